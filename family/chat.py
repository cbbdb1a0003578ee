"""Chat messages -> prompt text, per model family (a `Family.encode_chat` is one of the encoders below).

Messages are OpenAI-style dicts: `role` system / user / assistant, `content` text, and on assistant turns an
optional `reasoning_content`. The conversation must end with a user turn: the prompt ends where the model's reply
starts. Tools and tool calls are not supported (a clear error).

- V3.2 and V4 follow DeepSeek's own encoders (`encoding/encoding_dsv32.py` in the DeepSeek-V3.2 release,
  `encoding/encoding_dsv4.py` in DeepSeek-V4-Flash); there is no jinja template for them. The reply opens with
  `<｜Assistant｜></think>` (thinking off) or `<｜Assistant｜><think>` (thinking on); earlier turns' reasoning
  is dropped, as theirs is by default. tests/test_chat.py holds their output for a table of conversations.
- V3 (model_type deepseek_v3 covers V3, R1 and V3.1, which open the reply differently) renders the checkpoint's
  own chat template as transformers' `apply_chat_template(..., add_generation_prompt=True)` does; `thinking` is
  passed to the template (DeepSeek-V3.1's template reads it). A checkpoint without a template is an error, not a
  guess: every DeepSeek release of this model type ships one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dsconv.errors import InputError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"

ROLES = ("system", "user", "assistant")
_KEYS = {"system": {"role", "content"}, "user": {"role", "content"},
         "assistant": {"role", "content", "reasoning_content"}}
# What transformers passes a template from the tokenizer's special tokens (its `special_tokens_map`)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = Mapping[str, Any]


class ChatError(InputError):
    """A conversation or chat template this project cannot render; the message names the value."""


def check_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise ChatError("messages is empty: a conversation needs at least one user message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatError(f"messages[{i}] is a {type(message).__name__}, not a mapping with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise ChatError(f"messages[{i}] has role={role!r}; supported roles: {', '.join(ROLES)}")
        unknown = sorted(set(message) - _KEYS[role])
        if unknown:
            raise ChatError(f"messages[{i}] ({role}) has unsupported field(s) {', '.join(unknown)}; a {role} "
                            f"message takes {', '.join(sorted(_KEYS[role]))}")
        content = message.get("content")
        if not isinstance(content, str) and not (role == "assistant" and content is None):
            raise ChatError(f"messages[{i}] ({role}) content must be text, got {type(content).__name__}")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ChatError(f"messages[{i}] reasoning_content must be text, got {type(reasoning).__name__}")
    if messages[-1]["role"] != "user":
        raise ChatError(f"the last message has role={messages[-1]['role']!r}; it must be the user's, since the "
                        f"prompt ends where the assistant's reply begins")


def encode_chat(family, messages: Sequence[Message], thinking: bool = False,
                tokenizer_config: Mapping | None = None) -> str:
    """The prompt text `family` is given for `messages`; tokenize it without adding special tokens."""
    if family.encode_chat is None:
        raise ChatError(f"model_type={family.name!r} has no chat format; feed the prompt as raw text (--no-chat)")
    check_messages(messages)
    return family.encode_chat(messages, thinking, tokenizer_config or {})


def encode_chat_ids(tokenizer, family, messages: Sequence[Message], thinking: bool = False,
                    tokenizer_config: Mapping | None = None) -> list[int]:
    """The prompt's token ids under a `tokenizers.Tokenizer`; the text carries BOS itself, so none is added."""
    return tokenizer.encode(encode_chat(family, messages, thinking, tokenizer_config), add_special_tokens=False).ids


def read_tokenizer_config(directory: Path) -> dict:
    """tokenizer_config.json next to tokenizer.json ({} if absent), with `chat_template.jinja` as its template
    when that file exists (transformers reads the file first)."""
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    jinja = Path(directory) / "chat_template.jinja"
    if jinja.is_file():
        config["chat_template"] = jinja.read_text()
    return config


def encode_v32(messages: Sequence[Message], thinking: bool, tokenizer_config: Mapping) -> str:
    # Every user turn opens an assistant turn; only the last one may open it thinking.
    last = len(messages) - 1
    parts = [BOS]
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"] or ""
        if role == "system":
            parts.append(content)
        elif role == "user":
            parts.append(USER + content + ASSISTANT + (THINK if thinking and i == last else END_THINK))
        else:  # an earlier turn: its reasoning is dropped
            parts.append(content + EOS)
    return "".join(parts)


def encode_v4(messages: Sequence[Message], thinking: bool, tokenizer_config: Mapping) -> str:
    # Consecutive user messages are one turn (joined by a blank line), and a user turn opens an assistant turn
    # only where one follows (or the reply starts): a system message right after it continues the same turn.
    merged: list[dict] = []
    for message in messages:
        if message["role"] == "user" and merged and merged[-1]["role"] == "user":
            merged[-1]["content"] += "\n\n" + message["content"]
        else:
            merged.append({"role": message["role"], "content": message["content"] or ""})
    last = len(merged) - 1
    parts = [BOS]
    for i, message in enumerate(merged):
        role, content = message["role"], message["content"]
        if role == "system":
            parts.append(content)
        elif role == "user":
            parts.append(USER + content)
            if i == last or merged[i + 1]["role"] == "assistant":
                parts.append(ASSISTANT + (THINK if thinking and i == last else END_THINK))
        else:  # an earlier turn: its reasoning is dropped
            parts.append(content + EOS)
    return "".join(parts)


def render_template(messages: Sequence[Message], thinking: bool, tokenizer_config: Mapping) -> str:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates; transformers uses "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) or not template:
        raise ChatError("the tokenizer has no chat template (tokenizer_config.json `chat_template` or "
                        "chat_template.jinja) and this model type renders prompts with it; add the checkpoint's "
                        "template, or feed the prompt as raw text (--no-chat)")
    special = {name: _token_text(tokenizer_config[name]) for name in SPECIAL_TOKENS
               if tokenizer_config.get(name) is not None}
    # transformers also offers reasoning under the name gpt-oss templates read (`thinking`)
    chat = [{"thinking": m["reasoning_content"], **m} if m.get("reasoning_content") is not None else dict(m)
            for m in messages]
    import jinja2

    try:
        return _compile(template).render(messages=chat, tools=None, documents=None, add_generation_prompt=True,
                                         **special, thinking=thinking)
    except jinja2.TemplateError as exc:
        raise ChatError(f"the chat template failed: {exc}") from None


def _token_text(token) -> str:
    return token["content"] if isinstance(token, Mapping) else str(token)  # AddedToken dicts carry `content`


def _compile(template: str):
    # The environment transformers' apply_chat_template renders in: a sandbox, trim/lstrip blocks, loop controls,
    # a `tojson` that keeps non-ASCII text, and the `raise_exception` / `strftime_now` globals.
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
