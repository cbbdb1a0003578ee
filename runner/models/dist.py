"""This rank's process groups and their sizes: what the parallel layers (models/parallel.py) and the expert-parallel
step (models/moe.py) exchange through.

`Dist()` is the one-process case (every size 1, no group: each exchange is the identity). The distributed case
wraps the groups built from the manifest's layout. Time inside collectives is summed in `comm_seconds` (each
exchange runs under `timed`) for the compute / communication split the benchmark reports.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from dsconv.comm.collectives import all_gather_cat
from dsconv.family.layout import Layout
from dsconv.kernels.device import takes_npu_path
from dsconv.kernels.streams import SideStream
from dsconv.runner.models.kernel_switch import KernelSwitch


PLANNED = ("tokens", "logit_rows")  # what `plan_step` gives per attention-DP index, in this order


@dataclass
class Dist:
    rank: int = 0
    attn_tp: int = 1
    attn_tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    tp: int = 1
    oproj_tp: int = 1
    embed_tp: int = 1
    cp: int = 1  # context-parallel prefill group size
    device: torch.device = torch.device("cpu")  # where the collectives' buffers live (gloo: cpu)
    groups: object | None = None  # comm.groups.Groups when distributed
    comm_seconds: float = 0.0
    # this step's rows on each rank of each fine-grained TP group (o_proj, embedding), in group-rank order:
    # `start_step`
    step_counts: dict = field(default_factory=dict)
    # the shared expert computes while the MoE's dispatch travels (models/moe.py); False: after the combine
    overlap_shared_experts: bool = True
    # this rank's routed experts of every MoE layer (layers.RoutedExperts), in build order: what EPLB's balancer
    # (models/eplb.py) walks
    experts: list = field(default_factory=list, repr=False)
    kernels: KernelSwitch = field(default_factory=KernelSwitch)  # --kernels, and whether this step runs PyPTO's
    _side_stream: SideStream | None = field(default=None, repr=False)
    _planned: list[tuple[int, int]] | None = field(default=None, repr=False)  # `plan_step`

    @classmethod
    def from_layout(cls, layout: Layout, device: torch.device, cp_size: int = 1,
                    overlap_shared_experts: bool = True) -> "Dist":
        """After init_process_group: this rank's groups from the manifest's layout and the context-parallel
        prefill's group size (called on every rank)."""
        from dsconv.comm.groups import make_groups

        # MC2's communicator only where its ops may run: the NPU path (models/mc2.py)
        groups = make_groups(layout, cp_size, mc2=takes_npu_path(device))
        return cls(rank=groups.world.rank, attn_tp=groups.attn_tp.size, attn_tp_rank=groups.attn_tp.rank,
                   ep=groups.ep.size, ep_rank=groups.ep.rank, tp=groups.tp.size, oproj_tp=groups.oproj_tp.size,
                   embed_tp=groups.embed_tp.size, cp=groups.cp.size, device=device, groups=groups,
                   overlap_shared_experts=overlap_shared_experts)

    @property
    def side_stream(self) -> SideStream:
        """The second stream the overlapped work runs on (on CPU: in order, kernels.streams), made at first use."""
        if self._side_stream is None:
            self._side_stream = SideStream(self.device)
        return self._side_stream

    @property
    def world_size(self) -> int:
        return 1 if self.groups is None else self.groups.world.size

    @contextmanager
    def timed(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.comm_seconds += time.perf_counter() - started

    def plan_step(self, rows: list[tuple[int, int]] | None) -> None:
        """The next forward's (tokens, logit rows) on each attention-DP index, from the step plan every rank holds
        (engine/worker.py), or None after it: the TP exchanges then take their members' row counts from here
        instead of exchanging them (a host sync each on an accelerator)."""
        self._planned = rows

    def most_moe_rows(self) -> int | None:
        """The most rows any rank routes through the MoE this step, from the step plan (None without one): each
        attention-TP rank routes its share, ceil(tokens / attn_tp), of its DP index's tokens (parallel.py,
        attention_tp_share; an accelerator's throwaway row stands in only for an empty share)."""
        if self._planned is None:
            return None
        return max(-(-tokens // self.attn_tp) for tokens, _ in self._planned)

    def moe_row_position(self) -> tuple[int, int] | None:
        """(the number of this rank's first MoE row among every rank's this step, every rank's rows), from the step
        plan (None without one): DP index by DP index, each attention-TP rank's share (parallel.py,
        attention_tp_share) in group order. EPLB's routing numbers rows by it (models/eplb.py)."""
        if self._planned is None:
            return None
        dp_index = self.rank // self.attn_tp
        before = sum(tokens for tokens, _ in self._planned[:dp_index])
        share = -(-self._planned[dp_index][0] // self.attn_tp)
        return before + self.attn_tp_rank * share, sum(tokens for tokens, _ in self._planned)

    def start_step(self, rows: int) -> None:
        """Called by the model at the top of each step with its row count: the rows each member of each
        fine-grained TP group (o_proj, embedding) holds this step, learnt once here for every layer's exchange."""
        self.step_counts = {}
        for name, size in (("oproj_tp", self.oproj_tp), ("embed_tp", self.embed_tp)):
            if size > 1:
                self.step_counts[name] = self.row_counts(rows, getattr(self.groups, name), "tokens")

    def row_counts(self, rows: int, group, of: str) -> list[int]:
        """The rows each member of `group` holds, in group-rank order (each member passes its own count): from the
        step plan when there is one (`of`: "tokens" the model is fed, or "logit_rows"), else exchanged."""
        if self._planned is not None:
            column = PLANNED.index(of)
            counts = [self._planned[member // self.attn_tp][column] for member in group.ranks]
            if counts[group.rank] != rows:
                raise ValueError(f"rank {self.rank} holds {rows} rows, but the step plan gives it {counts[group.rank]}")
            return counts
        with self.timed():
            counts = all_gather_cat(torch.tensor([rows], device=self.device), group, dim=0)  # rows per member
        return counts.tolist()  # host sync: the exchanges take their sizes as ints
