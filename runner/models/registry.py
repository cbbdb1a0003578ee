"""dsrun's model per family: model_type -> how to build its forward and its cache, and `build_model`, which loads
one rank's model from its shards. The family layer (`dsconv.family`) describes checkpoints and knows nothing of the
runner; a family with no entry here has no runner, which `model_for` says in one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dsconv.errors import InputError
from dsconv.family.arch import DEFAULT_BLOCK_SIZE, family_for
from dsconv.family.deepseek_v3 import cache_fields
from dsconv.kernels.device import flush_denormals
from dsconv.kernels.linear import matmul_dtype_for
from dsconv.runner.models.deepseek_v3 import DeepseekV3
from dsconv.runner.models.deepseek_v4 import DeepseekV4
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.kv_cache import LatentCache, cache_blocks
from dsconv.runner.models.v4_cache import DEFAULT_MAX_SEQS, V4Cache, default_state_blocks
from dsconv.runner.models.weights import load_rank


@dataclass(frozen=True)
class ModelEntry:
    new_model: Callable[..., Any]  # (config, RankWeights, Dist, dtype, mtp) -> model (mtp: with its MTP layer)
    # (config, compute dtype, blocks, block_size, device, kv_cache_dtype, max_seqs, prefix_caching,
    # speculative_tokens) -> a cache of that many blocks and sequence slots, ready for prefix caching if asked
    # (DeepSeek-V4: with its state blocks), with a layer for the MTP layer and room for steps that rewind over that
    # many rejected drafts if speculative_tokens (0: no speculative decoding); the kv_cache_dtype is one the family
    # accepts
    # (family.arch.check_kv_cache_dtype)
    new_cache: Callable[..., Any]
    # (config, compute dtype, device, kv_cache_dtype, block_size, prefix_caching, speculative_tokens) -> (bytes of
    # one block, bytes of one sequence slot with its share of the state blocks), as the cache allocates them
    cache_bytes: Callable[..., tuple[int, int]]
    # (config, block_size) -> the state blocks one sequence slot brings with prefix caching (0: none needed)
    state_blocks: Callable[[Any, int], int] = lambda cfg, block_size: 0


def _latent_cache(cfg, dtype: torch.dtype, blocks: int, block_size: int, device, kv_cache_dtype: str = "auto",
                  max_seqs: int = DEFAULT_MAX_SEQS, prefix_caching: bool = True, speculative_tokens: int = 0,
                  allocate_on=None):
    # entries in the dtype decode multiplies them in on `device` (float32 on CPU for a BF16 run, exact: BF16 values
    # convert losslessly), so a decode step reads the context as is instead of converting it in every layer; INT8
    # fields keep their unquantized part (V3's rope key) in the compute dtype: 16 bits in a BF16 run
    # the MTP layer's entries in one more layer, after the decoder layers' (deepseek_v3.MultiTokenPredictor)
    # (a rewound step writes the same slots again: nothing else to keep)
    return LatentCache(cfg.num_hidden_layers + bool(speculative_tokens), blocks, block_size,
                       cache_fields(cfg, kv_cache_dtype), matmul_dtype_for(dtype, device), allocate_on or device,
                       rest_dtype=dtype)


def _latent_bytes(cfg, dtype: torch.dtype, device, kv_cache_dtype: str, block_size: int,
                  prefix_caching: bool = True, speculative_tokens: int = 0) -> tuple[int, int]:
    cache = _latent_cache(cfg, dtype, 0, block_size, device, kv_cache_dtype, speculative_tokens=speculative_tokens,
                          allocate_on="meta")
    return cache.bytes_per_token * block_size, 0  # nothing per sequence


def _v4_cache(cfg, dtype: torch.dtype, blocks: int, block_size: int, device, kv_cache_dtype: str = "auto",
              max_seqs: int = DEFAULT_MAX_SEQS, prefix_caching: bool = True, speculative_tokens: int = 0):
    # entries, windows and state in the model dtype (INT8 entries and windows under kv_cache_dtype int8); the state
    # blocks prefix caching needs, in proportion to the sequence slots
    state_blocks = default_state_blocks(cfg, block_size, max_seqs) if prefix_caching else 0
    return V4Cache(cfg, blocks * block_size, dtype, device, block_size=block_size, max_seqs=max_seqs,
                   kv_cache_dtype=kv_cache_dtype, state_blocks=state_blocks, speculative_tokens=speculative_tokens,
                   mtp=bool(speculative_tokens))


def _v4_bytes(cfg, dtype: torch.dtype, device, kv_cache_dtype: str, block_size: int,
              prefix_caching: bool = True, speculative_tokens: int = 0) -> tuple[int, int]:
    # one block and one slot with its state blocks, on the meta device (nothing allocated); "cpu" stands for itself,
    # anything else for an accelerator, whose one extra block and slot (the idle rank's) a budget counts apart
    cache = _v4_cache(cfg, dtype, block_size, block_size, "meta", kv_cache_dtype, 1, prefix_caching,
                      speculative_tokens)
    return cache.bytes_per_block, cache.bytes_per_seq + cache.state_blocks * cache.bytes_per_state_block


V3 = ModelEntry(DeepseekV3, _latent_cache, _latent_bytes)
MODELS: dict[str, ModelEntry] = {"deepseek_v3": V3, "deepseek_v32": V3,
                                 "deepseek_v4": ModelEntry(DeepseekV4, _v4_cache, _v4_bytes,
                                                           lambda cfg, size: default_state_blocks(cfg, size, 1))}


def model_for(model_type: str) -> ModelEntry:
    if model_type not in MODELS:
        raise InputError(f"dsrun has no model for {model_type} shards (supported: {', '.join(sorted(MODELS))})")
    return MODELS[model_type]


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class CacheFactory:
    """A model's caches: `factory(tokens, kv_cache_dtype, block_size, max_seqs, prefix_caching)` makes one holding
    `tokens` tokens per rank (whole blocks, rounded up), running up to max_seqs sequences at once, with what prefix
    caching needs (on by default, as the engine's --enable-prefix-caching)."""

    def __init__(self, entry, cfg, dtype: torch.dtype, device: torch.device, speculative_tokens: int = 0):
        self.entry, self.cfg, self.dtype, self.device = entry, cfg, dtype, device
        self.speculative_tokens = speculative_tokens

    def __call__(self, tokens: int, kv_cache_dtype: str = "auto", block_size: int = DEFAULT_BLOCK_SIZE,
                 max_seqs: int = DEFAULT_MAX_SEQS, prefix_caching: bool = True):
        return self.entry.new_cache(self.cfg, self.dtype, cache_blocks(tokens, block_size), block_size, self.device,
                                    kv_cache_dtype, max_seqs, prefix_caching, self.speculative_tokens)


def build_model(shards: Path, manifest: dict, rank: int, dist: Dist, dtype: torch.dtype, speculative_tokens: int = 0):
    """-> (model, its config, a CacheFactory for the cache its forward takes), by the shards' family;
    speculative_tokens: with the checkpoint's MTP layer (speculative decoding of that many drafts a step), and a
    cache for it."""
    mtp = speculative_tokens > 0
    config = manifest["model"]["config"]
    family = family_for(config)
    entry = model_for(family.name)
    cfg = family.parse_config(config)
    flush_denormals(dist.device)  # the thread that builds the model is the one that runs it
    weights = load_rank(shards, manifest, rank, dist.device)
    model = entry.new_model(cfg, weights, dist, dtype, mtp) if mtp else entry.new_model(cfg, weights, dist, dtype)
    return model, cfg, CacheFactory(entry, cfg, dtype, dist.device, speculative_tokens)
