"""GLM-5's chat format (glm_jax/chat.py): rendered prompts against golden strings written out by hand from the
format's rules (docs/glm5_facts.md section 8), parsing as the inverse of rendering, and the errors for bad input."""

import json
import re

import pytest

from glm_jax import chat

CALC = {
  "type": "function",
  "function": {
    "name": "calc",
    "description": "Évalue une expression",
    "parameters": {
      "type": "object",
      "properties": {"expr": {"type": "string"}, "digits": {"type": "integer"}},
      "required": ["expr"],
    },
  },
}
SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}
TOOLS_BLOCK = (
  "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
  '{"type": "function", "function": {"name": "calc", "description": "Évalue une expression", "parameters": '
  '{"type": "object", "properties": {"expr": {"type": "string"}, "digits": {"type": "integer"}}, "required": '
  '["expr"]}}}\n'
  '{"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}\n'
  "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
  "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}"
  "</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)
TOOL_SHAPES = (
  'valid: {"type": "function", "function": {"name": ..., "parameters": {"type": "object", "properties": {...}}}} '
  'or the bare {"name": ..., "parameters": {...}}'
)


def call(name, arguments, wrapped=True):
  fn = {"name": name, "arguments": arguments}
  return {"type": "function", "function": fn} if wrapped else fn


USER = {"role": "user", "content": "What is 37*91?"}
ASK_CALC = {
  "role": "assistant",
  "reasoning_content": "Use the calculator.",
  "content": "",
  "tool_calls": [call("calc", {"expr": "37*91", "digits": 3})],
}
RESULT = {"role": "tool", "content": "3367"}
ANSWER = {"role": "assistant", "reasoning_content": "The tool says 3367.", "content": "37*91 = 3367."}
CHAIN = [USER, ASK_CALC, RESULT, ANSWER]
CALL_TEXT = (
  "<tool_call>calc<arg_key>expr</arg_key><arg_value>37*91</arg_value><arg_key>digits</arg_key><arg_value>3</arg_value>"
  "</tool_call>"
)


def test_the_golden_of_the_facts_verbatim():
  want = (
    "[gMASK]<sop><|user|>What is 37*91?<|assistant|><think>Use the calculator.</think><tool_call>calc<arg_key>expr"
    "</arg_key><arg_value>37*91</arg_value><arg_key>digits</arg_key><arg_value>3</arg_value></tool_call>"
    "<|observation|><tool_response>3367</tool_response><|assistant|><think>"
  )
  assert chat.render([USER, ASK_CALC, RESULT], add_generation_prompt=True) == want


def test_a_tool_chain_after_the_last_user_turn_keeps_its_reasoning():
  want = (
    "[gMASK]<sop><|user|>What is 37*91?<|assistant|><think>Use the calculator.</think>" + CALL_TEXT + "<|observation|>"
    "<tool_response>3367</tool_response><|assistant|><think>The tool says 3367.</think>37*91 = 3367."
  )
  assert chat.render(CHAIN) == want


LATER = [*CHAIN, {"role": "user", "content": "And 2+2?"}]


def test_turns_before_the_last_user_turn_keep_a_bare_end_of_thinking():
  want = (
    "[gMASK]<sop><|user|>What is 37*91?<|assistant|></think>" + CALL_TEXT + "<|observation|>"
    "<tool_response>3367</tool_response><|assistant|></think>37*91 = 3367.<|user|>And 2+2?<|assistant|><think>"
  )
  assert chat.render(LATER, add_generation_prompt=True) == want
  # Reasoning inside the content, with the newlines the model writes around it, collapses the same way.
  inline = [USER, {"role": "assistant", "content": "<think>\nMultiply.\n</think>\n\n3367 "}, LATER[-1]]
  assert chat.render(inline) == "[gMASK]<sop><|user|>What is 37*91?<|assistant|></think>3367<|user|>And 2+2?"


def test_clear_thinking_false_keeps_every_turns_reasoning():
  want = (
    "[gMASK]<sop><|user|>What is 37*91?<|assistant|><think>Use the calculator.</think>" + CALL_TEXT + "<|observation|>"
    "<tool_response>3367</tool_response><|assistant|><think>The tool says 3367.</think>37*91 = 3367.<|user|>And 2+2?"
    "<|assistant|><think>"
  )
  assert chat.render(LATER, add_generation_prompt=True, clear_thinking=False) == want
  inline = [USER, {"role": "assistant", "content": "<think>\nMultiply.\n</think>\n\n3367 "}, LATER[-1]]
  want = "[gMASK]<sop><|user|>What is 37*91?<|assistant|><think>Multiply.</think>3367<|user|>And 2+2?"
  assert chat.render(inline, clear_thinking=False) == want


def test_enable_thinking_false_closes_the_thinking_in_the_generation_prompt():
  assert chat.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=False) == (
    "[gMASK]<sop><|user|>Hi<|assistant|></think>"
  )
  # The history is rendered as with thinking on; only the prompt changes.
  on, off = (chat.render(CHAIN, add_generation_prompt=True, enable_thinking=e) for e in (True, False))
  assert on[: -len("<think>")] == off[: -len("</think>")] == chat.render(CHAIN) + "<|assistant|>"


TWO_CALLS = [
  {"role": "user", "content": "Weather in Paris and Rome?"},
  {
    "role": "assistant",
    "reasoning_content": "Two searches.",
    "tool_calls": [call("search", {"query": "Paris"}), call("search", {"query": "Rome"}, wrapped=False)],
  },
  {"role": "tool", "content": "18C"},
  {"role": "tool", "content": "24C"},
]


def test_consecutive_tool_results_share_one_observation():
  want = (
    "[gMASK]<sop><|user|>Weather in Paris and Rome?<|assistant|><think>Two searches.</think>"
    "<tool_call>search<arg_key>query</arg_key><arg_value>Paris</arg_value></tool_call>"
    "<tool_call>search<arg_key>query</arg_key><arg_value>Rome</arg_value></tool_call>"
    "<|observation|><tool_response>18C</tool_response><tool_response>24C</tool_response><|assistant|><think>"
  )
  assert chat.render(TWO_CALLS, add_generation_prompt=True) == want


def test_a_tool_message_with_a_list_of_results_opens_its_own_observation():
  messages = [*TWO_CALLS[:3], {"role": "tool", "content": ["24C", {"output": "rain"}]}]
  want = "<|observation|><tool_response>18C</tool_response><|observation|><tool_response>24C</tool_response>"
  assert chat.render(messages).endswith(want + "<tool_response>rain</tool_response>")


WEATHER = {
  "name": "weather",
  "parameters": {"type": "object", "properties": {"note": {"type": "string"}, "days": {"type": "integer"}}},
}
NON_STRING_ARGS = {
  "days": 3,
  "scale": -0.5,
  "metric": True,
  "station": None,
  "hours": [6, 12, [18]],
  "place": {"city": "北京", "near": ["Tiānjīn", "Bǎodìng"]},
  "note": 'naïve "quotes" <kept>',
}
NON_STRING_TEXT = (
  "<tool_call>weather<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>scale</arg_key><arg_value>-0.5</arg_value>"
  "<arg_key>metric</arg_key><arg_value>true</arg_value><arg_key>station</arg_key><arg_value>null</arg_value>"
  "<arg_key>hours</arg_key><arg_value>[6, 12, [18]]</arg_value><arg_key>place</arg_key>"
  '<arg_value>{"city": "北京", "near": ["Tiānjīn", "Bǎodìng"]}</arg_value>'
  '<arg_key>note</arg_key><arg_value>naïve "quotes" <kept></arg_value></tool_call>'
)


def weather(arguments):
  return [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call("weather", arguments)]}]


def test_non_string_arguments_are_json_without_ascii_escapes_and_strings_are_raw():
  messages = weather(NON_STRING_ARGS)
  want = "[gMASK]<sop><|user|>Weather?<|assistant|></think>" + NON_STRING_TEXT
  assert chat.render(messages) == want


def test_arguments_as_a_json_string_render_as_the_dict_does():
  for text in (json.dumps(NON_STRING_ARGS), json.dumps(NON_STRING_ARGS, ensure_ascii=False, indent=2)):
    assert chat.render(weather(text)) == chat.render(weather(NON_STRING_ARGS))


def test_a_system_message_with_tools_follows_the_tools_block():
  messages = [{"role": "system", "content": "Be terse. "}, {"role": "user", "content": "Hi"}]
  want = "[gMASK]<sop>" + TOOLS_BLOCK + "<|system|>Be terse. <|user|>Hi<|assistant|><think>"
  assert chat.render(messages, tools=[CALC, SEARCH], add_generation_prompt=True) == want
  assert chat.render(messages, tools=[]) == "[gMASK]<sop><|system|>Be terse. <|user|>Hi"


def test_content_forms():
  messages = [
    {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image_url"}, "here"]},
    {"role": "assistant", "content": None, "reasoning_content": ""},
    {"role": "assistant", "content": "  Done.\n", "reasoning_content": "  whitespace around  "},
  ]
  # content None renders nothing (the template under jinja2 would print "None"; vLLM and sglang pass "").
  want = "[gMASK]<sop><|user|>Look: here<|assistant|></think><|assistant|><think>whitespace around</think>Done."
  assert chat.render(messages) == want


# Each conversation with the tools it is rendered with; parse_assistant must give back its assistant turns.
CONVERSATIONS = [
  ([USER, ASK_CALC, RESULT], None),
  (CHAIN, [CALC]),
  (TWO_CALLS, [SEARCH]),
  (weather(NON_STRING_ARGS), [WEATHER]),
  (weather(json.dumps(NON_STRING_ARGS)), [WEATHER]),
]


def as_parsed(message):
  """What parse_assistant should return for an assistant message written with reasoning_content."""
  calls = []
  for c in message.get("tool_calls", []):
    fn = c.get("function", c)
    args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
    calls.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
  reasoning, content = (message.get(k) or "" for k in ("reasoning_content", "content"))
  out = {"role": "assistant", "reasoning_content": reasoning.strip(), "content": content.strip()}
  return {**out, "tool_calls": calls, "errors": []}


@pytest.mark.parametrize("messages, tools", CONVERSATIONS)
def test_parse_assistant_recovers_each_rendered_assistant_turn(messages, tools):
  turns = 0
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    turns += 1
    full = chat.render(messages[: i + 1], tools=tools)
    turn = full[len(chat.render(messages[:i], tools=tools)) :]
    assert turn.startswith("<|assistant|>")
    assert chat.parse_assistant(turn[len("<|assistant|>") :], tools=tools) == as_parsed(message)
    prompt = chat.render(messages[:i], tools=tools, add_generation_prompt=True)
    if message.get("reasoning_content"):  # the model's own completion: what follows the generation prompt
      assert full.startswith(prompt)
      assert chat.parse_assistant(full[len(prompt) :], tools=tools) == as_parsed(message)
  assert turns


def test_parse_reasoning_content_and_thinking_off():
  got = chat.parse_assistant("Think first.\n</think>\nThe answer is 4.")
  assert (got["reasoning_content"], got["content"], got["tool_calls"]) == ("Think first.", "The answer is 4.", [])
  got = chat.parse_assistant("The answer is 4.")  # thinking off: the prompt ended with </think>
  assert (got["reasoning_content"], got["content"]) == ("", "The answer is 4.")


LOOKUP = {
  "name": "lookup",
  "parameters": {
    "type": "object",
    "properties": {"code": {"type": "string"}, "zip": {"type": "string"}, "n": {"type": "integer"}},
  },
}


def test_string_typed_parameters_stay_raw_and_others_are_json_or_raw():
  text = (
    "</think><tool_call>lookup<arg_key>code</arg_key><arg_value>007</arg_value><arg_key>zip</arg_key>"
    "<arg_value>12345</arg_value><arg_key>n</arg_key><arg_value>12345</arg_value><arg_key>extra</arg_key>"
    "<arg_value>twelve</arg_value></tool_call>"
  )
  args = chat.parse_assistant(text, tools=[LOOKUP])["tool_calls"][0]["function"]["arguments"]
  assert args == {"code": "007", "zip": "12345", "n": 12345, "extra": "twelve"}
  assert [type(v) for v in args.values()] == [str, str, int, str]
  # Without a schema every value that reads as JSON is parsed: "12345" comes back as a number.
  args = chat.parse_assistant(text)["tool_calls"][0]["function"]["arguments"]
  assert args == {"code": "007", "zip": 12345, "n": 12345, "extra": "twelve"}


def test_glm45_layout_with_newlines_between_tags_parses_too():
  text = "</think>\n<tool_call>calc\n<arg_key>expr</arg_key>\n<arg_value>1+1</arg_value>\n</tool_call>"
  assert chat.parse_assistant(text, tools=[CALC])["tool_calls"] == [call("calc", {"expr": "1+1"})]


def test_malformed_tool_calls_are_returned_as_errors_beside_the_good_ones():
  bad_arg = "<tool_call>calc<arg_key>expr</arg_key></tool_call>"
  good = "<tool_call>calc<arg_key>expr</arg_key><arg_value>1+1</arg_value></tool_call>"
  unknown = "<tool_call>rm<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>"
  twice = (
    "<tool_call>calc<arg_key>expr</arg_key><arg_value>1</arg_value><arg_key>expr</arg_key><arg_value>2</arg_value>"
  )
  twice += "</tool_call>"
  nameless = "<tool_call><arg_key>expr</arg_key><arg_value>1</arg_value></tool_call>"
  reopened = "<tool_call>calc<arg_key>expr</arg_key><arg_value>3"
  unclosed = "<tool_call>calc<arg_key>expr</arg_key><arg_value>2+2"
  text = "Reason.</think>Let me try. " + bad_arg + good + unknown + twice + nameless + reopened + good + unclosed
  got = chat.parse_assistant(text, tools=[CALC])
  assert got["reasoning_content"] == "Reason."
  assert got["content"] == "Let me try."
  assert got["tool_calls"] == [call("calc", {"expr": "1+1"})] * 2
  assert got["errors"] == [
    {
      "index": 0,
      "text": bad_arg,
      "error": "tool call 0: argument 0: expected <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>, got "
      "'<arg_key>expr</arg_key>'",
    },
    {"index": 2, "text": unknown, "error": "tool call 2: 'rm' is not an offered tool; offered: 'calc'"},
    {"index": 3, "text": twice, "error": "tool call 3: argument 1: 'expr' is given twice"},
    {"index": 4, "text": nameless, "error": "tool call 4: expected the tool's name before the first <arg_key>, got ''"},
    {"index": 5, "text": reopened, "error": "tool call 5: no closing </tool_call>"},
    {"index": 7, "text": unclosed, "error": "tool call 7: no closing </tool_call>"},
  ]


def test_a_missing_end_of_value_is_malformed_not_swallowed():
  text = "</think><tool_call>calc<arg_key>expr</arg_key><arg_value>1<arg_key>digits</arg_key><arg_value>2</arg_value>"
  text += "</tool_call>"
  got = chat.parse_assistant(text)
  assert got["tool_calls"] == []
  assert got["errors"][0]["error"].startswith("tool call 0: argument 0: expected <arg_key>KEY</arg_key>")


def user_then(assistant):
  return [{"role": "user", "content": "Hi"}, {"role": "assistant", **assistant}]


BAD_RENDER = [
  (
    {"messages": [{"role": "developer", "content": "x"}]},
    "messages[0].role: 'developer' is not a role of GLM-5's chat format; valid: 'system', 'user', 'assistant', 'tool'",
  ),
  (
    {"messages": [{"content": "x"}]},
    "messages[0].role: None is not a role of GLM-5's chat format; valid: 'system', 'user', 'assistant', 'tool'",
  ),
  (
    {"messages": user_then({"tool_calls": [call("rm", {"path": "/"})]}), "tools": [CALC, SEARCH]},
    "messages[1].tool_calls[0].function.name: 'rm' is not an offered tool; offered: 'calc', 'search'",
  ),
  (
    {"messages": user_then({"tool_calls": [call("calc", [1, 2], wrapped=False)]})},
    "messages[1].tool_calls[0].arguments: expected an object or a JSON string of one, got [1, 2]",
  ),
  (
    {"messages": user_then({"tool_calls": [call("calc", '"1+1"')]})},
    "messages[1].tool_calls[0].function.arguments: expected an object or a JSON string of one, got '\"1+1\"'",
  ),
  (
    {"messages": user_then({"tool_calls": [call("calc", "{expr: 1}")]})},
    "messages[1].tool_calls[0].function.arguments: expected an object or a JSON string of one, got '{expr: 1}'",
  ),
  (
    {"messages": user_then({"tool_calls": [{"type": "function", "id": "c1"}]})},
    "messages[1].tool_calls[0]: expected a tool call with a name, got {'type': 'function', 'id': 'c1'}; valid: "
    '{"type": "function", "function": {"name": ..., "arguments": {...}}} or {"name": ..., "arguments": {...}}',
  ),
  (
    {"messages": [{"role": "user", "content": 5}]},
    "messages[0].content: expected a string, a list of text parts or None, got 5",
  ),
  (
    {"messages": user_then({"reasoning_content": ["a"]})},
    "messages[1].reasoning_content: expected a string or None, got ['a']",
  ),
  (
    {"messages": [{"role": "tool", "content": None}]},
    'messages[0].content: expected a string or a list of strings or {"output": string}, got None',
  ),
  (
    {"messages": [{"role": "tool", "content": [{"type": "text", "text": "x"}]}]},
    'messages[0].content[0]: expected a string or {"output": string}, got {\'type\': \'text\', \'text\': \'x\'}',
  ),
]
BAD_TOOLS = [
  ({"name": "calc"}, "tools: expected a list of function definitions, got {'name': 'calc'}; " + TOOL_SHAPES),
  (["calc"], "tools[0]: expected a function definition, got 'calc'; " + TOOL_SHAPES),
  (
    [{"type": "retrieval", "function": {"name": "calc"}}],
    "tools[0].type: 'retrieval', only 'function' tools exist; " + TOOL_SHAPES,
  ),
  ([{"description": "no name"}], "tools[0].name: expected a non-empty string, got None; " + TOOL_SHAPES),
  (
    [{"type": "function", "function": {"name": "calc", "parameters": {"type": "array"}}}],
    "tools[0].function.parameters: expected a JSON schema of an object, got {'type': 'array'}; " + TOOL_SHAPES,
  ),
  (
    [{"name": "calc", "parameters": {"type": "object", "properties": {"expr": "string"}}}],
    "tools[0].parameters: expected a JSON schema of an object, got {'type': 'object', 'properties': {'expr': "
    "'string'}}; " + TOOL_SHAPES,
  ),
  ([CALC, {"name": "calc"}], "tools[1].name: 'calc' is offered twice"),
]


@pytest.mark.parametrize("kwargs, message", BAD_RENDER)
def test_bad_messages_name_the_message_and_field(kwargs, message):
  with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
    chat.render(**kwargs)


@pytest.mark.parametrize("tools, message", BAD_TOOLS)
def test_bad_tool_schemas_name_the_tool_and_field(tools, message):
  for fn in (lambda: chat.render([], tools=tools), lambda: chat.parse_assistant("", tools=tools)):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
      fn()
