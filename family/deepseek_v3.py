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
from typing import Iterator

from dsconv.family.arch import ArchError, CacheField, Encoding, Family, Role, TensorSpec, register
from dsconv.family.deepseek_v3_config import ARCHITECTURES, FP8_BLOCK, V32, V3Config, hub_config, parse_config
from dsconv.family.recipes import EXPERTS, FUSED_PAIRS, Recipe
from dsconv.family import dsml
from dsconv.family.text import encode_v32, render_template

__all__ = ["V3Config", "parse_config", "inventory", "tiny_config"]


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


# msModelSlim's DeepSeek-V3.2 recipes (lab_practice/deepseek_v3_2/deepseek_w8a8.yaml, deepseek_w4a8.yaml)
# exclude "*wq_b", "*wk", "*weights_proj" from linear_quant: the whole Lightning indexer stays BF16 (its output is
# a discrete top-k choice, which INT8 error flips). Their per-token W8A8 attention group (deepseek_w4a8.yaml) also
# excludes q_a_proj, kv_a_proj_with_mqa and kv_b_proj; deepseek_w8a8.yaml quantizes q_a/kv_a only with calibrated
# per-tensor activation scales, which this converter has not.
RECIPE = Recipe("v3", frozenset({Role.ATTN_Q_B, Role.ATTN_O, Role.DENSE_W1, Role.DENSE_W2, Role.DENSE_W3} | EXPERTS),
                "q_b_proj, o_proj, routed + shared experts, dense MLP (msModelSlim's per-token Ascend recipe); "
                "q_a/kv_a/kv_b, the V3.2 indexer (wq_b, wk, weights_proj), router, embed, head stay BF16")
# CANN's V3.2 practice on Atlas A3 runs the indexer prolog's q_b (the indexer's wq_b) in W8A8 too: this recipe
# adds it to v3's. wk and weights_proj stay BF16: dsrun merges them into the layer input's one projection with
# q_a and kv_a, which stay BF16 in both recipes.
RECIPE_INDEXER = Recipe("v32-indexer", RECIPE.int8_roles | {Role.INDEXER_Q_B},
                        "v3 plus the V3.2 Lightning indexer's wq_b (CANN's A3 practice: the indexer prolog's "
                        "q_b in W8A8); wk and weights_proj stay BF16")
# q_a and kv_a, which engines fuse, and V3.2's indexer wk and weights_proj, which read the same layer input and
# which dsrun runs in the same merged projection
MLA_FUSED = (Role.ATTN_Q_A, Role.ATTN_KV_A, Role.INDEXER_K, Role.INDEXER_WEIGHTS)

# MLA attention TP: heads are the output rows of q_b_proj and kv_b_proj and the input columns of o_proj; an
# all-reduce after o_proj sums the partial outputs. The indexer stays replicated.
ATTENTION_TP = {Role.ATTN_Q_B: 0, Role.ATTN_KV_B: 0, Role.ATTN_O: 1}


# An INT8 latent has one scale per token for each 128 values: the granularity of DeepSeek's FP8 MLA cache
# (FlashMLA: 512 FP8 + 4 float32 scales + 64 BF16 rope = 656 bytes a token) and of CANN's C8 cache on Atlas A3
# (vllm-ascend's sparse C8: npu_dynamic_block_quant with 1 x 128 blocks; npu_kv_quant_sparse_flash_attention
# reads 656-byte rows, tile_size 128).
LATENT_INT8_TILE = 128


def cache_fields(cfg: V3Config, kv_cache_dtype: str = "auto") -> dict[str, CacheField]:
    """What MLA caches per token and layer: the normalized latent and the rotated shared key side by side in one
    row (as vLLM's MLA cache keeps them: one gather per decode read), and V3.2's indexer keys.

    Under --kv-cache-dtype int8 the latent is INT8 with a float32 scale per token and 128 values (one per token
    when kv_lora_rank is not a multiple of 128), the indexer keys INT8 with one scale per token (as DeepSeek's
    FP8 indexer cache and CANN's A8C8 keep them), and the rope key stays in the compute dtype. DeepSeek's FP8
    MLA cache and CANN's C8 cache keep it unquantized the same way: it carries the position, its dot product
    with q_pe decides much of the attention weight, and at 64 of 576 values it is a small share of the bytes.
    The latent only meets the queries through W_UK / W_UV, which spread its rounding over every head."""
    if kv_cache_dtype != "int8":
        fields = {"c_kv_k_pe": CacheField(cfg.kv_lora_rank + cfg.qk_rope_head_dim)}
        if cfg.has_indexer:
            fields["index_k"] = CacheField(cfg.index_head_dim)
        return fields
    tile = LATENT_INT8_TILE if cfg.kv_lora_rank % LATENT_INT8_TILE == 0 else 0
    fields = {"c_kv_k_pe": CacheField(cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, tile)}
    if cfg.has_indexer:
        fields["index_k"] = CacheField(cfg.index_head_dim, cfg.index_head_dim)
    return fields


CACHE_COMPONENTS = {"c_kv_k_pe": "MLA latent + rope key", "index_k": "indexer keys"}


# KV cache per rank and sequence, main decoder layers only. MLA keeps one latent per token shared by all heads,
# so attention TP does not split it.
def kv_cache_bytes_per_token(cfg: V3Config, itemsize: int, kv_cache_dtype: str = "auto") -> dict[str, float]:
    return {CACHE_COMPONENTS[name]: cfg.num_hidden_layers * field.nbytes(itemsize)
            for name, field in cache_fields(cfg, kv_cache_dtype).items()}


def kv_cache_bytes_per_sequence(cfg: V3Config, itemsize: int, kv_cache_dtype: str = "auto") -> dict[str, int]:
    return {}  # everything MLA caches grows with the sequence


def hub_name(name: str) -> str:
    return name  # transformers saves V3 / V3.2 under the hub's names (its MTP layers it does not save at all)


def ascend_mtp_copies(cfg: V3Config) -> dict[str, str]:
    return {}  # the hub's V3 MTP layers ship their own embed_tokens and shared_head.head


for _model_type in ARCHITECTURES:
    register(Family(name=_model_type, parse_config=parse_config, inventory=inventory, hub_name=hub_name,
                    hub_config=hub_config, ascend_mtp_copies=ascend_mtp_copies,
                    scale_suffix="weight_scale_inv", scale_is_e8m0=False,
                    recipes=(RECIPE, RECIPE_INDEXER) if _model_type == V32 else (RECIPE,),
                    fused=FUSED_PAIRS + (MLA_FUSED,), attention_tp=ATTENTION_TP, check_attention_tp=None,
                    kv_cache_bytes_per_token=kv_cache_bytes_per_token,
                    kv_cache_bytes_per_sequence=kv_cache_bytes_per_sequence,
                    tiny_config=functools.partial(tiny_config, _model_type),
                    encode_chat=encode_v32 if _model_type == V32 else render_template,
                    tool_dialect=dsml.V32 if _model_type == V32 else None))
