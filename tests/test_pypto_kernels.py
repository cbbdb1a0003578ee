"""PyPTO kernels (kernels/pypto/) through PyPTO 0.2.0's pass-verify interpreter on the host, against the torch path:
float32 within 1e-5 at the tiny and the real hidden size (V3.2's and V4-Flash's 7168), BF16 within its rounding;
a deliberately wrong variant of each kernel fails; the host shim refuses a PyPTO without its private pieces and
turns a verify result other than PASS into an error."""

import pytest
import torch
import torch.nn.functional as F

from dsconv.errors import InputError
from dsconv.kernels.norm import WEIGHT_IN_FLOAT32, rms_norm
from dsconv.kernels.pypto import host
from dsconv.kernels.pypto.moe_gate import v3_gate, v4_gate
from dsconv.kernels.pypto.rms_norm import add_rms_norm

pytestmark = pytest.mark.usefixtures("pypto_deferred_checks")

EPS = 1e-6
FLOAT32_TOLERANCE = 1e-5
BF16_HALF_ULP = 2 ** -8  # relative: one rounding of the output to BF16 (8 bits of mantissa), the torch path's too


def inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen).to(dtype) for shape in ((tokens, hidden), (tokens, hidden), (hidden,))]


@pytest.mark.parametrize("tokens,hidden", [(4, 64), (2, 7168)], ids=["tiny", "real-hidden"])
def test_add_rms_norm_float32_equals_the_torch_path(tokens, hidden):
    x, residual, weight = inputs(tokens, hidden, torch.float32)
    out, summed = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, x + residual)
    expected = rms_norm(x + residual, weight, EPS, WEIGHT_IN_FLOAT32)
    assert (out - expected).abs().max().item() <= FLOAT32_TOLERANCE


def test_add_rms_norm_bf16_within_its_rounding():
    x, residual, weight = inputs(4, 64, torch.bfloat16)
    out, summed = add_rms_norm(x, residual, weight, EPS)
    expected = rms_norm((x.float() + residual.float()), weight.float(), EPS, WEIGHT_IN_FLOAT32)
    # the sum and the output each rounded once to BF16
    assert torch.allclose(summed.float(), x.float() + residual.float(), rtol=BF16_HALF_ULP, atol=0)
    assert torch.allclose(out.float(), expected, rtol=2 * BF16_HALF_ULP, atol=1e-6)


@pytest.mark.parametrize("wrong", ["no_scale", "shifted"])
def test_a_wrong_rms_norm_fails(wrong):
    """The 1 / rms scale left out, or each row scaled by the next row's: far outside the tolerance."""
    x, residual, weight = inputs(4, 64, torch.float32)
    out, _ = add_rms_norm(x, residual, weight, EPS, wrong)
    assert (out - rms_norm(x + residual, weight, EPS, WEIGHT_IN_FLOAT32)).abs().max().item() > 0.1


def test_the_shim_names_missing_private_pieces(monkeypatch):
    import pypto.runtime

    monkeypatch.delattr(pypto.runtime, "_pto_to_tensor_data")
    with pytest.raises(InputError, match=r"lacks what kernels/pypto/host.py relies on: pypto.runtime._pto_to_tensor_data"):
        host.check()


def test_a_verify_result_other_than_pass_is_an_error():
    """Every verified pass has a PASS row; a FAILED row, or a pass with no row (its replay failed), raises."""
    passed = [{"passName": f"Pass_{i:02d}_{name}", "verifyResult": "PASS", "maxAbsDiff": "0.000000"}
              for i, name in enumerate(host.VERIFY_OPTIONS["pass_verify_pass_filter"])]
    host.check_results("k", passed)
    with pytest.raises(RuntimeError, match=r"k: PyPTO's pass verification failed: Pass_14_SplitK \(FAILED"):
        host.check_results("k", [*passed, {**passed[0], "passName": "Pass_14_SplitK", "verifyResult": "FAILED"}])
    with pytest.raises(RuntimeError, match=r"failed: InferDynShape \(no result: its replay failed\)"):
        host.check_results("k", [{**passed[0], "passName": "Pass_04_ExpandFunction"}])
    with pytest.raises(RuntimeError, match="wrote no verify results"):
        host.check_results("k", [])


def v3_reference(x, router, bias, groups, topk_group, k, scale):
    """runner/models/deepseek_v3.py's route, on these tensors (its configuration's norm_topk_prob true)."""
    scores = F.linear(x.float(), router).sigmoid()
    grouped = (scores + bias).view(-1, groups, router.shape[0] // groups)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)
    dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(topk_group, -1).indices,
                                                                      False)
    experts = grouped.masked_fill(dropped[..., None], float("-inf")).view(x.shape[0], -1).topk(k, dim=-1).indices
    weights = scores.gather(1, experts)
    return experts, weights / (weights.sum(-1, keepdim=True) + 1e-20) * scale


def v4_reference(x, router, bias, k, scale, tid2eid=None, tokens=None):
    """runner/models/deepseek_v4.py's route (sqrt-softplus scores), on these tensors."""
    scores = F.softplus(F.linear(x.float(), router.float())).sqrt()
    experts = tid2eid[tokens] if tid2eid is not None else (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(1, experts)
    return experts, weights / (weights.sum(-1, keepdim=True) + 1e-20) * scale


def gate_inputs(tokens, hidden, experts, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen), torch.randn(experts, hidden, generator=gen) / hidden ** 0.5,
            torch.randn(experts, generator=gen) / 4)


# (tokens, hidden, experts, groups, topk_group, k): the tiny V3.2 fixture's, and V3.2's real gate (7168, 256 experts
# in 8 groups, 4 of them, top-8)
V3_SHAPES = {"tiny": (4, 64, 16, 4, 2, 4), "real": (4, 7168, 256, 8, 4, 8)}
# (tokens, hidden, experts, k): tiny, and V4-Flash's real gate (4096, 256 experts, top-6)
V4_SHAPES = {"tiny": (4, 64, 16, 2), "real": (4, 4096, 256, 6)}


@pytest.mark.parametrize("shape", list(V3_SHAPES))
def test_v3_gate_equals_the_torch_path(shape):
    tokens, hidden, experts, groups, topk_group, k = V3_SHAPES[shape]
    x, router, bias = gate_inputs(tokens, hidden, experts)
    chosen, weights = v3_gate(x, router, bias, groups, topk_group, k, True, 2.5)
    expected, expected_weights = v3_reference(x, router, bias, groups, topk_group, k, 2.5)
    assert torch.equal(chosen, expected)  # random scores: no ties
    assert (weights - expected_weights).abs().max().item() <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("shape", list(V4_SHAPES))
def test_v4_gate_and_its_hash_layers_equal_the_torch_path(shape):
    tokens, hidden, experts, k = V4_SHAPES[shape]
    x, router, bias = gate_inputs(tokens, hidden, experts)
    chosen, weights = v4_gate(x, router, bias, k, 1.5)
    expected, expected_weights = v4_reference(x, router, bias, k, 1.5)
    assert torch.equal(chosen, expected)
    assert (weights - expected_weights).abs().max().item() <= FLOAT32_TOLERANCE
    gen = torch.Generator().manual_seed(2)
    tid2eid = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(32)])  # [vocab 32, k]
    token_ids = torch.tensor([3, 31, 0, 3][:tokens])
    chosen, weights = v4_gate(x, router, None, k, 1.5, tid2eid, token_ids)
    expected, expected_weights = v4_reference(x, router, None, k, 1.5, tid2eid, token_ids)
    assert torch.equal(chosen, expected)
    assert (weights - expected_weights).abs().max().item() <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("wrong", ["shifted", "no_scale"])
def test_a_wrong_gate_fails(wrong):
    """Each chosen expert shifted by one, or the weights left unnormalized: the comparison above fails."""
    tokens, hidden, experts, groups, topk_group, k = V3_SHAPES["tiny"]
    x, router, bias = gate_inputs(tokens, hidden, experts)
    chosen, weights = v3_gate(x, router, bias, groups, topk_group, k, True, 2.5, wrong)
    expected, expected_weights = v3_reference(x, router, bias, groups, topk_group, k, 2.5)
    assert not torch.equal(chosen, expected) or (weights - expected_weights).abs().max().item() > 0.1
    chosen, weights = v4_gate(x, router, bias, 2, 1.5, wrong=wrong)
    expected, expected_weights = v4_reference(x, router, bias, 2, 1.5)
    assert not torch.equal(chosen, expected) or (weights - expected_weights).abs().max().item() > 0.1
