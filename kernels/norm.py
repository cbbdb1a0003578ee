"""RMSNorm in the exact order of transformers' DeepseekV3RMSNorm, so a BF16 runner matches it bit for bit.

    x32 = x.float();  y = (x32 * rsqrt(mean(x32**2) + eps)).to(x.dtype);  out = weight * y

The weight multiplies after rounding back to x's dtype; multiplying in float32 first would differ in the last
BF16 bit. Plain torch ops, so the same code runs on CPU, CUDA and NPU. The float32 part is torch's rms_norm,
whose CPU kernel gives the formula's result bit for bit (tests check it against transformers); another
device's fused kernel may sum the squares in another order, a float32 rounding difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d] in x's dtype."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match the input's last dim {x.shape[-1]}")
    # torch's rms_norm without a weight computes transformers' float32 part (pow, mean, + eps, rsqrt, mul) in
    # one call instead of five
    normed = F.rms_norm(x.to(torch.float32), weight.shape, eps=eps).to(x.dtype)
    # transformers returns weight.dtype x x.dtype promoted; with the checkpoint's BF16 weights that is x's dtype
    return (weight * normed).to(x.dtype)
