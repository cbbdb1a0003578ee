"""RMSNorm in the exact order of transformers' DeepseekV3RMSNorm, so a BF16 runner matches it bit for bit.

    x32 = x.float();  y = (x32 * rsqrt(mean(x32**2) + eps)).to(x.dtype);  out = weight * y

The weight multiplies after rounding back to x's dtype; multiplying in float32 first would differ in the last
BF16 bit. Plain torch ops, so the same code runs on CPU, CUDA and NPU; on CPU the result equals transformers'
bit for bit (tests check it), another device may sum the squares in another order, a float32 rounding
difference.
"""

from __future__ import annotations

import torch

from kernels.device import cast


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d] in x's dtype."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match the input's last dim {x.shape[-1]}")
    x32 = cast(x, torch.float32)
    # transformers' formula as written (F.rms_norm's composite computes the same float32 part, but with nine
    # calls inside, each scalar wrapped in a tensor: measured no faster in a decode step on the 2-core CI CPU)
    inv_rms = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    normed = cast(x32 * inv_rms, x.dtype)
    # transformers returns weight.dtype x x.dtype promoted; with the checkpoint's BF16 weights that is x's dtype
    return cast(weight * normed, x.dtype)
