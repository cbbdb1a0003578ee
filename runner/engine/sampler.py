"""Next-token choice and logprobs from one row of logits, on the rank that computed the row.

A sampled token depends only on the row's logits and (seed, index), the token's position in the request's
output: the uniform number each draw inverts comes from a generator seeded with both, so the same seed gives
the same tokens whatever else shares the batch, whatever the world size, and after a preempted request is
recomputed. The draw inverts the cumulative distribution over tokens sorted by probability (ties by id), so
float noise in the logits moves a choice only when the number falls on a boundary.
"""

from __future__ import annotations

import numpy as np
import torch

from dsconv.runner.models.batch import SampleSpec
from dsconv.runner.engine.request import TokenLogprob


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> float32 log-softmax (the logprobs reported: the model's, before any sampling filter)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprob(row_log_probs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    best = {}
    if top:
        values, ids = row_log_probs.topk(top)
        best = dict(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(row_log_probs[token]), best)


def uniform(seed: int, index: int) -> float:
    """A number in [0, 1) fixed by (seed, index): numpy's SeedSequence mixes the pair into the generator state."""
    return float(np.random.default_rng([seed % 2**64, index]).random())


def sample(logits: torch.Tensor, spec: SampleSpec) -> int:
    """logits [vocab] -> the chosen token id: argmax at temperature 0, else a draw from the distribution at
    spec.temperature restricted to the top_k most likely tokens and the top_p nucleus."""
    if spec.temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / spec.temperature, dim=-1)
    # descending by probability, ties by token id (a stable sort of ids in order), so the order is exact
    probs, ids = probs.sort(descending=True, stable=True)
    keep = probs.shape[0] if spec.top_k == 0 else min(spec.top_k, probs.shape[0])
    if spec.top_p < 1.0:
        # the smallest prefix whose mass reaches top_p: a token stays if the mass before it is below top_p
        before = probs.cumsum(0) - probs
        keep = min(keep, max(1, int((before < spec.top_p).sum())))
    probs, ids = probs[:keep].double(), ids[:keep]
    cdf = probs.cumsum(0) / probs.sum()
    pick = int(torch.searchsorted(cdf, torch.tensor([uniform(spec.seed, spec.index)], dtype=cdf.dtype), right=True))
    return int(ids[min(pick, keep - 1)])
