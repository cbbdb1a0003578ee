"""In-process greedy generation through the engine (scheduler, worker, step loop) on one rank: what the tests
and benchmarks call to run a model without starting ranks."""

from __future__ import annotations

from typing import Callable

from dsconv.runner.models.dist import Dist
from dsconv.runner.engine.core import EngineCore
from dsconv.runner.engine.worker import Worker
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.engine.scheduler import Scheduler


def greedy(model, cache, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
           on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Every prompt admitted at once and prefilled in one step (no chunking), then one token per sequence per
    step; each stops at EOS (None: never) or after max_new_tokens."""
    scheduler = Scheduler(dp=1, num_blocks=cache.num_blocks, block_size=cache.block_size,
                          max_num_seqs=max(1, len(prompts)), max_num_batched_tokens=max(1, sum(map(len, prompts))),
                          eos_token_id=eos_id)
    core = EngineCore(scheduler, Worker(model, cache, Dist(), dp_index=0))
    outputs: list[list[int]] = [[] for _ in prompts]
    for index, prompt in enumerate(prompts):
        scheduler.add(str(index), prompt, SamplingParams(max_tokens=max_new_tokens), None)
    while scheduler.has_work:
        for request, out in core.step():
            index = int(request.request_id)
            for token in out.new_token_ids:
                outputs[index].append(token)
                if on_token is not None:
                    on_token(index, token)
    for seq_id in scheduler.releases[0]:  # finished requests' room, freed on the rank with the next step's batch
        cache.release(seq_id)
    return outputs
