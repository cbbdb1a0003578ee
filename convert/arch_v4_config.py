"""DeepSeek-V4 config.json, validated.

Accepts the hub's spellings (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`,
top-level `expert_dtype`) and the ones transformers' `DeepseekV4Config` reads or writes (`layer_types` +
`compress_rates`, legacy `compress_rate_csa` / `compress_rate_hca`, `mlp_layer_types`,
`partial_rotary_factor`, `rope_parameters`, `expert_dtype` inside `quantization_config`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from dsconv.convert.arch import ArchError

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


# The per-layer `compress_ratios` values the hub writes, and the type each one means (as transformers folds them)
HUB_RATIO_TYPES = {0: AttnType.SLIDING, 4: AttnType.CSA, 128: AttnType.HCA}
DEFAULT_COMPRESS_RATES = {AttnType.CSA: 4, AttnType.HCA: 128}


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
    attn_types: tuple[AttnType, ...]  # one per decoder layer
    mtp_attn_types: tuple[AttnType, ...]  # one per MTP layer
    csa_compress_rate: int
    hca_compress_rate: int
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
            "index_topk", "hc_mult", "hc_sinkhorn_iters", "csa_compress_rate", "hca_compress_rate",
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
        if self.csa_compress_rate == self.hca_compress_rate:
            raise ArchError(f"CSA and HCA compress rates are both {self.csa_compress_rate}; they must differ")
        if len(self.attn_types) != self.num_hidden_layers or len(self.mlp_types) != self.num_hidden_layers:
            raise ArchError(
                f"num_hidden_layers={self.num_hidden_layers} but {len(self.attn_types)} attention types and "
                f"{len(self.mlp_types)} MLP types were given"
            )
        if len(self.mtp_attn_types) != self.num_nextn_predict_layers:
            raise ArchError(
                f"num_nextn_predict_layers={self.num_nextn_predict_layers} but {len(self.mtp_attn_types)} MTP "
                "attention types were given"
            )
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
    def compress_ratios(self) -> tuple[int, ...]:
        # The hub's per-layer spelling, decoder layers then MTP layers
        return tuple(self.compress_rate(kind) for kind in self.attn_types + self.mtp_attn_types)

    def compress_rate(self, attn_type: AttnType) -> int:
        rates = {AttnType.SLIDING: 0, AttnType.CSA: self.csa_compress_rate, AttnType.HCA: self.hca_compress_rate}
        return rates[attn_type]


def _require(raw: dict, key: str) -> Any:
    if key not in raw:
        raise ArchError(f"config.json has no {key!r}, which deepseek_v4 needs")
    return raw[key]


def _compress_rates(raw: dict) -> dict[AttnType, int]:
    rates = dict(DEFAULT_COMPRESS_RATES)
    for key, rate in (raw.get("compress_rates") or {}).items():
        try:
            rates[AttnType(key)] = rate
        except ValueError:
            raise ArchError(f"compress_rates has unknown layer type {key!r}") from None
    for key, attn_type in (("compress_rate_csa", AttnType.CSA), ("compress_rate_hca", AttnType.HCA)):
        if raw.get(key) is not None:
            rates[attn_type] = raw[key]
    return rates


def _attention_schedule(raw: dict, n_layers: int, n_mtp: int, rates: dict) -> tuple[tuple, tuple]:
    if "compress_ratios" in raw:
        ratios = list(raw["compress_ratios"])
        if len(ratios) != n_layers + n_mtp:
            raise ArchError(
                f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers + "
                f"num_nextn_predict_layers = {n_layers + n_mtp}"
            )
        types = []
        for layer, ratio in enumerate(ratios):
            if ratio not in HUB_RATIO_TYPES:
                raise ArchError(f"compress_ratios[{layer}]={ratio!r} is not one of {sorted(HUB_RATIO_TYPES)}")
            kind = HUB_RATIO_TYPES[ratio]
            if kind is not AttnType.SLIDING and rates[kind] != ratio:
                raise ArchError(f"compress_ratios[{layer}]={ratio} contradicts {kind.value} rate {rates[kind]}")
            types.append(kind)
        return tuple(types[:n_layers]), tuple(types[n_layers:])
    if "layer_types" not in raw:
        raise ArchError("config.json has neither 'compress_ratios' nor 'layer_types'")
    try:
        types = [AttnType(name) for name in raw["layer_types"]]
    except ValueError as error:
        raise ArchError(f"layer_types: {error}") from None
    # transformers writes one entry per decoder layer only; MTP layers need theirs too
    if len(types) != n_layers + n_mtp:
        raise ArchError(
            f"layer_types has {len(types)} entries; expected num_hidden_layers + num_nextn_predict_layers = "
            f"{n_layers + n_mtp}"
        )
    return tuple(types[:n_layers]), tuple(types[n_layers:])


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
    rates = _compress_rates(raw)
    attn_types, mtp_attn_types = _attention_schedule(raw, n_layers, n_mtp, rates)
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
        attn_types=attn_types,
        mtp_attn_types=mtp_attn_types,
        csa_compress_rate=rates[AttnType.CSA],
        hca_compress_rate=rates[AttnType.HCA],
        mlp_types=_mlp_schedule(raw, n_layers),
        rope_scaling=_yarn(raw),
        # transformers' default when a config omits it; the hub writes false
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        quantized=quantized,
        weight_block_size=block,
        expert_dtype=expert_dtype,
    )
