"""The expert-parallel step both model families share: (token, expert) pairs travel to the experts' owner
ranks, this rank's experts run on what arrives, the results travel back and are summed with the routing
weights; the shared expert's output is added. Every rank calls it once per MoE layer, with zero rows if it has
no tokens.

Overlap (`Dist.overlap_shared_experts`, on unless --no-overlap-shared-experts): the dispatch's rows are issued
asynchronously and the shared expert computes while they travel; the wait comes right before the routed experts
need them. On an accelerator the shared expert runs on a second stream (kernels.streams), so it also runs beside
the routed experts and the combine; on CPU gloo's thread moves the rows while the main thread computes it. The
combine is issued asynchronously too and waited right before its rows are summed. Without overlap the shared
expert runs after the combine, as it did before. Both orders compute the same values: the shared expert's output
and the routed sum are independent until they are added, in the same order (routed + shared).

Two exchanges per MoE layer in decode: the dispatch carries its counts. Every rank knows from the step plan how many
rows each rank routes (Dist.most_moe_rows), and a token sends at most k rows, so no rank sends any other more than
capacity = most rows x k rows. The dispatch then sends every peer one block of that capacity with its count in a
header (comm.collectives.all_to_all_counted, as DeepEP's low-latency mode and MC2 carry theirs): one all-to-all, no
exchange of counts before it. The combine returns each peer's real rows only, both sides' counts being known by
then. The padding costs bytes: the counted form is taken while a rank's padded send stays within its device's
DISPATCH_PAD_BYTES (decode steps, short chunks); past it (long prefill chunks, whose blocks would be mostly padding)
and without a step plan, the counts travel first (exchange_counts) and the rows follow in a variable-size
all-to-all, three exchanges.

Host syncs per MoE layer on an accelerator: one at EP > 1 (the counted dispatch's received headers, read when it
is waited for; the variable one's counts, read back before its rows are sent), none at EP 1. Counting uses
index_add_ there (bincount sizes its output from the data, a sync), the grouped experts take the counts as a
tensor, and the combine reuses the dispatch's counts.

The profiler sees each phase under its own name (DISPATCH, DISPATCH_WAIT, SHARED_EXPERT, COMBINE, COMBINE_WAIT):
the test of the overlap reads them from a torch.profiler trace."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function

from dsconv.comm.collectives import InFlight, all_to_all_counted, all_to_all_variable, exchange_counts, header_rows
from dsconv.kernels.device import is_npu
from dsconv.kernels.linear import quantize_activations
from dsconv.runner.models import mc2
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.layers import RoutedExperts
from dsconv.family.placement import expert_owner

DISPATCH, DISPATCH_WAIT = "dsrun.moe.dispatch", "dsrun.moe.dispatch_wait"
SHARED_EXPERT = "dsrun.moe.shared_expert"
COMBINE, COMBINE_WAIT = "dsrun.moe.combine", "dsrun.moe.combine_wait"

# The most bytes a rank's counted dispatch may send (its padded blocks), by device type; above it the counts travel
# first. The counted form saves one exchange's latency and pays for its padding in bandwidth, so the bound is about
# what a link moves in one exchange's latency:
# - gloo between local processes (cpu): an all-to-all of 16 ranks takes about 7 ms on 2 cores (docs/benchmarks.md),
#   in which memory moves tens of MB;
# - a device link (cuda, npu): about 25 GB/s (200 Gb/s) for tens of microseconds, about 1 MB. Real V3.2 at EP16
#   under W8A8 (7,180-byte rows, top-8) fits one token per rank in it: a decode step at batch 1.
DISPATCH_PAD_BYTES = {"cpu": 32 * 2**20}
DEVICE_LINK_PAD_BYTES = 2**20


def expert_parallel(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, local: RoutedExperts,
                    dist: Dist, shared: Callable[[torch.Tensor], torch.Tensor], distinct: bool = True) -> torch.Tensor:
    """x [T, H]; experts, weights [T, k] from the router (global expert ids); local: this rank's experts; shared:
    the shared expert -> routed + shared(x), [T, H]. distinct: each token's k experts are distinct (a router's
    top-k; a hash layer's table may repeat one), which MC2 requires (models/mc2.py). With physical experts (or
    counting the load) the logical ids become physical slots first (models/eplb.py), distinct when they were:
    everything below sees slots."""
    if local.routing is not None:
        experts = local.routing(experts, dist)
    if not dist.overlap_shared_experts:
        routed = _routed(x, experts, weights, local, dist, None, distinct)
        with record_function(SHARED_EXPERT):
            return routed + shared(x)
    side, out = dist.side_stream, []

    def shared_beside() -> None:
        with side.beside(), record_function(SHARED_EXPERT):
            out.append(shared(x))

    routed = _routed(x, experts, weights, local, dist, shared_beside, distinct)
    side.join()
    return routed + out[0]


def _routed(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, local: RoutedExperts, dist: Dist,
            during_dispatch: Callable[[], None] | None, distinct: bool) -> torch.Tensor:
    """The routed experts' weighted sum [T, H]; during_dispatch (if given) runs once, while the dispatch travels
    (at EP 1, where nothing travels, first). On the NPU path within MC2's limits, MC2's two ops (models/mc2.py)."""
    if mc2.fits(x, experts.shape[1], local, dist, distinct):
        return mc2.routed(x, experts, weights, local, dist, during_dispatch)
    if dist.ep == 1 and x.shape[0] == 1 and not is_npu(x):  # on NPU the grouped call costs no host sync
        if during_dispatch is not None:
            during_dispatch()
        return _one_local_token(x, experts, weights, local)
    k, per_rank = experts.shape[1], len(local.ids)
    flat = experts.flatten()  # [T*k] one row per (token, expert) pair
    # grouped by owning EP rank (sorting by expert id also groups each destination's rows by expert)
    order = torch.argsort(flat, stable=True)
    send_counts = _count(expert_owner(flat, local.n_physical, dist.ep), dist.ep)
    # each row's expert as its index among its owner's local experts (owners hold contiguous blocks of slots)
    rows, local_ids = x[order // k], flat[order] % per_rank
    # EP dispatch: each row goes to its expert's owner with the expert's local index
    columns = dispatch_columns(rows, local_ids, local.int8)
    dispatch = ep_dispatch(dist, columns, send_counts, k)
    if during_dispatch is not None:
        during_dispatch()
    received = dispatch.wait()
    if received is None:  # no row for this rank's experts in this layer: only the rows' way back to take part in
        back = ep_combine(dist, torch.empty(0, x.shape[1], dtype=x.dtype, device=x.device), dispatch.counts)
    else:
        back = ep_combine(dist, _run_local(received, local, dist, x.dtype), dispatch.counts)
    combined = torch.empty(flat.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    with dist.timed(), record_function(COMBINE_WAIT):
        combined[order] = back.wait()[0]
    # per token, its k rows weighted and summed in float32: [T, 1, k] @ [T, k, H]
    return torch.bmm(weights[:, None], combined.view(-1, k, x.shape[1]).float())[:, 0].to(x.dtype)


def dispatch_columns(rows: torch.Tensor, local_ids: torch.Tensor, int8: bool) -> list[torch.Tensor]:
    """What the dispatch sends per row: for W8A8 experts the INT8 activations [N, H] and their per-token float32
    scales [N, 1], quantized once here by the sender (what the expert would compute from the row: quantization is
    per row, so it commutes with the exchange), else the rows in their dtype; then each row's local expert [N]."""
    return [*quantize_activations(rows), local_ids] if int8 else [rows, local_ids]


def _run_local(received: list[torch.Tensor], local: RoutedExperts, dist: Dist,
               out_dtype: torch.dtype) -> torch.Tensor:
    """The rows that arrived for this rank's experts (columns as ep_dispatch returned them) through those experts,
    in arrival order."""
    per_rank = len(local.ids)
    recv_local = received[-1]
    # rows from several source ranks are regrouped by local expert; from this rank alone (EP 1) they already are
    by_expert = torch.argsort(recv_local, stable=True) if dist.ep > 1 else None
    counts = _count(recv_local, per_rank)
    inputs = received[:-1] if by_expert is None else [column[by_expert] for column in received[:-1]]
    x_scale = inputs[1] if local.int8 else None  # W8A8: the sender's per-token scales
    grouped = local(inputs[0], counts, x_scale, out_dtype)
    if by_expert is None:
        return grouped
    out = torch.empty_like(grouped)
    out[by_expert] = grouped
    return out  # rows return to their senders in this order


class Dispatch:
    """An EP dispatch in flight: `wait()` -> the columns as received (None when no row arrived), after which
    `counts` holds the row counts per peer as lists, (received, sent), for `ep_combine`. sent: the sent counts when
    they are known at issue (the variable form); the counted form's exchange reads them back with its headers."""

    def __init__(self, dist: Dist, columns: list[torch.Tensor], flight: InFlight | None = None,
                 widths: list[int] = (), sent: list[int] | None = None):
        self.dist, self.columns, self.flight, self.widths, self.sent = dist, columns, flight, widths, sent
        self.counts: tuple[list[int], list[int]] | None = None

    def wait(self) -> list[torch.Tensor] | None:
        if self.flight is None:  # EP 1: nothing travelled
            return self.columns
        with self.dist.timed(), record_function(DISPATCH_WAIT):
            recv, received, *sent = self.flight.wait()
        self.counts = (received, sent[0] if sent else self.sent)
        if not sum(received):  # no rows for this rank: None, so that nothing reads an empty buffer
            return None
        # clone, not contiguous(): a one-row column slice counts as contiguous at an unaligned storage offset
        return [part.clone(memory_format=torch.contiguous_format).view(c.dtype).reshape(-1, *c.shape[1:])
                for part, c in zip(recv.split(self.widths, dim=1), self.columns)]


def ep_dispatch(dist: Dist, columns: list[torch.Tensor], send_counts: torch.Tensor, per_token: int) -> Dispatch:
    """Per-row tensors (e.g. INT8 activations [N, H], their scales [N, 1], local expert ids [N]), rows
    grouped by destination EP rank (send_counts[d] rows for rank d) -> the exchange in flight. The columns
    travel packed as bytes in one all-to-all, issued asynchronously: with their counts in fixed-capacity blocks when
    the step plan bounds them and the padding is within DISPATCH_PAD_BYTES, else after an exchange of counts.
    per_token: the most rows one token may send one rank: its k (a router's top-k are distinct experts, but a hash
    layer's token-to-expert table may name one twice)."""
    if dist.ep == 1:
        return Dispatch(dist, columns)
    widths = [row_bytes(c) for c in columns]
    packed = torch.cat([c.contiguous().view(torch.uint8).reshape(c.shape[0], w) for c, w in zip(columns, widths)],
                       dim=1)
    group = dist.groups.ep
    capacity = dispatch_capacity(dist, per_token, sum(widths))
    with dist.timed(), record_function(DISPATCH):
        if capacity is not None:
            on_host = send_counts.device.type == "cpu" and not is_npu(send_counts)
            if on_host and int(send_counts.max()) > capacity:  # a free check where the counts are on the host
                raise ValueError(f"an EP dispatch of {send_counts.tolist()} rows exceeds its blocks' capacity "
                                 f"{capacity}: the step plan understates this rank's rows")
            flight = all_to_all_counted(packed, send_counts, capacity, group, async_op=True)
            return Dispatch(dist, columns, flight, widths)
        received = exchange_counts(send_counts, group)
        # the one host sync: the all-to-all takes its split sizes as lists, both read back at once
        sent, received = torch.stack([send_counts, received]).tolist()
        flight = all_to_all_variable(packed, sent, group, recv_counts=received, async_op=True)
    return Dispatch(dist, columns, flight, widths, sent)


def dispatch_capacity(dist: Dist, per_token: int, width: int) -> int | None:
    """The rows of each block of a counted dispatch this step (rows of `width` bytes), or None when the counts must
    travel first: no step plan, or padded blocks above the device's DISPATCH_PAD_BYTES. Every rank decides alike,
    from the plan."""
    most = dist.most_moe_rows()
    if most is None:
        return None
    capacity = most * per_token
    budget = DISPATCH_PAD_BYTES.get(dist.device.type, DEVICE_LINK_PAD_BYTES)
    return capacity if dist.ep * (header_rows(width) + capacity) * width <= budget else None


def ep_combine(dist: Dist, out: torch.Tensor, counts: tuple[list[int], list[int]] | None) -> InFlight:
    """The reverse exchange, issued asynchronously: expert outputs travel back to the ranks that sent their rows,
    in order; wait() on the result -> (rows, counts). counts: the dispatch's; both sides of this exchange are known,
    so no counts travel again."""
    if dist.ep == 1:
        return InFlight(None, lambda: (out, [out.shape[0]]))
    received, sent = counts
    with dist.timed(), record_function(COMBINE):
        return all_to_all_variable(out, received, dist.groups.ep, recv_counts=sent, async_op=True)


def row_bytes(t: torch.Tensor) -> int:
    """The bytes one row of t takes on the wire."""
    count = 1
    for dim in t.shape[1:]:
        count *= dim
    return count * t.element_size()


def _count(values: torch.Tensor, n: int) -> torch.Tensor:
    """values [N] in [0, n) -> [n] int64, how many equal each. On an accelerator torch.bincount sizes its output
    from the data (a host sync), so index_add_ into n zeros counts there; on CPU bincount is the faster."""
    if values.device.type == "cpu" and not is_npu(values):
        return torch.bincount(values, minlength=n)
    return torch.zeros(n, dtype=torch.int64, device=values.device).index_add_(0, values, torch.ones_like(values))


def _one_local_token(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     local: RoutedExperts) -> torch.Tensor:
    """EP 1 and one token, a single sequence's decode step: nothing to exchange or regroup, so the token's row
    goes through its k experts directly (under W8A8 quantized once). The same values as the general path (same
    expert inputs, same weighted sum) with a fraction of its calls."""
    chosen = experts.tolist()[0]  # at EP 1 the global ids are the local ones
    if local.int8:
        x_q, x_scale = quantize_activations(x)
        outputs = local.token(x_q, chosen, x_scale, x.dtype)
    else:
        outputs = local.token(x, chosen)  # [k, H]
    # the weighted sum as the general path computes it ([T, 1, k] @ [T, k, H] with T = 1): the same rounding
    return torch.bmm(weights[:, None], outputs.float()[None])[:, 0].to(x.dtype)
