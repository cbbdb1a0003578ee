"""The gated MLP activation, and a rank's routed experts over rows grouped by expert (what an EP dispatch hands it).

`grouped_mlp`: x [N, hidden] holds counts[0] rows for local expert 0, then counts[1] rows for expert 1, and so
on; an expert with zero rows costs nothing. `token_mlp`: one token's row through each of its k experts (a
decode step at EP 1: nothing to group). Each expert computes
    gate, up = (x @ w13[e].T).chunk(2)      # w13 [E, 2I, hidden]: gate rows first, then up (transformers' gate_up_proj)
    out      = swiglu(gate, up) @ w2[e].T   # w2 [E, hidden, I]
with float weights, or INT8 ones with per-output-channel scales (W8A8: activations quantized per token, the
formula of kernels.linear). The rows may arrive already quantized by their sender (INT8 plus per-token scales),
as W8A8 experts behind the EP all-to-all receive them. The projections run per expert group, the activation
once over all rows, and under W8A8 the down projection's input is quantized once for all rows: a decode token's
k experts make one activation call, not k. On NPU each projection is one npu_grouped_matmul over all local
experts, with the counts kept on the device, in the form vllm-ascend runs W8A8_DYNAMIC experts in (NpuExperts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsconv.kernels.device import cast, is_npu, require_torch_npu
from dsconv.kernels.linear import (FloatWeight, linear, quantize_activations, w8a8_linear_quantized,
                                   w8a8_linear_reference)

# torch_npu's aclFormat number of FRACTAL_NZ, the blocked layout its matmul kernels read weights in. vllm-ascend
# casts every INT8 expert weight to it at load (vllm_ascend/quantization/w8a8_dynamic.py,
# process_weights_after_loading: npu_format_cast_(weight, 29)).
ACL_FORMAT_FRACTAL_NZ = 29


def swiglu(gate_or_gate_up: torch.Tensor, up: torch.Tensor | None = None, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up, from gate and up, or from their concatenation [..., 2I] (gate first) when up is None.
    With DeepSeek-V4's swiglu_limit, gate is clamped from above and up on both sides."""
    gate = gate_or_gate_up
    if up is None:
        gate, up = gate_or_gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class ExpertWeights:
    """E experts' weights, stacked: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]; float, or INT8 with
    per-output-channel scales w13_scale [E, 2I, 1] and w2_scale [E, H, 1] (float32)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None):
        experts, inter2, hidden = w13.shape if w13.dim() == 3 else (None, None, None)
        if experts is None or inter2 % 2:
            raise ValueError(f"w13 {tuple(w13.shape)} must be [experts, 2 * intermediate, hidden]")
        if tuple(w2.shape) != (experts, hidden, inter2 // 2):
            raise ValueError(f"w2 {tuple(w2.shape)} must be [{experts}, {hidden}, {inter2 // 2}]")
        self.int8 = w13_scale is not None
        for name, w, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
            if (scale is not None) != self.int8 or (w.dtype == torch.int8) != self.int8:
                raise ValueError(f"{name}: INT8 weights need scales and float weights take none ({w.dtype}, "
                                 f"scale {None if scale is None else tuple(scale.shape)})")
            if scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (*w.shape[:2], 1)):
                raise ValueError(f"{name}_scale must be float32 [{w.shape[0]}, {w.shape[1]}, 1], got {scale.dtype} "
                                 f"{tuple(scale.shape)}")
        self.w13, self.w2, self.w13_scale, self.w2_scale = w13, w2, w13_scale, w2_scale
        self.experts, self.hidden = experts, hidden
        self.npu: NpuExperts | None = None
        if self.int8 and is_npu(w13):  # the device's form only: the CPU forms below are never used on an NPU
            self.npu = NpuExperts(w13, w13_scale, w2, w2_scale)
            self.w13 = self.w2 = self.w13_scale = self.w2_scale = None
            return
        # each expert's projection operands, made once (views; float ones as kernels.linear.FloatWeight holds
        # them): a list index per group instead of tensor selects
        if self.int8:
            self._w13, self._w2 = list(zip(w13.unbind(), w13_scale.unbind())), list(zip(w2.unbind(), w2_scale.unbind()))
        else:
            self._w13, self._w2 = FloatWeight.stacked(w13), FloatWeight.stacked(w2)


class NpuExperts:
    """INT8 experts in the form vllm-ascend's W8A8_DYNAMIC MoE hands torch_npu's grouped matmul
    (vllm_ascend/quantization/w8a8_dynamic.py: process_weights_after_loading, apply_mlp):
    - w13 [E, H, 2I] and w2 [E, I, H]: each expert's weight as the op's [k, n], made contiguous and cast to
      FRACTAL_NZ once, at load;
    - w13_scale [E, 2I] and w2_scale [E, H] in BF16: torch_npu's dtype table for the per-token form gives BF16
      out for a BF16 scale (a float32 scale gives float16 out). Rounding a channel's float32 scale to BF16 moves
      that channel's outputs by at most 2^-9 of their value, against kernels.linear's float32 scales."""

    def __init__(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor):
        torch_npu = require_torch_npu()
        self.w13 = torch_npu.npu_format_cast(w13.transpose(1, 2).contiguous(), ACL_FORMAT_FRACTAL_NZ)
        self.w2 = torch_npu.npu_format_cast(w2.transpose(1, 2).contiguous(), ACL_FORMAT_FRACTAL_NZ)
        self.w13_scale = w13_scale[:, :, 0].to(torch.bfloat16)
        self.w2_scale = w2_scale[:, :, 0].to(torch.bfloat16)


def grouped_mlp(x: torch.Tensor, counts: torch.Tensor | list[int], experts: ExpertWeights,
                x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                limit: float | None = None) -> torch.Tensor:
    """x [N, H] rows grouped by expert, counts [E] rows per expert (a tensor or a list) -> [N, H], in x's row
    order. Float rows give their own dtype; INT8 rows quantized by their sender (W8A8 experts only), with
    per-token scales x_scale [N, 1], give out_dtype. limit: V4's swiglu_limit."""
    _check_rows(x, x_scale, out_dtype, experts)
    if is_npu(x):  # the counts stay on the device: no host sync
        counts = torch.as_tensor(counts, device=x.device)
        if tuple(counts.shape) != (experts.experts,) or counts.dtype.is_floating_point:
            raise ValueError(f"counts must be an integer tensor [{experts.experts}], got {counts.dtype} "
                             f"{tuple(counts.shape)}")
        return _grouped_mlp_npu(x, counts, experts, x_scale, x.dtype if x_scale is None else out_dtype, limit)
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.dtype.is_floating_point:
            raise ValueError(f"counts must be a 1-D integer tensor [E], got {counts.dtype} {tuple(counts.shape)}")
        counts_list = counts.tolist()
    else:
        counts_list = counts
    if len(counts_list) != experts.experts:
        raise ValueError(f"{len(counts_list)} expert counts for {experts.experts} experts (w13)")
    if sum(counts_list) != x.shape[0] or min(counts_list, default=0) < 0:
        raise ValueError(f"counts {counts_list} must be non-negative and sum to x's {x.shape[0]} rows")
    groups, start = [], 0  # (expert, first row, end row) of each expert with rows
    for e, n in enumerate(counts_list):
        if n:
            groups.append((e, start, start + n))
            start += n
    return _grouped(x, x_scale, groups, experts, out_dtype, limit)


def token_mlp(x: torch.Tensor, expert_ids: list[int], experts: ExpertWeights, x_scale: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, limit: float | None = None) -> torch.Tensor:
    """One token x [1, H] through each of its experts (distinct local ids, in any order) -> [k, H], row j from
    expert_ids[j]: the grouped MLP with k groups of one row, all reading the token's row (a decode step's token at
    EP 1, where nothing needs regrouping). x_scale [1, 1] and out_dtype as in grouped_mlp."""
    _check_rows(x, x_scale, out_dtype, experts)
    if x.shape[0] != 1:
        raise ValueError(f"token_mlp takes one token, got {x.shape[0]} rows")
    if is_npu(x):  # the token's row once per expert, grouped in expert order for the one grouped call
        order = sorted(range(len(expert_ids)), key=expert_ids.__getitem__)
        counts = [0] * experts.experts
        for e in expert_ids:
            counts[e] += 1
        # the token's row repeated as real rows: a stride-0 expand is not a documented x of the grouped matmul
        rows = x.expand(len(expert_ids), -1).contiguous()
        scales = None if x_scale is None else x_scale.expand(len(expert_ids), -1).contiguous()
        out = _grouped_mlp_npu(rows, torch.tensor(counts, device=x.device), experts, scales,
                               x.dtype if x_scale is None else out_dtype, limit)  # row j: expert_ids[order[j]]
        position = [0] * len(order)
        for j, i in enumerate(order):
            position[i] = j
        return out[torch.tensor(position, device=x.device)]
    return _grouped(x, x_scale, [(e, j, j + 1) for j, e in enumerate(expert_ids)], experts, out_dtype, limit)


def grouped_mlp_reference(x: torch.Tensor, counts: torch.Tensor, experts: ExpertWeights,
                          limit: float | None = None) -> torch.Tensor:
    """Each expert's whole MLP on its rows with the plain formulas (F.linear, kernels.linear's W8A8 reference)."""
    out, start = torch.empty_like(x), 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        if n and experts.int8:
            gate_up = w8a8_linear_reference(rows, experts.w13[e], experts.w13_scale[e], out_dtype=x.dtype)
            out[start:start + n] = w8a8_linear_reference(swiglu(gate_up, limit=limit), experts.w2[e],
                                                         experts.w2_scale[e], out_dtype=x.dtype)
        elif n:
            out[start:start + n] = linear(swiglu(linear(rows, experts.w13[e]), limit=limit), experts.w2[e])
        start += n
    return out


def _check_rows(x: torch.Tensor, x_scale: torch.Tensor | None, out_dtype: torch.dtype | None,
                experts: ExpertWeights) -> None:
    if x_scale is not None and (not experts.int8 or out_dtype is None):
        raise ValueError("pre-quantized INT8 rows need W8A8 experts and an out_dtype")
    if x.dim() != 2 or x.shape[1] != experts.hidden:
        raise ValueError(f"rows {tuple(x.shape)} must be [N, {experts.hidden}] for these experts")


def _grouped(x, x_scale, groups, experts: ExpertWeights, out_dtype, limit) -> torch.Tensor:
    """groups: (expert, first row, end row), in row order; x [N, H], or [1, H] read by every group."""
    if not groups:
        return torch.empty(0, experts.hidden, dtype=x.dtype if x_scale is None else out_dtype, device=x.device)
    gate_up = _project_groups(x, x_scale, groups, experts._w13, experts.int8, out_dtype)  # [N, 2I]
    hidden = swiglu(gate_up, limit=limit)  # [N, I]: one call for every row
    return _project_groups(hidden, None, groups, experts._w2, experts.int8, out_dtype)


def _project_groups(x, x_scale, groups, weights, int8: bool, out_dtype) -> torch.Tensor:
    """Each group's rows through its expert's projection (weights[e]), outputs in row order: float projections
    in x's dtype, INT8 ones in out_dtype (x's when x is float)."""
    if int8 and x_scale is None:
        out_dtype = x.dtype
        x, x_scale = quantize_activations(x)  # per token: once for all groups
    whole = x.shape[0] == 1 or len(groups) == 1  # every group reads all of x: its one row, or a lone group's rows
    outs = []
    for e, start, stop in groups:
        rows, row_scale = (x, x_scale) if whole else (x[start:stop], None if x_scale is None else x_scale[start:stop])
        if int8:
            w, w_scale = weights[e]
            outs.append(w8a8_linear_quantized(rows, row_scale, w, w_scale, out_dtype))
        else:
            outs.append(weights[e](rows))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# --- NPU (torch_npu; in CI against tests/npu_double.py) ----------------------------------------------------------
def _grouped_mlp_npu(x, counts, experts: ExpertWeights, x_scale, out_dtype, limit) -> torch.Tensor:
    """Every local expert's rows in one npu_grouped_matmul per projection, whatever the number of experts.

    group_list_type 0 (cumulative row counts) accepts one expert too; type 1 (per-group counts) refuses a
    one-entry list. INT8 projections take vllm-ascend's W8A8_DYNAMIC form (apply_mlp): INT8 rows with their
    per-token scales, the NZ weights with their BF16 channel scales, BF16 out, widened to out_dtype.
    """
    if x.shape[0] == 0:  # an idle rank's step: no rows, no kernel call
        return torch.empty(0, experts.hidden, dtype=out_dtype, device=x.device)
    torch_npu = require_torch_npu()
    group_list = counts.to(torch.int64).cumsum(0)  # [E] end row of each expert's group
    if not experts.int8:  # float experts: the weights' dtype in and out, weights as [E, k, n] views
        def project(rows, w):
            (y,) = torch_npu.npu_grouped_matmul([cast(rows, w.dtype)], [w.transpose(1, 2)], group_list=group_list,
                                                split_item=2, group_type=0, group_list_type=0)
            return cast(y, out_dtype)

        return project(swiglu(project(x, experts.w13), limit=limit), experts.w2)
    if experts.npu is None:
        raise RuntimeError("INT8 experts built from non-NPU tensors reached the NPU branch: ExpertWeights casts "
                           "them to the device's form when it is given NPU tensors")

    def project_int8(rows, row_scale, w, w_scale):
        if row_scale is None:
            rows, row_scale = quantize_activations(rows)  # npu_dynamic_quant: int8 [N, k], float32 [N, 1]
        (y,) = torch_npu.npu_grouped_matmul([rows], [w], scale=[w_scale], per_token_scale=[row_scale.reshape(-1)],
                                            group_list=group_list, split_item=2, group_type=0, group_list_type=0,
                                            output_dtype=torch.bfloat16)
        return cast(y, out_dtype)

    device_form = experts.npu
    hidden = swiglu(project_int8(x, x_scale, device_form.w13, device_form.w13_scale), limit=limit)
    return project_int8(hidden, None, device_form.w2, device_form.w2_scale)
