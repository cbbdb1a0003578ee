"""DeepSeek-V3.2's absorbed sparse MLA decode in PyPTO: each sequence's heads, their queries already absorbed into
the latent space, attend over the latent rows of its chosen positions, gathered from the paged latent cache through
their slots; what runner/models/deepseek_v3.py's `Attention.absorbed` computes between its two absorptions (W_UK
into the queries before, W_UV into the outputs after: the MLA prolog's and epilog's projections).

Per sequence b, with query [H, lora + rope] = [q_nope @ W_UK | q_pe] and ctx [K, lora + rope] its K latent rows
(c_kv normed, then the rotated rope key):
    scores = query @ ctx^T * scale            [H, K], masked positions -inf
    probs  = softmax(scores) in float32
    out    = probs @ ctx[:, :lora]            [H, lora]
The cache is the runner's (runner/models/kv_cache.py): `c_kv_k_pe` [S, lora + rope] in the compute dtype, or under
--kv-cache-dtype int8 its latent as INT8 codes [S, lora] with one float32 scale per row [S, 1] and the rope key
[S, rope] in the compute dtype ("stored in 8, computed in 16": the codes are dequantized in float32 and rounded
once to the compute dtype, as the cache's `read_slots` does, then multiplied there).

Shapes: query [B * H, lora + rope] and out [B * H, lora]; slots [B * K] int32 (each sequence's chosen slots), mask
[B, K] float32 additive (0 or -inf). Tiles, at V3.2's decode (H = 128 heads, lora 512 + rope 64, K = 2048): vector
tiles of VEC_ROWS heads by the whole key axis, 8 x 2048 float32 = 64 KiB, inside the unified buffer (192 KiB on
the A2/A3 class the compiler checks; the softmax's reductions stay in one tile); cube tiles CUBE_M x CUBE_K by
CUBE_N, float32 operand tiles of 16 and 32 KiB (L0A / L0B, 64 KiB each).
"""

import functools  # no `from __future__ import annotations`: PyPTO's jit reads the annotations as objects

import pypto
import torch

from dsconv.kernels.pypto.host import VERIFY_OPTIONS, run
from dsconv.kernels.pypto.tiles import cube_tile

DTYPES = {torch.float32: pypto.DT_FP32, torch.bfloat16: pypto.DT_BF16}
VEC_ROWS = 8  # heads per vector tile, the key axis whole (the softmax reduces inside one tile)
CUBE_M, CUBE_K, CUBE_N = 64, 64, 128
MASKED = float("-inf")
WRONG = (None, "no_scale", "shifted")



@functools.lru_cache(maxsize=64)
def _kernel(batch: int, heads: int, lora: int, rope: int, slots_total: int, keys_n: int, dtype: torch.dtype,
            int8: bool, scale: float, wrong=None):
    """The jitted kernel for one shape, dtype and cache form. wrong: a deliberately wrong variant for the negative
    tests ("no_scale": the INT8 rows' scales left out, or the softmax scale for a float cache; "shifted": every
    position scored with the next position's latent row, the values where they were)."""
    dt = DTYPES[dtype]
    width = lora + rope
    latent_dtype = pypto.DT_INT8 if int8 else dt
    latent_width = lora if int8 else width
    cube_m = cube_tile(heads, CUBE_M)

    @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
    def sparse_mla_decode(query: pypto.Tensor((batch * heads, width), dt),
                          latent: pypto.Tensor((slots_total, latent_width), latent_dtype),
                          latent_scales: pypto.Tensor((slots_total, 1), pypto.DT_FP32),
                          rope_keys: pypto.Tensor((slots_total, rope), dt),
                          slots: pypto.Tensor((batch * keys_n,), pypto.DT_INT32),
                          mask: pypto.Tensor((batch, keys_n), pypto.DT_FP32),
                          out: pypto.Tensor((batch * heads, lora), dt)):
        pypto.set_vec_tile_shapes(min(heads, VEC_ROWS), max(keys_n, width))
        outputs = []
        for b in range(batch):
            rows = pypto.view(slots, [keys_n], [b * keys_n])  # this sequence's chosen slots of the paged cache
            if int8:  # stored in 8: codes * scale in float32, rounded once to the compute dtype, rope appended
                codes = pypto.cast(pypto.index_select(latent, 0, rows), pypto.DT_FP32)
                if wrong != "no_scale":
                    codes = pypto.mul(codes, pypto.index_select(latent_scales, 0, rows))
                ctx = pypto.concat([pypto.cast(pypto.cast(codes, dt), pypto.DT_FP32),
                                    pypto.cast(pypto.index_select(rope_keys, 0, rows), pypto.DT_FP32)], -1)
            else:
                ctx = pypto.cast(pypto.index_select(latent, 0, rows), pypto.DT_FP32)  # [K, lora + rope]
            q_b = pypto.cast(pypto.view(query, [heads, width], [b * heads, 0]), pypto.DT_FP32)
            pypto.set_cube_tile_shapes([cube_m, cube_m], [cube_tile(width, CUBE_K), cube_tile(width, CUBE_K)],
                                       [cube_tile(keys_n, CUBE_N), cube_tile(keys_n, CUBE_N)])
            scored = ctx
            if wrong == "shifted":  # position j scored with row j + 1's latent (the values where they were)
                scored = pypto.concat([pypto.view(ctx, [keys_n - 1, width], [1, 0]),
                                       pypto.view(ctx, [1, width], [0, 0])], 0)
            scores = pypto.matmul(q_b, scored, pypto.DT_FP32, b_trans=True)  # [H, K]
            if not (wrong == "no_scale" and not int8):
                scores = pypto.mul(scores, scale)
            scores = pypto.add(scores, pypto.view(mask, [1, keys_n], [b, 0]))
            weights = pypto.exp(pypto.sub(scores, pypto.amax(scores, -1, keepdim=True)))
            probs = pypto.div(weights, pypto.sum(weights, -1, keepdim=True))
            pypto.set_cube_tile_shapes([cube_m, cube_m], [cube_tile(keys_n, CUBE_K), cube_tile(keys_n, CUBE_K)],
                                       [cube_tile(lora, CUBE_N), cube_tile(lora, CUBE_N)])
            outputs.append(pypto.matmul(probs, pypto.view(ctx, [keys_n, lora], [0, 0]), pypto.DT_FP32))
        if batch == 1:
            out[:] = pypto.cast(outputs[0], dt)
        else:
            out[:] = pypto.cast(pypto.concat(outputs, 0), dt)

    return sparse_mla_decode


def sparse_mla_decode(query: torch.Tensor, cache: dict, slots: torch.Tensor, valid: torch.Tensor | None,
                      lora: int, scale: float, wrong=None) -> torch.Tensor:
    """query [B, H, lora + rope] (W_UK absorbed, then q_pe), cache one layer's latent cache as the runner stores it
    ({"c_kv_k_pe": [S, lora + rope]}, or under INT8 {"c_kv_k_pe.int8": [S, lora], "c_kv_k_pe.scale": [S, 1],
    "c_kv_k_pe.rest": [S, rope]}), slots [B, K] each sequence's chosen slots, valid [B, K] bool or None -> [B, H,
    lora] in query's dtype, through PyPTO's interpreter (host.run). A row must allow at least one position."""
    if wrong not in WRONG:
        raise ValueError(f"wrong={wrong!r}: one of {WRONG}")
    batch, heads, width = query.shape
    rope, keys_n = width - lora, slots.shape[1]
    int8 = "c_kv_k_pe.int8" in cache
    if int8:  # the layer's cache as stored: INT8 codes, their scales, the rope keys
        latent, scales, rope_keys = (cache[f"c_kv_k_pe.{part}"] for part in ("int8", "scale", "rest"))
    else:  # the latent rows hold the rope key: the INT8 form's inputs are placeholders, never read
        latent = cache["c_kv_k_pe"].to(query.dtype)
        scales, rope_keys = torch.ones(latent.shape[0], 1), torch.zeros(latent.shape[0], rope, dtype=query.dtype)
    mask = torch.zeros(batch, keys_n)
    if valid is not None:
        mask = mask.masked_fill(~valid, MASKED)
    out = torch.empty(batch * heads, lora, dtype=query.dtype)
    run(_kernel(batch, heads, lora, rope, latent.shape[0], keys_n, query.dtype, int8, float(scale), wrong),
        query.reshape(batch * heads, width).contiguous(), latent.contiguous(), scales.float().contiguous(),
        rope_keys.to(query.dtype).contiguous(), slots.to(torch.int32).flatten().contiguous(), mask, out)
    return out.reshape(batch, heads, lora)
