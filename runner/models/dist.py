"""The collectives the model's forward calls, over this rank's process groups.

`Dist()` is the one-process case (every collective is the identity). The distributed case wraps the
groups built from the manifest's layout; each method is one explicit exchange, so every rank enters them in
the same order (a rank without tokens still calls them, with zero rows). Time inside collectives is summed
in `comm_seconds` for the compute / communication split the benchmark reports.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dsconv.comm.collectives import all_gather_cat, all_reduce_sum, all_to_all_variable
from dsconv.kernels.device import takes_npu_path
from dsconv.kernels.linear import quantize_activations

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
    oproj_tp: int = 1
    embed_tp: int = 1
    cp: int = 1  # context-parallel prefill group size
    device: torch.device = torch.device("cpu")  # where the collectives' buffers live (gloo: cpu)
    groups: object | None = None  # comm.groups.Groups when distributed
    comm_seconds: float = 0.0
    steps: int = 0  # engine steps this rank has run (the Worker counts them)
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
        with self._timed():
            padded = F.pad(share, (0, 0, 0, per - share.shape[0])).contiguous()
            return all_gather_cat(padded, self.groups.attn_tp, dim=0)[:rows]

    def cp_gather(self, x: torch.Tensor, most: int, order: torch.Tensor) -> torch.Tensor:
        """A context-parallel prefill's new rows: x [T, d], this member's positions -> [length, d], every
        member's rows in position order (`order`: each position's row among the gathered, member after member,
        each padded to `most`)."""
        if self.cp == 1:
            return x.index_select(0, order)
        with self._timed():
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
        with self._timed():
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
        with self._timed():
            back, _ = all_to_all_variable(out, received, self.groups.ep, recv_counts=sent)
        return back

    def start_step(self, rows: int) -> None:
        """Called by the model at the top of each step with its row count: the most rows any member of each
        fine-grained TP group (o_proj, embedding) holds this step, learnt once here for every layer's exchange."""
        self.step_most = {}
        for name, size in (("oproj_tp", self.oproj_tp), ("embed_tp", self.embed_tp)):
            if size > 1:
                self.step_most[name] = self._most_rows(rows, getattr(self.groups, name))

    def _most_rows(self, rows: int, group) -> int:
        with self._timed():
            counts = all_gather_cat(torch.tensor([rows], device=self.device), group, dim=0)  # rows per member
        return int(counts.max())  # host sync: the exchanges take their sizes as ints

    def embed(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> their embedding rows [T, hidden] in the table's dtype. Under embedding TP the table is
        this rank's slice of the vocabulary (contiguous rows, in group-rank order), as vllm-ascend's embedding TP
        splits it: the group's token ids are gathered, each rank looks up the ids in its slice (zeros for the
        rest), and an all-to-all brings each rank its own rows' partial rows, summed. Exactly one partial is
        nonzero, so the sum is the row itself, bit for bit."""
        if self.embed_tp == 1:
            return F.embedding(tokens, table)
        group, most = self.groups.embed_tp, self.step_most["embed_tp"]
        if most == 0:
            return table.new_empty(0, table.shape[1])
        with self._timed():
            everyone = all_gather_cat(F.pad(tokens, (0, most - tokens.shape[0])), group, dim=0)  # [size * most]
        local = everyone - group.rank * table.shape[0]
        outside = (local < 0) | (local >= table.shape[0])
        partial = F.embedding(local.clamp(0, table.shape[0] - 1), table).masked_fill_(outside[:, None], 0)
        with self._timed():
            # every member sends `most` rows to each, so the counts need no exchange (nor a host sync)
            mine, _ = all_to_all_variable(partial, [most] * group.size, group, recv_counts=[most] * group.size)
        return mine.view(group.size, most, -1).sum(0)[:tokens.shape[0]]

    def oproj(self, x: torch.Tensor, proj: "Proj") -> torch.Tensor:
        """o_proj of this rank's rows x [T, heads * v] -> [T, hidden]. Under o_proj TP each rank holds a slice of
        its output rows [hidden / size, heads * v]: the group's inputs are gathered (INT8 with their per-token
        scales under W8A8, quantized once by their owner, as the whole layer would), each rank computes its
        output columns for all of them, and an all-to-all hands each rank its rows' columns. Every output is
        one rank's whole dot product: the same values as the unsplit layer (vllm-ascend splits the input
        columns instead and sums partial products in a reduce-scatter, moving fewer bytes)."""
        if self.oproj_tp == 1:
            return proj(x)
        group, most = self.groups.oproj_tp, self.step_most["oproj_tp"]
        if most == 0:
            return x.new_empty(0, proj.weight.shape[0] * group.size)
        pad = most - x.shape[0]
        with self._timed():
            if proj.scale is None:
                sliced_in = (all_gather_cat(F.pad(x, (0, 0, 0, pad)), group, dim=0),)
            else:
                x_q, x_scale = quantize_activations(x)
                sliced_in = (all_gather_cat(F.pad(x_q, (0, 0, 0, pad)), group, dim=0),
                             all_gather_cat(F.pad(x_scale, (0, 0, 0, pad)), group, dim=0))
        sliced = proj(*sliced_in) if proj.scale is None else proj.quantized(*sliced_in, x.dtype)
        return self._own_rows(sliced, group, most, x.shape[0])

    def _own_rows(self, sliced: torch.Tensor, group, most: int, rows: int) -> torch.Tensor:
        """sliced [size * most, n / size]: this rank's output columns of every member's rows (padded to `most`)
        -> [rows, n], this rank's rows with every member's columns, in group-rank order."""
        with self._timed():
            # slice i, from rank i: `most` rows from each, known here, so no exchange of counts
            mine, _ = all_to_all_variable(sliced.contiguous(), [most] * group.size, group,
                                          recv_counts=[most] * group.size)
        return mine.view(group.size, most, -1).transpose(0, 1).reshape(most, -1)[:rows]

    def lm_head_logits(self, h: torch.Tensor, head: Proj) -> torch.Tensor:
        """h [rows, hidden] (this rank's own rows; DP ranks differ) and head, the projection by this rank's
        vocabulary slice [vocab / tp, hidden] -> [rows, vocab], the full logits of this rank's rows.

        Every rank's rows are gathered (padded to the group's largest count), each rank computes its vocabulary
        slice for all of them, and an all-to-all hands each rank the slices of its own rows."""
        if self.tp == 1:
            return head(h)
        group = self.groups.tp
        most = self._most_rows(h.shape[0], group)
        if most == 0:  # no rank wants logits this step (e.g. every sequence is mid-prompt): all skip alike
            return h.new_empty(0, head.weight.shape[0] * group.size)
        with self._timed():
            everyone = all_gather_cat(F.pad(h, (0, 0, 0, most - h.shape[0])).contiguous(), group, dim=0)
        return self._own_rows(head(everyone), group, most, h.shape[0])  # my vocabulary slice of everyone's rows


def _row_bytes(t: torch.Tensor) -> int:
    count = 1
    for dim in t.shape[1:]:
        count *= dim
    return count * t.element_size()
