"""Small verifiable tasks for the CPU demos of GRPO and on-policy distillation.

Every task writes its problems in one shared character vocabulary, so one tiny model (any model vocab of at
least `CharVocab().vocab_size` = 18 ids) can learn them all, and a mix of tasks can share a batch:

  id 0 = pad, id 1 = eos, then the alphabet "0123456789+=-sr," in order: "0" -> 2, ..., "9" -> 11,
  "+" -> 12, "=" -> 13, "-" -> 14, "s" -> 15, "r" -> 16, "," -> 17.

The tasks (a prompt ends with "=", the answer follows it and the model ends it with eos):
  addition   "47+85="  -> "132"     a, b uniform in [0, 10**digits)
  sort       "s3142="  -> "1234"    `length` uniform digits, answer sorted ascending
  reverse    "r3142="  -> "2413"    `length` uniform digits, answer reversed

  task = make_task("addition", digits=2)
  problems = task.sample(np.random.default_rng(0), 8)
  batch = sft_batch([(make_task("addition"), 1.0), (make_task("sort"), 1.0)], rng, batch_size=16, seq_len=16,
                    vocab=CharVocab())        # {"input_ids", "segment_ids", "positions"}: [16, 16] int32
  prompts = mixed_prompts([(add, 0.5), (srt, 0.5)], rng, 64)   # for rollouts / distillation

A task of your own needs no edit here: subclass TaskBase in a module of yours and name it by its import path,
make_task("my_tasks:CountTask", length=3) (a config's tasks.<label>.task or teachers.<name>.task field;
docs/post_training.md shows one with its reward).

Host-side numpy only; everything is deterministic given the numpy Generator passed in.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import re
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

ALPHABET = "0123456789+=-sr,"
PAD_ID = 0
EOS_ID = 1


class CharVocab:
  """Character-level tokenizer: pad = 0, eos = 1, then one id per character of `ALPHABET`, in order."""

  def __init__(self, alphabet: str = ALPHABET):
    if len(set(alphabet)) != len(alphabet) or not alphabet:
      raise ValueError(f"CharVocab alphabet must be non-empty with distinct characters, got {alphabet!r}")
    self.alphabet = alphabet
    self.pad_id = PAD_ID
    self.eos_id = EOS_ID
    self.num_special = 2
    self.vocab_size = self.num_special + len(alphabet)
    self._char_to_id = {c: i + self.num_special for i, c in enumerate(alphabet)}

  def __eq__(self, other: object) -> bool:
    return isinstance(other, CharVocab) and other.alphabet == self.alphabet

  def __hash__(self) -> int:
    return hash(("CharVocab", self.alphabet))

  def record(self) -> dict:
    """What a checkpoint saves of this vocabulary (as data.Tokenizer.record, without a JSON to rebuild it from)."""
    digest = hashlib.sha256(f"CharVocab:{self.alphabet}".encode("utf-8")).hexdigest()
    return {"name": f"CharVocab({self.alphabet!r})", "sha256": digest, "vocab_size": self.vocab_size}

  @classmethod
  def from_record(cls, record: Mapping) -> "CharVocab":
    """The vocabulary a checkpoint recorded (see record; its name holds the alphabet); ValueError when the record is
    not a CharVocab's or does not rebuild it."""
    name = record.get("name")
    match = re.fullmatch(r"CharVocab\((.*)\)", name, re.S) if isinstance(name, str) else None
    try:
      alphabet = ast.literal_eval(match.group(1)) if match else None
    except (ValueError, SyntaxError):
      alphabet = None
    if not isinstance(alphabet, str):
      raise ValueError(f"tokenizer record {name!r}: not a CharVocab's (expected the name CharVocab('<alphabet>'))")
    vocab = cls(alphabet)
    if vocab.record()["sha256"] != record.get("sha256"):
      raise ValueError(
        f"tokenizer record {name!r}: its alphabet hashes to {vocab.record()['sha256'][:12]}, the record says "
        f"{str(record.get('sha256'))[:12]}"
      )
    return vocab

  def __repr__(self) -> str:
    return f"CharVocab(alphabet={self.alphabet!r}, vocab_size={self.vocab_size})"

  def encode(self, text: str) -> list[int]:
    """Ids of the characters of `text` (no eos added); ValueError naming an unknown character."""
    ids = []
    for pos, c in enumerate(text):
      if c not in self._char_to_id:
        raise ValueError(
          f"CharVocab.encode: character {c!r} at position {pos} of {text!r} is not in the alphabet {self.alphabet!r}"
        )
      ids.append(self._char_to_id[c])
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids` up to the first eos (excluded); pads are skipped. ValueError for an id out of range."""
    chars = []
    for pos, i in enumerate(ids):
      i = int(i)
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"CharVocab.decode: id {i} at position {pos} is outside the vocabulary [0, {self.vocab_size})")
      if i == self.eos_id:
        break
      if i == self.pad_id:
        continue
      chars.append(self.alphabet[i - self.num_special])
    return "".join(chars)

  def check_model_vocab(self, model_vocab_size: int) -> None:
    """ValueError if a model with `model_vocab_size` output ids cannot write every id of this vocabulary."""
    if int(model_vocab_size) < self.vocab_size:
      raise ValueError(
        f"model vocab_size={model_vocab_size} is smaller than the task vocabulary's "
        f"{self.vocab_size} ids (pad, eos and {self.alphabet!r}); use vocab_size >= {self.vocab_size}"
      )


@dataclasses.dataclass(frozen=True)
class Problem:
  """One task instance: the prompt text, the exact expected answer text (no eos) and the prompt's ids."""

  task: str
  prompt: str
  answer: str
  prompt_ids: tuple[int, ...]


class Task(Protocol):
  """What every task provides (see AdditionTask; TaskBase is the base class to start a new one from)."""

  name: str
  vocab: CharVocab
  max_prompt_len: int
  max_answer_len: int

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]: ...

  def demonstration(self, problem: Problem) -> list[int]: ...


def _check_count(name: str, n: int) -> int:
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
    raise ValueError(f"{name}: n must be a non-negative integer, got {n!r}")
  return int(n)


def _check_positive(cls: str, field: str, value: int, high: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= high:
    raise ValueError(f"{cls}: {field} must be an integer in [1, {high}], got {value!r}")
  return int(value)


class TaskBase:
  """Shared pieces: problem construction and the demonstration (prompt ids + answer ids + eos). A new task
  subclasses it, sets `name`, `max_prompt_len` and `max_answer_len` (eos included) and writes `sample`."""

  name = ""

  def __init__(self, vocab: CharVocab | None = None):
    self.vocab = vocab if vocab is not None else CharVocab()

  def _problem(self, prompt: str, answer: str) -> Problem:
    return Problem(task=self.name, prompt=prompt, answer=answer, prompt_ids=tuple(self.vocab.encode(prompt)))

  def demonstration(self, problem: Problem) -> list[int]:
    """The ideal sequence: prompt ids, answer ids, eos."""
    return list(problem.prompt_ids) + self.vocab.encode(problem.answer) + [self.vocab.eos_id]


class AdditionTask(TaskBase):
  """ "a+b=" -> str(a + b), with a and b uniform in [0, 10**digits) (no leading zeros)."""

  name = "addition"

  def __init__(self, digits: int = 2, vocab: CharVocab | None = None):
    super().__init__(vocab)
    self.digits = _check_positive("AdditionTask", "digits", digits, 9)
    self.max_prompt_len = 2 * self.digits + 2  # a, "+", b, "="
    self.max_answer_len = self.digits + 1 + 1  # the sum may carry one digit, then eos

  def __repr__(self) -> str:
    return f"AdditionTask(digits={self.digits})"

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """`n` problems drawn from `rng`."""
    n = _check_count("AdditionTask.sample", n)
    ab = rng.integers(0, 10**self.digits, size=(n, 2))
    return [self._problem(f"{a}+{b}=", str(a + b)) for a, b in ab.tolist()]


class _DigitStringTask(TaskBase):
  """A marker letter, `length` uniform digits, "="; the answer is a function of the digits."""

  marker = ""

  def __init__(self, length: int = 4, vocab: CharVocab | None = None):
    super().__init__(vocab)
    self.length = _check_positive(type(self).__name__, "length", length, 64)
    self.max_prompt_len = self.length + 2  # marker, digits, "="
    self.max_answer_len = self.length + 1  # digits, eos

  def __repr__(self) -> str:
    return f"{type(self).__name__}(length={self.length})"

  def _answer(self, digits: str) -> str:
    raise NotImplementedError

  def sample(self, rng: np.random.Generator, n: int) -> list[Problem]:
    """`n` problems drawn from `rng`."""
    n = _check_count(f"{type(self).__name__}.sample", n)
    rows = rng.integers(0, 10, size=(n, self.length))
    out = []
    for row in rows.tolist():
      digits = "".join(str(d) for d in row)
      out.append(self._problem(f"{self.marker}{digits}=", self._answer(digits)))
    return out


class SortTask(_DigitStringTask):
  """ "s3142=" -> "1234": the digits sorted ascending."""

  name = "sort"
  marker = "s"

  def _answer(self, digits: str) -> str:
    return "".join(sorted(digits))


class ReverseTask(_DigitStringTask):
  """ "r3142=" -> "2413": the digits in reverse order."""

  name = "reverse"
  marker = "r"

  def _answer(self, digits: str) -> str:
    return digits[::-1]


TASKS = {"addition": AdditionTask, "sort": SortTask, "reverse": ReverseTask}


def load_import_path(path: str) -> object:
  """The attribute that an import path "package.module:attr" names (attr may be dotted). ValueError saying what
  is wrong when `path` has no ":", its module does not import, or the module has no such attribute."""
  module_name, _, attr = path.partition(":")
  if not module_name or not attr:
    raise ValueError(f"{path!r} is not an import path of the form 'package.module:attr'")
  try:
    obj = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"import path {path!r}: module {module_name!r} does not import ({type(e).__name__}: {e})") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"import path {path!r}: {module_name}:{attr} has no attribute {part!r}")
    obj = getattr(obj, part)
  return obj


def registered_or_imported(fn: str, what: str, name: str, registry: Mapping[str, object], valid: str) -> object:
  """registry[name], or the object at the import path `name` ("package.module:attr"); a ValueError naming `fn`,
  the value and what is `valid` when it is neither."""
  if name in registry:
    return registry[name]
  if not isinstance(name, str) or ":" not in name:
    raise ValueError(f"{fn}: unknown {what} {name!r}; valid: {valid}")
  try:
    return load_import_path(name)
  except ValueError as e:
    raise ValueError(f"{fn}: {e}; valid: {valid}") from e


_TASK_MEMBERS = ("name", "vocab", "max_prompt_len", "max_answer_len", "sample", "demonstration")  # Task's
_VALID_TASKS = "a registered name {} or an import path 'package.module:TaskClass' to a Task class (see TaskBase)"


def make_task(name: str, **kwargs) -> Task:
  """The task registered under `name` (see TASKS), or the Task class at the import path `name`
  ("package.module:TaskClass"), built with `kwargs` (e.g. digits=1, length=4)."""
  valid = _VALID_TASKS.format(sorted(TASKS))
  cls = registered_or_imported("make_task", "task", name, TASKS, valid)
  if not isinstance(cls, type):
    raise ValueError(f"make_task: {name!r} is {cls!r}, not a class; valid: {valid}")
  task = cls(**kwargs)
  missing = [m for m in _TASK_MEMBERS if not hasattr(task, m)]
  if missing:
    raise ValueError(f"make_task: {name!r} is not a Task (its instances lack {missing}); valid: {valid}")
  return task


TasksAndWeights = Sequence[tuple[Task, float]] | Mapping[Task, float]


def _split_tasks_and_weights(tasks_and_weights: TasksAndWeights) -> tuple[list[Task], np.ndarray]:
  """Tasks and their normalised probabilities; ValueError for no tasks or bad weights."""
  pairs = list(tasks_and_weights.items()) if isinstance(tasks_and_weights, Mapping) else list(tasks_and_weights)
  if not pairs:
    raise ValueError("tasks_and_weights is empty: give at least one (task, weight) pair")
  for p in pairs:
    if not isinstance(p, (tuple, list)) or len(p) != 2:
      raise ValueError(f"tasks_and_weights must hold (task, weight) pairs, got {p!r}")
  tasks = [t for t, _ in pairs]
  try:
    weights = np.asarray([float(w) for _, w in pairs], dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise ValueError(f"task weights must be real numbers, got {[w for _, w in pairs]!r}") from e
  named = "{" + ", ".join(f"{t!r}: {float(w)}" for t, w in zip(tasks, weights)) + "}"
  if not np.all(np.isfinite(weights)) or np.any(weights < 0):
    raise ValueError(f"task weights must be finite and non-negative, got {named}")
  if weights.sum() <= 0:
    raise ValueError(f"task weights must not all be zero, got {named}")
  return tasks, weights / weights.sum()


def _task_per_row(
  tasks_and_weights: TasksAndWeights, rng: np.random.Generator, n: int
) -> tuple[list[Task], list[Problem]]:
  """Draw a task per row by the weights, then that many problems from each task, kept in row order."""
  tasks, probs = _split_tasks_and_weights(tasks_and_weights)
  which = rng.choice(len(tasks), size=n, p=probs)
  out: list[Problem | None] = [None] * n
  for k, task in enumerate(tasks):
    rows = np.flatnonzero(which == k)
    for r, prob in zip(rows.tolist(), task.sample(rng, len(rows))):
      out[r] = prob
  return [tasks[k] for k in which.tolist()], out  # type: ignore[return-value]


def mixed_prompts(tasks_and_weights: TasksAndWeights, rng: np.random.Generator, n: int) -> list[Problem]:
  """`n` problems, each from a task drawn with probability proportional to its weight (weights need not sum
  to 1). Deterministic given `rng`. ValueError for negative, non-finite or all-zero weights."""
  n = _check_count("mixed_prompts", n)
  return _task_per_row(tasks_and_weights, rng, n)[1]


def sft_batch(
  tasks_and_weights: TasksAndWeights, rng: np.random.Generator, batch_size: int, seq_len: int, vocab: CharVocab
) -> dict[str, np.ndarray]:
  """One demonstration (prompt + answer + eos) per row, task drawn per row by the weights, right-padded.

  Returns int32 [batch_size, seq_len] arrays: "input_ids" (pad_id on padding), "segment_ids" (1 on the
  demonstration's tokens, 0 on padding, so the LM loss ignores padding) and "positions" (0, 1, ... on the
  tokens, 0 on padding). ValueError, before drawing anything, if the longest demonstration of a task with a
  positive weight (max_prompt_len + max_answer_len) does not fit in seq_len.
  """
  batch_size = _check_count("sft_batch batch_size", batch_size)
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ValueError(f"sft_batch: seq_len must be a positive integer, got {seq_len!r}")
  for task, prob in zip(*_split_tasks_and_weights(tasks_and_weights)):
    longest = task.max_prompt_len + task.max_answer_len
    if prob > 0 and longest > seq_len:
      raise ValueError(
        f"sft_batch: task {task!r} has demonstrations of up to {longest} tokens (eos included) but "
        f"seq_len={seq_len}; use seq_len >= {longest}"
      )
  tasks, problems = _task_per_row(tasks_and_weights, rng, batch_size)
  input_ids = np.full((batch_size, seq_len), vocab.pad_id, dtype=np.int32)
  segment_ids = np.zeros((batch_size, seq_len), dtype=np.int32)
  positions = np.zeros((batch_size, seq_len), dtype=np.int32)
  for r, (task, prob) in enumerate(zip(tasks, problems)):
    if task.vocab != vocab:
      raise ValueError(f"sft_batch: task {task.name!r} uses {task.vocab!r} but the batch is built with {vocab!r}")
    ids = task.demonstration(prob)
    if len(ids) > seq_len:
      raise ValueError(
        f"sft_batch: a {task.name!r} demonstration {prob.prompt + prob.answer!r} is {len(ids)} "
        f"tokens (eos included) but seq_len={seq_len}; use seq_len >= "
        f"{task.max_prompt_len + task.max_answer_len} for this task"
      )
    input_ids[r, : len(ids)] = ids
    segment_ids[r, : len(ids)] = 1
    positions[r, : len(ids)] = np.arange(len(ids))
  return {"input_ids": input_ids, "segment_ids": segment_ids, "positions": positions}
