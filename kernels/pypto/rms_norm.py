"""RMSNorm with the residual add, in PyPTO: (x + residual) normalized over the hidden dimension and scaled by the
weight, and the sum kept as the next residual; what a decoder layer does between its blocks (kernels.norm.rms_norm
is the torch path it must equal).

Shapes: x, residual, out, residual_out [T, H]; weight [1, H]. The sum of squares accumulates in float32 whatever the
dtype, as the torch path does. Tiles: one row of H at a time on the vector unit, so that a row of the real models'
7168 float32 values (28 KiB) stays far inside the unified buffer (192 KiB on the A2/A3 class the compiler checks).
"""

import functools  # no `from __future__ import annotations`: PyPTO's jit reads the annotations as objects

import pypto
import torch

from dsconv.kernels.pypto.host import VERIFY_OPTIONS, run

DTYPES = {torch.float32: pypto.DT_FP32, torch.bfloat16: pypto.DT_BF16}
ROWS_PER_TILE = 1


@functools.cache
def _kernel(tokens: int, hidden: int, dtype: torch.dtype, eps: float, wrong=None):
    """The jitted kernel for one shape and dtype (compiled at its first call; PyPTO compiles every call). wrong: a
    deliberately wrong variant for the negative tests ("no_scale": the 1 / rms scale left out; "shifted": each row
    normalized by the next row's mean square)."""
    dt = DTYPES[dtype]

    @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
    def add_rms_norm(x: pypto.Tensor((tokens, hidden), dt), residual: pypto.Tensor((tokens, hidden), dt),
                     weight: pypto.Tensor((1, hidden), dt), out: pypto.Tensor((tokens, hidden), dt),
                     residual_out: pypto.Tensor((tokens, hidden), dt)):
        pypto.set_vec_tile_shapes(ROWS_PER_TILE, hidden)
        summed = pypto.add(pypto.cast(x, pypto.DT_FP32), pypto.cast(residual, pypto.DT_FP32))
        mean_square = pypto.mul(pypto.sum(pypto.mul(summed, summed), -1, keepdim=True), 1.0 / hidden)
        if wrong == "shifted":
            mean_square = pypto.concat([pypto.view(mean_square, (tokens - 1, 1), [1, 0]),
                                        pypto.view(mean_square, (1, 1), [0, 0])], 0)
        scale = pypto.rsqrt(pypto.add(mean_square, eps))
        normed = summed if wrong == "no_scale" else pypto.mul(summed, scale)
        normed = pypto.mul(normed, pypto.cast(weight, pypto.DT_FP32))
        out[:] = pypto.cast(normed, dt)
        residual_out[:] = pypto.cast(summed, dt)

    return add_rms_norm


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 wrong=None) -> tuple:
    """(rms_norm(x + residual) * weight, x + residual), through PyPTO's interpreter on the host (host.run)."""
    tokens, hidden = x.shape
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    run(_kernel(tokens, hidden, x.dtype, eps, wrong), x.contiguous(), residual.contiguous(),
        weight.reshape(1, hidden).contiguous(), out, residual_out)
    return out, residual_out
