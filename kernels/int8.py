"""Symmetric per-row INT8 quantization: weights per output channel offline, activations per token at run time.

scale = max(amax, AMAX_FLOOR) / 127 and q = clamp(round(x / scale), -127, 127), all in float32, with
round-half-to-even (torch.round and numpy.round agree), so a NumPy evaluation of the same formula is
bit-identical. -128 is never produced, keeping the range symmetric.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
# Floor for an all-zero row: keeps its scale finite and positive, so it dequantizes to exact zeros.
AMAX_FLOOR = 1e-8


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float32 -> (q int8 [rows, cols], scale float32 [rows, 1]); the plain formula."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax.clamp(min=AMAX_FLOOR) / INT8_MAX
    q = torch.clamp(torch.round(x / scale), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_rows_(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> torch.Tensor:
    """Same result as the reference, overwriting x (float32) in place to avoid temporaries.

    Returns the per-row amax so callers can reject NaN/Inf without another pass.
    """
    # amax and amin as two reductions: on CPU far faster than aminmax(dim=...) or abs().amax()
    amax = torch.maximum(x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True).neg_())
    torch.div(amax.clamp(min=AMAX_FLOOR), INT8_MAX, out=scale_out)
    x.div_(scale_out).round_().clamp_(-INT8_MAX, INT8_MAX)
    q_out.copy_(x)
    return amax
