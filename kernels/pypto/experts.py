"""The W8A8 routed experts' grouped MLP in PyPTO: a rank's rows, grouped by local expert, through each expert's
gate/up projection, the swiglu and the down projection, with INT8 weights and activations quantized per token
(kernels.moe.grouped_mlp for INT8 experts is the torch path it must equal, with kernels.linear's W8A8 formula).

Shapes: x [N, H] float32 or BF16 rows (or INT8 rows with their per-token scales x_scale [N, 1], as the EP all-to-all
delivers them), counts[e] rows for local expert e in order; w13 [E * 2I, H] INT8 (each expert's gate rows, then its
up rows) with w13_scale [E, 2I] float32; w2 [E * H, I] INT8 with w2_scale [E, H]; out [N, H] in the output dtype.
One kernel per counts pattern: the counts are closure constants, so each expert's rows and weights are static views
and an expert with no rows costs nothing. Per projection:
    x_q, s_x = quantize(x)                      # per token, float32: s_x = max(amax, 1e-8) / 127,
                                                # x_q = clip(round(x / s_x), -127, 127) (round half to even)
    acc      = x_q @ w[e].T                     # INT8 x INT8 -> INT32: the exact integer sums
    y        = (acc * s_x) * s_w[e].T           # float32, rounded to the output dtype as the torch path does
and between them swiglu(gate, up) = silu(gate) * up, with V4's limit clamping gate from above and up on both sides.

Tiles: the vector unit takes VEC_ROWS row of the widest activation (max(H, 2I); 7168 float32 values, 28 KiB, at
V3.2's real H) at a time, so an element-wise op's inputs and output stay well inside the 192 KiB unified buffer.
The cube takes CUBE_M rows, a K chunk of CUBE_K_L0 (L1: CUBE_K_L1) and CUBE_N output channels: its L0B tile,
CUBE_K_L0 x CUBE_N INT8, fills the 64 KiB L0B; L0A (16 x 256 INT8) is 4 KiB; L0C (16 x 256 INT32) is 16 KiB; L1
holds CUBE_M x CUBE_K_L1 + CUBE_K_L1 x CUBE_N INT8 = 272 KiB of 512 KiB. The weights (16 MiB per expert's w13 at
V4-Flash's 4096 x 4096, 28 MiB at V3.2's 4096 x 7168) stream through those tiles from global memory. Large tiles
also keep the host interpreter affordable: it runs every leaf function for each verified pass.
"""

import functools  # no `from __future__ import annotations`: PyPTO's jit reads the annotations as objects

import pypto
import torch

from dsconv.kernels.int8 import AMAX_FLOOR, INT8_MAX
from dsconv.kernels.moe import ExpertWeights
from dsconv.kernels.pypto.host import VERIFY_OPTIONS, run

DTYPES = {torch.float32: pypto.DT_FP32, torch.bfloat16: pypto.DT_BF16, torch.int8: pypto.DT_INT8}
VEC_ROWS = 1  # rows per vector tile (the tile's width is the whole activation row)
CUBE_M = 16  # rows per cube tile (a group's rows; a step's groups are small)
CUBE_K_L0, CUBE_K_L1 = 256, 1024  # the K chunk in L0A/L0B and in L1
CUBE_N = 256  # output channels per cube tile


# PyPTO 0.2.0's parser inlines only helpers marked @pypto.frontend.function with fixed shapes (a plain Python helper
# called from a kernel crashes it, and a tensor assigned to an output is moved there), so the kernel spells out both
# projections; the Python `if`s and `for`s on closure constants choose and unroll what is traced.


@functools.lru_cache(maxsize=64)
def _kernel(counts: tuple, hidden: int, inter: int, in_dtype: torch.dtype, out_dtype: torch.dtype,
            limit: float | None, wrong=None):
    """The jitted kernel for one counts pattern, shape, dtype pair and limit (compiled at its first call; PyPTO
    compiles every call). in_dtype torch.int8: pre-quantized rows, read with x_scale (otherwise x_scale is ignored).
    wrong: a deliberately wrong variant for the negative tests ("no_scale": the weight scales left out; "shifted":
    each group's rows multiplied by the next expert's weights)."""
    experts, rows = len(counts), sum(counts)
    # each expert with rows: its first row, its rows and the expert whose weights it reads (parallel lists, indexed
    # in the kernel: the parser fails to unpack a one-element list of tuples in a `for`)
    group_first, group_rows, group_weights, start = [], [], [], 0
    for e, n in enumerate(counts):
        if n:
            group_first.append(start)
            group_rows.append(n)
            group_weights.append((e + 1) % experts if wrong == "shifted" else e)
            start += n
    n_groups = len(group_first)
    in_dt, out_dt, fp32 = DTYPES[in_dtype], DTYPES[out_dtype], pypto.DT_FP32
    width = max(hidden, 2 * inter)

    @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
    def grouped_w8a8_mlp(x: pypto.Tensor((rows, hidden), in_dt), x_scale: pypto.Tensor((rows, 1), pypto.DT_FP32),
                         w13: pypto.Tensor((experts * 2 * inter, hidden), pypto.DT_INT8),
                         w13_scale: pypto.Tensor((experts, 2 * inter), pypto.DT_FP32),
                         w2: pypto.Tensor((experts * hidden, inter), pypto.DT_INT8),
                         w2_scale: pypto.Tensor((experts, hidden), pypto.DT_FP32),
                         out: pypto.Tensor((rows, hidden), out_dt)):
        pypto.set_vec_tile_shapes(VEC_ROWS, width)
        pypto.set_cube_tile_shapes([CUBE_M, CUBE_M], [CUBE_K_L0, CUBE_K_L1], [CUBE_N, CUBE_N])
        # the gate/up projection's input: the rows quantized per token, or as their sender quantized them
        if in_dt == pypto.DT_INT8:
            x_q, x_s = x, x_scale
        else:
            x_f = pypto.cast(x, fp32)
            x_s = pypto.div(pypto.maximum(pypto.amax(pypto.abs(x_f), -1, keepdim=True), AMAX_FLOOR), INT8_MAX)
            x_q = pypto.cast(pypto.clip(pypto.round(pypto.div(x_f, x_s)), -INT8_MAX, INT8_MAX), pypto.DT_INT8)
        parts = []
        for g in range(n_groups):
            first, n, w_e = group_first[g], group_rows[g], group_weights[g]
            acc = pypto.matmul(pypto.view(x_q, [n, hidden], [first, 0]),
                               pypto.view(w13, [2 * inter, hidden], [w_e * 2 * inter, 0]), pypto.DT_INT32,
                               b_trans=True)  # [n, 2I]
            y = pypto.mul(pypto.cast(acc, fp32), pypto.view(x_s, [n, 1], [first, 0]))
            if wrong != "no_scale":
                y = pypto.mul(y, pypto.view(w13_scale, [1, 2 * inter], [w_e, 0]))
            parts.append(y)
        gate_up = parts[0] if len(parts) == 1 else pypto.concat(parts, 0)  # [N, 2I]
        if out_dt != fp32:  # the torch path's projection output, in the output dtype
            gate_up = pypto.cast(pypto.cast(gate_up, out_dt), fp32)
        gate = pypto.view(gate_up, [rows, inter], [0, 0])
        up = pypto.view(gate_up, [rows, inter], [0, inter])
        if limit is not None:
            gate = pypto.minimum(gate, limit)
            up = pypto.clip(up, -limit, limit)
        # silu as torch's CPU kernel computes it, x / (1 + exp(-x)), in float32
        act = pypto.div(gate, pypto.add(pypto.exp(pypto.neg(gate)), 1.0))
        if out_dt != fp32:  # silu(gate) and its product with up each rounded to the output dtype
            act = pypto.cast(pypto.cast(act, out_dt), fp32)
        act = pypto.mul(act, up)
        if out_dt != fp32:
            act = pypto.cast(pypto.cast(act, out_dt), fp32)
        # the down projection's input, quantized per token
        h_s = pypto.div(pypto.maximum(pypto.amax(pypto.abs(act), -1, keepdim=True), AMAX_FLOOR), INT8_MAX)
        h_q = pypto.cast(pypto.clip(pypto.round(pypto.div(act, h_s)), -INT8_MAX, INT8_MAX), pypto.DT_INT8)
        downs = []
        for g in range(n_groups):
            first, n, w_e = group_first[g], group_rows[g], group_weights[g]
            acc = pypto.matmul(pypto.view(h_q, [n, inter], [first, 0]),
                               pypto.view(w2, [hidden, inter], [w_e * hidden, 0]), pypto.DT_INT32,
                               b_trans=True)  # [n, H]
            y = pypto.mul(pypto.cast(acc, fp32), pypto.view(h_s, [n, 1], [first, 0]))
            if wrong != "no_scale":
                y = pypto.mul(y, pypto.view(w2_scale, [1, hidden], [w_e, 0]))
            downs.append(y)
        down = downs[0] if len(downs) == 1 else pypto.concat(downs, 0)  # [N, H]
        out[:] = pypto.cast(down, out_dt)

    return grouped_w8a8_mlp


def grouped_w8a8_mlp(x: torch.Tensor, counts: list[int], experts: ExpertWeights, x_scale: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, limit: float | None = None,
                     wrong=None) -> torch.Tensor:
    """kernels.moe.grouped_mlp for W8A8 experts, through PyPTO's interpreter on the host (host.run): x [N, H] rows
    grouped by expert (counts[e] rows for local expert e, in order) -> [N, H] in x's dtype, or, for INT8 rows with
    their per-token scales x_scale [N, 1], in out_dtype. limit: V4's swiglu_limit. wrong: see _kernel."""
    if not experts.int8:
        raise ValueError("the PyPTO grouped MLP is the W8A8 one: these experts hold float weights "
                         "(kernels.moe.grouped_mlp runs them)")
    if x_scale is not None and (out_dtype is None or x.dtype != torch.int8):
        raise ValueError("pre-quantized rows must be INT8 and need an out_dtype")
    if x.dim() != 2 or x.shape[1] != experts.hidden:
        raise ValueError(f"rows {tuple(x.shape)} must be [N, {experts.hidden}] for these experts")
    counts = [int(n) for n in counts]
    if len(counts) != experts.experts or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(f"counts {counts} must be {experts.experts} non-negative numbers summing to x's "
                         f"{x.shape[0]} rows")
    out_dtype = x.dtype if x_scale is None else out_dtype
    if out_dtype not in (torch.float32, torch.bfloat16) or x.dtype not in DTYPES:
        raise ValueError(f"rows {x.dtype} / output {out_dtype}: the kernel takes float32 or BF16 (or INT8 rows)")
    rows, hidden = x.shape
    if not rows:
        return torch.empty(0, hidden, dtype=out_dtype)
    n_experts, inter2 = experts.w13.shape[:2]
    out = torch.empty(rows, hidden, dtype=out_dtype)
    scale = torch.zeros(rows, 1) if x_scale is None else x_scale.to(torch.float32).reshape(rows, 1).contiguous()
    kernel = _kernel(tuple(counts), hidden, inter2 // 2, x.dtype, out_dtype, limit, wrong)
    run(kernel, x.contiguous(), scale, experts.w13.reshape(n_experts * inter2, hidden).contiguous(),
        experts.w13_scale.reshape(n_experts, inter2).contiguous(),
        experts.w2.reshape(n_experts * hidden, inter2 // 2).contiguous(),
        experts.w2_scale.reshape(n_experts, hidden).contiguous(), out)
    return out
