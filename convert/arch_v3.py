"""DeepSeek-V3 and DeepSeek-V3.2(-Exp): config, tensor inventory and a tiny config, in the hub's names.

Both use the HF layout (`model.layers.L.self_attn.q_a_proj.weight`, ...). V3.2 is V3 plus a lightning indexer
under `self_attn.indexer` on every layer. The MTP layers follow the decoder layers as `model.layers.{L}` with
L >= num_hidden_layers: a full decoder layer plus `enorm`, `hnorm`, `eh_proj`, `embed_tokens` and
`shared_head.{norm,head}`.

What the hub ships in which encoding (DeepSeek-V3 / V3.2-Exp FP8 releases):
- FP8 e4m3 + float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)]: every attention and MLP linear of the
  decoder layers (MTP layer included), the indexer's `wq_b` and `wk`.
- BF16: embeddings, `lm_head`, all norms, the router `mlp.gate.weight`, the indexer `weights_proj` (DeepSeek's
  V3.2 inference code notes it is stored in bf16), `k_norm` weight and bias, MTP `eh_proj` and
  `shared_head.head` (vLLM loads `eh_proj` as a plain, unquantized nn.Linear).
- F32: `mlp.gate.e_score_correction_bias`.
A config without `quantization_config` describes a BF16 checkpoint (e.g. one made by fp8_cast_bf16.py): its
linears are then BF16 too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Iterator

from dsconv.convert.arch import ArchError, Encoding, Family, Role, TensorSpec, register

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
             "topk_group", "routed_scaling_factor", "norm_topk_prob", "scoring_func", "topk_method", "rms_norm_eps")
# Keys older or re-saved configs may omit, with the value their absence means.
_OPTIONAL = {"num_nextn_predict_layers": 0, "moe_layer_freq": 1, "tie_word_embeddings": False}
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


def inventory(cfg: V3Config) -> Iterator[TensorSpec]:
    h = cfg.hidden_size
    yield TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, h), Role.EMBED, Encoding.BF16)
    for layer in range(cfg.num_layers_with_mtp):
        yield from _layer(cfg, layer, mtp=layer >= cfg.num_hidden_layers)
    yield TensorSpec("model.norm.weight", (h,), Role.NORM, Encoding.BF16)
    if not cfg.tie_word_embeddings:
        yield TensorSpec("lm_head.weight", (cfg.vocab_size, h), Role.HEAD, Encoding.BF16)


def _layer(cfg: V3Config, layer: int, mtp: bool) -> Iterator[TensorSpec]:
    p = f"model.layers.{layer}."
    h = cfg.hidden_size
    linear = Encoding.FP8 if cfg.fp8 else Encoding.BF16

    def spec(name, shape, role, encoding=Encoding.BF16, expert=None):
        return TensorSpec(p + name, shape, role, encoding, layer=layer, expert=expert, mtp=mtp)

    if mtp:
        yield spec("embed_tokens.weight", (cfg.vocab_size, h), Role.EMBED)
        yield spec("enorm.weight", (h,), Role.NORM)
        yield spec("hnorm.weight", (h,), Role.NORM)
        yield spec("eh_proj.weight", (h, 2 * h), Role.MTP_PROJ)
    yield spec("input_layernorm.weight", (h,), Role.NORM)
    heads, qk_head = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    yield spec("self_attn.q_a_proj.weight", (cfg.q_lora_rank, h), Role.ATTN_Q_A, linear)
    yield spec("self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,), Role.NORM)
    yield spec("self_attn.q_b_proj.weight", (heads * qk_head, cfg.q_lora_rank), Role.ATTN_Q_B, linear)
    yield spec("self_attn.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
               Role.ATTN_KV_A, linear)
    yield spec("self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,), Role.NORM)
    yield spec("self_attn.kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
               Role.ATTN_KV_B, linear)
    yield spec("self_attn.o_proj.weight", (h, heads * cfg.v_head_dim), Role.ATTN_O, linear)
    if cfg.has_indexer:
        d = cfg.index_head_dim
        yield spec("self_attn.indexer.wq_b.weight", (cfg.index_n_heads * d, cfg.q_lora_rank), Role.INDEXER_Q_B,
                   linear)
        yield spec("self_attn.indexer.wk.weight", (d, h), Role.INDEXER_K, linear)
        yield spec("self_attn.indexer.k_norm.weight", (d,), Role.NORM)
        yield spec("self_attn.indexer.k_norm.bias", (d,), Role.INDEXER_K_NORM_BIAS)
        yield spec("self_attn.indexer.weights_proj.weight", (cfg.index_n_heads, h), Role.INDEXER_WEIGHTS)
    yield spec("post_attention_layernorm.weight", (h,), Role.NORM)
    if not cfg.is_moe_layer(layer):
        i = cfg.intermediate_size
        yield spec("mlp.gate_proj.weight", (i, h), Role.DENSE_W1, linear)
        yield spec("mlp.up_proj.weight", (i, h), Role.DENSE_W3, linear)
        yield spec("mlp.down_proj.weight", (h, i), Role.DENSE_W2, linear)
    else:
        yield spec("mlp.gate.weight", (cfg.n_routed_experts, h), Role.ROUTER)
        yield spec("mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), Role.ROUTER_BIAS, Encoding.F32)
        i = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            q = f"mlp.experts.{e}."
            yield spec(q + "gate_proj.weight", (i, h), Role.EXPERT_W1, linear, expert=e)
            yield spec(q + "up_proj.weight", (i, h), Role.EXPERT_W3, linear, expert=e)
            yield spec(q + "down_proj.weight", (h, i), Role.EXPERT_W2, linear, expert=e)
        if cfg.n_shared_experts:
            s = i * cfg.n_shared_experts
            yield spec("mlp.shared_experts.gate_proj.weight", (s, h), Role.SHARED_W1, linear)
            yield spec("mlp.shared_experts.up_proj.weight", (s, h), Role.SHARED_W3, linear)
            yield spec("mlp.shared_experts.down_proj.weight", (h, s), Role.SHARED_W2, linear)
    if mtp:
        yield spec("shared_head.norm.weight", (h,), Role.NORM)
        yield spec("shared_head.head.weight", (cfg.vocab_size, h), Role.HEAD)


# Tiny but structurally complete: 1 dense + 2 MoE layers + 1 MTP layer, 16 experts in 4 groups (one expert
# per rank at EP16), 8 heads (one per rank at TP8). Every FP8 dimension is a multiple of 128 so transformers'
# block dequantization accepts it; hence qk_rope_head_dim=128 (kv_lora_rank and kv_lora_rank + rope must both
# be multiples of 128). index_topk=8 is below a test prompt's length so the indexer really drops tokens.
_TINY = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 128,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 128,
    "moe_layer_freq": 1,
    "n_group": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 8,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 128,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": FP8_BLOCK},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 1024,
}
_TINY_INDEXER = {"index_head_dim": 256, "index_n_heads": 4, "index_topk": 8}
# Like the real 576-row kv_a_proj_with_mqa (512 + 64): 256 + 64 = 320 rows, a 64-row last block.
_PARTIAL_BLOCK = {"qk_rope_head_dim": 64, "kv_lora_rank": 256}


def tiny_config(model_type: str, partial_block: bool = False, **overrides) -> dict:
    config = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, **_TINY}
    if model_type == V32:
        config.update(_TINY_INDEXER)
        # V3.1 and later train with UE8M0 (power-of-two) scales and say so; the scale tensors stay float32.
        config["quantization_config"] = {**config["quantization_config"], "scale_fmt": "ue8m0"}
    if partial_block:
        config.update(_PARTIAL_BLOCK)
    config.update(overrides)
    kv_a_rows = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    if partial_block and kv_a_rows % FP8_BLOCK[0] == 0:
        raise ArchError(f"partial_block=True but overrides make kv_a_proj_with_mqa rows={kv_a_rows} "
                        f"a multiple of {FP8_BLOCK[0]}")
    return config


for _model_type in ARCHITECTURES:
    register(Family(name=_model_type, parse_config=parse_config, inventory=inventory,
                    scale_suffix="weight_scale_inv", scale_is_e8m0=False,
                    tiny_config=functools.partial(tiny_config, _model_type)))
