"""safetensors files read and written tensor by tensor.

Reading goes through positioned reads into fresh buffers instead of `safe_open`'s mmap: mapped file pages
count towards the process's resident set for as long as the mapping lives, so mapping a 5 GB shard makes
RSS grow by 5 GB even when each tensor is dropped right after use. Writing streams each tensor's bytes
behind a header computed up front, so a file never has to be assembled in memory.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from dsconv.errors import InputError

HEADER_LEN_BYTES = 8  # little-endian u64 in front of the JSON header
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own cap; a larger length means a corrupt file
HEADER_ALIGN = 8  # the header is space-padded so tensor data starts 8-byte aligned

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate a header against the file size; a truncated or corrupt file is an InputError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_LEN_BYTES)
        if len(head) < HEADER_LEN_BYTES:
            raise InputError(f"{path.name}: not a safetensors file ({size} bytes, too short for a header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or HEADER_LEN_BYTES + header_len > size:
            raise InputError(f"{path.name}: corrupt or truncated safetensors header (declares {header_len} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path.name}: corrupt safetensors header ({exc.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path.name}: corrupt safetensors header (not a JSON object)")
    data_start = HEADER_LEN_BYTES + header_len
    data_len = size - data_start
    entries: dict[str, TensorEntry] = {}
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path.name}: corrupt header entry for tensor {name}") from None
        if not (isinstance(dtype_name, str) and all(_count(v) for v in (begin, end, *shape))):
            raise InputError(f"{path.name}: corrupt header entry for tensor {name}")
        if dtype_name not in DTYPES:
            raise InputError(f"{path.name}: tensor {name} has unsupported dtype {dtype_name}")
        dtype = DTYPES[dtype_name]
        nbytes = _numel(shape) * dtype.itemsize
        if not (0 <= begin <= end) or end - begin != nbytes:
            raise InputError(f"{path.name}: tensor {name} declares {end - begin} bytes, its shape needs {nbytes}")
        if end > data_len:
            raise InputError(
                f"{path.name} is truncated: tensor {name} needs bytes up to {end} but the file holds {data_len}"
            )
        end_max = max(end_max, end)
        entries[name] = TensorEntry(name, dtype, shape, data_start + begin, nbytes)
    if end_max != data_len:
        raise InputError(f"{path.name}: {data_len - end_max} trailing bytes after the last tensor (corrupt file)")
    return entries


def read_tensor(path: Path, entry: TensorEntry) -> torch.Tensor:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_rows(fd, path, entry, 0, entry.shape[0] if entry.shape else 1)
    finally:
        os.close(fd)


def read_rows(fd: int, path: Path, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) along dim 0 of a tensor in the open file `fd`, by one positioned read."""
    if not entry.shape:
        return pread(fd, path, entry.offset, entry.nbytes, entry.name).view(entry.dtype).reshape(())
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    buf = pread(fd, path, entry.offset + start * row_bytes, (stop - start) * row_bytes, entry.name)
    return buf.view(entry.dtype).reshape(stop - start, *entry.shape[1:])


def pread(fd: int, path: Path, offset: int, nbytes: int, what: str) -> torch.Tensor:
    """nbytes at offset into a fresh uint8 tensor; a short read means the file changed or is truncated."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    got = os.preadv(fd, [memoryview(buf.numpy())], offset) if nbytes else 0
    if got != nbytes:
        raise InputError(f"{path.name}: short read of {what} ({got} of {nbytes} bytes); file truncated?")
    return buf


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def header_bytes(tensors: list[OutTensor], metadata: dict[str, str]) -> bytes:
    """The exact header (length prefix included) for tensors laid out back to back in list order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def file_size(tensors: list[OutTensor], metadata: dict[str, str]) -> int:
    return len(header_bytes(tensors, metadata)) + sum(t.nbytes for t in tensors)


class StreamingWriter:
    """Writes one safetensors file under a temporary name; `commit()` fsyncs and renames it into place.

    Tensors must arrive in the order given to the constructor, with the declared dtype and shape.
    """

    def __init__(self, path: Path, tensors: list[OutTensor], metadata: dict[str, str]):
        self.path = path
        self.tmp = path.with_name(path.name + ".partial")
        self._pending = list(tensors)
        self._f = open(self.tmp, "wb")
        self._f.write(header_bytes(tensors, metadata))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._pending.pop(0) if self._pending else None
        if expected is None or expected.name != name:
            raise RuntimeError(f"writer for {self.path.name} got {name}, expected {expected and expected.name}")
        if tensor.dtype != expected.dtype or tuple(tensor.shape) != expected.shape:
            raise RuntimeError(
                f"{name}: produced {tensor.dtype} {tuple(tensor.shape)}, planned {expected.dtype} {expected.shape}"
            )
        self._f.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()))

    def commit(self) -> None:
        if self._pending:
            raise RuntimeError(f"{self.path.name}: {len(self._pending)} planned tensors were never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: object) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())
