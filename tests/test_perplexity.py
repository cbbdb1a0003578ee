"""`dsrun perplexity`'s scoring equals transformers' perplexity of the same windows (float32), on one rank and
on 16, with one window and with several."""


import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.errors import InputError
from dsconv.runner.entrypoints.perplexity import windows
from dsconv.family.layout import Layout
from tests.helpers import score_ranks, shard, transformers_perplexity

RELATIVE_TOLERANCE = 1e-4
TEXT_TOKENS = 45  # with BOS: one window at --context 64, three (16, 16, 14) at --context 16
BOS = 0  # the tiny fixtures' bos_token_id


def text_ids(vocab: int) -> list[int]:
    return torch.randint(2, vocab, (TEXT_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()


def test_windows_cut_and_score_every_token_after_the_first():
    ids = list(range(10))
    assert windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(ids, 10) == [ids]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a last window of one token scores nothing
    with pytest.raises(InputError, match="--context 1 must be at least 2"):
        windows(ids, 1)


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [
    ("deepseek_v32", Layout(1, 1, 1, 1)),
    ("deepseek_v32", Layout(16, 16, 16, 8)),  # attention DP2 x TP8: only attention-TP rank 0 of a group reports
    ("deepseek_v4", Layout(1, 1, 1, 1)),
    ("deepseek_v4", Layout(16, 16, 16, 1)),  # attention DP16: windows spread over the ranks, most idle
])
def test_perplexity_equals_transformers(tiny_source, tmp_path, family, layout):
    shards = tmp_path / "shards"
    shard(tiny_source(family, "fp8"), shards, layout)
    reference = AutoModelForCausalLM.from_pretrained(tiny_source(family, "bf16"), dtype=torch.float32).eval()
    ids = [BOS] + text_ids(reference.config.vocab_size)
    for context in (64, 16):
        cut = windows(ids, context)
        assert len(cut) == (1 if context == 64 else 3)
        ours = score_ranks(shards, tmp_path / f"results-{context}", cut)
        expected, tokens = transformers_perplexity(reference, cut)
        assert ours["tokens"] == tokens == len(ids) - len(cut)
        assert abs(ours["perplexity"] - expected) <= RELATIVE_TOLERANCE * expected, (ours, expected)
