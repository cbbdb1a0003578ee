"""The W8A8 grouped-expert MLP in PyPTO (kernels/pypto/experts.py) through PyPTO 0.2.0's pass-verify interpreter on
the host, against kernels.moe.grouped_mlp for INT8 experts: float32 rows, BF16 rows, pre-quantized INT8 rows, V4's
swiglu limit, one group and empty experts, at a tiny size and at V4-Flash's real expert dims; a deliberately wrong
variant fails; float experts are refused."""

import pytest
import torch

from dsconv.kernels.linear import quantize_activations
from dsconv.kernels.moe import ExpertWeights, grouped_mlp
from dsconv.kernels.pypto.experts import grouped_w8a8_mlp

pytestmark = pytest.mark.usefixtures("pypto_deferred_checks")

FLOAT32_TOLERANCE = 1e-5  # relative to the output's largest value
BF16_ULP = 2 ** -7  # relative: one BF16 unit in the last place (8 bits of mantissa)
INT8_MEAN_ABS = 64  # about the mean |code| of uniform INT8 weights: sets scales that give O(1) activations
TINY = (4, 256, 128)  # (local experts, hidden, intermediate)
TINY_COUNTS = [2, 0, 3, 1]
V4_FLASH = (2, 4096, 2048)  # two of V4-Flash's experts at its real hidden and intermediate sizes
V32 = (2, 7168, 2048)  # two of V3.2's
V4_SWIGLU_LIMIT = 10.0  # tests/data/deepseek_v4_flash.config.json's swiglu_limit
TINY_LIMIT = 1.0  # small enough to clamp many of the tiny fixture's O(1) gate and up values


def int8_experts(experts: int, hidden: int, inter: int, seed: int = 0) -> ExpertWeights:
    """Random INT8 weights with per-channel scales that keep each projection's outputs O(1) for O(1) rows."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randint(-127, 128, (experts, 2 * inter, hidden), generator=gen, dtype=torch.int8)
    w2 = torch.randint(-127, 128, (experts, hidden, inter), generator=gen, dtype=torch.int8)
    w13_scale = (0.5 + torch.rand(experts, 2 * inter, 1, generator=gen)) / (INT8_MEAN_ABS * hidden ** 0.5)
    w2_scale = (0.5 + torch.rand(experts, hidden, 1, generator=gen)) / (INT8_MEAN_ABS * inter ** 0.5)
    return ExpertWeights(w13, w2, w13_scale, w2_scale)


def rows(n: int, hidden: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("limit", [None, TINY_LIMIT], ids=["no-limit", "v4-limit"])
def test_float32_rows_equal_the_torch_path(limit):
    experts = int8_experts(*TINY)
    x = rows(sum(TINY_COUNTS), TINY[1])
    out = grouped_w8a8_mlp(x, TINY_COUNTS, experts, limit=limit)
    expected = grouped_mlp(x, TINY_COUNTS, experts, limit=limit)
    assert out.dtype == torch.float32
    assert relative_error(out, expected) <= FLOAT32_TOLERANCE  # measured: 0 (the same quantized codes)
    if limit is not None:  # the limit clamps something here: the result differs from the unclamped one
        assert relative_error(grouped_mlp(x, TINY_COUNTS, experts), expected) > 0.01


def test_bf16_rows_and_one_group_equal_the_torch_path():
    experts = int8_experts(*TINY)
    x = rows(sum(TINY_COUNTS), TINY[1], torch.bfloat16)
    out = grouped_w8a8_mlp(x, TINY_COUNTS, experts, limit=TINY_LIMIT)
    assert out.dtype == torch.bfloat16
    # the projections', the silu's and the product's BF16 roundings are the torch path's (measured: equal)
    assert relative_error(out, grouped_mlp(x, TINY_COUNTS, experts, limit=TINY_LIMIT)) <= BF16_ULP
    one_group = [0, 0, 5, 0]  # one expert's rows only (the others idle)
    x = rows(5, TINY[1])
    assert relative_error(grouped_w8a8_mlp(x, one_group, experts),
                          grouped_mlp(x, one_group, experts)) <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_pre_quantized_rows_equal_the_torch_path(out_dtype):
    """INT8 rows with their per-token scales, as the EP all-to-all delivers them, into out_dtype."""
    experts = int8_experts(*TINY)
    x_q, x_scale = quantize_activations(rows(sum(TINY_COUNTS), TINY[1]))
    out = grouped_w8a8_mlp(x_q, TINY_COUNTS, experts, x_scale, out_dtype)
    assert out.dtype == out_dtype
    expected = grouped_mlp(x_q, TINY_COUNTS, experts, x_scale, out_dtype)
    assert relative_error(out, expected) <= (FLOAT32_TOLERANCE if out_dtype == torch.float32 else BF16_ULP)


@pytest.mark.parametrize("dims,limit", [(V4_FLASH, V4_SWIGLU_LIMIT)], ids=["v4-flash"])
def test_real_expert_dims_equal_the_torch_path(dims, limit):
    """Two experts at V4-Flash's real sizes (H 4096, I 2048) with its swiglu limit, a few rows each. V3.2's (H 7168,
    I 2048, V32) gave equal outputs too, by hand: the same kernel at a wider H (docs/pypto.md)."""
    experts = int8_experts(*dims)
    counts = [2, 1]
    x = rows(sum(counts), dims[1])
    out = grouped_w8a8_mlp(x, counts, experts, limit=limit)
    assert relative_error(out, grouped_mlp(x, counts, experts, limit=limit)) <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("wrong", ["no_scale", "shifted"])
def test_a_wrong_kernel_fails(wrong):
    """The weight scales left out, or each group through the next expert's weights: far outside the tolerance."""
    experts = int8_experts(*TINY)
    x = rows(sum(TINY_COUNTS), TINY[1])
    out = grouped_w8a8_mlp(x, TINY_COUNTS, experts, wrong=wrong)
    assert relative_error(out, grouped_mlp(x, TINY_COUNTS, experts)) > 0.1


def test_float_experts_are_refused():
    experts = ExpertWeights(torch.randn(2, 8, 16), torch.randn(2, 16, 4))
    with pytest.raises(ValueError, match="is the W8A8 one"):
        grouped_w8a8_mlp(torch.randn(3, 16), [1, 2], experts)
