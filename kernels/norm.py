"""RMSNorm in the exact order of transformers' DeepseekV3RMSNorm, so a BF16 runner matches it bit for bit.

    x32 = x.float();  y = (x32 * rsqrt(mean(x32**2) + eps)).to(x.dtype);  out = weight * y

The weight multiplies after rounding back to x's dtype; multiplying in float32 first would differ in the last
BF16 bit. `y` is torch's own F.rms_norm without a weight, which computes exactly that (half-precision inputs
upcast to float32, cast back once). On CPU the result equals transformers' bit for bit (tests check it);
another device may run a fused kernel that sums the squares in another order, a float32 rounding difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.device import cast


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d] in x's dtype."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"RMSNorm weight {tuple(weight.shape)} does not match the input's last dim {x.shape[-1]}")
    # one call for the float32 part rather than transformers' six as written: the same operations inside, without
    # a Python round trip each (measured ~30% less time per norm on the 2-core CI CPU, and a decode step of the
    # tiny V3 model runs 13 norms). F.rms_norm's own weight multiply would come before the cast back: not used
    normed = F.rms_norm(x, x.shape[-1:], eps=eps)
    # transformers returns weight.dtype x x.dtype promoted; with the checkpoint's BF16 weights that is x's dtype
    return cast(weight * normed, x.dtype)
