"""DeepSeek-V3 / V3.2(-Exp) config.json, validated, and written back in the hub's form.

Accepts the hub's spellings and the ones transformers 5 re-saves (`rope_parameters`); keys older or re-saved
configs may omit get the value their absence means (`scoring_func` and `topk_method`: the sigmoid / noaux_tc
routing transformers assumes). V3.2 adds the lightning indexer's `index_*` keys.

transformers saves no MTP tensors but keeps `num_nextn_predict_layers`: a config in its form (`rope_parameters`,
which the hub never writes) describes a checkpoint without MTP layers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dsconv.family.arch import ArchError, hub_dtype_key

V3 = "deepseek_v3"
V32 = "deepseek_v32"
ARCHITECTURES = {V3: "DeepseekV3ForCausalLM", V32: "DeepseekV32ForCausalLM"}

FP8_BLOCK = [128, 128]  # the only block grid DeepSeek ships; a different one would need a different decoder
SUPPORTED_SCORING = "sigmoid"  # V3 routing: sigmoid scores + e_score_correction_bias ("noaux_tc")
SUPPORTED_TOPK_METHOD = "noaux_tc"
SUPPORTED_ROPE_SCALING = "yarn"


@dataclass(frozen=True)
class V3Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense-MLP layers
    moe_intermediate_size: int  # per routed / shared expert
    num_hidden_layers: int
    num_nextn_predict_layers: int  # MTP layers after the decoder layers
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    topk_method: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # YaRN parameters as the hub writes them, None without scaling
    tie_word_embeddings: bool
    fp8: bool  # the config carries an FP8 `quantization_config`
    scale_fmt: str | None  # quantization_config.scale_fmt ("ue8m0": scales are powers of two)
    index_n_heads: int | None = None  # V3.2 lightning indexer
    index_head_dim: int | None = None
    index_topk: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ArchError(f"model_type={self.model_type!r} is not one of {sorted(ARCHITECTURES)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ArchError(f"{f.name}={value!r} must be an integer")
        positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ArchError(f"{name}={getattr(self, name)} must be positive")
        for name in ("num_nextn_predict_layers", "n_shared_experts", "first_k_dense_replace"):
            if getattr(self, name) < 0:
                raise ArchError(f"{name}={getattr(self, name)} must not be negative")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ArchError(f"first_k_dense_replace={self.first_k_dense_replace} exceeds "
                            f"num_hidden_layers={self.num_hidden_layers}")
        if self.moe_layer_freq != 1:
            raise ArchError(f"moe_layer_freq={self.moe_layer_freq} is not supported (DeepSeek-V3 uses 1)")
        if self.n_routed_experts % self.n_group:
            raise ArchError(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ArchError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        reachable = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > reachable:
            raise ArchError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {reachable} experts "
                            f"of topk_group={self.topk_group} groups")
        if self.scoring_func != SUPPORTED_SCORING:
            raise ArchError(f"scoring_func={self.scoring_func!r} is not supported (only {SUPPORTED_SCORING!r})")
        if self.topk_method != SUPPORTED_TOPK_METHOD:
            raise ArchError(f"topk_method={self.topk_method!r} is not supported (only {SUPPORTED_TOPK_METHOD!r})")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if kind != SUPPORTED_ROPE_SCALING:
                raise ArchError(f"rope_scaling type={kind!r} is not supported (only {SUPPORTED_ROPE_SCALING!r})")
        if self.scale_fmt not in (None, "ue8m0"):
            raise ArchError(f"quantization_config.scale_fmt={self.scale_fmt!r} is not supported")
        indexer = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if self.model_type == V32:
            for name, value in zip(("index_n_heads", "index_head_dim", "index_topk"), indexer):
                if value is None or value <= 0:
                    raise ArchError(f"{name}={value!r} must be a positive integer for {V32}")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise ArchError(f"index_head_dim={self.index_head_dim} is smaller than "
                                f"qk_rope_head_dim={self.qk_rope_head_dim}")
        elif any(value is not None for value in indexer):
            raise ArchError(f"index_* keys given for model_type={self.model_type!r}, which has no indexer")

    @property
    def has_indexer(self) -> bool:
        return self.model_type == V32

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "num_experts_per_tok", "n_group",
             "topk_group", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps")
# Keys older or re-saved configs may omit, with the value their absence means.
_OPTIONAL = {"num_nextn_predict_layers": 0, "moe_layer_freq": 1, "tie_word_embeddings": False,
             "scoring_func": SUPPORTED_SCORING, "topk_method": SUPPORTED_TOPK_METHOD}
_INDEXER = ("index_n_heads", "index_head_dim", "index_topk")


def parse_config(d: dict) -> V3Config:
    model_type = d.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ArchError(f"model_type={model_type!r} is not one of {sorted(ARCHITECTURES)}")
    keys = _REQUIRED + (_INDEXER if model_type == V32 else ())
    missing = [k for k in keys if k not in d]
    if missing:
        raise ArchError(f"config.json ({model_type}) lacks required key(s): {', '.join(missing)}")
    if "q_lora_rank" not in d:
        raise ArchError("config.json lacks required key: q_lora_rank")
    if d["q_lora_rank"] is None:
        raise ArchError("q_lora_rank=None (V2-Lite-style single q_proj) is not supported; V3 uses q_a/q_b")
    values = {k: d[k] for k in keys}
    values.update({k: d.get(k, default) for k, default in _OPTIONAL.items()})
    if is_transformers_form(d):
        values["num_nextn_predict_layers"] = 0
    rope_theta, rope_scaling = _rope(d)
    fp8, scale_fmt = _quantization(d.get("quantization_config"))
    return V3Config(model_type=model_type, q_lora_rank=d["q_lora_rank"], rope_theta=rope_theta,
                    rope_scaling=rope_scaling, fp8=fp8, scale_fmt=scale_fmt, **values)


def _rope(d: dict) -> tuple[float, dict | None]:
    # Hub configs write rope_theta + rope_scaling; configs re-saved by transformers 5 write rope_parameters.
    if "rope_parameters" in d and d["rope_parameters"] is not None:
        params = dict(d["rope_parameters"])
        if "rope_theta" not in params:
            raise ArchError("rope_parameters lacks rope_theta")
        theta = params.pop("rope_theta")
        return theta, (params if params.get("rope_type", "default") != "default" else None)
    if "rope_theta" not in d:
        raise ArchError("config.json lacks required key: rope_theta (or rope_parameters)")
    return d["rope_theta"], d.get("rope_scaling")


COMPRESSED_TENSORS = "compressed-tensors"


def _quantization(q: dict | None) -> tuple[bool, str | None]:
    if q is None or q.get("quant_method") == COMPRESSED_TENSORS:
        return False, None  # no FP8 encoding; a compressed-tensors (W8A8) checkpoint's INT8 is read by dtype
    if q.get("quant_method") != "fp8":
        raise ArchError(f"quantization_config.quant_method={q.get('quant_method')!r} is not supported (only 'fp8')")
    if list(q.get("weight_block_size", [])) != FP8_BLOCK:
        raise ArchError(f"quantization_config.weight_block_size={q.get('weight_block_size')!r} "
                        f"is not supported (only {FP8_BLOCK})")
    return True, q.get("scale_fmt")


def is_transformers_form(d: dict) -> bool:
    return d.get("rope_parameters") is not None


def hub_config(raw: dict, cfg: V3Config) -> dict:
    """config.json in the hub's form (rope_theta + rope_scaling, the routing keys, the MTP layers the checkpoint
    holds), whatever form came in: what vllm-ascend and DeepSeek's own code read."""
    config = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    config.update(num_nextn_predict_layers=cfg.num_nextn_predict_layers, scoring_func=cfg.scoring_func,
                  topk_method=cfg.topk_method, rope_theta=cfg.rope_theta)
    if cfg.rope_scaling is not None:
        scaling = {k: v for k, v in cfg.rope_scaling.items() if k not in ("rope_type", "type")}
        config["rope_scaling"] = {**scaling, "type": SUPPORTED_ROPE_SCALING}
    return hub_dtype_key(config)
