"""Agentic rollouts (glm_jax/rl/agentic.py) and the GRPO trainer on environments: advantages by group id against
hand-computed values and losses.group_advantages; the batch layout against the trajectories; an environment and a
fan-out rollout function loaded by module path from a temporary package, refused by name when they do not import,
and a GRPO run through them whose logged rewards are the ones the plugin recorded."""

import json
import os
import sys
import textwrap

import ml_collections
import numpy as np
import pytest

from glm_jax.data import default_data_config, load_tokenizer
from glm_jax.rl import agentic, losses
from glm_jax.rl.config import validate_rl_config
from glm_jax.rl.trajectory import Trajectory


def test_advantages_by_group_id_by_hand():
  rewards = np.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
  groups = np.asarray([0, 0, 0, 1, 1, 2])
  adv = agentic.group_advantages_by_id(rewards, groups)
  g0 = (np.asarray([1.0, 0, 0]) - 1 / 3) / (np.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2) + losses.STD_EPS)
  np.testing.assert_allclose(adv, [*g0, 0.0, 0.0, 0.0], rtol=1e-6)  # equal rewards: 0; a group of one: 0
  consecutive = np.random.default_rng(0).random(12)
  np.testing.assert_allclose(
    agentic.group_advantages_by_id(consecutive, np.repeat(np.arange(3), 4)),
    np.asarray(losses.group_advantages(consecutive, 4)),
    rtol=1e-5,
  )


def test_samples_lay_out_as_the_trajectories(data_cache_dir):
  cfg = default_data_config()
  cfg.cache_dir = data_cache_dir
  tok = load_tokenizer(cfg)
  samples = []
  for i, text in enumerate(["a</think>b<|endoftext|>", "longer answer</think>here<|endoftext|>"]):
    traj = Trajectory(tok, [{"role": "user", "content": f"q{i}"}])
    ids = tok.encode_chat(text)
    traj.add_sample(ids, np.linspace(-1, 0, len(ids)))
    samples.append(agentic.Sample(traj, float(i), 7, "lbl", {"n": i}, "stop"))
  rollout = agentic.to_rollout(samples, version=3, width=40, pad_id=tok.pad_id)
  for i, s in enumerate(samples):
    n = len(s.trajectory.tokens)
    assert rollout.tokens[i, :n].tolist() == s.trajectory.tokens and (rollout.tokens[i, n:] == tok.pad_id).all()
    assert rollout.response_mask[i].tolist() == [bool(m) for m in s.trajectory.loss_mask] + [False] * (40 - n)
    np.testing.assert_allclose(rollout.rollout_logp[i, :n], s.trajectory.logprobs)
    assert rollout.prompt_lens[i] == s.trajectory.spans[0].end and rollout.lengths[i] == n
  assert rollout.groups.tolist() == [7, 7] and rollout.rewards.tolist() == [0.0, 1.0] and rollout.version == 3
  assert rollout.problems == [("lbl", {"n": 0}), ("lbl", {"n": 1})] and rollout.finished.all()


PLUGIN_ENVS = '''
import numpy as np
from glm_jax.rl.environment import StepResult


class Echo:
  """Asks for a word; reward: the share of the word's letters the reply starts with."""

  name = "echo"

  def __init__(self, word="amen"):
    self.word = word

  def sample(self, rng, n):
    return [{"question": f"Say {self.word}", "answer": self.word} for _ in range(n)]

  def reset(self, task):
    return _Episode(task)

  def demonstration(self, task):
    return [{"role": "user", "content": task["question"]}, {"role": "assistant", "content": task["answer"]}]


class _Episode:
  def __init__(self, task):
    self.task, self.tools = task, None
    self.messages = [{"role": "user", "content": task["question"]}]

  def step(self, turn):
    word, reply = self.task["answer"], turn["content"]
    same = next((i for i, (a, b) in enumerate(zip(word, reply)) if a != b), min(len(word), len(reply)))
    return StepResult([], True, same / len(word))
'''

PLUGIN_ROLLOUT = '''
import json
import os

from glm_jax.rl import agentic


def fan_out(ctx, prompts, key):
  """default_rollout, then (a verifier's branch) group_size more episodes of the prompt whose answers scored lowest
  (the first of equals), in that prompt's group: the groups differ in size; every sample's (group, reward) recorded
  in $RECORD."""
  samples = agentic.default_rollout(ctx, prompts, key)
  g = min(range(len(prompts)), key=lambda g: sum(s.reward for s in samples if s.group == g))
  result = ctx.run_episodes([prompts[g]] * ctx.group_size, key)
  for traj, reward, finish in zip(result.trajectories, result.rewards, result.finish):
    samples.append(agentic.Sample(traj, reward, g, prompts[g][0], prompts[g][1], finish, {"branch": True}))
  with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps([[s.group, s.reward] for s in samples]) + "\\n")
  return samples


def recording(ctx, prompts, key):
  """default_rollout, each sample's label, tokens, loss mask and sampler log-probs recorded in $RECORD."""
  samples = agentic.default_rollout(ctx, prompts, key)
  rows = [(s.label, s.trajectory.tokens, s.trajectory.loss_mask, s.trajectory.logprobs) for s in samples]
  with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(rows) + "\\n")
  return samples
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
  pkg = tmp_path / "plugins" / "my_agents"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "envs.py").write_text(textwrap.dedent(PLUGIN_ENVS))
  (pkg / "rollouts.py").write_text(textwrap.dedent(PLUGIN_ROLLOUT))
  monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
  monkeypatch.setenv("RECORD", str(tmp_path / "record.jsonl"))
  yield tmp_path
  for name in [m for m in sys.modules if m.startswith("my_agents")]:
    del sys.modules[name]


def plugin_config(cache_dir):
  from glm_jax.configs import agent_tiny

  config = agent_tiny.get_config("smoke")
  config.data.cache_dir = cache_dir
  config.tasks = ml_collections.ConfigDict({"echo": {"weight": 1.0, "task": "my_agents.envs:Echo", "word": "amen"}})
  config.rl.rollout_fn = "my_agents.rollouts:fan_out"
  config.rl.cache_len, config.rl.max_turn_tokens, config.rl.max_turns = 48, 6, 1
  config.sft.steps = 0
  return config


def test_plugins_by_module_path_are_checked_before_any_rollout(plugin, data_cache_dir):
  config = plugin_config(data_cache_dir)
  validate_rl_config(config)
  for field, value, match in [
    ("rl.rollout_fn", "my_agents.rollouts:missing", r"rl\.rollout_fn='my_agents\.rollouts:missing'.*no attribute"),
    ("rl.rollout_fn", "nowhere.mod:fn", r"rl\.rollout_fn='nowhere\.mod:fn'.*does not import"),
    ("tasks.echo.task", "my_agents.envs:Nope", r"tasks\.echo: .*has no attribute 'Nope'"),
    ("rl.tool_timeout", 0.0, r"rl\.tool_timeout=0\.0 is invalid; must be a finite number of seconds > 0"),
    ("rl.speculate", 1, r"rl\.speculate=1.*not with rl\.tokenizer='model'"),
  ]:
    bad = plugin_config(data_cache_dir)
    section, _, name = field.rpartition(".")
    bad_section = bad
    for part in section.split("."):
      bad_section = bad_section[part]
    bad_section[name] = value
    with pytest.raises(ValueError, match=match):
      validate_rl_config(bad)


@pytest.mark.slow  # a GRPO run: the agent loop and the RL step compiled
def test_grpo_through_a_plugin_rollout_logs_its_rewards(plugin, data_cache_dir):
  from glm_jax.rl import trainer

  config = plugin_config(data_cache_dir)
  summary = trainer.run(config, str(plugin / "run"))
  recorded = [json.loads(line) for line in open(plugin / "record.jsonl")]
  assert len(recorded) == config.rl.steps
  rows = [json.loads(line) for line in open(plugin / "run" / "metrics.jsonl")]
  logged = {r["step"]: r for r in rows if "reward_mean" in r}
  for step, samples in enumerate(recorded, start=1):
    rewards = [r for _, r in samples]
    assert logged[step]["reward_mean"] == pytest.approx(np.mean(rewards), abs=1e-6)
    groups = sorted({g for g, _ in samples})
    assert groups == list(range(config.rl.prompts_per_step))  # fan-out samples joined their prompt's group
    assert len(samples) == (config.rl.prompts_per_step + 1) * config.rl.group_size  # and the one branch
  assert summary["step"] == config.rl.steps and 0.0 <= summary["eval_accuracy"] <= 1.0


@pytest.mark.parametrize("rollouts", ["in_process", "rollout_server"])
@pytest.mark.slow  # a distillation run: the agent loop, the teachers' scorer and the distillation step compiled
def test_distillation_on_environments_scores_each_episode_by_its_teacher(plugin, data_cache_dir, rollouts):
  """Two teachers, each an Echo environment and a model of its own seed (no fine-tuning): each step's logged
  teacher_kl/<name> equals the KL recomputed here from the recorded episodes, the teacher's log-probs by a plain
  forward pass of a model built from its seed, on the model's turns only (the loss mask). "rollout_server": the
  student's episodes through a serving engine's API (glm_jax/rl/rollout_server.py: an engine process behind the
  router, the step's weights pushed to it before each rollout, each turn a POST /generate)."""
  import jax
  from flax import nnx

  from glm_jax.configs import distill_tiny
  from glm_jax.model import GlmMoeDsa, ModelConfig
  from glm_jax.rl import trainer

  config = plugin_config(data_cache_dir)
  config.trainer = "distill"
  config.teachers = ml_collections.ConfigDict()
  for name, word, seed in [("amen", "amen", 7), ("selah", "selah", 8)]:
    config.teachers[name] = distill_tiny.teacher("my_agents.envs:Echo", 1.0, seed=seed, word=word)
    config.teachers[name].sft_steps = 0
  del config["tasks"]
  config.rl.rollout_fn = "my_agents.rollouts:recording"
  config.rl.group_size, config.rl.prompts_per_step, config.rl.steps = 1, 4, 2
  config.rl.rollout_server = rollouts == "rollout_server"
  validate_rl_config(config)
  trainer.run(config, str(plugin / "run"))

  model_cfg = ModelConfig.from_dict(config.model)
  teachers = {n: GlmMoeDsa(model_cfg, nnx.Rngs(config.teachers[n].seed)) for n in config.teachers}
  recorded = [json.loads(line) for line in open(plugin / "record.jsonl")]
  logged = {r["step"]: r for r in (json.loads(line) for line in open(plugin / "run" / "metrics.jsonl"))}
  assert len(recorded) == config.rl.steps
  seen = set()
  for step, samples in enumerate(recorded, start=1):
    for name, model in teachers.items():
      rows = [(tokens, mask, logp) for label, tokens, mask, logp in samples if label == name]
      gaps = []
      for tokens, mask, logp in rows:
        logits = np.asarray(model(np.asarray([tokens]), compute_mtp=False).logits[0], np.float64)
        teacher = np.asarray(jax.nn.log_softmax(logits / config.rl.temperature, axis=-1))
        for t in np.flatnonzero(mask):  # token t is scored by the logits at t - 1
          gaps.append(logp[t] - teacher[t - 1, tokens[t]])
      expected = float(np.mean(gaps)) if gaps else 0.0
      assert logged[step][f"teacher_kl/{name}"] == pytest.approx(expected, abs=2e-4), (step, name)
      seen |= {name} if rows else set()
  assert seen == set(teachers)  # both teachers' environments were played
  # through the engines: each step's weights were written for them (the last two kept)
  assert (rollouts == "rollout_server") == os.path.isdir(plugin / "run" / "rollout" / "weights" / "1")


@pytest.mark.slow  # async GRPO with a rollout worker process (its imports and compiles)
def test_async_grpo_with_a_rollout_process_plays_the_plugin(plugin, data_cache_dir, monkeypatch):
  """The worker process loads the plugin's environment and rollout function by module path and runs the episodes;
  each logged step's reward mean is that of the rollout (by its index) the plugin recorded in the worker."""
  from glm_jax.rl import trainer

  path = [str(plugin / "plugins"), os.environ.get("PYTHONPATH")]
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))  # the worker process imports the plugin
  config = plugin_config(data_cache_dir)
  config.rl.async_rollouts = config.rl.rollout_process = True
  config.rl.max_pending, config.rl.tau = 1, config.rl.steps  # no rollout is too stale to train on
  summary = trainer.run(config, str(plugin / "run"))
  recorded = [json.loads(line) for line in open(plugin / "record.jsonl")]  # in the worker's order: by index
  rows = [json.loads(line) for line in open(plugin / "run" / "metrics.jsonl")]
  trained = [r for r in rows if "reward_mean" in r]
  assert [r["step"] for r in trained] == list(range(1, config.rl.steps + 1)) and summary["dropped_stale"] == 0
  for row in trained:
    rewards = [r for _, r in recorded[row["rollout_index"]]]
    assert row["reward_mean"] == pytest.approx(np.mean(rewards), abs=1e-6)
  assert summary["workers_replaced"] == 0 and os.path.exists(plugin / "run" / "rollout" / "tokenizer.json")


def test_tokens_outside_the_models_turns_get_no_gradient(data_cache_dir):
  """GRPO's loss on an agentic batch: d loss / d logp is exactly 0 on the prompt, the tool results and the padding
  (loss mask 0), and not on the model's own tokens."""
  import jax
  import jax.numpy as jnp

  cfg = default_data_config()
  cfg.cache_dir = data_cache_dir
  tok = load_tokenizer(cfg)
  samples = []
  for i in range(2):
    traj = Trajectory(tok, [{"role": "user", "content": f"What is {i}+1?"}])
    first = tok.encode_chat(
      "Add.</think><tool_call>calc<arg_key>x</arg_key><arg_value>1</arg_value></tool_call><|observation|>"
    )
    traj.add_sample(first, [-0.3] * len(first))
    traj.add_observation([{"role": "tool", "content": str(i + 1)}])
    last = tok.encode_chat(f"So.</think>{i + 1}<|endoftext|>")
    traj.add_sample(last, [-0.2] * len(last))
    samples.append(agentic.Sample(traj, float(i), 0, "calc", {}, "stop"))
  rollout = agentic.to_rollout(samples, 0, 96, tok.pad_id)
  adv = agentic.group_advantages_by_id(rollout.rewards, rollout.groups)
  logp0 = jnp.asarray(rollout.rollout_logp) - 0.01 * jnp.arange(96)[None] / 96  # a policy near the sampler's

  def loss(logp):
    return losses.grpo_loss(
      logp, jax.lax.stop_gradient(logp), jnp.asarray(rollout.rollout_logp), adv, jnp.asarray(rollout.response_mask)
    )[0]

  grad = np.asarray(jax.grad(loss)(logp0))
  mask = rollout.response_mask
  assert (grad[~mask] == 0).all()
  assert (grad[mask] != 0).all() and mask.sum() == sum(sum(s.trajectory.loss_mask) for s in samples)
  obs = samples[0].trajectory.spans[2]
  assert obs.kind == "observation" and not mask[0, obs.start : obs.end].any()
