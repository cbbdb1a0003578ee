"""What a run is: the shards, how to compute, and the engine's limits, as one typed value built by the command
line (runner/cli.py) and handed to every rank. `engine.core.start_engine` builds the engine from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dsconv.family.layout import Layout

DEFAULT_CACHE_TOKENS = 4096


@dataclass(frozen=True)
class CacheConfig:
    """One attention-DP rank's KV cache: `tokens` (--cache-tokens), or as many as `memory_bytes` holds
    (--kv-cache-memory-bytes); `dtype` is --kv-cache-dtype (auto or int8)."""
    tokens: int = DEFAULT_CACHE_TOKENS
    memory_bytes: int | None = None
    dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    """What rank 0's scheduler may run at once per attention-DP rank, how it places requests, and context-parallel
    prefill (cp_size ranks prefill a prompt of at least cp_min_tokens tokens together)."""
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    balancing: str = "least-loaded"
    cp_size: int = 1
    cp_min_tokens: int | None = None


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs to build its part of the engine. `manifest` is the checked manifest of `shards`
    (`dsconv verify`'s); max_model_len None: the smaller of the context and the cache (request.resolve_max_model_len).
    keepalive_s: how often an idle rank 0 wakes the others (None: the loop ends when idle, as generate's does)."""
    shards: Path
    manifest: dict
    dtype: str = "bfloat16"
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None
    keepalive_s: float | None = None
    drain_timeout_s: float = 30.0

    @property
    def layout(self) -> Layout:
        return Layout.from_json(self.manifest["layout"])

    @property
    def model_config(self) -> dict:
        """The checkpoint's config.json, as the manifest carries it."""
        return self.manifest["model"]["config"]

    @property
    def family_name(self) -> str:
        return self.manifest["model"]["family"]
