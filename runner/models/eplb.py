"""Expert-parallel load balancing on the running model: routing to physical experts, counting the load, and
rebalancing while serving (`--enable-eplb --eplb-config`, vLLM's keys).

- **Routing** (`ExpertRouting`, one per MoE layer). A layer's logical experts each have one or more physical
  replicas (family/expert_map.py). The router's (token, expert) pairs keep their gate weights and change only
  where they are computed: the step's tokens are numbered across every rank (from the step plan every rank holds:
  DP index by DP index, each attention-TP rank's share in order) and the layer keeps a running count of the tokens
  it has routed, so token t's pick of expert e goes to replica (count + t) mod replicas(e): a hot expert's tokens go
  round-robin over its replicas across tokens, ranks and steps, with no exchange (without a step plan, the tokens
  are numbered from this rank's global rank). The tokens picking one expert are then spread unless they fall at a
  multiple of its replica count apart; an exact per-expert count would need the other ranks' picks. Every replica
  holds the same bytes, so the output does not change. V4's hash
  layers route through the same table, and so does the NPU path: MC2 and the grouped matmuls take the physical
  ids and this rank's slots.
- **Counting** (with EPLB or `--expert-load-record`). Each call adds its pairs to a per-layer count of logical
  experts and of physical slots, on the device, no host sync; an idle rank's throwaway token (accelerators) is not
  counted.
- **Rebalancing** (`ExpertBalancer`). At each step boundary (the worker's `before_step`, reached by every rank
  in the same step, the step plan being every rank's) the step's counts join a sliding window of `window_size`
  steps. Every `step_interval` steps the window's counts are summed over the world, each layer gets a new
  placement (family/eplb.py), and the layers whose placement changed move: each rank receives the INT8 weights
  with their scales (or the float weights) of the experts its new slots hold and it lacks, from a rank holding
  them, in one all-to-all over the EP group, and keeps its own. A layer switches its weights and its routing
  table together at a step boundary, on every rank at once. `use_async` (the default, as vLLM's) moves one layer
  per step, so a step pauses for one layer's exchange and the extra memory is one layer's slots and the bytes in
  flight; without it every layer moves at the same boundary. The step that rebalances also computes every layer's
  placement (family/eplb.py: about 0.02 s a layer at 256 experts + 16 on 16 ranks).
- **Figures.** Balancedness is mean over max of the tokens each EP rank's slots took (vLLM's); overall, the layers'
  means summed over their maxima summed. Before: measured over the window; after: the new placement's, on the
  same window's loads (the next window measures it). `log_balancedness` prints both; the engine exports them.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from dsconv.comm.collectives import all_reduce_sum, all_to_all_variable
from dsconv.convert.safetensors_io import write_json_atomic
from dsconv.errors import InputError
from dsconv.family.eplb import Placement, balancedness, place
from dsconv.family.expert_map import ModelKey, load_record
from dsconv.kernels.moe import ExpertWeights
from dsconv.runner.models.dist import Dist

# Rebalances whose figures a balancer keeps (dsrun generate --json lists them): a server rebalancing every
# step_interval steps for months must not grow; the count of all of them is kept apart (rebalances)
HISTORY = 64


@dataclass(frozen=True)
class EplbConfig:
    """--eplb-config: vLLM's keys and defaults."""
    window_size: int = 1000  # steps whose loads decide a placement
    step_interval: int = 3000  # steps between placements
    num_redundant_experts: int | None = None  # must equal the shards' (None: whatever they hold)
    log_balancedness: bool = False
    use_async: bool = True  # move one layer per step (else every layer at one step boundary)

    @classmethod
    def parse(cls, text: str) -> "EplbConfig":
        try:
            data = json.loads(text or "{}")
        except ValueError as exc:
            raise InputError(f"--eplb-config is not JSON: {exc}") from None
        known = {f.name: f for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - set(known):
            raise InputError(f"--eplb-config takes an object with keys among {sorted(known)}; got "
                             f"{sorted(data) if isinstance(data, dict) else data!r}")
        for name in ("window_size", "step_interval"):
            if name in data and (type(data[name]) is not int or data[name] < 1):
                raise InputError(f"--eplb-config {name} must be a positive integer, not {data[name]!r}")
        for name in ("log_balancedness", "use_async"):
            if name in data and type(data[name]) is not bool:
                raise InputError(f"--eplb-config {name} must be true or false, not {data[name]!r}")
        redundant = data.get("num_redundant_experts")
        if redundant is not None and (type(redundant) is not int or redundant < 0):
            raise InputError(f"--eplb-config num_redundant_experts must be a non-negative integer, not {redundant!r}")
        return cls(**data)


class ExpertRouting:
    """One MoE layer's logical -> physical routing on this rank (the module's docstring), and its counts."""

    def __init__(self, physical: tuple[int, ...], experts: int, device: torch.device):
        self.experts, self.device = experts, device
        self.routed = 0  # rows routed so far, over every rank
        self.counting = False
        self.logical_counts = torch.zeros(experts, dtype=torch.int64, device=device)
        self.set(physical)

    def set(self, physical: tuple[int, ...]) -> None:
        """A new placement: the table of each expert's slots ([E, most replicas], short rows padded with their
        first) and the replica counts."""
        replicas = Placement.of(list(physical), self.experts).replicas
        most = max(map(len, replicas))
        table = [list(r) + [r[0]] * (most - len(r)) for r in replicas]
        self.physical = tuple(physical)
        self.table = torch.tensor(table, dtype=torch.int64, device=self.device)
        self.replicas = torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=self.device)
        self.physical_counts = torch.zeros(len(physical), dtype=torch.int64, device=self.device)

    def __call__(self, experts: torch.Tensor, dist: Dist) -> torch.Tensor:
        """experts [T, k] logical ids -> [T, k] physical slots (counted when counting)."""
        experts = experts.long()
        position = dist.moe_row_position()
        first, step_rows = position if position is not None else (dist.rank, experts.shape[0])
        tokens = torch.arange(experts.shape[0], device=experts.device)[:, None]
        pick = (tokens + (self.routed + first)) % self.replicas[experts]
        self.routed += step_rows
        physical = self.table[experts, pick]
        if self.counting:
            flat = experts.flatten()
            self.logical_counts.index_add_(0, flat, torch.ones_like(flat))
            slots = physical.flatten()
            self.physical_counts.index_add_(0, slots, torch.ones_like(slots))
        return physical

    def take_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical, physical) counts since the last take, zeroed."""
        out = (self.logical_counts.clone(), self.physical_counts.clone())
        self.logical_counts.zero_()
        self.physical_counts.zero_()
        return out


@dataclass
class Figures:
    """One rebalance's balancedness: per layer and overall ("all"), measured over the window and planned."""
    step: int  # the steps run when it was computed
    measured: dict[str, float]
    planned: dict[str, float]
    moved: int  # layers whose placement changed

    def summary(self) -> dict:
        return {"step": self.step, "measured": self.measured["all"], "planned": self.planned["all"],
                "layers_moved": self.moved}


def overall(rank_loads: list[list[float]]) -> float:
    """vLLM's overall balancedness: the layers' mean rank loads summed over their max rank loads summed."""
    top = sum(max(loads) for loads in rank_loads)
    return 1.0 if top == 0 else sum(sum(loads) / len(loads) for loads in rank_loads) / top


class ExpertBalancer:
    """This rank's side of EPLB and of --expert-load-record (the module's docstring), over every MoE layer the
    model built (Dist.experts, RoutedExperts in build order). Every rank calls `before_step` at each step's start
    and `finish` once at the end, in the same order."""

    def __init__(self, dist: Dist, key: ModelKey, config: EplbConfig | None, record: Path | None, groups: int,
                 nodes: int):
        """key: the model's (every MoE layer, the MTP layer's too: a record names them all, with zeros for a layer
        that did not run); config: EPLB's (None: no rebalancing); record: the load record's path (None: none);
        groups, nodes: the hierarchical policy's (family/eplb.py)."""
        self.dist, self.config, self.record, self.groups, self.nodes = dist, config, record, groups, nodes
        self.layers = list(dist.experts)
        if not self.layers:
            raise InputError("--enable-eplb and --expert-load-record need a model with routed experts")
        first = self.layers[0]
        self.key = key
        for layer in self.layers:
            layer.counted()
        device = first.routing.device
        shape = (len(self.layers), first.experts)
        self.total = torch.zeros(shape, dtype=torch.int64, device=device)  # --expert-load-record: the whole run
        window = config.window_size if config is not None else 0
        self.window = torch.zeros((window, *shape), dtype=torch.int32, device=device)
        self.window_slots = torch.zeros((window, len(self.layers), first.n_physical), dtype=torch.int32,
                                        device=device)
        self.steps = 0
        self.pending: list[tuple[int, tuple[int, ...]]] = []  # (layer index, new physical) still to move
        self.history: deque[Figures] = deque(maxlen=HISTORY)  # the last rebalances' figures
        self.rebalances = 0  # in all
        self.skipped = 0  # rebalances that fell due while an earlier one's moves were still pending, in all

    @property
    def figures(self) -> Figures | None:
        """The last rebalance's."""
        return self.history[-1] if self.history else None

    def count(self, on: bool) -> None:
        """Whether this step's rows count as load (an idle rank's throwaway token does not)."""
        for layer in self.layers:
            layer.routing.counting = on

    def _take_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The counts since the last take ([layers, experts], [layers, slots]), added to the run's total."""
        logical, physical = zip(*(layer.routing.take_counts() for layer in self.layers))
        logical = torch.stack(logical)
        self.total += logical
        return logical, torch.stack(physical)

    def before_step(self) -> None:
        """The boundary before a step: the last step's counts into the window, a due rebalance, a due move."""
        logical, physical = self._take_counts()
        if self.config is None:
            return
        at = self.steps % self.config.window_size
        self.window[at] = logical.to(torch.int32)
        self.window_slots[at] = physical.to(torch.int32)
        self.steps += 1
        due = self.steps % self.config.step_interval == 0
        if self.pending:
            self._move_some()
            if due:  # the window is summed again at the next due step, once every layer has moved
                self.skipped += 1
                self._log(f"eplb rebalance skipped after {self.steps} steps: the last one's moves were pending "
                          f"({len(self.pending)} layers still to move)")
        elif due:
            self._rebalance()

    def _log(self, message: str) -> None:
        if self.config.log_balancedness and self.dist.rank == 0:
            print(f"dsrun: {message}", file=sys.stderr, flush=True)

    def _rebalance(self) -> None:
        """Every layer's new placement from the window's loads summed over the world; the changed ones queued."""
        host = self.dist.groups.host if self.dist.groups is not None else None
        loads = self.window.sum(0, dtype=torch.int64).cpu().contiguous()
        slots = self.window_slots.sum(0, dtype=torch.int64).cpu().contiguous()
        if host is not None:
            all_reduce_sum(loads, host)
            all_reduce_sum(slots, host)
        ep, measured, planned, before, after = self.dist.ep, {}, {}, [], []
        for index, layer in enumerate(self.layers):
            layer_loads = loads[index].tolist()
            ranks_now = slots[index].view(ep, -1).sum(1).tolist()
            placement = place(layer_loads, layer.n_physical, self.groups, self.nodes, ep)
            ranks_then = placement.rank_loads(layer_loads, ep)
            measured[layer.prefix], planned[layer.prefix] = balancedness(ranks_now), balancedness(ranks_then)
            before.append(ranks_now)
            after.append(ranks_then)
            if placement.physical != layer.routing.physical:
                self.pending.append((index, placement.physical))
        measured["all"], planned["all"] = overall(before), overall(after)
        self.history.append(Figures(self.steps, measured, planned, len(self.pending)))
        self.rebalances += 1
        self._log(f"eplb rebalance {self.rebalances} after {self.steps} steps: balancedness {measured['all']:.3f} "
                  f"measured over the last {min(self.steps, self.config.window_size)} steps, {planned['all']:.3f} "
                  f"planned; {len(self.pending)} of {len(self.layers)} layers move")
        if self.pending:
            self._move_some()

    def _move_some(self) -> None:
        count = 1 if self.config.use_async else len(self.pending)
        for index, physical in self.pending[:count]:
            self.layers[index].move(physical, self.dist)
        del self.pending[:count]

    @torch.inference_mode()  # as the steps' counts were made
    def finish(self) -> None:
        """The end of the run, on every rank: with a record, the loads of the whole run summed over the world, which
        rank 0 writes there (whole or not at all)."""
        self._take_counts()  # the last step's
        if self.record is None:
            return
        total = self.total.to("cpu", copy=True)
        if self.dist.groups is not None:
            all_reduce_sum(total, self.dist.groups.host)
        if self.dist.rank == 0:
            loads = dict.fromkeys(self.key.layers, [0] * self.key.experts)
            loads.update({layer.prefix: total[i].tolist() for i, layer in enumerate(self.layers)})
            write_json_atomic(self.record, load_record(self.key, loads))


def move_experts(weights: ExpertWeights, old: tuple[int, ...], new: tuple[int, ...], dist: Dist) -> ExpertWeights:
    """This EP rank's experts under the old placement -> under the new one: the experts it keeps are copied, the
    others received from a rank that held them, in one all-to-all of their bytes over the EP group (each expert's
    w13, w2 and, INT8, their scales). Every EP rank calls it with the same placements."""
    ep, me = dist.ep, dist.ep_rank
    per_rank = len(new) // ep
    old_held = [old[r * per_rank:(r + 1) * per_rank] for r in range(ep)]
    new_held = [new[r * per_rank:(r + 1) * per_rank] for r in range(ep)]
    # sends[source][dest]: the experts `source` sends `dest`, in dest's slot order
    sends = [[[] for _ in range(ep)] for _ in range(ep)]
    for dest in range(ep):
        for expert in new_held[dest]:
            if expert not in old_held[dest]:
                holders = [r for r in range(ep) if expert in old_held[r]]
                sends[holders[dest % len(holders)]][dest].append(expert)
    parts = [t for t in (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale) if t is not None]
    widths = [t[0].numel() * t.element_size() for t in parts]

    def row(expert: int) -> torch.Tensor:
        i = old_held[me].index(expert)
        return torch.cat([t[i].contiguous().view(torch.uint8).flatten() for t in parts])

    leaving = [e for dest in range(ep) for e in sends[me][dest]]
    send = torch.empty(len(leaving), sum(widths), dtype=torch.uint8, device=parts[0].device)
    for i, expert in enumerate(leaving):
        send[i] = row(expert)
    received = send  # EP 1: every expert is already here
    if ep > 1:
        received, _ = all_to_all_variable(send, [len(sends[me][d]) for d in range(ep)], dist.groups.ep,
                                          recv_counts=[len(sends[s][me]) for s in range(ep)])
        del send
    arrived = {e: received[i] for i, e in enumerate(e for s in range(ep) for e in sends[s][me])}
    out = [torch.empty((per_rank, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in parts]
    for slot, expert in enumerate(new_held[me]):
        if expert in old_held[me]:
            source = old_held[me].index(expert)
            for target, t in zip(out, parts):
                target[slot] = t[source]
        else:
            for target, chunk in zip(out, arrived[expert].split(widths)):
                target[slot] = chunk.clone().view(target.dtype).view(target.shape[1:])  # clone: aligned
    if weights.int8:
        return ExpertWeights(out[0], out[1], out[2], out[3])
    return ExpertWeights(out[0], out[1])
