"""INT8 cache entries (--kv-cache-dtype int8): a per-token symmetric quantizer, its dequantization, and the
INT8 x INT8 scoring of V3.2's indexer against its INT8 key cache ("A8C8").

Entries are quantized as W8A8 quantizes activations (kernels.int8's formula, one float32 scale per row):
    q, s = quantize_rows(x)                    # x [N, d] -> q int8 [N, d], s float32 [N, 1]
    x'   = q * s                               # dequantized, float32
and scores of INT8 queries against INT8 keys are exact integer dot products scaled once:
    scores = (q_q @ k_q.T) * s_q * s_k.T       # int32 sums, then float32
Every step is a tensor op on the tensors' own device: nothing reads a value back to the host.
"""

from __future__ import annotations

import torch

from dsconv.kernels.linear import EXACT_FLOAT32_K, quantize_activations


def hadamard(dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Hadamard matrix H [dim, dim] (Sylvester's construction; dim a power of two): orthogonal and
    symmetric, so (q @ H) . (k @ H) = q . k. Rotating q and k by it before INT8 quantization spreads an outlier
    coordinate over all of them, shrinking the per-row scale, as DeepSeek's V3.2 indexer (rotate_activation
    before its FP8 cast) and CANN's A8C8 indexer do."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / dim ** 0.5).to(dtype=dtype, device=device)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] float -> (int8 [..., d], float32 scale [..., 1]): one scale per row of d values. On an NPU
    through npu_dynamic_quant (kernels.linear.quantize_activations), elsewhere kernels.int8's formula."""
    q, scale = quantize_activations(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(*x.shape[:-1], 1)


def dequantize_tokens(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., d] and float32 [..., 1] -> [..., d] in dtype: q * scale computed in float32, rounded once."""
    values = q.to(torch.float32) * scale
    return values if dtype == torch.float32 else values.to(dtype)


def int8_scores(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """INT8 queries against INT8 keys: q [..., M, d], k [..., N, d] int8 with scales [..., M, 1], [..., N, 1] ->
    float32 [..., M, N] = (q @ k^T, exact integer sums) * q_scale * k_scale^T (batch dims broadcast as matmul's).

    The integer sums come from a float32 product of the INT8 values, exact while d <= EXACT_FLOAT32_K (the sums
    stay below 2**24; an index head is 128 wide): the same integers an INT8 x INT8 -> INT32 GEMM returns, on
    any device, from BLAS kernels that exist everywhere."""
    d = q.shape[-1]
    if d > EXACT_FLOAT32_K:
        raise ValueError(f"int8_scores sums {d} products per score; float32 holds them exactly up to "
                         f"{EXACT_FLOAT32_K}")
    if q.dtype != torch.int8 or k.dtype != torch.int8:
        raise ValueError(f"int8_scores takes int8 queries and keys, got {q.dtype} and {k.dtype}")
    sums = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
    return sums.mul_(q_scale).mul_(k_scale.transpose(-1, -2))
