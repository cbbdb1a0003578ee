"""Prefill/decode disaggregation: what crosses between a producer instance (P, `kv_role` kv_producer: it prefills and
hands the prompt's cache over) and a consumer (D, kv_consumer: it receives the cache and decodes), and the read a
consumer's ranks run.

The hand-over, as vLLM's P/D connectors do it, driven by a router (`dsrun router`, entrypoints/router.py):
1. The router sends the request to P with max_tokens 1 and `kv_transfer_params: {"do_remote_decode": true}`. P
   computes the prompt as usual (prefix caching on: it skips what it holds) and, when the request ends, keeps the
   prompt's full blocks for a lease (`Offer`: their hashes, block ids, for DeepSeek-V4 the state blocks of the
   boundary, and the sessions and memory regions of the P ranks that hold them), returned in its response's
   `kv_transfer_params`.
2. The router sends the request to D with those params (P's URL among them). D's scheduler places the
   request on an attention-DP rank, looks its blocks up in D's own prefix cache, gives the missing ones fresh
   blocks, and the next step's batch tells that DP index's ranks to read them (`Load`): each rank reads from one
   P rank of the group that holds them (the latent cache is the same on every attention-TP rank of a group, so
   any may send), through the Mooncake transfer engine (comm/kv_transfer.py).
3. Once read, D ends the lease at P (POST {remote_url}/kv_transfer/release), and P answers whether the lease was
   still held: only then were the blocks P's prompt's for the whole read (P lets a lease's blocks go only when it
   ends), and D publishes them in its pool under P's hashes; the request starts as a prefix hit: D computes the
   prompt's tail (its last partial block, and always its last token, whose logits draw the first token), restoring
   a DeepSeek-V4 slot from the transferred state blocks as any hit does. A lease that had ended is a failed load.

P signs each offer with the key both sides are given (engine/kv_auth.py); D reads nothing it has not verified.

Only full blocks travel: P and D may run different world sizes and parallel layouts, but not a different model,
cache dtype or block size (the regions must match unit for unit, which the read checks).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from dsconv.comm.kv_transfer import Region, TransferAgent, TransferError, engine_class
from dsconv.errors import InputError
from dsconv.runner.engine.kv_auth import KEY_SOURCES, AuthKey

CONNECTORS = ("MooncakeConnector", "MooncakeConnectorV1")  # vLLM's name, and vllm-ascend's
PRODUCER, CONSUMER = "kv_producer", "kv_consumer"
LOAD_FAILURE_POLICIES = ("fail", "recompute")  # vLLM's kv_load_failure_policy
DEFAULT_LEASE_S = 30.0  # how long P keeps a request's blocks for D (vLLM's NIXL lease)
DEFAULT_TIMEOUT_S = 30.0  # a read's limit when MC_TRANSFER_TIMEOUT (the Mooncake engine's, seconds) is not set
EXTRA_KEYS = ("host", "lease_s", "transfer_timeout_s", "kv_load_failure_policy", *KEY_SOURCES)
STAGING_BYTES = 64 * 2**20  # the most a consumer's rank reads into host memory at once (one part of a hand-over)
PARAM_KEYS = ("remote_engine_id", "transfer_id", "remote_block_size", "remote_hashes", "remote_blocks",
              "remote_state_blocks", "remote_ranks", "remote_url", "expires_at", "signature")


@dataclass(frozen=True)
class KVTransferConfig:
    """--kv-transfer-config, vLLM's JSON: {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer" |
    "kv_consumer", "kv_connector_extra_config": {...}}. Extra config: `host`, the address this instance's ranks'
    transfer engines listen on (the node's own, reachable from the other instance's nodes); `lease_s`, how long a
    producer keeps blocks nobody confirmed; `transfer_timeout_s`, a consumer's limit on one read (default
    MC_TRANSFER_TIMEOUT, else 30); `kv_load_failure_policy`, what a consumer does when a read fails: `fail` the
    request with an error, or `recompute` its prompt itself; `auth_key_file`, `auth_key_env` or `auth_key`: the
    secret P signs its offers with and D verifies them with (engine/kv_auth.py). release_url: a producer's own
    URL, where consumers end its leases (serve sets it once its HTTP server listens)."""
    role: str
    key: AuthKey = field(repr=False)
    host: str = "127.0.0.1"
    lease_s: float = DEFAULT_LEASE_S
    transfer_timeout_s: float = DEFAULT_TIMEOUT_S
    load_failure_policy: str = "fail"
    release_url: str | None = None

    @property
    def producer(self) -> bool:
        return self.role == PRODUCER

    @property
    def summary(self) -> str:
        """The ready line's part."""
        if self.producer:
            return f"P/D {self.role} (Mooncake on {self.host}, lease {self.lease_s:g} s)"
        return (f"P/D {self.role} (Mooncake on {self.host}, reads time out after {self.transfer_timeout_s:g} s, "
                f"on failure {self.load_failure_policy})")

    @classmethod
    def parse(cls, text: str) -> KVTransferConfig:
        """The flag's JSON -> the config; InputError (one line) on anything else."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"--kv-transfer-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InputError("--kv-transfer-config must be a JSON object")
        unknown = sorted(set(raw) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
        if unknown:
            raise InputError(f"--kv-transfer-config: unknown key {unknown[0]!r} (kv_connector, kv_role, "
                             f"kv_connector_extra_config)")
        if raw.get("kv_connector") not in CONNECTORS:
            raise InputError(f"--kv-transfer-config: kv_connector {raw.get('kv_connector')!r} is not one this server "
                             f"has ({', '.join(CONNECTORS)})")
        if raw.get("kv_role") not in (PRODUCER, CONSUMER):
            raise InputError(f"--kv-transfer-config: kv_role {raw.get('kv_role')!r} is not {PRODUCER} or {CONSUMER} "
                             f"(kv_both is not supported: run a producer and a consumer)")
        extra = raw.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise InputError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise InputError(f"--kv-transfer-config: unknown kv_connector_extra_config key {unknown[0]!r} "
                             f"({', '.join(EXTRA_KEYS)})")
        timeout = extra.get("transfer_timeout_s", float(os.environ.get("MC_TRANSFER_TIMEOUT", DEFAULT_TIMEOUT_S)))
        config = cls(raw["kv_role"], AuthKey.of(extra), extra.get("host", cls.host),
                     extra.get("lease_s", DEFAULT_LEASE_S), timeout, extra.get("kv_load_failure_policy", "fail"))
        if not isinstance(config.host, str) or not config.host:
            raise InputError(f"--kv-transfer-config: host must be a non-empty string, got {config.host!r}")
        for name in ("lease_s", "transfer_timeout_s"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InputError(f"--kv-transfer-config: {name} must be a positive number of seconds, got {value!r}")
        if config.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise InputError(f"--kv-transfer-config: kv_load_failure_policy {config.load_failure_policy!r} is not "
                             f"{' or '.join(LOAD_FAILURE_POLICIES)}")
        return config


def check_transfer_engine() -> None:
    """InputError (one line) when the Mooncake transfer engine cannot be imported here."""
    try:
        engine_class()
    except TransferError as exc:
        raise InputError(f"--kv-transfer-config: {exc}") from None


@dataclass(frozen=True)
class Export:
    """A producer's request (kv_transfer_params {"do_remote_decode": true}): when it ends, its prompt's blocks are
    leased to a consumer and its last output carries the Offer's params."""
    role: ClassVar[str] = PRODUCER  # the instance that takes it


@dataclass(frozen=True)
class RankRegions:
    """One rank's transfer engine session and its cache's registered regions (block views, then state views)."""
    session: str
    blocks: tuple[Region, ...]
    state: tuple[Region, ...]

    def params(self) -> dict:
        return {"session": self.session, "blocks": [list(_fields(r)) for r in self.blocks],
                "state": [list(_fields(r)) for r in self.state]}

    @classmethod
    def from_params(cls, raw) -> RankRegions:
        return cls(raw["session"], tuple(Region(*map(int, r)) for r in raw["blocks"]),
                   tuple(Region(*map(int, r)) for r in raw["state"]))


def _fields(region: Region) -> tuple[int, int, int]:
    return region.address, region.unit_bytes, region.units


def rank_regions(agent: TransferAgent, cache) -> RankRegions:
    """Registers a rank's cache with its transfer engine -> what a peer needs to read it."""
    blocks, state = cache.transfer_views()
    return RankRegions(agent.session, tuple(agent.publish(blocks)), tuple(agent.publish(state)))


@dataclass(frozen=True)
class Offer:
    """What a producer hands over for one request, as its response's kv_transfer_params (`params`) carry it: the
    prompt's first full blocks (their hashes and P's block ids), for DeepSeek-V4 the state blocks of that boundary
    ((block index, state block) pairs), the ranks of P's attention-DP group that hold them, P's URL (release_url,
    where the consumer ends the lease), the lease's end (expires_at, time.time() on P's clock), and P's signature
    over all of it (engine/kv_auth.py)."""
    engine_id: str
    transfer_id: str
    block_size: int
    hashes: tuple[bytes, ...]
    blocks: tuple[int, ...]
    state: tuple[tuple[int, int], ...]
    ranks: tuple[RankRegions, ...]
    release_url: str
    expires_at: float
    signature: str = ""
    role: ClassVar[str] = CONSUMER  # the instance that takes it

    def payload(self) -> dict:
        """Every field but the signature: what P signs and D verifies."""
        return {"remote_engine_id": self.engine_id, "transfer_id": self.transfer_id,
                "remote_block_size": self.block_size, "remote_hashes": [h.hex() for h in self.hashes],
                "remote_blocks": list(self.blocks), "remote_state_blocks": [list(p) for p in self.state],
                "remote_ranks": [r.params() for r in self.ranks], "remote_url": self.release_url,
                "expires_at": self.expires_at}

    def params(self) -> dict:
        return {**self.payload(), "signature": self.signature}

    def signed(self, key: AuthKey) -> Offer:
        return replace(self, signature=key.sign(self.payload()))

    @classmethod
    def from_params(cls, raw: dict) -> Offer:
        """A consumer's request's kv_transfer_params -> the offer; InputError naming what is malformed."""
        missing = [key for key in PARAM_KEYS if key not in raw]
        if missing:
            raise InputError(f"kv_transfer_params lacks {missing[0]!r}: pass the producer's kv_transfer_params on "
                             f"(as `dsrun router` does)")
        try:
            offer = cls(str(raw["remote_engine_id"]), str(raw["transfer_id"]), int(raw["remote_block_size"]),
                        tuple(bytes.fromhex(h) for h in raw["remote_hashes"]), tuple(map(int, raw["remote_blocks"])),
                        tuple((int(i), int(b)) for i, b in raw["remote_state_blocks"]),
                        tuple(RankRegions.from_params(r) for r in raw["remote_ranks"]), str(raw["remote_url"]),
                        float(raw["expires_at"]), str(raw["signature"]))
        except (TypeError, ValueError, KeyError) as exc:
            raise InputError(f"kv_transfer_params is malformed: {type(exc).__name__}: {exc}") from None
        if len(offer.hashes) != len(offer.blocks) or not offer.ranks:
            raise InputError(f"kv_transfer_params is malformed: {len(offer.hashes)} hashes for {len(offer.blocks)} "
                             f"blocks, {len(offer.ranks)} ranks")
        return offer


@dataclass(frozen=True)
class Offers:
    """A consumer's request of several prompts (a batch completion): one producer's offer per prompt, in order, as
    kv_transfer_params {"prompts": [...]} carry them; the front end gives each prompt's request its own."""
    each: tuple[Offer, ...]

    @classmethod
    def from_params(cls, raw: dict) -> Offers:
        if not isinstance(raw["prompts"], list) or not raw["prompts"]:
            raise InputError("kv_transfer_params prompts must be a non-empty list of the producer's params, one per "
                             "prompt")
        return cls(tuple(Offer.from_params(one) for one in raw["prompts"]))


@dataclass(frozen=True)
class Load:
    """A batch item for the ranks of one attention-DP index: read these (P block, our block) and (P state block, our
    state block) pairs from P's group (member i reads from ranks[i % len(ranks)])."""
    seq_id: int
    ranks: tuple[RankRegions, ...]
    blocks: tuple[tuple[int, int], ...]
    state: tuple[tuple[int, int], ...]
    timeout_s: float


@dataclass(frozen=True)
class LoadReport:
    """One rank's outcome of a Load: error None when every unit arrived."""
    seq_id: int
    error: str | None
    seconds: float
    bytes: int


def run_load(agent: TransferAgent, views: tuple[list[torch.Tensor], list[torch.Tensor]], load: Load,
             member: int) -> LoadReport:
    """On a consumer's rank: reads a Load's units from its P rank and, as each part arrives in time, copies it into
    this rank's cache views (cache.transfer_views()). The units are read in parts of at most STAGING_BYTES, so a
    long prompt's hand-over holds no more than that in host memory at once."""
    started, moved = time.perf_counter(), 0
    peer = load.ranks[member % len(load.ranks)]
    try:
        for regions, ours, pairs in ((peer.blocks, views[0], load.blocks), (peer.state, views[1], load.state)):
            _check_regions(regions, ours, pairs)
            per_pair = sum(region.unit_bytes for region in regions)
            step = max(1, STAGING_BYTES // max(1, per_pair))
            for first in range(0, len(pairs), step):
                part = pairs[first:first + step]
                staging = agent.read(peer.session, [(region, [src for src, _ in part]) for region in regions],
                                     load.timeout_s)
                _copy(staging, regions, ours, part)
                moved += staging.nbytes
    except TransferError as exc:
        return LoadReport(load.seq_id, str(exc), time.perf_counter() - started, moved)
    return LoadReport(load.seq_id, None, time.perf_counter() - started, moved)


def _copy(staging: torch.Tensor, regions: tuple[Region, ...], views: list[torch.Tensor],
          pairs: tuple[tuple[int, int], ...]) -> None:
    """The staged units (region by region, each its pairs' units in order) into our views' units."""
    offset, ours = 0, None
    for region, view in zip(regions, views):
        if ours is None or ours.device != view.device:
            ours = torch.tensor([dst for _, dst in pairs], device=view.device)
        size = len(pairs) * region.unit_bytes
        view.index_copy_(0, ours, staging[offset:offset + size].view(len(pairs), region.unit_bytes).to(view.device))
        offset += size


def _check_regions(regions: tuple[Region, ...], views: list[torch.Tensor], pairs: tuple[tuple[int, int], ...]) -> None:
    """P's regions beside ours, unit for unit (TransferError: the caches differ, or a unit is outside P's)."""
    if not pairs:
        return
    if len(regions) != len(views) or any(r.unit_bytes != v.shape[1] for r, v in zip(regions, views)):
        raise TransferError(f"the producer's cache regions ({len(regions)}) differ from this cache's ({len(views)}) "
                            f"or their sizes do: P and D must run the same model, cache dtype and block size")
    if any(not 0 <= src < region.units for region in regions for src, _ in pairs):
        raise TransferError("a unit to read lies outside the producer's cache")
