"""KV cache offload, the ranks' side (runner/engine/kv_offload.py says what the tiers are and when they move): each
rank's host slots, its files in the disk tier, and the copies a step's OffloadOps ask for.

A unit is what cache.transfer_views() enumerates (P/D disaggregation moves the same units): a block's entries in
every cache tensor of every layer (V3.2: latent rows, indexer keys, INT8 scales; V4: compressed entries, indexer
keys), or a V4 state block's rows. A host slot holds one unit of a kind, as one uint8 row per view.

A disk file holds one unit: MAGIC, the header's length (4 bytes, little-endian), a JSON header (the directory's
fingerprint, the kind, the hash, the payload's length and sha256), then the payload (the views' rows, in order). It is
written under a temporary name and renamed whole, so a file a killed server was writing is never read (a rank removes
the temporary files it finds at start). A file is read back only when every header field and the checksum agree;
otherwise it is counted as corrupt and removed.

The directory (`open_directory`) records what it belongs to (DIRECTORY_META: the shards' manifest digest, the compute
and cache dtypes, the block size, the world size, the speculative tokens (V3.2's MTP layer is a layer of the cache)
and a block's and a sequence slot's bytes): a server refuses another's in one line. Each rank keeps its files in
`rank<NNN>/`; rank 0 reads every rank's directory at start (`scan`, `agree`): a block counts when every rank of its
DP index has a file for it, and the files of one only some have are removed. So a deployment over several nodes
needs the path on storage every node sees.

Any OSError of the tier (ENOSPC, EDQUOT, EFBIG, EROFS, EACCES, EIO, ...) is reported (`OffloadReport.failed`) and
stops this rank's writes; rank 0 stops every spill when it hears (kv_offload.Offloader.reported). A read that fails
is a miss. `run`'s deadline bounds a graceful stop's flush (FLUSH_S).

On an accelerator the device copies run on a side stream into pinned host memory, which the compute stream waits
for before the step's forward (a saved block may be written by that step).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from dsconv.errors import InputError
from dsconv.runner.engine.block_pool import HASH_BYTES
from dsconv.runner.engine.kv_offload import (BLOCK, DROP, FETCH, KINDS, SAVE, SPILL, STATE, OffloadOps,
                                             OffloadReport, TierShape)

MAGIC = b"DSRUNKV1"
LENGTH_BYTES = 4  # the header's length
DIRECTORY_META = "dsrun-kv-offload.json"
FORMAT = 1
SUFFIX, TEMPORARY = ".kv", ".tmp"
DIGEST_SHOWN = 12  # characters of a recorded value a refusal shows (the model is a sha256)
# A graceful stop's flush of the host tier to disk ends after this many seconds, written or not: a SIGTERM's grace
# (Kubernetes' terminationGracePeriodSeconds, 30 s by default) is mostly the drain's (--drain-timeout); at a local
# disk's 1 GB/s this writes about 10 GB a rank. A file a rank did not reach is removed at the next start on the
# ranks that wrote it (a block counts only where every rank of its DP index has one).
FLUSH_S = 10.0


def open_directory(path: Path, identity: dict) -> str:
    """The disk tier's directory for a run of `identity` (made when missing) -> its fingerprint; InputError (one
    line) when it is another run's (model, dtypes, block size or world size) or a directory of something else."""
    identity = {"format": FORMAT, **identity}
    meta = path / DIRECTORY_META
    try:
        path.mkdir(parents=True, exist_ok=True)
        if meta.exists():
            recorded = json.loads(meta.read_text())
            if recorded != identity:
                differ = sorted(k for k in set(recorded) | set(identity) if recorded.get(k) != identity.get(k))
                was = ", ".join(f"{k} {str(recorded.get(k))[:DIGEST_SHOWN]!r}" for k in differ)
                raise InputError(f"--kv-offloading-path {path} holds another run's KV cache (it was written for "
                                 f"{was}): give another directory, or empty this one")
        elif any(path.iterdir()):
            raise InputError(f"--kv-offloading-path {path} is not empty and is not a KV offload directory (no "
                             f"{DIRECTORY_META})")
        else:
            meta.write_text(json.dumps(identity, sort_keys=True))
    except (OSError, ValueError) as exc:
        raise InputError(f"--kv-offloading-path {path}: {exc}") from None
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def rank_directory(path: Path, rank: int) -> Path:
    return path / f"rank{rank:03d}"


def file_name(kind: str, digest: bytes) -> str:
    return f"{kind}-{digest.hex()}{SUFFIX}"


def agree(found: list[dict[str, list[bytes]]]) -> tuple[dict[str, list[bytes]], dict[str, list[bytes]]]:
    """The scans of one DP index's ranks -> (per kind, the hashes every rank has a file for, in the first rank's
    order; those only some ranks have, whose files go)."""
    known, strays = {}, {}
    for kind in KINDS:
        everywhere = set.intersection(*(set(rank[kind]) for rank in found))
        known[kind] = [digest for digest in found[0][kind] if digest in everywhere]
        strays[kind] = list(dict.fromkeys(digest for rank in found for digest in rank[kind]
                                          if digest not in everywhere))
    return known, strays


def scan(path: Path, rank: int) -> dict[str, list[bytes]]:
    """The hashes a rank's directory has files for, per kind, oldest first (by modification time)."""
    found = {kind: [] for kind in KINDS}
    directory = rank_directory(path, rank)
    if not directory.is_dir():
        return found
    entries = []
    for file in directory.iterdir():
        kind, _, rest = file.name.partition("-")
        if kind in KINDS and rest.endswith(SUFFIX):
            try:
                if file.is_file():  # a directory or a device with a block's name is nobody's block
                    entries.append((file.stat().st_mtime_ns, kind, bytes.fromhex(rest[:-len(SUFFIX)])))
            except (OSError, ValueError):
                continue
    for _, kind, digest in sorted(entries):
        found[kind].append(digest)
    return found


def _header(fingerprint: str, kind: str, digest: bytes, size: int, sha256: str) -> bytes:
    return json.dumps({"fingerprint": fingerprint, "kind": kind, "hash": digest.hex(), "bytes": size,
                       "sha256": sha256}).encode()


def encode(fingerprint: str, kind: str, digest: bytes, payload: bytes) -> bytes:
    header = _header(fingerprint, kind, digest, len(payload), hashlib.sha256(payload).hexdigest())
    return MAGIC + len(header).to_bytes(LENGTH_BYTES, "little") + header + payload


def file_bytes(fingerprint: str, unit_bytes: dict[str, int]) -> dict[str, int]:
    """Per kind, the bytes of one unit's file on this rank, header included (the disk tier's size counts them)."""
    return {kind: unit_file_bytes(fingerprint, kind, bytes(HASH_BYTES), size) for kind, size in unit_bytes.items()}


def unit_file_bytes(fingerprint: str, kind: str, digest: bytes, size: int) -> int:
    """The bytes of the file of the unit `digest` of `size` payload bytes (its header names the hash)."""
    return len(MAGIC) + LENGTH_BYTES + size + len(_header(fingerprint, kind, digest, size, hashlib.sha256().hexdigest()))


def decode(data: bytes, fingerprint: str, kind: str, digest: bytes, size: int) -> bytes:
    """A file's bytes -> its payload; ValueError naming what is wrong (torn, corrupt, another run's, another
    unit's)."""
    if data[:len(MAGIC)] != MAGIC:
        raise ValueError("not a KV offload file")
    start = len(MAGIC) + LENGTH_BYTES
    length = int.from_bytes(data[len(MAGIC):start], "little")
    try:
        header = json.loads(data[start:start + length])
    except (ValueError, UnicodeDecodeError):
        raise ValueError("its header is torn or corrupt") from None
    if not isinstance(header, dict):
        raise ValueError("its header is torn or corrupt (not a JSON object)")
    if header.get("fingerprint") != fingerprint:
        raise ValueError("it belongs to another model or cache layout")
    if header.get("kind") != kind or header.get("hash") != digest.hex():
        raise ValueError("it holds another block")
    payload = data[start + length:]
    if header.get("bytes") != size or len(payload) != size:
        raise ValueError(f"it is torn ({len(payload)} payload bytes of {size})")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("its checksum does not match")
    return payload


class OffloadStore:
    """One rank's host slots and disk files (run: one step's ops)."""

    def __init__(self, cache, shape: TierShape, dp_index: int, rank: int, directory: Path | None = None,
                 fingerprint: str = ""):
        blocks, states = cache.transfer_views()
        self.views = {BLOCK: blocks, STATE: states}
        self.dp_index, self.rank, self.fingerprint = dp_index, rank, fingerprint
        accelerator = cache.device.type != "cpu"
        self.host = {kind: [torch.empty(shape.host[kind], view.shape[1], dtype=torch.uint8, pin_memory=accelerator)
                            for view in self.views[kind]] for kind in KINDS}
        self.unit_bytes = shape.unit_bytes  # one unit of each kind on this rank (its views' widths summed)
        self.stream = torch.Stream(device=cache.device) if accelerator else None
        self.write = _write  # (path, bytes) -> None: raises OSError as the filesystem does (tests replace it)
        self.stopped: str | None = None  # the filesystem's first error: this rank writes no more files
        self._unreported = OffloadReport(dp_index, rank)  # errors met before the first step's ops
        self.directory = None if directory is None else rank_directory(directory, rank)
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                for stale in self.directory.glob(f"*{TEMPORARY}*"):  # a write a killed server left: never read
                    stale.unlink(missing_ok=True)
            except OSError as exc:
                self._failed(self._unreported, exc, f"preparing {self.directory}")

    def run(self, ops: OffloadOps | None, deadline: float | None = None) -> OffloadReport:
        """A step's ops, in order -> what failed and what moved. deadline (time.monotonic()): the ops left when it
        passes are not run (a graceful stop's flush)."""
        report, self._unreported = self._unreported, OffloadReport(self.dp_index, self.rank)
        if ops is None:
            return report
        compute = None
        if self.stream is not None:  # the device copies go on the side stream, after what the step before wrote
            compute = torch.accelerator.current_stream(self.stream.device)
            self.stream.wait_stream(compute)
        for done, op in enumerate(ops.ops):
            if deadline is not None and time.monotonic() > deadline:
                print(f"dsrun: KV offload: rank {self.rank} stopped writing its host tier to disk after {FLUSH_S:g} s "
                      f"({done} of {len(ops.ops)} ops run)", file=sys.stderr, flush=True)
                break
            self._run_op(op, report)
        if compute is not None:  # the step's forward writes blocks saved here, reads blocks loaded here
            compute.wait_stream(self.stream)
        return report

    def flush(self, ops: OffloadOps | None) -> None:
        """A graceful stop: the host tier's blocks written to disk (kv_offload.Offloader.flush), for FLUSH_S at
        most (checked between files: one write the filesystem holds up is waited for), and one line saying so."""
        report = self.run(ops, time.monotonic() + FLUSH_S)
        if ops is None or not ops.ops:
            return
        errors = f"; the disk said: {report.disk_errors[0][1]}" if report.disk_errors else ""
        print(f"dsrun: KV offload: rank {self.rank} wrote {report.moved['host_to_disk'] / 2**20:.1f} MiB of its host "
              f"tier to {self.directory}{errors}", file=sys.stderr, flush=True)

    def _run_op(self, op: tuple, report: OffloadReport) -> None:
        name, kind = op[0], op[1]
        if name == DROP:
            self._drop(kind, op[2], report)
        elif name == SPILL:
            if self.stream is not None:
                self.stream.synchronize()  # the slot's save is whole in host memory
            self._spill(kind, op[2], op[3], report)
        elif name == FETCH:
            self._fetch(kind, op[2], op[3], report)
        else:
            self._device_copy(name, kind, op[2], op[3], report)

    def _failed(self, report: OffloadReport, exc: OSError, what: str) -> None:
        report.failed(exc, what)
        self.stopped = self.stopped or f"{what}: {exc}"

    def _drop(self, kind: str, digest: bytes, report: OffloadReport) -> None:
        path = self.directory / file_name(kind, digest)
        try:  # missing_ok covers a missing file only: a read-only mount still says EROFS
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._failed(report, exc, f"removing {path}")

    def _device_copy(self, name: str, kind: str, first: int, second: int, report: OffloadReport) -> None:
        """SAVE (device block -> host slot) or LOAD (host slot -> device block), on the side stream if there is
        one."""
        with self.stream if self.stream is not None else contextlib.nullcontext():
            for view, host in zip(self.views[kind], self.host[kind]):
                if name == SAVE:
                    host[second].copy_(view[first], non_blocking=self.stream is not None)
                else:
                    view[second].copy_(host[first], non_blocking=self.stream is not None)
        report.moved["device_to_host" if name == SAVE else "host_to_device"] += self.unit_bytes[kind]

    def _spill(self, kind: str, slot: int, digest: bytes, report: OffloadReport) -> None:
        if self.stopped is not None:  # rank 0 has not heard yet: its index forgets the file (failed_spills)
            report.failed_spills.append((kind, digest, f"the disk tier stopped ({self.stopped})"))
            return
        payload = b"".join(host[slot].numpy().tobytes() for host in self.host[kind])
        final = self.directory / file_name(kind, digest)
        temporary = final.with_name(f"{final.name}{TEMPORARY}{os.getpid()}")
        try:
            self.write(temporary, encode(self.fingerprint, kind, digest, payload))
            os.replace(temporary, final)
        except OSError as exc:
            report.failed_spills.append((kind, digest, str(exc)))
            self._failed(report, exc, f"writing {final}")
            with contextlib.suppress(OSError):  # what failed is reported above; a torn temporary file is never read
                temporary.unlink(missing_ok=True)
            return
        report.moved["host_to_disk"] += len(payload)

    def _fetch(self, kind: str, digest: bytes, slot: int, report: OffloadReport) -> None:
        """A file read into a host slot; one that cannot be read is a miss (every rank of the DP index then removes
        it: kv_offload.Offloader.reported)."""
        path = self.directory / file_name(kind, digest)
        try:
            size, expected = path.stat().st_size, unit_file_bytes(self.fingerprint, kind, digest, self.unit_bytes[kind])
            if size != expected:  # looked at before reading: a huge file with a block's name is never read whole
                raise ValueError(f"{size} bytes, where this {kind} file has {expected}")
            payload = decode(path.read_bytes(), self.fingerprint, kind, digest, self.unit_bytes[kind])
        except FileNotFoundError:
            report.failed_fetches.append((kind, digest, "missing"))
            return
        except OSError as exc:
            report.failed_fetches.append((kind, digest, str(exc)))
            self._failed(report, exc, f"reading {path}")
            return
        except ValueError as exc:
            report.failed_fetches.append((kind, digest, str(exc)))
            report.corrupt += 1
            self._drop(kind, digest, report)
            return
        offset = 0
        for host in self.host[kind]:
            width = host.shape[1]
            host[slot].copy_(torch.frombuffer(bytearray(payload[offset:offset + width]), dtype=torch.uint8))
            offset += width
        report.moved["disk_to_host"] += len(payload)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)
