"""The process groups of one layout: attention TP, attention DP, MoE EP, lm_head TP, o_proj and embedding TP, and
the world; and the runner's context-parallel prefill groups (`cp_size` consecutive attention-DP ranks, a choice
made at run time, not in the shards).

Membership comes from `family.layout.Layout.groups()`, the same table the shard writer used, so a rank reads
exactly the shard its groups expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsconv.family.layout import Layout

GROUP_NAMES = ("attn_tp", "attn_dp", "ep", "tp", "oproj_tp", "embed_tp")


@dataclass(frozen=True)
class Group:
    name: str
    ranks: tuple[int, ...]  # global ranks in group-rank order (torch sorts them; so does Layout)
    rank: int  # this process's index in `ranks`
    handle: dist.ProcessGroup | None  # None for a group of one: it never communicates

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Groups:
    world: Group
    attn_tp: Group
    attn_dp: Group
    ep: Group
    tp: Group
    oproj_tp: Group
    embed_tp: Group
    cp: Group
    host: Group  # the world over gloo, whatever the device: what travels between hosts (the engine's step plan)
    # the EP members again, in a communicator of their own, for Ascend's MC2 dispatch and combine
    # (npu_moe_distribute_dispatch_v2 / combine_v2), whose documentation allows no other op in their communicator;
    # made only for the NPU path (make_groups' mc2) and EP > 1, else None
    mc2: Group | None = None


def cp_members(layout: Layout, cp_size: int) -> list[list[int]]:
    """The context-parallel groups: cp_size consecutive attention-DP ranks each (attention TP 1: a DP index is a
    rank); with cp_size 1, every rank alone."""
    if cp_size == 1:
        return [[rank] for rank in range(layout.world_size)]
    if layout.dp % cp_size or (cp_size > 1 and layout.attn_tp != 1):
        raise ValueError(f"a context-parallel group of {cp_size} needs attention TP 1 and a size dividing the "
                         f"attention-DP size; the layout has attention DP {layout.dp} x TP {layout.attn_tp}")
    return [list(range(first, first + cp_size)) for first in range(0, layout.dp, cp_size)]


def make_groups(layout: Layout | dict, cp_size: int = 1, mc2: bool = False) -> Groups:
    """Call on every rank, after init_process_group, with the same layout (the manifest's), cp_size and mc2 (a
    communicator of its own for the MC2 ops, Groups.mc2)."""
    layout = _as_layout(layout)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != layout.world_size:
        raise ValueError(f"the process group has {world_size} ranks but the layout has "
                         f"world_size={layout.world_size}")
    world_ranks = tuple(range(world_size))
    # new_group is itself collective: every rank must call it for every group, members or not, in the same
    # order, because torch names groups by a per-process counter and meets peers under that name in the
    # store. The loop below depends only on the layout, which is identical on every rank, so the sequence of
    # calls is too; that also holds for the groups it skips (size 1) or reuses (the world, repeated members).
    handles: dict[tuple[int, ...], dist.ProcessGroup | None] = {
        world_ranks: dist.group.WORLD if world_size > 1 else None}
    mine: dict[str, Group] = {}
    for name, member_lists in [*layout.groups().items(), ("cp", cp_members(layout, cp_size))]:
        for members in map(tuple, member_lists):
            if list(members) != sorted(members):
                raise ValueError(f"{name} group {members} is not sorted; torch would renumber its ranks")
            if members not in handles:
                handles[members] = dist.new_group(list(members)) if len(members) > 1 else None
            if rank in members:
                mine[name] = Group(name, members, members.index(rank), handles[members])
    world = Group("world", world_ranks, rank, handles[world_ranks])
    # the step plan and the results are host objects: over gloo they never touch an accelerator (HCCL or NCCL
    # would copy them to the device and back, a host sync each way); on CPU the world already is gloo
    host = world
    if world_size > 1 and dist.get_backend() != dist.Backend.GLOO:
        host = Group("host", world_ranks, rank, dist.new_group(list(world_ranks), backend=dist.Backend.GLOO))
    mc2_group = None
    if mc2 and layout.ep > 1:  # one more new_group per EP group, in the same order on every rank (see above)
        for members in map(tuple, layout.groups()["ep"]):
            handle = dist.new_group(list(members))
            if rank in members:
                mc2_group = Group("mc2", members, members.index(rank), handle)
    return Groups(world=world, host=host, mc2=mc2_group, **{name: mine[name] for name in (*GROUP_NAMES, "cp")})


def hccl_comm_name(group: Group, device: torch.device) -> str:
    """The name HCCL knows the group's communicator by, which torch_npu's MC2 ops take as their group (got as
    torch_npu's own examples and vllm-ascend get it: the group's backend for the device, asked with this process's
    global rank)."""
    return group.handle._get_backend(device).get_hccl_comm_name(group.ranks[group.rank])


def _as_layout(layout: Layout | dict) -> Layout:
    if isinstance(layout, Layout):
        return layout
    built = Layout.from_json(layout)
    if "groups" in layout and layout["groups"] != built.groups():
        raise ValueError(f"the manifest's layout groups {layout['groups']} disagree with the groups its sizes "
                         f"give: {built.groups()}")
    return built
