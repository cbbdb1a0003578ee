"""A chat reply's tool calls (family/dsml.py's format) split from its text, whole and while it streams.

The calls block follows the reply's text. While the reply streams, the text is sent up to where a block may begin
(a tail that may be the start of the block's marker, and trailing whitespace, are held back); the block itself is
never sent as text. When the reply ends, a block that parses becomes `tool_calls` (`finish_reason: "tool_calls"`);
anything else (no block, an unfinished or malformed one, text after it) is the reply's text, as is: a model's
malformed call is the client's to see, never a server error.

While the block streams, each call is sent as vLLM and SGLang send it: a first delta with its id, type and function
name once `<invoke name="...">` has been decoded, then fragments of its arguments as its parameters decode, which
concatenate to the final arguments JSON (`json.dumps` of the parsed parameters). A string value streams as it
decodes (JSON-escaped, a tail that may begin the closing tag held back); any other value is sent when its closing
tag arrives. A block that turns out malformed leaves the deltas already sent; its text then arrives as content,
as in the whole response.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from dsconv.family.dsml import (INVOKE_END, INVOKE_HEAD, PARAMETER_END, PARAMETER_HEAD, Dialect,
                                ToolCallError)
from dsconv.runner.entrypoints.openai.choice import partial_tail


@dataclass(frozen=True)
class Reply:
    content: str  # the text before the calls; all of it when there are none
    calls: list[dict] = field(default_factory=list)  # OpenAI tool_calls


def split_calls(dialect: Dialect, text: str) -> Reply:
    """A finished reply's text (after any reasoning) -> its text and calls."""
    at = text.find(dialect.start)
    if at < 0:
        return Reply(text)
    end = text.find(dialect.end, at)
    if end < 0 or text[end + len(dialect.end):].strip():
        return Reply(text)
    try:
        calls = dialect.parse_calls(text[at + len(dialect.start):end])
    except ToolCallError:
        return Reply(text)
    return Reply(text[:at].rstrip(), calls)


def sendable(dialect: Dialect, text: str) -> str:
    """What of an unfinished reply's text may be streamed now: never a calls block, nor a tail that may begin one
    (trailing whitespace included: a block strips it from the text before it)."""
    at = text.find(dialect.start)
    head = text[:at] if at >= 0 else text[:len(text) - partial_tail(text, (dialect.start,))]
    return head.rstrip()


@dataclass(frozen=True)
class PartialCall:
    name: str
    arguments: str  # what of the arguments JSON is final so far: always a prefix of the call's final arguments


def partial_calls(dialect: Dialect, text: str) -> list[PartialCall]:
    """The calls of an unfinished reply's text (after any reasoning) as far as they have been decoded, each with the
    part of its arguments that can no longer change. Parsing stops at the first thing that is not (yet) the format:
    what follows is sent, if at all, when the reply ends."""
    at = text.find(dialect.start)
    if at < 0:
        return []
    block = text[at + len(dialect.start):]
    calls, pos = [], 0
    while True:
        pos = _skip_space(block, pos)
        head = INVOKE_HEAD.match(block, pos)
        if head is None or not head.group(1):
            return calls
        name, pos = head.group(1), head.end()
        arguments, pos, closed = _partial_arguments(block, pos)
        calls.append(PartialCall(name, arguments))
        if not closed:
            return calls


def _partial_arguments(block: str, pos: int) -> tuple[str, int, bool]:
    """(the final part of one call's arguments JSON, where its invoke ends, whether it has ended) from `pos`, just
    after its `<invoke name=...>`."""
    parts = []
    while True:
        pos = _skip_space(block, pos)
        if block.startswith(INVOKE_END, pos):
            return ("".join(parts) + "}" if parts else "{}"), pos + len(INVOKE_END), True
        head = PARAMETER_HEAD.match(block, pos)
        if head is None:
            return "".join(parts), pos, False
        key, is_text = head.group(1), head.group(2) == "true"
        opening = ("{" if not parts else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        end = block.find(PARAMETER_END, head.end())
        if end < 0:  # the value is still decoding: a string's text so far, minus a tail that may close it
            value = block[head.end():]
            if is_text:
                value = value[:len(value) - partial_tail(value, (PARAMETER_END,))]
                parts.append(opening + '"' + _escaped(value))
            return "".join(parts), pos, False
        value = block[head.end():end]
        if is_text:
            parts.append(opening + '"' + _escaped(value) + '"')
        else:
            try:
                parts.append(opening + json.dumps(json.loads(value), ensure_ascii=False))
            except json.JSONDecodeError:  # malformed: the whole reply says what it is when it ends
                return "".join(parts), pos, False
        pos = end + len(PARAMETER_END)


def _escaped(text: str) -> str:
    """A string's JSON text without its quotes: escaping is per character, so pieces concatenate to the whole."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class CallStream:
    """One choice's calls as sent so far: each call's id and how much of its arguments."""

    def __init__(self):
        self.ids: list[str] = []
        self.sent: list[str] = []

    def deltas(self, calls: list[PartialCall]) -> list[dict]:
        """The tool_calls deltas that bring the client from what it has to `calls`."""
        out = []
        for index, call in enumerate(calls):
            if index == len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.sent.append(call.arguments)
                out.append({"index": index, "id": self.ids[index], "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > len(self.sent[index]):
                if not call.arguments.startswith(self.sent[index]):
                    raise RuntimeError(f"call {index}'s arguments changed after they were sent: "
                                       f"{self.sent[index]!r:.60} -> {call.arguments!r:.60}")
                out.append({"index": index, "function": {"arguments": call.arguments[len(self.sent[index]):]}})
                self.sent[index] = call.arguments
        return out

    def final(self, calls: list[dict]) -> list[dict]:
        """The last deltas, from the whole reply's parsed calls (ToolCallError-free: split_calls parsed them), and
        the calls under the ids the stream gave them."""
        return self.deltas([PartialCall(c["function"]["name"], c["function"]["arguments"]) for c in calls])
