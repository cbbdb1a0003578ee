"""The NPU path (kernels.device dispatch) against the torch_npu contract double (tests/npu_double.py) on CPU: every
call it makes must be one the real API documents as accepted, and its tokens must equal the CPU path's."""

import json
import sys
from contextlib import contextmanager

import pytest
import torch

import dsconv.comm.launch as launch_module
from dsconv.comm.launch import TORCHRUN_ENV, launch
from dsconv.errors import InputError
from dsconv.kernels.device import reset_npu_path
from dsconv.kernels.linear import quantize_activations, w8a8_linear
from dsconv.kernels.moe import grouped_mlp, token_mlp
from dsconv.runner.models.dist import Dist
from dsconv.runner.engine.worker import build_model
from dsconv.runner.engine.offline import greedy
from dsconv.runner.models.weights import load_manifest
from dsconv.family.layout import Layout
from tests.helpers import NEW_TOKENS, PROMPTS, quantized_weight, random_experts, run_ranks, shard
from tests.npu_double import CALLS_NAME, INT8_CACHE_NPU_OPS, SYNCS_NAME, ContractError, TorchNpuDouble, forbid_cpu_int8_path, install, keep_cpu_attention

HIDDEN, INTER = 48, 64


@pytest.fixture
def on_npu(monkeypatch):
    """`with on_npu() as double:` the double installed in this process (CPU tensors take the NPU branches), the
    CPU INT8 kernels refused and attention kept on its CPU branch (npu_double.keep_cpu_attention says why), all
    undone on leaving."""

    @contextmanager
    def installed():
        double = install()
        with monkeypatch.context() as patch:
            forbid_cpu_int8_path(patch.setattr)
            keep_cpu_attention(patch.setattr)
            try:
                yield double
            finally:
                reset_npu_path()

    return installed


def _experts(n_experts, seed, int8=True):
    return random_experts(n_experts, HIDDEN, INTER, seed, int8)


# --- the double refuses what the real API refuses ----------------------------------------------------------------
def test_double_is_not_torch_npu():
    double = TorchNpuDouble()
    assert "not torch_npu" in double.__name__ and "torch_npu" not in sys.modules


def test_double_rejects_an_empty_x1():
    double, gen = TorchNpuDouble(), torch.Generator().manual_seed(0)
    w, s = quantized_weight(8, 16, gen)
    with pytest.raises(ContractError, match="must not be empty"):
        double.npu_quant_matmul(torch.empty(0, 16, dtype=torch.int8), w.T, s.view(-1),
                                pertoken_scale=torch.empty(0), output_dtype=torch.bfloat16)


def test_double_rejects_float32_quantize_input_and_float32_output():
    double, gen = TorchNpuDouble(), torch.Generator().manual_seed(0)
    with pytest.raises(ContractError, match="float16 or bfloat16"):
        double.npu_dynamic_quant(torch.randn(2, 16))
    w, s = quantized_weight(8, 16, gen)
    x_q, x_scale = double.npu_dynamic_quant(torch.randn(2, 16).to(torch.bfloat16))
    with pytest.raises(ContractError, match="output_dtype"):
        double.npu_quant_matmul(x_q, w.T, s.view(-1), pertoken_scale=x_scale, output_dtype=torch.float32)
    with pytest.raises(TypeError):  # pertoken_scale is keyword-only in the schema
        double.npu_quant_matmul(x_q, w.T, s.view(-1), None, x_scale)


def test_double_rejects_wrong_group_list_type_and_form():
    double, experts = TorchNpuDouble(), _experts(2, seed=1)
    x_q = torch.ones(5, HIDDEN, dtype=torch.int8)
    call = dict(split_item=2, group_type=0, output_dtype=torch.int32)
    weight = [experts.w13.transpose(1, 2)]
    with pytest.raises(ContractError, match="group_list is a list"):
        double.npu_grouped_matmul([x_q], weight, group_list=[2, 5], group_list_type=0, **call)
    with pytest.raises(ContractError, match="int64"):
        double.npu_grouped_matmul([x_q], weight, group_list=torch.tensor([2, 5], dtype=torch.int32), **call)
    with pytest.raises(ContractError, match="non-decreasing cumulative"):
        double.npu_grouped_matmul([x_q], weight, group_list=torch.tensor([2, 3]), group_list_type=0, **call)
    one = _experts(1, seed=1)
    with pytest.raises(ContractError, match="one-entry"):
        double.npu_grouped_matmul([x_q], [one.w13.transpose(1, 2)], group_list=torch.tensor([5]), group_list_type=1,
                                  **call)
    (y,) = double.npu_grouped_matmul([x_q], weight, group_list=torch.tensor([2, 5]), group_list_type=0, **call)
    assert y.dtype == torch.int32 and y.shape == (5, 2 * INTER)


# --- kernels through the NPU branch ------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_w8a8_linear_npu_branch_equals_cpu_path(rows, on_npu):
    gen = torch.Generator().manual_seed(rows)
    w, s = quantized_weight(24, 40, gen)
    x = torch.randn(rows, 40, generator=gen).to(torch.bfloat16)
    want = w8a8_linear(x, w, s, out_dtype=torch.bfloat16)
    with on_npu() as double:
        got = w8a8_linear(x, w, s, out_dtype=torch.bfloat16)
    assert torch.equal(got, want) and got.shape == (rows, 24)
    # zero rows: an empty result without a kernel call
    assert double.calls["npu_quant_matmul"] == double.calls["npu_dynamic_quant"] == (1 if rows else 0)


def test_float32_takes_the_bfloat16_route(on_npu):
    """--dtype float32 on NPU: quantized from BF16, produced in BF16 and widened (the double refuses float32)."""
    gen = torch.Generator().manual_seed(3)
    w, s = quantized_weight(24, 40, gen)
    x = torch.randn(5, 40, generator=gen)
    want = w8a8_linear(x.to(torch.bfloat16), w, s, out_dtype=torch.bfloat16).float()
    with on_npu():
        got = w8a8_linear(x, w, s, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("counts", [[0], [3], [2, 0, 3, 1], [0, 0, 0, 0]])
@pytest.mark.parametrize("prequantized", [False, True])
def test_grouped_mlp_one_grouped_call_per_projection(counts, prequantized, on_npu):
    experts = _experts(len(counts), seed=len(counts))
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out_dtype = torch.bfloat16 if prequantized else None
    x_q, x_scale = quantize_activations(x) if prequantized else (x, None)
    want = grouped_mlp(x_q, torch.tensor(counts), experts, x_scale, out_dtype, limit=7.0)
    with on_npu() as double:
        x_q, x_scale = quantize_activations(x) if prequantized else (x, None)
        got = grouped_mlp(x_q, torch.tensor(counts), experts, x_scale, out_dtype, limit=7.0)
    assert torch.equal(got, want)
    assert double.calls["npu_grouped_matmul"] == (2 if sum(counts) else 0)  # gate_up and down, all experts


def test_grouped_float_experts_and_token_mlp(on_npu):
    experts, int8_experts = _experts(3, seed=9, int8=False), _experts(3, seed=9)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    want, want_token = grouped_mlp(x, [1, 0, 3], experts), token_mlp(x[:1], [2, 0], int8_experts)
    with on_npu() as double:
        got, token = grouped_mlp(x, [1, 0, 3], experts), token_mlp(x[:1], [2, 0], int8_experts)
    assert torch.equal(got, want) and torch.equal(token, want_token)
    assert double.calls["npu_grouped_matmul"] == 4


# --- whole models ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_world_1_w8a8_npu_path_gives_the_cpu_tokens(family, w8a8_source, tmp_path, on_npu, monkeypatch):
    shards = tmp_path / "w1"
    shard(w8a8_source(family), shards, Layout(1, 1, 1, 1))
    manifest = load_manifest(shards)
    model, _, new_cache = build_model(shards, manifest, 0, Dist(), torch.bfloat16)
    want = greedy(model, new_cache(256), PROMPTS, NEW_TOKENS, eos_id=None)
    model32, _, new_cache32 = build_model(shards, manifest, 0, Dist(), torch.float32)
    with on_npu() as double:
        got = greedy(model, new_cache(256), PROMPTS, NEW_TOKENS, eos_id=None)
        # --dtype float32 on NPU runs through the BF16 route (the double refuses float32 INT8 inputs)
        tokens32, logits32 = greedy_logits(model32, new_cache32(256))
    with monkeypatch.context() as patch:
        bfloat16_route_on_cpu(patch.setattr)
        want32, want_logits32 = greedy_logits(model32, new_cache32(256))
    assert got == want
    assert tokens32 == want32
    # Float projections of 2 to 16 rows (kernels.linear.linear_t) and a lone decode token's expert sum
    # (runner.moe.expert_parallel) take other GEMM forms on the NPU branches, so their sums round otherwise: the
    # logits agree to float32 rounding (1.4e-6 at most, measured), where the plain float32 CPU path's are 3e-2 or
    # more away from the first step on.
    for step, (got_step, want_step) in enumerate(zip(logits32, want_logits32, strict=True)):
        torch.testing.assert_close(got_step, want_step, rtol=0, atol=1e-5, msg=lambda m: f"step {step}: {m}")
    assert double.calls["npu_quant_matmul"] > 0 and double.calls["npu_grouped_matmul"] > 0


def test_int8_kv_cache_through_the_double(w8a8_source, tmp_path, on_npu):
    """--kv-cache-dtype int8 on the NPU branches: entries and indexer queries quantized by npu_dynamic_quant (BF16
    in, as documented), the rest device-generic torch ops; BF16 compute, so what it quantizes is what the CPU path
    quantizes, and the tokens are the CPU path's."""
    shards = tmp_path / "w1"
    shard(w8a8_source("deepseek_v32"), shards, Layout(1, 1, 1, 1))
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.bfloat16)
    want = greedy(model, new_cache(256, "int8"), PROMPTS, NEW_TOKENS, eos_id=None)
    with on_npu() as double:
        baseline = dict(double.calls)
        got = greedy(model, new_cache(256, "int8"), PROMPTS, NEW_TOKENS, eos_id=None)
    assert got == want
    assert double.calls["npu_dynamic_quant"] > baseline.get("npu_dynamic_quant", 0)
    assert set(INT8_CACHE_NPU_OPS) >= {"store", "dequantize", "A8C8 indexer", "C8 attention"}


def greedy_logits(model, cache):
    """greedy's tokens for PROMPTS, and the logits of each of its steps."""
    steps = []
    forward = model.forward

    def recorded(*args, **kwargs):
        logits = forward(*args, **kwargs)
        steps.append(logits.clone())
        return logits

    model.forward = recorded
    try:
        return greedy(model, cache, PROMPTS, NEW_TOKENS, eos_id=None), steps
    finally:
        del model.forward


def bfloat16_route_on_cpu(set_attribute) -> None:
    """The CPU path computing what kernels.linear promises for float32 on NPU: W8A8 activations quantized from
    BF16, W8A8 projections' products returned in BF16 and widened; the grouped experts' int32 sums are
    dequantized in float32 as on the CPU (kernels.moe). set_attribute: e.g. monkeypatch.setattr."""
    import dsconv.kernels.moe as kernels_moe
    import dsconv.runner.models.layers as layers
    import dsconv.runner.models.moe as runner_moe

    bf16 = torch.bfloat16
    project, project_quantized = layers.w8a8_linear, layers.w8a8_linear_quantized
    set_attribute(layers, "w8a8_linear",
                  lambda x, w, s, out_dtype: project(x.to(bf16), w, s, out_dtype=bf16).to(out_dtype))
    set_attribute(layers, "w8a8_linear_quantized",
                  lambda x_q, x_scale, w, s, out_dtype: project_quantized(x_q, x_scale, w, s, bf16).to(out_dtype))
    for module in (kernels_moe, runner_moe):
        set_attribute(module, "quantize_activations",
                      lambda x, quantize=module.quantize_activations: quantize(x.to(bf16)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_world_16_idle_dp_ranks_npu_path_gives_the_cpu_tokens(family, w8a8_source, tmp_path):
    """One prompt on DP16 / EP16: 15 ranks have no rows in every step, yet enter every collective and expert
    group. Every rank runs the double with the CPU INT8 kernels refused."""
    shards = tmp_path / "w16"
    shard(w8a8_source(family), shards, Layout(16, 16, 16, 1))
    prompts = [PROMPTS[1]]
    want = run_ranks(shards, tmp_path, prompts, dtype="bfloat16")
    got = run_ranks(shards, tmp_path, prompts, dtype="bfloat16", entry="tests.npu_double:rank_main",
                    results_name="npu")
    assert got == want
    calls = [json.loads((tmp_path / "npu" / CALLS_NAME.format(rank=rank)).read_text()) for rank in range(16)]
    assert calls[0]["npu_quant_matmul"] > 0  # the one rank with a sequence runs its INT8 projections there
    assert all(c.get("npu_quant_matmul", 0) == 0 for c in calls[1:])  # idle ranks: no call on zero rows
    assert sum(c.get("npu_grouped_matmul", 0) for c in calls) > 0  # expert owners ran their groups there
    # host syncs in each decode step (every step after the prefill), per rank: 2 per MoE layer (the EP all-to-all
    # takes its split sizes as lists: the sent counts, and the received ones from the count exchange), 1 for
    # lm_head TP (the most rows any rank holds), and on the rank that samples 1 for the drawn tokens
    config = load_manifest(shards)["model"]["config"]
    moe_layers = config["num_hidden_layers"] - config.get("first_k_dense_replace", 0)  # V4: every layer
    for rank in range(16):
        steps = json.loads((tmp_path / "npu" / SYNCS_NAME.format(rank=rank)).read_text())
        decode = [sum(step.values()) for step in steps[1:]]
        assert decode == [2 * moe_layers + 1 + (rank == 0)] * (NEW_TOKENS - 1), (rank, steps)


@pytest.mark.slow
def test_attention_tp_shares_reach_the_quantizer_without_padding_rows(w8a8_source, tmp_path):
    """V3.2 at attention DP2 x TP8: the 8 ranks of a group each route a share of the group's rows through the
    MoE. A share padded with zero rows would reach npu_dynamic_quant, whose documented formula divides 0 by 0
    for an all-zero row (the double refuses it): the shares are unpadded, and the tokens are the CPU path's."""
    shards = tmp_path / "dp2tp8"
    shard(w8a8_source("deepseek_v32"), shards, Layout(16, 16, 16, 8))
    prompts = [PROMPTS[1], PROMPTS[2]]  # 37 and 20 rows: shares of 5 and 3, the last ones shorter or empty
    want = run_ranks(shards, tmp_path, prompts, dtype="bfloat16")
    got = run_ranks(shards, tmp_path, prompts, dtype="bfloat16", entry="tests.npu_double:rank_main",
                    results_name="npu")
    assert got == want


def test_local_launch_refuses_more_ranks_than_devices(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_npu", TorchNpuDouble())  # backend_for imports it
    monkeypatch.setattr(launch_module, "visible_devices", lambda device: 8)
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InputError) as error:
        launch("tests.npu_double:rank_main", {}, world_size=16, device="npu", timeout_s=5, log_dir=tmp_path)
    message = str(error.value)
    assert "torchrun" in message and "16 ranks" in message and "sees 8" in message and "\n" not in message
