"""What a run is: the shards, how to compute, and the engine's limits, as one typed value built by the command
line (runner/cli.py) and handed to every rank. `engine.core.start_engine` builds the engine from it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from dsconv.errors import InputError
from dsconv.manifest.schema import MANIFEST_NAME
from dsconv.runner.engine.block_pool import BLOCK_HASH_SCHEME
from dsconv.runner.engine.kv_offload import GIB, OffloadConfig
from dsconv.runner.engine.kv_transfer import KVTransferConfig
from dsconv.runner.engine.offload_store import open_directory
from dsconv.family.arch import (DEFAULT_BLOCK_SIZE, Family, check_block_size, check_context_parallel,
                               check_kv_cache_dtype, family_for)
from dsconv.family.layout import DEFAULT_MAX_NUM_BATCHED_TOKENS, Layout
from dsconv.kernels.device import NPU_DEVICE_TYPE
from dsconv.runner.models.eplb import EplbConfig
from dsconv.runner.models.kernel_switch import KERNELS
from dsconv.runner.models.kv_cache import cache_blocks
from dsconv.runner.models.registry import DTYPES, model_for
from dsconv.runner.engine.request import resolve_max_model_len
from dsconv.runner.engine.speculative import SpeculativeConfig
from dsconv.runner.models.weights import load_manifest

DEFAULT_CACHE_TOKENS = 4096
SPECULATIVE_FAMILIES = ("deepseek_v3", "deepseek_v32", "deepseek_v4")  # whose MTP layer the runner drafts with


@dataclass(frozen=True)
class CacheConfig:
    """One attention-DP rank's KV cache: `tokens` (--cache-tokens), or as many as `memory_bytes` holds
    (--kv-cache-memory-bytes), in blocks of `block_size` tokens (--block-size); `dtype` is --kv-cache-dtype (auto
    or int8)."""
    tokens: int = DEFAULT_CACHE_TOKENS
    memory_bytes: int | None = None
    dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE


BALANCING = ("cache-aware", "least-loaded", "round-robin")
# vLLM's --scheduling-policy: fcfs admits by arrival and preempts the newest running request; priority admits by
# (priority, arrival), lower first, and preempts the running request of the highest (priority, arrival)
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """What rank 0's scheduler may run at once per attention-DP rank, how it places requests, and context-parallel
    prefill (cp_size ranks prefill a prompt of at least cp_min_tokens tokens together; family/arch.py's
    check_context_parallel checks it against the shards). Each flag is checked here, once, with its one line."""
    max_num_seqs: int = 16
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    balancing: str = "cache-aware"  # least-loaded, counting the prefix cache's hits (scheduler.py)
    cp_size: int = 1
    cp_min_tokens: int | None = None
    enable_prefix_caching: bool = True  # vLLM's flag and default (runner/engine/block_pool.py)
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs or priority (scheduler.py)
    kv_transfer: KVTransferConfig | None = None  # P/D disaggregation: this instance's role (engine/kv_transfer.py)

    def __post_init__(self):
        if self.kv_transfer is not None and not self.enable_prefix_caching:
            raise InputError("--kv-transfer-config needs prefix caching: the hand-over publishes and adopts blocks by "
                             "their hashes (drop --no-enable-prefix-caching)")
        if self.balancing not in BALANCING:
            raise InputError(f"--dp-balancing {self.balancing!r} is not one of {', '.join(BALANCING)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InputError(f"--scheduling-policy {self.scheduling_policy!r} is not one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        for name, value in (("--max-num-seqs", self.max_num_seqs),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens)):
            if value < 1:
                raise InputError(f"{name} {value} must be at least 1")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings beyond this rank's model and cache (engine/core.py's new_engine): rank 0's scheduler,
    what its door admits (vocab_size, max_model_len), when a sequence stops (eos_token_id), the idle loop's
    keep-alive (None: the loop ends when idle, as generate's does), how long a drain waits, and MTP drafting."""
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    keepalive_s: float | None = None
    drain_timeout_s: float = 30.0
    speculative: SpeculativeConfig | None = None

    @property
    def speculative_tokens(self) -> int:
        """The drafts a step verifies (0: no speculative decoding)."""
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0


def eplb_config(enable: bool, text: str | None) -> EplbConfig | None:
    """--enable-eplb and --eplb-config -> EPLB's settings, or None when off."""
    if text is not None and not enable:
        raise InputError("--eplb-config needs --enable-eplb")
    return EplbConfig.parse(text or "{}") if enable else None


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs to build its part of the engine. `manifest` is the checked manifest of `shards`
    (`dsconv verify`'s); max_model_len None: the smaller of the context and the cache (request.resolve_max_model_len).
    keepalive_s: how often an idle rank 0 wakes the others (None: the loop ends when idle, as generate's does).
    record_shapes: the file rank 0 appends the shape matrix's row to (--record-shapes), naming `command`."""
    shards: Path
    manifest: dict
    command: str = "generate"  # the dsrun command that runs (the shape matrix's rows name it)
    dtype: str = "bfloat16"
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None
    keepalive_s: float | None = None
    drain_timeout_s: float = 30.0
    record_shapes: Path | None = None  # append a row of what the run's steps covered (engine/shapes.py)
    # the MoE's shared expert computes while the expert exchange travels (runner/models/moe.py)
    overlap_shared_experts: bool = True
    speculative: SpeculativeConfig | None = None  # --speculative-config (engine/speculative.py)
    eplb: EplbConfig | None = None  # --enable-eplb with --eplb-config (runner/models/eplb.py)
    expert_load_record: Path | None = None  # rank 0 writes the run's expert loads here (family/expert_map.py)
    kernels: str = "torch"  # --kernels (runner/models/kernel_switch.py)
    offload: OffloadConfig | None = None  # --kv-offloading-size and its disk tier (engine/kv_offload.py)

    @classmethod
    def open(cls, shards: Path, world_size: int | None = None, **options) -> "RunConfig":
        """The run of SHARDS (its manifest must pass `dsconv verify`), the options checked against it: the dtype,
        the cache dtype and context parallelism the family takes, and world_size (None: the shards')."""
        if options.get("record_shapes") is not None:
            options["record_shapes"] = _record_path(options["record_shapes"])
        run = cls(Path(shards), load_manifest(Path(shards)), **options)
        if run.dtype not in DTYPES:
            raise InputError(f"--dtype {run.dtype!r} is not one of {', '.join(DTYPES)}")
        check_kv_cache_dtype(run.family, run.cache.dtype)
        run._check_cache()
        cp_size, cp_min_tokens = run.scheduler.cp_size, run.scheduler.cp_min_tokens
        check_context_parallel(run.family, run.layout, cp_size,
                               1 if cp_min_tokens is None else cp_min_tokens)  # None: context parallelism off
        if world_size is not None and world_size != run.layout.world_size:
            raise InputError(f"--world-size {world_size} does not match the shards' world size "
                             f"{run.layout.world_size}")
        run._check_speculative()
        run._check_experts()
        _check_kernels(run)
        if "max_position_embeddings" not in run.model_config:
            raise InputError(f"{shards}/config.json has no max_position_embeddings (the longest context to accept)")
        return run

    def with_offload(self, config: OffloadConfig | None) -> "RunConfig":
        """This run with KV offload: checked against the cache (prefix caching on; each rank's share of the host
        size holds a block at least) and, with a disk tier, its directory opened for these shards (InputError, one
        line: engine/offload_store.open_directory)."""
        if config is None:
            return self
        if not self.scheduler.enable_prefix_caching:
            raise InputError("--kv-offloading-size keeps the prefix cache's blocks: it needs prefix caching "
                             "(drop --no-enable-prefix-caching)")
        per_block, _ = self.cache_bytes
        world = self.layout.world_size
        for flag, size in (("--kv-offloading-size", config.host_bytes), ("--kv-offloading-disk-size",
                                                                          config.disk_bytes)):
            if (size or flag == "--kv-offloading-size") and size // world < per_block:
                raise InputError(f"{flag} {size / GIB:g} GiB is {size // world} bytes a rank over {world} ranks, "
                                 f"below one block of the KV cache ({per_block} bytes: {self.cache.block_size} "
                                 f"tokens, {self.cache.dtype}, {self.dtype})")
        if config.path is not None:
            # every setting that changes a unit's bytes or layout: the speculative tokens add V3.2's MTP layer to
            # the cache, and the cache's bytes (a block's, a sequence slot's: V4's state) cover what else may; and
            # how blocks are named (block_pool's hash chain: files named by another scheme would never be found)
            identity = {"model": hashlib.sha256((self.shards / MANIFEST_NAME).read_bytes()).hexdigest(),
                        "block_hashes": BLOCK_HASH_SCHEME,
                        "dtype": self.dtype, "kv_cache_dtype": self.cache.dtype, "block_size": self.cache.block_size,
                        "world_size": world, "speculative_tokens": self.speculative_tokens,
                        "cache_bytes": list(self.cache_bytes)}
            config = replace(config, fingerprint=open_directory(config.path, identity))
        return replace(self, offload=config)

    @property
    def speculative_tokens(self) -> int:
        """The drafts a step verifies (0: no speculative decoding)."""
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0

    def engine_config(self, cache_tokens: int) -> EngineConfig:
        """The engine's settings, for a KV cache of `cache_tokens` tokens per attention-DP rank as built."""
        return EngineConfig(vocab_size=self.vocab_size, eos_token_id=self.eos_token_id, scheduler=self.scheduler,
                            max_model_len=resolve_max_model_len(self.max_model_len, self.max_position_embeddings,
                                                                cache_tokens),
                            keepalive_s=self.keepalive_s, drain_timeout_s=self.drain_timeout_s,
                            speculative=self.speculative)

    def _check_experts(self) -> None:
        """--enable-eplb and --expert-load-record: the shards' redundant experts as --eplb-config says, a record
        file that can be written."""
        experts = self.manifest.get("experts")  # `dsconv verify` checked it (load_manifest)
        redundant = experts["redundant"] if experts else 0
        wanted = self.eplb.num_redundant_experts if self.eplb is not None else None
        if wanted is not None and wanted != redundant:
            raise InputError(f"--eplb-config num_redundant_experts {wanted}: {self.shards} holds {redundant} "
                             f"redundant experts a layer (`dsconv shard --num-redundant-experts` sets them)")
        if self.eplb is not None and self.device == NPU_DEVICE_TYPE:
            raise InputError("--enable-eplb: moving experts while serving is not built for --device npu yet (its "
                             "experts are kept in the grouped matmul's own form); place them statically with "
                             "`dsconv shard --expert-load`")
        record = self.expert_load_record
        if record is not None and not Path(record).parent.is_dir():
            raise InputError(f"--expert-load-record {record}: {Path(record).parent} is not a directory")

    @property
    def experts_summary(self) -> str:
        """What the ready line says of the experts: redundant ones, EPLB."""
        experts = self.manifest.get("experts")
        parts = [f"{experts['redundant']} redundant experts a layer"] if experts and experts["redundant"] else []
        if self.eplb is not None:
            parts.append(f"EPLB every {self.eplb.step_interval} steps over {self.eplb.window_size}")
        return "; ".join(parts)

    def _check_speculative(self) -> None:
        """MTP speculative decoding needs the MTP layer in the shards, a family the runner drafts for, no
        context-parallel prefill (whose shares the MTP layer does not take yet) and no NPU: each refusal one
        line."""
        if self.speculative is None:
            return
        if self.family.name not in SPECULATIVE_FAMILIES:
            raise InputError(f"--speculative-config: MTP drafting is implemented for "
                             f"{', '.join(SPECULATIVE_FAMILIES)} shards so far, not {self.family.name}")
        if not any(t.get("mtp") for t in self.manifest["tensors"]):
            raise InputError(f"--speculative-config: {self.shards} holds no MTP layer (the checkpoint has none, or it "
                             f"was converted without it)")
        if self.scheduler.cp_size > 1:
            raise InputError("--speculative-config does not combine with --prefill-context-parallel-size above 1 "
                             "yet: the MTP layer does not take a context-parallel share")
        if self.device == NPU_DEVICE_TYPE:
            raise InputError("--speculative-config is not built for --device npu yet: a rank with no request to "
                             "draft for would hand the MTP layer's chained passes zero rows, which Ascend kernels "
                             "refuse")

    def _check_cache(self) -> None:
        cache = self.cache
        check_block_size(self.family, cache.block_size)
        self.cache_bytes  # the family's cache takes this block size (DeepSeek-V4: whole entries of each ratio)
        if cache.tokens < 1:
            raise InputError(f"--cache-tokens {cache.tokens} must be at least 1")
        if cache.memory_bytes is None:
            return
        if cache.memory_bytes < 1:
            raise InputError(f"--kv-cache-memory-bytes {cache.memory_bytes} must be at least 1")
        if self.cache_blocks < 1:
            per_block, per_seq = self.cache_bytes
            slots = f" after {_slots(self.seq_slots)} of {per_seq} bytes" if per_seq else ""
            raise InputError(f"--kv-cache-memory-bytes {cache.memory_bytes} holds less than one block of the KV cache"
                             f"{slots}: one block of {cache.block_size} tokens takes {per_block} bytes "
                             f"({self.cache.dtype}, {self.dtype}); at least {self.bytes_for(1)} bytes")

    @cached_property
    def cache_bytes(self) -> tuple[int, int]:
        """(bytes of one block, bytes of one sequence slot) of one attention-DP rank's KV cache, every layer: the
        blocks hold what grows with the tokens, the slots what a running sequence keeps whatever its length
        (DeepSeek-V4's windows and compressor state; nothing for V3's latent cache)."""
        # the cache's dtype rule tells only CPU from the rest: "meta" stands for an accelerator here, so the parent
        # need not load its backend (a missing torch_npu is the launcher's one line, not a traceback here)
        device = "cpu" if self.device == "cpu" else "meta"
        return model_for(self.family.name).cache_bytes(self.family.parse_config(self.model_config),
                                                       DTYPES[self.dtype], device, self.cache.dtype,
                                                       self.cache.block_size, self.scheduler.enable_prefix_caching,
                                                       self.speculative_tokens)

    @property
    def _idle(self) -> int:
        """On an NPU the cache allocates one block (and slot) more, for an idle rank's throwaway token
        (kv_cache.LatentCache.dummy_block): a byte budget holds those too."""
        return 1 if self.device == NPU_DEVICE_TYPE else 0

    @property
    def seq_slots(self) -> int:
        """The sequence slots the cache allocates: one per sequence a DP rank runs at once, and the idle one."""
        return self.scheduler.max_num_seqs + self._idle

    def bytes_for(self, blocks: int) -> int:
        """The --kv-cache-memory-bytes that holds `blocks` blocks, with the slots and the idle block."""
        per_block, per_seq = self.cache_bytes
        return (blocks + self._idle) * per_block + self.seq_slots * per_seq

    @property
    def cache_blocks(self) -> int:
        """The blocks one attention-DP rank's KV cache has: --cache-tokens rounded up to whole blocks, or the whole
        blocks --kv-cache-memory-bytes holds once the sequence slots are carved from it."""
        cache = self.cache
        if cache.memory_bytes is None:
            return cache_blocks(cache.tokens, cache.block_size)
        per_block, per_seq = self.cache_bytes
        room = cache.memory_bytes - self.seq_slots * per_seq
        if not per_block:  # blocks that hold nothing (a V4 of sliding layers only): the budget holds the slots
            if room < 0:
                return 0
            return cache_blocks(self.max_position_embeddings * self.scheduler.max_num_seqs, cache.block_size)
        return max(0, room // per_block - self._idle)

    def with_max_num_seqs(self, max_num_seqs: int) -> "RunConfig":
        """This run with another --max-num-seqs, its cache checked again (a byte budget's slots change with it)."""
        run = replace(self, scheduler=replace(self.scheduler, max_num_seqs=max_num_seqs))
        run._check_cache()
        return run

    @property
    def cache_tokens(self) -> int:
        return self.cache_blocks * self.cache.block_size

    @property
    def cache_flag(self) -> str:
        """The flag that sized the KV cache, with its value (for a refusal's line)."""
        if self.cache.memory_bytes is not None:
            return f"--kv-cache-memory-bytes {self.cache.memory_bytes}"
        return f"--cache-tokens {self.cache.tokens}"

    def check_holds(self, max_model_len: int | None) -> None:
        """Refuses, in one line naming the least budget that would do, a --kv-cache-memory-bytes whose cache cannot
        hold one request of an explicit --max-model-len (within the model's context; beyond it is
        request.resolve_max_model_len's refusal)."""
        cache = self.cache
        if cache.memory_bytes is None or max_model_len is None or max_model_len > self.max_position_embeddings:
            return
        if max_model_len > self.cache_tokens:
            blocks = cache_blocks(max_model_len, cache.block_size)
            raise InputError(f"--kv-cache-memory-bytes {cache.memory_bytes} holds {self.cache_tokens} tokens, fewer "
                             f"than --max-model-len {max_model_len}: one such request needs at least "
                             f"{self.bytes_for(blocks)} bytes ({blocks} blocks of {cache.block_size} tokens)")

    @property
    def overlap_summary(self) -> str:
        """Which MoE order runs (and, with --kernels pypto, which kernels), for the closing or start-up line."""
        kernels = "; decode steps through the PyPTO kernels (--kernels pypto)" if self.kernels == "pypto" else ""
        if self.overlap_shared_experts:
            return f"shared experts overlapped with the expert exchange{kernels}"
        return f"shared experts after the expert exchange (--no-overlap-shared-experts){kernels}"

    def cache_summary(self) -> str:
        """The KV cache in one line, for the start-up output."""
        blocks, size = self.cache_blocks, self.cache.block_size
        per_block, per_seq = self.cache_bytes
        line = (f"KV cache per attention-DP rank: {blocks} blocks x {size} tokens = {blocks * size} tokens, "
                f"{blocks * per_block / 2**20:.1f} MiB")
        if per_seq:
            window = self.model_config.get("sliding_window")
            state = ""
            if self.scheduler.enable_prefix_caching:  # the slots' bytes include their share of the state blocks
                state = f", with {self.state_blocks_per_slot} state blocks each for prefix hits"
            line += (f" of compressed entries and indexer keys (every group holds each block's {size} tokens), and "
                     f"{_slots(self.seq_slots)} (a {window}-token sliding window and the unfinished "
                     f"compression windows each{state}), {self.seq_slots * per_seq / 2**20:.1f} MiB")
        return line + f" ({self.cache.dtype}); {self.prefix_caching_summary}"

    @property
    def state_blocks_per_slot(self) -> int:
        """DeepSeek-V4 with prefix caching: the state blocks (runner/models/v4_cache.py) each sequence slot brings."""
        return model_for(self.family.name).state_blocks(self.family.parse_config(self.model_config),
                                                        self.cache.block_size)

    @property
    def prefix_caching_summary(self) -> str:
        if not self.scheduler.enable_prefix_caching:
            return "prefix caching off (--no-enable-prefix-caching)"
        return f"prefix caching on, at {self.cache.block_size}-token blocks"

    @property
    def layout(self) -> Layout:
        return Layout.from_json(self.manifest["layout"])

    @property
    def model_config(self) -> dict:
        """The checkpoint's config.json, as the manifest carries it."""
        return self.manifest["model"]["config"]

    @property
    def family(self) -> Family:
        return family_for(self.model_config)

    @property
    def vocab_size(self) -> int:
        return self.model_config["vocab_size"]

    @property
    def max_position_embeddings(self) -> int:
        return self.model_config["max_position_embeddings"]

    @property
    def eos_token_id(self) -> int | None:
        return self.model_config.get("eos_token_id")


def _check_kernels(run: RunConfig) -> None:
    """--kernels: one of KERNELS; pypto installed (at the version its host shim is written for), on CPU or CUDA,
    without speculative decoding: each refusal one line."""
    if run.kernels not in KERNELS:
        raise InputError(f"--kernels {run.kernels!r} is not one of {', '.join(KERNELS)}")
    if run.kernels == "torch":
        return
    if run.device == NPU_DEVICE_TYPE:
        raise InputError("--kernels pypto: the compiled PyPTO kernels (CANN) are not wired in yet; on --device npu "
                         "run --kernels torch")
    if run.speculative is not None:
        raise InputError("--kernels pypto runs decode steps of one token each: not with --speculative-config")
    from dsconv.kernels.pypto.host import check

    check()


def _record_path(path: Path) -> Path:
    """--record-shapes as an absolute path (rank 0 appends to it), refused at once if it cannot be written."""
    path = Path(path).resolve()
    if not path.parent.is_dir():
        raise InputError(f"--record-shapes {path}: its directory does not exist")
    if path.is_dir():
        raise InputError(f"--record-shapes {path} is a directory, not a file")
    return path


def _slots(n: int) -> str:
    return f"{n} sequence slot{'s' if n != 1 else ''}"
