"""RMSNorm in the three orders DeepSeek's models round in, one function with the order as a parameter:

    x32 = x.float();  r = rsqrt(mean(x32**2) + eps)
    WEIGHT_AFTER_CAST  out = weight * (x32 * r).to(x.dtype)     transformers' DeepseekV3RMSNorm
    WEIGHT_IN_FLOAT32  out = (weight * (x32 * r)).to(x.dtype)   DeepseekV4RMSNorm (V4 keeps norm weights float32)
    UNWEIGHTED         out = x * r.to(x.dtype)                  DeepseekV4UnweightedRMSNorm

A runner matches its reference only in the reference's order: the orders differ in the last BF16 bit.
`rms_norm_reference` computes WEIGHT_AFTER_CAST's normalized part with torch's own F.rms_norm without a weight,
which does exactly that (half-precision inputs upcast to float32, cast back once), and equals transformers bit
for bit on CPU.

CPU path for BF16/FP16 inputs in the WEIGHT_AFTER_CAST order: the normalized part as F.layer_norm of [x, -x].
That row's mean is zero and its variance is mean(x**2), so LayerNorm's (row - mean) * rsqrt(var + eps) on its
first half is the RMSNorm of x, from one fused kernel call instead of the several that F.rms_norm makes on CPU.
LayerNorm sums the squares in another order (Welford), so its float32 variance can differ from the reference's
in the last bit; after the rounding to BF16 that changes an element only where it sits on a rounding boundary
(tests bound the rate and the size). float32 inputs take the reference (exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsconv.kernels.device import cast
from dsconv.kernels.linear import HALF_DTYPES

WEIGHT_AFTER_CAST = "weight_after_cast"
WEIGHT_IN_FLOAT32 = "weight_in_float32"
UNWEIGHTED = "unweighted"
ORDERS = (WEIGHT_AFTER_CAST, WEIGHT_IN_FLOAT32, UNWEIGHTED)

_SIGNS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # [[1], [-1]] per dtype and device, made once


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             order: str = WEIGHT_AFTER_CAST) -> torch.Tensor:
    """x [..., d], weight [d] (None for UNWEIGHTED) -> [..., d] in x's dtype."""
    if order == UNWEIGHTED:
        if weight is not None:
            raise ValueError("an UNWEIGHTED RMSNorm takes no weight")
        return x * cast(torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps), x.dtype)
    _check(x, weight)
    if order == WEIGHT_IN_FLOAT32:
        x32 = x.float()
        return cast(weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)), x.dtype)
    if order != WEIGHT_AFTER_CAST:
        raise ValueError(f"RMSNorm order {order!r} is not one of {ORDERS}")
    if x.device.type != "cpu" or x.dtype not in HALF_DTYPES:
        return _weighted(weight, F.rms_norm(x, x.shape[-1:], eps=eps), x.dtype)
    d = x.shape[-1]
    signs = _SIGNS.get((x.dtype, x.device))
    if signs is None:
        signs = _SIGNS[(x.dtype, x.device)] = torch.tensor([[1.0], [-1.0]], dtype=x.dtype, device=x.device)
    mirrored = (x.unsqueeze(-2) * signs).reshape(*x.shape[:-1], 2 * d)  # [..., 2d] = [x, -x]: exact, one call
    return _weighted(weight, F.layer_norm(mirrored, (2 * d,), eps=eps)[..., :d], x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The WEIGHT_AFTER_CAST order from torch's F.rms_norm."""
    _check(x, weight)
    return _weighted(weight, F.rms_norm(x, x.shape[-1:], eps=eps), x.dtype)


def _weighted(weight: torch.Tensor, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # transformers returns weight.dtype x x.dtype promoted; with the checkpoint's BF16 weights that is x's dtype
    return cast(weight * normed, dtype)


def _check(x: torch.Tensor, weight: torch.Tensor | None) -> None:
    if weight is None or weight.shape != x.shape[-1:]:
        shape = None if weight is None else tuple(weight.shape)
        raise ValueError(f"RMSNorm weight {shape} does not match the input's last dim {x.shape[-1]}")
