"""What tensors a DeepSeek checkpoint holds, derived from its config.json alone.

Every stage reads checkpoints through this module: the quantizer (which tensors a recipe turns INT8), the
sharder and the planner (placement by role), the tiny-checkpoint maker (what to generate) and the runner.
A model family is one registered `Family` (config parsing, tensor inventory, recipes, attention-TP split,
KV-cache sizes, chat encoder, tiny config), defined in one module (`deepseek_v3`, `deepseek_v4`);
`family_for(config)` picks one from `model_type` and nothing else. This package (`dsconv.family`) sits below
every stage and imports none of them; the runner keeps its own model per model_type
(runner/models/registry.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from dsconv.errors import InputError
from dsconv.family.layout import Layout
from dsconv.family.recipes import ALL_LINEARS, Recipe
from dsconv.family.tensors import Encoding, Role, TensorSpec

__all__ = ["ArchError", "CacheField", "Encoding", "Family", "Role", "TensorSpec", "family_for", "families",
           "recipe_for", "recipes_help", "register"]  # Role, Encoding and TensorSpec: family/tensors.py's


class ArchError(InputError):
    """A config or tensor name this project cannot place; the message names the value."""


# vLLM's --kv-cache-dtype values dsrun and `dsconv plan` take: "auto" keeps cache entries in the compute dtype
# (BF16 on a device), "int8" stores the quantities a family marks (CacheField.int8_dims) as INT8 with a float32
# scale per token (symmetric, kernels.int8's formula), dequantized or multiplied as INT8 where they are read.
KV_CACHE_DTYPES = ("auto", "int8")
KV_SCALE_BYTES = 4  # an INT8 cache entry's per-token scale is one float32
# Tokens per KV-cache block (dsrun's paged caches allocate and table whole blocks) unless --block-size says
# otherwise: vLLM's default on GPUs. Small blocks waste less of a sequence's last block and let forked samples share
# more of a prompt; vllm-ascend runs 128 on Ascend, where the fused attention kernels take blocks of 128 (dsrun's
# NPU path reads its caches through torch ops, which take any size). The tests cross block boundaries at 16 and 64.
DEFAULT_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 1024  # the largest --block-size taken (a power of two up to this)


@dataclass(frozen=True)
class CacheField:
    """One quantity a paged cache keeps per token and layer: `dim` values, of which the leading `int8_dims` are
    stored as INT8 under --kv-cache-dtype int8, with one float32 scale per token for each `tile` of them (0: all
    in the cache dtype)."""
    dim: int
    int8_dims: int = 0
    tile: int = 0  # values per scale; 0: one scale for all int8_dims

    def __post_init__(self):
        if self.int8_dims and self.int8_dims % self.scale_tile:
            raise ValueError(f"{self.int8_dims} INT8 values do not split into tiles of {self.tile}")

    @property
    def scale_tile(self) -> int:
        return self.tile or self.int8_dims

    @property
    def scales(self) -> int:
        """Scales per token and layer."""
        return self.int8_dims // self.scale_tile if self.int8_dims else 0

    def nbytes(self, itemsize: int) -> int:
        """Bytes per token and layer, `itemsize` being the cache dtype's (2 for BF16)."""
        return self.int8_dims + self.scales * KV_SCALE_BYTES + (self.dim - self.int8_dims) * itemsize


@dataclass(frozen=True)
class Family:
    """Everything the pipeline knows about one model family; its module builds one and registers it.

    `parse_config` returns a validated dataclass; placement and the tiny-checkpoint maker read its
    `vocab_size`, `num_hidden_layers`, `num_attention_heads` and `n_routed_experts`.
    """

    name: str  # the config's model_type
    parse_config: Callable[[dict], Any]  # validated dataclass from config.json
    inventory: Callable[[Any], Iterator[TensorSpec]]  # every tensor the checkpoint holds, MTP included
    # Checkpoints saved by transformers: its tensor name -> the hub's (the name every stage uses), and any
    # config.json -> the hub's form for the tensors the checkpoint holds (what quantize and shard write)
    hub_name: Callable[[str], str]
    hub_config: Callable[[dict, Any], dict]  # (config.json, parsed config) -> config.json
    # msModelSlim's Ascend layout also stores these copies per MTP layer: copy name -> the tensor it copies
    ascend_mtp_copies: Callable[[Any], dict[str, str]]
    scale_suffix: str  # FP8/FP4 scale name next to `X.weight`: "weight_scale_inv" (V3) or "scale" (V4)
    scale_is_e8m0: bool  # V4 stores scales as float8_e8m0fnu
    recipes: tuple[Recipe, ...]  # its W8A8 recipes, the default first; recipes.ALL_LINEARS applies to every family
    fused: tuple[tuple[Role, ...], ...]  # roles engines run as one matmul: every recipe gives a group one type
    attention_tp: Mapping[Role, int]  # with attn_tp > 1: the attention roles split by heads, and on which dim
    check_attention_tp: Callable[[Any, int], None] | None  # (config, attn_tp): raises when heads cannot split
    # (config, entry bytes, kv_cache_dtype) -> bytes per token by component
    kv_cache_bytes_per_token: Callable[[Any, int, str], dict[str, float]]
    # (config, entry bytes, kv_cache_dtype) -> length-independent state, by component
    kv_cache_bytes_per_sequence: Callable[[Any, int, str], dict[str, int]]
    tiny_config: Callable[..., dict]  # (partial_block=False, **overrides): a small config.json for fixtures
    # family/text.py's encoder: (messages, thinking, tokenizer_config.json, tools) -> prompt text; None: no chat
    # format (prompts are fed as raw text, dsrun --no-chat)
    encode_chat: Callable[[Any, bool, Mapping, list], str] | None
    # why --kv-cache-dtype int8 is refused for this family; None: its caches have an INT8 form
    kv_cache_int8_refusal: str | None = None
    # why a context-parallel prefill (--prefill-context-parallel-size) is refused; None: the family has one
    context_parallel_refusal: str | None = None
    # family.dsml.Dialect of its tool calls; None: the family takes no tools
    tool_dialect: Any = None


def check_kv_cache_dtype(family: Family, kv_cache_dtype: str) -> None:
    """Refuses an unknown --kv-cache-dtype, or int8 for a family whose caches have no INT8 form, in one line."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InputError(f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "int8" and family.kv_cache_int8_refusal is not None:
        raise InputError(f"--kv-cache-dtype int8 is not available for {family.name}: {family.kv_cache_int8_refusal}")


def check_block_size(family: Family, block_size: int) -> None:
    """Refuses, in one line, a --block-size the runner's caches cannot table: a power of two up to MAX_BLOCK_SIZE
    (the same for every family today)."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise InputError(f"--block-size {block_size} must be a power of two from 1 to {MAX_BLOCK_SIZE} "
                         f"({family.name})")


def check_context_parallel(family: Family, layout: Layout, cp_size: int, cp_min_tokens: int) -> None:
    """Refuses, in one line, a context-parallel prefill the family or the layout cannot run: a group is cp_size
    attention-DP ranks (attention TP 1), and cp_size divides the attention-DP size."""
    if cp_size < 1 or cp_min_tokens < 1:
        raise InputError(f"--prefill-context-parallel-size {cp_size} and --prefill-cp-min-tokens {cp_min_tokens} "
                         f"must be at least 1")
    if cp_size == 1:
        return
    if family.context_parallel_refusal is not None:
        raise InputError(f"--prefill-context-parallel-size is not available for {family.name}: "
                         f"{family.context_parallel_refusal}")
    if layout.attn_tp != 1 or layout.dp % cp_size:
        raise InputError(f"--prefill-context-parallel-size {cp_size} needs attention TP 1 and an attention-DP size "
                         f"it divides; the shards have attention DP {layout.dp} x TP {layout.attn_tp}")


# The families that ship with dsconv; each module registers its Family when imported.
BUILTIN_FAMILY_MODULES = ("dsconv.family.deepseek_v3", "dsconv.family.deepseek_v4")
_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds a family (a built-in module's or one defined elsewhere); a name already taken is refused."""
    known = _FAMILIES.get(family.name)
    if known is family:
        return family
    if known is not None:
        raise ValueError(f"model_type={family.name!r} is already registered by another Family")
    check_recipes(family, list(_FAMILIES.values()))
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    if name not in _FAMILIES:
        raise ValueError(f"model_type={name!r} is not registered")
    del _FAMILIES[name]


def family_for(config: dict) -> Family:
    _load_families()
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        known = ", ".join(sorted(_FAMILIES))
        raise ArchError(f"unsupported architecture model_type={model_type!r}; supported: {known}")
    return _FAMILIES[model_type]


def families() -> dict[str, Family]:
    _load_families()
    return dict(_FAMILIES)


def _load_families() -> None:
    # Imported for their register() side effect; late so the family modules can import this one.
    for module in BUILTIN_FAMILY_MODULES:
        importlib.import_module(module)


def hub_dtype_key(config: dict) -> dict:
    """transformers 5 writes `dtype` where the hub (and the transformers 4 that engines pin) reads `torch_dtype`."""
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config.pop("dtype")
    return config


# -- a family's recipes (family/recipes.py defines them) --------------------------------------------------------

def accepted(family: Family) -> tuple[Recipe, ...]:
    return (*family.recipes, ALL_LINEARS)


def check_recipes(family: Family, registered: list[Family]) -> None:
    """Refuses a family whose recipes would split a fused group, or reuse another family's recipe name."""
    if not family.recipes:
        raise ValueError(f"family {family.name} defines no recipe (its first is the default)")
    for recipe in accepted(family):
        for group in family.fused:
            if len({role in recipe.int8_roles for role in group}) != 1:
                raise ValueError(f"recipe {recipe.name} quantizes some of {[r.value for r in group]} but not all; "
                                 f"{family.name} fuses them into one matmul")
    taken = {r.name: r for r in (ALL_LINEARS, *(r for other in registered for r in other.recipes))}
    for recipe in family.recipes:
        if recipe.name in taken and taken[recipe.name] is not recipe:
            raise ValueError(f"recipe name {recipe.name!r} of {family.name} is already taken by another recipe")


def recipe_for(name: str | None, family: Family) -> Recipe:
    by_name = {r.name: r for r in accepted(family)}
    if name is None:
        return family.recipes[0]
    if name in by_name:
        return by_name[name]
    owners = [f.name for f in families().values() if any(r.name == name for r in f.recipes)]
    if owners:
        raise InputError(f"recipe {name!r} is for {', '.join(owners)}, not {family.name}")
    raise InputError(f"unknown recipe {name!r}; choose from {', '.join(by_name)}")


def recipes_help() -> str:
    """Every registered family's recipes and all-linears, for --recipe's help."""
    registered = families().values()
    recipes = {r.name: r for family in registered for r in family.recipes}
    lines = [f"{r.name}: {r.help}." for r in (*recipes.values(), ALL_LINEARS)]
    defaults = ", ".join(f"{family.name} -> {family.recipes[0].name}" for family in registered)
    return " ".join(lines) + f" Default by model: {defaults}."
