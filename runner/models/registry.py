"""dsrun's model per family: model_type -> how to build its forward and its cache, and `build_model`, which loads
one rank's model from its shards. The family layer (`dsconv.family`) describes checkpoints and knows nothing of the
runner; a family with no entry here has no runner, which `model_for` says in one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dsconv.errors import InputError
from dsconv.family.arch import family_for
from dsconv.family.deepseek_v3 import cache_fields
from dsconv.kernels.device import flush_denormals
from dsconv.runner.models.deepseek_v3 import DeepseekV3
from dsconv.runner.models.deepseek_v4 import DeepseekV4
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.kv_cache import BLOCK_SIZE, LatentCache, cache_blocks
from dsconv.runner.models.v4_state import V4Cache
from dsconv.runner.models.weights import load_rank


@dataclass(frozen=True)
class ModelEntry:
    new_model: Callable[[Any, Any, Any, Any], Any]  # (config, RankWeights, Dist, dtype) -> model
    # (config, model, capacity_tokens, device, kv_cache_dtype) -> cache; the dtype is one the family accepts
    # (family.arch.check_kv_cache_dtype)
    new_cache: Callable[[Any, Any, int, Any, str], Any]
    # (config, model, kv_cache_dtype) -> the bytes one token's cache entries take, as the cache allocates them
    bytes_per_token: Callable[[Any, Any, str], int]


def _latent_cache(cfg, model, capacity_tokens: int, device, kv_cache_dtype: str = "auto"):
    # INT8 fields keep their unquantized part (V3's rope key) in the compute dtype: 16 bits in a BF16 run
    return LatentCache(cfg.num_hidden_layers, cache_blocks(capacity_tokens), BLOCK_SIZE,
                       cache_fields(cfg, kv_cache_dtype), model.cache_dtype, device, rest_dtype=model.dtype)


def _latent_bytes_per_token(cfg, model, kv_cache_dtype: str) -> int:
    return _latent_cache(cfg, model, 0, "meta", kv_cache_dtype).bytes_per_token


def _v4_state(cfg, model, capacity_tokens: int, device, kv_cache_dtype: str = "auto"):
    if kv_cache_dtype != "auto":  # the CLI refuses it first (family.arch.check_kv_cache_dtype)
        raise InputError(f"--kv-cache-dtype {kv_cache_dtype} is not available for deepseek_v4")
    return V4Cache(cfg, capacity_tokens, model.dtype, device)  # compressor state in the model dtype


def _v4_bytes_per_token(cfg, model, kv_cache_dtype: str) -> int:
    raise InputError("a byte budget for the KV cache is not available for deepseek_v4 (its windows and compressor "
                     "state are per sequence): size it with --cache-tokens")


V3 = ModelEntry(DeepseekV3, _latent_cache, _latent_bytes_per_token)
MODELS: dict[str, ModelEntry] = {"deepseek_v3": V3, "deepseek_v32": V3,
                                 "deepseek_v4": ModelEntry(DeepseekV4, _v4_state, _v4_bytes_per_token)}


def model_for(model_type: str) -> ModelEntry:
    if model_type not in MODELS:
        raise InputError(f"dsrun has no model for {model_type} shards (supported: {', '.join(sorted(MODELS))})")
    return MODELS[model_type]


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class CacheFactory:
    """A model's caches: `factory(tokens, kv_cache_dtype)` makes one holding `tokens` tokens per rank;
    `tokens_in(nbytes, kv_cache_dtype)` says how many tokens fit in a byte budget (whole blocks)."""

    def __init__(self, entry, cfg, model, device: torch.device):
        self.entry, self.cfg, self.model, self.device = entry, cfg, model, device

    def __call__(self, tokens: int, kv_cache_dtype: str = "auto"):
        return self.entry.new_cache(self.cfg, self.model, tokens, self.device, kv_cache_dtype)

    def tokens_in(self, nbytes: int, kv_cache_dtype: str = "auto") -> int:
        per_block = self.entry.bytes_per_token(self.cfg, self.model, kv_cache_dtype) * BLOCK_SIZE
        return nbytes // per_block * BLOCK_SIZE


def build_model(shards: Path, manifest: dict, rank: int, dist: Dist, dtype: torch.dtype):
    """-> (model, its config, a CacheFactory for the cache its forward takes), by the shards' family."""
    config = manifest["model"]["config"]
    family = family_for(config)
    entry = model_for(family.name)
    cfg = family.parse_config(config)
    flush_denormals(dist.device)  # the thread that builds the model is the one that runs it
    weights = load_rank(shards, manifest, rank, dist.device)
    model = entry.new_model(cfg, weights, dist, dtype)
    return model, cfg, CacheFactory(entry, cfg, model, dist.device)
