"""Tests for glm_jax/rl/tasks.py and glm_jax/rl/rewards.py: vocab, tasks, SFT batches, prompt mixing, rewards."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from glm_jax.rl import rewards as rewards_lib
from glm_jax.rl.rewards import REWARD_FNS, exact_match, make_reward_fn, score
from glm_jax.rl.tasks import (
  AdditionTask,
  CharVocab,
  Problem,
  ReverseTask,
  SortTask,
  make_task,
  mixed_prompts,
  sft_batch,
)

VOCAB = CharVocab()
# Hand-written: pad 0, eos 1, then "0123456789+=-sr," from id 2.
EXPECTED_IDS = {
  "0": 2,
  "1": 3,
  "2": 4,
  "3": 5,
  "4": 6,
  "5": 7,
  "6": 8,
  "7": 9,
  "8": 10,
  "9": 11,
  "+": 12,
  "=": 13,
  "-": 14,
  "s": 15,
  "r": 16,
  ",": 17,
}


# ----------------------------------------------------------------------------------------------------- vocab


def test_vocab_ids_and_round_trip_of_every_character():
  assert (VOCAB.pad_id, VOCAB.eos_id, VOCAB.vocab_size) == (0, 1, 18)
  for c, i in EXPECTED_IDS.items():
    assert VOCAB.encode(c) == [i]
    assert VOCAB.decode([i]) == c
  text = "".join(EXPECTED_IDS)
  assert VOCAB.decode(VOCAB.encode(text)) == text
  assert VOCAB.encode("s3142=") == [15, 5, 3, 6, 4, 13]


def test_vocab_errors_name_the_character_and_the_id():
  with pytest.raises(ValueError, match=re.escape("'x'")) as e:
    VOCAB.encode("12x")
  assert "0123456789+=-sr," in str(e.value)
  with pytest.raises(ValueError, match=r"id 18 .*\[0, 18\)"):
    VOCAB.decode([3, 18])
  with pytest.raises(ValueError, match="id -1"):
    VOCAB.decode([-1])
  with pytest.raises(ValueError, match="vocab_size=16"):
    VOCAB.check_model_vocab(16)
  VOCAB.check_model_vocab(32)


def test_decode_stops_at_eos_and_skips_pad():
  assert VOCAB.decode([3, 0, 4, 1, 5, 6]) == "12"
  assert VOCAB.decode([1, 3]) == ""
  assert VOCAB.decode([]) == ""


# ----------------------------------------------------------------------------------------------------- tasks


def test_addition_answers_demonstrations_and_length_bounds():
  task = AdditionTask(digits=2)
  problems = task.sample(np.random.default_rng(0), 1000)
  assert len(problems) == 1000
  seen_a = set()
  for p in problems:
    m = re.fullmatch(r"(\d+)\+(\d+)=", p.prompt)
    assert m is not None, p.prompt
    a, b = int(m.group(1)), int(m.group(2))
    assert 0 <= a < 100 and 0 <= b < 100
    assert str(a) == m.group(1) and str(b) == m.group(2)  # no leading zeros
    seen_a.add(a)
    assert p.task == "addition"
    assert p.answer == str(a + b)
    assert p.prompt_ids == tuple(EXPECTED_IDS[c] for c in p.prompt)
    demo = task.demonstration(p)
    assert demo[-1] == 1
    assert demo == [EXPECTED_IDS[c] for c in p.prompt + p.answer] + [1]
    assert VOCAB.decode(demo) == p.prompt + p.answer
  assert len(seen_a) > 95  # uniform over 100 values, 1000 draws
  # "99+99=" is 6 tokens; "198" + eos is 4; both bounds are reached within 1000 samples.
  assert (task.max_prompt_len, task.max_answer_len) == (6, 4)
  assert max(len(p.prompt_ids) for p in problems) == 6
  assert max(len(p.answer) + 1 for p in problems) == 4


def test_addition_one_digit_covers_its_range():
  task = make_task("addition", digits=1)
  problems = task.sample(np.random.default_rng(1), 1000)
  pairs = [tuple(int(x) for x in p.prompt[:-1].split("+")) for p in problems]
  assert {a for a, _ in pairs} == set(range(10)) and {b for _, b in pairs} == set(range(10))
  assert all(p.answer == str(a + b) for p, (a, b) in zip(problems, pairs))
  assert (task.max_prompt_len, task.max_answer_len) == (4, 3)
  assert all(len(p.prompt_ids) <= 4 and len(p.answer) + 1 <= 3 for p in problems)


def test_sort_and_reverse_answers():
  sort, rev = SortTask(length=4), make_task("reverse", length=4)
  assert isinstance(rev, ReverseTask)
  rng = np.random.default_rng(2)
  for task, marker, fn in ((sort, "s", lambda d: "".join(sorted(d))), (rev, "r", lambda d: d[::-1])):
    problems = task.sample(rng, 1000)
    for p in problems:
      assert p.prompt[0] == marker and p.prompt[-1] == "=" and len(p.prompt) == 6
      digits = p.prompt[1:-1]
      assert digits.isdigit()
      assert p.answer == fn(digits)
      assert VOCAB.decode(task.demonstration(p)) == p.prompt + p.answer
      assert task.demonstration(p)[-1] == 1
    assert (task.max_prompt_len, task.max_answer_len) == (6, 5)
  # One hand-checked instance.
  p = Problem(task="sort", prompt="s3142=", answer="1234", prompt_ids=(15, 5, 3, 6, 4, 13))
  assert sort.demonstration(p) == [15, 5, 3, 6, 4, 13, 3, 4, 5, 6, 1]


def test_sampling_is_deterministic_given_the_rng():
  a = SortTask().sample(np.random.default_rng(7), 20)
  b = SortTask().sample(np.random.default_rng(7), 20)
  assert a == b
  assert SortTask().sample(np.random.default_rng(8), 20) != a


def test_make_task_and_constructor_errors():
  with pytest.raises(ValueError, match=r"'multiply'.*'addition'.*'reverse'.*'sort'"):
    make_task("multiply")
  with pytest.raises(ValueError, match="digits"):
    AdditionTask(digits=0)
  with pytest.raises(ValueError, match="length"):
    SortTask(length=-1)
  with pytest.raises(ValueError, match="n must be"):
    SortTask().sample(np.random.default_rng(0), -2)


# ----------------------------------------------------------------------------------------------------- sft_batch


class _FixedAddition(AdditionTask):
  """Always "12+5=" -> "17", so a batch row can be written by hand."""

  def sample(self, rng, n):
    return [Problem(task=self.name, prompt="12+5=", answer="17", prompt_ids=(3, 4, 12, 7, 13))] * n


def test_sft_batch_matches_a_hand_built_row():
  batch = sft_batch([(_FixedAddition(digits=2), 1.0)], np.random.default_rng(0), batch_size=3, seq_len=12, vocab=VOCAB)
  assert set(batch) == {"input_ids", "segment_ids", "positions"}
  row_ids = [3, 4, 12, 7, 13, 3, 9, 1, 0, 0, 0, 0]  # "12+5=" "17" eos, then pad
  row_seg = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
  row_pos = [0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0]
  for key, row in (("input_ids", row_ids), ("segment_ids", row_seg), ("positions", row_pos)):
    assert batch[key].dtype == np.int32 and batch[key].shape == (3, 12)
    np.testing.assert_array_equal(batch[key], np.array([row] * 3, dtype=np.int32))


def test_sft_batch_on_mixed_real_tasks():
  tasks = [(AdditionTask(), 1.0), (SortTask(), 1.0)]
  batch = sft_batch(tasks, np.random.default_rng(3), batch_size=64, seq_len=11, vocab=VOCAB)
  names = set()
  for ids, seg, pos in zip(batch["input_ids"], batch["segment_ids"], batch["positions"]):
    n = int(np.sum(ids != 0))
    np.testing.assert_array_equal(seg, (np.arange(11) < n).astype(np.int32))
    np.testing.assert_array_equal(pos, np.where(np.arange(11) < n, np.arange(11), 0))
    np.testing.assert_array_equal(ids[n:], 0)
    assert ids[n - 1] == 1 and np.sum(ids == 1) == 1  # exactly one eos, the last token
    text = VOCAB.decode(ids.tolist())
    prompt, answer = text.split("=")
    if prompt.startswith("s"):
      names.add("sort")
      assert answer == "".join(sorted(prompt[1:]))
    else:
      names.add("addition")
      a, b = prompt.split("+")
      assert answer == str(int(a) + int(b))
  assert names == {"addition", "sort"}


def test_sft_batch_rejects_a_too_short_seq_len():
  # Sort(length=4) demonstrations are "s3142=1234" + eos = 11 tokens.
  with pytest.raises(ValueError, match=r"11 tokens.*seq_len=10"):
    sft_batch([(SortTask(), 1.0)], np.random.default_rng(0), batch_size=2, seq_len=10, vocab=VOCAB)
  # A zero-weight task is never drawn, so its length does not matter.
  batch = sft_batch([(SortTask(), 1.0), (SortTask(length=9), 0.0)], np.random.default_rng(0), 2, 11, VOCAB)
  assert batch["input_ids"].shape == (2, 11)
  with pytest.raises(ValueError, match="uses CharVocab"):
    sft_batch([(SortTask(vocab=CharVocab("0123456789s=")), 1.0)], np.random.default_rng(0), 2, 11, VOCAB)


# ----------------------------------------------------------------------------------------------------- mixed_prompts


def test_mixed_prompts_follow_the_weights():
  add, srt = AdditionTask(), SortTask()
  n = 4000
  problems = mixed_prompts([(add, 3.0), (srt, 1.0)], np.random.default_rng(4), n)  # 0.75 / 0.25, unnormalised
  assert len(problems) == n
  frac_add = sum(p.task == "addition" for p in problems) / n
  se = math.sqrt(0.75 * 0.25 / n)
  assert abs(frac_add - 0.75) < 3 * se
  for p in problems:  # every problem is a valid one of its own task
    if p.task == "sort":
      assert p.answer == "".join(sorted(p.prompt[1:-1]))
    else:
      a, b = p.prompt[:-1].split("+")
      assert p.answer == str(int(a) + int(b))
  again = mixed_prompts([(add, 3.0), (srt, 1.0)], np.random.default_rng(4), n)
  assert again == problems
  only_add = mixed_prompts({add: 1.0, srt: 0.0}, np.random.default_rng(5), 50)  # a mapping works too
  assert [p.task for p in only_add] == ["addition"] * 50


def test_mixed_prompts_rejects_bad_weights():
  add, srt = AdditionTask(), SortTask()
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match=r"non-negative.*SortTask\(length=4\): -1\.0"):
    mixed_prompts([(add, 1.0), (srt, -1.0)], rng, 4)
  with pytest.raises(ValueError, match=r"all be zero.*AdditionTask\(digits=2\): 0\.0"):
    mixed_prompts([(add, 0.0), (srt, 0.0)], rng, 4)
  with pytest.raises(ValueError, match="finite"):
    mixed_prompts([(add, float("nan"))], rng, 4)
  with pytest.raises(ValueError, match="empty"):
    mixed_prompts([], rng, 4)


# ----------------------------------------------------------------------------------------------------- rewards


def _problem(answer: str = "132") -> Problem:
  return Problem(task="addition", prompt="47+85=", answer=answer, prompt_ids=(6, 9, 12, 10, 7, 13))


def test_exact_match():
  reward = exact_match(VOCAB)
  p = _problem()  # 47 + 85 = 132; "1" 3, "3" 5, "2" 4
  assert reward(p, [3, 5, 4, 1]) == 1.0
  assert reward(p, [3, 5, 5, 1]) == 0.0  # wrong digit
  assert reward(p, [3, 5, 4]) == 0.0  # right digits, cut off without eos
  assert reward(p, [3, 5, 4, 1, 11, 11, 0]) == 1.0  # tokens after eos are ignored
  assert reward(p, [3, 5, 1]) == 0.0  # too short
  assert reward(p, [3, 5, 4, 2, 1]) == 0.0  # too long
  assert reward(p, [1]) == 0.0 and reward(p, []) == 0.0
  assert reward(p, [3, 0, 5, 4, 1]) == 0.0  # a pad inside the answer is wrong
  assert reward(p, [3, 5, 4, 25, 1]) == 0.0  # an id beyond the vocab (model vocab 32) is wrong
  assert reward(p, np.array([3, 5, 4, 1], dtype=np.int32)) == 1.0
  # Every task's demonstration, minus its prompt, earns the full reward.
  for task in (AdditionTask(), SortTask(), ReverseTask()):
    for q in task.sample(np.random.default_rng(6), 50):
      assert reward(q, task.demonstration(q)[len(q.prompt_ids) :]) == 1.0


def test_score_survives_reward_fn_failures(monkeypatch):
  logged = []
  monkeypatch.setattr(rewards_lib.logging, "warning", lambda fmt, *args: logged.append(fmt % args))
  values = {"a": 0.5, "b": "raise", "c": float("nan"), "d": 1, "e": None, "f": "high", "g": float("inf")}

  def reward_fn(problem, response):
    v = values[problem.answer]
    if v == "raise":
      raise ZeroDivisionError("division by zero in the checker")
    return v

  ids = ["s0", "s1", "s2", "s3", "s4", "s5", "s6"]
  problems = [_problem(k) for k in values]
  rewards, failures = score(reward_fn, problems, [[1]] * 7, ids)
  assert rewards.dtype == np.float32 and rewards.shape == (7,)
  np.testing.assert_array_equal(rewards, np.array([0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=np.float32))
  assert len(failures) == 5
  assert failures[0].startswith("sample s1:") and "ZeroDivisionError: division by zero in the checker" in failures[0]
  assert failures[1].startswith("sample s2:") and "nan" in failures[1]
  assert failures[2].startswith("sample s4:") and "None" in failures[2]
  assert failures[3].startswith("sample s5:") and "'high'" in failures[3]
  assert failures[4].startswith("sample s6:") and "inf" in failures[4]
  assert len(logged) == 5 and all(sid in msg for sid, msg in zip(["s1", "s2", "s4", "s5", "s6"], logged))


def test_score_with_exact_match_and_length_mismatch():
  reward = make_reward_fn("exact_match", VOCAB)
  rewards, failures = score(reward, [_problem(), _problem()], [[3, 5, 4, 1], [3, 5, 4]], [0, 1])
  np.testing.assert_array_equal(rewards, np.array([1.0, 0.0], dtype=np.float32))
  assert failures == []
  with pytest.raises(ValueError, match="2, 1 and 2"):
    score(reward, [_problem(), _problem()], [[1]], [0, 1])
  with pytest.raises(ValueError, match="1, 1 and 0"):
    score(reward, [_problem()], [[1]], [])


def test_reward_registry():
  assert "exact_match" in REWARD_FNS
  with pytest.raises(ValueError, match=r"'f1'.*'exact_match'"):
    make_reward_fn("f1", VOCAB)
