"""DeepSeek-V3.2's lightning indexer for a decode group, in PyPTO: each sequence's index scores over its cached
keys, read from the paged key cache through its slots, then its top k positions; what runner/models/deepseek_v3.py's
`Indexer.select_decode` computes in torch.

Per sequence b, with q [heads, dim] its index queries (normed, roped; rotated by the Hadamard matrix for an INT8
cache) and w [heads] its head weights:
    scores[h, c] = relu(q[h] . key[c] / sqrt(dim))          INT8 cache (A8C8): q quantized per head as the cache
                                                             quantizes keys, q_codes . key_codes summed exactly as
                                                             integers, times both scales
    index[c]     = sum_h w[h] / sqrt(heads) * scores[h, c]   padded or invalid positions -inf
    top          = the k best positions, ties toward the lowest position (relu leaves exact zeros)

The top k are found in steps that do not depend on how PyPTO's topk orders ties (torch.topk in the interpreter,
unspecified), and with topk calls of at most SELECT_COLS (PyPTO 0.2.0 refuses a k above the vector tile's last
axis):
- the k-th best score v, in rounds: a round's SELECT_COLS best scores give v when it lies among them; else every score
  at or above the round's lowest is set aside (all of them rank before v) and the next round looks below;
- kept: every position scoring above v, and of those scoring v the first (k - above) by position (a running count);
- each kept position goes to its place among the kept (a running count of them), the others after: the kept
  positions, lowest first, in the output's first k columns (one scatter).
The running counts are taken one selection tile at a time, each tile's cumsum plus the sum of the tiles before it:
PyPTO 0.2.0's cumsum across tiles carries a tile's last value into the next through an EXPAND that its pass
verification cannot replay (InferDynShape wrote no result: measured at 2,048 positions), and a cumsum over one tile
of the whole row does not compile.
The torch path lists them best first: the same set (tests compare sets; attention over them differs only in the
order of its float sums).

Shapes: q [B * heads, dim] float32; head_weights [B, heads] float32; keys [S, dim] (the layer's whole key cache:
int8 with scales [S, 1] float32, or float32) and slots [B * C] int32 (each sequence's context), gathered in the
kernel; valid [B, C] float32, 1 where a position is real. Out: [B, k] int32. The heads are scored VEC_ROWS at a
time and their weighted scores summed (measured: a tensor of more heads than a tile's rows made PyPTO's pass
verification fail). Tiles: vector VEC_ROWS x VEC_COLS float32 for the scores (16 KiB, inside the 192 KiB unified
buffer of the A2/A3 class the compiler checks), 1 x SELECT_COLS for the selection; a reduction's tile is 32-byte
aligned (VEC_ALIGN), a scatter's axis whole (one row of C: 32 KiB at 8K); cube CUBE_M x CUBE_K by CUBE_N.

Checked at V3.2's decode size: 64 index heads of 128 over 8,192 positions, top 2,048
(tests/test_pypto_v32_attention.py).
"""

import functools  # no `from __future__ import annotations`: PyPTO's jit reads the annotations as objects

import pypto
import torch

from dsconv.kernels.int8 import AMAX_FLOOR, INT8_MAX
from dsconv.kernels.pypto.host import VERIFY_OPTIONS, run

VEC_ROWS, VEC_COLS = 8, 512
VEC_ALIGN = 8  # float32 values in 32 bytes
# the selection's tile: one row of 1,024 scores. topk takes k up to the tile's last axis, so V3.2's top-2,048 takes
# two rounds. Measured: at 8,192 positions the score tile's 8 x 512 made PyPTO 0.2.0's cost model fail (FFFFFF), and
# a 2,048-wide tile overflowed the unified buffer in topk's transpose (200 KiB of 192).
SELECT_COLS = 1024
# cube tiles, K whole at the index head's 128: float32 keys CUBE_M x CUBE_K (L0A 32 KiB) by CUBE_N[False] (L0B 32 KiB of
# 64); INT8 keys by CUBE_N[True] (L0B 32 KiB; L0C CUBE_M x 256 INT32, 64 KiB of 128). The wider INT8 tile took V3.2's
# 8K decode from 34 s to 12 s in the interpreter (a quarter of the tiles to compile)
CUBE_M, CUBE_K = 64, 128
CUBE_N = {False: 64, True: 256}


def _aligned(columns: int) -> int:
    """A vector tile's last axis rounded up to VEC_ALIGN values: the compiler wants reductions' tiles 32-byte
    aligned."""
    return -(-columns // VEC_ALIGN) * VEC_ALIGN


@functools.lru_cache(maxsize=64)
def _kernel(batch: int, heads: int, dim: int, slots_total: int, context: int, k: int, int8: bool, wrong=None):
    key_dtype = pypto.DT_INT8 if int8 else pypto.DT_FP32
    score_scale = dim ** -0.5
    select_cols = _aligned(min(context, SELECT_COLS))
    take = min(select_cols, context)
    head_scale = heads ** -0.5

    @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
    def indexer_topk(q: pypto.Tensor((batch * heads, dim), pypto.DT_FP32),
                     head_weights: pypto.Tensor((batch, heads), pypto.DT_FP32),
                     keys: pypto.Tensor((slots_total, dim), key_dtype),
                     key_scales: pypto.Tensor((slots_total, 1), pypto.DT_FP32),
                     slots: pypto.Tensor((batch * context,), pypto.DT_INT32),
                     valid: pypto.Tensor((batch, context), pypto.DT_FP32),
                     positions: pypto.Tensor((1, context), pypto.DT_FP32),
                     top: pypto.Tensor((batch, k), pypto.DT_INT32)):
        pypto.set_vec_tile_shapes(VEC_ROWS, _aligned(min(context, VEC_COLS)))
        pypto.set_cube_tile_shapes([CUBE_M, CUBE_M], [CUBE_K, CUBE_K], [CUBE_N[int8], CUBE_N[int8]])
        picks = []
        for b in range(batch):
            rows = pypto.view(slots, [context], [b * context])  # this sequence's context slots of the paged cache
            keys_b = pypto.index_select(keys, 0, rows)  # its keys as stored
            if int8:
                k_scale = pypto.transpose(pypto.index_select(key_scales, 0, rows), 0, 1)  # [1, C]
            index = None
            for first in range(0, heads, VEC_ROWS):  # VEC_ROWS heads at a time (module docstring), summed
                rows_n = min(VEC_ROWS, heads - first)
                query = pypto.view(q, [rows_n, dim], [b * heads + first, 0])
                if int8:  # A8C8: the query quantized per head (kernels/int8.py's formula), integer sums, both scales
                    q_scale = pypto.mul(pypto.maximum(pypto.amax(pypto.abs(query), -1, keepdim=True), AMAX_FLOOR),
                                        1.0 / INT8_MAX)
                    codes = pypto.cast(pypto.clip(pypto.round(pypto.div(query, q_scale)), -INT8_MAX, INT8_MAX),
                                       pypto.DT_INT8)
                    sums = pypto.matmul(codes, keys_b, pypto.DT_INT32, b_trans=True)
                    scores = pypto.mul(pypto.mul(pypto.cast(sums, pypto.DT_FP32), q_scale), k_scale)
                else:
                    scores = pypto.matmul(query, keys_b, pypto.DT_FP32, b_trans=True)
                scores = pypto.relu(pypto.mul(scores, score_scale))  # [rows, C]
                weights = pypto.mul(pypto.view(head_weights, [1, rows_n], [b, first]), head_scale)
                part = pypto.matmul(weights, scores, pypto.DT_FP32)  # [1, C]
                index = part if index is None else pypto.add(index, part)
            real = pypto.view(valid, [1, context], [b, 0])
            index = pypto.where(pypto.gt(real, 0.5), index, float("-inf"))
            if wrong == "shifted":  # position c's score read at c + 1: every index off by one
                index = pypto.concat([pypto.view(index, [1, context - 1], [0, 1]),
                                      pypto.view(index, [1, 1], [0, 0])], -1)
            # the k-th best score, exactly, with topk calls of at most SELECT_COLS (PyPTO's limit): each round's top
            # values give it when it lies among them; else every score at or above the round's lowest is set aside
            # (all of them ranked before it) and the next round looks below
            pypto.set_vec_tile_shapes(1, select_cols)
            remaining, need, kth = index, None, None
            for _ in range(-(-k // take)):
                best, _ = pypto.topk(remaining, take, -1, True)  # [1, take], best first
                lowest = pypto.view(best, [1, 1], [0, take - 1])
                at_or_above = pypto.sum(pypto.where(pypto.ge(remaining, lowest), 1.0, 0.0), -1, keepdim=True)
                if need is None:
                    need = pypto.add(pypto.mul(at_or_above, 0.0), float(k))  # [1, 1]: ranks still to pass
                pick = pypto.cast(pypto.clip(pypto.add(need, -1.0), 0.0, float(take - 1)), pypto.DT_INT32)
                here = pypto.where(pypto.le(need, float(take)), pypto.gather(best, 1, pick), lowest)
                found = pypto.where(pypto.ge(at_or_above, need), 1.0, 0.0)
                found = pypto.maximum(found, pypto.where(pypto.le(need, float(take)), 1.0, 0.0))
                if kth is None:
                    kth, done = here, found
                else:  # a round counts only while the k-th is not found
                    kth = pypto.where(pypto.gt(done, 0.5), kth, here)
                    done = pypto.maximum(done, found)
                need = pypto.add(need, pypto.mul(at_or_above, -1.0))
                remaining = pypto.where(pypto.lt(remaining, lowest), remaining, float("-inf"))
            # kept: every score above the k-th, and of those equal to it the first (k - above) by position; then
            # each kept position goes to its place among the kept (a running count), the others after them
            above = pypto.where(pypto.gt(index, kth), 1.0, 0.0)
            at = pypto.where(pypto.eq(index, kth), 1.0, 0.0)
            # how many ties are kept: k - above (a scalar first operand of sub mis-compiles: negate and add)
            room = pypto.add(pypto.mul(pypto.sum(above, -1, keepdim=True), -1.0), float(k))
            # running counts one tile at a time, each tile's cumsum plus the sum of the tiles before it (a cumsum
            # across tiles fails PyPTO 0.2.0's InferDynShape replay; module docstring); the counts are exact in
            # float32 (below 2^24)
            parts, carry = [], None
            for first in range(0, context, select_cols):
                chunk = pypto.view(at, [1, min(select_cols, context - first)], [0, first])
                parts.append(pypto.cumsum(chunk, -1) if carry is None else pypto.add(pypto.cumsum(chunk, -1), carry))
                total = pypto.sum(chunk, -1, keepdim=True)
                carry = total if carry is None else pypto.add(carry, total)
            ties_before = parts[0] if len(parts) == 1 else pypto.concat(parts, -1)  # ties up to each position
            kept = pypto.add(above, pypto.where(pypto.le(ties_before, room), at, 0.0))  # 1 or 0
            parts, carry = [], None
            for first in range(0, context, select_cols):
                chunk = pypto.view(kept, [1, min(select_cols, context - first)], [0, first])
                parts.append(pypto.cumsum(chunk, -1) if carry is None else pypto.add(pypto.cumsum(chunk, -1), carry))
                total = pypto.sum(chunk, -1, keepdim=True)
                carry = total if carry is None else pypto.add(carry, total)
            kept_before = parts[0] if len(parts) == 1 else pypto.concat(parts, -1)  # kept up to each position
            # a kept position's place: kept before it (itself included) - 1; another's: k + those not kept before it
            # (position + 1 - kept_before) - 1
            place = pypto.where(pypto.gt(kept, 0.5), pypto.add(kept_before, -1.0),
                                pypto.add(pypto.add(positions, pypto.mul(kept_before, -1.0)), float(k)))
            pypto.set_vec_tile_shapes(1, _aligned(context))  # a scatter's axis is not split: a row of C (32 KiB at 8K)
            ordered = pypto.scatter(pypto.mul(positions, 0.0), 1, pypto.cast(place, pypto.DT_INT32), positions)
            pypto.set_vec_tile_shapes(VEC_ROWS, _aligned(min(context, VEC_COLS)))
            picks.append(pypto.cast(pypto.view(ordered, [1, k], [0, 0]), pypto.DT_INT32))
        if batch == 1:
            top[:] = picks[0]
        else:
            top[:] = pypto.concat(picks, 0)

    return indexer_topk


def indexer_topk(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
                 slots: torch.Tensor, valid: torch.Tensor | None, k: int, wrong=None) -> torch.Tensor:
    """q [B, heads, dim] (rotated for an INT8 cache), head_weights [B, heads], keys [S, dim] the layer's key cache
    (int8 with key_scales [S, 1], or float), slots [B, C] each sequence's context slots, valid [B, C] bool or None
    -> [B, min(k, C)] int64 positions into slots' columns, lowest first, through PyPTO's interpreter (host.run).
    wrong: "shifted", a deliberately wrong variant for the negative test (each position scored as the next)."""
    batch, heads, dim = q.shape
    context = slots.shape[1]
    k = min(k, context)
    int8 = keys.dtype == torch.int8
    if int8 == (key_scales is None):
        raise ValueError("an INT8 key cache needs its scales, a float one takes none")
    scales = key_scales if int8 else torch.ones(keys.shape[0], 1)  # a float cache's: placeholders, never read
    real = torch.ones(batch, context) if valid is None else valid.float()
    positions = torch.arange(context, dtype=torch.float32)[None]
    top = torch.empty(batch, k, dtype=torch.int32)
    run(_kernel(batch, heads, dim, keys.shape[0], context, k, int8, wrong), q.float().reshape(-1, dim).contiguous(),
        head_weights.float().contiguous(), keys.contiguous() if int8 else keys.float().contiguous(),
        scales.float().contiguous(), slots.to(torch.int32).flatten().contiguous(), real, positions, top)
    return top.long()
