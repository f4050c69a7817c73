"""A task and its reward from a module outside the library, named by import path in the config (rl.tasks' task
field, teachers.<name>.task, rl.reward): sampled, batched and rewarded through the trainer's own path, and bad
import paths rejected naming the field, the value and what is valid."""

from __future__ import annotations

import re
import sys
import textwrap
from types import SimpleNamespace

import ml_collections
import numpy as np
import pytest

import glm_jax.configs.distill_tiny
import glm_jax.configs.grpo_tiny
from glm_jax.rl.config import task_mix, validate_rl_config
from glm_jax.rl.rewards import make_reward_fn, score
from glm_jax.rl.rollout import step_rollout
from glm_jax.rl.tasks import AdditionTask, CharVocab, sft_batch

VOCAB = CharVocab()
MODULE = "glm_jax_test_plugin_tasks"  # written to tmp_path by the fixture, as a researcher's own my_tasks.py
PLUGIN = textwrap.dedent('''
  """The largest of `length` digits, ",3142=" -> "4", rewarded 1 - |answer - guess| / 10 for one digit and eos."""
  from glm_jax.rl.tasks import TaskBase

  NOT_CALLABLE = 3


  class LargestDigitTask(TaskBase):
    name = "largest"

    def __init__(self, length=4, vocab=None):
      super().__init__(vocab)
      self.length = length
      self.max_prompt_len = length + 2  # ",", the digits, "="
      self.max_answer_len = 2  # one digit, eos

    def sample(self, rng, n):
      rows = rng.integers(0, 10, size=(n, self.length)).tolist()
      return [self._problem("," + "".join(map(str, r)) + "=", str(max(r))) for r in rows]


  class NotATask:
    def __init__(self, **kwargs):
      pass


  def make_reward(vocab):
    def reward(problem, response):
      if len(response) < 2 or response[1] != vocab.eos_id:
        return 0.0
      return 1.0 - abs(int(problem.answer) - int(vocab.decode(response[:1]))) / 10

    return reward
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
  (tmp_path / f"{MODULE}.py").write_text(PLUGIN)
  monkeypatch.syspath_prepend(str(tmp_path))
  yield MODULE
  sys.modules.pop(MODULE, None)


def grpo_config(task: str = f"{MODULE}:LargestDigitTask", reward: str = f"{MODULE}:make_reward"):
  config = glm_jax.configs.grpo_tiny.get_config()
  config.tasks = ml_collections.ConfigDict({"largest": dict(weight=1.0, task=task, length=3)})
  config.rl.reward = reward
  config.rl.prompts_per_step = 6
  config.rl.group_size = 2
  return config


class FirstDigitSampler:
  """Stands in for the KV-cache sampler: answers each prompt with its first digit and eos, in the sampler's
  layout (prompt then response, right-padded)."""

  def __call__(self, params, rest, prompts, key):
    rows = [list(p) + [p[1], VOCAB.eos_id] for p in prompts]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
      tokens[i, : len(r)] = r
    prompt_lens = np.asarray([len(p) for p in prompts])
    return SimpleNamespace(
      tokens=tokens,
      response_mask=np.zeros(tokens.shape, bool),
      logp=np.zeros(tokens.shape, np.float32),
      prompt_lens=prompt_lens,
      lengths=prompt_lens + 2,
      finished=np.ones(len(rows), bool),
    )


def test_a_task_and_reward_of_ones_own_are_sampled_and_rewarded_through_the_config(plugin):
  config = grpo_config()
  validate_rl_config(config)
  ((task, weight),) = task_mix(config)
  assert (type(task).__name__, task.name, task.length, weight) == ("LargestDigitTask", "largest", 3, 1.0)
  reward_fn = make_reward_fn(config.rl.reward, VOCAB)

  # hand-computed: ",3142=" has answer "4"; a guess g then eos scores 1 - |4 - g| / 10, anything else 0
  problem = task._problem(",3142=", "4")
  responses = [[6, 1], [4, 1], [11, 1], [6], [1], [6, 6, 1]]  # "4"+eos, "2"+eos, "9"+eos, no eos, eos, "44"+eos
  rewards, failures = score(reward_fn, [problem] * 6, responses, list(range(6)))
  np.testing.assert_allclose(rewards, [1.0, 0.8, 0.5, 0.0, 0.0, 0.0], rtol=1e-6)
  assert failures == []

  # the trainer's rollout path: the step's problems from the task mix, the sampler, the reward
  rollout = step_rollout(FirstDigitSampler(), None, None, [(task, weight)], config.rl, reward_fn, 0, 0, 2)
  assert len(rollout.problems) == 12 and rollout.failures == []
  expected = []
  for p in rollout.problems:
    assert re.fullmatch(r",\d{3}=", p.prompt) and p.task == "largest"
    digits = [int(c) for c in p.prompt[1:-1]]
    assert p.answer == str(max(digits))
    expected.append(1.0 - (max(digits) - digits[0]) / 10)
  np.testing.assert_allclose(rollout.rewards, expected, rtol=1e-6)

  # the warm start's batches: prompt + answer + eos
  batch = sft_batch([(task, 1.0)], np.random.default_rng(1), batch_size=4, seq_len=7, vocab=VOCAB)
  for row in batch["input_ids"]:
    text = VOCAB.decode(row)
    assert re.fullmatch(r",\d{3}=\d", text) and text[-1] == max(text[1:4]) and row[6] == VOCAB.eos_id


def test_plugin_tasks_mix_with_built_in_ones_and_serve_as_teachers(plugin):
  config = grpo_config()
  config.tasks.addition = ml_collections.ConfigDict(dict(weight=3.0, digits=1))  # a built-in name, unchanged
  validate_rl_config(config)
  mix = {t.name: (type(t).__name__, w) for t, w in task_mix(config)}
  assert mix == {"addition": (AdditionTask.__name__, 3.0), "largest": ("LargestDigitTask", 1.0)}
  config = glm_jax.configs.distill_tiny.get_config()
  config.teachers.sort.task = f"{MODULE}:LargestDigitTask"
  config.teachers.sort.task_kwargs = ml_collections.ConfigDict(dict(length=3))
  validate_rl_config(config)
  assert [t.name for t, _ in task_mix(config)] == ["addition", "largest"]


VALID_TASKS = "valid: a registered name ['addition', 'reverse', 'sort'] or an import path 'package.module:TaskClass'"


@pytest.mark.parametrize(
  "task, problem",
  [
    ("no_such_module_for_glm_jax:Task", "module 'no_such_module_for_glm_jax' does not import (ModuleNotFoundError"),
    (f"{MODULE}:Missing", "has no attribute 'Missing'"),
    (f"{MODULE}:make_reward", "is <function make_reward at"),
    (f"{MODULE}:NotATask", "is not a Task (its instances lack ['name', 'vocab', 'max_prompt_len', 'max_answer_len'"),
    ("largest", "unknown task 'largest'"),
  ],
)
def test_a_bad_task_import_path_names_the_field_the_value_and_what_is_valid(plugin, task, problem):
  with pytest.raises(ValueError) as e:
    validate_rl_config(grpo_config(task=task))
  msg = str(e.value)
  assert msg.startswith("tasks.largest.task: make_task: ") and repr(task) in msg, msg
  assert problem in msg and VALID_TASKS in msg, msg
  config = glm_jax.configs.distill_tiny.get_config()
  config.teachers.sort.task = task
  with pytest.raises(ValueError, match=r"^teachers\.sort\.task: make_task: .*" + re.escape(VALID_TASKS)):
    validate_rl_config(config)


@pytest.mark.parametrize(
  "reward, problem",
  [
    ("no_such_module_for_glm_jax:make_reward", "module 'no_such_module_for_glm_jax' does not import"),
    (f"{MODULE}:NOT_CALLABLE", "is 3, which does not make a reward function"),
    (f"{MODULE}:LargestDigitTask", "cannot be called with the vocabulary"),
    ("f1", "unknown reward 'f1'"),
  ],
)
def test_a_bad_reward_import_path_names_the_field_the_value_and_what_is_valid(plugin, reward, problem):
  with pytest.raises(ValueError) as e:
    validate_rl_config(grpo_config(reward=reward))
  msg = str(e.value)
  assert msg.startswith(f"rl.reward={reward!r} is invalid; make_reward_fn: "), msg
  assert problem in msg and "valid: a registered name ['exact_match'] or an import path" in msg, msg
