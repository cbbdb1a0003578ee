"""Projections: BF16 `linear`, and W8A8 `w8a8_linear` (INT8 weights, INT8 activations quantized per token).

W8A8 math, for x [M, k] and an INT8 weight w [n, k] with per-output-channel scale s_w [n, 1]:
    x_q, s_x = quantize_rows(x)                      # per token: s_x [M, 1], the kernels.int8 formula
    acc      = x_q @ w.T                             # exact integer sums, int32 [M, n]
    y        = (acc * s_x * s_w.T).to(out_dtype)     # dequantize in float32
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsconv.kernels.device import cast, is_npu, require_torch_npu
from dsconv.kernels.int8 import INT8_MAX, quantize_rows_, quantize_rows_reference

# float32 holds every integer of magnitude below 2**24 exactly. A dot product over K int8 pairs never exceeds
# K * 127**2 in magnitude, so a float32 GEMM over a K-slice of at most this length returns the exact integer
# sum whatever order the BLAS adds in. The int8 inputs are exact even where float32 matmuls run with TF32 or
# BF16 inputs (7 significant bits suffice for 127), and those modes still accumulate in float32.
EXACT_FLOAT32_K = 2**24 // INT8_MAX**2  # 1040
# npu_quant_matmul rejects k or n above 65535: an unsharded 129280-row lm_head cannot use it, it has to be split
# over TP or kept in BF16.
NPU_QUANT_MATMUL_MAX_DIM = 65535
HALF_DTYPES = (torch.bfloat16, torch.float16)
# torch._int_mm on CUDA (cuBLASLt's INT8 GEMM, int32 out) takes more than 16 rows and K, N multiples of 8
# (torch's checks in aten/src/ATen/native/cuda/Blas.cpp): a decode step's few rows are padded with zero rows.
# DeepSeek-V3.2's and V4's projection and expert dimensions are all multiples of 8.
INT_MM_MIN_ROWS = 17
INT_MM_MULTIPLE = 8
# A float32 projection of 2 to 16 rows (a decode step's batch) on CPU runs as (weight @ x.T).T: with the weight
# out of cache, as in a model's step, CPU BLAS streams the weight once that way instead of once per row block
# (docs/benchmarks.md, "Kernel choices"). One row is a matrix-vector product either way; from 32 rows on, the
# usual order is as fast or faster.
CPU_FEW_ROWS = 16
# Whether this CPU multiplies BF16 in hardware (AVX512-BF16 or AMX; torch's BF16 GEMMs then run on oneDNN's native
# kernels). On a 2-core EPYC with avx512_bf16, BF16 GEMMs took 2x-5x less time than float32 ones of the same
# weight at 2 to 512 rows (docs/benchmarks.md, "Kernel choices"): there a BF16 weight is multiplied as it is.
CPU_BF16_GEMM = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
# The float32 tile a BF16 weight is converted into on a CPU without BF16 instructions: at 8 MiB the tiled products
# took as long as, or less than, products of a float32 copy of the whole weight (2 to 512 rows of weights from
# [2048, 7168] to [7168, 16384]), and 16 local ranks hold 128 MiB of tiles between them, not a copy each.
CPU_TILE_BYTES = 8 * 2**20


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A float (BF16) projection computed in the weight's dtype; the result comes back in x's dtype."""
    return cast(F.linear(cast(x, weight.dtype), weight, bias), x.dtype)


def linear_t(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """linear(x, weight) given weight_t = weight.t(), a view made once at load, for a model's own projections.

    For 2-D x this is the GEMM F.linear ends in, called directly: F.linear reaches it through matmul and makes
    the transposed view at every call. Same kernel, same values, fewer calls per projection (a decode step
    makes dozens of projections of one row, where the call overhead is much of the time)."""
    x_in = cast(x, weight_t.dtype)
    if x_in.dim() != 2:
        return cast(torch.matmul(x_in, weight_t), x.dtype)
    if x_in.device.type == "cpu" and 1 < x_in.shape[0] <= CPU_FEW_ROWS:  # an NPU tensor's type is "npu"
        # (weight @ x.T).T: the same dot products, which MKL computes without repacking the whole weight
        return cast(torch.mm(weight_t.t(), x_in.t()).t().contiguous(), x.dtype)
    return cast(torch.mm(x_in, weight_t), x.dtype)


class FloatWeight:
    """A float projection weight [n, k] as the products take it, its transposed view made once, and no copy: the
    weight stays the rank's memory-mapped shard, which the ranks on one machine share (a per-rank copy of every
    replicated weight is what kept 16 local ranks at the real dimensions out of 24 GB).

    One row multiplies the weight in its own dtype, as do several rows on a device or on a CPU that multiplies BF16
    in hardware (`CPU_BF16_GEMM`). A CPU without BF16 instructions (AVX2) emulates BF16 GEMMs at a cost that grows
    with every row, so there several rows multiply the weight converted to float32 tile by tile (`float32_tiles`);
    one row, a matrix-vector product bound by the weight's bytes, reads half the bytes from the BF16 weight. Both
    products accumulate in float32 and round once, as a BF16 GEMM with float32 accumulation does, up to the order
    of the sums (figures in docs/benchmarks.md, "Kernel choices")."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.weight_t = weight, weight.t()
        self.in_tiles = matmul_dtype(weight) != weight.dtype and not (weight.dtype == torch.bfloat16 and CPU_BF16_GEMM)

    @classmethod
    def of(cls, weight: torch.Tensor) -> "FloatWeight":
        return cls(weight)

    @classmethod
    def stacked(cls, weights: torch.Tensor) -> list["FloatWeight"]:
        """weights [E, n, k] (a rank's experts) -> one per entry."""
        return [cls(one) for one in weights.unbind()]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> [..., n] in x's dtype."""
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if self.in_tiles and rows.shape[0] > 1:
            return float32_tiles(rows, self.weight).to(x.dtype).reshape(*x.shape[:-1], self.weight.shape[0])
        return linear_t(x, self.weight_t)


def float32_tiles(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, k] @ weight [n, k].T -> float32 [M, n], the weight converted to float32 CPU_TILE_BYTES at a time into
    one scratch tile: the products of a float32 copy of the whole weight, with no such copy held."""
    n, k = weight.shape
    tile_rows = max(1, min(n, CPU_TILE_BYTES // (k * 4)))
    out_t = torch.empty(n, x.shape[0], dtype=torch.float32, device=x.device)  # [n, M]: each tile's rows contiguous
    scratch = torch.empty(tile_rows, k, dtype=torch.float32, device=x.device)
    x_t = cast(x, torch.float32).t()
    for start in range(0, n, tile_rows):
        stop = min(start + tile_rows, n)
        tile = scratch[:stop - start]
        tile.copy_(weight[start:stop])
        torch.mm(tile, x_t, out=out_t[start:stop])
    return out_t.t()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (torch.matmul's broadcasting), returned in a's dtype, for products of two activations or of an
    activation and a weight copy made at load (attention scores and values).

    On CPU, BF16/FP16 operands are multiplied as float32 and the product rounded back once: the values of a
    half-precision GEMM with float32 accumulation, as torch's own computes, up to the order of the sums. A CPU
    without BF16 instructions (AVX2) emulates torch's BF16 batched and [1, k] @ [k, n] products, several times
    slower than the upcast. Other devices multiply in the inputs' dtype.
    """
    product_dtype = matmul_dtype(a)
    return cast(torch.matmul(cast(a, product_dtype), cast(b, product_dtype)), a.dtype)


def matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype `matmul` multiplies t in. An operand converted to it beforehand is not converted again: a
    weight copy made at load (then twice the bytes of a BF16 copy on CPU), a context read by two products."""
    return matmul_dtype_for(t.dtype, t.device)


def matmul_dtype_for(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """matmul_dtype for a tensor of this dtype on this device."""
    return torch.float32 if torch.device(device).type == "cpu" and dtype in HALF_DTYPES else dtype


def w8a8_linear(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [..., k] float, weight_int8 [n, k], weight_scale [n, 1] float32 -> [..., n] in out_dtype."""
    _check_w8a8(x, weight_int8, weight_scale)
    if is_npu(x):
        return _w8a8_linear_npu(x, weight_int8, weight_scale, out_dtype)
    x_q, x_scale = quantize_activations(x.reshape(-1, x.shape[-1]))
    y = w8a8_linear_quantized(x_q, x_scale, weight_int8, weight_scale, out_dtype)
    return y.reshape(*x.shape[:-1], weight_int8.shape[0])


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, k] float -> (int8 [M, k], float32 scale [M, 1]): the per-token dynamic quantization of W8A8,
    also used to send INT8 activations through the EP all-to-all."""
    if is_npu(x):
        return _quantize_npu(x)
    x2d = x.to(torch.float32, copy=True)  # a private copy: quantized in place
    x_q = torch.empty(x2d.shape, dtype=torch.int8, device=x.device)
    x_scale = torch.empty(x2d.shape[0], 1, dtype=torch.float32, device=x.device)
    quantize_rows_(x2d, x_q, x_scale)
    return x_q, x_scale


def w8a8_linear_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, weight_int8: torch.Tensor,
                          weight_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Already-quantized activations (x_q int8 [M, k], x_scale [M, 1]) -> [M, n] in out_dtype."""
    if is_npu(x_q):
        return _quant_matmul_npu(x_q, x_scale, weight_int8, weight_scale, out_dtype)
    return _dequantize(int8_matmul(x_q, weight_int8), x_scale, weight_scale, out_dtype)


def w8a8_linear_reference(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The plain formula: reference quantizer and an int32 GEMM (CPU only: CUDA has no int32 matmul)."""
    _check_w8a8(x, weight_int8, weight_scale)
    x_q, x_scale = quantize_rows_reference(x.reshape(-1, x.shape[-1]).to(torch.float32))
    acc = int8_matmul_reference(x_q, weight_int8)
    return _dequantize(acc, x_scale, weight_scale, out_dtype).reshape(*x.shape[:-1], weight_int8.shape[0])


def int8_matmul_reference(x_q: torch.Tensor, weight_int8: torch.Tensor) -> torch.Tensor:
    """x_q [M, k] int8, weight_int8 [n, k] int8 -> int32 [M, n]."""
    return x_q.to(torch.int32) @ weight_int8.to(torch.int32).T


def int8_matmul(x_q: torch.Tensor, weight_int8: torch.Tensor) -> torch.Tensor:
    """Same int32 result as the reference. On CUDA, torch._int_mm (`int_mm_padded`) where the shapes allow; on a
    CPU whose torch._int_mm is exact (`cpu_int8_gemm`), torch._int_mm; otherwise float32 GEMMs over K-slices short
    enough to be exact (an int32 matmul on CPU is a plain loop, several times slower). Every path gives the exact
    integer sums, so the choice changes no value. No rows (an idle rank's step) touch no weight: the slices would
    convert the whole weight to float32 for nothing, which made every W8A8 decode step at world 16 cost seconds."""
    if not x_q.shape[0]:
        return torch.zeros(0, weight_int8.shape[0], dtype=torch.int32, device=x_q.device)
    if x_q.device.type == "cuda" and not x_q.shape[1] % INT_MM_MULTIPLE \
            and not weight_int8.shape[0] % INT_MM_MULTIPLE:
        return int_mm_padded(x_q, weight_int8)
    if x_q.device.type == "cpu" and cpu_int8_gemm():
        return torch._int_mm(x_q.contiguous(), weight_int8.t())
    acc = torch.zeros(x_q.shape[0], weight_int8.shape[0], dtype=torch.int32, device=x_q.device)
    for start in range(0, x_q.shape[1], EXACT_FLOAT32_K):
        cols = slice(start, start + EXACT_FLOAT32_K)
        acc += (x_q[:, cols].to(torch.float32) @ weight_int8[:, cols].to(torch.float32).T).to(torch.int32)
    return acc


def _cpu_int_mm_is_exact() -> bool:
    """Whether torch._int_mm on this CPU returns exact int32 sums. oneDNN runs it on VNNI instructions where the CPU
    has them, exact; on AVX2 alone (or with ONEDNN_MAX_CPU_ISA capping it there) it adds pairs of u8 x s8 products
    into saturating int16 lanes, and sums go wrong: measured 121157 off in a [8, 1024] @ [1024, 256] product. The
    probe: 64 products of 127 x 127, whose pairs saturate int16 in that form."""
    x = torch.full((1, 64), INT8_MAX, dtype=torch.int8)
    weight = torch.full((8, 64), INT8_MAX, dtype=torch.int8)
    try:
        return bool((torch._int_mm(x, weight.t()) == 64 * INT8_MAX**2).all())
    except RuntimeError:  # a torch build without a CPU kernel for it
        return False


@functools.cache
def cpu_int8_gemm() -> bool:
    """Whether CPU INT8 GEMMs run torch._int_mm: on a CPU with VNNI, where the probe finds it exact, 9x-11x less time
    than the float32 K-slices on a 2-core EPYC with avx512_vnni, from 1 to 512 rows of [2048, 7168] to [24576, 1536]
    weights (docs/benchmarks.md, "Kernel choices"); without VNNI it was slower than the slices at more than a few
    rows (measured on an AVX2 EPYC). Probed at the first GEMM, not at import: the rank server imports this module
    before it forks the ranks, and a oneDNN GEMM run before a fork can leave its threads' locks held in the children
    (with ONEDNN_MAX_CPU_ISA=AVX2 every rank hung in its first parallel copy)."""
    return torch.cpu._is_vnni_supported() and _cpu_int_mm_is_exact()


def int_mm_padded(x_q: torch.Tensor, weight_int8: torch.Tensor) -> torch.Tensor:
    """x_q [M, k] int8 @ weight_int8 [n, k].T -> int32 [M, n] by torch._int_mm, the rows padded with zero rows to
    INT_MM_MIN_ROWS (their results dropped); k and n multiples of INT_MM_MULTIPLE."""
    rows = x_q.shape[0]
    padded = F.pad(x_q, (0, 0, 0, INT_MM_MIN_ROWS - rows)) if rows < INT_MM_MIN_ROWS else x_q
    return torch._int_mm(padded.contiguous(), weight_int8.t())[:rows]


def _dequantize(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    # acc [M, n] int32, x_scale [M, 1], weight_scale [n, 1]
    return (acc.to(torch.float32) * x_scale * weight_scale.T).to(out_dtype)


def _check_w8a8(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
        raise ValueError(f"W8A8 weight must be a 2-D int8 tensor [out, in], got {weight_int8.dtype} "
                         f"{tuple(weight_int8.shape)}")
    n, k = weight_int8.shape
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n, 1):
        raise ValueError(f"W8A8 weight_scale must be float32 [{n}, 1], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features but the W8A8 weight expects {k}")
    if not x.is_floating_point():
        raise ValueError(f"W8A8 input must be floating point, got {x.dtype}")


# --- NPU (torch_npu; in CI against tests/npu_double.py) ----------------------------------------------------------
# Each call passes only what the op's documentation accepts: no empty x1 (npu_quant_matmul), float16/bfloat16
# input to npu_dynamic_quant, float16/bfloat16 output from npu_quant_matmul. float32 compute (--dtype float32)
# takes the BF16 route: activations quantized from BF16, products returned in BF16 and widened.
def _w8a8_linear_npu(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    x_q, x_scale = _quantize_npu(x.reshape(-1, x.shape[-1]))
    y = _quant_matmul_npu(x_q, x_scale, weight_int8, weight_scale, out_dtype)
    return y.reshape(*x.shape[:-1], weight_int8.shape[0])


def _quantize_npu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, k] float -> (int8 [M, k], float32 [M, 1]). Same symmetric per-token formula as kernels.int8, though
    the NPU's rounding is not promised bit-equal."""
    if x.shape[0] == 0:  # an idle rank's step: nothing to quantize
        return (torch.empty(x.shape, dtype=torch.int8, device=x.device),
                torch.empty(0, 1, dtype=torch.float32, device=x.device))
    # contiguous rows: a column slice (the INT8 part of a cache row) or a stride-0 expand is not a documented x
    x_in = cast(x, npu_half(x.dtype)).contiguous()
    x_q, x_scale = require_torch_npu().npu_dynamic_quant(x_in)  # int8 [M, k], float32 [M]
    return x_q, x_scale[:, None]


def _quant_matmul_npu(x_q: torch.Tensor, x_scale: torch.Tensor, weight_int8: torch.Tensor,
                      weight_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    n, k = weight_int8.shape
    if k > NPU_QUANT_MATMUL_MAX_DIM or n > NPU_QUANT_MATMUL_MAX_DIM:
        raise ValueError(f"npu_quant_matmul needs in, out <= {NPU_QUANT_MATMUL_MAX_DIM}; weight is [{n}, {k}]: "
                         "shard it over TP or keep it in BF16")
    if x_q.shape[0] == 0:  # npu_quant_matmul rejects an empty x1; an idle rank's step has no rows
        return torch.empty(0, n, dtype=out_dtype, device=x_q.device)
    y = require_torch_npu().npu_quant_matmul(x_q, weight_int8.T, weight_scale.view(-1),  # weight as [k, n], a view
                                             pertoken_scale=x_scale.view(-1), output_dtype=npu_half(out_dtype))
    return cast(y, out_dtype)


def npu_half(dtype: torch.dtype) -> torch.dtype:
    """The dtype an NPU INT8 op takes in or gives out for `dtype`: float16 / bfloat16 as is, BF16 otherwise."""
    return dtype if dtype in HALF_DTYPES else torch.bfloat16
