"""Ascend's MC2 expert-parallel step: torch_npu.npu_moe_distribute_dispatch_v2 sends each token's row to its k
experts' ranks, their counts exchanged inside the op (and, for W8A8 experts, the rows quantized to INT8 per token
before they leave, quant_mode 2); npu_moe_distribute_combine_v2 brings the experts' outputs back and sums them with
the routing weights. Two ops per MoE layer, as vllm-ascend's MC2 path runs them (vllm_ascend/ops/fused_moe/
token_dispatcher.py). In CI the ops run against the contract double (tests/npu_double.py), which models them over
gloo with the documented parameters and limits.

What the documentation fixes (torch_npu's npu_moe_distribute_dispatch_v2 and _combine_v2, Atlas A3), and how the
step meets it:
- every rank's x is [BS, H] with 0 < BS <= 512: every rank pads its rows to the step's most (Dist.most_moe_rows,
  the same on every rank), an idle rank included, and marks the real ones in x_active_mask (True first; a mask
  is allowed because every rank's BS is equal). The padding rows name experts 0 .. k - 1 (valid, distinct) and
  never travel.
- expert_ids [BS, K] int32, K <= 16, the K ids of a row distinct: a router's top-k. A hash layer's table may name
  an expert twice, so hash layers take the all-to-all path.
- H in [1024, 7168] (dispatch takes up to 8192, combine 7168), x BF16 or FP16, at most 512 routed experts
  (combine's bound; it also asks experts per rank x EP size <= 1280, which that implies), EP size in
  [2, 384], experts divisible by the EP size.
- HCCL_BUFFSIZE (MB, default 200) at least 2 x (local experts x BS x EP x Align512(Align32(2H) + 64)
  + (K + shared experts) x BS x Align512(2H)) bytes; the shared experts stay outside the op here (0).
- expand_x holds A rows, A >= global_bs x min(local experts, K), grouped by local expert, expert_token_nums rows
  each; the rest are not rows. The grouped matmul takes exactly its groups' rows, so the real ones are read back
  (one host sync per layer, as the all-to-all path's counts) and the outputs padded back to A rows for the combine,
  which takes expand_x as [A, H].
Outside any of these the step takes the all-to-all path (models/moe.py); `fits` says which, alike on every rank.
"""

from __future__ import annotations

import os

import torch
from torch.profiler import record_function

from dsconv.comm.groups import hccl_comm_name
from dsconv.kernels.device import is_npu, require_torch_npu
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.layers import RoutedExperts

MAX_TOKENS = 512  # BS per rank, A3 (A2: 256)
MAX_TOP_K = 16
HIDDEN = (1024, 7168)  # combine_v2's range on A3, inside dispatch_v2's [1024, 8192]
MAX_EXPERTS = 512  # combine_v2's moe_expert_num on A3 (dispatch_v2 takes 1024)
EP_SIZES = (2, 384)  # combine_v2's ep_world_size on A3 (dispatch_v2 takes 768)
DTYPES = (torch.bfloat16, torch.float16)
HCCL_BUFFSIZE_ENV, HCCL_BUFFSIZE_DEFAULT_MB = "HCCL_BUFFSIZE", 200
QUANT_NONE, QUANT_DYNAMIC = 0, 2  # dispatch_v2's quant_mode: rows as they are, or INT8 per token with scales
SHARED_EXPERTS_IN_OP = 0  # the shared experts run beside the op (models/moe.py), not inside it
COUNTS_AS_SIZES = 1  # expert_token_nums_type 1: rows per local expert (0 would give their running sums)
DISPATCH, COMBINE = "dsrun.moe.mc2_dispatch", "dsrun.moe.mc2_combine"  # the ops' names in a profiler trace


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def buffer_bytes(local_experts: int, most: int, ep: int, hidden: int, k: int) -> int:
    """The HCCL buffer the A3 documentation asks for one communicator at BS = most ("fullmesh_v1", the default
    algorithm)."""
    row = _align(_align(2 * hidden, 32) + 64, 512)
    return 2 * (local_experts * most * ep * row + (k + SHARED_EXPERTS_IN_OP) * most * _align(2 * hidden, 512))


def hccl_buffer_bytes() -> int:
    """HCCL_BUFFSIZE in bytes: the environment's (in MB), else HCCL's default."""
    return int(os.environ.get(HCCL_BUFFSIZE_ENV, HCCL_BUFFSIZE_DEFAULT_MB)) * 2**20


def fits(x: torch.Tensor, k: int, local: RoutedExperts, dist: Dist, distinct: bool) -> bool:
    """Whether this step's MoE layer takes MC2: the NPU path with its communicator, a step plan, and every limit
    of the module docstring. Every rank decides alike: each input is the same on every rank (the plan's most rows,
    the layer's shapes, the environment a launcher gives every rank)."""
    groups = dist.groups
    if not is_npu(x) or groups is None or groups.mc2 is None or not distinct or x.dtype not in DTYPES:
        return False
    most = dist.most_moe_rows()
    experts, ep, hidden = local.n_physical, dist.ep, x.shape[1]
    if most is None or not 0 < most <= MAX_TOKENS or not 0 < k <= MAX_TOP_K:
        return False
    if not HIDDEN[0] <= hidden <= HIDDEN[1] or not EP_SIZES[0] <= ep <= EP_SIZES[1]:
        return False
    if experts > MAX_EXPERTS or experts % ep:
        return False
    return buffer_bytes(experts // ep, most, ep, hidden, k) <= hccl_buffer_bytes()


def routed(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, local: RoutedExperts, dist: Dist,
           during_dispatch) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] through dispatch_v2 and combine_v2 (the caller checked `fits`);
    during_dispatch (if given) runs once, after the dispatch is issued."""
    torch_npu = require_torch_npu()
    group = dist.groups.mc2
    name = hccl_comm_name(group, x.device)
    rows, k = experts.shape
    most = dist.most_moe_rows()
    padding = most - rows
    ids = experts.to(torch.int32)
    if padding:  # rows that never travel: zeros, naming valid distinct experts
        x = torch.cat([x, x.new_zeros(padding, x.shape[1])])
        ids = torch.cat([ids, torch.arange(k, dtype=torch.int32, device=ids.device).expand(padding, k)])
        weights = torch.cat([weights, weights.new_zeros(padding, k)])
    active = torch.arange(most, device=x.device) < rows
    common = dict(group_ep=name, ep_world_size=dist.ep, ep_rank_id=group.rank, moe_expert_num=local.n_physical,
                  shared_expert_num=SHARED_EXPERTS_IN_OP, global_bs=most * dist.ep)
    with dist.timed(), record_function(DISPATCH):
        expand_x, scales, assist, counts, ep_counts, tp_counts, _ = torch_npu.npu_moe_distribute_dispatch_v2(
            x, ids, x_active_mask=active, quant_mode=QUANT_DYNAMIC if local.int8 else QUANT_NONE,
            expert_token_nums_type=COUNTS_AS_SIZES, **common)
    if during_dispatch is not None:
        during_dispatch()
    arrived = int(counts.sum())  # the one host sync: the grouped matmul takes exactly its groups' rows
    out = x.new_zeros(expand_x.shape[0], x.shape[1])
    if arrived:
        x_scale = scales[:arrived, None] if local.int8 else None
        out[:arrived] = local(expand_x[:arrived], counts, x_scale, x.dtype)
    with dist.timed(), record_function(COMBINE):
        combined = torch_npu.npu_moe_distribute_combine_v2(out, ids, assist, ep_counts, weights.float(),
                                                            x_active_mask=active, tp_send_counts=tp_counts, **common)
    return combined[:rows]

