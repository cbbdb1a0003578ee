"""RMSNorm in the order of transformers' DeepseekV3RMSNorm, so a runner matches it (see the CPU path below).

    x32 = x.float();  y = (x32 * rsqrt(mean(x32**2) + eps)).to(x.dtype);  out = weight * y

The weight multiplies after rounding back to x's dtype; multiplying in float32 first would differ in the last
BF16 bit. `rms_norm_reference` computes `y` with torch's own F.rms_norm without a weight, which does exactly
that (half-precision inputs upcast to float32, cast back once), and equals transformers bit for bit on CPU.

CPU path for BF16/FP16 inputs: `y` as F.layer_norm of [x, -x]. That row's mean is zero and its variance is
mean(x**2), so LayerNorm's (row - mean) * rsqrt(var + eps) on its first half is the RMSNorm of x, from one
fused kernel call instead of the ~7 that F.rms_norm makes on CPU (in a tiny-model decode step, where a step
runs 13 norms, measured 4-7% less time per step in paired A/Bs on the 2-core CI CPU). LayerNorm sums the
squares in another order (Welford), so its float32 variance can differ from the reference's in the last bit;
after the rounding to BF16 that changes an element only where it sits on a rounding boundary (2 of 1.8M
elements in a sample; tests bound the rate and the size). float32 inputs take the reference (exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsconv.kernels.device import cast
from dsconv.kernels.linear import HALF_DTYPES

_SIGNS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # [[1], [-1]] per dtype and device, made once


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d] in x's dtype."""
    _check(x, weight)
    if x.device.type != "cpu" or x.dtype not in HALF_DTYPES:
        return _weighted(weight, F.rms_norm(x, x.shape[-1:], eps=eps), x.dtype)
    d = x.shape[-1]
    signs = _SIGNS.get((x.dtype, x.device))
    if signs is None:
        signs = _SIGNS[(x.dtype, x.device)] = torch.tensor([[1.0], [-1.0]], dtype=x.dtype, device=x.device)
    mirrored = (x.unsqueeze(-2) * signs).reshape(*x.shape[:-1], 2 * d)  # [..., 2d] = [x, -x]: exact, one call
    return _weighted(weight, F.layer_norm(mirrored, (2 * d,), eps=eps)[..., :d], x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    return _weighted(weight, F.rms_norm(x, x.shape[-1:], eps=eps), x.dtype)


def _weighted(weight: torch.Tensor, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # transformers returns weight.dtype x x.dtype promoted; with the checkpoint's BF16 weights that is x's dtype
    return cast(weight * normed, dtype)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match the input's last dim {x.shape[-1]}")
