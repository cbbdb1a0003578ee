"""dsrun's model per family: model_type -> how to build its forward and its cache. The family layer
(`dsconv.family`) describes checkpoints and knows nothing of the runner; a family with no entry here has no
runner, which `model_for` says in one line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dsconv.errors import InputError
from dsconv.runner.models.deepseek_v3 import DeepseekV3, cache_fields
from dsconv.runner.models.deepseek_v4 import DeepseekV4
from dsconv.runner.models.kv_cache import BLOCK_SIZE, LatentCache
from dsconv.runner.models.v4_state import V4Cache


@dataclass(frozen=True)
class ModelEntry:
    new_model: Callable[[Any, Any, Any, Any], Any]  # (config, RankWeights, Dist, dtype) -> model
    new_cache: Callable[[Any, Any, int, Any], Any]  # (config, model, capacity_tokens, device) -> cache


def _latent_cache(cfg, model, capacity_tokens: int, device):
    return LatentCache(cfg.num_hidden_layers, -(-capacity_tokens // BLOCK_SIZE), BLOCK_SIZE, cache_fields(cfg),
                       model.cache_dtype, device)


def _v4_state(cfg, model, capacity_tokens: int, device):
    return V4Cache(cfg, capacity_tokens, model.dtype, device)  # compressor state in the model dtype


V3 = ModelEntry(DeepseekV3, _latent_cache)
MODELS: dict[str, ModelEntry] = {"deepseek_v3": V3, "deepseek_v32": V3,
                                 "deepseek_v4": ModelEntry(DeepseekV4, _v4_state)}


def model_for(model_type: str) -> ModelEntry:
    if model_type not in MODELS:
        raise InputError(f"dsrun has no model for {model_type} shards (supported: {', '.join(sorted(MODELS))})")
    return MODELS[model_type]
