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
    # mean(x32**2) is sum / d in torch's CPU kernel, so this is transformers' value bit for bit in five ops
    # where F.rms_norm's composite takes nine (it wraps each scalar in a tensor): on the 2-core CI CPU a decode
    # step's thirteen norms cost half as much
    inv_rms = (x32 * x32).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps).rsqrt_()
    normed = cast(x32 * inv_rms, x.dtype)
    # transformers returns weight.dtype x x.dtype promoted; with the checkpoint's BF16 weights that is x's dtype
    return cast(weight * normed, x.dtype)
