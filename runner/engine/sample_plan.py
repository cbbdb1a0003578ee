"""What a request's next step draws, as rank 0's scheduler writes it into the step's Batch (SampleSpec): its sampling
parameters, the tokens it may not draw yet, the drafts its step verifies and how many the MTP layer proposes after
it (engine/speculative.py), the room its block table needs for them, and when a drawn token finishes it."""

from __future__ import annotations

from dsconv.runner.engine.batch import SampleSpec
from dsconv.runner.engine.request import FINISH_LENGTH, FINISH_STOP
from dsconv.runner.engine.sequence import Request


class SamplePlan:
    def __init__(self, eos_token_id: int | None, speculative_tokens: int):
        """speculative_tokens: the drafts the MTP layer proposes per step for a plain greedy request (0: none)."""
        self.eos_token_id, self.speculative_tokens = eos_token_id, speculative_tokens

    def spec(self, request: Request, drafts: list[int] = ()) -> SampleSpec | None:
        """What to draw once the request's tokens are all fed (None when it generates nothing): with speculative
        decoding, the drafts the step verifies, and how many the MTP layer proposes for the next."""
        params = request.params
        if params.max_tokens == 0:
            return None
        siblings = () if request.forked else tuple(request.seed + i for i in range(1, params.n))
        penalized = params.repetition_penalty != 1.0
        return SampleSpec(params.temperature, params.top_p, params.top_k, request.seed, len(request.output),
                          params.logprobs, params.grammar, tuple(request.output) if params.grammar else (), siblings,
                          params.logit_bias, tuple(drafts), self.proposes(request),
                          repetition_penalty=params.repetition_penalty,
                          seen=tuple(sorted(set(request.prompt) | set(request.output))) if penalized else (),
                          banned=self.banned(request), min_p=params.min_p)

    def banned(self, request: Request) -> tuple[int, ...]:
        """The tokens a request may not draw yet: before min_tokens, those that would end it (EOS unless ignored,
        and its stop tokens), as vLLM's min_tokens holds them back."""
        params = request.params
        if len(request.output) >= params.min_tokens:
            return ()
        ends = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            ends.add(self.eos_token_id)
        return tuple(sorted(ends))

    def proposes(self, request: Request) -> int:
        """The drafts the MTP layer proposes for a request after its step (none for a request with a logit_bias, or
        whose n samples are not forked yet; a grammar's masks constrain its drafts and their verification)."""
        params = request.params
        plain = not params.logit_bias and request.forked and params.repetition_penalty == 1.0 \
            and not params.min_p and not params.min_tokens
        return self.speculative_tokens if plain else 0

    @staticmethod
    def usable_drafts(request: Request) -> list[int]:
        """A decoding request's drafts it can still use: no more than the tokens it may emit after the first."""
        return request.drafts[:max(0, request.params.max_tokens - len(request.output) - 1)]

    def room(self, request: Request, n: int) -> int:
        """The tokens a request's table must hold to feed n more: with speculative decoding, also the positions the
        MTP layer's chained drafts write past them (its own cache layer), never past the request's longest length
        (the worker stops drafting where the table ends)."""
        longest = len(request.prompt) + request.params.max_tokens
        return min(request.num_computed + n + max(0, self.proposes(request) - 1),
                   max(longest, request.num_computed + n))

    def finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if (token == self.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            return FINISH_STOP
        if len(request.output) >= params.max_tokens:
            return FINISH_LENGTH
        return None
