"""Chat messages as OpenAI's API accepts them, made what the family's chat encoding (family/chat.py) renders."""

from __future__ import annotations

from typing import Any

from dsconv.errors import InputError

# Message fields OpenAI's spec allows that DeepSeek's chat encodings have no place for: dropped. `name` tells
# participants apart (DeepSeek's encoders render none); an assistant message read back from a response carries
# `refusal` and `annotations` (URL citations of its text) as well.
DROPPED_MESSAGE_FIELDS = ("name", "refusal", "annotations")
# Fields of an assistant message as a response carries it that must be null to be dropped: a real audio reply or a
# deprecated function_call cannot be rendered, and leaving either out would change the conversation
NULL_ONLY_MESSAGE_FIELDS = ("audio", "function_call")


def chat_messages(messages: list[Any]) -> list[Any]:
    """Messages as OpenAI accepts them, made what family/chat.py renders: `developer` (OpenAI's newer name for
    system) is system; fields whose value is null are absent (`response.choices[0].message.model_dump()` appended
    as is); DROPPED_MESSAGE_FIELDS are dropped; content-part lists ([{"type": "text", "text": ...}]) are joined into
    one text, as vLLM joins them. Everything else (a wrong type, an unknown role or field, a missing
    tool_call_id) goes to family/chat.py's checks unchanged."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        message = {key: value for key, value in message.items()
                   if key not in DROPPED_MESSAGE_FIELDS and (value is not None or key == "content")}
        for key in NULL_ONLY_MESSAGE_FIELDS:
            if key in message:
                raise InputError(f"messages[{i}].{key} is not supported: only null"
                                 + (" (send tool_calls)" if key == "function_call" else ""))
        if message.get("role") == "developer":
            message["role"] = "system"
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InputError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                     f"are supported, got {part!r:.80}")
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        out.append(message)
    return out
