"""The collectives the runner's forward calls, one small function each, on a `comm.groups.Group`.

Every member of a group must call the same collectives on it in the same order; a rank with no tokens still
calls them with zero rows. A group of one returns its input without communicating.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dsconv.comm.groups import Group


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sums `x` over the group in place and returns it (e.g. after a row-split `o_proj`)."""
    if not x.is_contiguous():
        raise ValueError(f"all_reduce_sum needs a contiguous tensor; got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if group.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group.handle)
    return x


def all_gather_cat(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenates every member's `x` along `dim` in group-rank order; all members pass the same shape.

    lm_head TP: each rank's [tokens, vocab / tp] logits slice -> [tokens, vocab].
    """
    if group.size == 1:
        return x
    x = x.contiguous()  # gloo sends raw memory
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.handle)
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, group: Group, source: int) -> torch.Tensor:
    """Member `source`'s (global rank) `x` on every member, in place: the others pass a tensor of the same shape
    and dtype to receive it in."""
    if group.size > 1:
        dist.broadcast(x, src=source, group=group.handle)
    return x


def exchange_counts(send_counts: torch.Tensor, group: Group) -> torch.Tensor:
    """send_counts [group.size] (rows this rank sends each member) -> [group.size], the rows each member sends
    this rank, as a tensor where the counts live: no host sync here (the caller reads both at once)."""
    if group.size == 1:
        return send_counts
    counts_in = torch.empty_like(send_counts)
    dist.all_to_all_single(counts_in, send_counts.contiguous(), group=group.handle)
    return counts_in


class InFlight:
    """An all-to-all issued with async_op=True: `wait()` returns what the blocking call returns, (recv,
    recv_counts). On an accelerator the wait orders the current stream after the exchange; on CPU (gloo) it
    blocks until gloo's thread has finished it. Until then the main thread computes whatever does not need it."""

    def __init__(self, work, finish, buffers: tuple[torch.Tensor, ...] = ()):
        self._work, self._finish = work, finish
        self._buffers = buffers  # the exchange's send and receive buffers, alive until it is waited for

    def wait(self) -> tuple[torch.Tensor, list[int]]:
        if self._work is not None:
            self._work.wait()
        self._buffers = ()
        return self._finish()


def all_to_all_variable(send: torch.Tensor, send_counts: list[int] | torch.Tensor, group: Group,
                        recv_counts: list[int] | None = None, async_op: bool = False
                        ) -> tuple[torch.Tensor, list[int]] | InFlight:
    """EP exchange: rows `send[offset_j : offset_j + send_counts[j]]` go to group rank j.

    send: [N, ...] rows grouped by destination, in group-rank order; send_counts: [group.size], sum N.
    Returns recv: [M, ...] (same trailing shape and dtype), the rows from rank 0 first, then rank 1, ...;
    and recv_counts: rows received from each rank, sum M. Zero rows to or from any rank are fine, including
    N = 0 (a rank with no tokens still takes part). recv_counts, when the caller already knows them (the
    reverse of an earlier exchange, or `exchange_counts` read back), skip the exchange of counts.
    async_op: return an `InFlight` at once, the rows still travelling; its wait() returns (recv, recv_counts).
    """
    send_counts = [int(c) for c in (send_counts.tolist() if torch.is_tensor(send_counts) else send_counts)]
    if len(send_counts) != group.size or min(send_counts) < 0 or sum(send_counts) != send.shape[0]:
        raise ValueError(f"send_counts={send_counts} must give a non-negative row count for each of the "
                         f"{group.size} ranks of group {group.name}, summing to the {send.shape[0]} rows sent")
    if group.size == 1:
        return InFlight(None, lambda: (send, send_counts)) if async_op else (send, send_counts)

    if recv_counts is None:
        # 1. Counts first: every rank learns how many rows each peer will send it, to size its receive buffer.
        counts = torch.tensor(send_counts, dtype=torch.int64, device=send.device)
        recv_counts = exchange_counts(counts, group).tolist()
    elif len(recv_counts) != group.size:
        raise ValueError(f"recv_counts={recv_counts} must have one entry per rank of group {group.name}")
    recv_counts = [int(c) for c in recv_counts]

    # 2. The rows. An all-to-all only moves data, so it moves bytes: each row becomes `row_bytes` uint8
    # values. One code path for every dtype, including float8 and the e8m0 scales that gloo cannot send
    # (gloo does carry int8 since torch 2.x, but not float8: "Invalid scalar type").
    row_shape = send.shape[1:]
    row_bytes = math.prod(row_shape) * send.element_size()
    # A rank that sends or receives nothing would hand the backend an empty buffer (a null data pointer, which
    # HCCL does not document as valid): it sends itself one extra row instead, dropped on arrival. Each rank
    # decides alone; its peers' counts are unchanged. An empty side is never read or written (the row counts
    # are on the host), so no kernel sees a zero-size tensor here either.
    pad = group.rank if (sum(send_counts) == 0 or sum(recv_counts) == 0) else None
    send_splits, recv_splits = list(send_counts), list(recv_counts)
    send_bytes = _send_bytes(send, send_counts, row_bytes, pad)
    if pad is not None:
        send_splits[pad] += 1
        recv_splits[pad] += 1
    recv_bytes = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=send.device)
    work = dist.all_to_all_single(recv_bytes, send_bytes, output_split_sizes=recv_splits,
                                  input_split_sizes=send_splits, group=group.handle, async_op=async_op)

    def finish() -> tuple[torch.Tensor, list[int]]:
        if sum(recv_counts) == 0:  # only the extra row arrived
            return torch.empty(0, *row_shape, dtype=send.dtype, device=send.device), list(recv_counts)
        arrived = recv_bytes
        if pad is not None:
            end = sum(recv_splits[:pad + 1])  # the extra row closes this rank's own part
            arrived = _cat_rows([recv_bytes[:end - 1], recv_bytes[end:]])
        return arrived.reshape(-1).view(send.dtype).reshape(sum(recv_counts), *row_shape), list(recv_counts)

    return InFlight(work, finish, (send_bytes, recv_bytes)) if async_op else finish()


def _send_bytes(send: torch.Tensor, send_counts: list[int], row_bytes: int, pad: int | None) -> torch.Tensor:
    """`send` as [N, row_bytes] uint8 rows; with `pad` (a group rank), one zero row more after that rank's part:
    all_to_all_variable's extra row, which a rank sending nothing sends alone."""
    if send.shape[0] == 0:
        return torch.zeros(1, row_bytes, dtype=torch.uint8, device=send.device)  # the extra row alone
    send_bytes = send.contiguous().reshape(-1).view(torch.uint8).reshape(send.shape[0], row_bytes)
    if pad is None:
        return send_bytes
    end = sum(send_counts[:pad + 1])
    return _cat_rows([send_bytes[:end], send_bytes.new_zeros(1, row_bytes), send_bytes[end:]])


COUNT_BYTES = 8  # a block's header: its row count as one int64


def header_rows(row_bytes: int) -> int:
    """The rows a fixed-capacity block's header takes: enough for its count."""
    return -(-COUNT_BYTES // row_bytes)


def all_to_all_counted(send: torch.Tensor, send_counts: torch.Tensor, capacity: int, group: Group,
                       async_op: bool = False) -> tuple[torch.Tensor, list[int], list[int]] | InFlight:
    """EP exchange in one all-to-all, its counts travelling with its rows (as DeepEP's low-latency mode and MC2
    carry theirs): rows `send[offset_j : offset_j + send_counts[j]]` go to group rank j, as in all_to_all_variable,
    but no exchange of counts comes first. Every member sends every member one block of a fixed size: a header
    (`header_rows`) whose first 8 bytes are the block's row count, then `capacity` rows, the real ones first, the
    rest padding that is never read.

    send: [N, ...] rows grouped by destination, in group-rank order; send_counts: [group.size] int64 tensor summing to
    N, where the rows live (no host sync here). capacity: the most rows any member may send any one member this time,
    which every member must pass alike (the caller derives it from what every rank knows, and checks its counts
    where that costs no host sync); a row past its block's capacity is an index error, a header above it an error
    at the receiver. Returns (recv [M, ...], recv_counts) as all_to_all_variable does, and send_counts as a list,
    read back with the received headers; async_op: an `InFlight`, its wait() reads them (the host sync on an
    accelerator)."""
    size, n = group.size, send.shape[0]
    if send_counts.shape != (size,):
        raise ValueError(f"send_counts of shape {tuple(send_counts.shape)} must give one count per rank of group "
                         f"{group.name} ({size})")
    if n > capacity * size:
        raise ValueError(f"{n} rows cannot travel in {size} blocks of capacity {capacity}")
    if size == 1:
        finish = lambda: (send, [n], [n])  # noqa: E731
        return InFlight(None, finish) if async_op else finish()

    row_shape = send.shape[1:]
    row_bytes = math.prod(row_shape) * send.element_size()
    head = header_rows(row_bytes)
    blocks = torch.empty(size, head + capacity, row_bytes, dtype=torch.uint8, device=send.device)
    counts = send_counts.to(torch.int64).contiguous()
    blocks.view(size, -1)[:, :COUNT_BYTES] = counts.view(torch.uint8).view(size, COUNT_BYTES)
    if n:  # each row to its destination's block, after the header, in order
        destination = torch.repeat_interleave(torch.arange(size, device=send.device), counts, output_size=n)
        first = torch.cumsum(counts, 0) - counts  # [size] each destination's first row in `send`
        slot = torch.arange(n, device=send.device) - first[destination] + head
        blocks[destination, slot] = send.contiguous().reshape(-1).view(torch.uint8).view(n, row_bytes)
    received = torch.empty_like(blocks)
    work = dist.all_to_all_single(received, blocks, group=group.handle, async_op=async_op)

    def finish() -> tuple[torch.Tensor, list[int], list[int]]:
        headers = received.view(size, -1)[:, :COUNT_BYTES].contiguous().view(torch.int64).view(size)
        recv_counts, sent = torch.stack([headers, counts]).tolist()  # both read back at once
        if max(recv_counts) > capacity or min(recv_counts) < 0:
            raise ValueError(f"received block counts {recv_counts} outside [0, {capacity}]: the members disagree "
                             f"on the capacity")
        if not sum(recv_counts):
            return torch.empty(0, *row_shape, dtype=send.dtype, device=send.device), recv_counts, sent
        arrived = _cat_rows([received[source, head:head + count] for source, count in enumerate(recv_counts)])
        return arrived.reshape(-1).view(send.dtype).reshape(sum(recv_counts), *row_shape), recv_counts, sent

    return InFlight(work, finish, (blocks, received)) if async_op else finish()


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of the parts that have rows (their sizes are on the host): no kernel is handed an empty one."""
    parts = [part for part in parts if part.shape[0]]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def broadcast_bytes(payload: bytes | None, group: Group, source: int, capacity: int) -> bytes:
    """Member `source`'s (global rank) payload on every member (the others pass None), its length travelling with
    it: one broadcast of a block of COUNT_BYTES + capacity bytes whose header is the length, and a second of the
    rest when the payload is longer than capacity (every member reads that from the header). torch's
    broadcast_object_list sends the length first, in a broadcast of its own, every time."""
    if group.size == 1:
        return payload
    block = torch.zeros(COUNT_BYTES + capacity, dtype=torch.uint8)
    if group.ranks[group.rank] == source:
        _write_block(block, payload, capacity)
    dist.broadcast(block, src=source, group=group.handle)
    length = _length(block)
    if length <= capacity:
        return block[COUNT_BYTES:COUNT_BYTES + length].numpy().tobytes()
    rest = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if group.ranks[group.rank] == source else \
        torch.empty(length, dtype=torch.uint8)
    dist.broadcast(rest, src=source, group=group.handle)
    return rest.numpy().tobytes()


def gather_bytes(payload: bytes, group: Group, dest: int, capacity: int) -> list[bytes] | None:
    """Every member's payload on member `dest` (global rank), in group-rank order (None on the others), lengths
    travelling with them: one gather of blocks of COUNT_BYTES + capacity bytes (a header of the length, then the
    payload); a member whose payload is longer sends it whole after the gather, point to point, and `dest` receives
    it from each member whose header says so. torch's gather_object all-gathers the lengths first, every time, and
    gloo's all-gather is a ring of size - 1 hops where its gather is one message from each member."""
    if group.size == 1:
        return [payload]
    block = torch.zeros(COUNT_BYTES + capacity, dtype=torch.uint8)
    _write_block(block, payload, capacity)
    mine = group.ranks[group.rank] == dest
    blocks = [torch.empty_like(block) for _ in range(group.size)] if mine else None
    dist.gather(block, blocks, dst=dest, group=group.handle)
    if not mine:
        if len(payload) > capacity:
            dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=dest, group=group.handle)
        return None
    out = []
    for source, b in zip(group.ranks, blocks):
        length = _length(b)
        if length <= capacity:
            out.append(b[COUNT_BYTES:COUNT_BYTES + length].numpy().tobytes())
        elif source == dest:
            out.append(payload)
        else:
            whole = torch.empty(length, dtype=torch.uint8)
            dist.recv(whole, src=source, group=group.handle)
            out.append(whole.numpy().tobytes())
    return out


def _write_block(block: torch.Tensor, payload: bytes, capacity: int) -> None:
    """The payload's length into block's header, and the payload after it if it fits."""
    block[:COUNT_BYTES] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    if payload and len(payload) <= capacity:
        block[COUNT_BYTES:COUNT_BYTES + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def _length(block: torch.Tensor) -> int:
    return int(block[:COUNT_BYTES].view(torch.int64)[0])


def barrier(group: Group) -> None:
    if group.size > 1:
        dist.barrier(group=group.handle)
