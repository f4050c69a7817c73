"""What one post-training run shares, in two stages: `RunSetup`, fixed before the policy is warm-started (what the
warm start and the teachers read), and `RunContext`, the setup plus what the loops sample, score and log with.
The loops take a RunContext beside the TrainState and the step they start from.

Two stages because `run` builds the samplers, the reward function and the metrics writer after the warm start
(a run that fails while warm-starting leaves no metrics file in its workdir).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax

from glm_jax.data.tokenizer import Tokenizer
from glm_jax.inference.sampler import Sampler
from glm_jax.model import ModelConfig
from glm_jax.model.quantization import pack_params
from glm_jax.rl.rewards import RewardFn
from glm_jax.rl.tasks import CharVocab, Problem, Task
from glm_jax.train.checkpoint import Checkpointer
from glm_jax.train.guards import ConsecutiveSkips
from glm_jax.train.lifecycle import StopSignals
from glm_jax.train.metrics import MetricsWriter
from glm_jax.train.progress import Progress


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSetup:
  """The run's config and workdir, its policy's model and optimizer, its task mix and its checkpoints."""

  config: ml_collections.ConfigDict
  workdir: str
  model_cfg: ModelConfig  # the policy's architecture
  vocab: CharVocab | Tokenizer  # the character vocabulary, or with rl.tokenizer="model" the model's tokenizer
  tasks_and_weights: list[tuple[Task, float]]  # the prompts' mix (glm_jax/rl/config.py's task_mix); [] when agentic
  graphdef: Any  # the policy's
  optimizer: optax.GradientTransformation  # the RL optimizer (the fine-tuning has its own, config.sft.optimizer)
  schedule: Callable[[Any], Any]  # its learning rate by step
  checkpointer: Checkpointer  # <workdir>'s checkpoints
  # The compiled fine-tuning steps (glm_jax/rl/warm_start.py's sft_step), owned by the run: the student and the
  # teachers of one architecture share one compilation.
  sft_steps: dict = dataclasses.field(default_factory=dict)
  # config.quant's plan for the policy ({} without QAT): the updates fake-quantize these weights and the rollouts
  # sample from them packed, by the one quantizer, so both see the same weights.
  quant_plan: dict = dataclasses.field(default_factory=dict)
  _pack: dict = dataclasses.field(default_factory=dict, repr=False)  # the compiled packing, made on first use
  # rl.tokenizer="model": the tasks section's [(label, environment, weight)] (glm_jax/rl/config.py environment_mix)
  environments: list[tuple[str, Any, float]] = dataclasses.field(default_factory=list)

  def served(self, params: Any) -> Any:
    """The policy's weights as the rollouts and evaluations sample from them: packed under the quant plan."""
    if not self.quant_plan:
      return params
    if "fn" not in self._pack:
      self._pack["fn"] = jax.jit(lambda p: pack_params(p, self.quant_plan))
    return self._pack["fn"](params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunContext(RunSetup):
  """The setup plus the samplers, the reward, the held-out problems and the metrics writer."""

  reward_fn: RewardFn | None  # None when agentic: the environments score
  sampler: Sampler | Any  # the rollouts' (rl.temperature, rl.top_p, rl.rollout_dtype); when agentic an AgentLoop
  greedy: Sampler | Any  # eval_accuracy's
  eval_problems: list[Problem] | list[tuple[str, dict]]  # answered greedily for eval_accuracy; (label, task) agentic
  writer: MetricsWriter
  progress: Progress  # the lines on stdout and the progress bar (glm_jax/train/progress.py)
  skips: ConsecutiveSkips  # stops the run after rl.max_consecutive_skips skipped updates in a row
  stop: StopSignals  # a preemption or Ctrl-C: a checkpoint at the next update, then Stopped
  rollout_fn: Callable | None = None  # agentic: rl.rollout_fn (glm_jax/rl/agentic.py)
  # eval_accuracy by the policy's step: the last step's, logged, is also the summary's
  eval_accuracy: dict[int, float] = dataclasses.field(default_factory=dict)

  @classmethod
  def after_warm_start(cls, setup: RunSetup, **loop_fields) -> RunContext:
    """The context of `setup` with the fields the loops add (not copies: the same checkpointer and caches)."""
    return cls(**{f.name: getattr(setup, f.name) for f in dataclasses.fields(setup)}, **loop_fields)
