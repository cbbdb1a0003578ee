"""family/eplb.py's placement on its own: every logical expert placed, every rank's slots full, a node's groups kept
on its ranks, and the max rank load against the best any placement reaches (exhaustive search on small cases)."""

import itertools
import random

import pytest

from dsconv.errors import InputError
from dsconv.family.eplb import balancedness, pack, place, replicate

LPT_BOUND = 4 / 3  # longest-first packing of whole items into equal-count bins stays within this of the best
# The whole policy (replica counts, then packing) against the best of every replica count and assignment, replicas on
# one rank allowed (so the search's optimum is at most the best placement with replicas apart). Measured worst over
# the cases below: 1.138 (4 experts on 4 ranks of 2 slots). Greedy replica counts alone (DeepSeek's step 2) measured
# 1.568 on the same cases: a hot expert's 5 replicas on 4 ranks. Asserted: within the packing's 4/3; the cases are
# seeded, so the figure is the same on every machine.
JOINT_BOUND = LPT_BOUND


def best_max_load(loads: list[float], slots: int, ranks: int) -> float:
    """The smallest max rank load over every replica count (one or more each, `slots` in all) and every assignment
    of the replicas to ranks of slots / ranks each, an expert's tokens split evenly over its replicas."""
    best = float("inf")
    per_rank = slots // ranks
    for cuts in itertools.combinations(range(1, slots), len(loads) - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, slots))]
        shares = sorted((loads[e] / c for e, c in enumerate(counts) for _ in range(c)), reverse=True)
        best = min(best, _best_split(shares, ranks, per_rank, best))
    return best


def _best_split(shares: list[float], ranks: int, per_rank: int, bound: float) -> float:
    """The smallest max bin total over splits of shares into `ranks` bins of per_rank items (pruned at bound)."""
    best = bound

    def go(i: int, totals: list[float], sizes: list[int]) -> None:
        nonlocal best
        if max(totals) >= best:
            return
        if i == len(shares):
            best = max(totals)
            return
        seen = set()
        for b in range(ranks):
            if sizes[b] < per_rank and (totals[b], sizes[b]) not in seen:
                seen.add((totals[b], sizes[b]))
                totals[b] += shares[i]
                sizes[b] += 1
                go(i + 1, totals, sizes)
                totals[b] -= shares[i]
                sizes[b] -= 1

    go(0, [0.0] * ranks, [0] * ranks)
    return best


@pytest.mark.parametrize("experts,slots,ranks", [(4, 6, 2), (5, 6, 2), (6, 8, 2), (4, 8, 4), (6, 8, 4), (3, 6, 3)])
def test_the_global_policy_against_exhaustive_search(experts, slots, ranks):
    rng = random.Random(experts * 100 + slots * 10 + ranks)
    worst = 1.0
    for _ in range(25):
        loads = [rng.choice([1, 2, 3, 5, 8, 40, 100]) * rng.random() for _ in range(experts)]
        placement = place(loads, slots, groups=1, nodes=1, ranks=ranks)
        assert sorted(set(placement.physical)) == list(range(experts))  # every expert at least once
        assert all(placement.replicas[e] for e in range(experts)) and len(placement.physical) == slots
        per_rank = slots // ranks
        for r in range(ranks):  # replicas apart, each rank's in ascending order
            held = placement.physical[r * per_rank:(r + 1) * per_rank]
            assert list(held) == sorted(set(held))
        got = max(placement.rank_loads(loads, ranks))
        assert sum(placement.rank_loads(loads, ranks)) == pytest.approx(sum(loads))  # every token somewhere
        worst = max(worst, got / best_max_load(loads, slots, ranks))
    assert worst <= JOINT_BOUND, worst
    print(f"experts {experts}, slots {slots}, ranks {ranks}: worst max-load ratio to the optimum {worst:.4f}")


def test_packing_against_exhaustive_search():
    """The packing step alone (pack) against the best split of the same items into equal-count bins."""
    worst = 1.0
    for trial in range(300):
        rng = random.Random(trial)
        ranks, per_rank = rng.choice([2, 3, 4]), rng.choice([2, 3])
        weights = [rng.choice([1, 2, 3, 5, 8, 40, 100]) * rng.random() for _ in range(ranks * per_rank)]
        bins = pack(weights, ranks)
        assert sorted(i for b in bins for i in b) == list(range(len(weights)))
        assert all(len(b) == per_rank for b in bins)
        got = max(sum(weights[i] for i in b) for b in bins)
        worst = max(worst, got / _best_split(sorted(weights, reverse=True), ranks, per_rank, float("inf")))
    assert worst <= LPT_BOUND, worst
    print(f"packing: worst max-load ratio to the optimum {worst:.4f}")


def test_the_hierarchical_policy_keeps_each_nodes_groups_on_its_ranks():
    rng = random.Random(7)
    loads = [rng.expovariate(1.0) * (20 if e in (3, 12) else 1) for e in range(16)]  # two hot experts
    groups, nodes, ranks, slots = 4, 2, 4, 24
    placement = place(loads, slots, groups, nodes, ranks)
    per_rank, group_size = slots // ranks, 16 // groups
    node_of_group = {}
    for slot, expert in enumerate(placement.physical):
        node = slot // per_rank // (ranks // nodes)
        assert node_of_group.setdefault(expert // group_size, node) == node  # a group's replicas on one node
    assert sorted(node_of_group.values()) == [0, 0, 1, 1]  # two groups a node
    assert len(placement.replicas[3]) > 1 and len(placement.replicas[12]) > 1  # the hot experts replicated
    before = [sum(loads[e] for e in range(r * 4, r * 4 + 4)) for r in range(ranks)]  # 4 experts a rank, no EPLB
    assert balancedness(placement.rank_loads(loads, ranks)) > balancedness(before)


def test_groups_that_do_not_divide_over_the_nodes_take_the_global_policy():
    loads = [float(e + 1) for e in range(6)]
    assert place(loads, 8, groups=3, nodes=2, ranks=2) == place(loads, 8, groups=1, nodes=1, ranks=2)
    # 2 nodes of 3 experts each, but 4 slots a rank: only the global policy can fill a rank with distinct experts
    assert place(loads, 8, groups=2, nodes=2, ranks=2) == place(loads, 8, groups=1, nodes=1, ranks=2)


@pytest.mark.parametrize("experts,hot,slots", [(64, 4, 80), (32, 2, 48)])
def test_a_few_equally_hot_experts_split_exactly(experts, hot, slots):
    """tests/test_skewed_routing.py's workload at world 16 with 16 redundant experts: every token to the same `hot`
    experts. The greedy rule alone gives each hot expert 20 / hot replicas, which 16 ranks cannot share evenly
    (0.625 for V3.2's 4); the best j gives 16 hot replicas, one a rank."""
    loads = [30.0] * hot + [0.0] * (experts - hot)
    placement = place(loads, slots, groups=1, nodes=1, ranks=16)
    assert balancedness(placement.rank_loads(loads, 16)) == 1.0
    assert sum(len(placement.replicas[e]) for e in range(hot)) == 16


def test_the_parts():
    assert replicate([10.0, 1.0, 4.0], 6) == [3, 1, 2]  # 10/3 > 4/2 > 10/4: the fifth slot to 0, the sixth to 2
    assert pack([5.0, 4.0, 3.0, 3.0], 2) == [[0, 3], [1, 2]]
    assert replicate([10.0, 1.0, 4.0], 6, cap=2) == [2, 2, 2]  # at most 2 each
    assert replicate([10.0, 1.0, 4.0], 6, greedy=1) == [2, 3, 1]  # one by the greedy rule, two to the coolest
    assert pack([5.0, 4.0, 3.0, 1.0], 2, kinds=[0, 1, 2, 0]) == [[0, 2], [1, 3]]  # kind 0 apart
    # the last item (kind 4) finds the only open bin holding kind 4: the full bin gives up its lightest item that
    # the open bin lacks (item 1), and takes it
    assert pack([10.0, 3.0, 3.0, 3.0, 1.0, 1.0], 2, kinds=[0, 1, 2, 3, 4, 4]) == [[0, 4, 1], [2, 3, 5]]
    assert balancedness([1.0, 1.0]) == 1.0 and balancedness([3.0, 1.0]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("args,needle", [
    ((4, 3, 1, 1, 1), "cannot hold 4 logical experts"),
    ((4, 7, 1, 1, 2), "do not divide over 2 EP ranks"),
    ((4, 8, 1, 3, 4), "do not divide over 3 nodes"),
    ((4, 12, 1, 1, 2), "exceed the 4 experts a node holds"),
])
def test_bad_input(args, needle):
    experts, slots, groups, nodes, ranks = args
    with pytest.raises(InputError, match=needle):
        place([1.0] * experts, slots, groups, nodes, ranks)


# -- the balancer's bookkeeping over a long run (runner/models/eplb.py) -------------------------------------------


class _Layer:
    """A MoE layer as ExpertBalancer sees it: its routing, moved in place."""

    def __init__(self, prefix: str, experts: int):
        import torch

        from dsconv.runner.models.eplb import ExpertRouting

        self.prefix, self.experts, self.n_physical = prefix, experts, experts
        self.routing = ExpertRouting(tuple(range(experts)), experts, torch.device("cpu"))

    def counted(self) -> None:
        pass

    def move(self, physical, dist) -> None:
        self.routing.set(physical)


def test_balancer_history_is_bounded_and_skipped_rebalances_are_counted():
    """Issue 71: every rebalance's figures were kept for the life of the server, and a rebalance that fell due
    while the last one's moves were pending was dropped without a word."""
    import types

    import torch

    from dsconv.runner.models.eplb import HISTORY, EplbConfig, ExpertBalancer

    layers = [_Layer(f"layers.{i}.mlp", 4) for i in range(2)]
    dist = types.SimpleNamespace(experts=layers, groups=None, ep=2, rank=0)
    balancer = ExpertBalancer(dist, None, EplbConfig(window_size=1, step_interval=1), None, 1, 1)
    skew = [torch.tensor([100, 1, 1, 1]), torch.tensor([1, 1, 1, 100])]
    steps = 3 * HISTORY
    for step in range(steps):
        for layer in layers:  # expert 0, then expert 3, is hot: the best placement keeps changing
            load = skew[step // 2 % 2]
            layer.routing.logical_counts += load
            layer.routing.physical_counts += load[list(layer.routing.physical)]
        balancer.before_step()
    assert balancer.skipped > 0  # two layers, one moved a step: every other due step finds a move pending
    assert balancer.rebalances + balancer.skipped == steps and balancer.rebalances > HISTORY
    assert len(balancer.history) == HISTORY and balancer.history[-1].step >= steps - 2  # the newest kept
