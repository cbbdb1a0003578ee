"""The paged latent cache: what a sequence reads back is what it wrote, position by position, whether its
blocks are consecutive (read as a view of the cache) or scattered (gathered through its slots)."""

import pytest
import torch

from dsconv.family.arch import CacheField
from dsconv.runner.models import step as step_module
from dsconv.runner.models.kv_cache import LatentCache
from tests.helpers import Steps

BLOCK = 4
DIM = 3


def row(seq_id: int, position: int) -> list[float]:
    return [seq_id, position, seq_id * 1000 + position]


@pytest.mark.parametrize("gather_rows,groups", [(step_module.DECODE_GATHER_ROWS, 1), (20, 3)],
                         ids=["one-group", "groups"])
def test_reads_return_every_position_in_order_for_consecutive_and_scattered_blocks(gather_rows, groups, monkeypatch):
    monkeypatch.setattr(step_module, "DECODE_GATHER_ROWS", gather_rows)  # 20: decodes split into several groups
    cache = LatentCache(layers=2, num_blocks=16, block_size=BLOCK, fields={"a": CacheField(DIM)}, dtype=torch.float32)
    runner = Steps(cache)
    lengths = {0: 0, 1: 0, 2: 0, 3: 0}
    consecutive_seen, scattered_seen = set(), set()
    most_groups = 0
    # a prefill alone (a range write of 6 rows), a batched prefill, decode steps of three sequences interleaved
    # (their blocks end up scattered), steps of sequence 2 alone (one token: a range write), a multi-token step,
    # and decodes after a prefill chunk (their rows not the step's first)
    steps = [[(3, 6)], [(0, 3), (1, 6), (2, 9)]] + [[(0, 1), (1, 1), (2, 1)]] * 6 + [[(2, 1)]] * 3 + [[(0, 5)]] + \
        [[(0, 2), (3, 1), (1, 1)]]
    for new_tokens in steps:
        meta = step_meta(runner, new_tokens)
        values = torch.tensor([row(seq_id, lengths[seq_id] + i) for seq_id, n in new_tokens for i in range(n)],
                              dtype=torch.float32)
        for layer in range(2):
            cache.write(layer, meta, a=values + layer)
        for seq_id, n in new_tokens:
            lengths[seq_id] += n
        for seq in meta.seqs:
            (consecutive_seen if seq.first_slot is not None else scattered_seen).add(seq.seq_id)
            expected = torch.tensor([row(seq.seq_id, p) for p in range(seq.context_len)], dtype=torch.float32)
            for layer in range(2):
                (got,) = cache.read(layer, seq, "a")
                assert torch.equal(got, expected + layer), (new_tokens, seq.seq_id, layer)
        check_decode_reads(cache, meta)
        most_groups = max(most_groups, len(meta.decodes))
    assert consecutive_seen and scattered_seen  # both read paths ran
    assert most_groups == groups


def step_meta(runner, new_tokens):
    """(seq_id, n_new) pairs -> the step's metadata (the token ids do not matter to the cache)."""
    return runner.inputs([(seq_id, [0] * n) for seq_id, n in new_tokens]).meta


def check_decode_reads(cache, meta):
    """The step's one-token sequences read together, in groups in step order: each row its own context, padded
    to its group's longest, no group's gather past DECODE_GATHER_ROWS unless it holds one sequence."""
    decodes = [seq for seq in meta.seqs if seq.query_len == 1]
    assert sum(group.slots.shape[0] for group in meta.decodes) == len(decodes)
    at = 0
    for decode in meta.decodes:
        group = decodes[at:at + decode.slots.shape[0]]
        at += len(group)
        rows = [seq.start for seq in group]
        if rows == list(range(len(rows))):  # the step's first rows: a slice
            assert decode.rows == slice(0, len(rows))
        else:
            assert decode.rows.tolist() == rows
        longest = max(seq.context_len for seq in group)
        assert decode.max_context == longest
        assert len(group) == 1 or len(group) * longest <= step_module.DECODE_GATHER_ROWS
        for layer in range(2):
            padded = cache.read_decode(layer, decode, "a")
            assert padded.shape == (len(group), longest, DIM)
            for b, seq in enumerate(group):
                (own,) = cache.read(layer, seq, "a")
                assert torch.equal(padded[b, :seq.context_len], own)
                if decode.valid is not None:
                    assert decode.valid[b].tolist() == [p < seq.context_len for p in range(longest)]
                else:
                    assert seq.context_len == longest


def test_first_slot_only_for_consecutive_ranges():
    runner = Steps(LatentCache(layers=1, num_blocks=8, block_size=BLOCK, fields={"a": CacheField(DIM)}, dtype=torch.float32))
    meta = step_meta(runner, [(0, 2), (1, 2)])  # blocks 0 and 1: the step's slots 0, 1, 4, 5 are not one range
    assert meta.first_slot is None
    assert [s.first_slot for s in meta.seqs] == [0, BLOCK]
    meta = step_meta(runner, [(1, 1)])  # one token: always one range
    assert meta.first_slot == BLOCK + 2
    for _ in range(3):  # sequence 0 grows past its block into block 2, after sequence 1's
        meta = step_meta(runner, [(0, 1)])
    assert meta.seqs[0].first_slot is None
