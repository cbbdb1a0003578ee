"""Context-parallel prefill as rank 0's scheduler plans it (scheduler.py): which waiting request each group of cp_size
DP ranks prefills together in the next step, and each member's share of its prompt (batch.CPShare)."""

from __future__ import annotations

import dataclasses

from dsconv.runner.engine.batch import CPShare, PromptScores
from dsconv.runner.engine.sequence import Request



def shares(s, started: list[Request]) -> dict[int, tuple[CPShare, Request]]:
    """s: the scheduler. This step's context-parallel prefills: in each group of cp_size DP ranks, the earliest of
    the waiting requests at the head of a member's queue whose prompt fits its rank's cache and sequence limit and
    leaves at least cp_min_tokens uncached (prefix caching: looked up first) -> DP rank -> (its share, the request).
    The request is admitted on its own rank (the owner) with the rest of its prompt computed in this step; the
    owner's cached prefix is handed to the other members in each layer (deepseek_v3.Attention)."""
    found: dict[int, tuple[CPShare, Request]] = {}
    for first in range(0, s.dp if s.cp_size > 1 else 0, s.cp_size):
        members = range(first, first + s.cp_size)
        heads = [s.ranks[r].waiting[0] for r in members if s.ranks[r].waiting]
        for request in heads:
            if s.ranks[request.dp_rank].states is None:  # no context-parallel prefill restores a slot
                s._reuse_prefix(s.ranks[request.dp_rank], request)
        ready = [request for request in heads if _ready(s, request)]
        if not ready:
            continue
        request = min(ready, key=lambda r: r.arrival)
        owner, length, start = request.dp_rank, len(request.prompt), request.num_computed
        s.ranks[owner].waiting.popleft()
        s.ranks[owner].running.append(request)
        s._started(request, started)
        table = tuple(s.ranks[owner].blocks.grow(request.seq_id, length))
        request.num_computed = length
        group = (owner, *[r for r in members if r != owner])
        for member, rank in enumerate(group):
            share = CPShare(request.seq_id, length, group, member, start=start)
            scores = None
            if request.scoring:  # each member scores its own rows (every position but the last)
                targets = [request.prompt[p + 1] for p in share.scored_positions]
                scores = PromptScores(targets, request.params.prompt_logprobs) if targets else None
            owner_parts = {"block_table": table, "sample": s.plan.spec(request)} if member == 0 else {}
            found[rank] = dataclasses.replace(share, scores=scores, **owner_parts), request
    return found

def _ready(s, request: Request) -> bool:
    rank = s.ranks[request.dp_rank]
    # a waiting request without output has computed only what its prefix hit gave it
    return (not request.output and len(request.prompt) - request.num_computed >= s.cp_min_tokens
            and rank.blocks.missing(request.seq_id, len(request.prompt)) <= rank.blocks.num_free
            and rank.seqs() + request.seqs <= s.max_num_seqs)
