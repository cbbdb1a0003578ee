"""A contract double of torch_npu for CPU tests. It is NOT torch_npu and says so (`IS_CONTRACT_DOUBLE`, its
module name): it runs nothing on an NPU and proves nothing about NPU numerics.

What it is for: the runner's NPU branches (kernels.device dispatch) run against it on CPU, so a call that the
real API refuses fails a test here instead of on an Ascend server.
- **Signatures are torch_npu's own.** Every op of torch_npu 2.14.0's schema file (tests/npu_schemas.py: fetched
  from the wheel, about 1,450 schemas that CPU torch accepts) is defined in the `npu` namespace of the process,
  and `double.<op>(...)` calls `torch.ops.npu.<op>`: the dispatcher binds each call against the real schema
  (names, positional / keyword-only, types) before any kernel runs. An op the double does not model binds and
  then raises NotImplementedError; a name torch_npu does not have is an AttributeError.
- **Constraints are the documented ones.** The modelled ops refuse what the documentation refuses (dtype tables,
  layouts, contiguity, empty inputs) and compute with the torch reference formula (kernels.int8's quantizer
  without its floor, exact integer sums), so tokens through it can be compared with the CPU path's. Each refusal
  cites its source:

    [schema]  torch_npu 2.14.0's npu_native_functions_by_codegen.yaml (bound by the dispatcher)
    [dq]      torch_npu 2.14.0's docstring of npu_dynamic_quant (torch_npu/_op_plugin_docs.py)
    [qmm]     the same for npu_quant_matmul ("Constraints" and its dtype table, Atlas A2/A3)
    [gmm]     the same for npu_grouped_matmul (parameters, dtype table for group_list as a Tensor, scenario
              "single-single-single" for group_type 0)
    [aclnn]   CANN aclnnQuantMatmulV5: empty tensors are not supported
    [usage]   vllm-ascend's W8A8_DYNAMIC MoE (vllm_ascend/quantization/w8a8_dynamic.py: experts transposed to
              [E, k, n], made contiguous and cast to FRACTAL_NZ with npu_format_cast_ at load; apply_mlp's
              npu_grouped_matmul with scale [E, n] and per_token_scale, output_dtype the scale's dtype)
    [mc2]     torch_npu's documentation of npu_moe_distribute_dispatch_v2 and npu_moe_distribute_combine_v2
              (op-plugin docs/context/, Atlas A3 rows: the wheel carries no docstring for them); they communicate,
              so the double runs them over the gloo group behind their communicator's name
    [assumed] a conservative choice the documentation does not state

What it does not model is refused too (NotImplementedError), never guessed: other group_list_types, bias,
offset, smoothing, INT4.

Install it in a process with `install()` (kernels.device.route_to_npu_path: CPU tensors take the NPU branches);
ranks started by comm.launch install it through the rank entry `generate_on_double`.
"""

from __future__ import annotations

import json
import math
import sys
import types
from collections import Counter
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from dsconv.kernels.int8 import INT8_MAX
from dsconv.kernels.moe import ACL_FORMAT_FRACTAL_NZ
from tests.npu_schemas import TORCH_NPU_VERSION, registered, scalar_type_codes

IS_CONTRACT_DOUBLE = True
CHECKED_AGAINST = f"torch_npu {TORCH_NPU_VERSION} (its schema file and op docstrings), CANN aclnn docs"
QUANT_MATMUL_MAX_DIM = 65535  # [qmm] "x1 and x2's last dimension cannot exceed 65535"
GROUPED_INNER_LIMIT = 65536  # [gmm] "InnerLimit 65536": each tensor's last dim must be below it
GROUPED_MAX_GROUPS = 1024  # [gmm] group_type 0, single weight tensor: "at most 1024 groups"
ACL_FORMAT_ND = 2  # torch_npu's aclFormat numbering: 2 ND (a plain tensor's), 29 FRACTAL_NZ
FORMAT_ATTRIBUTE = "_npu_double_format"  # the format npu_format_cast gave a tensor (the double's bookkeeping)
HALF = (torch.float16, torch.bfloat16)


class ContractError(RuntimeError):
    """A call the real torch_npu documents as unsupported."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(message)


def npu_format(tensor: torch.Tensor) -> int:
    """The double's stand-in for torch_npu.get_npu_format: FRACTAL_NZ for what npu_format_cast made NZ (that
    tensor object, not a view of it), ND for anything else."""
    return getattr(tensor, FORMAT_ATTRIBUTE, ACL_FORMAT_ND)


def _dtype(code: int | None) -> torch.dtype | None:
    """A dtype argument as the dispatcher hands it over (an int, c10's ScalarType number) back as a dtype."""
    return None if code is None else scalar_type_codes()[code]


def _dense(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and 0 not in tensor.stride()


_active: list["TorchNpuDouble"] = []  # the double whose call is running: the kernels count on it


class TorchNpuDouble(types.ModuleType):
    """torch_npu as the runner sees it: `double.<op>` binds against the real schema and runs the double's kernel;
    `calls` counts each op's calls."""

    def __init__(self):
        super().__init__("tests.npu_double (contract double, not torch_npu)")
        self.calls: Counter = Counter()
        self.npu = NpuStreams(self.calls)
        _kernels()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in registered().defined:
            raise AttributeError(f"torch_npu {TORCH_NPU_VERSION} has no op {name!r} [schema]")
        op = getattr(torch.ops.npu, name)

        def call(*args, **kwargs):
            _active.append(self)
            try:
                return op(*args, **kwargs)
            finally:
                _active.pop()

        return call


def _count(name: str) -> None:
    double = _active[-1]
    double.calls[name] += 1
    if double.npu.current is not double.npu.default:  # the op was queued on a second stream
        double.calls[f"{name} on a second stream"] += 1


# --- torch_npu.npu's streams and events: the calls kernels.streams makes, with the signatures of torch_npu's wheel
# (tests/npu_schemas.py, stream_api; a test compares them), recorded in the double's `calls` ---
class NpuStreams(types.ModuleType):
    """torch_npu.npu's Stream, Event, current_stream and stream as the double's `npu` attribute. Nothing runs
    asynchronously on CPU: the double checks the calls' order (an event is recorded before a stream waits for it, a
    stream context is entered on a stream of this module) and records where each op was queued."""

    def __init__(self, calls: Counter):
        super().__init__("tests.npu_double.npu (contract double, not torch_npu.npu)")
        module, self.calls = self, calls

        class Stream:
            def __init__(self, device=None, priority=0, **kwargs):
                calls["npu.Stream"] += 1
                self.device = device

            def wait_event(self, event):
                calls["npu.Stream.wait_event"] += 1
                _require(isinstance(event, Event), "Stream.wait_event takes a torch_npu.npu.Event [assumed]")
                _require(event.recorded, "a stream waits for an event that was never recorded: it would not "
                                         "wait at all [assumed]")

        class Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                calls["npu.Event"] += 1
                self.recorded = False

            def record(self, stream=None):
                calls["npu.Event.record"] += 1
                _require(stream is None or isinstance(stream, Stream), "Event.record takes a torch_npu.npu.Stream "
                                                                       "[assumed]")
                self.recorded = True

        self.Stream, self.Event = Stream, Event
        self.default = Stream.__new__(Stream)  # the device's default stream, made without counting it
        self.default.device = None
        self.current = self.default

        def current_stream(device=None):
            calls["npu.current_stream"] += 1
            return module.current

        @contextmanager
        def stream(stream):
            calls["npu.stream"] += 1
            _require(stream is None or isinstance(stream, Stream), "npu.stream takes a torch_npu.npu.Stream")
            previous, module.current = module.current, stream or module.current
            try:
                yield
            finally:
                module.current = previous

        self.current_stream, self.stream = current_stream, stream


# --- the modelled ops: CPU kernels behind torch_npu's schemas (arguments arrive as the dispatcher binds them) ---
def _dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                   dst_type_max=0.0):
    _count("npu_dynamic_quant")
    x = input
    _require(x.dtype in HALF, f"npu_dynamic_quant: x must be float16 or bfloat16, got {x.dtype} [dq]")
    _require(x.dim() > 1, f"npu_dynamic_quant: x must have more than one dimension, got {x.dim()} [dq]")
    _require(x.numel() > 0, "npu_dynamic_quant: empty x is not documented as supported [assumed]")
    _require(_dense(x), f"npu_dynamic_quant: x must be contiguous, got strides {x.stride()} [assumed]")
    if smooth_scales is not None or group_index is not None or _dtype(dst_type) not in (None, torch.int8) \
            or quant_mode != "pertoken" or dst_type_max != 0.0:
        raise NotImplementedError("the double models npu_dynamic_quant's plain per-token INT8 form only")
    # [dq] scale = row_max(abs(x)) / 127, y = round(x / scale): no floor, so an all-zero row divides 0 by 0
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    amax = rows.abs().amax(dim=1, keepdim=True)
    _require(bool((amax > 0).all()),
             "npu_dynamic_quant: an all-zero row has scale 0 in the documented formula (0 / 0) [dq]")
    scale = amax / INT8_MAX
    q = torch.clamp(torch.round(rows / scale), -INT8_MAX, INT8_MAX).to(torch.int8)
    # [dq] y: int8, x's shape; scale: float32, x's shape without the last dimension
    return q.reshape(x.shape), scale.reshape(x.shape[:-1])


def _quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, x1_dtype=None,
                  x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None, y_scale=None):
    _count("npu_quant_matmul")
    output_dtype = _dtype(output_dtype)
    _require(x1.dtype == torch.int8 and x2.dtype == torch.int8,
             f"npu_quant_matmul: x1, x2 must both be int8 here, got {x1.dtype}, {x2.dtype} [qmm]")
    _require(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, "npu_quant_matmul: x1, x2 take 2 to 6 dimensions [qmm]")
    _require(x1.numel() > 0 and x2.numel() > 0 and scale.numel() > 0,
             f"npu_quant_matmul: x1 {tuple(x1.shape)}, x2, scale must not be empty [qmm] [aclnn]")
    if x1.dim() != 2 or x2.dim() != 2:
        raise NotImplementedError("the double models 2-D x1 and x2 only")
    (m, k), (k2, n) = x1.shape, x2.shape
    _require(k == k2, f"npu_quant_matmul: x1 {tuple(x1.shape)} @ x2 {tuple(x2.shape)}: inner sizes differ")
    _require(k <= QUANT_MATMUL_MAX_DIM and n <= QUANT_MATMUL_MAX_DIM,
             f"npu_quant_matmul: last dimensions must not exceed {QUANT_MATMUL_MAX_DIM}, got k={k}, n={n} [qmm]")
    _require(scale.dim() == 1 and scale.shape[0] in (1, n),
             f"npu_quant_matmul: scale must be 1-D (1,) or ({n},), got {tuple(scale.shape)} [qmm]")
    if pertoken_scale is not None:
        _require(pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,),
                 f"npu_quant_matmul: pertoken_scale must be float32 ({m},), got {pertoken_scale.dtype} "
                 f"{tuple(pertoken_scale.shape)} [qmm]")
    # [qmm] dtype table rows with int8 inputs and a per-token scale: bfloat16 out takes a float32 or bfloat16
    # scale, float16 out a float32 one. float32 is never an output dtype.
    allowed = {torch.bfloat16: (torch.float32, torch.bfloat16), torch.float16: (torch.float32,)}
    _require(output_dtype in (None, torch.int8, torch.float16, torch.bfloat16, torch.int32),
             f"npu_quant_matmul: output_dtype {output_dtype} is not one of int8, float16, bfloat16, int32 [qmm]")
    if pertoken_scale is None or output_dtype not in allowed or any(
            a is not None for a in (offset, bias, group_sizes, y_scale, x1_dtype, x2_dtype, pertoken_scale_dtype,
                                    scale_dtype)):
        raise NotImplementedError("the double models the per-token form with float16/bfloat16 output only")
    _require(scale.dtype in allowed[output_dtype],
             f"npu_quant_matmul: {output_dtype} output with a per-token scale takes a scale in "
             f"{allowed[output_dtype]}, got {scale.dtype} [qmm]")
    acc = x1.to(torch.int32) @ x2.to(torch.int32)  # exact sums
    return (acc.to(torch.float32) * pertoken_scale[:, None] * scale.to(torch.float32)[None, :]).to(output_dtype)


def _grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                    per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                    activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                    tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                    per_token_scale_dtype=None):
    _count("npu_grouped_matmul")
    output_dtype = _dtype(output_dtype)
    if len(x) != 1 or len(weight) != 1 or group_type != 0 or split_item not in (2, 3):
        raise NotImplementedError("the double models group_type 0 with one x, one 3-D weight (single-single-"
                                  "single, split_item 2 or 3) only")
    if any(a is not None for a in (bias, offset, antiquant_scale, antiquant_offset, activation_input,
                                   activation_quant_scale, activation_quant_offset, tuning_config, x_dtype,
                                   weight_dtype, scale_dtype, per_token_scale_dtype)) or act_type != 0:
        raise NotImplementedError("the double models no bias, offset, antiquant, activation or dtype-override inputs")
    (rows,), (w,) = x, weight
    _require(group_list is not None, "npu_grouped_matmul: group_type 0 needs a group_list [gmm]")
    _require(group_list.dtype == torch.int64 and group_list.dim() == 1,
             f"npu_grouped_matmul: group_list must be a 1-D int64 tensor, got {group_list.dtype} "
             f"{tuple(group_list.shape)} [gmm]")
    _require(rows.dim() == 2 and w.dim() == 3, f"npu_grouped_matmul: single-single-single takes a 2-D x and a "
             f"3-D weight, got {tuple(rows.shape)}, {tuple(w.shape)} [gmm]")
    # [gmm] x may not be transposed; strides other than a contiguous row-major x (a stride-0 expand among them)
    # are not documented
    _require(_dense(rows), f"npu_grouped_matmul: x must be contiguous, got strides {rows.stride()} [gmm]")
    _require(per_token_scale is None or all(_dense(t) for t in per_token_scale),
             "npu_grouped_matmul: per_token_scale must be contiguous [gmm]")
    groups, k, n = w.shape
    m = rows.shape[0]
    _require(rows.shape[1] == k, f"npu_grouped_matmul: x {tuple(rows.shape)} against weight {tuple(w.shape)}")
    _require(k < GROUPED_INNER_LIMIT and n < GROUPED_INNER_LIMIT,
             f"npu_grouped_matmul: last dimensions must be below {GROUPED_INNER_LIMIT} [gmm]")
    _require(group_list.shape[0] == groups and groups <= GROUPED_MAX_GROUPS,
             f"npu_grouped_matmul: group_list has {group_list.shape[0]} entries for {groups} weight groups "
             f"(at most {GROUPED_MAX_GROUPS}) [gmm]")
    _require(m > 0, "npu_grouped_matmul: empty x is not documented as supported [assumed]")
    values = group_list.tolist()
    _require(min(values) >= 0, f"npu_grouped_matmul: group_list {values} has a negative entry [gmm]")
    if group_list_type == 0:  # [gmm] cumulative sums: non-decreasing, the last equal to x's rows
        _require(all(a <= b for a, b in zip(values, values[1:])) and values[-1] == m,
                 f"npu_grouped_matmul: group_list_type 0 takes non-decreasing cumulative sums ending at {m}, got "
                 f"{values} [gmm]")
        ends = values
    elif group_list_type == 1:  # [gmm] per-group sizes, "and its length cannot be 1", summing to x's rows
        _require(len(values) != 1, "npu_grouped_matmul: group_list_type 1 refuses a one-entry group_list [gmm]")
        _require(sum(values) == m, f"npu_grouped_matmul: group sizes {values} must sum to {m} [gmm]")
        ends = torch.tensor(values).cumsum(0).tolist()
    else:
        raise NotImplementedError(f"the double models group_list_type 0 and 1, not {group_list_type}")
    if rows.dtype in (*HALF, torch.float32):  # [gmm] dtype table, not quantized: x, weight, y in one dtype
        _require(w.dtype == rows.dtype and output_dtype in (None, rows.dtype) and scale is None
                 and per_token_scale is None,
                 f"npu_grouped_matmul: float x {rows.dtype} needs weight in {rows.dtype}, output_dtype None or "
                 f"{rows.dtype}, no scales [gmm]")
        return [_grouped(rows, w, ends, rows.dtype)]
    _require(rows.dtype == torch.int8 and w.dtype == torch.int8,
             f"npu_grouped_matmul: quantized x and weight must be int8, got {rows.dtype}, {w.dtype} [gmm]")
    # [usage] INT8 experts go to the op as npu_format_cast made them: [E, k, n], contiguous, FRACTAL_NZ. The
    # documentation also lists ND weights; the double holds the code to the form vllm-ascend runs.
    _require(npu_format(w) == ACL_FORMAT_FRACTAL_NZ,
             "npu_grouped_matmul: INT8 expert weights must be the FRACTAL_NZ tensor npu_format_cast returned "
             "(not ND, not a view of it) [usage]")
    # [gmm] dtype table, per-token quantization: scale bfloat16 -> bfloat16 out, scale float32 -> float16 out;
    # per_token_scale float32 1-D [m]. The int32-output form is listed only under tuning_config: not modelled.
    allowed = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}
    _require(output_dtype in allowed and scale is not None and per_token_scale is not None,
             f"npu_grouped_matmul: int8 x with output_dtype {output_dtype}, scale and per_token_scale "
             f"{'given' if scale is not None and per_token_scale is not None else 'missing'} is not a per-token "
             "form of the dtype table [gmm]")
    (w_scale,), (t_scale,) = scale, per_token_scale
    _require(w_scale.dtype == allowed[output_dtype] and tuple(w_scale.shape) == (groups, n),
             f"npu_grouped_matmul: scale must be {allowed[output_dtype]} [{groups}, {n}] for {output_dtype} output, "
             f"got {w_scale.dtype} {tuple(w_scale.shape)} [gmm] [usage]")
    _require(t_scale.dtype == torch.float32 and tuple(t_scale.shape) == (m,),
             f"npu_grouped_matmul: per_token_scale must be float32 ({m},), got {t_scale.dtype} "
             f"{tuple(t_scale.shape)} [gmm]")
    acc = _grouped(rows, w, ends, torch.int32).to(torch.float32)
    row_group = torch.repeat_interleave(torch.arange(groups), torch.tensor(ends).diff(prepend=torch.tensor([0])))
    # kernels.linear's dequantization order: (sums x per-token scale) x channel scale, in float32
    return [(acc * t_scale[:, None] * w_scale.to(torch.float32)[row_group]).to(output_dtype)]


def _grouped(rows, w, ends, out_dtype):
    out, start = torch.empty(rows.shape[0], w.shape[2], dtype=out_dtype), 0
    for g, end in enumerate(ends):
        if end > start:
            if out_dtype == torch.int32:
                out[start:end] = rows[start:end].to(torch.int32) @ w[g].to(torch.int32)  # exact sums
            else:
                out[start:end] = rows[start:end] @ w[g]
        start = end
    return out


def _grouped_matmul_list(x, weight, **kwargs):
    _count("npu_grouped_matmul")
    raise ContractError("npu_grouped_matmul: group_list as a list of ints takes no per_token_scale and only int64 "
                        "scales; the runner passes it as a Tensor [gmm]")


def _format_cast(self, acl_format, *, customize_dtype=None, input_dtype=None):
    _count("npu_format_cast")
    if customize_dtype is not None or input_dtype is not None or acl_format not in (ACL_FORMAT_ND,
                                                                                  ACL_FORMAT_FRACTAL_NZ):
        raise NotImplementedError("the double models casts to ND and FRACTAL_NZ only")
    _require(_dense(self), f"npu_format_cast: cast a contiguous tensor, got strides {self.stride()} [usage]")
    _require(self.numel() > 0, "npu_format_cast: empty tensor [assumed]")
    out = self.clone()  # the values, held ND on CPU: the format is bookkeeping
    setattr(out, FORMAT_ATTRIBUTE, acl_format)
    return out


# --- MC2: npu_moe_distribute_dispatch_v2 / combine_v2 (A3 rows of [mc2]) ---------------------------------------------
MC2_MAX_BS = 512  # [mc2] 0 < BS <= 512
MC2_MAX_K = 16  # [mc2] 0 < K <= 16
MC2_DISPATCH_H, MC2_COMBINE_H = (1024, 8192), (1024, 7168)  # [mc2] H, each op's range
MC2_DISPATCH_EXPERTS, MC2_COMBINE_EXPERTS = 1024, 512  # [mc2] moe_expert_num upper bounds
MC2_DISPATCH_EP, MC2_COMBINE_EP = (2, 768), (2, 384)  # [mc2] ep_world_size ranges
MC2_COMBINE_SLOTS = 1280  # [mc2] combine: moe_expert_num / ep_world_size x ep_world_size <= 1280
MC2_ASSIST_WIDTH = 128  # [mc2] assist_info_for_combine is [A * 128]
MC2_BUFFSIZE_DEFAULT_MB = 200  # [mc2] HCCL_BUFFSIZE's default
COMM_NAME_PREFIX = "npu-double-hccl:"
_mc2_groups: dict[str, object] = {}  # a communicator's name (hccl_comm_name) -> its gloo ProcessGroup
_mc2_dispatched: dict[str, dict] = {}  # per communicator, its last dispatch_v2, which its combine_v2 must match


def _comm_name(backend, rank: int) -> str:
    """ProcessGroupGloo.get_hccl_comm_name while the double is installed: a name for the group whose backend this
    is, registered so that the MC2 kernels find the group to communicate on."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    for group, name in _world.pg_names.items():
        if group._get_backend(torch.device("cpu")) is backend:
            _require(rank in dist.get_process_group_ranks(group),
                     f"get_hccl_comm_name({rank}): rank {rank} is not a member of group {name} [assumed]")
            _mc2_groups[COMM_NAME_PREFIX + name] = group
            return COMM_NAME_PREFIX + name
    raise ContractError("get_hccl_comm_name: a backend of no process group [assumed]")


def _mc2_group(name: str):
    _require(1 <= len(name) < 128, f"MC2: group_ep's length must be in [1, 128), got {len(name)} [mc2]")
    _require(name in _mc2_groups, f"MC2: {name!r} names no communicator (take it from get_hccl_comm_name) [mc2]")
    return _mc2_groups[name]


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def _mc2_common(op, ep_world_size, ep_rank_id, moe_expert_num, ep_range, max_experts, group_tp, tp_world_size,
                expert_shard_type, shared_expert_rank_num, comm_alg, special) -> None:
    if group_tp or tp_world_size > 1 or expert_shard_type or shared_expert_rank_num or any(special) \
            or comm_alg not in ("", "fullmesh_v1"):
        raise NotImplementedError(f"the double models {op} without TP, shared-expert ranks or special experts, "
                                  "with the default algorithm")
    _require(ep_range[0] <= ep_world_size <= ep_range[1],
             f"{op}: ep_world_size {ep_world_size} outside {list(ep_range)} [mc2]")
    _require(0 <= ep_rank_id < ep_world_size, f"{op}: ep_rank_id {ep_rank_id} outside [0, {ep_world_size}) [mc2]")
    _require(1 <= moe_expert_num <= max_experts and moe_expert_num % ep_world_size == 0,
             f"{op}: moe_expert_num {moe_expert_num} must be in [1, {max_experts}] and divisible by "
             f"ep_world_size {ep_world_size} [mc2]")


def _mc2_mask(op, x_active_mask, bs: int) -> torch.Tensor:
    """The active tokens as a bool [BS] (all when no mask)."""
    if x_active_mask is None:
        return torch.ones(bs, dtype=torch.bool)
    _require(x_active_mask.dtype == torch.bool and tuple(x_active_mask.shape) == (bs,),
             f"{op}: x_active_mask must be bool ({bs},) (its 2-D form is not modelled), got {x_active_mask.dtype} "
             f"{tuple(x_active_mask.shape)} [mc2]")
    n = int(x_active_mask.sum())
    _require(bool(x_active_mask[:n].all()), f"{op}: x_active_mask's True entries must come before its False ones, "
                                            f"got {x_active_mask.tolist()} [mc2]")
    return x_active_mask.clone()


def _dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                 x_active_mask=None, expert_scales=None, elastic_info=None, performance_info=None, group_tp="",
                 tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                 quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="", zero_expert_num=0,
                 copy_expert_num=0, const_expert_num=0, y_dtype=None, x_dtype=None, scales_dtype=None):
    import os

    import torch.distributed as dist

    op = "npu_moe_distribute_dispatch_v2"
    _count(op)
    if any(a is not None for a in (scales, expert_scales, elastic_info, performance_info, y_dtype, x_dtype,
                                   scales_dtype)):
        raise NotImplementedError(f"the double models {op} without scales, expert_scales, elastic or performance "
                                  "info and dtype overrides")
    _mc2_common(op, ep_world_size, ep_rank_id, moe_expert_num, MC2_DISPATCH_EP, MC2_DISPATCH_EXPERTS, group_tp,
                tp_world_size, expert_shard_type, shared_expert_rank_num, comm_alg,
                (zero_expert_num, copy_expert_num, const_expert_num))
    _require(x.dim() == 2 and x.dtype in HALF, f"{op}: x must be 2-D bfloat16 or float16, got {x.dtype} "
                                              f"{tuple(x.shape)} [mc2]")
    bs, h = x.shape
    _require(0 < bs <= MC2_MAX_BS, f"{op}: BS {bs} outside (0, {MC2_MAX_BS}] [mc2]")
    _require(MC2_DISPATCH_H[0] <= h <= MC2_DISPATCH_H[1], f"{op}: H {h} outside {list(MC2_DISPATCH_H)} [mc2]")
    _require(expert_ids.dtype == torch.int32 and expert_ids.dim() == 2 and expert_ids.shape[0] == bs,
             f"{op}: expert_ids must be int32 ({bs}, K), got {expert_ids.dtype} {tuple(expert_ids.shape)} [mc2]")
    k = expert_ids.shape[1]
    _require(0 < k <= min(MC2_MAX_K, moe_expert_num), f"{op}: K {k} outside (0, {MC2_MAX_K}] [mc2]")
    ids = expert_ids.to(torch.int64)
    _require(bool(((ids >= 0) & (ids < moe_expert_num)).all()), f"{op}: expert_ids outside [0, {moe_expert_num}) "
                                                                 "[mc2]")
    _require(bool((ids.sort(dim=1).values.diff(dim=1) != 0).all()), f"{op}: a row of expert_ids names an expert "
                                                                     "twice [mc2]")
    _require(0 <= shared_expert_num <= 4, f"{op}: shared_expert_num {shared_expert_num} outside [0, 4] [mc2]")
    _require(quant_mode in (0, 2), f"{op}: quant_mode must be 0 or 2, got {quant_mode} [mc2]")
    _require(expert_token_nums_type in (0, 1), f"{op}: expert_token_nums_type must be 0 or 1 [mc2]")
    active = _mc2_mask(op, x_active_mask, bs)
    group = _mc2_group(group_ep)
    _require(dist.get_world_size(group) == ep_world_size and dist.get_rank(group) == ep_rank_id,
             f"{op}: ep_world_size {ep_world_size} / ep_rank_id {ep_rank_id} disagree with the communicator [mc2]")
    local = moe_expert_num // ep_world_size
    # [mc2] dynamic quantization: x_fp32 = x (no scales); s = 127 / max|x|; int8(x_fp32 * s); the scale out is 1 / s
    rows = x.to(torch.float32)
    if quant_mode == 2:
        amax = rows[active].abs().amax(dim=1, keepdim=True) if bool(active.any()) else rows[:0, :1]
        _require(bool((amax > 0).all()), f"{op}: an all-zero active row has no quantization scale (127 / 0) "
                                         "[assumed]")
        inverse = torch.zeros(bs, 1)
        inverse[active] = 127.0 / amax
        payload = torch.clamp(torch.round(rows * inverse), -127, 127).to(torch.int8)
        row_scale = (1.0 / inverse[:, 0])
    else:
        payload, row_scale = x, torch.zeros(bs)
    # every rank's parameters and outgoing rows; each takes what its experts are sent
    outgoing = [[] for _ in range(ep_world_size)]
    for t in range(bs):
        if active[t]:
            for e in ids[t].tolist():
                outgoing[e // local].append((e % local, t, payload[t].clone(), float(row_scale[t])))
    mine = dict(bs=bs, h=h, k=k, dtype=x.dtype, experts=moe_expert_num, global_bs=global_bs, quant=quant_mode,
                shared=shared_expert_num, masked=not bool(active.all()), rows=outgoing)
    peers = [None] * ep_world_size
    dist.all_gather_object(peers, mine, group=group)
    for name in ("h", "k", "dtype", "experts", "global_bs", "quant", "shared"):
        _require(len({str(p[name]) for p in peers}) == 1, f"{op}: the ranks disagree on {name}: "
                                                          f"{[p[name] for p in peers]} [mc2]")
    sizes = [p["bs"] for p in peers]
    _require(not any(p["masked"] for p in peers) or len(set(sizes)) == 1,
             f"{op}: an x_active_mask with False entries while the ranks' BS differ ({sizes}) [mc2]")
    _require(global_bs == max(sizes) * ep_world_size or (global_bs == 0 and len(set(sizes)) == 1),
             f"{op}: global_bs {global_bs} must be max BS x ep_world_size ({max(sizes) * ep_world_size}), or 0 when "
             f"every BS is equal [mc2]")
    max_bs = max(sizes)
    need = 2 * (local * max_bs * ep_world_size * _align(_align(2 * h, 32) + 64, 512)
                + (k + shared_expert_num) * max_bs * _align(2 * h, 512))
    have = int(os.environ.get("HCCL_BUFFSIZE", MC2_BUFFSIZE_DEFAULT_MB)) * 2**20
    _require(need <= have, f"{op}: HCCL_BUFFSIZE {have >> 20} MB below the {need} bytes this call needs [mc2]")
    arrived = sorted((e, source, t, row, scale) for source, p in enumerate(peers)
                     for e, t, row, scale in p["rows"][ep_rank_id])
    a = (global_bs or bs * ep_world_size) * min(local, k)  # [mc2] A, the most rows this rank may receive
    expand_x = torch.zeros(a, h, dtype=torch.int8) if quant_mode == 2 else torch.full((a, h), math.nan,
                                                                                       dtype=x.dtype)
    dynamic_scales = torch.full((a,), math.nan) if quant_mode == 2 else torch.empty(0)
    assist = torch.full((a * MC2_ASSIST_WIDTH,), -1, dtype=torch.int32)
    counts = torch.zeros(local, dtype=torch.int64)
    per_source = torch.zeros(local, ep_world_size, dtype=torch.int32)
    for i, (e, source, t, row, scale) in enumerate(arrived):
        expand_x[i] = row
        if quant_mode == 2:
            dynamic_scales[i] = scale
        assist[3 * i:3 * i + 3] = torch.tensor([source, t, e], dtype=torch.int32)
        counts[e] += 1
        per_source[e, source] += 1
    ep_recv_counts = per_source.flatten().cumsum(0).to(torch.int32)  # [mc2] A3: ep_world_size x local, running sums
    _mc2_dispatched[group_ep] = dict(ids=expert_ids.clone(), active=active, a=a, h=h, bs=bs, dtype=x.dtype,
                                     assist=assist.clone(), ep_counts=ep_recv_counts.clone(), global_bs=global_bs,
                                     experts=moe_expert_num)
    expert_token_nums = counts if expert_token_nums_type == 1 else counts.cumsum(0)
    tp_recv_counts = torch.zeros(0, dtype=torch.int32)  # [mc2] shape (tp_world_size,): no TP domain
    expand_scales = torch.empty(0)  # [mc2] A3 returns none
    return expand_x, dynamic_scales, assist, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales


def _combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep, ep_world_size,
                ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None, expand_scales=None,
                shared_expert_x=None, elastic_info=None, ori_x=None, const_expert_alpha_1=None,
                const_expert_alpha_2=None, const_expert_v=None, performance_info=None, group_tp="", tp_world_size=0,
                tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0,
                comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0, const_expert_num=0):
    import torch.distributed as dist

    op = "npu_moe_distribute_combine_v2"
    _count(op)
    if any(a is not None for a in (expand_scales, shared_expert_x, elastic_info, ori_x, const_expert_alpha_1,
                                   const_expert_alpha_2, const_expert_v, performance_info)) or comm_quant_mode:
        raise NotImplementedError(f"the double models {op} without expand_scales, shared_expert_x, elastic, "
                                  "special-expert or performance inputs and without communication quantization")
    _mc2_common(op, ep_world_size, ep_rank_id, moe_expert_num, MC2_COMBINE_EP, MC2_COMBINE_EXPERTS, group_tp,
                tp_world_size, expert_shard_type, shared_expert_rank_num, comm_alg,
                (zero_expert_num, copy_expert_num, const_expert_num))
    _require(moe_expert_num <= MC2_COMBINE_SLOTS, f"{op}: moe_expert_num {moe_expert_num} above "
                                                  f"{MC2_COMBINE_SLOTS} [mc2]")
    _require(group_ep in _mc2_dispatched, f"{op}: no npu_moe_distribute_dispatch_v2 on {group_ep!r} to combine: the "
                                          "two are used together [mc2]")
    sent = _mc2_dispatched.pop(group_ep)
    _require(expand_x.dtype in HALF, f"{op}: expand_x must be bfloat16 or float16, got {expand_x.dtype} [mc2]")
    _require(tuple(expand_x.shape) == (sent["a"], sent["h"]),
             f"{op}: expand_x must be [A, H] = {(sent['a'], sent['h'])} as dispatched, got {tuple(expand_x.shape)} "
             "[mc2]")
    _require(MC2_COMBINE_H[0] <= sent["h"] <= MC2_COMBINE_H[1], f"{op}: H {sent['h']} outside "
                                                                f"{list(MC2_COMBINE_H)} [mc2]")
    _require(torch.equal(expert_ids, sent["ids"]), f"{op}: expert_ids differ from the dispatch's [mc2]")
    _require(torch.equal(assist_info_for_combine, sent["assist"]) and torch.equal(ep_send_counts, sent["ep_counts"]),
             f"{op}: assist_info_for_combine and ep_send_counts must be the dispatch's outputs [mc2]")
    _require(global_bs == sent["global_bs"] and moe_expert_num == sent["experts"],
             f"{op}: global_bs and moe_expert_num must be the dispatch's [mc2]")
    bs, k = sent["bs"], sent["ids"].shape[1]
    _require(expert_scales.dtype == torch.float32 and tuple(expert_scales.shape) == (bs, k),
             f"{op}: expert_scales must be float32 ({bs}, {k}), got {expert_scales.dtype} "
             f"{tuple(expert_scales.shape)} [mc2]")
    active = _mc2_mask(op, x_active_mask, bs)
    _require(torch.equal(active, sent["active"]), f"{op}: x_active_mask differs from the dispatch's [mc2]")
    _require(tp_send_counts is None or tp_send_counts.numel() == 0, f"{op}: tp_send_counts without a TP domain")
    group = _mc2_group(group_ep)
    used = int(ep_send_counts[-1])
    back = [[] for _ in range(ep_world_size)]
    for i in range(used):  # each row returns to the token that sent it
        source, t, e = assist_info_for_combine[3 * i:3 * i + 3].tolist()
        back[source].append((t, ep_rank_id * (moe_expert_num // ep_world_size) + e, expand_x[i].clone()))
    peers = [None] * ep_world_size
    dist.all_gather_object(peers, back, group=group)
    combined = torch.zeros(bs, k, expand_x.shape[1], dtype=expand_x.dtype)
    for p in peers:
        for t, expert, row in p[ep_rank_id]:
            j = sent["ids"][t].tolist().index(expert)
            combined[t, j] = row
    n = int(active.sum())
    out = torch.zeros(bs, expand_x.shape[1], dtype=expand_x.dtype)
    # the routing-weighted sum in float32 over each token's k rows (the all-to-all path's formula)
    out[:n] = torch.bmm(expert_scales[:n, None], combined[:n].float())[:, 0].to(expand_x.dtype)
    return out


MODELLED = {"npu_moe_distribute_dispatch_v2": _dispatch_v2, "npu_moe_distribute_combine_v2": _combine_v2,
            "npu_dynamic_quant": _dynamic_quant, "npu_quant_matmul": _quant_matmul,
            "npu_grouped_matmul": _grouped_matmul, "npu_grouped_matmul.List": _grouped_matmul_list,
            "npu_format_cast": _format_cast}


@cache
def _kernels() -> None:
    """Every torch_npu op gets a CPU kernel once per process: the modelled ones theirs, the others a refusal
    (after the dispatcher has bound the call)."""
    schemas = registered()
    for name in schemas.defined:
        kernel = MODELLED.get(name)
        if kernel is None:
            def kernel(*args, _name=name, **kwargs):
                raise NotImplementedError(f"the contract double does not model torch_npu.{_name}")
        schemas.implement(name, kernel)


# --- --kv-cache-dtype int8 on an NPU -------------------------------------------------------------------------------
# The runner's INT8 cache path is torch ops on the cache's device (no host reads; tests/test_cache_int8.py runs it on
# the meta device) plus one torch_npu op, npu_dynamic_quant (modelled above), which quantizes the entries and the
# indexer's queries. What a real NPU build would call for each step, with the constraints their documentation gives
# (op-plugin docs/zh/custom_APIs/torch_npu/; vllm-ascend 182b75ea's sfa_v1.py; CANN's cann-recipes-infer
# deepseek_v3_2_exp). Each signature is written with torch_npu 2.14.0's own argument names, which
# test_npu_contract checks against its schema file ("..." leaves arguments out). Not modelled by this double: the
# runner does not call them, so nothing here runs them.
INT8_CACHE_NPU_OPS = {
    "store": ("npu_scatter_nd_update_(self, indices, updates)",
              "int8 supported on Atlas A2/A3; indices at least 2-D. vllm-ascend writes its LI C8 keys with it. "
              "dsrun stores with index_copy_ (one torch op, no host read)."),
    "quantize per token": ("npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode='pertoken')",
                           "x float16/bfloat16, more than one dimension; scale = rowmax(|x|) / 127, float32, x's "
                           "shape without the last dim. dsrun calls it (kernels.linear.quantize_activations)."),
    "quantize per 128-value tile": ("npu_dynamic_block_quant(x, *, min_scale=0.0, round_mode='rint', dst_type=1, "
                                    "row_block_size=1, col_block_size=128)",
                                    "int8 output and the 1 x 128 block only: the MLA latent's C8 scales (vllm-ascend "
                                    "sparse C8). dsrun quantizes each tile as a row of npu_dynamic_quant instead."),
    "dequantize": ("npu_anti_quant(x, scale, *, offset=None, dst_dtype=None, src_dtype=None)",
                   "scale 1-D, of size 1 or x's last dim: per channel only, so a per-token scale is a broadcast "
                   "multiply, which is what dsrun does (kernels.cache_int8.dequantize_tokens)."),
    "A8C8 indexer": ("npu_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, "
                     "query_quant_mode, key_quant_mode, *, actual_seq_lengths_query, actual_seq_lengths_key, "
                     "block_table, layout_query='BSND', layout_key='BSND', sparse_count=2048, sparse_mode=3, ...)",
                     "Atlas A3 inference: int8 query and key, quant modes 0 (per token and head) only, weights and "
                     "both dequant scales float16 (dsrun keeps float32 scales: a cast), head dim 128, query heads at "
                     "most 64, one key head, paged block size a multiple of 16 up to 1024 (dsrun's is 16); returns "
                     "the top-k indices itself. Keys and queries rotated by a Hadamard matrix before quantizing, as "
                     "vllm-ascend and cann-recipes-infer do and dsrun does."),
    "C8 attention": ("npu_kv_quant_sparse_flash_attention(query, key, value, sparse_indices, scale_value, "
                     "key_quant_mode, value_quant_mode, *, key_dequant_scale=None, value_dequant_scale=None, "
                     "block_table=None, ..., tile_size=128, rope_head_dim=64)",
                     "key int8 on A2/A3, key_quant_mode 2 (per tile), tile_size 128, KV_D 656 only: each token one "
                     "row [512 int8 latent | 64 BF16 rope key | 4 float32 scales]; dsrun holds the same bytes in "
                     "three tensors (kv_cache.LatentCache), which a device build would pack into that row. A torch_npu "
                     "op since 2.14 (vllm-ascend 182b75ea called it as its own torch.ops._C_ascend op)."),
    "int8 x int8 -> int32 product": ("npu_quant_matmul(x1, x2, scale, *, ..., output_dtype=torch.int32)",
                                     "listed for int8 inputs with int32 output on A2/A3, a scale still required; "
                                     "dsrun's int8_scores multiplies the INT8 values as float32 (exact for a "
                                     "128-wide head) on any device."),
}


def install() -> TorchNpuDouble:
    """A fresh double, made the module the NPU branches call, with CPU tensors routed to them."""
    from dsconv.kernels.device import route_to_npu_path

    from torch._C._distributed_c10d import ProcessGroupGloo

    double = TorchNpuDouble()
    route_to_npu_path("cpu", double)
    # comm.groups.hccl_comm_name asks the group's backend for its HCCL name: gloo's answers with the double's
    ProcessGroupGloo.get_hccl_comm_name = _comm_name
    return double


def forbid_cpu_int8_path(set_attribute=setattr) -> None:
    """Make the CPU INT8 kernels fail: under the double every INT8 projection must take the NPU branch.
    set_attribute: e.g. pytest's monkeypatch.setattr, to undo it after a test."""
    import dsconv.kernels.linear as linear
    import dsconv.kernels.moe as moe

    def refuse(*args, **kwargs):
        raise AssertionError("a CPU INT8 kernel ran while the NPU path was installed")

    for module, name in ((linear, "quantize_rows_"), (linear, "int8_matmul"), (moe, "_project_groups")):
        set_attribute(module, name, refuse)


def keep_cpu_attention(set_attribute=setattr) -> None:
    """Attention on its CPU branch while the double is installed. Its NPU branch calls no torch_npu op (plain
    torch matmuls in the compute dtype), so the double has nothing to check there, and its BF16 products round
    differently from the CPU branch's float32 ones: on the random-weight fixtures that alone moves a near-tie
    token after a few steps. Kept on the CPU branch, the INT8 and expert dispatch is all that differs, and the
    tokens compare exactly."""
    import dsconv.kernels.attention as attention

    set_attribute(attention, "is_npu", lambda tensor: False)


CALLS_NAME = "npu_calls_rank{rank}.json"
SYNCS_NAME = "host_syncs_rank{rank}.json"
# What reads a tensor's values on the host: on a device each waits for the device to finish (a host sync).
SYNC_METHODS = ("item", "tolist", "__int__", "__index__", "__float__", "__bool__")


class SyncCounter:
    """Counts, per engine step, the host reads of tensor values (SYNC_METHODS) on this rank: under the double every
    tensor stands for a device tensor. steps[i]: {method: calls} in the i-th step's Worker.execute (building the
    inputs, the forward and the sampler); the step plan's broadcast, an object exchange, is not in it."""

    def __init__(self):
        self.steps: list[dict[str, int]] = []
        self.current: dict[str, int] | None = None

    def install(self) -> None:
        import torch

        from dsconv.runner.engine import worker

        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if self.current is not None and caller != __file__:  # the double's own checks are no sync
                    self.current[_name] = self.current.get(_name, 0) + 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        execute = worker.Worker.execute

        def counted_step(worker_self, batch, plan=None):
            self.current = {}
            try:
                return execute(worker_self, batch, plan)
            finally:
                self.steps.append(self.current)
                self.current = None

        worker.Worker.execute = counted_step


ZEROS_NAME = "zero_size_ops_rank{rank}.json"


def _package_caller() -> str:
    """file:line of the innermost frame in the package's own code (the call that handed the op its tensor)."""
    import dsconv

    package = str(Path(dsconv.__file__).resolve().parent)
    frame = sys._getframe(1)
    while frame is not None:
        name = str(Path(frame.f_code.co_filename).resolve())
        if name.startswith(package) and "/tests/" not in name and "site-packages" not in name:
            return f"{Path(name).relative_to(package)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside the package"


class ZeroSizeWatch:
    """Records, over every engine step's Worker.execute on this rank, each aten or torch_npu op that received a
    zero-size tensor: {"op at file:line": calls}, the line being the package's call. Under the double every tensor
    stands for a device tensor."""

    def __init__(self):
        self.ops: Counter = Counter()

    def install(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        from dsconv.runner.engine import worker

        ops = self.ops

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in tree_leaves((args, kwargs))):
                    ops[f"{func.overloadpacket} at {_package_caller()}"] += 1
                return func(*args, **kwargs)

        execute = worker.Worker.execute

        def watched_step(worker_self, batch, plan=None):
            with Watch():
                return execute(worker_self, batch, plan)

        worker.Worker.execute = watched_step


def generate_on_double(result_dir: str, **kwargs):
    """A rank entry: the double installed in this rank, then dsrun generate's ranks (entrypoints.generate.generate);
    the op counts go to result_dir/npu_calls_rank{R}.json."""
    import torch.distributed as dist

    from dsconv.runner.entrypoints.generate import generate

    double = install()
    forbid_cpu_int8_path()
    keep_cpu_attention()
    syncs = SyncCounter()
    syncs.install()
    zeros = ZeroSizeWatch()
    zeros.install()
    result = generate(**kwargs)
    rank = dist.get_rank() if dist.is_initialized() else 0
    (Path(result_dir) / CALLS_NAME.format(rank=rank)).write_text(json.dumps(dict(double.calls)))
    (Path(result_dir) / SYNCS_NAME.format(rank=rank)).write_text(json.dumps(syncs.steps))
    (Path(result_dir) / ZEROS_NAME.format(rank=rank)).write_text(json.dumps(dict(zeros.ops)))
    return result
