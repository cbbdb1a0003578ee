"""POST /v1/completions: prompts (text or token ids, n choices each) -> text, streamed or whole, with echo and
logprobs shaped as lm-evaluation-harness reads them (prompt tokens first, the first one with logprob None)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from dsconv.errors import InputError
from dsconv.family.text import Detokenizer
from dsconv.runner.entrypoints.openai.choice import Choice, EngineError, Envelope, completion_logprobs, prompt_offsets
from dsconv.runner.entrypoints.openai.streaming import RequestGroup, answer, updates
from dsconv.runner.entrypoints.openai.protocol import (COMPLETION_MAX_TOKENS, CompletionRequest, check_common,
                                      check_token_id, sampling_params, stop_strings, truncate)

if TYPE_CHECKING:
    from dsconv.runner.entrypoints.openai.streaming import Front


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # what echo returns: the client's text, or the decoded ids
    added: int  # how many tokens the server put in front of the client's text (BOS)


def text_prompt(engine: Front, text: str, add_special_tokens: bool = True) -> Prompt:
    ids, added = engine.text.encode_counted(text)  # the one text -> ids rule (family/text.py)
    if not add_special_tokens:  # vLLM's add_special_tokens=false: the text's own tokens only
        ids, added = ids[added:], 0
    return Prompt(ids, text, added)


def truncated(engine: Front, prompt: Prompt, body: CompletionRequest) -> Prompt:
    """truncate_prompt_tokens: the prompt's last tokens, echoed as their text."""
    ids = truncate(prompt.ids, body, engine.max_model_len)
    if len(ids) == len(prompt.ids):
        return prompt
    cut = len(prompt.ids) - len(ids)
    added = max(0, prompt.added - cut)
    return Prompt(ids, engine.tokenizer.decode(ids[added:], skip_special_tokens=False), added)


def prompts(engine: Front, prompt: str | list, add_special_tokens: bool = True) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # one prompt: a text, or one list of ids
    if not prompt:
        raise InputError("prompt is empty")
    out = []
    for i, one in enumerate(prompt):
        name = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if not one:
            raise InputError(f"{name} is empty")
        if isinstance(one, str):
            out.append(text_prompt(engine, one, add_special_tokens))
            continue
        for token_id in one:
            check_token_id(token_id, engine.vocab_size, name)
        out.append(Prompt(list(one), engine.tokenizer.decode(one, skip_special_tokens=False), 0))
    return out


async def completions(engine: Front, request: Request, body: CompletionRequest,
                      dp_rank: int | None) -> Response:
    check_common(body, engine.model_name, engine.vocab_size)
    if body.best_of not in (None, 1):
        raise InputError(f"best_of={body.best_of} is not supported: only 1")
    if body.suffix:
        raise InputError("suffix is not supported: this server completes after the prompt, it does not insert")
    inputs = [truncated(engine, p, body) for p in prompts(engine, body.prompt, body.add_special_tokens)]
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = sampling_params(body, max_tokens, logprobs=body.logprobs, vocab_size=engine.vocab_size,
                             prompt_logprobs=body.logprobs if body.echo else None)
    response = Completion(engine, body, inputs, params.n)
    requests = RequestGroup(engine, request, dp_rank)
    return await answer(requests, response, response.choices, body.stream, params)


class Completion(Envelope):
    def __init__(self, engine: Front, body: CompletionRequest, inputs: list[Prompt], n: int):
        super().__init__(engine, "cmpl", [Choice(i * n + sample, p.ids, stop_strings(body),
                                                 Detokenizer(engine.tokenizer, body.skip_special_tokens), sample,
                                                 include_stop=body.include_stop_str_in_output,
                                                 min_tokens=body.min_tokens)
                                          for i, p in enumerate(inputs) for sample in range(n)])
        self.body, self.inputs, self.n = body, inputs, n
        self.echo_sent = [False] * len(self.choices)

    def response(self) -> dict:
        return {**self.head("text_completion"), "choices": [self._choice(c) for c in self.choices],
                "usage": self.usage(), **self.handoff()}

    def _choice(self, choice: Choice) -> dict:
        prompt = self.inputs[choice.index // self.n]
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._logprobs(choice, 0, self.body.echo)
        return {"index": choice.index, "text": (prompt.text if self.body.echo else "") + choice.text,
                "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def _logprobs(self, choice: Choice, first_token: int, with_prompt: bool) -> dict:
        """Logprobs of the generated tokens from `first_token` on, after the prompt's when `with_prompt`."""
        prompt = self.inputs[choice.index // self.n]
        base = len(prompt.text) if self.body.echo else 0  # generated text starts after the echoed prompt
        ids = choice.token_ids[first_token:]
        entries: list = choice.logprobs[first_token:]
        offsets = [base + offset for offset in choice.token_offsets[first_token:]]
        if with_prompt:
            if choice.prompt_logprobs is None or len(choice.prompt_logprobs) != len(prompt.ids):
                raise EngineError(f"prompt logprobs for {len(prompt.ids)} tokens were asked for, the engine "
                                  f"gave {None if choice.prompt_logprobs is None else len(choice.prompt_logprobs)}")
            ids = prompt.ids + ids
            entries = choice.prompt_logprobs + entries
            offsets = prompt_offsets(self.engine.tokenizer, prompt.ids, prompt.added) + offsets
        return completion_logprobs(self.engine.tokenizer, ids, entries, offsets, self.body.return_tokens_as_token_ids)

    async def chunks(self, requests: RequestGroup):
        async for choice in updates(requests, self.choices):
            chunk = self._chunk(choice)
            if chunk is not None:
                yield self.streamed(chunk, self.body.stream_options)
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield {**self.head("text_completion"), "choices": [], "usage": self.usage()}

    def _chunk(self, choice: Choice) -> dict | None:
        """What `choice` has new since its last chunk, or None when nothing is new."""
        echo = ""
        with_prompt = False
        if self.body.echo and not self.echo_sent[choice.index]:
            # the prompt goes first, with its logprobs once the engine has scored it
            if self.body.logprobs is None or choice.prompt_logprobs is not None:
                echo, with_prompt = self.inputs[choice.index // self.n].text, self.body.logprobs is not None
                self.echo_sent[choice.index] = True
        text = choice.ready_text()
        delta = echo + text[choice.sent_text:]
        new_tokens = len(choice.token_ids) - choice.sent_tokens
        logprobs = None
        if self.body.logprobs is not None and (new_tokens or with_prompt):
            logprobs = self._logprobs(choice, choice.sent_tokens, with_prompt)
        finish = choice.finish_reason if choice.done else None
        choice.sent_text, choice.sent_tokens = len(text), len(choice.token_ids)
        if not delta and logprobs is None and finish is None:
            return None
        return {**self.head("text_completion"),
                "choices": [{"index": choice.index, "text": delta, "logprobs": logprobs, "finish_reason": finish}]}
