"""KV cache offload under the prefix cache (vLLM's --kv-offloading-size, SGLang's hierarchical cache): the scheduler's
side, on rank 0, one `Offloader` per attention-DP rank; runner/engine/offload_store.py is the ranks' side.

Two tiers below the device pool (block_pool.py), each keyed by the block hashes the prefix cache publishes under
(so a request's cache_salt isolates every tier as it does the device one):
- **host**: a fixed number of slots in host memory on every rank (--kv-offloading-size GiB over all ranks, vLLM's
  meaning). A published block the device pool gives up (`BlockPool.on_evict`) is copied into a host slot first,
  before the step that reuses it writes it; so is a DeepSeek-V4 state block (`StatePool.on_evict`). Host slots are
  given out least recently used first.
- **disk** (--kv-offloading-path DIR, --kv-offloading-disk-size GiB): a block that falls out of the host tier is
  written to a file named by its hash (offload_store.py: a checksummed file, written under a temporary name and
  renamed whole). Files are dropped least recently used first past the size; a server restarted on DIR with the same
  shards finds them (`DiskTier.scan`).

A request's prefix is looked up device first, then host, then disk (`kv_connector.offload.OffloadConnector.hit`).
Host hits are copied into fresh device blocks in the ops of the step that admits the request, before its forward.
Disk hits are
read into host slots first, in a step of their own: each rank checks its file, and a file that is torn, corrupt or
another model's is reported (`OffloadReport`), counted and removed; the request is looked up again the next step and
computes what was not found. The ops of a step (`OffloadOps`) run on every rank of the DP index in the order the
scheduler decided them, before anything else of the step: a slot a hit loads from and then gives to an evicted block
is read before it is written; a slot a hit reads, or a disk read fills, is given to nobody else in that step
(`busy`), nor, while the read is unchecked, is its hash a hit for anyone (`pending`). The files a hit reads are
pinned before any of their slots is taken, so the spills those slots cause never drop one of them.

A file on disk counts only when every rank of its DP index has one (a block is read on all of them); a failed read
removes it on all of them. Any error the filesystem gives the tier stops the spills for the life of the process
(one log line, `OffloadCounts.disk_stopped`, the metrics and /health say why); reads go on, and one that fails is a
miss. A graceful stop writes what the host tier holds to disk (`Offloader.flush`), so a restart finds it.
"""

from __future__ import annotations

import errno
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from dsconv.errors import InputError
from dsconv.runner.engine.kv_connector.base import StepMeta

GIB = 2**30
BLOCK, STATE = "block", "state"  # a block's entries; a DeepSeek-V4 state block (block_pool.StatePool)
KINDS = (BLOCK, STATE)
TIERS = ("device", "host", "disk")  # where a prefix hit came from; where a block was given up
DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")


@dataclass(frozen=True)
class OffloadConfig:
    """--kv-offloading-size (host bytes over every rank), --kv-offloading-path and --kv-offloading-disk-size (disk
    bytes over every rank; 0 without a path)."""
    host_bytes: int
    path: Path | None = None
    disk_bytes: int = 0
    fingerprint: str = ""  # the disk tier directory's (offload_store.open_directory), in every file's header

    @classmethod
    def of(cls, size_gib: float | None, path: Path | None, disk_gib: float | None) -> OffloadConfig | None:
        """The flags -> the config (None: no offload); InputError (one line) on a bad combination. The directory
        itself is checked against the shards by offload_store.open_directory."""
        if size_gib is None:
            if path is not None or disk_gib is not None:
                raise InputError("--kv-offloading-path and --kv-offloading-disk-size need --kv-offloading-size (the "
                                 "host tier disk blocks pass through)")
            return None
        if not size_gib > 0:
            raise InputError(f"--kv-offloading-size {size_gib} must be a positive number of GiB")
        if (path is None) != (disk_gib is None):
            raise InputError("--kv-offloading-path and --kv-offloading-disk-size go together (a directory and how "
                             "much of it the disk tier may fill)")
        if disk_gib is not None and not disk_gib > 0:
            raise InputError(f"--kv-offloading-disk-size {disk_gib} must be a positive number of GiB")
        if path is not None and path.exists() and not path.is_dir():
            raise InputError(f"--kv-offloading-path {path} is not a directory")
        return cls(int(size_gib * GIB), path, int((disk_gib or 0) * GIB))


@dataclass(frozen=True)
class TierShape:
    """One rank's tiers in units: host slots and disk entries per kind, and each kind's bytes on one rank."""
    host: dict[str, int]
    disk: dict[str, int]
    unit_bytes: dict[str, int]

    @classmethod
    def of(cls, config: OffloadConfig, world_size: int, device_units: dict[str, int], unit_bytes: dict[str, int],
           file_bytes: dict[str, int]) -> TierShape:
        """Each rank's share of the sizes (bytes / world_size), split between the kinds as the device pool splits
        its bytes. device_units: the device pool's blocks and state blocks; unit_bytes: one of each on this rank;
        file_bytes: one of each's file, header included (offload_store.file_bytes)."""
        pool = {kind: device_units[kind] * unit_bytes[kind] for kind in KINDS}
        total = sum(pool.values())

        def split(budget: int, each: dict[str, int]) -> dict[str, int]:
            return {kind: budget * pool[kind] // total // each[kind] if unit_bytes[kind] else 0 for kind in KINDS}

        return cls(split(config.host_bytes // world_size, unit_bytes),
                   split(config.disk_bytes // world_size, file_bytes), unit_bytes)

    def summary(self, config: OffloadConfig) -> str:
        """The ready line's part."""
        host = f"KV offload: host {config.host_bytes / GIB:g} GiB ({self.host[BLOCK]} blocks a rank"
        host += f", {self.host[STATE]} state blocks)" if self.host[STATE] else ")"
        if config.path is None:
            return host
        return (f"{host}, disk {config.disk_bytes / GIB:g} GiB at {config.path} ({self.disk[BLOCK]} blocks a rank"
                + (f", {self.disk[STATE]} state blocks)" if self.disk[STATE] else ")"))


# the ops, as (name, kind, ...) tuples:
DROP = "drop"  # (DROP, kind, hash): remove its file
SPILL = "spill"  # (SPILL, kind, host slot, hash): the slot written to the hash's file
SAVE = "save"  # (SAVE, kind, device block, host slot)
FETCH = "fetch"  # (FETCH, kind, hash, host slot): the file read, checked, into the slot
LOAD = "load"  # (LOAD, kind, host slot, device block)


@dataclass(frozen=True)
class OffloadOps(StepMeta):
    """One step's copies on every rank of a DP index, run in order before anything else of the step."""
    ops: tuple[tuple, ...]


@dataclass
class OffloadReport:
    """One rank's outcome of a step's ops: the fetches and spills that failed ((kind, hash, why)), the files found
    corrupt (torn, checksum, foreign; removed), the errors the filesystem gave ((errno name, what failed)), and the
    bytes moved."""
    dp_index: int
    rank: int = 0
    failed_fetches: list[tuple[str, bytes, str]] = field(default_factory=list)
    failed_spills: list[tuple[str, bytes, str]] = field(default_factory=list)
    corrupt: int = 0
    disk_errors: list[tuple[str, str]] = field(default_factory=list)
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))

    def failed(self, exc: OSError, what: str) -> None:
        """A filesystem error of the tier (the spills stop when rank 0 hears of it)."""
        self.disk_errors.append((errno.errorcode.get(exc.errno, "OSError"), f"{what}: {exc}"))


class HostTier:
    """One kind's host slots on one DP index: which hash each holds, least recently used first."""

    def __init__(self, slots: int):
        self.slots = slots
        self.free = list(range(slots - 1, -1, -1))
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, the least recently used first
        self.busy: set[int] = set()  # slots a disk read of the step being built fills, or a hit of it reads

    def find(self, digest: bytes) -> int | None:
        slot = self.index.get(digest)
        if slot is not None:
            self.index.move_to_end(digest)
        return slot

    def take(self, digest: bytes) -> tuple[int, bytes | None] | None:
        """A slot for `digest` -> (slot, the hash it held, now forgotten); None when every slot is busy this
        step."""
        if self.free:
            slot, old = self.free.pop(), None
        else:
            old = next((h for h, s in self.index.items() if s not in self.busy), None)
            if old is None:
                return None
            slot = self.index.pop(old)
        self.index[digest] = slot
        return slot, old

    def forget(self, digest: bytes) -> None:
        slot = self.index.pop(digest, None)
        if slot is not None:
            self.free.append(slot)


class DiskTier:
    """One kind's files on one DP index: which hashes have one, least recently used first, up to `entries`."""

    def __init__(self, entries: int, known: list[bytes] = ()):
        self.entries = entries
        self.index: OrderedDict[bytes, None] = OrderedDict((digest, None) for digest in known[-entries:] if entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.index

    def touch(self, digest: bytes) -> None:
        self.index.move_to_end(digest)

    def put(self, digest: bytes, keep: set[bytes] = frozenset()) -> list[bytes] | None:
        """Room for `digest`'s file -> the hashes whose files go for it (least recently used, none of `keep`: files
        being read); None when the disk tier takes no more (no room at all, or only files in `keep`)."""
        if not self.entries:
            return None
        candidates = [old for old in self.index if old not in keep][:max(0, len(self.index) - self.entries + 1)]
        if len(self.index) - len(candidates) >= self.entries:
            return None
        for old in candidates:
            del self.index[old]
        self.index[digest] = None
        return candidates

    def forget(self, digest: bytes) -> None:
        self.index.pop(digest, None)


@dataclass
class OffloadCounts:
    """Running totals over every DP index (the metrics take what grew since the last step)."""
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    corrupt_files: int = 0
    disk_errors: dict[str, int] = field(default_factory=dict)  # errno name -> errors the filesystem gave the tier
    disk_stopped: str | None = None  # why the disk tier takes no more files (the first error); None: it does


class Offloader:
    """One DP index's host and disk tiers and the ops its next step runs."""

    def __init__(self, shape: TierShape, disk_known: dict[str, list[bytes]] | None, counts: OffloadCounts,
                 strays: dict[str, list[bytes]] | None = None):
        """disk_known: per kind, the hashes every rank of the DP index has a file for, oldest first (None: no disk
        tier); strays: those only some ranks have, whose files go in the first step."""
        self.host = {kind: HostTier(shape.host[kind]) for kind in KINDS}
        self.disk = {kind: DiskTier(shape.disk[kind], (disk_known or {}).get(kind, [])) for kind in KINDS} \
            if disk_known is not None else None
        self.counts = counts
        self.from_disk: set[tuple[str, bytes]] = set()  # fetched into the host tier, not yet used by a hit
        self.pending: set[tuple[str, bytes]] = set()  # fetched by the step being built or run: not readable yet
        self._ops: list[tuple] = []  # the next step's, in order
        for kind in KINDS if self.disk is not None else ():  # files found past the size (a smaller one now) go
            self._ops.extend((DROP, kind, digest) for digest in disk_known.get(kind, [])
                             if digest not in self.disk[kind])
            self._ops.extend((DROP, kind, digest) for digest in (strays or {}).get(kind, []))

    def where(self, kind: str, digest: bytes) -> str | None:
        """The tier below the device that holds `digest`: "host", "disk", "pending" (a read from disk not yet
        checked) or None."""
        if (kind, digest) in self.pending:
            return "pending"
        if digest in self.host[kind].index:
            return "host"
        if self.disk is not None and digest in self.disk[kind]:
            return "disk"
        return None

    def evicted(self, kind: str, block: int, digest: bytes) -> None:
        """The device pool gives up published `block` (hash `digest`): its entries saved to a host slot first (none
        when the host tier has it already, or every slot is busy this step)."""
        self.counts.evictions["device"] += 1
        if self.host[kind].find(digest) is not None:
            return
        slot = self._slot(kind, digest)
        if slot is not None:
            self._ops.append((SAVE, kind, block, slot))

    def fetch(self, wanted: list[tuple[str, bytes]]) -> bool:
        """The files of `wanted` ((kind, hash) pairs, on disk) read into host slots by the next step -> False when
        some found no slot free this step (those read stay in the host tier)."""
        for kind, digest in wanted:  # pinned first: the spill a slot causes drops none of them
            self.disk[kind].touch(digest)
            self.pending.add((kind, digest))
        fetched = True
        for kind, digest in wanted:
            slot = self._slot(kind, digest)
            if slot is None:
                self.pending.discard((kind, digest))
                fetched = False
                continue
            self.host[kind].busy.add(slot)
            self._ops.append((FETCH, kind, digest, slot))
            self.from_disk.add((kind, digest))
        return fetched

    def load(self, kind: str, digest: bytes, block: int) -> str:
        """The host slot holding `digest` copied into device `block` by the next step -> the tier it came from
        ("disk" when it was fetched for this hit)."""
        slot = self.host[kind].find(digest)
        self._ops.append((LOAD, kind, slot, block))
        if (kind, digest) in self.from_disk:
            self.from_disk.discard((kind, digest))
            return "disk"
        return "host"

    def hold(self, kind: str, digest: bytes) -> None:
        """A host slot a hit loads from in this step: the blocks the hit takes, and their evictions, come first, so
        it is given to nobody else in this step."""
        self.host[kind].busy.add(self.host[kind].index[digest])

    def _slot(self, kind: str, digest: bytes) -> int | None:
        taken = self.host[kind].take(digest)
        if taken is None:
            return None
        slot, old = taken
        if old is not None:
            self.counts.evictions["host"] += 1
            self.from_disk.discard((kind, old))
            self._spill(kind, slot, old)
        return slot

    def _spill(self, kind: str, slot: int, digest: bytes) -> None:
        """A hash falling out of the host tier: written to its file, unless the disk tier has it or takes none."""
        if self.disk is None or self.counts.disk_stopped is not None:
            return
        disk = self.disk[kind]
        if digest in disk:
            disk.touch(digest)
            return
        dropped = disk.put(digest, {pending for k, pending in self.pending if k == kind})
        if dropped is None:
            return
        self.counts.evictions["disk"] += len(dropped)
        self._ops.extend((DROP, kind, old) for old in dropped)
        self._ops.append((SPILL, kind, slot, digest))

    def flush(self) -> OffloadOps | None:
        """A graceful stop: every hash of the host tier not on disk yet written to its file (least recently used
        first, so the disk tier keeps the most recent if it is smaller), after the ops not yet run."""
        for kind in KINDS:
            for digest, slot in list(self.host[kind].index.items()):
                self._spill(kind, slot, digest)
        return self.take_ops()

    def take_ops(self) -> OffloadOps | None:
        """The ops built since the last step's (None when there are none)."""
        ops, self._ops = self._ops, []
        for tier in self.host.values():
            tier.busy.clear()
        return OffloadOps(tuple(ops)) if ops else None

    def settled(self) -> None:
        """A step's reports are in: the reads it ran that no rank reported failed are whole."""
        self.pending.clear()

    def reported(self, report: OffloadReport) -> None:
        """A rank's outcome: a hash whose file failed to read is in neither tier any more, and one whose file failed
        to write is not on disk (either way its files go on every rank of the DP index); an error of the filesystem
        stops the spills."""
        for kind, digest, _ in report.failed_fetches:
            self.host[kind].forget(digest)
            self.from_disk.discard((kind, digest))
        for kind, digest, _ in report.failed_fetches + report.failed_spills:
            if self.disk is not None and digest in self.disk[kind]:
                self.disk[kind].forget(digest)
                self._ops.append((DROP, kind, digest))
        for name, why in report.disk_errors:
            self.counts.disk_errors[name] = self.counts.disk_errors.get(name, 0) + 1
            if self.counts.disk_stopped is None:
                self.counts.disk_stopped = f"{name} on rank {report.rank}: {why}"
                print(f"dsrun: KV offload: the disk tier takes no more blocks ({self.counts.disk_stopped}); requests "
                      f"go on, and the files already written are still read", file=sys.stderr, flush=True)
        self.counts.corrupt_files += report.corrupt
        for direction, count in report.moved.items():
            self.counts.moved[direction] += count
