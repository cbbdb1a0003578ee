"""The collectives the model's forward calls, over this rank's process groups.

`Dist()` is the one-process case (every collective is the identity). The distributed case wraps the
groups built from the manifest's layout; each method is one explicit exchange, so every rank enters them in
the same order (a rank without tokens still calls them, with zero rows). Time inside collectives is summed
in `comm_seconds` for the compute / communication split the benchmark reports.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dsconv.comm.collectives import all_gather_cat, all_reduce_sum, all_to_all_variable

if TYPE_CHECKING:
    from dsconv.runner.models.layers import Proj


@dataclass
class Dist:
    rank: int = 0
    attn_tp: int = 1
    attn_tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    tp: int = 1
    device: torch.device = torch.device("cpu")  # where the collectives' buffers live (gloo: cpu)
    groups: object | None = None  # comm.groups.Groups when distributed
    comm_seconds: float = 0.0
    steps: int = 0  # engine steps this rank has run (the Worker counts them)

    @classmethod
    def from_layout(cls, layout: dict, device: torch.device) -> "Dist":
        """After init_process_group: this rank's groups from the manifest's layout (called on every rank)."""
        from dsconv.comm.groups import make_groups

        groups = make_groups(layout)
        return cls(rank=groups.world.rank, attn_tp=groups.attn_tp.size, attn_tp_rank=groups.attn_tp.rank,
                   ep=groups.ep.size, ep_rank=groups.ep.rank, tp=groups.tp.size, device=device, groups=groups)

    @contextmanager
    def _timed(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.comm_seconds += time.perf_counter() - started

    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Heads split over attention TP: sum the partial o_proj outputs."""
        if self.attn_tp == 1:
            return x
        with self._timed():
            return all_reduce_sum(x.contiguous(), self.groups.attn_tp)

    def attn_tp_share(self, x: torch.Tensor) -> torch.Tensor:
        """Under attention TP every rank of the group holds the same rows: each takes an equal share (padded
        with zero rows so all shares match in size for the gather)."""
        if self.attn_tp == 1:
            return x
        per = -(-x.shape[0] // self.attn_tp)
        padded = F.pad(x, (0, 0, 0, per * self.attn_tp - x.shape[0]))
        return padded[self.attn_tp_rank * per:(self.attn_tp_rank + 1) * per]

    def attn_tp_unshare(self, share: torch.Tensor, rows: int) -> torch.Tensor:
        if self.attn_tp == 1:
            return share
        with self._timed():
            return all_gather_cat(share.contiguous(), self.groups.attn_tp, dim=0)[:rows]

    def ep_dispatch(self, columns: list[torch.Tensor], send_counts: torch.Tensor):
        """Per-row tensors (e.g. INT8 activations [N, H], their scales [N, 1], local expert ids [N]), rows
        grouped by destination EP rank (send_counts[d] rows for rank d) -> the same columns as received, and
        the row counts per peer as lists, (received, sent), for `ep_combine`. The columns travel packed as bytes
        in one all-to-all."""
        if self.ep == 1:
            return columns, None
        widths = [_row_bytes(c) for c in columns]
        packed = torch.cat([c.contiguous().view(torch.uint8).reshape(c.shape[0], w) for c, w in zip(columns, widths)],
                           dim=1)
        sent = send_counts.tolist()  # host sync: the all-to-all takes its split sizes as lists
        with self._timed():
            recv, received = all_to_all_variable(packed, sent, self.groups.ep)
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
        with self._timed():
            back, _ = all_to_all_variable(out, received, self.groups.ep, recv_counts=sent)
        return back

    def lm_head_logits(self, h: torch.Tensor, head: Proj) -> torch.Tensor:
        """h [rows, hidden] (this rank's own rows; DP ranks differ) and head, the projection by this rank's
        vocabulary slice [vocab / tp, hidden] -> [rows, vocab], the full logits of this rank's rows.

        Every rank's rows are gathered (padded to the group's largest count), each rank computes its vocabulary
        slice for all of them, and an all-to-all hands each rank the slices of its own rows."""
        if self.tp == 1:
            return head(h)
        group = self.groups.tp
        with self._timed():
            counts = all_gather_cat(torch.tensor([h.shape[0]], device=h.device), group, dim=0)  # [tp] rows per rank
            most = int(counts.max())
            if most == 0:  # no rank wants logits this step (e.g. every sequence is mid-prompt): all skip alike
                return h.new_empty(0, head.weight.shape[0] * group.size)
            padded = F.pad(h, (0, 0, 0, most - h.shape[0])).contiguous()
            everyone = all_gather_cat(padded, group, dim=0)  # [tp * most, hidden], rank order
        sliced = head(everyone)  # [tp * most, vocab / tp]: my slice of everyone's logits
        with self._timed():
            mine, _ = all_to_all_variable(sliced, [most] * group.size, group)  # slice i of my rows, from rank i
        return mine.view(group.size, most, -1).transpose(0, 1).reshape(most, -1)[:h.shape[0]]


def _row_bytes(t: torch.Tensor) -> int:
    count = 1
    for dim in t.shape[1:]:
        count *= dim
    return count * t.element_size()
