"""Environments (glm_jax/rl/environment.py): tasks and rewards checked against Python's arithmetic and the corpus
read independently; a tool turn answered through a real ToolRunner (results, a malformed call and a raising call
each an observation, in the model's order); demonstrations that solve their tasks; bad names named."""

import numpy as np
import pytest

from glm_jax import chat
from glm_jax.data.sources import embedded_examples
from glm_jax.rl import environment, tools
from glm_jax.rl.environment import StepResult, last_word, make_environment


def test_calculator_tasks_and_scores():
  env = make_environment("calculator", digits=4, ops="*+")
  tasks = env.sample(np.random.default_rng(0), 20)
  for t in tasks:
    a, op, b = t["expression"].split()
    assert 1000 <= int(a) <= 9999 and 1000 <= int(b) <= 9999 and op in "*+"
    assert int(t["answer"]) == (int(a) * int(b) if op == "*" else int(a) + int(b))
    assert t["question"] == f"What is {t['expression']}?"
  assert {t["expression"].split()[1] for t in tasks} == {"*", "+"}
  t = tasks[0]
  episode = env.reset(t)
  assert episode.messages == [{"role": "user", "content": t["question"]}]
  assert episode.tools == [tools.CALCULATOR.definition]
  for content, reward in [(t["answer"], 1.0), (f" {int(t['answer']):,}.", 1.0), (t["answer"] + "1", 0.0), ("", 0.0)]:
    assert episode.step({"content": content, "tool_calls": [], "errors": []}) == StepResult([], True, reward)
  assert make_environment("calculator", with_tools=False).reset(t).tools is None


def test_verse_lookup_tasks_against_the_corpus():
  reference = {}
  for prompt, text in embedded_examples():
    book, _, ref = prompt.strip().rpartition(" ")
    chapter, verse = map(int, ref.split(":"))
    reference[(book, chapter, verse)] = text
  env = make_environment("verse_lookup", books=["john", "Genesis"])
  for t in env.sample(np.random.default_rng(1), 20):
    book, chapter, verse = t["ref"]
    assert book in ("John", "Genesis")
    words = "".join(c if c.isalpha() or c == "'" else " " for c in reference[(book, chapter, verse)]).split()
    assert t["answer"] == words[-1].strip("'")
    assert t["question"] == f"What is the last word of {book} {chapter}:{verse}?"
  assert last_word("Jesus wept.") == "wept" and last_word("the LORD's.") == "LORD's" and last_word("...") == ""
  with pytest.raises(ValueError, match=r"verse_lookup: books=\['Hezekiah'\]"):
    make_environment("verse_lookup", books=["Hezekiah"])


def test_a_tool_turn_through_a_real_runner_keeps_the_models_order():
  env = make_environment("calculator", digits=2)
  task = env.sample(np.random.default_rng(2), 1)[0]
  text = (
    "Two calls.</think><tool_call>calculator<arg_key>expression</arg_key><arg_value>6 * 7</arg_value></tool_call>"
    "<tool_call>calculator<arg_key>expression</arg_key></tool_call>"  # malformed: a key without its value
    "<tool_call>calculator<arg_key>expression</arg_key><arg_value>1 / 0</arg_value></tool_call>"
  )
  turn = chat.parse_assistant(text, tools=env.reset(task).tools)
  with tools.ToolRunner([tools.CALCULATOR], timeout=5, num_workers=1) as runner:
    env.serve(runner)
    result = env.reset(task).step(turn)
    counts = runner.counts
  assert not result.done and result.reward == 0.0
  answers = [m["content"] for m in result.messages]
  assert [m["role"] for m in result.messages] == ["tool"] * 3
  assert answers[0] == "42" and answers[1].startswith("error: invalid tool call: tool call 1:")
  assert answers[2].startswith("error:") and "zero" in answers[2]
  assert counts["ok"] == 1 and counts["invalid"] == 1 and counts["error"] == 1
  env.serve(None)
  no_runner = env.reset(task).step(turn)  # tools not served: every call answered with an error, the episode goes on
  assert not no_runner.done and all(m["content"].startswith("error: no tools") for m in no_runner.messages)


@pytest.mark.parametrize("name", ["calculator", "verse_lookup", "addition"])
def test_demonstrations_solve_their_tasks(name):
  env = make_environment(name)
  for task in env.sample(np.random.default_rng(3), 5):
    messages = env.demonstration(task)
    chat.render(messages, tools=env.reset(task).tools)  # renders in the chat format
    final = messages[-1]
    assert final["role"] == "assistant" and env.score(task, final["content"]) == 1.0
    if name != "addition":  # the tool result the demonstration shows is the tool's own answer
      call = messages[1]["tool_calls"][0]["function"]
      fn = tools.calculator if name == "calculator" else tools.lookup_verse
      assert messages[2]["content"] == fn(**call["arguments"])


def test_unknown_environments_and_arguments_are_named():
  with pytest.raises(ValueError, match=r"unknown environment 'abacus'; valid: a registered name \['addition'"):
    make_environment("abacus")
  with pytest.raises(ValueError, match=r"module 'no_such_pkg.envs' does not import"):
    make_environment("no_such_pkg.envs:Env")
  with pytest.raises(ValueError, match=r"environment 'calculator': .*unexpected keyword argument 'digit'"):
    make_environment("calculator", digit=3)
  with pytest.raises(ValueError, match=r"calculator: digits=0; must be an integer in \[1, 12\]"):
    make_environment("calculator", digits=0)
  with pytest.raises(ValueError, match=r"is not an Environment: it lacks \['name', 'sample', 'reset'\]"):
    make_environment("collections:OrderedDict")
  assert isinstance(make_environment("sort", length=3), environment.TaskEnvironment)


def test_format_reward_only_after_a_well_formed_call_that_ran():
  env = make_environment("calculator", digits=2, format_reward=0.1)
  task = env.sample(np.random.default_rng(4), 1)[0]
  call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": task["expression"]}}}
  wrong = {"content": "0", "tool_calls": [], "errors": []}
  assert env.reset(task).step(wrong).reward == 0.0  # no call made
  with tools.ToolRunner([tools.CALCULATOR], timeout=5, num_workers=1) as runner:
    env.serve(runner)
    episode = env.reset(task)
    episode.step({"content": "", "tool_calls": [call], "errors": []})
    assert episode.step(wrong) == StepResult([], True, 0.1)
    right = env.reset(task)
    right.step({"content": "", "tool_calls": [call], "errors": []})
    assert right.step({"content": task["answer"], "tool_calls": [], "errors": []}).reward == 1.0
    malformed = env.reset(task)
    malformed.step({"content": "", "tool_calls": [], "errors": [{"index": 0, "text": "x", "error": "bad"}]})
    assert malformed.step(wrong).reward == 0.0
  env.serve(None)
  with pytest.raises(ValueError, match=r"calculator: format_reward=1\.5; must be a number in \[0, 1\)"):
    make_environment("calculator", format_reward=1.5)
