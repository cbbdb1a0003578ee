"""Expert-parallel load balancing: where the physical experts (each a replica of one logical expert) of one MoE layer
go, given the tokens each logical expert took. The hierarchical policy of DeepSeek's published EPLB, written here
from its description:

1. **Groups to nodes.** The experts' groups (n_group of them; a token's top-k is first chosen among groups) are
   packed onto the nodes, heaviest group first, each onto the lightest node that still has room for a group, so
   every node gets n_group / nodes groups and the routing's group limit keeps a token's experts within few nodes.
2. **Replicas within a node.** Each node's logical experts get its physical slots: one replica each, then every
   further slot to the expert whose load per replica is the highest (a replica takes an equal share of its
   expert's tokens).
3. **Replicas to ranks.** Each node's replicas are packed onto its ranks the same way as step 1, heaviest replica
   first onto the lightest rank with a free slot: every rank gets the same number of slots.

When the groups do not divide over the nodes, the global policy runs instead: one group and one node, so every
expert competes for every slot. Longest-first packing of equal-count bins stays within 4/3 of the best maximum
when the items are whole (the LPT bound); tests/test_eplb.py measures it against exhaustive search.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsconv.errors import InputError


@dataclass(frozen=True)
class Placement:
    """One layer's physical experts: `physical[p]` is the logical expert physical slot p holds (slot p is on rank
    p // slots_per_rank); `replicas[e]` lists the slots holding logical expert e."""
    physical: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]

    def rank_loads(self, loads: list[float], ranks: int) -> list[float]:
        """The tokens each rank takes when an expert's tokens split evenly over its replicas."""
        per_rank = len(self.physical) // ranks
        out = [0.0] * ranks
        for slot, expert in enumerate(self.physical):
            out[slot // per_rank] += loads[expert] / len(self.replicas[expert])
        return out


def balancedness(rank_loads: list[float]) -> float:
    """Mean over max of the ranks' tokens (vLLM's and SGLang's figure): 1 is perfect balance."""
    top = max(rank_loads)
    return 1.0 if top == 0 else sum(rank_loads) / len(rank_loads) / top


def pack(weights: list[float], bins: int) -> list[list[int]]:
    """Items into `bins` bins of len(weights) / bins items each, longest first onto the lightest bin with room ->
    the items of each bin (ties: the lower item, then the lower bin)."""
    per_bin = len(weights) // bins
    contents: list[list[int]] = [[] for _ in range(bins)]
    totals = [0.0] * bins
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_bins = [b for b in range(bins) if len(contents[b]) < per_bin]
        target = min(open_bins, key=lambda b: (totals[b], b))
        contents[target].append(item)
        totals[target] += weights[item]
    return contents


def replicate(loads: list[float], slots: int) -> list[int]:
    """Replica counts for experts with these loads over `slots` slots: one each, then each further slot to the
    expert with the highest load per replica (ties: the lower expert)."""
    counts = [1] * len(loads)
    for _ in range(slots - len(loads)):
        hottest = max(range(len(loads)), key=lambda e: (loads[e] / counts[e], -e))
        counts[hottest] += 1
    return counts


def place(loads: list[float], slots: int, groups: int, nodes: int, ranks: int) -> Placement:
    """The hierarchical placement (the module's docstring) of len(loads) logical experts over `slots` physical
    slots on `ranks` ranks of `nodes` nodes, the experts in `groups` equal groups; the global policy when the
    groups do not divide over the nodes."""
    experts = len(loads)
    _check(experts, slots, groups, nodes, ranks)
    if groups % nodes:
        groups, nodes = 1, 1
    group_size, node_slots, node_ranks = experts // groups, slots // nodes, ranks // nodes
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    physical: list[int] = []
    for node_groups in pack(group_loads, nodes):
        members = [g * group_size + i for g in sorted(node_groups) for i in range(group_size)]
        counts = replicate([loads[e] for e in members], node_slots)
        copies = [expert for expert, count in zip(members, counts) for _ in range(count)]
        shares = [loads[expert] / count for expert, count in zip(members, counts) for _ in range(count)]
        for rank_items in pack(shares, node_ranks):
            physical += [copies[i] for i in sorted(rank_items)]
    replicas: list[list[int]] = [[] for _ in range(experts)]
    for slot, expert in enumerate(physical):
        replicas[expert].append(slot)
    return Placement(tuple(physical), tuple(tuple(r) for r in replicas))


def _check(experts: int, slots: int, groups: int, nodes: int, ranks: int) -> None:
    if slots < experts:
        raise InputError(f"{slots} physical expert slots cannot hold {experts} logical experts")
    if slots % ranks:
        raise InputError(f"{slots} physical experts ({slots - experts} redundant) do not divide over {ranks} EP "
                         f"ranks: the redundant experts must make the total a multiple of the EP size")
    if ranks % nodes or experts % groups:
        raise InputError(f"{ranks} ranks over {nodes} nodes, {experts} experts in {groups} groups: each must "
                         f"divide evenly")
    if groups % nodes == 0 and slots // nodes < experts // nodes:
        raise InputError(f"{slots // nodes} slots per node cannot hold its {experts // nodes} experts")
