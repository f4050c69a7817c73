"""The post-training loops end to end on CPU: GRPO raises the expected reward, the asynchronous path drops stale
rollouts and survives a failing reward function, distillation lowers the student's KL to its teachers, and bad
configs fail before any work."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import glm_jax.configs.distill_tiny
import glm_jax.configs.grpo_tiny
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.rl import rewards as rewards_lib
from glm_jax.rl import tasks as tasks_lib
from glm_jax.rl import trainer as rl_trainer
from glm_jax.rl import warm_start
from glm_jax.rl.rollout import make_sampler
from glm_jax.train.checkpoint import Checkpointer
from tests.shared_runs import shared_run

# the GRPO and distillation loops end to end; the notebooks run the same programs (tests/test_notebooks.py)

# rl.rollout_max_running of the runs through the serving engines: on a CPU an engine with 16 slots spends less per
# sampled token than with the default 64, and each sample draws with its own seed, so the rollouts are the same.
ENGINE_ROWS = 16

ALL_SUMS = [tasks_lib.AdditionTask(digits=1)._problem(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def quiet(config, **rl):
  config.rl.tensorboard = False
  config.rl.update(rl)
  return config


def demonstrations(problems, task):
  """[n, L] tokens of prompt + answer + eos and the mask of the answer + eos positions."""
  demos = [task.demonstration(p) for p in problems]
  tokens = np.zeros((len(demos), max(map(len, demos))), np.int32)
  mask = np.zeros(tokens.shape, bool)
  for i, (p, d) in enumerate(zip(problems, demos)):
    tokens[i, : len(d)] = d
    mask[i, len(p.prompt_ids) : len(d)] = True
  return jnp.asarray(tokens), jnp.asarray(mask)


def answer_logprobs(cfg, params, rest, tokens):
  """log p of each token given the ones before it, from the model's logits: [n, L] (0 at position 0)."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))))  # the structure; no weights made
  logits = nnx.merge(graphdef, params, rest)(tokens, compute_mtp=False).logits[:, :-1]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  rows, prev = np.arange(tokens.shape[0])[:, None], np.arange(tokens.shape[1] - 1)[None]
  return jnp.pad(logp[rows, prev, tokens[:, 1:]], [(0, 0), (1, 0)]), logp


@pytest.fixture(scope="module")
def grpo_warm_start(tmp_path_factory):
  """grpo_tiny's warm start, its config.sft.steps of fine-tuning as a run makes it (<run>/init), made once for the
  session: the GRPO runs below start from it (rl.init_from) instead of each fine-tuning again, the same weights
  (the same steps on the same batches, from the same seed)."""

  def make(directory):
    setup, state = rl_trainer._setup(quiet(glm_jax.configs.grpo_tiny.get_config()), directory)
    warm_start.warm_start(setup, state)
    setup.checkpointer.close()

  return os.path.join(shared_run(tmp_path_factory, "grpo_tiny_sft", make), "init")


def policy_weights(workdir, config, which):
  """(params, rest) of the warm start ("init") or the latest RL checkpoint ("final")."""
  cfg = ModelConfig.from_dict(config.model)
  _, state, _, _ = warm_start.make_policy(cfg, config.optimizer, 0, True)
  if which == "init":
    return warm_start.reference_policy(workdir, state)
  with Checkpointer(workdir, read_only=True) as ckpt:
    state = ckpt.restore(ckpt.latest_step(), state)
  return state.params, state.rest


def uncommitted(tree):
  """Copies of a pytree's arrays that are not committed to a device, as a run's weights are (jitted updates of
  freshly initialized ones): restored arrays are committed, and a program compiled for one kind of argument is
  compiled again for the other."""
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), tree)


@pytest.mark.parametrize("engine", ["in_process", "rollout_process", "rollout_server"])
@pytest.mark.slow
def test_grpo_raises_expected_reward(tmp_path, engine, grpo_warm_start):
  """grpo_tiny as shipped (1-digit addition, DSA selecting 4 keys, frozen indexer, IcePop), 30 GRPO steps after
  its 60-step SFT (the session's one: grpo_warm_start). The measure is exact, not sampled: the probability of
  answering each of the 100 problems correctly, p(answer, eos | prompt) at temperature 1, averaged. Measured over
  seeds 0, 1, 2: 0.106 -> 0.171, 0.119 -> 0.186, 0.100 -> 0.161, gains of 0.061 to 0.068; the 0.04 asserted
  here is ten times the spread of the gains over seeds below their smallest. "rollout_process": the same run with
  its rollouts from a worker process over localhost (glm_jax/rl/rollout_engine.py; asynchronous, tau 1) gains as
  much; "rollout_server": its rollouts through the serving engines' HTTP API behind SGLang's router
  (glm_jax/rl/rollout_server.py; two engines, the step's weights pushed through /update_weights before each rollout)
  too. (Asynchronous through the engines, which rollouts are dropped as stale depends on the machine's timing: one
  fresh-clone run gained 0.034, so the learning test runs them synchronously.)"""
  config = quiet(glm_jax.configs.grpo_tiny.get_config(), steps=30, eval_every=1000, checkpoint_every=1000)
  config.rl.init_from = grpo_warm_start
  if engine == "rollout_process":
    config.rl.update(async_rollouts=True, rollout_process=True, tau=1)
  if engine == "rollout_server":
    config.rl.update(rollout_server=True, rollout_engines=2, rollout_max_running=ENGINE_ROWS)
  summary = rl_trainer.run(config, str(tmp_path))
  assert summary["step"] == 30
  cfg = ModelConfig.from_dict(config.model)
  tokens, mask = demonstrations(ALL_SUMS, tasks_lib.AdditionTask(digits=1))
  expected = {}
  for which in ("init", "final"):
    logp, _ = answer_logprobs(cfg, *policy_weights(str(tmp_path), config, which), tokens)
    expected[which] = float(jnp.mean(jnp.exp(jnp.sum(jnp.where(mask, logp, 0.0), axis=1))))
  print("p(correct answer)", expected)
  assert expected["final"] > expected["init"] + 0.04, expected
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
  assert len(rewards) == 30 and np.mean(rewards[-5:]) > np.mean(rewards[:5])
  for key in ("reward_std", "icepop_drop_frac", "clip_frac", "mismatch_kl", "response_len_mean", "grad_norm"):
    assert key in rows[-1]


@pytest.mark.slow
def test_async_drops_stale_rollouts_and_survives_failing_rewards(tmp_path, monkeypatch):
  """A worker that runs ahead (the first update includes compiling the step, while it queues two more batches)
  with tau = 0: every rollout made with older weights than the trainer's is dropped, none is trained on. A
  reward function that raises on some samples and returns NaN on others gives them 0 (logged, counted), and
  the weights stay finite."""

  def flaky(vocab):
    exact = rewards_lib.exact_match(vocab)

    def reward(problem, response):
      if problem.prompt.startswith("3"):
        raise RuntimeError("grader crashed")
      if problem.prompt.startswith("4"):
        return float("nan")
      return exact(problem, response)

    return reward

  monkeypatch.setitem(rewards_lib.REWARD_FNS, "flaky", flaky)
  config = glm_jax.configs.grpo_tiny.get_config()
  config.sft.steps = 0
  quiet(
    config,
    steps=4,
    async_rollouts=True,
    objective="async",
    tau=0,
    max_pending=2,
    reward="flaky",
    prompts_per_step=8,
    group_size=4,
    eval_prompts=8,
    eval_every=1000,
    checkpoint_every=1000,
  )
  summary = rl_trainer.run(config, str(tmp_path))
  assert summary["step"] == 4 and summary["dropped_stale"] >= 2
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "reward_mean" in line]
  assert [r["staleness"] for r in rows] == [0, 0, 0, 0]
  assert sum(r["reward_failures"] for r in rows) > 0
  assert rows[-1]["dropped_stale"] == summary["dropped_stale"]
  params, _ = policy_weights(str(tmp_path), config, "final")
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))  # (numpy: no program per shape)


@pytest.mark.slow
def test_distillation_lowers_kl_to_teachers(tmp_path):
  """distill_tiny with short teacher fine-tunes, 20 steps. The measure is what on-policy distillation minimizes,
  computed exactly per token: on 512 answers the student samples (fixed prompts and keys; in batches of the run's
  prompts_per_step, the run's compiled sampler) before and after,
  sum_v p_s(v) (log p_s(v) - log p_t(v)) at each answer position, over the whole vocabulary, with each prompt's
  own teacher; averaged over answer tokens."""
  config = quiet(
    glm_jax.configs.distill_tiny.get_config(),
    steps=20,
    prompts_per_step=32,
    eval_prompts=8,
    eval_every=1000,
    checkpoint_every=1000,
  )
  for t in config.teachers.values():
    t.sft_steps = 40
  rl_trainer.run(config, str(tmp_path))
  cfg = ModelConfig.from_dict(config.model)
  names = list(config.teachers.keys())
  tasks = [
    (tasks_lib.make_task(config.teachers[n].task, **config.teachers[n].task_kwargs.to_dict()), 1.0) for n in names
  ]
  problems = tasks_lib.mixed_prompts(tasks, np.random.default_rng(3), 512)
  graphdef, state, _, _ = warm_start.make_policy(cfg, config.optimizer, 0, False)
  teachers = []
  for n in names:
    with Checkpointer(os.path.join(tmp_path, "teachers", n), read_only=True) as ckpt:
      teachers.append(uncommitted(ckpt.restore_weights(ckpt.latest_step(), state.params, state.rest)))
  sampler = make_sampler(graphdef, cfg, config.rl, tasks, tasks_lib.CharVocab())
  rows_per_call = config.rl.prompts_per_step  # the run's rollout batch: its sampling program, already compiled
  key = jax.random.key(7)
  kls = {}
  for which in ("init", "final"):
    student = uncommitted(policy_weights(str(tmp_path), config, which))  # the run's sampler program serves it
    outs = [
      sampler(*student, [p.prompt_ids for p in problems[i : i + rows_per_call]], jax.random.fold_in(key, i))
      for i in range(0, len(problems), rows_per_call)
    ]
    tokens = jnp.concatenate([o.tokens for o in outs])
    mask = jnp.concatenate([o.response_mask for o in outs])[:, 1:]  # the logits at t - 1 predict token t
    _, logp_s = answer_logprobs(cfg, *student, tokens)
    total, count = 0.0, 0.0
    for k in range(len(names)):
      rows = np.asarray([p.task == tasks[k][0].name for p in problems])[:, None] & np.asarray(mask)
      _, logp_t = answer_logprobs(cfg, *teachers[k], tokens)
      kl = jnp.sum(jnp.exp(logp_s) * (logp_s - logp_t), -1)
      total += float(jnp.sum(jnp.where(rows, kl, 0.0)))
      count += float(rows.sum())
    kls[which] = total / count
  print("KL(student || teacher) per token", kls)
  assert kls["final"] < 0.9 * kls["init"], kls


def test_bad_configs(tmp_path):
  config = glm_jax.configs.distill_tiny.get_config()
  config.teachers.sort.model = ml_collections.ConfigDict({"vocab_size": 64})
  config.sft.steps = 0
  with pytest.raises(ValueError, match="teachers.sort: vocab_size 64 differs from the student's model.vocab_size 32"):
    rl_trainer.run(quiet(config), str(tmp_path / "a"))
  config = glm_jax.configs.grpo_tiny.get_config()
  config.model.vocab_size = 10
  with pytest.raises(ValueError, match="model vocab_size=10 is smaller than the task vocabulary.s 18 ids"):
    rl_trainer.run(quiet(config), str(tmp_path / "b"))
  assert not os.path.exists(tmp_path / "b" / "checkpoints")
  config = glm_jax.configs.grpo_tiny.get_config()
  config.tasks.addition.weight = -1.0
  with pytest.raises(ValueError, match="weights must be finite and non-negative"):
    rl_trainer.run(quiet(config), str(tmp_path / "c"))
  config = glm_jax.configs.distill_tiny.get_config()
  with pytest.raises(ValueError, match="rl.group_size=8 is invalid; on-policy distillation samples one answer"):
    rl_trainer.run(quiet(config, group_size=8), str(tmp_path / "d"))


@pytest.mark.slow
def test_quantization_aware_grpo_samples_from_the_packed_weights(tmp_path):
  """GRPO with config.quant (per-row INT4 on the routed experts and the attention): the rollouts sample from the
  packed weights and the updates fake-quantize the same weights, so the rollout log-probs are the training
  forward's: the logged mismatch KL stays at fp32 rounding, where the unquantized weights' log-probs differ from
  the packed ones' by far more. The final weights stay unquantized (fp32) in the checkpoint."""
  from glm_jax.model import quantization as Q

  config = glm_jax.configs.grpo_tiny.get_config()
  config.sft.steps = 0
  config.quant = Q.default_quant_config()
  config.quant.update(scheme="int4_row", scope="routed_experts,attention")
  quiet(config, steps=3, prompts_per_step=8, group_size=4, eval_prompts=8, eval_every=1000, checkpoint_every=1000)
  rl_trainer.run(config, str(tmp_path))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "mismatch_kl" in line]
  assert len(rows) == 3 and max(abs(r["mismatch_kl"]) for r in rows) < 1e-6, [r["mismatch_kl"] for r in rows]
  params, rest = policy_weights(str(tmp_path), config, "final")
  plan = Q.quant_plan(params, config.quant)
  cfg = ModelConfig.from_dict(config.model)
  tokens, _ = demonstrations(ALL_SUMS[:16], tasks_lib.AdditionTask(digits=1))
  _, logp_fp32 = answer_logprobs(cfg, params, rest, tokens)
  # packed as the run packs them for its rollouts (RunContext.served: one jitted program, the run's when alike)
  packed = jax.jit(lambda p: Q.pack_params(p, plan))(uncommitted(params))
  _, logp_packed = answer_logprobs(cfg, packed, rest, tokens)
  kl = float(jnp.mean(jnp.sum(jnp.exp(logp_packed) * (logp_packed - logp_fp32), -1)))
  assert kl > 1e-4, kl  # without the packing the rollouts would be off by this much
  assert all(np.asarray(x).dtype == np.float32 for x in jax.tree.leaves(params))


@pytest.mark.slow  # two engine processes behind the router, 5 GRPO steps
def test_async_grpo_through_the_engines_trains_on_rollouts_within_tau(tmp_path, grpo_warm_start):
  """Asynchronous GRPO through the serving engines (rollouts made ahead by the worker's thread while new weights are
  pushed to the engines): every step trains on a rollout at most rl.tau versions behind the weights it updates, in
  the order the worker made them, and the rollouts dropped as stale are counted. The batches are the learning test's
  (its compiled programs serve these); 5 steps: past the rl.max_pending rollouts queued with the first weights, the
  rollouts come while new weights reach the engines."""
  steps = 5
  config = quiet(glm_jax.configs.grpo_tiny.get_config(), steps=steps, eval_every=1000, checkpoint_every=1000)
  config.rl.update(async_rollouts=True, rollout_server=True, rollout_engines=2, tau=1, init_from=grpo_warm_start)
  config.rl.rollout_max_running = ENGINE_ROWS
  summary = rl_trainer.run(config, str(tmp_path))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  trained = [r for r in rows if "reward_mean" in r]
  assert [r["step"] for r in trained] == list(range(1, steps + 1)) and summary["step"] == steps
  assert all(0 <= r["staleness"] <= 1 for r in trained)
  indices = [r["rollout_index"] for r in trained]
  assert indices == sorted(set(indices)) and indices[-1] - indices[0] + 1 == steps + summary["dropped_stale"]
