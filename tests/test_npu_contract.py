"""The NPU path (kernels.device dispatch) against the torch_npu contract double (tests/npu_double.py) on CPU: every
call it makes must be one the real API documents as accepted, and its tokens must equal the CPU path's."""

import inspect
import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import dsconv.comm.launch as launch_module
from dsconv.comm.forkserver import TORCHRUN_ENV
from dsconv.comm.launch import launch
from dsconv.errors import InputError
from dsconv.kernels.device import reset_npu_path
from dsconv.kernels.streams import STREAM_API, SideStream
from dsconv.kernels.linear import quantize_activations, w8a8_linear
from dsconv.kernels.moe import ACL_FORMAT_FRACTAL_NZ, ExpertWeights, grouped_mlp, token_mlp
from dsconv.runner.models import mc2
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.registry import build_model
from dsconv.shard.shard import ExpertRequest
from tests.helpers import greedy
from dsconv.runner.models.weights import load_manifest
from dsconv.family.layout import Layout
from tests.helpers import NEW_TOKENS, PROMPTS, expert_scales_to_bf16, quantized_weight, run_ranks, shard
from tests.npu_double import (CALLS_NAME, generate_on_double, INT8_CACHE_NPU_OPS, MODELLED, SYNCS_NAME, ZEROS_NAME, ContractError, TorchNpuDouble,
                              forbid_cpu_int8_path, install, keep_cpu_attention)
from tests.npu_schemas import TORCH_NPU_VERSION, SchemasUnavailable, registered, stream_api

PACKAGE = Path(__file__).resolve().parent.parent

HIDDEN, INTER = 48, 64
DISPATCH_V2 = "npu_moe_distribute_dispatch_v2"


@pytest.fixture(autouse=True, scope="module")
def torch_npu_schemas():
    """The double binds every call against torch_npu's own schemas, fetched from its wheel once into the dsconv
    cache: without them there is nothing to check against, and the module says so in one line."""
    try:
        return registered()
    except SchemasUnavailable as e:
        pytest.skip(f"torch_npu {TORCH_NPU_VERSION}'s schemas are unavailable: {e}")


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


def _expert_tensors(n_experts, seed, int8=True):
    """Stacked random experts' (w13, w2[, w13_scale, w2_scale]): BF16, or INT8 with channel scales that BF16
    holds exactly, so the NPU form's BF16 scales (kernels.moe.NpuExperts) are the CPU path's values."""
    gen = torch.Generator().manual_seed(seed)
    if not int8:
        return (torch.randn(n_experts, 2 * INTER, HIDDEN, generator=gen).to(torch.bfloat16),
                torch.randn(n_experts, HIDDEN, INTER, generator=gen).to(torch.bfloat16))
    w13, s13 = zip(*(quantized_weight(2 * INTER, HIDDEN, gen) for _ in range(n_experts)))
    w2, s2 = zip(*(quantized_weight(HIDDEN, INTER, gen) for _ in range(n_experts)))
    return torch.stack(w13), torch.stack(w2), bf16_exact(torch.stack(s13)), bf16_exact(torch.stack(s2))


def bf16_exact(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.bfloat16).to(torch.float32)


def _experts(n_experts, seed, int8=True):
    """ExpertWeights built where they are called: on the CPU path, or, inside on_npu, in the device's form."""
    return ExpertWeights(*_expert_tensors(n_experts, seed, int8))


@pytest.fixture(scope="module")
def npu_source(w8a8_source, tmp_path_factory):
    """npu_source(family): the family's W8A8 checkpoint with its routed experts' channel scales rounded to values
    BF16 holds exactly. The NPU form takes those scales in BF16 (kernels.moe.NpuExperts), the CPU path in
    float32: with these values both compute the same numbers, so their tokens compare exactly."""
    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            built[family] = tmp_path_factory.mktemp(f"{family}-npu") / "w8a8"
            expert_scales_to_bf16(w8a8_source(family), built[family])
        return built[family]

    return build


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
    with pytest.raises(RuntimeError, match="takes 3 positional"):  # pertoken_scale is keyword-only in the schema
        double.npu_quant_matmul(x_q, w.T, s.view(-1), None, x_scale)


def test_double_rejects_wrong_group_list_type_and_form():
    double = TorchNpuDouble()
    w13 = _expert_tensors(2, seed=1)[0]  # [2, 2I, H]
    x_q, x_scale = double.npu_dynamic_quant(torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
                                            .to(torch.bfloat16))
    nz = double.npu_format_cast(w13.transpose(1, 2).contiguous(), ACL_FORMAT_FRACTAL_NZ)  # [2, H, 2I]
    scale = torch.ones(2, 2 * INTER, dtype=torch.bfloat16)
    call = dict(split_item=2, group_type=0, scale=[scale], per_token_scale=[x_scale], output_dtype=torch.bfloat16)
    with pytest.raises(ContractError, match="list of ints"):
        double.npu_grouped_matmul([x_q], [nz], group_list=[2, 5], group_list_type=0, **call)
    with pytest.raises(ContractError, match="int64"):
        double.npu_grouped_matmul([x_q], [nz], group_list=torch.tensor([2, 5], dtype=torch.int32), **call)
    with pytest.raises(ContractError, match="non-decreasing cumulative"):
        double.npu_grouped_matmul([x_q], [nz], group_list=torch.tensor([2, 3]), group_list_type=0, **call)
    with pytest.raises(ContractError, match="FRACTAL_NZ"):  # ND, or a view of the NZ tensor
        double.npu_grouped_matmul([x_q], [w13.transpose(1, 2).contiguous()], group_list=torch.tensor([2, 5]), **call)
    with pytest.raises(ContractError, match="FRACTAL_NZ"):
        double.npu_grouped_matmul([x_q], [nz[:, :, :]], group_list=torch.tensor([2, 5]), **call)
    with pytest.raises(ContractError, match="scale must be torch.bfloat16"):  # float32 scales give float16 out
        double.npu_grouped_matmul([x_q], [nz], group_list=torch.tensor([2, 5]),
                                  **{**call, "scale": [scale.float()]})
    with pytest.raises(ContractError, match="per-token form"):  # int32 out: listed only under tuning_config
        double.npu_grouped_matmul([x_q], [nz], group_list=torch.tensor([2, 5]), split_item=2, group_type=0,
                                  output_dtype=torch.int32)
    one = double.npu_format_cast(w13[:1].transpose(1, 2).contiguous(), ACL_FORMAT_FRACTAL_NZ)
    with pytest.raises(ContractError, match="one-entry"):
        double.npu_grouped_matmul([x_q], [one], group_list=torch.tensor([5]), group_list_type=1,
                                  **{**call, "scale": [scale[:1]]})
    (y,) = double.npu_grouped_matmul([x_q], [nz], group_list=torch.tensor([2, 5]), group_list_type=0, **call)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 2 * INTER)


def test_double_refuses_an_all_zero_row_and_an_empty_or_strided_x():
    double = TorchNpuDouble()
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with pytest.raises(ContractError, match="all-zero row"):
        double.npu_dynamic_quant(torch.cat([x, torch.zeros(1, HIDDEN, dtype=torch.bfloat16)]))
    with pytest.raises(ContractError, match="empty"):
        double.npu_dynamic_quant(x[:0])
    with pytest.raises(ContractError, match="contiguous"):
        double.npu_dynamic_quant(x[:1].expand(4, -1))
    q, scale = double.npu_dynamic_quant(x)
    want_q, want_scale = quantize_activations(x)  # the CPU path's formula: the same values where no row is zero
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale.view(-1))


# --- torch_npu's own schemas -------------------------------------------------------------------------------------
def torch_npu_calls() -> set[str]:
    """Every torch_npu op the package's code calls, read from its source: `torch_npu.<op>(` where a module bound
    the name torch_npu, and `require_torch_npu().<op>(`."""
    calls = set()
    for path in PACKAGE.glob("*/**/*.py"):
        if path.parts[len(PACKAGE.parts)] in ("tests", "scripts", ".venv") or ".venv" in path.parts:
            continue
        calls |= set(re.findall(r"(?:\btorch_npu|require_torch_npu\(\))\.(npu_\w+)\(", path.read_text()))
    return calls


def test_every_torch_npu_call_binds_to_the_real_schema(torch_npu_schemas):
    schemas = torch_npu_schemas
    assert len(schemas.defined) > 1400  # the schema file's entries that CPU torch defines (1,453 of 1,488)
    called = torch_npu_calls()
    assert {"npu_dynamic_quant", "npu_quant_matmul", "npu_grouped_matmul", "npu_format_cast"} <= called
    assert called <= set(schemas.defined), called - set(schemas.defined)
    assert called <= set(MODELLED)  # each one runs through a modelled kernel in the tests below
    # the double's kernels take exactly the schema's arguments, keyword-only where the schema says so
    for name, kernel in MODELLED.items():
        schema = torch._C.parse_schema(f"npu::{schemas.schema(name)}")
        params = inspect.signature(kernel).parameters
        if name.endswith(".List"):
            continue  # a refusal taking whatever the overload binds
        assert [a.name for a in schema.arguments] == list(params), name
        assert [a.kwarg_only for a in schema.arguments] == [
            p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values()], name


def test_named_device_ops_use_the_real_argument_names(torch_npu_schemas):
    """The torch_npu ops INT8_CACHE_NPU_OPS names for the INT8 caches (not called by the runner) exist in torch_npu
    2.14.0 with the arguments written there: positional ones in the schema's order, keyword ones keyword-only."""
    for step, (signature, _) in INT8_CACHE_NPU_OPS.items():
        name, args = re.fullmatch(r"(\w+)\((.*)\)", signature).groups()
        schema = torch._C.parse_schema(f"npu::{torch_npu_schemas.schema(name)}")
        real = {a.name: a for a in schema.arguments}
        written = [a.strip().split("=")[0] for a in args.split(",")]
        star = written.index("*") if "*" in written else len(written)
        positional, keywords = written[:star], [a for a in written[star + 1:] if a != "..."]
        assert positional == [a.name for a in schema.arguments[:len(positional)]], (step, positional)
        assert all(a in real and real[a].kwarg_only for a in keywords), (step, keywords)


def _double_stream_api() -> dict:
    """The double's stream calls by STREAM_SOURCES' names: a class as its constructor, a method unbound."""
    npu = TorchNpuDouble().npu
    return {"Stream": npu.Stream, "Stream.wait_event": npu.Stream.wait_event, "Event": npu.Event,
            "Event.record": npu.Event.record, "current_stream": npu.current_stream, "stream": npu.stream}


def _unbound(signature: inspect.Signature, method: bool) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter, without a method's self."""
    params = list(signature.parameters.values())[1 if method else 0:]
    return [(p.name, p.kind, p.default) for p in params]


def test_stream_calls_match_torch_npu_and_torch_cuda():
    """kernels.streams calls the same names on torch_npu.npu and torch.cuda. The double's Stream, Event,
    current_stream and stream take exactly the parameters of torch_npu 2.14.0's (read from its wheel's source), and
    torch.cuda's take those too, in the same order (CUDA's Event has one more, `external`, after them): a call the
    helper makes that binds on the double binds on both."""
    try:
        real = stream_api()
    except SchemasUnavailable as e:
        pytest.skip(f"torch_npu {TORCH_NPU_VERSION}'s stream sources are unavailable: {e}")
    assert set(real) == {f"{owner}.{name}" if owner != "module" else name
                         for owner, names in STREAM_API.items() for name in names}
    double = _double_stream_api()
    cuda = {"Stream": torch.cuda.Stream.__new__, "Stream.wait_event": torch.cuda.Stream.wait_event,
            "Event": torch.cuda.Event.__new__, "Event.record": torch.cuda.Event.record,
            "current_stream": torch.cuda.current_stream, "stream": torch.cuda.stream}
    for name, signature in real.items():
        ours = _unbound(inspect.signature(double[name]), method="." in name and not isinstance(double[name], type))
        ours = [(n, k, d) for n, k, d in ours]
        assert ours == _unbound(signature, method=False), name
        theirs = _unbound(inspect.signature(cuda[name]), method=name in ("Stream", "Event") or "." in name)
        assert [(n, k) for n, k, _ in theirs[:len(ours)]] == [(n, k) for n, k, _ in ours], (name, theirs)
        assert [d for _, _, d in theirs[:len(ours)]] == [d for _, _, d in ours], (name, theirs)


def test_side_stream_orders_its_work_through_events():
    """On the double's NPU path: a second stream made once, each block after an event of the main stream, its ops
    queued there, and the join waits for the block's own event; on CPU the block runs in order."""
    double = install()
    try:
        side = SideStream(torch.device("cpu"))
        assert side.parallel
        with side.beside():
            double.npu_dynamic_quant(torch.ones(2, 4, dtype=torch.bfloat16))
        side.join()
        side.join()  # nothing left to wait for
        assert (side.uses, side.joins) == (1, 1)
        calls = double.calls
        assert calls["npu.Stream"] == 1 and calls["npu.Event.record"] == 2 and calls["npu.Stream.wait_event"] == 2
        assert calls["npu_dynamic_quant on a second stream"] == 1
        with pytest.raises(ContractError, match="never recorded"):
            side.stream.wait_event(double.npu.Event())
    finally:
        reset_npu_path()
    cpu = SideStream(torch.device("cpu"))
    ran = []
    with cpu.beside():
        ran.append(1)
    cpu.join()
    assert not cpu.parallel and ran == [1] and (cpu.uses, cpu.joins) == (0, 0)


def test_the_dispatcher_binds_calls_against_the_schema():
    double = TorchNpuDouble()
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="missing value for argument 'input'"):  # the schema names it `input`
        double.npu_dynamic_quant(x=x)
    x_q, x_scale = double.npu_dynamic_quant(x)
    w, s = quantized_weight(8, HIDDEN, torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match="takes 3 positional"):  # pertoken_scale is keyword-only
        double.npu_quant_matmul(x_q, w.T, s.view(-1), None, x_scale)
    with pytest.raises(AttributeError, match="has no op"):
        double.npu_grouped_matmul_v9
    with pytest.raises(NotImplementedError, match="does not model torch_npu.npu_swiglu"):
        double.npu_swiglu(x)  # a real op, bound, but not modelled


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
        experts = _experts(len(counts), seed=len(counts))  # cast to FRACTAL_NZ with BF16 scales
        x_q, x_scale = quantize_activations(x) if prequantized else (x, None)
        got = grouped_mlp(x_q, torch.tensor(counts), experts, x_scale, out_dtype, limit=7.0)
    assert torch.equal(got, want)
    assert double.calls["npu_format_cast"] == 2  # w13 and w2, once at load
    assert double.calls["npu_grouped_matmul"] == (2 if sum(counts) else 0)  # gate_up and down, all experts


def test_grouped_float_experts_and_token_mlp(on_npu):
    experts, int8_experts = _experts(3, seed=9, int8=False), _experts(3, seed=9)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    want, want_token = grouped_mlp(x, [1, 0, 3], experts), token_mlp(x[:1], [2, 0], int8_experts)
    with on_npu() as double:
        int8_experts = _experts(3, seed=9)
        got, token = grouped_mlp(x, [1, 0, 3], experts), token_mlp(x[:1], [2, 0], int8_experts)
    assert torch.equal(got, want) and torch.equal(token, want_token)
    assert double.calls["npu_grouped_matmul"] == 4


# --- whole models ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_world_1_w8a8_npu_path_gives_the_cpu_tokens(family, npu_source, tmp_path, on_npu, monkeypatch):
    shards = tmp_path / "w1"
    shard(npu_source(family), shards, Layout(1, 1, 1, 1))
    manifest = load_manifest(shards)
    model, _, new_cache = build_model(shards, manifest, 0, Dist(), torch.bfloat16)
    want = greedy(model, new_cache(256), PROMPTS, NEW_TOKENS, eos_id=None)
    model32, _, new_cache32 = build_model(shards, manifest, 0, Dist(), torch.float32)
    with monkeypatch.context() as patch:
        bfloat16_route_on_cpu(patch.setattr)
        want32, want_logits32 = greedy_logits(model32, new_cache32(256))
    with on_npu() as double:  # models loaded with the double installed: experts in the device's form
        model, _, new_cache = build_model(shards, manifest, 0, Dist(), torch.bfloat16)
        got = greedy(model, new_cache(256), PROMPTS, NEW_TOKENS, eos_id=None)
        # --dtype float32 on NPU runs through the BF16 route (the double refuses float32 INT8 inputs)
        model32, _, new_cache32 = build_model(shards, manifest, 0, Dist(), torch.float32)
        tokens32, logits32 = greedy_logits(model32, new_cache32(256))
    assert got == want
    assert tokens32 == want32
    # Only the INT8 dispatch differs between the two runs (float projections and attention run the same CPU ops
    # on both), and the NPU branches compute what the BF16 route promises: the logits are the same bits.
    assert all(torch.equal(got_step, want_step) for got_step, want_step in zip(logits32, want_logits32, strict=True))
    assert double.calls["npu_quant_matmul"] > 0 and double.calls["npu_grouped_matmul"] > 0
    assert double.calls["npu_format_cast"] > 0


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_int8_kv_cache_through_the_double(npu_source, tmp_path, on_npu, family):
    """--kv-cache-dtype int8 on the NPU branches: entries and indexer queries quantized by npu_dynamic_quant (BF16
    in, as documented), the rest device-generic torch ops; BF16 compute, so what it quantizes is what the CPU path
    quantizes, and the tokens are the CPU path's."""
    shards = tmp_path / "w1"
    shard(npu_source(family), shards, Layout(1, 1, 1, 1))
    model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.bfloat16)
    want = greedy(model, new_cache(256, "int8"), PROMPTS, NEW_TOKENS, eos_id=None)
    with on_npu() as double:
        model, _, new_cache = build_model(shards, load_manifest(shards), 0, Dist(), torch.bfloat16)
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
    """The CPU path computing what the NPU branches promise for float32: W8A8 activations quantized from BF16,
    W8A8 projections' products (kernels.linear and the grouped experts of kernels.moe) returned in BF16 and
    widened. set_attribute: e.g. monkeypatch.setattr."""
    import dsconv.kernels.moe as kernels_moe
    import dsconv.runner.models.layers as layers
    import dsconv.runner.models.moe as runner_moe

    bf16 = torch.bfloat16
    project, project_quantized = layers.w8a8_linear, layers.w8a8_linear_quantized
    set_attribute(layers, "w8a8_linear",
                  lambda x, w, s, out_dtype: project(x.to(bf16), w, s, out_dtype=bf16).to(out_dtype))
    set_attribute(layers, "w8a8_linear_quantized",
                  lambda x_q, x_scale, w, s, out_dtype: project_quantized(x_q, x_scale, w, s, bf16).to(out_dtype))
    set_attribute(kernels_moe, "w8a8_linear_quantized",
                  lambda x_q, x_scale, w, s, out_dtype: project_quantized(x_q, x_scale, w, s, bf16).to(out_dtype))
    for module in (kernels_moe, runner_moe):
        set_attribute(module, "quantize_activations",
                      lambda x, quantize=module.quantize_activations: quantize(x.to(bf16)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_world_16_idle_dp_ranks_npu_path_gives_the_cpu_tokens(family, npu_source, tmp_path):
    """One prompt on DP16 / EP16: 15 ranks have no sequence in any step, yet enter every collective and expert
    group, each with a throwaway token. Every rank runs the double with the CPU INT8 kernels refused, the shared
    experts overlapped with the exchange on a second stream; the CPU path runs them after the exchange
    (--no-overlap-shared-experts): the same tokens, bit for bit, from both orders. The shards hold 16 redundant
    experts (round-robin): the grouped matmuls run on each rank's physical slots."""
    shards = tmp_path / "w16"
    shard(npu_source(family), shards, Layout(16, 16, 16, 1), ExpertRequest(16))
    prompts = [PROMPTS[1]]
    want = run_ranks(shards, tmp_path, prompts, dtype="bfloat16", overlap_shared_experts=False)
    got = run_ranks(shards, tmp_path, prompts, dtype="bfloat16", entry=generate_on_double,
                    results_name="npu", result_dir=str(tmp_path / "npu"))
    assert got == want
    calls = [json.loads((tmp_path / "npu" / CALLS_NAME.format(rank=rank)).read_text()) for rank in range(16)]
    # idle ranks run a throwaway token, a rank that receives no rows skips its experts, and empty state pieces are
    # left out by their sizes: no op in any step of any rank is handed a zero-size tensor
    zeros = [json.loads((tmp_path / "npu" / ZEROS_NAME.format(rank=rank)).read_text()) for rank in range(16)]
    assert not any(zeros), [(rank, ops) for rank, ops in enumerate(zeros) if ops]
    # every rank runs its INT8 projections there: rank 0 its sequence's, the idle ranks their throwaway token's
    assert all(c["npu_quant_matmul"] > 0 for c in calls), calls
    assert sum(c.get("npu_grouped_matmul", 0) for c in calls) > 0  # expert owners ran their groups there
    config = load_manifest(shards)["model"]["config"]
    # the tiny models' hidden size is below MC2's 1024 (runner/models/mc2.py): their layers take the all-to-all
    # path, whose ops are counted below; tests/test_mc2.py runs MC2 at EP16
    assert config["hidden_size"] < mc2.HIDDEN[0] and not any(DISPATCH_V2 in c for c in calls)
    moe_layers = config["num_hidden_layers"] - config.get("first_k_dense_replace", 0)  # V4: every layer
    steps = len(json.loads((tmp_path / "npu" / SYNCS_NAME.format(rank=0)).read_text()))
    # V3.2: each layer's indexer prolog (its keys) beside the MLA prolog
    beside = moe_layers + (config["num_hidden_layers"] if family == "deepseek_v32" else 0)
    for call in calls:  # each MoE layer of each step: the shared expert on the second stream, joined
        assert call["npu.Stream"] == 1, call  # one second stream per rank, made once
        assert call["npu.stream"] == call["npu.Stream.wait_event"] / 2 == beside * steps, call
        assert call["npu_quant_matmul on a second stream"] == 2 * moe_layers * steps, call  # gate_up and down
    # host syncs in each decode step (every step after the prefill), per rank: 1 per MoE layer (the counted
    # dispatch's received headers and its sent counts, read back together when it is waited for; the combine takes
    # them as lists) and on the rank that samples 1 for the drawn tokens; lm_head TP takes each rank's rows from the
    # step plan. Before: 2 per MoE layer (the two lists read one after the other) and 1 for lm_head TP (the rows
    # exchanged and read back).
    for rank in range(16):
        steps = json.loads((tmp_path / "npu" / SYNCS_NAME.format(rank=rank)).read_text())
        decode = [sum(step.values()) for step in steps[1:]]
        assert decode == [moe_layers + (rank == 0)] * (NEW_TOKENS - 1), (rank, steps)


@pytest.mark.slow
def test_attention_tp_shares_reach_the_quantizer_without_padding_rows(npu_source, tmp_path):
    """V3.2 at attention DP2 x TP8: the 8 ranks of a group each route a share of the group's rows through the
    MoE. A share padded with zero rows would reach npu_dynamic_quant, whose documented formula divides 0 by 0
    for an all-zero row (the double refuses it): the shares are unpadded, an empty one is a throwaway copy of a
    real row, and the tokens are the CPU path's (which runs the shared experts after the exchange, the double's
    beside it: bit for bit the same tokens from both orders at DP2 x TP8 too)."""
    shards = tmp_path / "dp2tp8"
    shard(npu_source("deepseek_v32"), shards, Layout(16, 16, 16, 8))
    prompts = [PROMPTS[1], PROMPTS[2]]  # 37 and 20 rows: shares of 5 and 3, the last ones shorter or empty
    want = run_ranks(shards, tmp_path, prompts, dtype="bfloat16", overlap_shared_experts=False)
    got = run_ranks(shards, tmp_path, prompts, dtype="bfloat16", entry=generate_on_double,
                    results_name="npu", result_dir=str(tmp_path / "npu"))
    assert got == want
    # a rank whose share is empty routes a throwaway copy of the group's first row instead: no zero-size tensor
    zeros = [json.loads((tmp_path / "npu" / ZEROS_NAME.format(rank=rank)).read_text()) for rank in range(16)]
    assert not any(zeros), [(rank, ops) for rank, ops in enumerate(zeros) if ops]


def test_local_launch_refuses_more_ranks_than_devices(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_npu", TorchNpuDouble())  # backend_for imports it
    monkeypatch.setattr(launch_module, "visible_devices", lambda device: 8)
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InputError) as error:
        launch(generate_on_double, {}, world_size=16, device="npu", timeout_s=5, log_dir=tmp_path)
    message = str(error.value)
    assert "torchrun" in message and "16 ranks" in message and "sees 8" in message and "\n" not in message
