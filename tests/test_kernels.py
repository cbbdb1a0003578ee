"""kernels/: each fast path against its plain reference, and each reference against transformers' own code."""

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

from dsconv.kernels.attention import attention, attention_reference, causal_mask
from dsconv.kernels.device import require_torch_npu
from dsconv.kernels.int8 import INT8_MAX
from dsconv.kernels import linear as linear_module
from dsconv.kernels.linear import (CPU_FEW_ROWS, EXACT_FLOAT32_K, INT_MM_MIN_ROWS, FloatWeight, float32_tiles,
                                   int8_matmul,
                                   int8_matmul_reference, int_mm_padded, linear,
                                   linear_t, matmul, matmul_dtype, quantize_activations, w8a8_linear,
                                   w8a8_linear_reference)
from dsconv.kernels.moe import ExpertWeights, grouped_mlp, grouped_mlp_reference, swiglu, token_mlp
from dsconv.kernels.norm import UNWEIGHTED, WEIGHT_IN_FLOAT32, rms_norm, rms_norm_reference
from dsconv.kernels.topk import topk_lowest_index
from dsconv.kernels.rope import (apply_rope, apply_rope_prefix, half_split_tables, rope_cos_sin, rope_tail,
                                 softmax_scale)
from tests.helpers import quantized_weight, random_experts

YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
ROPE_DIM = 64  # qk_rope_head_dim of the real models
ROPE_THETA = 10000


def _int8(*shape, gen):
    return torch.randint(-INT8_MAX, INT8_MAX + 1, shape, dtype=torch.int8, generator=gen)


# --- linear ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("int_mm", [True, False], ids=["cpu-int-mm", "float-slices"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 3), (0, 16, 8), (5, 33, 9), (17, 64, 32), (3, 2 * EXACT_FLOAT32_K + 5, 11)])
def test_int8_matmul_matches_int32_reference(m, k, n, int_mm, monkeypatch):
    """Both CPU paths: torch._int_mm (where the probe found it exact on this CPU) and the float32 K-slices."""
    if int_mm and not linear_module.cpu_int8_gemm():
        pytest.skip("torch._int_mm is not exact on this CPU (no VNNI): the float32 slices run instead")
    monkeypatch.setattr(linear_module, "cpu_int8_gemm", lambda: int_mm)
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x_q, w = _int8(m, k, gen=gen), _int8(n, k, gen=gen)
    assert torch.equal(int8_matmul(x_q, w), int8_matmul_reference(x_q, w))


def exact_cpu_int_mm() -> None:
    """Skips a test that runs CUDA's INT8 GEMM path on this CPU's torch._int_mm where that is not exact (oneDNN's
    saturating form: with ONEDNN_MAX_CPU_ISA=AVX2 on a CPU with VNNI, docs/testing.md's AVX2 stand-in)."""
    if not linear_module._cpu_int_mm_is_exact():
        pytest.skip("torch._int_mm is not exact on this CPU's oneDNN ISA: CUDA's path cannot run on it here")


@pytest.mark.parametrize("m", [0, 1, 5, INT_MM_MIN_ROWS - 1, INT_MM_MIN_ROWS, 40])
def test_int_mm_padded_equals_the_int32_reference(m):
    """CUDA's INT8 GEMM path (torch._int_mm, rows padded to its minimum), run here on CPU's torch._int_mm: the
    padding rows are dropped and the sums are exact, worst-case magnitudes included."""
    exact_cpu_int_mm()
    gen = torch.Generator().manual_seed(m)
    x_q, w = _int8(m, 1040, gen=gen), _int8(24, 1040, gen=gen)
    if m:
        x_q[0] = INT8_MAX
        w[0] = INT8_MAX
    acc = int_mm_padded(x_q, w)
    assert acc.dtype == torch.int32 and torch.equal(acc, int8_matmul_reference(x_q, w))


def test_w8a8_through_int_mm_equals_the_float_slices(monkeypatch):
    """The whole W8A8 projection with int8_matmul routed to int_mm_padded, as on CUDA (the dequantization after
    it unchanged), equals the CPU path's result bit for bit, decode's few rows and prefill's many."""
    exact_cpu_int_mm()
    gen = torch.Generator().manual_seed(1)
    w, w_scale = quantized_weight(32, 64, gen)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 64, generator=gen)
        expected = w8a8_linear(x, w, w_scale, out_dtype=torch.float32)
        with monkeypatch.context() as patch:
            patch.setattr(linear_module, "int8_matmul", int_mm_padded)
            got = w8a8_linear(x, w, w_scale, out_dtype=torch.float32)
        assert torch.equal(got, expected)


def test_the_cpu_int_mm_probe_sees_saturating_sums(monkeypatch):
    """oneDNN's AVX2 form of torch._int_mm adds u8 x s8 product pairs into saturating int16 lanes: a kernel that
    saturates so fails the probe, and int8_matmul then takes the float32 slices."""
    def saturating(x, weight_t):  # x shifted to u8, product pairs clamped to int16 as vpmaddubsw does, shift undone
        shifted = x.to(torch.int32) + 128
        products = shifted[:, :, None] * weight_t.to(torch.int32)[None]  # [m, k, n]
        pairs = products.view(x.shape[0], -1, 2, weight_t.shape[1]).sum(2).clamp(-2**15, 2**15 - 1)
        return (pairs.sum(1) - 128 * weight_t.to(torch.int32).sum(0)).to(torch.int32)

    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not linear_module._cpu_int_mm_is_exact()
    monkeypatch.setattr(torch, "_int_mm", lambda x, weight_t: int8_matmul_reference(x, weight_t.t()))
    assert linear_module._cpu_int_mm_is_exact()


def test_int8_matmul_exact_at_worst_case_sums():
    # every product +-127*127 with one sign: the sum needs more than float32's 24 bits unless K is sliced
    k = 3 * EXACT_FLOAT32_K + 7
    x_q = torch.full((2, k), INT8_MAX, dtype=torch.int8)
    x_q[1] = -INT8_MAX
    w = torch.full((3, k), INT8_MAX, dtype=torch.int8)
    w[1, ::2] = -INT8_MAX
    acc = int8_matmul(x_q, w)
    assert torch.equal(acc, int8_matmul_reference(x_q, w))
    assert acc[0, 0].item() == k * INT8_MAX**2


@pytest.mark.parametrize("lead", [(1,), (0,), (2, 3), (13,)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_linear_matches_reference_exactly(lead, dtype):
    gen = torch.Generator().manual_seed(len(lead) * 7 + lead[0])
    w, w_scale = quantized_weight(19, 45, gen)
    x = torch.randn(*lead, 45, generator=gen).to(dtype)
    x[..., :1, :] = 0  # an all-zero token (when there is one) must dequantize to exact zeros
    out = w8a8_linear(x, w, w_scale, out_dtype=dtype)
    assert out.shape == (*lead, 19) and out.dtype == dtype
    assert torch.equal(out, w8a8_linear_reference(x, w, w_scale, out_dtype=dtype))
    if x.numel():
        assert not out.reshape(-1, 19)[0].any()


def test_w8a8_linear_close_to_float_matmul():
    gen = torch.Generator().manual_seed(0)
    w, w_scale = quantized_weight(256, 1536, gen)
    x = torch.randn(32, 1536, generator=gen)
    expected = x @ (w.to(torch.float32) * w_scale).T
    got = w8a8_linear(x, w, w_scale, out_dtype=torch.float32)
    assert F.cosine_similarity(got.flatten(), expected.flatten(), dim=0) >= 0.999


def test_w8a8_linear_rejects_bad_weight_and_scale():
    gen = torch.Generator().manual_seed(0)
    w, w_scale = quantized_weight(4, 8, gen)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight_scale"):
        w8a8_linear(x, w, w_scale.view(-1))
    with pytest.raises(ValueError, match="int8"):
        w8a8_linear(x, w.to(torch.float32), w_scale)
    with pytest.raises(ValueError, match="8"):
        w8a8_linear(torch.randn(2, 9), w, w_scale)


def test_linear_computes_in_weight_dtype_returns_input_dtype():
    w = torch.randn(5, 7).to(torch.bfloat16)
    x = torch.randn(3, 7)
    out = linear(x, w)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.linear(x.to(torch.bfloat16), w).float())


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead", [(1,), (4,), (2, 3)], ids=["decode-row", "rows", "3d"])
def test_linear_t_equals_linear(lead, x_dtype):
    """The projection path from a transposed view made at load gives linear's values and dtype exactly."""
    w = torch.randn(48, 40).to(torch.bfloat16)
    x = torch.randn(*lead, 40).to(x_dtype)
    out = linear_t(x, w.t())
    assert out.dtype == x_dtype and out.shape == (*lead, 48)
    assert torch.equal(out, linear(x, w))


@pytest.mark.parametrize("rows", [1, 2, 5, CPU_FEW_ROWS, CPU_FEW_ROWS + 1, 40])
def test_linear_t_few_rows_equal_the_usual_product(rows):
    """2 to CPU_FEW_ROWS rows run as (weight @ x.T).T on CPU: the same dot products, summed in another order."""
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(300, 64, generator=gen), torch.randn(rows, 64, generator=gen)
    out = linear_t(x, w.t())
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, torch.mm(x.double(), w.double().t()).float(), atol=1e-5, rtol=1e-5)


def test_flush_denormals_zeroes_them_on_cpu():
    # in a fresh interpreter: a test before this one may have built a model, which flushes in its own thread
    code = ("import json, torch; from dsconv.kernels.device import flush_denormals; "
            "tiny = torch.tensor([1e-39, 1e-30]); before = (tiny * 1.0).tolist(); "
            "flush_denormals(torch.device('cpu')); print(json.dumps([before, (tiny * 1.0).tolist()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after = json.loads(out)
    assert before[0] != 0 and before[1] != 0  # 1e-39 is a denormal float32: kept, then flushed
    assert after[0] == 0.0 and after[1] == pytest.approx(1e-30)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_matmul_is_a_half_precision_product_rounded_once():
    """BF16 operands multiply as float32 on CPU: the exact products summed in float32, rounded to BF16 once,
    which is what a BF16 GEMM with float32 accumulation computes, up to the order of the sums."""
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(8, 1, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(8, 96, 40, generator=gen).to(torch.bfloat16)
    out = matmul(a, b)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 1, 40)
    exact = torch.matmul(a.double(), b.double())
    torch.testing.assert_close(out.double(), exact, rtol=2.0**-8, atol=1e-5)  # one rounding to BF16 (8 bits)
    torch.testing.assert_close(out, torch.matmul(a, b), atol=0, rtol=2.0**-7)  # torch's own BF16 product
    assert matmul_dtype(a) == torch.float32 and matmul_dtype(a.float()) == torch.float32
    assert matmul_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64
    b32 = b.float()  # an operand already in matmul_dtype is used as is: same result
    assert torch.equal(matmul(a, b32), out)


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_float_weight_keeps_the_mapped_weight_and_rounds_once(monkeypatch, bf16_gemm):
    """A BF16 projection holds no copy of its weight. Several rows on a CPU without BF16 instructions multiply
    float32 tiles of it (several tiles here), elsewhere the BF16 weight itself; either way the product is the exact
    one rounded to BF16 once, up to the order of float32 sums."""
    monkeypatch.setattr(linear_module, "CPU_BF16_GEMM", bf16_gemm)
    monkeypatch.setattr(linear_module, "CPU_TILE_BYTES", 7 * 96 * 4)  # 7 rows a tile: 40 rows take 6 tiles
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    projection = FloatWeight.of(weight)
    assert projection.weight.data_ptr() == weight.data_ptr() and projection.in_tiles != bf16_gemm
    for shape in [(1, 96), (3, 96), (33, 96), (2, 5, 96)]:
        x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        out = projection(x)
        assert out.dtype == torch.bfloat16 and out.shape == (*shape[:-1], 40)
        exact = x.double() @ weight.double().T
        torch.testing.assert_close(out.double(), exact, rtol=2.0**-8, atol=1e-4)
    x = torch.randn(33, 96, generator=gen)
    torch.testing.assert_close(float32_tiles(x, weight), x @ weight.float().T, rtol=1e-6, atol=1e-5)


def test_require_torch_npu_says_why():
    with pytest.raises(RuntimeError, match="torch_npu"):
        require_torch_npu()


# --- norm -----------------------------------------------------------------------------------------------------
def _hf_rms_norm(dim, dtype, gen):
    module = hf_v3.DeepseekV3RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(dim, generator=gen))
    return module.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_reference_equals_transformers(dtype):
    gen = torch.Generator().manual_seed(1)
    module = _hf_rms_norm(96, dtype, gen)
    x = (3 * torch.randn(4, 5, 96, generator=gen)).to(dtype)
    with torch.no_grad():
        expected = module(x)
    assert torch.equal(rms_norm_reference(x, module.weight.detach(), 1e-6), expected)
    if dtype == torch.float32:  # float32 runs the reference itself
        assert torch.equal(rms_norm(x, module.weight.detach(), 1e-6), expected)


# the CPU path's float32 variance may differ from the reference's in the last bit, which moves an element's
# rounding to the half dtype only on a rounding boundary: measured 2 of 1.8M elements in BF16, ~1e-5 in FP16
HALF_NORM_MISMATCH_MAX = 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [96, 512, 1536, 7168])  # a tiny fixture's and the real models' norm widths
def test_rms_norm_half_cpu_path_against_transformers(dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    module = _hf_rms_norm(dim, dtype, gen)
    # rows of very different scales, a zero row (eps alone) and one token alone, as a decode step has
    x = (torch.randn(64, dim, generator=gen) * torch.logspace(-3, 2, 64)[:, None]).to(dtype)
    x[5] = 0
    with torch.no_grad():
        expected = module(x)
        got = rms_norm(x, module.weight.detach(), 1e-6)
        assert torch.equal(rms_norm(x[7:8], module.weight.detach(), 1e-6), got[7:8])
    differ = got != expected
    assert differ.float().mean().item() <= HALF_NORM_MISMATCH_MAX
    # where they differ: the normalized values are adjacent on the half dtype's grid, and the weight multiply's
    # own rounding can carry that to two steps of the output's grid at most
    ulp = expected.float().abs().clamp_min(torch.finfo(dtype).tiny) * torch.finfo(dtype).eps
    assert bool(((got.float() - expected.float()).abs() <= 2 * ulp)[differ].all())


def test_rms_norm_checks_the_weight_and_the_order():
    with pytest.raises(ValueError, match="does not match"):
        rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(7, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="does not match"):
        rms_norm(torch.zeros(2, 8), None, 1e-6, WEIGHT_IN_FLOAT32)
    with pytest.raises(ValueError, match="takes no weight"):
        rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6, UNWEIGHTED)
    with pytest.raises(ValueError, match="not one of"):
        rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6, "weight_twice")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_v4_orders_equal_transformers(dtype):
    """V4's float32-weight order and its unweighted form, bit for bit against transformers' modules."""
    gen = torch.Generator().manual_seed(12)
    x = (3 * torch.randn(4, 5, 96, generator=gen)).to(dtype)
    x[0, 0] = 0  # eps alone
    weighted = hf_v4.DeepseekV4RMSNorm(96, eps=1e-6)  # V4 keeps the weight in float32
    with torch.no_grad():
        weighted.weight.copy_(torch.randn(96, generator=gen))
        assert torch.equal(rms_norm(x, weighted.weight.detach(), 1e-6, WEIGHT_IN_FLOAT32), weighted(x))
        assert torch.equal(rms_norm(x, None, 1e-6, UNWEIGHTED), hf_v4.DeepseekV4UnweightedRMSNorm(1e-6)(x))


# --- rope -----------------------------------------------------------------------------------------------------
def _rope_configs(rope_scaling):
    ours = SimpleNamespace(qk_rope_head_dim=ROPE_DIM, rope_theta=ROPE_THETA, rope_scaling=rope_scaling)
    kwargs = {"rope_scaling": dict(rope_scaling)} if rope_scaling else {}
    theirs = DeepseekV3Config(qk_rope_head_dim=ROPE_DIM, rope_theta=ROPE_THETA, max_position_embeddings=163840,
                              **kwargs)
    return ours, theirs


POSITIONS = torch.tensor([[0, 1, 2, 7, 100, 4095, 4096, 5000, 65537, 163839]])


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["default", "yarn"])
def test_rope_cos_sin_equal_transformers(rope_scaling):
    ours, theirs = _rope_configs(rope_scaling)
    cos, sin = rope_cos_sin(ours, POSITIONS)
    hf_cos, hf_sin = hf_v3.DeepseekV3RotaryEmbedding(theirs)(torch.zeros(1, dtype=torch.float32), POSITIONS)
    half = ROPE_DIM // 2
    assert cos.shape == (1, len(POSITIONS[0]), half)
    for ours_t, hf_t in ((cos, hf_cos), (sin, hf_sin)):  # transformers stores cat(freqs, freqs)
        assert torch.equal(ours_t, hf_t[..., :half]) and torch.equal(ours_t, hf_t[..., half:])


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["default", "yarn"])
def test_softmax_scale_equals_transformers(rope_scaling):
    ours, theirs = _rope_configs(rope_scaling)
    qk_head_dim = theirs.qk_nope_head_dim + theirs.qk_rope_head_dim
    expected = hf_v3.yarn_apply_mscale(theirs.rope_parameters, qk_head_dim**-0.5)
    assert softmax_scale(qk_head_dim, rope_scaling) == expected
    assert (expected != qk_head_dim**-0.5) == (rope_scaling is not None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False], ids=["mla-interleaved", "indexer-half-split"])
def test_apply_rope_equals_transformers(dtype, interleaved):
    gen = torch.Generator().manual_seed(2)
    ours, theirs = _rope_configs(YARN)
    heads, tokens = 3, POSITIONS.shape[1]
    q = torch.randn(1, heads, tokens, ROPE_DIM, generator=gen).to(dtype)  # transformers' [B, H, S, D]
    k = torch.randn(1, 1, tokens, ROPE_DIM, generator=gen).to(dtype)
    hf_cos, hf_sin = hf_v3.DeepseekV3RotaryEmbedding(theirs)(q, POSITIONS)  # [1, S, D] in q's dtype
    if interleaved:  # MLA's q_pe / k_pe
        hf_q, hf_k = hf_v3.apply_rotary_pos_emb_interleave(q, k, hf_cos, hf_sin)
    else:  # V3.2's indexer
        hf_q, hf_k = hf_v32.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    cos, sin = rope_cos_sin(ours, POSITIONS[0])  # [S, D/2] float32
    assert torch.equal(apply_rope(q, cos, sin, interleaved), hf_q)
    assert torch.equal(apply_rope(k, cos, sin, interleaved), hf_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("passed", [0, 64], ids=["rotated-only", "with-passthrough"])
def test_apply_rope_prefix_equals_transformers_indexer(dtype, passed):
    # V3.2's indexer q / k: index_head_dim wide, half-split rope on the first qk_rope_head_dim dims, the rest
    # passed through, as transformers' DeepseekV32Indexer splits, rotates and concatenates them
    gen = torch.Generator().manual_seed(3)
    ours, theirs = _rope_configs(YARN)
    heads, tokens, dim = 3, POSITIONS.shape[1], ROPE_DIM + passed
    q = (4 * torch.randn(1, heads, tokens, dim, generator=gen)).to(dtype)
    k = (4 * torch.randn(1, 1, tokens, dim, generator=gen)).to(dtype)
    hf_cos, hf_sin = hf_v3.DeepseekV3RotaryEmbedding(theirs)(q, POSITIONS)
    hf_q_rot, hf_k_rot = hf_v32.apply_rotary_pos_emb(q[..., :ROPE_DIM], k[..., :ROPE_DIM], hf_cos, hf_sin)
    cos, sin = rope_cos_sin(ours, POSITIONS[0])  # [S, D/2] float32
    cos_full, sin_full = half_split_tables(cos.to(dtype), sin.to(dtype), dim)
    for x, hf_rot in ((q, hf_q_rot), (k, hf_k_rot)):
        got = apply_rope_prefix(x, cos_full, sin_full, ROPE_DIM)
        assert torch.equal(got[..., :ROPE_DIM], hf_rot)
        assert torch.equal(got[..., ROPE_DIM:], x[..., ROPE_DIM:])
    with pytest.raises(ValueError, match="do not fit"):
        half_split_tables(cos, sin, ROPE_DIM - 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_tail_equals_transformers_v4(dtype):
    # V4: interleaved pairs on the last rope dims of each head, layout kept, the leading dims passed through
    gen = torch.Generator().manual_seed(13)
    ours, _ = _rope_configs(YARN)
    heads, tokens, dim = 3, POSITIONS.shape[1], ROPE_DIM + 32
    x = (4 * torch.randn(1, heads, tokens, dim, generator=gen)).to(dtype)  # transformers' [B, H, S, D]
    cos, sin = rope_cos_sin(ours, POSITIONS)  # [1, S, D/2] float32
    expected = hf_v4.apply_rotary_pos_emb(x, cos, sin)  # unsqueezes the head axis
    assert torch.equal(rope_tail(x, cos[:, None], sin[:, None]), expected)
    back = rope_tail(expected, cos[:, None], -sin[:, None]).float()  # the inverse rotation (V4's output)
    torch.testing.assert_close(back, x.float(), atol=0.05 if dtype == torch.bfloat16 else 1e-5, rtol=0.02)


# --- attention ------------------------------------------------------------------------------------------------
def _eager(q, k, v, scale, allowed):
    """transformers' eager attention with its additive mask (dtype min where not allowed) -> [B, H, S, Dv]."""
    allowed = allowed.expand(q.shape[0], -1, -1)[:, None]  # [B, 1, S, T]
    additive = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    module = SimpleNamespace(num_key_value_groups=1, training=False)
    out, _ = hf_v3.eager_attention_forward(module, q, k, v, additive, scaling=scale)
    return out.transpose(1, 2)


def _qkv(batch, heads, s, t, d, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, n, dim, generator=gen).to(dtype) for n, dim in ((s, d), (t, d), (t, dv)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_reference_equals_transformers_eager(dtype):
    q, k, v = _qkv(2, 4, 5, 9, 24, 16, dtype, seed=3)  # 4 cached keys, then a 5-token prefill chunk
    allowed = causal_mask(5, 9)
    sparse = allowed & (torch.rand(2, 5, 9, generator=torch.Generator().manual_seed(4)) < 0.5)
    sparse[:, torch.arange(5), torch.arange(5) + 4] = True  # each query keeps at least itself
    for mask in (allowed, sparse):
        expected = _eager(q, k, v, 0.2, mask)
        assert torch.equal(attention_reference(q, k, v, 0.2, mask), expected)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("s,t", [(6, 6), (5, 12), (1, 12)], ids=["prefill", "chunked-prefill", "decode"])
def test_attention_matches_reference(dtype, atol, s, t):
    q, k, v = _qkv(2, 3, s, t, 40, 24, dtype, seed=s * 100 + t)
    gen = torch.Generator().manual_seed(5)
    sparse = causal_mask(s, t) & (torch.rand(2, s, t, generator=gen) < 0.6)
    sparse[:, torch.arange(s), torch.arange(s) + t - s] = True
    for mask in (None, causal_mask(s, t), sparse):
        got, expected = attention(q, k, v, 0.15, mask), attention_reference(q, k, v, 0.15, mask)
        assert got.dtype == dtype and got.shape == (2, 3, s, 24)
        torch.testing.assert_close(got, expected, atol=atol, rtol=atol)


def test_attention_unbatched_heads_and_bad_mask():
    q, k, v = (x[0] for x in _qkv(1, 2, 4, 4, 8, 8, torch.float32, seed=6))  # [H, S, D]
    out = attention(q, k, v, 0.3, causal_mask(4, 4))
    torch.testing.assert_close(out, attention_reference(q, k, v, 0.3, causal_mask(4, 4)))
    with pytest.raises(ValueError, match="mask"):
        attention(q, k, v, 0.3, torch.ones(1, 1, 1, 4, 4, dtype=torch.bool))


def _sink_attention_formula(q, kv, allowed, sinks, scale):
    """V4's attention as its first runner wrote it: q [T, H, D], kv [K, D] (keys = values), allowed [T, K],
    sinks [H] -> [T, H, D]; the sink a last logit of each head's softmax, its probability dropped."""
    scores = (torch.einsum("thd,kd->htk", q, kv) * scale).float().masked_fill(~allowed, float("-inf"))
    logits = torch.cat([scores, sinks[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
    return torch.einsum("htk,kd->thd", probs.to(kv.dtype), kv)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-6)])
@pytest.mark.parametrize("s", [1, 6], ids=["decode", "prefill"])
def test_attention_with_sinks(dtype, atol, s):
    """V4's shared-KV attention with per-head sinks: against transformers' V4 eager attention (float32 only: in
    BF16 it takes the softmax in BF16) and against the formula the V4 runner used before."""
    gen = torch.Generator().manual_seed(14 + s)
    heads, t, d = 4, 9, 16
    q = torch.randn(s, heads, d, generator=gen).to(dtype)  # [T, H, D]
    kv = torch.randn(t, d, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    allowed = causal_mask(s, t) & (torch.rand(s, t, generator=gen) < 0.7)
    allowed[:, -1] = True
    got = attention(q.transpose(0, 1), kv, kv, 0.25, allowed, sinks=sinks).transpose(0, 1)
    assert got.dtype == dtype and got.shape == (s, heads, d)
    torch.testing.assert_close(got, _sink_attention_formula(q, kv, allowed, sinks, 0.25), atol=atol, rtol=atol)
    reference = attention_reference(q.transpose(0, 1), kv, kv, 0.25, allowed, sinks=sinks).transpose(0, 1)
    torch.testing.assert_close(got, reference, atol=atol, rtol=atol)
    if dtype == torch.float32:
        additive = torch.zeros(s, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
        module = SimpleNamespace(num_key_value_groups=1, training=False, sinks=sinks)
        kv4 = kv[None, None]  # [B, 1, K, D]: transformers' one KV head
        expected, _ = hf_v4.eager_attention_forward(module, q.transpose(0, 1)[None], kv4, kv4, additive, scaling=0.25)
        torch.testing.assert_close(got, expected[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sinks", [False, True], ids=["mla", "sinks"])
def test_one_token_batches_equal_each_sequence_alone(sinks):
    """Batched decode: each sequence's heads as the S queries of one call against its own keys, padded to the
    longest with the padding masked, equal one call per sequence ([heads, 1, D] against its keys)."""
    gen = torch.Generator().manual_seed(21)
    heads, d, lengths = 4, 16, [3, 9, 6]
    q = torch.randn(len(lengths), heads, d, generator=gen)
    keys = [torch.randn(n, d, generator=gen) for n in lengths]
    head_sinks = torch.randn(heads, generator=gen) if sinks else None
    padded = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)  # [B, K, D]
    allowed = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]  # [B, K]
    got = attention(q, padded, padded, 0.3, allowed[:, None], sinks=head_sinks, one_token=True)
    assert got.shape == (len(lengths), heads, d)
    for b, k in enumerate(keys):
        alone = attention(q[b][:, None], k, k, 0.3, sinks=head_sinks)[:, 0]  # [heads, D]
        torch.testing.assert_close(got[b], alone, atol=1e-6, rtol=1e-5)
        reference = attention_reference(q[b][:, None], k, k, 0.3, sinks=head_sinks)[:, 0]
        torch.testing.assert_close(got[b], reference, atol=1e-6, rtol=1e-5)


def test_attention_sink_takes_a_fully_masked_row():
    # a query that may look nowhere gives all its mass to the sinks: a zero output, not NaN
    q, kv = torch.randn(2, 1, 8), torch.randn(5, 8)
    out = attention(q, kv, kv, 0.3, torch.zeros(1, 5, dtype=torch.bool), sinks=torch.zeros(2))
    assert torch.equal(out, torch.zeros(2, 1, 8))


# --- moe ------------------------------------------------------------------------------------------------------
HIDDEN, INTER = 48, 64


def _experts(n_experts, seed, int8=True):
    return random_experts(n_experts, HIDDEN, INTER, seed, int8)


def _per_token_w8a8(x, expert_of_row, experts, limit):
    rows = []
    for i, e in enumerate(expert_of_row):
        gate, up = w8a8_linear_reference(x[i:i + 1], experts.w13[e], experts.w13_scale[e],
                                         out_dtype=x.dtype).chunk(2, dim=-1)
        rows.append(w8a8_linear_reference(swiglu(gate, up, limit), experts.w2[e], experts.w2_scale[e],
                                          out_dtype=x.dtype))
    return torch.cat(rows) if rows else x.new_empty(0, x.shape[1])


COUNTS = [[0, 3, 0, 5, 1], [0, 9, 0, 0, 0], [0, 0, 0, 0, 0], [2, 2, 2, 2, 2], [1, 0, 1, 1, 0]]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("limit", [None, 0.05], ids=["swiglu", "v4-clamped"])
def test_grouped_w8a8_equals_per_token_loop(counts, limit):
    experts = _experts(len(counts), seed=7)
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    counts_t = torch.tensor(counts)
    out = grouped_mlp(x, counts_t, experts, limit=limit)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, grouped_mlp_reference(x, counts_t, experts, limit=limit))
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts_t).tolist()
    assert torch.equal(out, _per_token_w8a8(x, expert_of_row, experts, limit))


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("limit", [None, 0.05], ids=["swiglu", "v4-clamped"])
def test_grouped_w8a8_from_prequantized_rows_equals_per_expert_loop(counts, limit):
    """INT8 rows and per-token scales from a sender (the EP dispatch) give what each expert computes from the
    float rows with w8a8_linear: the sender's quantization is the projection's own."""
    experts = _experts(len(counts), seed=15)
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    x_q, x_scale = quantize_activations(x)
    out = grouped_mlp(x_q, counts, experts, x_scale=x_scale, out_dtype=torch.bfloat16, limit=limit)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    expected, start = [], 0
    for e, n in enumerate(counts):
        rows = x[start:start + n]
        gate_up = w8a8_linear(rows, experts.w13[e], experts.w13_scale[e], out_dtype=x.dtype)
        expected.append(w8a8_linear(swiglu(gate_up, limit=limit), experts.w2[e], experts.w2_scale[e],
                                    out_dtype=x.dtype))
        start += n
    assert torch.equal(out, torch.cat(expected))
    assert torch.equal(out, grouped_mlp(x, torch.tensor(counts), experts, limit=limit))  # quantized inside


@pytest.mark.parametrize("limit", [None, 0.5], ids=["swiglu", "v4-clamped"])
def test_grouped_float_experts_equal_per_token_loop(limit):
    experts = _experts(3, seed=9, int8=False)
    counts = torch.tensor([3, 0, 4])
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    out = grouped_mlp(x, counts, experts, limit=limit)
    assert torch.equal(out, grouped_mlp_reference(x, counts, experts, limit=limit))
    expert_of_row = [0, 0, 0, 2, 2, 2, 2]
    w1, w3 = experts.w13[:, :INTER], experts.w13[:, INTER:]  # gate rows, then up rows
    loop = torch.cat([F.linear(swiglu(F.linear(x[i:i + 1], w1[e]), F.linear(x[i:i + 1], w3[e]), limit), experts.w2[e])
                      for i, e in enumerate(expert_of_row)])
    assert torch.equal(out, loop)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "w8a8"])
@pytest.mark.parametrize("limit", [None, 0.05], ids=["swiglu", "v4-clamped"])
def test_token_mlp_equals_grouped_rows(int8, limit):
    """One token through its experts in any order: row j is what grouped_mlp gives expert_ids[j]'s copy of the
    row (under W8A8 from the token quantized once, as the sender quantizes it)."""
    experts = _experts(5, seed=18, int8=int8)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(19)).to(torch.bfloat16)
    expert_ids = [3, 0, 4]
    grouped = grouped_mlp(x.expand(5, -1), torch.ones(5, dtype=torch.long), experts, limit=limit)  # every expert
    if int8:
        x_q, x_scale = quantize_activations(x)
        out = token_mlp(x_q, expert_ids, experts, x_scale=x_scale, out_dtype=torch.bfloat16, limit=limit)
    else:
        out = token_mlp(x, expert_ids, experts, limit=limit)
    assert out.dtype == torch.bfloat16 and out.shape == (3, HIDDEN)
    assert torch.equal(out, grouped[expert_ids])
    with pytest.raises(ValueError, match="one token"):
        token_mlp(x.expand(2, -1), expert_ids, experts)


def test_swiglu_limit_equals_transformers_v4_gate():
    gate_up = 3 * torch.randn(5, 2 * INTER, generator=torch.Generator().manual_seed(10))
    v4_experts = SimpleNamespace(limit=1.5, act_fn=F.silu)
    expected = hf_v4.DeepseekV4Experts._apply_gate(v4_experts, gate_up)
    assert torch.equal(swiglu(gate_up, limit=1.5), expected)  # the merged [gate | up] form
    assert torch.equal(swiglu(*gate_up.chunk(2, dim=-1), limit=1.5), expected)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(swiglu(gate_up), F.silu(gate) * up)  # without a limit: plain SwiGLU


def test_grouped_rejects_bad_counts_weights_and_rows():
    experts = _experts(2, seed=11)
    x = torch.randn(4, HIDDEN)
    with pytest.raises(ValueError, match="sum to"):
        grouped_mlp(x, torch.tensor([1, 2]), experts)
    with pytest.raises(ValueError, match="expert counts"):
        grouped_mlp(x, torch.tensor([1, 1, 2]), experts)
    with pytest.raises(ValueError, match="out_dtype"):
        grouped_mlp(*quantize_activations(x)[:1], [2, 2], experts, x_scale=quantize_activations(x)[1])
    with pytest.raises(ValueError, match="need W8A8 experts"):
        grouped_mlp(x, [2, 2], _experts(2, seed=11, int8=False), x_scale=torch.ones(4, 1), out_dtype=x.dtype)
    with pytest.raises(ValueError, match="w2"):
        ExpertWeights(experts.w13, experts.w2[:, :, :-1], experts.w13_scale, experts.w2_scale)
    with pytest.raises(ValueError, match="need scales"):
        ExpertWeights(experts.w13, experts.w2, experts.w13_scale)


@pytest.mark.parametrize("k", [1, 3, 8, 20])
def test_topk_ties_go_to_the_lowest_index(k):
    """Against NumPy's stable argsort of the negated scores: many exact ties (relu's zeros, repeated values),
    -inf entries, and k above the row length."""
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    scores = torch.relu(torch.randn(6, 12, generator=gen)).round(decimals=1)  # about half the row at exactly 0
    scores[1] = 0.5  # one row of equal scores
    scores[2, 5:] = float("-inf")
    got = topk_lowest_index(scores, k)
    want = np.argsort(-scores.numpy(), kind="stable", axis=-1)[:, :min(k, scores.shape[-1])]
    assert got.tolist() == want.tolist()
    assert got[1].tolist() == list(range(min(k, 12)))
