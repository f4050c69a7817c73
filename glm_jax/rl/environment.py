"""Environments: where agentic episodes happen (slime's customizable rollouts: multi-turn loops, tool calls,
environment feedback). An environment samples tasks, opens an episode on one, and answers the model's turns.

  env = make_environment("calculator", digits=4)         # or "package.module:MyEnvironment"
  tasks = env.sample(np.random.default_rng(0), 8)        # JSON-able dicts, each with its "answer"
  episode = env.reset(tasks[0])                          # episode.messages, episode.tools (function definitions)
  result = episode.step(turn)                            # turn: chat.parse_assistant's dict + "stop"
  result.messages, result.done, result.reward            # tool results / a reply; ended?; the reward so far

The protocol (`Environment`, `Episode`) is all an environment of your own needs: a class in a module of yours,
named by import path in a config's tasks.<label>.task (glm_jax/rl/config.py). This module's own:
  calculator     arithmetic the model cannot do in its head ("What is 3718 * 9127?"), with the calculator tool
  verse_lookup   "What is the last word of John 11:35?", with the lookup_verse tool over the embedded corpus
  addition, sort, reverse   glm_jax/rl/tasks.py's single-turn tasks as chat episodes (no tools)
A tool environment (ToolEnvironment) answers a turn with tool calls by running them through a ToolRunner
(glm_jax/rl/tools.py: bounded time and output; a raising, hanging or flooding tool and a malformed call become
error observations, and the episode goes on), and scores a turn without calls as the final answer: reward 1 for the
exact answer (`score`), else `format_reward` (default 0) when an earlier turn made well-formed calls that ran (the
"exact match plus a small format reward" of others' tool tasks), else 0. `with_tools=False` offers no tool: the same
questions, answered unaided.
`demonstration(task)` is a scripted conversation solving the task as the environment expects it (agentic SFT).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from glm_jax.rl import tasks as tasks_lib, tools as tools_lib


@dataclasses.dataclass
class StepResult:
  messages: list[dict]  # what answers the model's turn: tool messages, or a user reply ([] when done)
  done: bool
  reward: float = 0.0


class Episode(Protocol):
  messages: list[dict]  # the conversation the model starts from (system and user messages)
  tools: list[dict] | None  # the offered tools' function definitions (chat.render's `tools`), or None

  def step(self, turn: dict) -> StepResult: ...


class Environment(Protocol):
  name: str

  def sample(self, rng: np.random.Generator, n: int) -> list[dict]: ...

  def reset(self, task: dict) -> Episode: ...

  def demonstration(self, task: dict) -> list[dict]: ...


_ENV_MEMBERS = ("name", "sample", "reset")


class _Episode:
  def __init__(self, env: ToolEnvironment, task: dict, runner: tools_lib.ToolRunner | None):
    self.env, self.task, self.runner = env, task, runner
    self.messages = [{"role": "user", "content": env.question(task)}]
    self.tools = [t.definition for t in env.tools] if env.tools else None
    self.called = False  # a turn of well-formed calls only, run by the tools

  def step(self, turn: dict) -> StepResult:
    calls, errors = turn.get("tool_calls") or [], turn.get("errors") or []
    if not calls and not errors:
      reward = self.env.score(self.task, turn.get("content", ""))
      return StepResult([], True, reward if reward > 0 or not self.called else self.env.format_reward)
    self.called = self.called or (bool(calls) and not errors and self.runner is not None)
    if self.runner is None:  # tools were not offered, or the loop has none running: every call is an error
      answers = ["error: no tools are available here; answer directly"] * (len(calls) + len(errors))
    else:
      # In the order the model wrote them: a malformed call's "index" is its place among all of them.
      bad = {e["index"]: e for e in errors}
      outcomes = iter(self.runner.run_many(calls))
      answers = [self.runner.malformed(bad[i]) if i in bad else next(outcomes) for i in range(len(calls) + len(errors))]
    return StepResult([{"role": "tool", "content": a} for a in answers], False, 0.0)


class ToolEnvironment:
  """Questions with one exact answer and the tools that find it (module docstring). Subclasses give `name`,
  `tools`, `sample`, `question`, `answer_of` (how the final content is read) and `demonstration`."""

  name = "tool_environment"
  tools: Sequence[tools_lib.Tool] = ()

  def __init__(self, *, with_tools: bool = True, format_reward: float = 0.0):
    if not isinstance(with_tools, bool):
      raise ValueError(f"{self.name}: with_tools={with_tools!r}; must be True or False")
    if not (isinstance(format_reward, (int, float)) and 0 <= format_reward < 1):
      raise ValueError(f"{self.name}: format_reward={format_reward!r}; must be a number in [0, 1)")
    self.with_tools, self.format_reward = with_tools, float(format_reward)
    if not with_tools:
      self.tools = ()
    self.runner: tools_lib.ToolRunner | None = None  # set by the rollout that runs episodes (`serve`)

  def serve(self, runner: tools_lib.ToolRunner | None) -> None:
    self.runner = runner

  def reset(self, task: dict) -> _Episode:
    return _Episode(self, task, self.runner if self.tools else None)

  def question(self, task: dict) -> str:
    return task["question"]

  def answer_of(self, content: str) -> str:
    return content.strip()

  def score(self, task: dict, content: str) -> float:
    return float(self.answer_of(content) == task["answer"])


class CalculatorEnvironment(ToolEnvironment):
  """'What is A * B?' (or A + B, A - B) for `digits`-digit operands: a product of two 4-digit numbers is beyond
  a small model's head, one calculator call away. The answer: the integer, alone."""

  name = "calculator"
  tools = (tools_lib.CALCULATOR,)
  _OPS = {"*": lambda a, b: a * b, "+": lambda a, b: a + b, "-": lambda a, b: a - b}

  def __init__(self, digits: int = 4, ops: str = "*", *, with_tools: bool = True, format_reward: float = 0.0):
    super().__init__(with_tools=with_tools, format_reward=format_reward)
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 12:
      raise ValueError(f"calculator: digits={digits!r}; must be an integer in [1, 12]")
    if not isinstance(ops, str) or not ops or set(ops) - set(self._OPS):
      raise ValueError(f"calculator: ops={ops!r}; must be a non-empty string of {''.join(self._OPS)}")
    self.digits, self.ops = digits, ops

  def sample(self, rng: np.random.Generator, n: int) -> list[dict]:
    low, high = 10 ** (self.digits - 1), 10**self.digits
    out = []
    for _ in range(n):
      a, b = (int(x) for x in rng.integers(low, high, 2))
      op = self.ops[int(rng.integers(len(self.ops)))]
      expr = f"{a} {op} {b}"
      out.append({"question": f"What is {expr}?", "expression": expr, "answer": str(self._OPS[op](a, b))})
    return out

  def answer_of(self, content: str) -> str:
    return content.strip().rstrip(".").replace(",", "")

  def demonstration(self, task: dict) -> list[dict]:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": task["expression"]}}}
    result = tools_lib.calculator(task["expression"])
    return [
      {"role": "user", "content": self.question(task)},
      {"role": "assistant", "reasoning_content": "Use the calculator.", "content": "", "tool_calls": [call]},
      {"role": "tool", "content": result},
      {"role": "assistant", "reasoning_content": f"It says {result}.", "content": result},
    ]


class VerseLookupEnvironment(ToolEnvironment):
  """'What is the last word of John 11:35?' over the embedded King James Bible: one lookup_verse call, then the
  verse's last word (letters only) is the answer. Verses are drawn from `books` (all 66 by default)."""

  name = "verse_lookup"
  tools = (tools_lib.LOOKUP_VERSE,)

  def __init__(self, books: Sequence[str] = (), *, with_tools: bool = True, format_reward: float = 0.0):
    super().__init__(with_tools=with_tools, format_reward=format_reward)
    index = tools_lib.verse_index()
    unknown = [b for b in books if b.lower() not in index.books]
    if isinstance(books, str) or unknown:
      raise ValueError(f"verse_lookup: books={books!r}; each must be a book of the King James Bible ({unknown})")
    self.books = [index.books[b.lower()] for b in books] or list(index.chapters)
    self._refs = [k for k in index.verses if k[0] in self.books]

  def sample(self, rng: np.random.Generator, n: int) -> list[dict]:
    index = tools_lib.verse_index()
    out = []
    for i in rng.integers(len(self._refs), size=n):
      book, chapter, verse = self._refs[int(i)]
      out.append(
        {
          "question": f"What is the last word of {book} {chapter}:{verse}?",
          "ref": [book, chapter, verse],
          "answer": last_word(index.verses[(book, chapter, verse)]),
        }
      )
    return out

  def answer_of(self, content: str) -> str:
    return last_word(content)

  def demonstration(self, task: dict) -> list[dict]:
    book, chapter, verse = task["ref"]
    args = {"book": book, "chapter": chapter, "verse": verse}
    call = {"type": "function", "function": {"name": "lookup_verse", "arguments": args}}
    return [
      {"role": "user", "content": self.question(task)},
      {"role": "assistant", "reasoning_content": "Look the verse up.", "content": "", "tool_calls": [call]},
      {"role": "tool", "content": tools_lib.lookup_verse(book, chapter, verse)},
      {"role": "assistant", "reasoning_content": "Its last word.", "content": task["answer"]},
    ]


def last_word(text: str) -> str:
  """The last run of letters (apostrophes inside kept) of `text`: "... and the earth." -> "earth"."""
  words = re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)*", text)
  return words[-1] if words else ""


class TaskEnvironment(ToolEnvironment):
  """One of glm_jax/rl/tasks.py's single-turn tasks as a chat episode: its prompt text as the user message, its
  answer text expected as the reply's content. No tools."""

  def __init__(self, task: str = "addition", **kwargs: Any):
    super().__init__(with_tools=False)
    self.task = tasks_lib.make_task(task, **kwargs)
    self.name = self.task.name

  def sample(self, rng: np.random.Generator, n: int) -> list[dict]:
    return [{"question": p.prompt, "answer": p.answer} for p in self.task.sample(rng, n)]

  def demonstration(self, task: dict) -> list[dict]:
    return [
      {"role": "user", "content": task["question"]},
      {"role": "assistant", "reasoning_content": "", "content": task["answer"]},
    ]


ENVIRONMENTS = {
  "calculator": CalculatorEnvironment,
  "verse_lookup": VerseLookupEnvironment,
  **{name: (lambda name: lambda **kw: TaskEnvironment(name, **kw))(name) for name in tasks_lib.TASKS},
}
_VALID = "a registered name {} or an import path 'package.module:EnvironmentClass' (see environment.Environment)"


def make_environment(name: str, **kwargs: Any) -> Environment:
  """The environment registered under `name` (ENVIRONMENTS), or the class at the import path `name`, built with
  `kwargs`; ValueError naming what is wrong (an unknown name, a path that does not import, an object that is not an
  environment, arguments it does not take)."""
  valid = _VALID.format(sorted(ENVIRONMENTS))
  factory = tasks_lib.registered_or_imported("make_environment", "environment", name, ENVIRONMENTS, valid)
  try:
    env = factory(**kwargs)
  except TypeError as e:
    raise ValueError(f"environment {name!r}: {e}") from e
  missing = [m for m in _ENV_MEMBERS if not hasattr(env, m)]
  if missing:
    raise ValueError(f"environment {name!r} is not an Environment: it lacks {missing}; valid: {valid}")
  return env
