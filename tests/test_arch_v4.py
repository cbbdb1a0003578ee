"""deepseek_v4 config parsing and inventory, checked against facts of the real hub checkpoint."""

import json
import math
from pathlib import Path

import pytest

from dsconv.family.arch import ArchError, Encoding, Role
from dsconv.family.deepseek_v4 import AttnType, MlpType, inventory, parse_config, tiny_config

REAL_CONFIG = Path(__file__).parent / "data" / "deepseek_v4_flash.config.json"  # hub config.json, verbatim

# deepseek-ai/DeepSeek-V4-Flash model.safetensors.index.json: tensor count and metadata.total_size
REAL_TENSOR_COUNT = 69187
REAL_TOTAL_BYTES = 159_609_485_896
FP8_BLOCK = 128
FP4_BLOCK = 32
STORED_BYTES = {Encoding.FP8: 1, Encoding.FP4: 0.5, Encoding.BF16: 2, Encoding.F32: 4, Encoding.I64: 8}


def _stored(spec) -> tuple[int, float]:
    """(tensors, bytes) the hub stores for one spec, its scale included."""
    out, numel = spec.shape[0], math.prod(spec.shape)
    if spec.encoding is Encoding.FP8:
        scales = math.ceil(out / FP8_BLOCK) * math.ceil(spec.shape[1] / FP8_BLOCK)
        return 2, numel + scales
    if spec.encoding is Encoding.FP4:
        return 2, numel / 2 + out * spec.shape[1] // FP4_BLOCK
    return 1, numel * STORED_BYTES[spec.encoding]


def test_real_config_inventory_matches_the_hub_index():
    cfg = parse_config(json.loads(REAL_CONFIG.read_text()))
    specs = list(inventory(cfg))
    tensors, nbytes = map(sum, zip(*(_stored(spec) for spec in specs)))
    assert (tensors, nbytes) == (REAL_TENSOR_COUNT, REAL_TOTAL_BYTES)

    def layers_with(suffix: str) -> set[int]:
        return {spec.layer for spec in specs if spec.name.endswith(suffix) and not spec.mtp}

    # The index lists tid2eid on layers 0-2 only, a compressor on every layer but 0-1, an indexer on CSA layers
    assert layers_with("gate.tid2eid") == {0, 1, 2}
    assert layers_with("attn.compressor.ape") == set(range(2, 43))
    assert layers_with("attn.indexer.wq_b.weight") == set(range(2, 43, 2))
    assert {s.name for s in specs if s.mtp and s.role is Role.ROUTER_BIAS} == {"mtp.0.ffn.gate.bias"}
    assert len(set(s.name for s in specs)) == len(specs)


def test_transformers_spellings_parse_like_the_hub_ones():
    hub = tiny_config()
    parsed = parse_config(hub)
    attn = [kind.value for kind in parsed.attn_types + parsed.mtp_attn_types]
    alt = {k: v for k, v in hub.items() if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim")}
    alt.pop("rope_scaling")
    alt.pop("expert_dtype")
    alt.update(
        layer_types=attn,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 3,
        partial_rotary_factor=hub["qk_rope_head_dim"] / hub["head_dim"],
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000},
            "compress": {**hub["rope_scaling"], "rope_type": "yarn", "rope_theta": 160000},
        },
        quantization_config={**hub["quantization_config"], "expert_dtype": "fp4"},
    )
    assert parse_config(alt) == parsed


def test_transformers_config_round_trip():
    transformers = pytest.importorskip("transformers")
    without_mtp = tiny_config(num_nextn_predict_layers=0, compress_ratios=[0, 0, 4, 128, 4])
    cfg = parse_config(transformers.DeepseekV4Config(**without_mtp).to_dict())
    assert cfg == parse_config(without_mtp)
    assert cfg.attn_types == (AttnType.SLIDING,) * 2 + (AttnType.CSA, AttnType.HCA, AttnType.CSA)
    assert cfg.mlp_types == (MlpType.HASH,) * 2 + (MlpType.MOE,) * 3
    # transformers keeps no attention type for MTP layers and saves no MTP tensors: its form has no MTP layers
    assert parse_config(transformers.DeepseekV4Config(**tiny_config()).to_dict()) == parse_config(without_mtp)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"o_groups": 3}, "o_groups=3 does not divide num_attention_heads=4"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"compress_ratios": [0, 0, 4, -16, 4, 0]}, r"compress_ratios\[3\]=-16"),
        ({"compress_rates": {"compressed_sparse_attention": 8}}, "compressed_sparse_attention rate 8 is not 4"),
        ({"compress_ratios": [0, 0, 4, 128, 4]}, "compress_ratios has 5 entries"),
        ({"compress_rate_hca": 64}, r"compress_ratios\[3\]=128 contradicts heavily_compressed_attention rate 64"),
        ({"num_hash_layers": 6}, "num_hash_layers=6"),
        ({"num_experts_per_tok": 17}, "num_experts_per_tok=17"),
        ({"qk_rope_head_dim": 96}, "qk_rope_head_dim=96 exceeds index_head_dim=64"),
        ({"expert_dtype": "fp6"}, "expert_dtype='fp6'"),
        ({"scoring_func": "relu"}, "scoring_func='relu'"),
        ({"moe_intermediate_size": 48}, "moe_intermediate_size=48 is not a multiple of the FP4 block 32"),
        ({"model_type": "deepseek_v3"}, "model_type='deepseek_v3'"),
    ],
)
def test_invalid_configs_name_the_value(override, message):
    with pytest.raises(ArchError, match=message):
        tiny_config(**override)


def test_missing_key_is_named():
    raw = tiny_config()
    del raw["num_hash_layers"]
    with pytest.raises(ArchError, match="'num_hash_layers'"):
        parse_config(raw)


def test_unquantized_config_lists_bf16_linears():
    raw = tiny_config()
    del raw["quantization_config"]
    encodings = {spec.encoding for spec in inventory(parse_config(raw))}
    assert encodings == {Encoding.BF16, Encoding.F32, Encoding.I64}
