"""Drawing a token from candidates (runner/models/draw.py): any split of the vocabulary into lm_head-TP slices gives
the token the whole row gives, which is the sampler's (engine/sampler.py) for the same request; the candidates'
draws follow softmax(logits / T) over the top k (a chi-square test, as for speculative sampling); and which steps
draw from candidates (sampler.plain_draws)."""

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dsconv.runner.engine.sampler import plain_draws, sample
from dsconv.runner.engine.batch import Batch, PromptScores, SampleSpec
from dsconv.runner.models.draw import Draw, merge, pick_full, slice_entries, width
from tests.test_scheduler import random_logits, reference_probs


def _split(logits: torch.Tensor, draws: list[Draw], slices: int) -> torch.Tensor:
    """The rows' tokens from `slices` equal vocabulary slices' candidates, as lm_head TP merges them."""
    n = logits.shape[1] // slices
    entries = width(draws)
    parts = [slice_entries(logits[:, s * n:(s + 1) * n], s * n, draws, entries) for s in range(slices)]
    return merge(torch.stack(parts), draws)


def _random_draws(rng: random.Random, rows: int) -> list[Draw]:
    return [Draw(rng.choice([0.0, 0.0, 1.0, 0.7, 0.05, 5.0]), rng.choice([0, 0, 1, 3, 40, 500]),
                 rng.getrandbits(63), rng.randrange(500)) for _ in range(rows)]


@pytest.mark.parametrize("vocab,dtype", [(64, torch.float32), (1024, torch.float32), (1024, torch.bfloat16)])
def test_slices_draw_what_the_whole_row_draws(vocab, dtype):
    """Rows with many equal logits among them (ties go to the lowest id), top_k past a slice's size and past the
    vocabulary: 1, 2, 4 and 16 slices give the whole row's tokens, which are the sampler's for the same requests."""
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    logits, draws = random_logits(gen, 120, vocab, dtype), _random_draws(rng, 120)
    whole = pick_full(logits, draws)
    specs = [SampleSpec(d.temperature, 1.0, d.top_k, d.seed, d.index, None) for d in draws]
    assert whole.tolist() == sample(logits, specs).tolist()
    for slices in (1, 2, 4, 16):
        assert _split(logits, draws, slices).tolist() == whole.tolist(), slices


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3), (1.3, 5)])
def test_candidates_draw_from_the_softmax_over_the_top_k(temperature, top_k):
    """8,000 seeds through 4 slices of a 12-token row: the counts pass a chi-square test against NumPy's softmax at
    the temperature over the top k, and tokens outside the top k are never drawn."""
    logits = torch.tensor([[2.0, 1.5, 0.3, 0.2, -1.0, 0.9, 1.1, -0.4, 0.0, 0.6, 1.4, -2.0]])
    want = reference_probs(logits[0].numpy(), temperature, top_k, 1.0)
    draws = [Draw(temperature, top_k, seed, 3) for seed in range(8000)]
    tokens = _split(logits.expand(len(draws), -1), draws, 4).numpy()
    counts = np.bincount(tokens, minlength=len(want))
    assert np.all(counts[want == 0] == 0)
    kept = want > 0
    assert chisquare(counts[kept], len(draws) * want[kept]).pvalue > 1e-3


def test_plain_draws_are_the_steps_without_a_whole_row():
    """Greedy and temperature / top_k rows draw from candidates; prompt logprobs, logprobs, top_p, logit_bias,
    n > 1 or drafts need the whole row."""
    def batch(**spec) -> Batch:
        b = Batch()
        b.add(0, [1, 2], 2, [0], 4, SampleSpec(**{**dict(temperature=0.8, top_p=1.0, top_k=5, seed=1, index=0,
                                                        logprobs=None), **spec}), None)
        return b

    assert plain_draws(batch()) == [Draw(0.8, 5, 1, 0)]
    assert plain_draws(batch(temperature=0.0, top_k=0)) == [Draw(0.0, 0, 1, 0)]
    for whole in (dict(top_p=0.9), dict(logprobs=2), dict(logit_bias=((3, 1.0),)), dict(siblings=(2,)),
                  dict(drafts=(5,))):
        assert plain_draws(batch(**whole)) is None, whole
    scored = Batch()
    scored.add(0, [1, 2], 2, [0], 4, None, PromptScores([2], 0))
    assert plain_draws(scored) is None
