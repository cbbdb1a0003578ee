"""DeepSeek's DSML tool-call markup (V3.2 and V4): the tools section of the system prompt, an assistant turn's calls,
and the parser that turns a reply's calls back into OpenAI `tool_calls`.

The format is DeepSeek's own (`encoding/encoding_dsv32.py` in DeepSeek-V3.2, `encoding/encoding_dsv4.py` in
DeepSeek-V4-Flash), written here from their description and checked against their encoders' output
(tests/test_chat.py). A reply calls tools in one block after its text:

    \\n\\n<｜DSML｜function_calls>                 (V4: tool_calls)
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

A string argument is written as is (string="true"); any other value as JSON (string="false").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from dsconv.errors import ChatError

DSML = "｜DSML｜"

_V32_TOOLS = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml}function_calls>" block like the following as part of your reply to the user:
<{dsml}function_calls>
<{dsml}invoke name="$FUNCTION_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$FUNCTION_NAME2">
...
</{dsml}invoke>
</{dsml}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{dsml}function_calls>
...
</{dsml}function_calls>

<function_results>
...
</function_results>

<think>...thinking about results</think>

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

_V4_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ToolCallError(ValueError):
    """Tool-call text that does not follow the format (the reply is then returned as text)."""


@dataclass(frozen=True)
class Dialect:
    """One family's DSML: the name of its calls block, its tools section, and the name xgrammar's built-in
    structural tags give its tool-call format (constrained decoding of tool_choice "required")."""
    block: str
    tools_template: str
    structural_tag_model: str

    @property
    def start(self) -> str:
        return f"<{DSML}{self.block}>"

    @property
    def end(self) -> str:
        return f"</{DSML}{self.block}>"

    def tools_section(self, functions: list[dict]) -> str:
        """The system prompt's tools section: each function's schema as one line of JSON."""
        schemas = "\n".join(json.dumps(function, ensure_ascii=False) for function in functions)
        return self.tools_template.replace("{dsml}", DSML).replace("{schemas}", schemas)

    def render_calls(self, calls: list[dict]) -> str:
        """An assistant turn's OpenAI tool_calls as the block that follows its text."""
        invokes = [_invoke(call) for call in calls]
        return f"\n\n{self.start}\n" + "\n".join(invokes) + f"\n{self.end}"

    def parse_calls(self, block: str) -> list[dict]:
        """The text between the start and end markers -> OpenAI tool_calls (fresh ids); ToolCallError when it does
        not follow the format."""
        calls, at = [], 0
        for match in _INVOKE.finditer(block):
            if block[at:match.start()].strip():
                raise ToolCallError(f"unexpected text between calls: {block[at:match.start()]!r:.60}")
            calls.append(_call(match.group(1), match.group(2)))
            at = match.end()
        if block[at:].strip() or not calls:
            raise ToolCallError("no complete call" if not calls else f"unexpected text: {block[at:]!r:.60}")
        return calls


V32 = Dialect("function_calls", _V32_TOOLS, "deepseek_v3_2")
V4 = Dialect("tool_calls", _V4_TOOLS, "deepseek_v4")

# A call's markup, piece by piece (the streaming parser reads the pieces as they decode)
INVOKE_HEAD = re.compile(rf'<{DSML}invoke name="([^"\n]*)">\n?')
PARAMETER_HEAD = re.compile(rf'<{DSML}parameter name="([^"\n]*)" string="(true|false)">')
INVOKE_END, PARAMETER_END = f"</{DSML}invoke>", f"</{DSML}parameter>"
_INVOKE = re.compile(INVOKE_HEAD.pattern + "(.*?)" + re.escape(INVOKE_END), re.DOTALL)
_PARAMETER = re.compile(PARAMETER_HEAD.pattern + "(.*?)" + re.escape(PARAMETER_END), re.DOTALL)


def _invoke(call: dict) -> str:
    function = call["function"]
    arguments = json.loads(function["arguments"]) if function["arguments"] else {}
    params = []
    for key, value in arguments.items():
        is_text = isinstance(value, str)
        text = value if is_text else json.dumps(value, ensure_ascii=False)
        params.append(f'<{DSML}parameter name="{key}" string="{"true" if is_text else "false"}">{text}'
                      f'</{DSML}parameter>')
    return f'<{DSML}invoke name="{function["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>"


def _call(name: str, body: str) -> dict:
    arguments: dict[str, Any] = {}
    at = 0
    for match in _PARAMETER.finditer(body):
        if body[at:match.start()].strip():
            raise ToolCallError(f"unexpected text in call {name!r}: {body[at:match.start()]!r:.60}")
        key, is_text, value = match.groups()
        if key in arguments:
            raise ToolCallError(f"call {name!r} repeats parameter {key!r}")
        if is_text == "true":
            arguments[key] = value
        else:
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError:
                raise ToolCallError(f"call {name!r}: parameter {key!r} is not JSON: {value!r:.60}") from None
        at = match.end()
    if body[at:].strip():
        raise ToolCallError(f"unexpected text in call {name!r}: {body[at:]!r:.60}")
    if not name:
        raise ToolCallError("a call without a name")
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def check_arguments(arguments: Any, where: str) -> dict:
    """An assistant message's function.arguments (a JSON object as text) -> the object."""
    if not isinstance(arguments, str):
        raise ChatError(f"{where}.function.arguments must be a JSON object as text, got {type(arguments).__name__}")
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as exc:
        raise ChatError(f"{where}.function.arguments is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ChatError(f"{where}.function.arguments must be a JSON object, got {type(value).__name__}")
    return value
