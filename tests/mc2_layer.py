"""The rank entry of tests/test_mc2.py: one MoE layer at EP16 on the torch_npu contract double, through MC2
(npu_moe_distribute_dispatch_v2 / combine_v2) and through the all-to-all path, on the same rows and weights.
Light imports: every rank imports this module."""

from pathlib import Path

WEIGHT_SEED, ROWS_SEED = 1234, 99


def layer_experts(n_experts: int, hidden: int, inter: int, int8: bool):
    """Every rank's copy of the layer's experts, stacked: (w13 [E, 2I, H], w2 [E, H, I], scales or None)."""
    import torch

    from dsconv.kernels.int8 import quantize_rows_reference

    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    w13 = torch.randn(n_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(n_experts, hidden, inter, generator=gen) / inter ** 0.5
    if not int8:
        return w13.to(torch.bfloat16), w2.to(torch.bfloat16), None, None
    (q13, s13), (q2, s2) = (quantize_rows_reference(w.flatten(0, 1)) for w in (w13, w2))
    return (q13.view(w13.shape), q2.view(w2.shape), s13.view(*w13.shape[:2], 1), s2.view(*w2.shape[:2], 1))


def rank_rows(rank: int, rows: int, hidden: int, n_experts: int, k: int):
    """This rank's tokens: x [rows, H] BF16, their k distinct experts and float32 routing weights."""
    import torch

    gen = torch.Generator().manual_seed(ROWS_SEED + rank)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    scores = torch.rand(rows, n_experts, generator=gen)
    weights, experts = scores.topk(k, dim=-1)
    return x, experts, weights / weights.sum(-1, keepdim=True)


def mc2_layer(result_dir: str, hidden: int, n_experts: int, inter: int, k: int, rows: list[int], int8: bool,
              redundant: int = 0) -> None:
    """On every rank: install the double, build EP16's groups (MC2's communicator among them), plan the step from
    `rows` (each rank's tokens), and run the layer through MC2 and through the all-to-all path (a hash layer's
    `distinct=False` takes it). redundant: physical experts beyond the logical ones, placed round-robin
    (family/expert_map.py), which both paths route to (MC2 then takes physical ids). Writes rank{R}.pt: both
    outputs, the op calls of each run, and how many all_to_all_single calls each made."""
    import torch
    import torch.distributed as dist

    from dsconv.family.expert_map import ExpertMap
    from dsconv.family.layout import Layout
    from dsconv.kernels.moe import ExpertWeights
    from dsconv.runner.models.dist import Dist
    from dsconv.runner.models.eplb import ExpertRouting
    from dsconv.runner.models.layers import RoutedExperts
    from dsconv.runner.models.moe import expert_parallel
    from tests.npu_double import forbid_cpu_int8_path, install

    double = install()
    forbid_cpu_int8_path()
    exchanges = {"all_to_all_single": 0}
    all_to_all = dist.all_to_all_single

    def counted(*args, **kwargs):
        exchanges["all_to_all_single"] += 1
        return all_to_all(*args, **kwargs)

    dist.all_to_all_single = counted
    world = dist.get_world_size()
    mesh = Dist.from_layout(Layout(world, ep=world, tp=world, attn_tp=1), torch.device("cpu"))
    mesh.plan_step([(n, n) for n in rows])
    w13, w2, s13, s2 = layer_experts(n_experts, hidden, inter, int8)
    physical = ExpertMap.round_robin(["layer"], n_experts, redundant, mesh.ep).layers["layer"]
    local = RoutedExperts.__new__(RoutedExperts)  # the runner's class, its weights from tensors, not a shard
    local.experts, local.n_physical, local.limit = n_experts, len(physical), None
    mine = list(physical[mesh.ep_rank * len(physical) // mesh.ep:(mesh.ep_rank + 1) * len(physical) // mesh.ep])
    local.ids = tuple(mine)
    local.routing = ExpertRouting(physical, n_experts, torch.device("cpu")) if redundant else None
    local.weights = ExpertWeights(w13[mine], w2[mine], None if s13 is None else s13[mine],
                                  None if s2 is None else s2[mine])
    local.int8, local.kernels = int8, mesh.kernels
    x, experts, weights = rank_rows(mesh.rank, rows[mesh.rank], hidden, n_experts, k)

    def shared(rows):
        return rows * 0.5

    runs = {}
    for name, distinct in (("mc2", True), ("all_to_all", False)):
        double.calls.clear()
        exchanges["all_to_all_single"] = 0
        out = expert_parallel(x, experts, weights, local, mesh, shared, distinct=distinct)
        runs[name] = {"out": out, "calls": dict(double.calls), "all_to_all_single": exchanges["all_to_all_single"]}
    torch.save(runs, Path(result_dir) / f"rank{mesh.rank}.pt")
