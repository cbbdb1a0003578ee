"""KV cache memory: the bytes per token of the live cache tensors against what `dsconv plan` says, and what
--kv-cache-dtype int8 buys in tokens for the same bytes (what `dsrun serve --kv-cache-memory-bytes` holds)."""

import json
from pathlib import Path

import pytest
import torch

from dsconv.family.arch import DEFAULT_BLOCK_SIZE as BLOCK_SIZE, family_for
from dsconv.family.deepseek_v3 import cache_fields
from dsconv.family.deepseek_v4 import AttnType
from dsconv.family.layout import Layout
from dsconv.runner.models.registry import build_model
from dsconv.runner.models.dist import Dist
from dsconv.errors import InputError
from dsconv.runner.engine.config import CacheConfig, RunConfig, SchedulerConfig
from dsconv.runner.models.kv_cache import LatentCache
from dsconv.runner.models.weights import load_manifest
from dsconv.shard.sizes import CACHE_DTYPE, kv_cache_bytes_per_token
from tests.helpers import shard

REAL_V32 = Path(__file__).parent / "data" / "deepseek_v32_exp.config.json"
PLAN_TOLERANCE = 0.02
INT8_TOKENS_MIN = 1.7  # the INT8 cache's target: int8 holds at least 1.7x the tokens of the 16-bit cache in the same bytes


def _model(tiny_source, tmp_path, family: str):
    shards = tmp_path / f"{family}-shards"
    shard(tiny_source(family, "fp8"), shards, Layout(1, 1, 1, 1))
    manifest = load_manifest(shards)
    model, cfg, new_cache = build_model(shards, manifest, 0, Dist(), torch.bfloat16)
    return model, cfg, new_cache, family_for(manifest["model"]["config"])


def test_v3_live_cache_bytes_per_token_equal_the_plan(tiny_source, tmp_path):
    for name in ("deepseek_v3", "deepseek_v32"):
        _, cfg, new_cache, family = _model(tiny_source, tmp_path, name)
        for kv in ("auto", "int8"):
            cache = new_cache(4 * BLOCK_SIZE, kv)
            live = sum(t.numel() * t.element_size() for t in cache.data.values()) / (4 * BLOCK_SIZE)
            # CPU keeps a BF16 run's 16-bit entries as float32 (what its products take); an INT8 cache keeps its
            # unquantized rope key in the compute dtype, BF16, as a device would
            itemsize = cache.dtype.itemsize if kv == "auto" else CACHE_DTYPE.itemsize
            planned = sum(family.kv_cache_bytes_per_token(cfg, itemsize, kv).values())
            assert abs(live / planned - 1) <= PLAN_TOLERANCE, (name, kv, live, planned)
            assert live == cache.bytes_per_token


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_v4_cache_bytes_against_the_plan(tiny_source, tmp_path, block_size):
    """V4's cache tensors are all its storage: blocks of compressed entries and indexer keys, and sequence slots
    (windows, compressor state). A block's bytes equal the plan's per-token figures over the block's tokens, but
    for a group whose ratio is past the block size, which keeps one whole entry per block (its entries live in
    the block of their window's last token); a slot's bytes equal the plan's per-sequence figures. With prefix
    caching, the state blocks: per layer a block's window keys, and per compressor whose window spans blocks
    (HCA's 128 past the block size) every position's projected row and float32 gate, per overlapping one (CSA and
    its indexer, ratio 4) its last window's first series."""
    _, cfg, new_cache, family = _model(tiny_source, tmp_path, "deepseek_v4")
    assert new_cache(4 * block_size, block_size=block_size, max_seqs=3, prefix_caching=False).state_blocks == 0
    cache = new_cache(4 * block_size, block_size=block_size, max_seqs=3)
    itemsize = cache.dtype.itemsize
    per_block = 0
    for ratio, attn_type in zip(cfg.compress_ratios, cfg.attn_types):
        if attn_type is AttnType.SLIDING:
            continue
        dims = cfg.head_dim + (cfg.index_head_dim if attn_type is AttnType.CSA else 0)
        per_block += dims * itemsize * max(block_size, ratio) // ratio
    planned = sum(family.kv_cache_bytes_per_token(cfg, itemsize).values())
    if block_size >= max(cfg.compress_ratios):
        assert per_block == planned * block_size  # every group's entries fill their blocks
    else:
        assert per_block > planned * block_size
    assert cache.bytes_per_block == per_block
    assert cache.bytes_per_seq == sum(family.kv_cache_bytes_per_sequence(cfg, itemsize).values())
    per_state = 0
    for ratio, attn_type in zip(cfg.compress_ratios, cfg.attn_types):
        per_state += block_size * cfg.head_dim * itemsize  # the window keys
        row = itemsize + 4  # a projected value and its float32 gate
        if attn_type is AttnType.HCA and ratio > block_size:
            per_state += block_size * cfg.head_dim * row
        if attn_type is AttnType.CSA:
            per_state += ratio * (cfg.head_dim + cfg.index_head_dim) * row
    assert cache.state_blocks and cache.bytes_per_state_block == per_state
    assert sum(t.nbytes for t in cache.tensors()) == (4 * per_block + 3 * cache.bytes_per_seq
                                                      + cache.state_blocks * per_state)


def test_int8_cache_holds_more_tokens_in_the_same_bytes(tiny_source, tmp_path):
    """The token count `dsrun serve --kv-cache-memory-bytes` gives each cache, INT8 against auto: for the tiny
    V3.2 in this BF16 run on CPU (auto entries kept as float32), and for the real V3.2-Exp config's cache laid out
    as a device holds it (16-bit entries; on the meta device, so nothing is allocated), where the latent's share
    of its row is the real one (512 of 576 values; the tiny config's rope key is half its row)."""
    _, cfg, new_cache, family = _model(tiny_source, tmp_path, "deepseek_v32")
    budget = 64 << 20
    auto, int8 = (RunConfig.open(tmp_path / "deepseek_v32-shards", dtype="bfloat16",
                                 cache=CacheConfig(memory_bytes=budget, dtype=kv)).cache_tokens
                  for kv in ("auto", "int8"))
    assert int8 / auto >= INT8_TOKENS_MIN, (int8, auto)
    for kv, tokens in (("auto", auto), ("int8", int8)):
        cache = new_cache(tokens, kv)
        assert cache.num_blocks * BLOCK_SIZE == tokens and cache.bytes_per_token * tokens <= budget

    raw = json.loads(REAL_V32.read_text())
    real = family_for(raw).parse_config(raw)
    per_token = {}
    for kv in ("auto", "int8"):
        cache = LatentCache(real.num_hidden_layers, 1, BLOCK_SIZE, cache_fields(real, kv), torch.bfloat16, "meta",
                            rest_dtype=torch.bfloat16)
        per_token[kv] = cache.bytes_per_token
        assert per_token[kv] == sum(kv_cache_bytes_per_token(family_for(raw), real, kv).values())  # the plan's
    assert per_token == {"auto": 85_888, "int8": 61 * (656 + 132)}
    assert per_token["auto"] / per_token["int8"] >= INT8_TOKENS_MIN


def test_byte_budget_on_an_npu_holds_the_idle_rank_block(tiny_source, tmp_path):
    """On an NPU the latent cache allocates one block past the pool for an idle rank's throwaway token: a byte
    budget's block count leaves room for it there and not on CPU (float32 entries: the same bytes on both)."""
    _model(tiny_source, tmp_path, "deepseek_v32")
    runs = {device: RunConfig.open(tmp_path / "deepseek_v32-shards", dtype="float32", device=device,
                                   cache=CacheConfig(memory_bytes=1 << 20)) for device in ("cpu", "npu")}
    per_block, per_seq = runs["cpu"].cache_bytes
    assert runs["npu"].cache_bytes == runs["cpu"].cache_bytes and per_seq == 0
    assert runs["cpu"].cache_blocks == (1 << 20) // per_block == runs["npu"].cache_blocks + 1
    assert (runs["npu"].cache_blocks + 1) * per_block <= 1 << 20


def test_v4_byte_budget_carves_slots_then_blocks(tiny_source, tmp_path):
    """--kv-cache-memory-bytes for V4: the sequence slots (one per --max-num-seqs) come first, the blocks take the
    rest; a budget short of one block after the slots is one line naming the least that works."""
    _model(tiny_source, tmp_path, "deepseek_v4")
    shards = tmp_path / "deepseek_v4-shards"

    def run(budget: int, max_num_seqs: int = 4) -> RunConfig:
        return RunConfig.open(shards, dtype="float32", cache=CacheConfig(memory_bytes=budget),
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))

    per_block, per_seq = run(1 << 30).cache_bytes
    assert per_block > 0 and per_seq > 0
    budget = 4 * per_seq + 10 * per_block + per_block // 2
    assert run(budget).cache_blocks == 10
    assert run(budget + per_seq, max_num_seqs=5).cache_blocks == 10
    least = 4 * per_seq + per_block
    assert run(least).cache_blocks == 1
    with pytest.raises(InputError, match=f"holds less than one block of the KV cache after 4 sequence slots of "
                                         f"{per_seq} bytes.*at least {least} bytes"):
        run(least - 1)
    summary = run(budget).cache_summary()
    assert summary.startswith("KV cache per attention-DP rank: 10 blocks x 16 tokens = 160 tokens, ") and \
        "4 sequence slots" in summary


def test_v4_block_size_must_hold_whole_entries():
    """Entry e of ratio r lives in the block of its window's last token, one per block past the block size: that
    needs r and the block size to divide one another, else two entries would share a slot."""
    from dsconv.runner.models.v4_cache import check_geometry

    for ratios, block_size in (([4, 128], 1), ([4, 128], 16), ([4, 128], 256), ([0, 4, 128], 1024)):
        check_geometry(ratios, block_size)
    with pytest.raises(InputError, match="--block-size 64 cannot hold deepseek_v4's compress ratio 48 in whole "
                                         "entries"):
        check_geometry([4, 48], 64)
    with pytest.raises(InputError, match="compress ratio 3"):
        check_geometry([3], 16)
