"""One choice of a completion as the HTTP front end follows it: the engine's token ids turned into text
incrementally, cut at the first stop string, and what may be streamed so far (never a tail that could still
become a stop string or `</think>`, never half a UTF-8 character)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from dsconv.runner.entrypoints.openai.protocol import APIError
from dsconv.family.text import Detokenizer, END_THINK
from dsconv.runner.engine.request import FINISH_ABORT, FINISH_STOP, RequestOutput, TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports impossible tokens with this value too


class EngineError(Exception):
    """The engine gave up on a request (its final output carried an error), or refused it as it began to drain
    (unavailable: a 503, which a client may retry elsewhere)."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable

    def api_error(self) -> APIError:
        if self.unavailable:
            return APIError(503, f"{self}; takes no new requests")
        return APIError(500, f"the engine failed: {self}")


def partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is the start of a marker (and so may still become one)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def split_reasoning(text: str, final: bool, call_start: str | None = None) -> tuple[str, str | None]:
    """(reasoning, content) of a reply generated with thinking on, as vLLM's DeepSeek-R1 reasoning parser splits
    it: the text before `</think>` is reasoning; without `</think>` yet, all of it is (content None). While the
    reply goes on, a tail that may be the start of `</think>` is held back. With tools (call_start: the calls
    block's marker), a block that begins before any `</think>` ends the reasoning there (DeepSeek-V4 is reported
    to start calls without closing its reasoning) and is the content."""
    end = text.find(END_THINK)
    call = text.find(call_start) if call_start else -1
    if call >= 0 and (end < 0 or call < end):
        return text[:call].rstrip(), text[call:]
    if end >= 0:
        return text[:end], text[end + len(END_THINK):]
    if final:
        return text, None
    held = text[:len(text) - partial_tail(text, (END_THINK, call_start) if call_start else (END_THINK,))]
    return (held.rstrip() if call_start else held), None


@dataclass
class Choice:
    index: int  # in the response: prompt i's samples are choices i * n .. i * n + n - 1
    prompt_ids: list[int]
    stops: tuple[str, ...]
    detokenizer: Detokenizer
    sample: int = 0  # which of its engine request's n samples
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=list)  # where each generated token starts in the text
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: str = ""  # generated text, cut before the first stop string
    finish_reason: str | None = None
    done: bool = False  # no more text will come: the engine finished, or a stop string ended the choice
    stopped_here: bool = False  # a stop string ended it while the engine request was still running
    sent_tokens: int = 0  # streaming bookkeeping: tokens (and their logprobs) already sent
    sent_text: int = 0  # characters of `text` (or of reasoning + content, for chat) already sent
    sent_reasoning: int = 0
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string kept at the end of the text
    min_tokens: int = 0  # vLLM's min_tokens: a stop string within the first min_tokens tokens' text is no stop
    kv_transfer_params: dict | None = None  # a P/D producer's hand-over, from the engine's last output

    def consume(self, out: RequestOutput) -> None:
        self.cached_tokens = out.cached_tokens
        self.kv_transfer_params = out.connector_params or self.kv_transfer_params
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.token_offsets += self.detokenizer.add(out.new_token_ids)
        if out.finished:
            self.detokenizer.flush()
        # a stop string may straddle the old end of the text: search from where a match could still start
        checked = len(self.text)
        self.text = self.detokenizer.text
        start = max(0, checked - max((len(stop) for stop in self.stops), default=0))
        cuts = [(at, at + len(stop)) for at, stop in ((self._find(stop, start), stop) for stop in self.stops)
                if at >= 0]
        if cuts:
            at, end = min(cuts)
            self.text = self.text[:end if self.include_stop else at]
            self.finish_reason, self.done, self.stopped_here = FINISH_STOP, True, not out.finished
        elif out.finished:
            if out.finish_reason == FINISH_ABORT:
                raise EngineError(out.error or "the engine aborted the request", out.unavailable)
            self.finish_reason, self.done = out.finish_reason, True

    def _find(self, stop: str, start: int) -> int:
        """Where `stop` first occurs in the text from `start` (-1: it does not). With min_tokens, as vLLM checks: only
        once more than min_tokens tokens are out, and only a match that ends in the text of those after them."""
        if self.min_tokens:
            if len(self.token_offsets) <= self.min_tokens:
                return -1
            start = max(start, self.token_offsets[self.min_tokens] - len(stop) + 1)
        return self.text.find(stop, start)

    def ready_text(self) -> str:
        """The text that may be sent now: all of it once done, else without a tail that may start a stop string."""
        if self.done:
            return self.text
        return self.text[:len(self.text) - partial_tail(self.text, self.stops)]


def token_text(tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token alone (byte-level pieces of a longer character decode to the replacement mark), or with as_id
    (vLLM's `return_tokens_as_token_ids`) "token_id:<id>", which names it exactly."""
    if as_id:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(tokenizer, ids: list[int], entries: list[TokenLogprob | None],
                        offsets: list[int], as_ids: bool = False) -> dict:
    """/v1/completions' logprobs object for `ids`: `entries[i]` is None where nothing predicts the token (the
    prompt's first). top_logprobs maps token text -> logprob and always holds the chosen token, as OpenAI's does;
    ids that decode to the same text keep the highest logprob."""
    tops = []
    for token_id, entry in zip(ids, entries):
        if entry is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for top_id, logprob in [*entry.top.items(), (token_id, entry.logprob)]:
            text = token_text(tokenizer, top_id, as_ids)
            top[text] = max(top.get(text, MIN_LOGPROB), clamp(logprob))
        tops.append(top)
    return {"tokens": [token_text(tokenizer, i, as_ids) for i in ids],
            "token_logprobs": [None if e is None else clamp(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, ids: list[int], entries: list[TokenLogprob], top_n: int, as_ids: bool = False) -> dict:
    """/v1/chat/completions' logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id, as_ids)
        return {"token": text, "logprob": clamp(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(ids, entries):
        best = sorted(entry.top.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**item(token_id, entry.logprob), "top_logprobs": [item(i, lp) for i, lp in best]})
    return {"content": content}


def prompt_offsets(tokenizer, prompt_ids: list[int], added: int) -> list[int]:
    """Where each prompt token starts in the echoed prompt. The `added` tokens the server put in front (BOS) are not
    in the client's text: they get offset 0 and take no room."""
    detokenizer = Detokenizer(tokenizer, skip_special_tokens=False)
    return [0] * added + detokenizer.add(prompt_ids[added:])


class Envelope:
    """What every response body and stream chunk of one request carries (id, object kind, creation time, model),
    and its usage block: the one envelope of /v1/completions and /v1/chat/completions."""

    def __init__(self, engine, id_prefix: str, choices: list[Choice]):
        self.engine, self.choices = engine, choices
        self.id, self.created = f"{id_prefix}-{uuid.uuid4().hex}", int(time.time())

    def streamed(self, chunk: dict, stream_options) -> dict:
        """A stream chunk as sent: with vLLM's continuous_usage_stats (and include_usage), the usage so far."""
        if stream_options is not None and stream_options.include_usage and stream_options.continuous_usage_stats:
            return {**chunk, "usage": self.usage()}
        return chunk

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.engine.model_name}

    def handoff(self) -> dict:
        """A P/D producer's response: vLLM's top-level kv_transfer_params, which the router passes to the consumer
        (engine/kv_transfer.py); for several prompts (one choice each: a producer runs n 1), {"prompts": [each
        prompt's]} (kv_transfer.Offers); nothing otherwise."""
        params = [c.kv_transfer_params for c in self.choices if c.kv_transfer_params is not None]
        if not params:
            return {}
        return {"kv_transfer_params": params[0] if len(self.choices) == 1 else {"prompts": params}}

    def usage(self) -> dict:
        """As OpenAI counts: each prompt once however many samples it has, every sample's tokens; the prompt tokens
        taken from the prefix cache (`prompt_tokens_details.cached_tokens`, as OpenAI and vLLM report them)."""
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.sample == 0)
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = sum(c.cached_tokens for c in self.choices if c.sample == 0)  # vLLM's prompt_tokens_details
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
