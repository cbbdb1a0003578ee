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

Host syncs per MoE layer on an accelerator: one at EP > 1 (the all-to-all takes its split sizes as lists: the
counts this rank sends and, from the count exchange, those it receives, read back together), none at EP 1. Counting
uses index_add_ there (bincount sizes its output from the data, a sync), the grouped experts take the counts as a
tensor, and the combine reuses the dispatch's counts.

The profiler sees each phase under its own name (DISPATCH, DISPATCH_WAIT, SHARED_EXPERT, COMBINE, COMBINE_WAIT):
the test of the overlap reads them from a torch.profiler trace."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function

from dsconv.comm.collectives import InFlight, all_to_all_variable, exchange_counts
from dsconv.kernels.device import is_npu
from dsconv.kernels.linear import quantize_activations
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.layers import RoutedExperts
from dsconv.family.placement import expert_owner

DISPATCH, DISPATCH_WAIT = "dsrun.moe.dispatch", "dsrun.moe.dispatch_wait"
SHARED_EXPERT = "dsrun.moe.shared_expert"
COMBINE, COMBINE_WAIT = "dsrun.moe.combine", "dsrun.moe.combine_wait"


def expert_parallel(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, local: RoutedExperts,
                    dist: Dist, shared: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, H]; experts, weights [T, k] from the router (global expert ids); local: this rank's experts; shared:
    the shared expert -> routed + shared(x), [T, H]."""
    if not dist.overlap_shared_experts:
        routed = _routed(x, experts, weights, local, dist, None)
        with record_function(SHARED_EXPERT):
            return routed + shared(x)
    side, out = dist.side_stream, []

    def shared_beside() -> None:
        with side.beside(), record_function(SHARED_EXPERT):
            out.append(shared(x))

    routed = _routed(x, experts, weights, local, dist, shared_beside)
    side.join()
    return routed + out[0]


def _routed(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, local: RoutedExperts, dist: Dist,
            during_dispatch: Callable[[], None] | None) -> torch.Tensor:
    """The routed experts' weighted sum [T, H]; during_dispatch (if given) runs once, while the dispatch travels
    (at EP 1, where nothing travels, first)."""
    if dist.ep == 1 and x.shape[0] == 1 and not is_npu(x):  # on NPU the grouped call costs no host sync
        if during_dispatch is not None:
            during_dispatch()
        return _one_local_token(x, experts, weights, local)
    k, per_rank = experts.shape[1], len(local.ids)
    flat = experts.flatten()  # [T*k] one row per (token, expert) pair
    # grouped by owning EP rank (sorting by expert id also groups each destination's rows by expert)
    order = torch.argsort(flat, stable=True)
    send_counts = _count(expert_owner(flat, local.n_routed_experts, dist.ep), dist.ep)
    # each row's expert as its index among its owner's local experts (owners hold contiguous blocks)
    rows, local_ids = x[order // k], flat[order] % per_rank
    # EP dispatch: each row goes to its expert's owner with the expert's local index; W8A8 experts get INT8
    # activations and their per-token scales, quantized once here (what the expert itself would compute)
    columns = [*quantize_activations(rows), local_ids] if local.int8 else [rows, local_ids]
    dispatch = ep_dispatch(dist, columns, send_counts)
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
    """An EP dispatch in flight: `wait()` -> the columns as received (None when no row arrived); `counts`, the row
    counts per peer as lists, (received, sent), for `ep_combine`."""

    def __init__(self, dist: Dist, columns: list[torch.Tensor], flight=None, widths: list[int] = (),
                 counts: tuple[list[int], list[int]] | None = None):
        self.dist, self.columns, self.flight, self.widths, self.counts = dist, columns, flight, widths, counts

    def wait(self) -> list[torch.Tensor] | None:
        if self.flight is None:  # EP 1: nothing travelled
            return self.columns
        with self.dist.timed(), record_function(DISPATCH_WAIT):
            recv, received = self.flight.wait()
        if not sum(received):  # no rows for this rank: None, so that nothing reads an empty buffer
            return None
        # clone, not contiguous(): a one-row column slice counts as contiguous at an unaligned storage offset
        return [part.clone(memory_format=torch.contiguous_format).view(c.dtype).reshape(-1, *c.shape[1:])
                for part, c in zip(recv.split(self.widths, dim=1), self.columns)]


def ep_dispatch(dist: Dist, columns: list[torch.Tensor], send_counts: torch.Tensor) -> Dispatch:
    """Per-row tensors (e.g. INT8 activations [N, H], their scales [N, 1], local expert ids [N]), rows
    grouped by destination EP rank (send_counts[d] rows for rank d) -> the exchange in flight. The columns
    travel packed as bytes in one all-to-all, issued asynchronously after the counts' exchange."""
    if dist.ep == 1:
        return Dispatch(dist, columns)
    widths = [_row_bytes(c) for c in columns]
    packed = torch.cat([c.contiguous().view(torch.uint8).reshape(c.shape[0], w) for c, w in zip(columns, widths)],
                       dim=1)
    group = dist.groups.ep
    with dist.timed(), record_function(DISPATCH):
        received = exchange_counts(send_counts, group)
        # the one host sync: the all-to-all takes its split sizes as lists, both read back at once
        sent, received = torch.stack([send_counts, received]).tolist()
        flight = all_to_all_variable(packed, sent, group, recv_counts=received, async_op=True)
    return Dispatch(dist, columns, flight, widths, (received, sent))


def ep_combine(dist: Dist, out: torch.Tensor, counts: tuple[list[int], list[int]] | None) -> InFlight:
    """The reverse exchange, issued asynchronously: expert outputs travel back to the ranks that sent their rows,
    in order; wait() on the result -> (rows, counts). counts: the dispatch's; both sides of this exchange are known,
    so no counts travel again."""
    if dist.ep == 1:
        return InFlight(None, lambda: (out, [out.shape[0]]))
    received, sent = counts
    with dist.timed(), record_function(COMBINE):
        return all_to_all_variable(out, received, dist.groups.ep, recv_counts=sent, async_op=True)


def _row_bytes(t: torch.Tensor) -> int:
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
