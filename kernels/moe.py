"""Grouped expert MLPs over rows already sorted by local expert (what an EP dispatch hands a rank).

x_sorted [N, hidden] holds counts[0] rows for local expert 0, then counts[1] rows for expert 1, and so on; an
expert with zero rows is fine. Each expert computes
    gate, up = (x @ w13.T).chunk(2)      # w13 [2I, hidden]: gate rows first, then up (transformers' gate_up_proj)
    out      = swiglu(gate, up) @ w2.T   # w2 [hidden, I]
with W8A8 projections (`grouped_w8a8`) or float ones (`grouped_mlp`). Outputs keep x_sorted's row order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dsconv.kernels.device import is_npu, require_torch_npu
from dsconv.kernels.linear import linear, w8a8_linear, w8a8_linear_reference


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with DeepSeek-V4's swiglu_limit, gate is clamped from above and up on both sides."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def grouped_w8a8(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                 w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """x_sorted [N, H], counts [E] int, w13 int8 [E, 2I, H] + scale [E, 2I, 1], w2 int8 [E, H, I] + scale
    [E, H, 1] -> [N, H] in x_sorted's dtype. Intermediate activations are in x_sorted's dtype too."""
    _check_grouped(x_sorted, counts, w13, w2)
    if is_npu(x_sorted):
        return _grouped_w8a8_npu(x_sorted, counts, w13, w13_scale, w2, w2_scale, swiglu_limit)
    return _w8a8_expert_loop(w8a8_linear, x_sorted, counts, w13, w13_scale, w2, w2_scale, swiglu_limit)


def grouped_w8a8_reference(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
                           w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                           swiglu_limit: float | None = None) -> torch.Tensor:
    _check_grouped(x_sorted, counts, w13, w2)
    return _w8a8_expert_loop(w8a8_linear_reference, x_sorted, counts, w13, w13_scale, w2, w2_scale, swiglu_limit)


def grouped_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w1: Sequence[torch.Tensor] | torch.Tensor,
                w3: Sequence[torch.Tensor] | torch.Tensor, w2: Sequence[torch.Tensor] | torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
    """Float experts: w1 (gate) and w3 (up) [E][I, H], w2 [E][H, I], as lists or stacked tensors."""
    if not len(w1) == len(w3) == len(w2) == counts.numel():
        raise ValueError(f"{counts.numel()} expert counts but {len(w1)} w1, {len(w3)} w3, {len(w2)} w2 weights")
    _check_counts(x_sorted, counts)

    def expert(x: torch.Tensor, e: int) -> torch.Tensor:
        return linear(swiglu(linear(x, w1[e]), linear(x, w3[e]), swiglu_limit), w2[e])

    return _per_expert(x_sorted, counts, expert)


def _w8a8_expert_loop(project, x_sorted, counts, w13, w13_scale, w2, w2_scale, limit) -> torch.Tensor:
    def expert(x: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = project(x, w13[e], w13_scale[e], out_dtype=x.dtype).chunk(2, dim=-1)
        return project(swiglu(gate, up, limit), w2[e], w2_scale[e], out_dtype=x.dtype)

    return _per_expert(x_sorted, counts, expert)


def _per_expert(x_sorted: torch.Tensor, counts: torch.Tensor, expert) -> torch.Tensor:
    out = torch.empty_like(x_sorted)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:  # an expert without rows costs nothing
            out[start:start + n] = expert(x_sorted[start:start + n], e)
        start += n
    return out


def _check_counts(x_sorted: torch.Tensor, counts: torch.Tensor) -> None:
    if counts.dim() != 1 or counts.dtype.is_floating_point:
        raise ValueError(f"counts must be a 1-D integer tensor [E], got {counts.dtype} {tuple(counts.shape)}")
    total = int(counts.sum())
    if total != x_sorted.shape[0] or bool((counts < 0).any()):
        raise ValueError(f"counts {counts.tolist()} must be non-negative and sum to x_sorted's "
                         f"{x_sorted.shape[0]} rows")


def _check_grouped(x_sorted, counts, w13, w2) -> None:
    _check_counts(x_sorted, counts)
    experts, hidden = counts.numel(), x_sorted.shape[1]
    if w13.dim() != 3 or w13.shape[0] != experts or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} must be [{experts}, 2 * intermediate, {hidden}]")
    if tuple(w2.shape) != (experts, hidden, w13.shape[1] // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} must be [{experts}, {hidden}, {w13.shape[1] // 2}]")


# --- NPU (torch_npu), not run in CI ---------------------------------------------------------------------------
def _grouped_w8a8_npu(x_sorted, counts, w13, w13_scale, w2, w2_scale, limit) -> torch.Tensor:
    torch_npu = require_torch_npu()
    if counts.numel() == 1:
        # npu_grouped_matmul rejects a group_list of length 1 with group_list_type=1 (per-group sizes)
        raise ValueError("the NPU grouped W8A8 path needs at least 2 local experts; use w8a8_linear for one")
    group_list = counts.to(torch.int64)

    def grouped(x, w, w_scale):
        x_q, x_scale = torch_npu.npu_dynamic_quant(x)  # int8 [N, k], float32 [N]
        (y,) = torch_npu.npu_grouped_matmul(
            [x_q], [w.transpose(1, 2)],  # weight as [E, k, n], a transposed view
            # per-token INT8 with BF16 output takes the weight scale in BF16 [E, n]
            scale=[w_scale.squeeze(-1).to(torch.bfloat16)], per_token_scale=[x_scale],
            group_list=group_list, split_item=2, group_type=0, group_list_type=1, output_dtype=torch.bfloat16)
        return y.to(x.dtype)

    gate, up = grouped(x_sorted, w13, w13_scale).chunk(2, dim=-1)
    return grouped(swiglu(gate, up, limit), w2, w2_scale)
