"""Carrying out a plan: row chunks decoded and quantized on worker threads, written straight to their offsets.

Each part file is pre-sized behind its final header under a temporary name, filled by chunk tasks in any
order, then fsynced and renamed. Memory is a few chunks per worker, whatever the checkpoint size. A part
whose final file already exists with the planned header and size is complete (the rename is the commit).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from dsconv.convert.decode import decode_columns, decode_rows, scale_rows
from dsconv.errors import InputError
from dsconv.convert.plan import KEEP, PART_METADATA, TO_BF16, TO_INT8, Item, Part
from dsconv.convert.safetensors_io import fsync_dir, header_bytes, pread, read_rows
from dsconv.kernels.int8 import quantize_rows_

# Elements per task: big enough that the ~15 torch calls per chunk (each a GIL hand-off between worker
# threads) cost little next to their work, small enough that memory stays a few chunks per worker.
CHUNK_ELEMENTS = 1 << 22
COPY_CHUNK_BYTES = 16 << 20  # KEEP tensors are copied in slices of this size
# Dirty pages are flushed in the background every this many bytes, so writeback overlaps compute and
# the final fsync of a part has little left to do.
WRITEBACK_BYTES = 256 << 20


# glibc serves buffers over 128 KiB with fresh mmaps and unmaps them when freed, so every chunk's
# temporaries would page-fault in afresh. Raising the thresholds keeps freed chunk buffers in the heap for
# reuse. (32 MiB is the largest mmap threshold glibc accepts on 64-bit.)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 512 << 20


def keep_freed_buffers() -> bool:
    """Returns whether the allocator took the setting (only glibc has mallopt; elsewhere it is a no-op)."""
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


class SourceFiles:
    """One read-only descriptor per source file, shared by the workers (positioned reads are thread-safe)."""

    def __init__(self, items: tuple[Item, ...]):
        paths = {w.value.path for w in (item.weight for item in items)}
        paths |= {item.weight.scale.path for item in items if item.weight.scale is not None}
        self._fds: dict[Path, int] = {}
        try:
            for path in sorted(paths):
                self._fds[path] = os.open(path, os.O_RDONLY)
        except OSError:
            self.close()  # a source file vanished mid-run: release the ones already open
            raise

    def fd(self, path: Path) -> int:
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True)
class Task:
    item: Item
    start: int  # rows for decode/quantize tasks, bytes for KEEP copies
    stop: int


def _tasks(item: Item) -> Iterator[Task]:
    start, stop = item.rows
    if item.action == KEEP and item.cols is None:  # a contiguous byte range: copy it in slices
        entry = item.weight.value.entry
        row_bytes = entry.nbytes // (entry.shape[0] if entry.shape else 1) if entry.nbytes else 0
        first, last = start * row_bytes, stop * row_bytes
        step = max(entry.dtype.itemsize, COPY_CHUNK_BYTES - COPY_CHUNK_BYTES % entry.dtype.itemsize)
        for begin in range(first, last, step):
            yield Task(item, begin, min(last, begin + step))
        if first == last:
            yield Task(item, first, last)
        return
    cols = item.weight.spec.shape[1]
    step = max(1, CHUNK_ELEMENTS // cols)
    for begin in range(start, stop, step):
        yield Task(item, begin, min(stop, begin + step))


def _offsets(part: Part) -> dict[str, int]:
    pos = len(header_bytes(part.tensors, PART_METADATA))
    offsets = {}
    for t in part.tensors:
        offsets[t.name] = pos
        pos += t.nbytes
    return offsets


def _check_finite(name: str, values: torch.Tensor, where: str) -> None:
    # NaN propagates through max/min and +-Inf lands in one of them: two reductions, no mask tensor.
    if values.numel() and not bool(torch.isfinite(torch.stack((values.amax(), values.amin()))).all()):
        raise InputError(f"{name}: NaN or Inf in the weight ({where}); refusing to convert it")


def _pwrite(fd: int, tensor: torch.Tensor, offset: int) -> None:
    data = memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")
    written = os.pwrite(fd, data, offset)
    if written != len(data):  # pwrite to a regular file only comes up short when the disk is full
        raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes): is the disk full?")


def _run_task(task: Task, files: SourceFiles, fd: int, offsets: dict[str, int], block: tuple[int, int] | None) -> int:
    item, weight = task.item, task.item.weight
    name = weight.spec.name
    out = item.outputs[0]
    if item.action == KEEP and item.cols is None:
        entry, path = weight.value.entry, weight.value.path
        raw = pread(files.fd(path), path, entry.offset + task.start, task.stop - task.start, name)
        if entry.dtype.is_floating_point:
            _check_finite(name, raw.view(entry.dtype), f"bytes {task.start}-{task.stop}")
        first_byte = item.rows[0] * (entry.nbytes // (entry.shape[0] if entry.shape else 1) if entry.nbytes else 0)
        _pwrite(fd, raw, offsets[out.name] + task.start - first_byte)
        return task.stop - task.start

    values = read_rows(files.fd(weight.value.path), weight.value.path, weight.value.entry, task.start, task.stop)
    rows = task.stop - task.start
    out_row = task.start - item.rows[0]  # the first output row this task writes
    if item.action == KEEP:  # a column slice of stored rows
        x = values[:, item.cols[0]:item.cols[1]]
        if x.dtype.is_floating_point:
            _check_finite(name, x, f"rows {task.start}-{task.stop}")
        _pwrite(fd, x, offsets[out.name] + out_row * out.nbytes // out.shape[0])
        return item.source_bytes * rows // (item.rows[1] - item.rows[0])
    scales = None
    if weight.scale is not None:
        s0, s1 = scale_rows(weight.encoding, block, task.start, task.stop)
        scales = read_rows(files.fd(weight.scale.path), weight.scale.path, weight.scale.entry, s0, s1)
    if item.cols is None:
        x = decode_rows(values, scales, weight.encoding, block, task.start)  # [rows, cols] float32
    else:  # a column split: only this shard's columns
        x = decode_columns(values, scales, weight.encoding, block, task.start, item.cols)
    if item.action == TO_BF16:
        _check_finite(name, x, f"rows {task.start}-{task.stop}")
        _pwrite(fd, x.to(torch.bfloat16), offsets[out.name] + out_row * out.nbytes // out.shape[0])
    elif item.action == TO_INT8:
        cols = x.shape[1]
        q = torch.empty(rows, cols, dtype=torch.int8)
        scale = torch.empty(rows, 1, dtype=torch.float32)
        amax = quantize_rows_(x, q, scale)
        _check_finite(name, amax, f"rows {task.start}-{task.stop}")
        _pwrite(fd, q, offsets[out.name] + out_row * cols)
        for companion in item.outputs[1:]:  # weight_scale, then weight_offset (zeros: symmetric)
            data = scale if companion.name.endswith("weight_scale") else torch.zeros_like(scale)
            _pwrite(fd, data, offsets[companion.name] + out_row * scale.element_size())
    else:
        raise AssertionError(item.action)
    return item.source_bytes * rows // (item.rows[1] - item.rows[0])


@contextmanager
def _torch_threads(n: int):
    # Workers run one chunk each; torch's own intra-op pool would only contend with them.
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def part_is_complete(part: Part, path: Path) -> bool:
    if not path.is_file() or path.stat().st_size != part.nbytes:
        return False
    header = header_bytes(part.tensors, PART_METADATA)
    with open(path, "rb") as f:
        return f.read(len(header)) == header


def write_part(part: Part, path: Path, block: tuple[int, int] | None, workers: int,
               on_progress: Callable[[int], None]) -> None:
    tmp = path.with_name(path.name + ".partial")
    offsets = _offsets(part)
    keep_freed_buffers()
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite(fd, torch.frombuffer(bytearray(header_bytes(part.tensors, PART_METADATA)), dtype=torch.uint8), 0)
        os.ftruncate(fd, part.nbytes)
        files = SourceFiles(part.items)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="dsconv")
        flusher = ThreadPoolExecutor(1, thread_name_prefix="dsconv-writeback")
        try:
            with _torch_threads(1):
                futures = [pool.submit(_run_task, task, files, fd, offsets, block)
                           for item in part.items for task in _tasks(item)]
                unflushed = 0
                for future in as_completed(futures):
                    done = future.result()  # re-raises a worker's error
                    on_progress(done)
                    unflushed += done
                    if unflushed >= WRITEBACK_BYTES:
                        flusher.submit(os.fdatasync, fd)
                        unflushed = 0
        finally:
            # On an error or Ctrl-C, drop queued chunks instead of finishing them.
            pool.shutdown(wait=True, cancel_futures=True)
            flusher.shutdown(wait=True, cancel_futures=True)
            files.close()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
