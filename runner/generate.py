"""Greedy generation over the model's step function: prefill every prompt in one step, then one token per
sequence per step, each sequence stopping at EOS or its token budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dsconv.runner.cache import LatentCache


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    done: bool = False


@torch.inference_mode()  # no autograd bookkeeping on any op: generation never backpropagates
def greedy(model, cache: LatentCache, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
           on_token: Callable[[int, int], None] | None = None, dist=None) -> list[list[int]]:
    """dist: when distributed, every rank loops until no rank has work left, running zero-token steps when
    it has none itself, so all ranks enter the same collectives in the same order."""
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    pending = [(s.seq_id, s.prompt) for s in seqs]  # what each sequence feeds this step
    while dist.any_active(bool(pending)) if dist is not None else pending:
        meta = cache.step([(seq_id, len(tokens)) for seq_id, tokens in pending])
        tokens = torch.tensor([t for _, toks in pending for t in toks], dtype=torch.long,
                              device=meta.positions.device)
        logits = model.forward(tokens, meta, cache, rows=meta.last_rows)  # [len(pending), vocab]
        chosen = logits.argmax(dim=-1).tolist()
        next_pending = []
        for (seq_id, _), token in zip(pending, chosen):
            seq = seqs[seq_id]
            seq.generated.append(token)
            if on_token is not None:
                on_token(seq_id, token)
            seq.done = token == eos_id or len(seq.generated) >= max_new_tokens
            if seq.done:
                cache.release(seq_id)  # its cache room goes back to the sequences still running
            else:
                next_pending.append((seq_id, [token]))
        pending = next_pending
    return [s.generated for s in seqs]
