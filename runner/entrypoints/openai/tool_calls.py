"""A chat reply's tool calls (family/dsml.py's format) split from its text, whole and while it streams.

The calls block follows the reply's text. While the reply streams, the text is sent up to where a block may begin
(a tail that may be the start of the block's marker, and trailing whitespace, are held back); the block itself is
never sent as text. When the reply ends, a block that parses becomes `tool_calls` (`finish_reason: "tool_calls"`);
anything else (no block, an unfinished or malformed one, text after it) is the reply's text, as is: a model's
malformed call is the client's to see, never a server error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsconv.family.dsml import Dialect, ToolCallError
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


def call_deltas(calls: list[dict]) -> list[dict]:
    """Stream deltas of whole calls, as the openai SDK's stream accumulation reads them (index, id, type, name,
    arguments in one piece)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]
