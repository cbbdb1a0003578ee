"""A step's results taken by rank 0's scheduler (scheduler.py's `update`): each sequence's drawn tokens and scored
prompt positions become its request's outputs, speculative decoding's rejected drafts are cut back first, a request
whose n samples were drawn together starts the others from a fork of its cache, and a finished request is freed (what
its blocks become is the KV connector's to say). An error in one request's result fails that request alone."""

from __future__ import annotations

import dataclasses
import time

from dsconv.runner.engine.batch import CPShare
from dsconv.runner.engine.request import FINISH_LENGTH, RequestOutput, SeqResult
from dsconv.runner.engine.sequence import Request, Step
from dsconv.runner.models.kv_cache import Fork



def update(s, step: Step, results: list[list[SeqResult]]) -> list[tuple[Request, RequestOutput]]:
    """s: the scheduler; results[rank][i]: the i-th sequence of that rank's batch -> the outputs to deliver (finished
    requests are freed here). A context-parallel prefill's result is its owner's, with the members' scored prompt
    tokens put in position order."""
    _settle(s, step, results)
    if s.prefix_caching:  # first: a sequence that finishes in this step still publishes what it computed
        s._publish()
    for rank, seq_id in s._restored:  # their state is in their slots now
        rank.restored(seq_id)
    s._restored.clear()
    outputs, now = [], time.perf_counter()
    parts: dict[int, list[tuple[CPShare, SeqResult]]] = {}  # context-parallel: seq_id -> the members' results
    for batch, rank_results in zip(step.batches, results, strict=True):
        if batch.cp is not None:
            parts.setdefault(batch.cp.seq_id, []).extend(zip([batch.cp], rank_results, strict=True))
            continue
        for seq_id, result in zip(batch.seq_ids, rank_results, strict=True):
            outputs += _take_alone(s, seq_id, result, now)
    for seq_id, members in parts.items():
        scored = sorted(((p, entry) for share, result in members
                         for p, entry in zip(share.scored_positions, result.prompt_logprobs)),
                        key=lambda pair: pair[0])
        owner = next(result for share, result in members if share.member == 0)
        outputs += _take_alone(s, seq_id, dataclasses.replace(owner, prompt_logprobs=[e for _, e in scored]),
                                    now)
    return outputs

def _take_alone(s, seq_id: int, result: SeqResult, now: float) -> list[tuple[Request, RequestOutput]]:
    """_take, where an error of this one request fails it alone (its blocks freed); an error in freeing them is
    the pool's, and stops the engine."""
    request = s.by_seq.get(seq_id)
    if result.error is not None and request is not None:  # failed on the ranks (its grammar)
        return s.fail(request, "sample", RuntimeError(result.error))
    try:
        return _take(s, seq_id, result, now)
    except Exception as exc:  # noqa: BLE001  (a request can fail; the engine cannot)
        if request is None:
            raise
        return s.fail(request, "update", exc)

def _settle(s, step: Step, results: list[list[SeqResult]]) -> None:
    """Speculative decoding: each verifying sequence's computed tokens cut back to its last accepted draft (the
    rejected positions' entries are written over by its next steps), before anything is published."""
    for batch, rank_results in zip(step.batches, results, strict=True):
        for seq_id, result in zip(batch.seq_ids if batch.cp is None else (), rank_results):
            request = s.by_seq.get(seq_id)
            if request is not None and request.verifying:
                accepted = len(result.extra)
                request.num_computed -= request.verifying - accepted
                s.spec.add(request.verifying, accepted, s.plan.speculative_tokens)
                request.verifying = 0

def _take(s, seq_id: int, result: SeqResult, now: float) -> list[tuple[Request, RequestOutput]]:
    """One sequence's result -> the outputs it gives (its own, then any samples it starts)."""
    request = s.by_seq.get(seq_id)
    if request is None:  # aborted while the step ran
        return []
    out, samples = RequestOutput(request.request_id, len(request.prompt), index=request.index,
                                 cached_tokens=request.cached_tokens), []
    request.prompt_logprobs.extend(result.prompt_logprobs)
    if request.params.prompt_logprobs is not None and not request.prompt_delivered \
            and not request.scoring and request.num_computed >= len(request.prompt):
        out.prompt_logprobs = [None, *request.prompt_logprobs]
        request.prompt_delivered = True
    if result.token is not None:
        request.previous_token, request.last_token = request.last_token, now
        out.new_token_ids, logprobs = [], []
        for token, logprob in [(result.token, result.logprob), *result.extra]:  # until one finishes it
            request.output.append(token)
            out.new_token_ids.append(token)
            logprobs.append(logprob)
            out.finish_reason = s.plan.finish_reason(request, token)
            if out.finish_reason is not None:
                break
        out.new_logprobs = logprobs if result.logprob is not None else None
        request.drafts = list(result.drafts)
        if result.siblings:  # before the parent may go: the samples fork its cache
            samples = _start_samples(s, request, result.siblings, out.prompt_logprobs, now)
    elif request.params.max_tokens == 0 and not request.scoring and \
            request.num_computed == len(request.prompt):
        out.finish_reason = FINISH_LENGTH  # the prompt is scored and nothing is to be generated
    if out.finish_reason is not None:
        out.finished = True
        out.connector_params = s.connector.finished(request, s.ranks[request.dp_rank])
        s._remove(request)
    emitted = [(request, out)] if out.new_token_ids or out.prompt_logprobs is not None or out.finished else []
    return emitted + samples

def _start_samples(s, parent: Request, drawn: list, prompt_logprobs, now: float) -> list[tuple]:
    """Samples 1 .. n - 1 of `parent`, whose first tokens were drawn beside its own -> their first outputs.
    Each continues from a fork of the parent's cache, or, when the free blocks do not suffice for a copy of
    its last partial block, from scratch like a preempted request."""
    parent.forked = True
    rank, outputs = s.ranks[parent.dp_rank], []
    for index, (token, logprob) in enumerate(drawn, start=1):
        child = Request(parent.request_id, next(s._seq_ids), parent.prompt, parent.params, parent.seed + index,
                        parent.on_output, rank.index, index=index, forked=True, arrival=parent.arrival,
                        output=[token], prompt_logprobs=list(parent.prompt_logprobs), prompt_delivered=True,
                        first_scheduled=parent.first_scheduled, last_token=now)
        out = RequestOutput(parent.request_id, len(parent.prompt), index=index, new_token_ids=[token],
                            new_logprobs=None if logprob is None else [logprob], prompt_logprobs=prompt_logprobs,
                            finish_reason=s.plan.finish_reason(child, token))
        out.finished = out.finish_reason is not None
        outputs.append((child, out))
        if out.finished:
            continue
        s.requests[child.key] = s.by_seq[child.seq_id] = child
        copies = rank.blocks.fork(parent.seq_id, child.seq_id, parent.num_computed)
        if copies is None:
            rank.enqueue(child, front=True)
            continue
        child.num_computed = parent.num_computed
        rank.forks.append(Fork(parent.seq_id, child.seq_id, tuple(copies)))
        rank.running.append(child)
    return outputs
