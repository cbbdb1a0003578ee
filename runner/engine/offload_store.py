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
and cache dtypes, the block size and world size): a server refuses another's in one line. Each rank keeps its files in
`rank<NNN>/`; rank 0 reads the index of each DP index's first rank at start (`scan`), so a deployment over several
nodes needs the path on storage every node sees.

On an accelerator the device copies run on a side stream into pinned host memory, which the compute stream waits
for before the step's forward (a saved block may be written by that step).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from pathlib import Path

import torch

from dsconv.errors import InputError
from dsconv.runner.engine.kv_offload import (BLOCK, DROP, FETCH, KINDS, SAVE, SPILL, STATE, OffloadOps,
                                             OffloadReport, TierShape)

MAGIC = b"DSRUNKV1"
LENGTH_BYTES = 4  # the header's length
DIRECTORY_META = "dsrun-kv-offload.json"
FORMAT = 1
SUFFIX, TEMPORARY = ".kv", ".tmp"
DIGEST_SHOWN = 12  # characters of a recorded value a refusal shows (the model is a sha256)


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
                entries.append((file.stat().st_mtime_ns, kind, bytes.fromhex(rest[:-len(SUFFIX)])))
            except (OSError, ValueError):
                continue
    for _, kind, digest in sorted(entries):
        found[kind].append(digest)
    return found


def encode(fingerprint: str, kind: str, digest: bytes, payload: bytes) -> bytes:
    header = json.dumps({"fingerprint": fingerprint, "kind": kind, "hash": digest.hex(), "bytes": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return MAGIC + len(header).to_bytes(LENGTH_BYTES, "little") + header + payload


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
        self.dp_index, self.fingerprint = dp_index, fingerprint
        accelerator = cache.device.type != "cpu"
        self.host = {kind: [torch.empty(shape.host[kind], view.shape[1], dtype=torch.uint8, pin_memory=accelerator)
                            for view in self.views[kind]] for kind in KINDS}
        self.unit_bytes = shape.unit_bytes  # one unit of each kind on this rank (its views' widths summed)
        self.stream = torch.Stream(device=cache.device) if accelerator else None
        self.directory = None
        if directory is not None:
            self.directory = rank_directory(directory, rank)
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"*{TEMPORARY}*"):  # a write a killed server left: never read
                stale.unlink(missing_ok=True)
        self.write = _write  # (path, bytes) -> None: raises OSError as the filesystem does (tests replace it)

    def run(self, ops: OffloadOps | None) -> OffloadReport:
        """A step's ops, in order -> what failed and what moved."""
        report = OffloadReport(self.dp_index)
        if ops is None:
            return report
        compute = None
        if self.stream is not None:  # the device copies go on the side stream, after what the step before wrote
            compute = torch.accelerator.current_stream(self.stream.device)
            self.stream.wait_stream(compute)
        for op in ops.ops:
            name, kind = op[0], op[1]
            if name == DROP:
                (self.directory / file_name(kind, op[2])).unlink(missing_ok=True)
            elif name == SPILL:
                if self.stream is not None:
                    self.stream.synchronize()  # the slot's save is whole in host memory
                self._spill(kind, op[2], op[3], report)
            elif name == FETCH:
                self._fetch(kind, op[2], op[3], report)
            else:
                self._device_copy(name, kind, op[2], op[3], report)
        if compute is not None:  # the step's forward writes blocks saved here, reads blocks loaded here
            compute.wait_stream(self.stream)
        return report

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
        payload = b"".join(host[slot].numpy().tobytes() for host in self.host[kind])
        final = self.directory / file_name(kind, digest)
        temporary = final.with_name(f"{final.name}{TEMPORARY}{os.getpid()}")
        try:
            self.write(temporary, encode(self.fingerprint, kind, digest, payload))
            os.replace(temporary, final)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            report.failed_spills.append((kind, digest, str(exc)))
            report.disk_full = report.disk_full or exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            return
        report.moved["host_to_disk"] += len(payload)

    def _fetch(self, kind: str, digest: bytes, slot: int, report: OffloadReport) -> None:
        path = self.directory / file_name(kind, digest)
        try:
            payload = decode(path.read_bytes(), self.fingerprint, kind, digest, self.unit_bytes[kind])
        except FileNotFoundError:
            report.failed_fetches.append((kind, digest, "missing"))
            return
        except (OSError, ValueError) as exc:
            report.failed_fetches.append((kind, digest, str(exc)))
            report.corrupt += 1
            path.unlink(missing_ok=True)
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
