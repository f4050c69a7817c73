"""The entry points, absl apps: train, sweep, sample, serve, router, compile, convert, quantize, model_info, plot.

In a checkout launch/ links here (`bash scripts/with_env.sh python launch/train.py --config=configs/glm5_tiny.py`);
an installed glm-jax runs them as `python -m glm_jax.launch.train --config=configs/glm5_tiny.py` from any directory,
a configs/ path that is not there naming the installed config (glm_jax/cli.py).
"""
