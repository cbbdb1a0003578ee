"""A row's next token by the Gumbel-max rule, in a form that splits over vocabulary slices, so that lm_head TP sends
each row's candidates instead of its logits (parallel.ParallelLMHead).

A draw at temperature T > 0 restricted to a set S of tokens picks
    argmax over v in S of  logit_v / T + G(seed, index, v)
where G is standard Gumbel noise fixed by the request's seed, the token's position in its output and the token id.
That is a sample of softmax(logits / T) renormalized over S (Gumbel, 1954; the Gumbel-max trick), and since each
token's noise depends on its own id only, any slice of the vocabulary can compute its part:
- greedy (T = 0): each slice sends its first maximum and that id; the row takes the largest, the lowest id among
  equals (argmax over the whole row).
- T > 0 over the whole vocabulary: each slice sends its largest logit / T + G and that id, merged the same way.
- T > 0 over the top k: each slice sends its k largest logits with their ids (ties: lowest id first); merged, they
  hold the row's k largest, from which the row draws as above.
An entry is [value, id] in float32, 8 bytes (ids below 2**24 are exact in float32; Ascend's kernels mostly lack
float64). The scores are float32 wherever they are computed, the same operations on the same numbers, so a row draws
the same token from its whole row (one slice) as from any number of slices. Among equal scores the lowest id wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014): its increment and its
# two finalizer multipliers, which turn a counter into 64 well-mixed bits
GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX_1, MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
DOUBLE_BITS = 53  # a float64's significand: the top 53 of the 64 bits make a number in [0, 1)
NOISE_STREAM = np.uint64(2)  # a third word, so these numbers differ from any other use of (seed, index)
PAD_ID = -1.0  # an entry that holds no token (a slice smaller than the row's k)


@dataclass(frozen=True)
class Draw:
    """How one row's token is drawn: temperature (0: greedy), top_k (0: the whole vocabulary), and the request's
    seed and the token's index in its output, which fix the noise."""
    temperature: float
    top_k: int
    seed: int
    index: int

    def entries(self) -> int:
        """The entries one slice sends for this row."""
        return self.top_k if self.temperature and self.top_k else 1


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * MIX_1
    z = (z ^ (z >> np.uint64(27))) * MIX_2
    return z ^ (z >> np.uint64(31))


def gumbel(seed: int, index: int, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) for each token id in ids, float32 on ids' device, u in (0, 1) fixed by
    (seed, index, id)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        key = _mix(np.array([seed % 2**64], dtype=np.uint64) ^ _mix(np.array([index], dtype=np.uint64) + NOISE_STREAM))
        bits = _mix(key + (ids.cpu().numpy().astype(np.uint64) + np.uint64(1)) * GOLDEN_GAMMA)
    u = ((bits >> np.uint64(64 - DOUBLE_BITS)).astype(np.float64) + 0.5) / 2.0 ** DOUBLE_BITS  # never 0 or 1
    return torch.from_numpy(-np.log(-np.log(u))).to(torch.float32).to(ids.device)


def width(draws: list[Draw]) -> int:
    """The entries per row every slice sends for these rows (the most any row needs)."""
    return max((d.entries() for d in draws), default=1)


def slice_entries(sliced: torch.Tensor, first_id: int, draws: list[Draw], entries: int) -> torch.Tensor:
    """sliced [rows, n], the logits of one vocabulary slice (ids first_id ..), one draw per row -> [rows, entries, 2]
    float32 [value, id] per the module docstring, unused entries [-inf, PAD_ID]."""
    rows, n = sliced.shape
    out = torch.full((rows, entries, 2), PAD_ID, dtype=torch.float32, device=sliced.device)
    out[..., 0] = -torch.inf
    values = sliced.float()
    ids = torch.arange(first_id, first_id + n, device=sliced.device)
    best_of = [row for row, d in enumerate(draws) if not d.temperature or not d.top_k]  # one entry: the best
    if best_of:
        scores = values[best_of]  # a copy (indexing by a list)
        for i, row in enumerate(best_of):
            if draws[row].temperature:  # sampled over the whole vocabulary: its scores, not its logits
                scores[i] = _scores(values[row], ids, draws[row])
        best, at = scores.max(dim=-1)  # the first maximum of each row
        out[best_of, 0] = torch.stack([best, (at + first_id).float()], dim=-1)
    for row, d in enumerate(draws):
        if d.temperature and d.top_k:
            top, at = values[row].sort(descending=True, stable=True)  # ties: the lowest id first
            k = min(d.top_k, n)
            out[row, :k, 0], out[row, :k, 1] = top[:k], (at[:k] + first_id).float()
    return out


def merge(parts: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    """parts [slices, rows, entries, 2], every slice's entries for the rows in slice order -> [rows] the drawn
    tokens (long)."""
    tokens = torch.empty(len(draws), dtype=torch.long, device=parts.device)
    best_of = [row for row, d in enumerate(draws) if not d.temperature or not d.top_k]
    if best_of:  # each slice's best: the largest, the first slice among equals
        firsts = parts[:, best_of, 0]  # [slices, rows, 2]
        first = firsts[..., 0].argmax(dim=0)  # [rows]
        tokens[best_of] = firsts[..., 1].gather(0, first[None])[0].long()
    for row, d in enumerate(draws):
        if d.temperature and d.top_k:
            flat = parts[:, row].reshape(-1, 2)
            flat = flat[flat[:, 1] != PAD_ID]
            order = flat[:, 0].sort(descending=True, stable=True).indices[:d.top_k]  # slice order: ids ascending
            tokens[row] = pick_among(flat[order, 0], flat[order, 1].long(), d)
    return tokens


def pick_among(values: torch.Tensor, ids: torch.Tensor, d: Draw) -> int:
    """The token drawn from candidates (their logits as float32 values, their ids), the lowest id among equal
    scores."""
    score = _scores(values, ids, d)
    return int(ids[score == score.max()].min())


def pick_full(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    """logits [rows, vocab], the whole rows -> [rows] tokens: the rows as one slice."""
    return merge(slice_entries(logits, 0, draws, width(draws))[None], draws)


def _scores(values: torch.Tensor, ids: torch.Tensor, d: Draw) -> torch.Tensor:
    """float32 logit / T + G for each candidate."""
    temperature = torch.tensor(d.temperature, dtype=torch.float32, device=values.device)
    return values.float() / temperature + gumbel(d.seed, d.index, ids)
