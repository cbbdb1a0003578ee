"""A request's sequence as the scheduler tracks it (one per sample once a request's n samples are drawn), and the
shape of the KV caches that rank 0's pools mirror."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from dsconv.runner.engine.batch import Batch
from dsconv.runner.engine.request import RequestOutput, SamplingParams, TokenLogprob
from dsconv.runner.models.kv_cache import Restore


@dataclass
class Request:
    request_id: str
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    on_output: Callable[[RequestOutput], None]
    dp_rank: int
    index: int = 0  # which of the request's n samples
    forked: bool = False  # its n samples are drawn (for index 0 of n > 1; the others start so)
    arrival: float = field(default_factory=time.perf_counter)
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of prompt + output in the cache
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored so far (positions 1, 2, ...)
    prompt_delivered: bool = False
    first_scheduled: float | None = None
    last_token: float | None = None
    previous_token: float | None = None  # the time of the token before the last, for inter-token latency
    hashes: list[bytes] = field(default_factory=list)  # its tokens' full blocks' hashes, computed so far
    published: int = 0  # of its blocks, those published in its pool
    cached_tokens: int = 0  # tokens taken from the prefix cache when it was first scheduled
    restore: Restore | None = None  # DeepSeek-V4: the state its first step restores at its prefix hit
    drafts: list[int] = field(default_factory=list)  # speculative decoding: proposed for its next step
    verifying: int = 0  # the drafts its step being run verifies

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def seqs(self) -> int:
        """The sequences it will run as: n until its samples are drawn."""
        return 1 if self.forked else self.params.n

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def scoring(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    def work(self, horizon: int) -> int:
        """Tokens this request will feed in the next `horizon` steps at most: its uncomputed prompt (and, after a
        preemption, output) tokens, then one per step for each token it may still generate."""
        return len(self.tokens) - self.num_computed + min(horizon, self.params.max_tokens - len(self.output))


@dataclass
class Step:
    batches: list[Batch]  # one per DP rank
    started: list[Request]  # requests scheduled for the first time in this step
    preempted: list[int]  # per DP rank


@dataclass(frozen=True)
class PoolShape:
    """The ranks' KV caches as rank 0's block pools mirror them: `dp` of them (one per attention-DP index), each of
    `num_blocks` blocks of `block_size` tokens. prefix_caching: the cache can serve prefix hits (kv_cache.py's
    prefix_caching); state_blocks: the state blocks per DP rank of a cache that needs them for a hit (DeepSeek-V4),
    and state_start(boundary) the first position whose state a hit at that boundary restores."""
    dp: int
    num_blocks: int
    block_size: int
    prefix_caching: bool = False
    state_blocks: int = 0
    state_start: Callable[[int], int] | None = None

    @classmethod
    def of(cls, dp: int, cache) -> "PoolShape":
        """The pools mirroring `cache` (a rank's KVCache), on each of dp attention-DP ranks."""
        return cls(dp, cache.num_blocks, cache.block_size, cache.prefix_caching, cache.state_blocks,
                   cache.state_start)


def priority_key(request: Request) -> tuple[int, float]:
    """The order of the priority policy: lower priority values first, then arrival."""
    return request.params.priority, request.arrival
