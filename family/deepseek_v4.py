"""DeepSeek-V4 (Flash): config.json parsing and the exact tensor inventory of the hub checkpoint.

Hub facts this module encodes (deepseek-ai/DeepSeek-V4-Flash `config.json`, `model.safetensors.index.json`
and shard headers; DeepSeek's V4 inference `model.py`; transformers 5.23 `deepseek_v4`):
- `compress_ratios` has one entry per decoder layer plus one per MTP layer: 0 = sliding window only,
  4 = CSA (overlapping compressor + lightning indexer), any other ratio (the hub ships 128) = HCA (plain
  compressor, no indexer).
- The first `num_hash_layers` layers route by `ffn.gate.tid2eid[token]` (int64) and carry no `gate.bias`;
  MTP layers are never hash-routed.
- Linears ship FP8 with an e8m0 `.scale`; norms, the router, compressor projections, the indexer's
  `weights_proj`, `embed` and `head` ship BF16; sinks, `ape`, the router bias and all `hc_*` ship F32;
  routed experts ship FP4 when `expert_dtype` is "fp4" (top level, or inside `quantization_config`).
  A config without `quantization_config` describes a BF16 checkpoint: its linears are then BF16 too.
- For the real config the inventory reproduces the hub index exactly: 69,187 tensors (scales included) and
  159,609,485,896 bytes (tests/test_arch_v4.py).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Iterator

from dsconv.family.arch import ArchError, CacheField, Encoding, Family, Role, TensorSpec, register
from dsconv.family.deepseek_v4_config import AttnType, MlpType, V4Config, attn_type_of, hub_config, parse_config
from dsconv.family.recipes import EXPERTS, FUSED_PAIRS, Recipe
from dsconv.family import dsml
from dsconv.family.text import encode_v4

__all__ = ["AttnType", "MlpType", "V4Config", "attn_type_of", "parse_config", "inventory", "tiny_config", "FAMILY"]

HC_SCALE_PARTS = 3  # pre, post and comb mixes each have one learned scale
HC_HEAD_SCALE_PARTS = 1  # the final collapse has only a "pre" mix


def _fp8(cfg: V4Config) -> Encoding:
    # Block-scaled FP8 when the checkpoint is quantized, else plain BF16 (e.g. after an FP8-to-BF16 cast)
    return Encoding.FP8 if cfg.quantized else Encoding.BF16


def _expert_encoding(cfg: V4Config) -> Encoding:
    if cfg.quantized and cfg.expert_dtype == "fp4":
        return Encoding.FP4
    return _fp8(cfg)


@dataclass(frozen=True)
class _Scope:
    prefix: str  # "layers.3" or "mtp.0"
    layer: int  # decoder index; MTP layers continue after the last decoder layer
    mtp: bool

    def spec(self, suffix: str, shape: tuple[int, ...], role: Role, encoding: Encoding,
             expert: int | None = None) -> TensorSpec:
        return TensorSpec(f"{self.prefix}.{suffix}", shape, role, encoding, self.layer, expert, self.mtp)


def _compressor(scope: _Scope, path: str, cfg: V4Config, ratio: int, head_dim: int,
                overlap: bool) -> Iterator[TensorSpec]:
    # CSA compressors emit two series (the current and the next window's share), HCA ones a single series.
    width = (2 if overlap else 1) * head_dim
    yield scope.spec(f"{path}.ape", (ratio, width), Role.COMPRESSOR_APE, Encoding.F32)
    yield scope.spec(f"{path}.wkv.weight", (width, cfg.hidden_size), Role.COMPRESSOR_KV, Encoding.BF16)
    yield scope.spec(f"{path}.wgate.weight", (width, cfg.hidden_size), Role.COMPRESSOR_GATE, Encoding.BF16)
    yield scope.spec(f"{path}.norm.weight", (head_dim,), Role.NORM, Encoding.BF16)


def _attention(scope: _Scope, cfg: V4Config, ratio: int) -> Iterator[TensorSpec]:
    fp8 = _fp8(cfg)
    heads_dim = cfg.num_attention_heads * cfg.head_dim
    o_dim = cfg.o_groups * cfg.o_lora_rank
    yield scope.spec("attn.attn_sink", (cfg.num_attention_heads,), Role.ATTN_SINK, Encoding.F32)
    yield scope.spec("attn.wq_a.weight", (cfg.q_lora_rank, cfg.hidden_size), Role.ATTN_Q_A, fp8)
    yield scope.spec("attn.q_norm.weight", (cfg.q_lora_rank,), Role.NORM, Encoding.BF16)
    yield scope.spec("attn.wq_b.weight", (heads_dim, cfg.q_lora_rank), Role.ATTN_Q_B, fp8)
    # One shared K=V head
    yield scope.spec("attn.wkv.weight", (cfg.head_dim, cfg.hidden_size), Role.ATTN_KV, fp8)
    yield scope.spec("attn.kv_norm.weight", (cfg.head_dim,), Role.NORM, Encoding.BF16)
    # Grouped output projection: each of o_groups head groups goes to its own o_lora_rank slice
    yield scope.spec("attn.wo_a.weight", (o_dim, heads_dim // cfg.o_groups), Role.ATTN_O_A, fp8)
    yield scope.spec("attn.wo_b.weight", (cfg.hidden_size, o_dim), Role.ATTN_O_B, fp8)
    attn_type = attn_type_of(ratio)
    if attn_type is AttnType.SLIDING:
        return
    overlap = attn_type is AttnType.CSA
    yield from _compressor(scope, "attn.compressor", cfg, ratio, cfg.head_dim, overlap)
    if attn_type is AttnType.CSA:
        index_dim = cfg.index_n_heads * cfg.index_head_dim
        yield scope.spec("attn.indexer.wq_b.weight", (index_dim, cfg.q_lora_rank), Role.INDEXER_Q_B, fp8)
        yield scope.spec(
            "attn.indexer.weights_proj.weight", (cfg.index_n_heads, cfg.hidden_size), Role.INDEXER_WEIGHTS,
            Encoding.BF16,
        )
        yield from _compressor(scope, "attn.indexer.compressor", cfg, ratio, cfg.index_head_dim, overlap)


def _moe(scope: _Scope, cfg: V4Config, mlp_type: MlpType) -> Iterator[TensorSpec]:
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    yield scope.spec("ffn.gate.weight", (cfg.n_routed_experts, hidden), Role.ROUTER, Encoding.BF16)
    if mlp_type is MlpType.HASH:
        table = (cfg.vocab_size, cfg.num_experts_per_tok)
        yield scope.spec("ffn.gate.tid2eid", table, Role.ROUTER_TID2EID, Encoding.I64)
    else:
        yield scope.spec("ffn.gate.bias", (cfg.n_routed_experts,), Role.ROUTER_BIAS, Encoding.F32)
    expert_encoding = _expert_encoding(cfg)
    for expert in range(cfg.n_routed_experts):
        path = f"ffn.experts.{expert}"
        yield scope.spec(f"{path}.w1.weight", (inter, hidden), Role.EXPERT_W1, expert_encoding, expert)
        yield scope.spec(f"{path}.w2.weight", (hidden, inter), Role.EXPERT_W2, expert_encoding, expert)
        yield scope.spec(f"{path}.w3.weight", (inter, hidden), Role.EXPERT_W3, expert_encoding, expert)
    shared_inter = inter * cfg.n_shared_experts
    fp8 = _fp8(cfg)
    yield scope.spec("ffn.shared_experts.w1.weight", (shared_inter, hidden), Role.SHARED_W1, fp8)
    yield scope.spec("ffn.shared_experts.w2.weight", (hidden, shared_inter), Role.SHARED_W2, fp8)
    yield scope.spec("ffn.shared_experts.w3.weight", (shared_inter, hidden), Role.SHARED_W3, fp8)


def _hyper_connection(scope: _Scope, cfg: V4Config, name: str) -> Iterator[TensorSpec]:
    streams = cfg.hc_mult
    mixes = (2 + streams) * streams  # pre [m] + post [m] + comb [m, m]
    yield scope.spec(f"{name}_fn", (mixes, streams * cfg.hidden_size), Role.HC, Encoding.F32)
    yield scope.spec(f"{name}_base", (mixes,), Role.HC, Encoding.F32)
    yield scope.spec(f"{name}_scale", (HC_SCALE_PARTS,), Role.HC, Encoding.F32)


def _hc_head(cfg: V4Config, prefix: str, layer: int | None, mtp: bool) -> Iterator[TensorSpec]:
    streams = cfg.hc_mult
    shapes = {"fn": (streams, streams * cfg.hidden_size), "base": (streams,), "scale": (HC_HEAD_SCALE_PARTS,)}
    for part, shape in shapes.items():
        yield TensorSpec(f"{prefix}hc_head_{part}", shape, Role.HC, Encoding.F32, layer, None, mtp)


def _block(scope: _Scope, cfg: V4Config, ratio: int, mlp_type: MlpType) -> Iterator[TensorSpec]:
    yield scope.spec("attn_norm.weight", (cfg.hidden_size,), Role.NORM, Encoding.BF16)
    yield scope.spec("ffn_norm.weight", (cfg.hidden_size,), Role.NORM, Encoding.BF16)
    yield from _hyper_connection(scope, cfg, "hc_attn")
    yield from _hyper_connection(scope, cfg, "hc_ffn")
    yield from _attention(scope, cfg, ratio)
    yield from _moe(scope, cfg, mlp_type)


def _mtp_extras(scope: _Scope, cfg: V4Config) -> Iterator[TensorSpec]:
    hidden = cfg.hidden_size
    fp8 = _fp8(cfg)
    # The MTP layer mixes the next token's embedding (e) with the main model's last hidden state (h)
    yield scope.spec("e_proj.weight", (hidden, hidden), Role.MTP_PROJ, fp8)
    yield scope.spec("h_proj.weight", (hidden, hidden), Role.MTP_PROJ, fp8)
    for norm in ("enorm", "hnorm", "norm"):
        yield scope.spec(f"{norm}.weight", (hidden,), Role.NORM, Encoding.BF16)
    yield from _hc_head(cfg, f"{scope.prefix}.", scope.layer, True)


def inventory(cfg: V4Config) -> Iterator[TensorSpec]:
    if not isinstance(cfg, V4Config):
        raise ArchError(f"deepseek_v4 inventory needs a V4Config, got {type(cfg).__name__}")
    hidden = cfg.hidden_size
    yield TensorSpec("embed.weight", (cfg.vocab_size, hidden), Role.EMBED, Encoding.BF16)
    if not cfg.tie_word_embeddings:
        yield TensorSpec("head.weight", (cfg.vocab_size, hidden), Role.HEAD, Encoding.BF16)
    yield TensorSpec("norm.weight", (hidden,), Role.NORM, Encoding.BF16)
    yield from _hc_head(cfg, "", None, False)
    for layer, mlp_type in enumerate(cfg.mlp_types):
        yield from _block(_Scope(f"layers.{layer}", layer, False), cfg, cfg.compress_ratios[layer], mlp_type)
    for index in range(cfg.num_nextn_predict_layers):
        scope = _Scope(f"mtp.{index}", cfg.num_hidden_layers + index, True)
        yield from _block(scope, cfg, cfg.compress_ratios[scope.layer], MlpType.MOE)
        yield from _mtp_extras(scope, cfg)


# The config tiny_config() returns before its overrides, in the hub's spelling and key order
_TINY = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 256,
    "index_head_dim": 64,
    # enough heads that sum_h w_h relu(q_h . k) is rarely exactly 0 for several entries at once (as with
    # V4-Flash's 64): ties make the top-k choice implementation-defined, so references could disagree
    "index_n_heads": 16,
    "index_topk": 8,
    "initializer_range": 0.02,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 128,
    "n_routed_experts": 16,  # one per rank at 16-way expert parallelism
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 5,
    "num_hash_layers": 2,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 2,
    "o_lora_rank": 128,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 32,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    # YaRN on the compressed layers' rope; a small original length so it bends frequencies a test reaches
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 256,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 16,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 1024,
    "compress_rope_theta": 160000,
    # decoder layers: sliding, sliding, CSA, HCA, CSA; then the MTP layer (sliding), as the hub orders them
    "compress_ratios": [0, 0, 4, 128, 4, 0],
}


def tiny_config(partial_block: bool = False, **overrides) -> dict:
    """A small config.json in the hub's spelling, for fixtures and demos; `overrides` replace top-level keys.

    Every FP8 dimension is a multiple of the 128x128 scale block and every FP4 input dim of 32, so
    transformers' dequantization accepts the checkpoint. Layers 0-1 are hash-routed; the schedule holds all
    three attention types: a prompt of 400 tokens spans 25 sliding windows, 100 CSA windows and 3 HCA
    windows, and index_topk=8 makes the indexer drop most CSA entries.
    """
    if partial_block:
        # Every FP8 weight of V4-Flash fills whole 128x128 blocks; V3's kv_a_proj_with_mqa is the case to test
        raise ArchError("partial_block=True: deepseek_v4 ships no FP8 weight with a partial scale block")
    config = copy.deepcopy(_TINY)  # fresh lists and dicts: callers edit the config they get
    config.update(overrides)
    parse_config(config)  # an override that breaks the architecture fails here, naming the value
    return config


RECIPE = Recipe("v4", frozenset({Role.ATTN_Q_A, Role.ATTN_Q_B, Role.ATTN_KV, Role.INDEXER_Q_B} | EXPERTS),
                "wq_a, wq_b, wkv, indexer wq_b, routed + shared experts (msModelSlim's recipe without "
                "smoothing); wo_a/wo_b, compressors, indexer weights_proj, router, embed, head, hc_* stay BF16")

# Attention TP: query heads (wq_b rows, one sink per head) and whole output groups (wo_a rows per group, wo_b
# input columns) split together; the single KV head, compressors and indexer stay replicated.
ATTENTION_TP = {Role.ATTN_Q_B: 0, Role.ATTN_SINK: 0, Role.ATTN_O_A: 0, Role.ATTN_O_B: 1}


def check_attention_tp(cfg: V4Config, attn_tp: int) -> None:
    if cfg.o_groups % attn_tp:
        raise ArchError(f"o_groups={cfg.o_groups} is not divisible by attn-tp={attn_tp} (DeepSeek-V4 splits "
                        f"attention by whole output groups; use --attn-tp 1 to replicate attention)")


# KV cache per rank and sequence, main decoder layers only. V4 has one KV head, so attention TP does not split it.
# Each compressed layer keeps one entry per `ratio` tokens, its own ratio.
def cache_fields(cfg: V4Config, kv_cache_dtype: str = "auto") -> dict[str, CacheField]:
    """What V4 caches per entry (and per window row), every layer alike: `kv`, the one key = value row of the
    sliding window and of the compressed entries, and `index_k`, the indexer's compressed keys.

    Under --kv-cache-dtype int8 (C8) `kv` keeps its leading head_dim - qk_rope_head_dim values INT8 with one float32
    scale per row and its rotary tail (the last qk_rope_head_dim values, which carry the position) in the compute
    dtype, as V3.2's latent does; the indexer keys are INT8 with one scale per key (Hadamard-rotated first, as
    V3.2's A8C8 indexer keeps them)."""
    if kv_cache_dtype != "int8":
        return {"kv": CacheField(cfg.head_dim), "index_k": CacheField(cfg.index_head_dim)}
    return {"kv": CacheField(cfg.head_dim, cfg.head_dim - cfg.qk_rope_head_dim),
            "index_k": CacheField(cfg.index_head_dim, cfg.index_head_dim)}


def kv_cache_bytes_per_token(cfg: V4Config, itemsize: int, kv_cache_dtype: str = "auto") -> dict[str, float]:
    fields = cache_fields(cfg, kv_cache_dtype)
    kv, index_k = fields["kv"].nbytes(itemsize), fields["index_k"].nbytes(itemsize)
    csa, hca = _ratios_of(cfg, AttnType.CSA), _ratios_of(cfg, AttnType.HCA)
    return {
        "CSA compressed KV": sum(kv / ratio for ratio in csa),
        "CSA indexer keys": sum(index_k / ratio for ratio in csa),
        "HCA compressed KV": sum(kv / ratio for ratio in hca),
    }


CONTEXT_PARALLEL_REFUSAL = ("its compressed entries pool windows of 4 and 128 tokens and its sliding window reaches "
                            "back across any cut of the prompt, so each rank would need its neighbours' partial "
                            "windows and compressor state, which dsrun does not exchange; prefill V4 without it")


def kv_cache_bytes_per_sequence(cfg: V4Config, itemsize: int, kv_cache_dtype: str = "auto") -> dict[str, int]:
    csa, hca = _ratios_of(cfg, AttnType.CSA), _ratios_of(cfg, AttnType.HCA)
    state = sum(_compressor_state(r, cfg.head_dim, True, itemsize)
                + _compressor_state(cfg.csa_compress_rate, cfg.index_head_dim, True, itemsize) for r in csa)
    state += sum(_compressor_state(r, cfg.head_dim, False, itemsize) for r in hca)
    return {
        # Every layer keeps the last `sliding_window` K=V rows of its single KV head (INT8 under C8): a fixed
        # buffer, counted whole even for a sequence shorter than the window
        "sliding window": cfg.num_hidden_layers * cfg.sliding_window
        * cache_fields(cfg, kv_cache_dtype)["kv"].nbytes(itemsize),
        # the unfinished windows stay in the compute dtype (their gates float32) whatever the cache dtype
        "compressor state": state,
    }


GATE_ITEMSIZE = 4  # a compressor's gates are kept in float32 (its softmax runs in float32)


def _compressor_state(ratio: int, head_dim: int, overlap: bool, itemsize: int) -> int:
    """Bytes a compressor keeps between steps for one sequence, as dsrun's cache slot holds them: a whole window of
    projected rows and their gates (the row that completes a window joins it before the window is pooled), and
    for the overlapping (CSA) ones the previous window's first series with its gates."""
    width = (2 if overlap else 1) * head_dim  # CSA projects two series per token, HCA one
    carried = ratio * head_dim if overlap else 0
    return (ratio * width + carried) * (itemsize + GATE_ITEMSIZE)


def _ratios_of(cfg: V4Config, attn_type: AttnType) -> list[int]:
    return [r for r, kind in zip(cfg.compress_ratios, cfg.attn_types) if kind is attn_type]


# transformers' DeepseekV4ForCausalLM saves the hub's names under `model.` (all but `head.weight`), with its own
# names for these (found by saving a model built from tiny_config() and matching tensors by value)
_TRANSFORMERS_NAMES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^(layers\.\d+\.attn)\.norm\.(weight)$"), r"\1.kv_norm.\2"),
)


def hub_name(name: str) -> str:
    name = name.removeprefix("model.")
    for pattern, replacement in _TRANSFORMERS_NAMES:
        name = pattern.sub(replacement, name)
    return name


def ascend_mtp_copies(cfg: V4Config) -> dict[str, str]:
    """msModelSlim's V4 saver gives each MTP layer its own head and embedding (float copies of the main ones);
    vllm-ascend's deepseek_v4_mtp drafter loads `mtp.{i}.head.weight` as its head."""
    copies = {}
    for index in range(cfg.num_nextn_predict_layers):
        copies[f"mtp.{index}.head.weight"] = "head.weight"
        copies[f"mtp.{index}.emb.tok_emb.weight"] = "embed.weight"
    return copies


FAMILY = register(
    Family(
        name="deepseek_v4",
        parse_config=parse_config,
        inventory=inventory,
        hub_name=hub_name,
        hub_config=hub_config,
        ascend_mtp_copies=ascend_mtp_copies,
        scale_suffix="scale",
        scale_is_e8m0=True,
        recipes=(RECIPE,),
        fused=FUSED_PAIRS,  # a single wkv and no kv_a: nothing attention-side is fused
        attention_tp=ATTENTION_TP,
        check_attention_tp=check_attention_tp,
        kv_cache_bytes_per_token=kv_cache_bytes_per_token,
        kv_cache_bytes_per_sequence=kv_cache_bytes_per_sequence,
        tiny_config=tiny_config,
        encode_chat=encode_v4,
        context_parallel_refusal=CONTEXT_PARALLEL_REFUSAL,
        tool_dialect=dsml.V4,
    )
)
