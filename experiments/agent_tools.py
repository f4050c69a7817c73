r"""Agentic post-training with tools, measured: a pretrained glm5_tiny, then agentic SFT, then GRPO on the two tool
environments (configs/agent_tiny.py: calculator, verse_lookup), each policy evaluated greedily on held-out tasks of each
environment with its tool and without it; tool-call validity, mean turns; the agent loop's sampled tokens/s continuing
on the KV cache against re-prefilling every turn; reward curves.

  bash scripts/with_env.sh python launch/train.py --config=configs/glm5_tiny.py \
      --workdir=runs/base  # the base (the main job)
  bash scripts/with_env.sh python experiments/agent_tools.py --base=runs/base --out=runs/agent

Trains <out>/run with launch/train.py's trainer (rl.init_from=--base: SFT on the environments' scripted
demonstrations, kept in <out>/run/init, then GRPO), unless <out>/run is complete. Prints a markdown table; writes
--results (<out>/results.json) and --figure (<out>/agent_tools.png); experiments/reproduce.py runs it a seed
into the committed figure and numbers.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from glm_jax.configs import agent_tiny  # noqa: E402
from glm_jax import cli, plots  # noqa: E402
from glm_jax.model import GlmMoeDsa, ModelConfig  # noqa: E402
from glm_jax.rl import agentic, environment, trainer  # noqa: E402
from glm_jax.rl.agent_loop import AgentLoop, AgentParams, describe  # noqa: E402
from glm_jax.train.checkpoint import Checkpointer  # noqa: E402

_BASE = flags.DEFINE_string("base", None, "A pretraining run of glm5_tiny (its checkpoint and tokenizer).")
_OUT = flags.DEFINE_string("out", None, "Where the agentic run goes (<out>/run).")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", None, "Agentic SFT steps (default: the config's).")
_RL_STEPS = flags.DEFINE_integer("rl_steps", None, "GRPO steps (default: the config's).")
_SEED = flags.DEFINE_integer("seed", 0, "rl.seed: the SFT's and GRPO's data and sampling.")
_EVAL_TASKS = flags.DEFINE_integer("eval_tasks", 64, "Held-out tasks an environment, answered greedily.")
_RESULTS = flags.DEFINE_string("results", "", "Where the figures go (JSON; default: <out>/results.json).")
_FIGURE = flags.DEFINE_string("figure", "", "The reward curves (default: <out>/agent_tools.png).")


def load_weights(workdir: str, cfg: ModelConfig):
  """(params, rest) of a workdir's latest checkpoint (a pretraining, SFT or RL one: the weights only)."""
  params, rest = nnx.split(GlmMoeDsa(cfg, nnx.Rngs(0)), nnx.Param, ...)[1:]
  with Checkpointer(workdir, read_only=True) as ckpt:
    _, (params, rest) = ckpt.restore_latest_weights(params, rest)
  return params, rest


def evaluate(loop, params, rest, tokenizer, label, env, tasks, rl) -> dict:
  """Greedy episodes of `tasks` in `env`: success rate, tool-call validity, mean turns, finish reasons, tokens/s."""
  with agentic.serving_tools([(label, env, 1.0)], rl):
    ctx = agentic.RolloutContext(loop, params, rest, {label: env}, tokenizer, 1, 0)
    result = ctx.run_episodes([(label, t) for t in tasks], jax.random.key(0))
  out = describe(result)
  out["success_rate"] = float(np.mean([r >= 1.0 for r in result.rewards]))
  return out


def speed(loop_cls_args, params, rest, tokenizer, label, env, tasks, rl) -> dict:
  """Sampled tokens/s of the same greedy episodes, continuing on the cache and re-prefilling every turn (each timed
  on a second run, after its compiles)."""
  out = {}
  for name, reprefill in (("kv_continuation", False), ("reprefill", True)):
    loop = AgentLoop(*loop_cls_args, reprefill=reprefill)
    with agentic.serving_tools([(label, env, 1.0)], rl):
      ctx = agentic.RolloutContext(loop, params, rest, {label: env}, tokenizer, 1, 0)
      ctx.run_episodes([(label, t) for t in tasks], jax.random.key(0))  # compiles
      t0 = time.perf_counter()
      result = ctx.run_episodes([(label, t) for t in tasks], jax.random.key(0))
      seconds = time.perf_counter() - t0
    out[name] = {
      "sampled_tokens": result.sampled_tokens,
      "seconds": seconds,
      "tokens_per_s": result.sampled_tokens / seconds,
    }
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _BASE.value or not _OUT.value:
    raise app.UsageError("--base and --out are required")
  config = agent_tiny.get_config()
  config.rl.init_from = _BASE.value
  config.rl.seed = _SEED.value
  if _SFT_STEPS.value is not None:
    config.sft.steps = _SFT_STEPS.value
    config.sft.optimizer.decay_steps = max(config.sft.steps - config.sft.optimizer.warmup_steps, 1)
  if _RL_STEPS.value is not None:
    config.rl.steps = _RL_STEPS.value
  run = os.path.join(_OUT.value, "run")
  t0 = time.perf_counter()
  summary = trainer.run(config, run)  # a complete run returns at once (its rows are kept)
  train_s = time.perf_counter() - t0
  rl = config.rl
  cfg = ModelConfig.from_dict(config.model)
  tokenizer = trainer.model_tokenizer(config)
  graphdef = nnx.graphdef(GlmMoeDsa(cfg, nnx.Rngs(0)))
  agent = AgentParams(max_turns=rl.max_turns, max_turn_tokens=rl.max_turn_tokens, cache_len=rl.cache_len, temperature=0)
  loop = AgentLoop(graphdef, cfg, tokenizer, agent)
  policies = {"base": _BASE.value, "sft": os.path.join(run, "init"), "grpo": run}
  rng = np.random.default_rng(2**20)
  table, results = [], {"summary": summary, "train_s": train_s, "eval": {}}
  for label, spec in config.tasks.items():
    kwargs = {k: v for k, v in spec.items() if k not in ("weight", "task")}
    tasks = environment.make_environment(label, **kwargs).sample(rng, _EVAL_TASKS.value)
    for policy, workdir in policies.items():
      params, rest = load_weights(workdir, cfg)
      for tools in (True, False):
        env = environment.make_environment(label, with_tools=tools, **kwargs)
        r = evaluate(loop, params, rest, tokenizer, label, env, tasks, rl)
        results["eval"][f"{label}/{policy}/{'tools' if tools else 'no_tools'}"] = r
        table.append((label, policy, tools, r))
  params, rest = load_weights(run, cfg)
  env = environment.make_environment(
    "calculator", **{k: v for k, v in config.tasks.calculator.items() if k != "weight"}
  )
  results["speed"] = speed(
    (graphdef, cfg, tokenizer, agent), params, rest, tokenizer, "calculator", env, tasks[:16], rl
  )

  metrics = ["success_rate", *(f"reward/{label}" for label in config.tasks), "mean_turns", "eval_accuracy"]
  fig = plots.curves({"grpo": run}, metrics, title="Agentic GRPO on glm5_tiny after agentic SFT (greedy eval: right)")
  plots.save(fig, _FIGURE.value or os.path.join(_OUT.value, "agent_tools.png"))
  results_path = _RESULTS.value or os.path.join(_OUT.value, "results.json")
  os.makedirs(os.path.dirname(results_path), exist_ok=True)
  with open(results_path, "w") as f:
    json.dump(results, f, indent=1)
  print("| environment | policy | tools | success | tool-call validity | mean turns | finish |")
  print("|---|---|---|---|---|---|---|")
  for label, policy, tools, r in table:
    validity = "-" if r["tool_call_validity"] is None else f"{r['tool_call_validity']:.2f}"
    print(
      f"| {label} | {policy} | {'yes' if tools else 'no'} | {r['success_rate']:.3f} | {validity} | "
      f"{r['mean_turns']:.2f} | {r['finish']} |"
    )
  s = results["speed"]
  print(
    f"\nagent loop, 16 greedy calculator episodes: {s['kv_continuation']['tokens_per_s']:.1f} sampled tokens/s "
    f"continuing on the cache, {s['reprefill']['tokens_per_s']:.1f} re-prefilling each turn; training {train_s:.0f} s"
  )


if __name__ == "__main__":
  cli.run(main)
