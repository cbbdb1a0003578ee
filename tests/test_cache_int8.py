"""--kv-cache-dtype int8 at the level of its parts: the per-token (per-tile) quantizer against a NumPy evaluation of
its formula, the paged cache storing and reading INT8 fields (as stored, and dequantized, through views and through
gathers), the A8C8 scores against an int32 reference, and the whole path on the `meta` device, where any read
back to the host (a sync on an accelerator) raises."""

import numpy as np
import pytest
import torch

from dsconv.family.arch import CacheField, check_kv_cache_dtype, family_for
from dsconv.family.deepseek_v3 import cache_fields, parse_config, tiny_config
from dsconv.errors import InputError
from dsconv.kernels.cache_int8 import dequantize_tokens, int8_scores, quantize_tokens
from dsconv.runner.models.kv_cache import LatentCache
from tests.helpers import Steps

BLOCK = 4


def numpy_quantize(x: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """The symmetric per-row formula over tiles of `tile` values: scale = max(amax, 1e-8) / 127,
    q = clip(round_half_even(x / scale), -127, 127), in float32."""
    rows = x.reshape(-1, tile).astype(np.float32)
    scale = (np.maximum(np.abs(rows).max(axis=1, keepdims=True), np.float32(1e-8)) / np.float32(127)).astype(np.float32)
    q = np.clip(np.round(rows / scale), -127, 127).astype(np.int8)
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], x.shape[-1] // tile)


def test_quantize_tokens_matches_numpy_per_tile():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=gen) * torch.logspace(-3, 2, 7)[:, None]
    x[3] = 0  # an all-zero row: finite scale, exact zeros back
    for tile in (256, 128, 64):
        q, scale = quantize_tokens(x.view(7, -1, tile))
        q_ref, scale_ref = numpy_quantize(x.numpy(), tile)
        assert np.array_equal(q.reshape(7, 256).numpy(), q_ref)
        assert np.array_equal(scale.reshape(7, -1).numpy(), scale_ref)
        back = dequantize_tokens(q, scale, torch.float32).reshape(7, 256)
        assert torch.equal(back[3], torch.zeros(256))
        # half a step at most per value: |x - q * s| <= s / 2
        step = scale.reshape(7, -1).repeat_interleave(tile, dim=1)
        assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()


def test_int8_scores_are_exact_integer_sums_scaled():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (3, 5, 128), generator=gen, dtype=torch.int8)
    k = torch.randint(-127, 128, (3, 9, 128), generator=gen, dtype=torch.int8)
    q_scale, k_scale = torch.rand(3, 5, 1, generator=gen), torch.rand(3, 9, 1, generator=gen)
    exact = q.to(torch.int32) @ k.to(torch.int32).transpose(1, 2)  # int32 reference sums
    scores = int8_scores(q, q_scale, k, k_scale)
    assert torch.equal(scores, exact.to(torch.float32) * q_scale * k_scale.transpose(1, 2))
    # the extreme case: every product 127 * 127 (or -127 * 127), still exact
    full = torch.full((1, 128), 127, dtype=torch.int8)
    assert int8_scores(full, torch.ones(1, 1), -full, torch.ones(1, 1)).item() == -128 * 127 * 127
    with pytest.raises(ValueError, match="int8 queries"):
        int8_scores(q.float(), q_scale, k, k_scale)


FIELDS = {"latent": CacheField(6, 4, tile=2), "keys": CacheField(4, 4)}


def _values(seq_id: int, positions: range) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seq_id * 1000 + positions.start)
    return {name: torch.randn(len(positions), field.dim, generator=gen) for name, field in FIELDS.items()}


def test_int8_fields_read_back_dequantized_and_as_stored():
    cache = LatentCache(layers=2, num_blocks=16, block_size=BLOCK, fields=FIELDS, dtype=torch.float32,
                        rest_dtype=torch.bfloat16)
    assert cache.data["latent.int8"].dtype == torch.int8 and cache.data["latent.scale"].shape[-1] == 2
    assert cache.data["latent.rest"].dtype == torch.bfloat16 and "keys.rest" not in cache.data
    # bytes per token from the tensors: latent 4 int8 + 2 float32 scales + 2 BF16, keys 4 int8 + 1 scale; 2 layers
    assert cache.bytes_per_token == 2 * (4 + 2 * 4 + 2 * 2) + 2 * (4 + 4)
    assert cache.bytes_per_token == 2 * sum(field.nbytes(2) for field in FIELDS.values())
    runner = Steps(cache)
    written: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    lengths = dict.fromkeys(written, 0)
    # prefills, then interleaved decodes: the blocks of sequences 0..2 end up scattered (gathered reads)
    for step in [[(0, 5)], [(1, 3), (2, 6)]] + [[(0, 1), (1, 1), (2, 1)]] * 4:
        meta = runner.inputs([(seq_id, [0] * n) for seq_id, n in step]).meta
        values = [_values(seq_id, range(lengths[seq_id], lengths[seq_id] + n)) for seq_id, n in step]
        for layer in range(2):
            cache.write(layer, meta, **{name: torch.cat([v[name] for v in values]) + layer for name in FIELDS})
        for (seq_id, n), value in zip(step, values):
            written[seq_id].append(value)
            lengths[seq_id] += n
        for seq in meta.seqs:
            for layer in range(2):
                for name, field in FIELDS.items():
                    original = torch.cat([v[name] for v in written[seq.seq_id]]) + layer
                    q_ref, s_ref = quantize_tokens(original[:, :field.int8_dims].reshape(
                        original.shape[0], field.scales, -1))
                    q, s = cache.read_int8(layer, name, seq=seq)
                    assert torch.equal(q, q_ref.reshape(q.shape)) and torch.equal(s, s_ref.reshape(s.shape))
                    (got,) = cache.read(layer, seq, name)
                    expected = dequantize_tokens(q_ref, s_ref, torch.float32).reshape(original.shape[0], -1)
                    if field.dim > field.int8_dims:  # the rest as stored: rounded to BF16
                        expected = torch.cat([expected, original[:, field.int8_dims:].bfloat16().float()], dim=-1)
                    assert torch.equal(got, expected)
        for decode in meta.decodes:  # the decode group's padded read: each row its own context
            for name in FIELDS:
                padded = cache.read_decode(0, decode, name)
                q, s = cache.read_int8(0, name, decode=decode)
                assert padded.shape[:2] == q.shape[:2] == s.shape[:2]


def test_the_int8_path_never_reads_back_to_the_host():
    """Quantize, store, gather, dequantize and score on the meta device: a tensor there has no values, so any
    .item(), .tolist() or bool() on the way (a host sync on an NPU or GPU) would raise."""
    device = torch.device("meta")
    x = torch.empty(6, 8, 256, device=device)
    q, scale = quantize_tokens(x)
    assert q.device == device and q.dtype == torch.int8 and scale.shape == (6, 8, 1)
    values = dequantize_tokens(q, scale, torch.bfloat16)
    assert values.device == device and values.dtype == torch.bfloat16
    keys, key_scale = quantize_tokens(torch.empty(6, 40, 256, device=device))
    assert int8_scores(q, scale, keys, key_scale).shape == (6, 8, 40)
    cache = LatentCache(layers=1, num_blocks=4, block_size=BLOCK, fields=FIELDS, dtype=torch.float32,
                        device=device, rest_dtype=torch.bfloat16)
    slots = torch.empty(5, dtype=torch.long, device=device)
    for name, field in FIELDS.items():
        q, s = quantize_tokens(torch.empty(5, field.int8_dims, device=device).view(5, field.scales, -1))
        cache.data[f"{name}.int8"][0].index_copy_(0, slots, q.view(5, -1))
        cache.data[f"{name}.scale"][0].index_copy_(0, slots, s.view(5, -1))
        assert cache.read_slots(0, name, slots.view(1, 5)).shape == (1, 5, field.dim)


def test_v3_cache_fields_and_the_one_line_refusals():
    cfg = parse_config(tiny_config("deepseek_v32"))
    auto, int8 = cache_fields(cfg), cache_fields(cfg, "int8")
    assert all(field.int8_dims == 0 for field in auto.values())
    assert int8["c_kv_k_pe"] == CacheField(cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, 128)
    assert int8["index_k"] == CacheField(cfg.index_head_dim, cfg.index_head_dim)
    real = parse_config(tiny_config("deepseek_v32", kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128))
    # DeepSeek's FP8 MLA row and CANN's C8 row: 512 + 4 scales x 4 B + 64 x 2 B = 656 bytes; indexer 128 + 4
    assert cache_fields(real, "int8")["c_kv_k_pe"].nbytes(2) == 656
    assert cache_fields(real, "int8")["index_k"].nbytes(2) == 132
    with pytest.raises(InputError, match="not one of auto, int8"):
        check_kv_cache_dtype(family_for(tiny_config("deepseek_v3")), "fp8")
    from dsconv.family.deepseek_v4 import cache_fields as v4_cache_fields, parse_config as v4_parse, \
        tiny_config as v4_tiny

    check_kv_cache_dtype(family_for(v4_tiny()), "int8")  # V4's C8
    check_kv_cache_dtype(family_for(tiny_config("deepseek_v32")), "int8")
    # V4-Flash's rows: a compressed entry's 448 INT8 values + 1 scale + its 64-value rotary tail in BF16; an
    # indexer key's 128 INT8 + 1 scale
    v4 = v4_parse(v4_tiny(head_dim=512, qk_rope_head_dim=64, index_head_dim=128))
    assert {name: field.nbytes(2) for name, field in v4_cache_fields(v4, "int8").items()} == {"kv": 580,
                                                                                              "index_k": 132}
    assert {name: field.nbytes(2) for name, field in v4_cache_fields(v4).items()} == {"kv": 1024, "index_k": 256}
