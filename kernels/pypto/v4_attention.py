"""DeepSeek-V4's decode attention in PyPTO: each sequence's heads against its own shared key = value rows, with a
mask of allowed keys and one sink logit per head, as runner/models/deepseek_v4.py's `Attention.decode` ends
(kernels.attention's `attention(q, keys, keys, scale, allowed[:, None], sinks=..., one_token=True)` is the torch
path it must equal).

Shapes: q [B, H, D], keys [B, K, D] (the sliding window's keys, then the selected compressed entries: one row is
both key and value), allowed [B, K], sinks [H]; out [B, H, D]. The kernel sees them flattened to 2-D: q as
[B * H, D], keys as [B * K, D], the mask as an additive float [B, K] (0 allowed, -inf not), sinks as a column
[H, 1]. Per sequence (a Python loop over B, unrolled as the kernel is traced): one [H, D] x [D, K] matmul for the
scores, the softmax over [scores, sink] with the sink's probability dropped, one [H, K] x [K, D] matmul for the
output. Everything runs in float32 (BF16 inputs are cast once, the output rounded once to BF16).

Tiles, at V4-Flash's decode (H = 64 heads a rank, D = 512, K = 128 + 512 = 640):
- vector: VEC_ROWS heads by the whole key axis, so that the softmax's row max and sum reduce inside one tile:
  8 x 640 float32 is 20 KiB a buffer, and the few live buffers of an elementwise step (its inputs, its output, the
  [8, 1] row statistics) stay far inside the unified buffer (192 KiB on the A2/A3 class the compiler checks); the
  [H, D] output's 8 x 512 tiles are 16 KiB. (Measured: 32 rows, 80 KiB a buffer, still compile; 64 rows, 160 KiB,
  are refused by a compiler pass.)
- cube: CUBE_M rows of heads, CUBE_K of the reduced axis, CUBE_N of the output's columns: the float32 operand tiles
  are 64 x 64 x 4 = 16 KiB (L0A) and 64 x 128 x 4 = 32 KiB (L0B), the accumulator 64 x 128 x 4 = 32 KiB (L0C),
  each inside its buffer (64 / 64 / 128 KiB on A2/A3). A smaller dimension takes its whole size, rounded up to
  tiles.CUBE_ALIGN (the tiny shapes' 4 heads, 21 keys: tiles of 16 and 32).
"""

import functools  # no `from __future__ import annotations`: PyPTO's jit reads the annotations as objects

import pypto
import torch

from dsconv.kernels.pypto.host import VERIFY_OPTIONS, run
from dsconv.kernels.pypto.tiles import cube_tile

DTYPES = {torch.float32: pypto.DT_FP32, torch.bfloat16: pypto.DT_BF16}
VEC_ROWS = 8  # heads per vector tile (the key axis whole: the softmax's reductions stay in one tile)
CUBE_M, CUBE_K, CUBE_N = 64, 64, 128  # the matmuls' tiles (module docstring)
MASKED = float("-inf")  # the additive mask's value for a key a query may not see
WRONG = (None, "no_sink", "shifted")


@functools.lru_cache(maxsize=64)
def _kernel(batch: int, heads: int, keys_n: int, dim: int, dtype: torch.dtype, scale: float, wrong=None):
    """The jitted kernel for one shape and dtype (compiled at its first call; PyPTO compiles every call). wrong: a
    deliberately wrong variant for the negative tests ("no_sink": the sink left out of the softmax; "shifted": key
    j's score computed with key j + 1's row, the last with the first, the values where they were)."""
    dt = DTYPES[dtype]
    cube_m, cube_k_scores, cube_k_out = cube_tile(heads, CUBE_M), cube_tile(dim, CUBE_K), cube_tile(keys_n, CUBE_K)
    cube_n_scores, cube_n_out = cube_tile(keys_n, CUBE_N), cube_tile(dim, CUBE_N)

    @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
    def v4_decode_attention(q: pypto.Tensor((batch * heads, dim), dt), keys: pypto.Tensor((batch * keys_n, dim), dt),
                            mask: pypto.Tensor((batch, keys_n), pypto.DT_FP32),
                            sinks: pypto.Tensor((heads, 1), pypto.DT_FP32),
                            out: pypto.Tensor((batch * heads, dim), dt)):
        pypto.set_vec_tile_shapes(min(heads, VEC_ROWS), max(keys_n, dim))
        outputs = []
        for b in range(batch):  # unrolled as traced: each sequence its own keys
            q_b = pypto.cast(pypto.view(q, [heads, dim], [b * heads, 0]), pypto.DT_FP32)
            k_b = pypto.cast(pypto.view(keys, [keys_n, dim], [b * keys_n, 0]), pypto.DT_FP32)
            scored = k_b
            if wrong == "shifted":  # key j scored with row j + 1 (a roll by one of the keys, not of the values)
                scored = pypto.concat([pypto.view(k_b, [keys_n - 1, dim], [1, 0]),
                                       pypto.view(k_b, [1, dim], [0, 0])], 0)
            pypto.set_cube_tile_shapes([cube_m, cube_m], [cube_k_scores, cube_k_scores],
                                       [cube_n_scores, cube_n_scores])
            scores = pypto.mul(pypto.matmul(q_b, scored, pypto.DT_FP32, b_trans=True), scale)  # [H, K]
            scores = pypto.add(scores, pypto.view(mask, [1, keys_n], [b, 0]))
            peak = pypto.amax(scores, -1, keepdim=True)  # [H, 1]
            if wrong != "no_sink":
                peak = pypto.maximum(peak, sinks)
            weights = pypto.exp(pypto.sub(scores, peak))  # [H, K], 0 where masked
            total = pypto.sum(weights, -1, keepdim=True)
            if wrong != "no_sink":  # the sink's own exp joins the denominator; its probability is dropped
                total = pypto.add(total, pypto.exp(pypto.sub(sinks, peak)))
            probs = pypto.div(weights, total)
            pypto.set_cube_tile_shapes([cube_m, cube_m], [cube_k_out, cube_k_out], [cube_n_out, cube_n_out])
            outputs.append(pypto.matmul(probs, k_b, pypto.DT_FP32))  # [H, D]
        out[:] = pypto.cast(pypto.concat(outputs, 0), dt)

    return v4_decode_attention


def v4_decode_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                        scale: float, wrong=None) -> torch.Tensor:
    """q [B, H, D], keys [B, K, D] (each row both key and value), allowed [B, K] bool, sinks [H] -> [B, H, D] in q's
    dtype (float32 or BF16), through PyPTO's interpreter on the host (host.run). A sequence that allows no key
    gets zeros (its sinks take all the probability), as the torch path does. wrong: a deliberately wrong variant
    for the negative tests ("no_sink", "shifted": _kernel's docstring)."""
    if wrong not in WRONG:
        raise ValueError(f"wrong={wrong!r}: one of {WRONG}")
    batch, heads, dim = q.shape
    keys_n = keys.shape[1]
    mask = torch.zeros(batch, keys_n).masked_fill(~allowed.bool(), MASKED)
    out = torch.empty(batch * heads, dim, dtype=q.dtype)
    run(_kernel(batch, heads, keys_n, dim, q.dtype, float(scale), wrong), q.reshape(batch * heads, dim).contiguous(),
        keys.to(q.dtype).reshape(batch * keys_n, dim).contiguous(), mask,
        sinks.float().reshape(heads, 1).contiguous(), out)
    return out.reshape(batch, heads, dim)
