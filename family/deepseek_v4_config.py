"""DeepSeek-V4 config.json, validated, and written back in the hub's form.

Accepts the hub's spellings (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`,
top-level `expert_dtype`) and the ones transformers' `DeepseekV4Config` reads or writes (`layer_types` +
`compress_rates`, legacy `compress_rate_csa` / `compress_rate_hca`, `mlp_layer_types`,
`partial_rotary_factor`, `rope_parameters`, `expert_dtype` inside `quantization_config`).

Compression follows DeepSeek's reference `model.py`: each layer has its own `compress_ratios` entry; 0 is
sliding-window only, 4 an overlapping compressor with a lightning indexer (CSA), any other positive ratio a
plain compressor attended densely (HCA). transformers folds the ratios into one rate per layer type.

transformers saves `layer_types` for the decoder layers only and no MTP tensors, while keeping
`num_nextn_predict_layers`: a config without `compress_ratios` whose `layer_types` covers the decoder layers
alone describes a checkpoint without MTP layers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from dsconv.family.arch import ArchError, hub_dtype_key

SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
EXPERT_DTYPES = ("fp4", "fp8")
FP4_BLOCK = 32  # e2m1 values sharing one e8m0 scale along a routed expert's input dim


class AttnType(str, enum.Enum):
    SLIDING = "sliding_attention"  # sliding window only
    CSA = "compressed_sparse_attention"  # + overlapping compressor and lightning indexer
    HCA = "heavily_compressed_attention"  # + plain compressor, attended densely


class MlpType(str, enum.Enum):
    HASH = "hash_moe"  # experts chosen by tid2eid[token]
    MOE = "moe"  # experts chosen by score + bias top-k


CSA_RATIO = 4  # the one ratio DeepSeek's reference compresses with overlap and indexes
DEFAULT_COMPRESS_RATES = {AttnType.CSA: CSA_RATIO, AttnType.HCA: 128}  # transformers' defaults per layer type


def attn_type_of(ratio: int) -> AttnType:
    """DeepSeek's rule: no compressor at 0, overlap + indexer at 4, a plain compressor at any other ratio."""
    if ratio == 0:
        return AttnType.SLIDING
    return AttnType.CSA if ratio == CSA_RATIO else AttnType.HCA


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    compress_ratios: tuple[int, ...]  # one per decoder layer, then one per MTP layer, as the hub writes them
    mlp_types: tuple[MlpType, ...]  # one per decoder layer
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling | None  # applied to the compressed layers' rope only
    rms_norm_eps: float
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    quantized: bool  # a `quantization_config` is present: linears ship FP8 block-scaled
    weight_block_size: tuple[int, int] | None  # FP8 scale grid, when quantized
    expert_dtype: str | None  # routed experts "fp4" or "fp8", when quantized

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
            "n_shared_experts", "num_experts_per_tok", "sliding_window", "index_n_heads", "index_head_dim",
            "index_topk", "hc_mult", "hc_sinkhorn_iters",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ArchError(f"{name}={value!r} must be a positive integer")
        if self.num_nextn_predict_layers < 0:
            raise ArchError(f"num_nextn_predict_layers={self.num_nextn_predict_layers} must be >= 0")
        # V4 attention is shared-KV MQA: `wkv` projects to exactly one head that serves as key and value
        if self.num_key_value_heads != 1:
            raise ArchError(f"num_key_value_heads={self.num_key_value_heads} is not supported; V4 uses 1 KV head")
        if self.num_attention_heads % self.o_groups:
            raise ArchError(
                f"o_groups={self.o_groups} does not divide num_attention_heads={self.num_attention_heads}"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ArchError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most head_dim={self.head_dim}"
            )
        # The indexer rotates its queries and keys with the same rope width as the main attention
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ArchError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} exceeds index_head_dim={self.index_head_dim}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ArchError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ArchError(f"scoring_func={self.scoring_func!r} is not one of {SCORING_FUNCS}")
        expected = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != expected:
            raise ArchError(f"compress_ratios has {len(self.compress_ratios)} entries; expected num_hidden_layers + "
                            f"num_nextn_predict_layers = {expected}")
        for layer, ratio in enumerate(self.compress_ratios):
            if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0:
                raise ArchError(f"compress_ratios[{layer}]={ratio!r} must be 0 (no compression) or a positive integer")
        if len(self.mlp_types) != self.num_hidden_layers:
            raise ArchError(
                f"num_hidden_layers={self.num_hidden_layers} but {len(self.mlp_types)} MLP types were given"
            )
        # DeepSeek's code hash-routes layers below num_hash_layers: hash layers must come first
        if MlpType.HASH in self.mlp_types[self.num_hash_layers:]:
            raise ArchError(f"mlp_layer_types {[t.value for t in self.mlp_types]} puts a hash_moe layer after a moe "
                            "layer; DeepSeek-V4 hash-routes the first num_hash_layers layers only")
        if self.expert_dtype is not None and self.expert_dtype not in EXPERT_DTYPES:
            raise ArchError(f"expert_dtype={self.expert_dtype!r} is not one of {EXPERT_DTYPES}")
        if self.expert_dtype == "fp4":
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % FP4_BLOCK:
                    raise ArchError(f"{name}={getattr(self, name)} is not a multiple of the FP4 block {FP4_BLOCK}")

    @property
    def num_hash_layers(self) -> int:
        return sum(mlp is MlpType.HASH for mlp in self.mlp_types)

    @property
    def attn_types(self) -> tuple[AttnType, ...]:
        """One per decoder layer."""
        return tuple(attn_type_of(r) for r in self.compress_ratios[:self.num_hidden_layers])

    @property
    def mtp_attn_types(self) -> tuple[AttnType, ...]:
        return tuple(attn_type_of(r) for r in self.compress_ratios[self.num_hidden_layers:])

    @property
    def csa_compress_rate(self) -> int:
        return CSA_RATIO

    @property
    def hca_compress_rate(self) -> int | None:
        """The heavy ratio when every HCA decoder layer shares one (as transformers' configs must), else None."""
        heavy = {r for r, kind in zip(self.compress_ratios, self.attn_types) if kind is AttnType.HCA}
        return heavy.pop() if len(heavy) == 1 else None


def _require(raw: dict, key: str) -> Any:
    if key not in raw:
        raise ArchError(f"config.json has no {key!r}, which deepseek_v4 needs")
    return raw[key]


def _compress_rates(raw: dict) -> dict[AttnType, int] | None:
    """transformers' per-type rates (`compress_rates`, legacy `compress_rate_csa` / `compress_rate_hca`), or None."""
    if all(raw.get(key) is None for key in ("compress_rates", "compress_rate_csa", "compress_rate_hca")):
        return None
    rates = dict(DEFAULT_COMPRESS_RATES)
    for key, rate in (raw.get("compress_rates") or {}).items():
        try:
            rates[AttnType(key)] = rate
        except ValueError:
            raise ArchError(f"compress_rates has unknown layer type {key!r}") from None
    for key, attn_type in (("compress_rate_csa", AttnType.CSA), ("compress_rate_hca", AttnType.HCA)):
        if raw.get(key) is not None:
            rates[attn_type] = raw[key]
    # Under DeepSeek's rule the ratio decides the layer's kind; a rate that says otherwise has no reference model
    if rates[AttnType.CSA] != CSA_RATIO:
        raise ArchError(f"compressed_sparse_attention rate {rates[AttnType.CSA]} is not {CSA_RATIO}; DeepSeek-V4 "
                        f"overlaps and indexes only at ratio {CSA_RATIO}")
    hca = rates[AttnType.HCA]
    if isinstance(hca, bool) or not isinstance(hca, int) or hca <= 0 or hca == CSA_RATIO:
        raise ArchError(f"heavily_compressed_attention rate {hca!r} must be a positive integer other than {CSA_RATIO}")
    return rates


def _compress_ratios(raw: dict, n_layers: int, n_mtp: int) -> tuple[tuple[int, ...], int]:
    """-> (ratios of the decoder and MTP layers, MTP layers the checkpoint holds)."""
    rates = _compress_rates(raw)
    if "compress_ratios" in raw:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list):
            raise ArchError(f"compress_ratios={ratios!r} is not a list")
        for layer, ratio in enumerate(ratios):
            if rates is not None and isinstance(ratio, int) and ratio and rates[attn_type_of(ratio)] != ratio:
                kind = attn_type_of(ratio)
                raise ArchError(f"compress_ratios[{layer}]={ratio} contradicts {kind.value} rate {rates[kind]}")
        return tuple(ratios), n_mtp
    if "layer_types" not in raw:
        raise ArchError("config.json has neither 'compress_ratios' nor 'layer_types'")
    rates = rates or DEFAULT_COMPRESS_RATES
    try:
        types = [AttnType(name) for name in raw["layer_types"]]
    except ValueError as error:
        raise ArchError(f"layer_types: {error}") from None
    ratios = tuple(0 if kind is AttnType.SLIDING else rates[kind] for kind in types)
    if len(types) == n_layers:
        return ratios, 0  # transformers' own form: it saves neither MTP layer types nor MTP tensors
    if len(types) != n_layers + n_mtp:
        raise ArchError(f"layer_types has {len(types)} entries; expected num_hidden_layers={n_layers} (no MTP "
                        f"layers) or num_hidden_layers + num_nextn_predict_layers = {n_layers + n_mtp}")
    return ratios, n_mtp


def _mlp_schedule(raw: dict, n_layers: int) -> tuple[MlpType, ...]:
    if "mlp_layer_types" in raw:
        try:
            types = tuple(MlpType(name) for name in raw["mlp_layer_types"])
        except ValueError as error:
            raise ArchError(f"mlp_layer_types: {error}") from None
        if len(types) != n_layers:
            raise ArchError(f"mlp_layer_types has {len(types)} entries; expected num_hidden_layers={n_layers}")
        return types
    n_hash = _require(raw, "num_hash_layers")
    if not isinstance(n_hash, int) or not 0 <= n_hash <= n_layers:
        raise ArchError(f"num_hash_layers={n_hash!r} must be between 0 and num_hidden_layers={n_layers}")
    return (MlpType.HASH,) * n_hash + (MlpType.MOE,) * (n_layers - n_hash)


def _rope_head_dim(raw: dict, head_dim: int) -> int:
    if "qk_rope_head_dim" in raw:
        return raw["qk_rope_head_dim"]
    if raw.get("partial_rotary_factor") is not None:
        return int(head_dim * raw["partial_rotary_factor"])
    raise ArchError("config.json has neither 'qk_rope_head_dim' nor 'partial_rotary_factor'")


def _yarn(raw: dict) -> YarnScaling | None:
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if isinstance(params.get("compress"), dict):  # transformers' nested form: yarn lives on the compress rope
        params = params["compress"]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ArchError(f"rope scaling type={rope_type!r} is not supported; V4 uses 'yarn'")
    return YarnScaling(
        factor=float(_require(params, "factor")),
        original_max_position_embeddings=int(_require(params, "original_max_position_embeddings")),
        beta_fast=float(_require(params, "beta_fast")),
        beta_slow=float(_require(params, "beta_slow")),
    )


def _quantization(raw: dict) -> tuple[bool, tuple[int, int] | None, str | None]:
    quant = raw.get("quantization_config")
    if quant is None or quant.get("quant_method") == "compressed-tensors":
        return False, None, None  # no FP8 encoding; a compressed-tensors (W8A8) checkpoint's INT8 is read by dtype
    if quant.get("quant_method") != "fp8":
        raise ArchError(f"quantization_config.quant_method={quant.get('quant_method')!r} is not 'fp8'")
    block = tuple(_require(quant, "weight_block_size"))
    if len(block) != 2:
        raise ArchError(f"quantization_config.weight_block_size={list(block)} must have two entries")
    # The hub writes expert_dtype at the top level; transformers moves it into quantization_config.
    # Without it DeepSeek's code builds FP8 experts.
    expert_dtype = quant.get("expert_dtype", raw.get("expert_dtype", "fp8"))
    return True, block, expert_dtype


def parse_config(raw: dict) -> V4Config:
    if raw.get("model_type") != "deepseek_v4":
        raise ArchError(f"model_type={raw.get('model_type')!r} is not 'deepseek_v4'")
    n_layers = _require(raw, "num_hidden_layers")
    n_mtp = _require(raw, "num_nextn_predict_layers")
    head_dim = _require(raw, "head_dim")
    compress_ratios, n_mtp = _compress_ratios(raw, n_layers, n_mtp)
    quantized, block, expert_dtype = _quantization(raw)
    plain = {
        key: _require(raw, key)
        for key in (
            "vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads",
            "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "n_shared_experts",
            "num_experts_per_tok", "scoring_func", "routed_scaling_factor", "norm_topk_prob", "swiglu_limit",
            "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
            "hc_eps", "rope_theta", "compress_rope_theta", "rms_norm_eps",
        )
    }
    return V4Config(
        **plain,
        num_hidden_layers=n_layers,
        num_nextn_predict_layers=n_mtp,
        head_dim=head_dim,
        qk_rope_head_dim=_rope_head_dim(raw, head_dim),
        compress_ratios=compress_ratios,
        mlp_types=_mlp_schedule(raw, n_layers),
        rope_scaling=_yarn(raw),
        # transformers' default when a config omits it; the hub writes false
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        quantized=quantized,
        weight_block_size=block,
        expert_dtype=expert_dtype,
    )


# What transformers writes in place of the hub's keys; hub_config writes the hub's instead
TRANSFORMERS_KEYS = ("layer_types", "compress_rates", "compress_rate_csa", "compress_rate_hca", "mlp_layer_types",
                     "partial_rotary_factor", "rope_parameters")


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def hub_config(raw: dict, cfg: V4Config) -> dict:
    """config.json in the hub's form, whatever form came in, for the tensors the checkpoint holds: what
    vllm-ascend and DeepSeek's own code read (compress_ratios with the MTP entries, num_hash_layers, the rope keys)."""
    config = {k: v for k, v in raw.items() if k not in TRANSFORMERS_KEYS and k != "rope_scaling"}
    config.update(
        num_nextn_predict_layers=cfg.num_nextn_predict_layers,
        compress_ratios=list(cfg.compress_ratios),
        num_hash_layers=cfg.num_hash_layers,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta,
    )
    if cfg.rope_scaling is not None:
        yarn = cfg.rope_scaling
        config["rope_scaling"] = {
            "beta_fast": _number(yarn.beta_fast),
            "beta_slow": _number(yarn.beta_slow),
            "factor": _number(yarn.factor),
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "type": "yarn",
        }
    config.setdefault("topk_method", "noaux_tc")  # transformers' V4 config has no such key; the hub writes it
    return hub_dtype_key(config)
