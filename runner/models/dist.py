"""This rank's process groups and the exchanges of attention TP, context-parallel prefill and MoE EP; the
tensor-parallel layers (embedding, o_proj, lm_head) are declared in models/parallel.py and exchange through these
groups.

`Dist()` is the one-process case (every collective is the identity). The distributed case wraps the
groups built from the manifest's layout; each method is one explicit exchange, so every rank enters them in
the same order (a rank without tokens still calls them, with zero rows). Time inside collectives is summed
in `comm_seconds` for the compute / communication split the benchmark reports.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dsconv.comm.collectives import all_gather_cat, all_reduce_sum, all_to_all_variable
from dsconv.kernels.device import takes_npu_path


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
    # this step's most rows on one rank of each fine-grained TP group (o_proj, embedding): `start_step`
    step_most: dict = field(default_factory=dict)

    @classmethod
    def from_layout(cls, layout: dict, device: torch.device, cp_size: int = 1) -> "Dist":
        """After init_process_group: this rank's groups from the manifest's layout and the context-parallel
        prefill's group size (called on every rank)."""
        from dsconv.comm.groups import make_groups

        groups = make_groups(layout, cp_size)
        return cls(rank=groups.world.rank, attn_tp=groups.attn_tp.size, attn_tp_rank=groups.attn_tp.rank,
                   ep=groups.ep.size, ep_rank=groups.ep.rank, tp=groups.tp.size, oproj_tp=groups.oproj_tp.size,
                   embed_tp=groups.embed_tp.size, cp=groups.cp.size, device=device, groups=groups)

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

    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Heads split over attention TP: sum the partial o_proj outputs."""
        if self.attn_tp == 1:
            return x
        with self.timed():
            return all_reduce_sum(x.contiguous(), self.groups.attn_tp)

    def attn_tp_share(self, x: torch.Tensor) -> torch.Tensor:
        """Under attention TP every rank of the group holds the same rows: each takes its share, rows
        [rank * per, (rank + 1) * per) with per = ceil(rows / size) (the last shares may be shorter or empty). No
        padding rows: an all-zero row would reach the MoE's quantizer, whose documented NPU formula (no floor
        on the scale) divides 0 by 0. On an accelerator an empty share is the group's first row instead, a
        throwaway that `attn_tp_unshare` drops, so that no kernel is handed a zero-size tensor."""
        if self.attn_tp == 1:
            return x
        per = -(-x.shape[0] // self.attn_tp)
        start = self.attn_tp_rank * per
        if start >= x.shape[0] and x.shape[0] and takes_npu_path(x.device):
            return x[:1]
        return x[start:start + per]

    def attn_tp_unshare(self, share: torch.Tensor, rows: int) -> torch.Tensor:
        """The group's shares of `rows` rows gathered back into all of them (each padded to an equal size for
        the gather only; a throwaway share lands past `rows` and is dropped)."""
        if self.attn_tp == 1:
            return share
        per = -(-rows // self.attn_tp)
        with self.timed():
            padded = F.pad(share, (0, 0, 0, per - share.shape[0])).contiguous()
            return all_gather_cat(padded, self.groups.attn_tp, dim=0)[:rows]

    def cp_gather(self, x: torch.Tensor, most: int, order: torch.Tensor) -> torch.Tensor:
        """A context-parallel prefill's new rows: x [T, d], this member's positions -> [length, d], every
        member's rows in position order (`order`: each position's row among the gathered, member after member,
        each padded to `most`)."""
        if self.cp == 1:
            return x.index_select(0, order)
        with self.timed():
            everyone = all_gather_cat(F.pad(x, (0, 0, 0, most - x.shape[0])).contiguous(), self.groups.cp, dim=0)
        return everyone.index_select(0, order)

    def ep_dispatch(self, columns: list[torch.Tensor], send_counts: torch.Tensor):
        """Per-row tensors (e.g. INT8 activations [N, H], their scales [N, 1], local expert ids [N]), rows
        grouped by destination EP rank (send_counts[d] rows for rank d) -> the same columns as received (None
        when no row arrived), and the row counts per peer as lists, (received, sent), for `ep_combine`. The
        columns travel packed as bytes in one all-to-all."""
        if self.ep == 1:
            return columns, None
        widths = [_row_bytes(c) for c in columns]
        packed = torch.cat([c.contiguous().view(torch.uint8).reshape(c.shape[0], w) for c, w in zip(columns, widths)],
                           dim=1)
        sent = send_counts.tolist()  # host sync: the all-to-all takes its split sizes as lists
        with self.timed():
            recv, received = all_to_all_variable(packed, sent, self.groups.ep)
        if not sum(received):  # no rows for this rank: None, so that nothing reads an empty buffer
            return None, (received, sent)
        # clone, not contiguous(): a one-row column slice counts as contiguous at an unaligned storage offset
        out = [part.clone(memory_format=torch.contiguous_format).view(c.dtype).reshape(-1, *c.shape[1:])
               for part, c in zip(recv.split(widths, dim=1), columns)]
        return out, (received, sent)

    def ep_combine(self, out: torch.Tensor, counts: tuple[list[int], list[int]] | None) -> torch.Tensor:
        """The reverse exchange: expert outputs travel back to the ranks that sent their rows, in order. counts:
        what ep_dispatch returned; both sides of this exchange are known, so no counts travel again."""
        if self.ep == 1:
            return out
        received, sent = counts
        with self.timed():
            back, _ = all_to_all_variable(out, received, self.groups.ep, recv_counts=sent)
        return back

    def start_step(self, rows: int) -> None:
        """Called by the model at the top of each step with its row count: the most rows any member of each
        fine-grained TP group (o_proj, embedding) holds this step, learnt once here for every layer's exchange."""
        self.step_most = {}
        for name, size in (("oproj_tp", self.oproj_tp), ("embed_tp", self.embed_tp)):
            if size > 1:
                self.step_most[name] = self.most_rows(rows, getattr(self.groups, name))

    def most_rows(self, rows: int, group) -> int:
        """The most rows any member of `group` holds (each member passes its own count)."""
        with self.timed():
            counts = all_gather_cat(torch.tensor([rows], device=self.device), group, dim=0)  # rows per member
        return int(counts.max())  # host sync: the exchanges take their sizes as ints


def _row_bytes(t: torch.Tensor) -> int:
    count = 1
    for dim in t.shape[1:]:
        count *= dim
    return count * t.element_size()
