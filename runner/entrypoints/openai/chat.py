"""POST /v1/chat/completions: messages (and tools) -> the family's chat prompt (family/text.py) -> a reply, streamed
or whole. With thinking on (chat_template_kwargs {"thinking": true}) the reply's text before `</think>` is returned
as `reasoning_content` and the rest as `content`, as vLLM's DeepSeek reasoning parser returns them; with tools, a
calls block at the end of the reply as `tool_calls` (tool_calls.py)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from dsconv.errors import InputError
from dsconv.family.text import Detokenizer
from dsconv.runner.entrypoints.openai.choice import Choice, Envelope, chat_logprobs, split_reasoning
from dsconv.runner.entrypoints.openai.streaming import Front, RequestGroup, answer, updates
from dsconv.runner.entrypoints.openai.tool_calls import CallStream, Reply, partial_calls, sendable, split_calls
from dsconv.runner.entrypoints.openai.protocol import ChatCompletionRequest, ChatSettings
from dsconv.runner.engine.request import SamplingParams

# Message fields OpenAI's spec allows that DeepSeek's chat encodings have no place for: dropped. `name` tells
# participants apart (DeepSeek's encoders render none); an assistant message read back from a response carries
# `refusal` and `annotations` (URL citations of its text) as well.
DROPPED_MESSAGE_FIELDS = ("name", "refusal", "annotations")
# Fields of an assistant message as a response carries it that must be null to be dropped: a real audio reply or a
# deprecated function_call cannot be rendered, and leaving either out would change the conversation
NULL_ONLY_MESSAGE_FIELDS = ("audio", "function_call")


def chat_messages(messages: list[Any]) -> list[Any]:
    """Messages as OpenAI accepts them, made what family/text.py renders: `developer` (OpenAI's newer name for
    system) is system; fields whose value is null are absent (`response.choices[0].message.model_dump()` appended
    as is); DROPPED_MESSAGE_FIELDS are dropped; content-part lists ([{"type": "text", "text": ...}]) are joined into
    one text, as vLLM joins them. Everything else (a wrong type, an unknown role or field, a missing
    tool_call_id) goes to family/text.py's checks unchanged."""
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


def chat_prompt_ids(engine: Front, messages: list, thinking: bool, tools: list | None = None) -> list[int]:
    """The conversation's prompt ids as the family renders it; the rendered text carries BOS itself."""
    return engine.text.encode_chat(engine.family, chat_messages(messages), thinking, tools)


async def chat_completions(engine: Front, request: Request, body: ChatCompletionRequest, settings: ChatSettings,
                           dp_rank: int | None) -> Response:
    """A chat request, its body translated (protocol.parse_chat): the prompt rendered, the reply streamed or
    returned."""
    prompt_ids = chat_prompt_ids(engine, body.messages, settings.thinking, settings.tools)
    if body.add_special_tokens:  # vLLM's: the tokenizer's own specials (BOS) before the template's text
        prompt_ids = engine.text.encode_counted("")[0] + prompt_ids
    if settings.keep_last is not None:
        prompt_ids = prompt_ids[-settings.keep_last:]
    max_tokens = settings.max_tokens
    if max_tokens is None:  # as vLLM: whatever the context leaves (max_model_len fits one DP rank's cache)
        max_tokens = engine.max_model_len - len(prompt_ids)
        if max_tokens <= 0:
            raise InputError(f"the prompt is {len(prompt_ids)} tokens, which leaves no room for a reply within "
                             f"max_model_len={engine.max_model_len}")
    params = SamplingParams(max_tokens=max_tokens, **settings.sampling)
    response = ChatCompletion(engine, body, prompt_ids, settings, params.n)
    return await answer(RequestGroup(engine, request, dp_rank), response, response.choices, body.stream, params)


class ChatCompletion(Envelope):
    def __init__(self, engine: Front, body: ChatCompletionRequest, prompt_ids: list[int], settings: ChatSettings,
                 n: int = 1):
        super().__init__(engine, "chatcmpl", [Choice(i, prompt_ids, settings.stop,
                                                     Detokenizer(engine.tokenizer, body.skip_special_tokens), i,
                                                     include_stop=body.include_stop_str_in_output,
                                                     min_tokens=body.min_tokens)
                                              for i in range(n)])
        self.body, self.thinking, self.dialect = body, settings.thinking, settings.dialect
        # with tools: what of each choice's calls has been streamed
        self.call_streams = [CallStream() for _ in self.choices] if self.dialect is not None else []

    def _split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the reply text so far."""
        if not self.thinking:
            return None, text
        return split_reasoning(text, final, self.dialect.start if self.dialect else None)

    def _reply(self, content: str | None, final: bool) -> Reply:
        """The content that may be sent (all of it when final) and, when final, the calls."""
        if self.dialect is None or content is None:
            return Reply(content)
        return split_calls(self.dialect, content) if final else Reply(sendable(self.dialect, content))

    @staticmethod
    def _finish(choice: Choice, reply: Reply) -> str | None:
        return "tool_calls" if reply.calls else choice.finish_reason

    def _logprobs(self, choice: Choice, first_token: int) -> dict | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.engine.tokenizer, choice.token_ids[first_token:], choice.logprobs[first_token:],
                             self.body.top_logprobs or 0, self.body.return_tokens_as_token_ids)

    def response(self) -> dict:
        return {**self.head("chat.completion"), "choices": [self._choice(choice) for choice in self.choices],
                "usage": self.usage(), **self.handoff()}

    def _choice(self, choice: Choice) -> dict:
        reasoning, content = self._split(choice.text, final=True)
        reply = self._reply(content, final=True)
        message = {"role": "assistant", "content": reply.content, "reasoning_content": reasoning}
        if reply.calls:
            message.update(content=reply.content or None, tool_calls=reply.calls)
        return {"index": choice.index, "message": message, "logprobs": self._logprobs(choice, 0),
                "finish_reason": self._finish(choice, reply)}

    async def chunks(self, requests: RequestGroup):
        options = self.body.stream_options
        for choice in self.choices:
            yield self.streamed(self._chunk(choice, {"role": "assistant", "content": ""}, None, None), options)
        async for choice in updates(requests, self.choices):
            chunk = self._next_chunk(choice)
            if chunk is not None:
                yield self.streamed(chunk, options)
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield {**self.head("chat.completion.chunk"), "choices": [], "usage": self.usage()}

    def _chunk(self, choice: Choice, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
        return {**self.head("chat.completion.chunk"),
                "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def _next_chunk(self, choice: Choice) -> dict | None:
        reasoning, raw = self._split(choice.ready_text(), final=choice.done)
        reply = self._reply(raw, final=choice.done)
        content = reply.content
        delta = {}
        if reasoning is not None and len(reasoning) > choice.sent_reasoning:
            delta["reasoning_content"] = reasoning[choice.sent_reasoning:]
            choice.sent_reasoning = len(reasoning)
        if content is not None and len(content) > choice.sent_text:
            delta["content"] = content[choice.sent_text:]
            choice.sent_text = len(content)
        if self.dialect is not None and raw is not None:
            calls = self.call_streams[choice.index]
            deltas = calls.final(reply.calls) if choice.done else calls.deltas(partial_calls(self.dialect, raw))
            if deltas:
                delta["tool_calls"] = deltas
        logprobs = self._logprobs(choice, choice.sent_tokens) if len(choice.token_ids) > choice.sent_tokens else None
        choice.sent_tokens = len(choice.token_ids)
        finish = self._finish(choice, reply) if choice.done else None
        if not delta and logprobs is None and finish is None:
            return None
        return self._chunk(choice, delta, logprobs, finish)
