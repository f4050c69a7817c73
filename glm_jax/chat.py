"""GLM-5's chat format, at the string level: `render` OpenAI-style messages to the prompt text and
`parse_assistant` what the model writes back (docs/glm5_facts.md section 8). Tokenization is not done here:
`Tokenizer.encode_chat` (glm_jax/data/tokenizer.py) reads each of FORMAT_TOKENS as one id.

`render` gives exactly what GLM-5's released chat template (GLM-4.7's, on the zai-org model cards) gives under
transformers (jinja2 with trim_blocks and lstrip_blocks; `tojson` is json.dumps without ASCII escaping), with the
deviations marked "Deviation" below. The layout:

- `[gMASK]<sop>`; with tools, a `<|system|>` block: "# Tools", each tool as given, as JSON, one a line inside
  `<tools></tools>`, then the call format. Each turn is its role token and its text, with no end-of-turn token.
- user and system turns: `<|user|>TEXT`, `<|system|>TEXT` (as given, not stripped).
- assistant turns: `<|assistant|>`, then `<think>REASONING</think>` when the turn comes after the last user message
  (interleaved thinking: a tool chain keeps its reasoning) or with clear_thinking=False (preserved thinking), else a
  bare `</think>`; then the content, stripped; then each call as
  `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` (V raw for a string, else JSON).
  Reasoning comes from `reasoning_content`, or else from `<think>...</think>` inside the content.
- tool results: one `<|observation|>` before a run of tool messages, each result `<tool_response>TEXT</tool_response>`.
- the generation prompt: `<|assistant|><think>`, or `<|assistant|></think>` with enable_thinking=False.

One user turn, a call with reasoning, its result and the generation prompt (one line, broken here):

  [gMASK]<sop><|user|>What is 37*91?<|assistant|><think>Use the calculator.</think>
  <tool_call>calc<arg_key>expr</arg_key><arg_value>37*91</arg_value><arg_key>digits</arg_key><arg_value>3</arg_value>
  </tool_call><|observation|><tool_response>3367</tool_response><|assistant|><think>

`parse_assistant` reads what follows the generation prompt (or `<|assistant|>`) up to a stop string. A malformed
tool call does not raise: it is left out of "tool_calls" and reported in "errors", so an agent loop can return it
to the model as an observation. Bad input to `render` (and bad tool schemas) raise ValueError naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
STOP_STRINGS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # where generation stops
# The format's own special tokens, each one id in a tokenizer that can chat (glm_jax/data/tokenizer.py), besides
# [gMASK], <sop> and <|endoftext|>, which every tokenizer of ours has (glm_jax/data/special_tokens.py).
FORMAT_TOKENS = (
  "<|system|>",
  "<|user|>",
  "<|assistant|>",
  "<|observation|>",
  "<think>",
  "</think>",
  "<tool_call>",
  "</tool_call>",
  "<arg_key>",
  "</arg_key>",
  "<arg_value>",
  "</arg_value>",
  "<tool_response>",
  "</tool_response>",
)

_TOOLS_HEAD = (
  "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_TAIL = (
  "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
  "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
  "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)
_TOOL_SHAPES = (
  'valid: {"type": "function", "function": {"name": ..., "parameters": {"type": "object", "properties": {...}}}} '
  'or the bare {"name": ..., "parameters": {...}}'
)
_CALL_SHAPES = (
  'valid: {"type": "function", "function": {"name": ..., "arguments": {...}}} or {"name": ..., "arguments": {...}}'
)
_ARG = re.compile(r"\s*<arg_key>([^<>]*)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _show(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def _function_defs(tools: Any) -> dict[str, dict]:
  """{name: function definition} of the offered tools, each checked to be a JSON-schema function definition."""
  if not isinstance(tools, (list, tuple)):
    raise ValueError(f"tools: expected a list of function definitions, got {_show(tools)}; {_TOOL_SHAPES}")
  defs = {}
  for i, tool in enumerate(tools):
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
      raise ValueError(f"{where}: expected a function definition, got {_show(tool)}; {_TOOL_SHAPES}")
    fn = tool
    if "function" in tool:
      if tool.get("type") != "function":
        raise ValueError(f"{where}.type: {_show(tool.get('type'))}, only 'function' tools exist; {_TOOL_SHAPES}")
      fn, where = tool["function"], f"{where}.function"
      if not isinstance(fn, dict):
        raise ValueError(f"{where}: expected a function definition, got {_show(fn)}; {_TOOL_SHAPES}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
      raise ValueError(f"{where}.name: expected a non-empty string, got {_show(fn.get('name'))}; {_TOOL_SHAPES}")
    params = fn.get("parameters", {})
    props = params.get("properties", {}) if isinstance(params, dict) else None
    if (
      not isinstance(params, dict)
      or params.get("type", "object") != "object"
      or not isinstance(props, dict)
      or not all(isinstance(p, dict) for p in props.values())
    ):
      raise ValueError(f"{where}.parameters: expected a JSON schema of an object, got {_show(params)}; {_TOOL_SHAPES}")
    if fn["name"] in defs:
      raise ValueError(f"{where}.name: {fn['name']!r} is offered twice")
    defs[fn["name"]] = fn
  return defs


def _text(content: Any, where: str) -> str:
  """The template's visible text: a string, or the text parts of a list (other parts, e.g. images, dropped)."""
  if content is None:
    return ""  # Deviation: jinja2 prints None as "None"; vLLM and sglang hand the template "" instead
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = [p if isinstance(p, str) else p.get("text", "") for p in content if isinstance(p, str) or _is_text(p)]
    return "".join(parts)
  raise ValueError(f"{where}: expected a string, a list of text parts or None, got {_show(content)}")


def _is_text(part: Any) -> bool:
  return isinstance(part, dict) and part.get("type") == "text"


def _tool_call(call: Any, where: str, offered: dict | None) -> tuple[str, dict]:
  """(name, arguments as a dict) of one tool call, OpenAI-shaped or bare; arguments may be a JSON string."""
  fn = call.get("function") if isinstance(call, dict) and call.get("function") else call
  where = f"{where}.function" if fn is not call else where
  if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
    raise ValueError(f"{where}: expected a tool call with a name, got {_show(call)}; {_CALL_SHAPES}")
  if offered is not None and fn["name"] not in offered:
    raise ValueError(f"{where}.name: {fn['name']!r} is not an offered tool; offered: {', '.join(map(repr, offered))}")
  args = fn.get("arguments")
  if isinstance(args, str):  # OpenAI sends a JSON string; the template wants a mapping (vLLM parses it the same way)
    try:
      args = json.loads(args)
    except json.JSONDecodeError:
      pass
  if not isinstance(args, dict):
    raise ValueError(f"{where}.arguments: expected an object or a JSON string of one, got {_show(fn.get('arguments'))}")
  return fn["name"], args


def _assistant(message: dict, where: str, keep_reasoning: bool, offered: dict | None) -> str:
  content = _text(message.get("content"), f"{where}.content")
  reasoning = message.get("reasoning_content")
  if reasoning is not None and not isinstance(reasoning, str):
    raise ValueError(f"{where}.reasoning_content: expected a string or None, got {_show(reasoning)}")
  if reasoning is None and "</think>" in content:  # the template's split: before the first </think>, after the last
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    content = content.split("</think>")[-1].lstrip("\n")
  # A dropped or empty reasoning leaves a bare </think>, as the released template and the facts have it (a proposed
  # fix, GLM-4.7 model-card discussion #46, would drop it; later GLM-5.x templates write <think></think>).
  out = "<|assistant|>" + (f"<think>{reasoning.strip()}</think>" if keep_reasoning and reasoning else "</think>")
  out += content.strip()
  calls = message.get("tool_calls") or []
  if not isinstance(calls, list):
    raise ValueError(f"{where}.tool_calls: expected a list of tool calls, got {_show(calls)}; {_CALL_SHAPES}")
  for j, call in enumerate(calls):
    name, args = _tool_call(call, f"{where}.tool_calls[{j}]", offered)
    pairs = (f"<arg_key>{k}</arg_key><arg_value>{_value(v)}</arg_value>" for k, v in args.items())
    out += f"<tool_call>{name}{''.join(pairs)}</tool_call>"
  return out


def _value(value: Any) -> str:
  return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tool(message: dict, where: str, after_tool: bool) -> str:
  content = message.get("content")
  if isinstance(content, str):
    return ("" if after_tool else "<|observation|>") + f"<tool_response>{content}</tool_response>"
  if not isinstance(content, list):
    raise ValueError(
      f'{where}.content: expected a string or a list of strings or {{"output": string}}, got {_show(content)}'
    )
  out = "<|observation|>"  # the template's list branch opens its own <|observation|>, even after another tool message
  for j, item in enumerate(content):
    text = item.get("output") if isinstance(item, dict) else item
    if not isinstance(text, str):  # Deviation: the template would print the Python repr of anything else
      raise ValueError(f'{where}.content[{j}]: expected a string or {{"output": string}}, got {_show(item)}')
    out += f"<tool_response>{text}</tool_response>"
  return out


def render(
  messages: list[dict],
  *,
  tools: list[dict] | None = None,
  add_generation_prompt: bool = False,
  enable_thinking: bool = True,
  clear_thinking: bool = True,
) -> str:
  """The prompt text of `messages` (OpenAI-style dicts with roles system, user, assistant, tool), as GLM-5's chat
  template renders it. With `tools`, every tool call must name an offered tool."""
  return "".join(
    render_pieces(
      messages,
      tools=tools,
      add_generation_prompt=add_generation_prompt,
      enable_thinking=enable_thinking,
      clear_thinking=clear_thinking,
    )
  )


def render_pieces(
  messages: list[dict],
  *,
  tools: list[dict] | None = None,
  add_generation_prompt: bool = False,
  enable_thinking: bool = True,
  clear_thinking: bool = True,
) -> list[str]:
  """`render`'s text in pieces: [the head ("[gMASK]<sop>" and the tools' system block), one piece a message, then
  the generation prompt when asked]. Each piece but the head starts with a format token."""
  offered = _function_defs(tools) if tools is not None else None
  if not isinstance(messages, (list, tuple)):
    raise ValueError(f"messages: expected a list of message dicts, got {_show(messages)}")
  roles = []
  for i, m in enumerate(messages):
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ROLES:
      got = f"{role!r} is not a role of" if isinstance(m, dict) else f"{_show(m)} is not a message of"
      raise ValueError(f"messages[{i}].role: {got} GLM-5's chat format; valid: {', '.join(map(repr, ROLES))}")
    roles.append(role)
  last_user = max((i for i, r in enumerate(roles) if r == "user"), default=-1)
  out = ["[gMASK]<sop>"]
  if tools:
    out[0] += "".join([_TOOLS_HEAD, *(json.dumps(t, ensure_ascii=False) + "\n" for t in tools), _TOOLS_TAIL])
  for i, (m, role) in enumerate(zip(messages, roles)):
    where = f"messages[{i}]"
    if role in ("system", "user"):
      out.append(f"<|{role}|>" + _text(m.get("content"), f"{where}.content"))
    elif role == "assistant":
      out.append(_assistant(m, where, not clear_thinking or i > last_user, offered or None))
    else:
      out.append(_tool(m, where, i > 0 and roles[i - 1] == "tool"))
  if add_generation_prompt:
    out.append("<|assistant|>" + ("<think>" if enable_thinking else "</think>"))
  return out


def _argument(value: str, schema: dict) -> Any:
  """A parameter typed "string" stays raw (vLLM keeps it raw too, but stripped; sglang JSON-decodes it first);
  any other is JSON when it reads as JSON, else the raw string."""
  if schema.get("type") == "string":
    return value
  try:
    return json.loads(value)
  except ValueError:
    return value


def _parse_call(block: str, offered: dict | None) -> dict:
  """One `NAME<arg_key>K</arg_key><arg_value>V</arg_value>...` (the text inside <tool_call></tool_call>) as an
  OpenAI tool call; raises ValueError saying what is malformed."""
  name, tag, rest = block.partition("<arg_key>")
  name, rest = name.strip(), tag + rest
  if not name or "<" in name or ">" in name:
    raise ValueError(f"expected the tool's name before the first <arg_key>, got {_show(name)}")
  if offered is not None and name not in offered:
    raise ValueError(f"{name!r} is not an offered tool; offered: {', '.join(map(repr, offered))}")
  props = (offered or {}).get(name, {}).get("parameters", {}).get("properties", {})
  args, pos = {}, 0
  while rest[pos:].strip():
    m = _ARG.match(rest, pos)
    if not m or "<arg_value>" in m[2] or "<arg_key>" in m[2]:
      raise ValueError(
        f"argument {len(args)}: expected <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>, got {_show(rest[pos:])}"
      )
    key = m[1].strip()
    if key in args:
      raise ValueError(f"argument {len(args)}: {key!r} is given twice")
    args[key] = _argument(m[2], props.get(key, {}))
    pos = m.end()
  return {"type": "function", "function": {"name": name, "arguments": args}}


def parse_assistant(text: str, *, tools: list[dict] | None = None) -> dict:
  """An assistant message from what the model wrote after the generation prompt (a leading `<think>` is allowed,
  so the text after `<|assistant|>` parses too), without the stop string.

  Returns {"role": "assistant", "reasoning_content", "content", "tool_calls", "errors"}: reasoning is the text
  before `</think>` (none without one: thinking was off); content is the text outside the tool calls, and both
  are stripped, as `render` strips them. "tool_calls" are OpenAI-shaped with arguments as a dict (no ids).
  "errors" lists each malformed call, {"index": its place among the calls, "text": its raw text, "error": why};
  they are not in "tool_calls". Given `tools`, a call must name one of them, and a parameter typed "string" in its
  schema stays raw; without a schema, a value that reads as JSON is parsed ("3" comes back as 3).
  """
  offered = _function_defs(tools) if tools else None
  reasoning, end_think, rest = text.removeprefix("<think>").partition("</think>")
  if not end_think:
    reasoning, rest = "", reasoning
  content, calls, errors = [], [], []
  pos = 0
  while (start := rest.find("<tool_call>", pos)) != -1:
    content.append(rest[pos:start])
    end, after = rest.find("</tool_call>", start), rest.find("<tool_call>", start + 1)
    if end != -1 and -1 < after < end:  # a call opened before this one closed: this one is unclosed
      end = -1
    pos = (len(rest) if after == -1 else after) if end == -1 else end + len("</tool_call>")
    index, raw = len(calls) + len(errors), rest[start:pos]
    try:
      if end == -1:
        raise ValueError("no closing </tool_call>")
      calls.append(_parse_call(rest[start + len("<tool_call>") : end], offered))
    except ValueError as e:
      errors.append({"index": index, "text": raw, "error": f"tool call {index}: {e}"})
  content.append(rest[pos:])
  return {
    "role": "assistant",
    "reasoning_content": reasoning.strip(),
    "content": "".join(content).strip(),
    "tool_calls": calls,
    "errors": errors,
  }
