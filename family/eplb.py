"""Expert-parallel load balancing: where the physical experts (each a replica of one logical expert) of one MoE layer
go, given the tokens each logical expert took. The hierarchical policy of DeepSeek's published EPLB, written here
from its description, with two changes of ours (below):

1. **Groups to nodes.** The experts' groups (n_group of them; a token's top-k is first chosen among groups) are
   packed onto the nodes, heaviest group first, each onto the lightest node that still has room for a group, so
   every node gets n_group / nodes groups and the routing's group limit keeps a token's experts within few nodes.
2. **Replicas within a node.** Each node's logical experts get its physical slots: one replica each, then further
   slots to the expert whose load per replica is the highest (a replica takes an equal share of its expert's
   tokens).
3. **Replicas to ranks.** Each node's replicas are packed onto its ranks the same way as step 1, heaviest replica
   first onto the lightest rank with a free slot: every rank gets the same number of slots.

Ours:
- **Replicas apart.** No rank holds two replicas of one expert (a second one there would take no load off any
  rank, and a rank's experts are then named by their logical ids: the shards and the runner's stacks rely on it).
  So an expert has at most as many replicas as its node has ranks, and step 3 puts a replica only on a rank without
  its expert; when the only ranks with room hold it, one replica of another expert moves over to make room (one
  always can: a full rank without the expert holds an expert the open rank lacks, having more distinct experts).
- **How many replicas go to the hottest.** Step 2's greedy rule alone can overshoot: with 4 equally hot experts
  and 16 ranks, 16 extra slots give each 5 replicas, 20 hot replicas that 16 ranks cannot share evenly (mean over
  max 0.625), where 4 each (and the other slots to cold experts) split exactly. So step 2 is run with the first j
  extra slots given by the greedy rule and the rest to the coolest experts, for every j (up to CANDIDATES of them,
  else that many spread evenly), and the j whose packing gives the lowest busiest rank is kept (ties: the larger j).

When the groups do not divide over the nodes (or a node's ranks have more slots each than its groups have experts),
the global policy runs instead: one group and one node, so every expert competes for every slot. Longest-first packing of equal-count bins stays within 4/3 of the best maximum
when the items are whole (the LPT bound); tests/test_eplb.py measures it against exhaustive search.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsconv.errors import InputError

# The most replica counts step 2 tries a node (the module's docstring): each costs a packing of the node's replicas,
# and a rebalance computes every layer's in one step. 33 covers every j of 32 extra slots a node (vLLM's suggested R);
# at V3's 256 experts on 64 ranks with 256 extra slots, 33 candidates take about 0.3 s a layer on one core.
CANDIDATES = 33


@dataclass(frozen=True)
class Placement:
    """One layer's physical experts: `physical[p]` is the logical expert physical slot p holds (slot p is on rank
    p // slots_per_rank; a rank's slots in ascending logical order); `replicas[e]` lists the slots holding logical
    expert e."""
    physical: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, physical: list[int], experts: int) -> "Placement":
        replicas: list[list[int]] = [[] for _ in range(experts)]
        for slot, expert in enumerate(physical):
            replicas[expert].append(slot)
        return cls(tuple(physical), tuple(tuple(r) for r in replicas))

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


def pack(weights: list[float], bins: int, kinds: list[int] | None = None) -> list[list[int]]:
    """Items into `bins` bins of len(weights) / bins items each, longest first onto the lightest bin with room ->
    the items of each bin (ties: the lower item, then the lower bin). kinds: items of one kind go to different bins
    (the module's docstring: replicas apart); the caller keeps each kind's count within `bins`."""
    per_bin = len(weights) // bins
    contents: list[list[int]] = [[] for _ in range(bins)]
    totals = [0.0] * bins
    held: list[set[int]] = [set() for _ in range(bins)]
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        kind = item if kinds is None else kinds[item]
        open_bins = [b for b in range(bins) if len(contents[b]) < per_bin]
        apart = [b for b in open_bins if kind not in held[b]]
        target = min(apart or open_bins, key=lambda b: (totals[b], b))
        if not apart:  # every bin with room holds this kind: a full bin without it gives one item up
            target = _make_room(target, kind, contents, held, totals, weights, kinds)
        contents[target].append(item)
        totals[target] += weights[item]
        held[target].add(kind)
    return contents


def _make_room(open_bin: int, kind: int, contents: list[list[int]], held: list[set[int]], totals: list[float],
               weights: list[float], kinds: list[int]) -> int:
    """Moves the lightest item that `open_bin` lacks the kind of, from the lightest full bin without `kind`, into
    open_bin -> that full bin, which now has room for `kind`."""
    donors = [b for b in range(len(contents)) if kind not in held[b]]
    donor = min(donors, key=lambda b: (totals[b], b))
    moved = min((i for i in contents[donor] if kinds[i] not in held[open_bin]), key=lambda i: (weights[i], i))
    contents[donor].remove(moved)
    held[donor].discard(kinds[moved])
    totals[donor] -= weights[moved]
    contents[open_bin].append(moved)
    held[open_bin].add(kinds[moved])
    totals[open_bin] += weights[moved]
    return donor


def replicate(loads: list[float], slots: int, cap: int | None = None, greedy: int | None = None) -> list[int]:
    """Replica counts for experts with these loads over `slots` slots, at most `cap` each: one each, then the first
    `greedy` further slots (default: all) each to the expert with the highest load per replica (ties: the lower
    expert), the rest each to the one with the lowest."""
    counts = [1] * len(loads)
    cap = slots if cap is None else cap
    extra = slots - len(loads)
    greedy = extra if greedy is None else greedy
    for step in range(extra):
        room = [e for e in range(len(loads)) if counts[e] < cap]
        if step < greedy:
            chosen = max(room, key=lambda e: (loads[e] / counts[e], -e))
        else:
            chosen = min(room, key=lambda e: (loads[e] / counts[e], e))
        counts[chosen] += 1
    return counts


def _greedy_shares(extra: int) -> list[int]:
    """The j (extra slots given by the greedy rule) tried: every j up to CANDIDATES of them, else CANDIDATES spread
    evenly from all of them to none (a rebalance computes every layer's placement in one step)."""
    if extra < CANDIDATES:
        return list(range(extra, -1, -1))
    return sorted({round(extra * i / (CANDIDATES - 1)) for i in range(CANDIDATES)}, reverse=True)


def _node_placement(loads: list[float], slots: int, ranks: int) -> list[int]:
    """One node's experts (loads, local indices) over its slots on its ranks -> the local expert of each slot, rank
    by rank, each rank's in ascending order: the best of step 2's greedy shares (the module's docstring)."""
    best: tuple[float, list[int]] | None = None
    for greedy in _greedy_shares(slots - len(loads)):
        counts = replicate(loads, slots, ranks, greedy)
        copies = [expert for expert, count in enumerate(counts) for _ in range(count)]
        shares = [loads[expert] / counts[expert] for expert in copies]
        bins = pack(shares, ranks, copies)
        top = max(sum(shares[i] for i in b) for b in bins)
        if best is None or top < best[0]:
            best = (top, [copies[i] for b in bins for i in sorted(b)])
    return best[1]


def place(loads: list[float], slots: int, groups: int, nodes: int, ranks: int) -> Placement:
    """The hierarchical placement (the module's docstring) of len(loads) logical experts over `slots` physical
    slots on `ranks` ranks of `nodes` nodes, the experts in `groups` equal groups; the global policy when the
    groups do not divide over the nodes."""
    experts = len(loads)
    if nodes < 1 or ranks % nodes:
        raise InputError(f"{ranks} EP ranks do not divide over {nodes} nodes")
    if groups % nodes or experts % groups or slots // ranks > experts // nodes:
        groups, nodes = 1, 1  # the global policy (a node's ranks would need more experts than its groups hold)
    _check(experts, slots, groups, nodes, ranks)
    group_size, node_slots, node_ranks = experts // groups, slots // nodes, ranks // nodes
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    physical: list[int] = []
    for node_groups in pack(group_loads, nodes):
        members = [g * group_size + i for g in sorted(node_groups) for i in range(group_size)]
        physical += [members[i] for i in _node_placement([loads[e] for e in members], node_slots, node_ranks)]
    return Placement.of(physical, experts)


def _check(experts: int, slots: int, groups: int, nodes: int, ranks: int) -> None:
    if slots < experts:
        raise InputError(f"{slots} physical expert slots cannot hold {experts} logical experts")
    if slots % ranks:
        raise InputError(f"{slots} physical experts ({slots - experts} redundant) do not divide over {ranks} EP "
                         f"ranks: the redundant experts must make the total a multiple of the EP size")
    node_experts = experts // nodes
    if slots // ranks > node_experts:
        raise InputError(f"{slots // ranks} slots per rank exceed the {node_experts} experts a node holds: a rank "
                         f"holds at most one replica of each")
