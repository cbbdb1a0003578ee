"""`dsconv quantize` outputs, read back with other projects' loaders and checked against the source."""

import json

import pytest
import torch

from dsconv.convert.formats import ASCEND_FLOAT, ASCEND_INT8, DESCRIPTION_NAME
from dsconv.convert.quantize import build_plan
from tests.helpers import COSINE_MIN, FAMILIES, SMALL_FILES, cosine, quantize, read_all, source_reference


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("encoding", ["fp8", "bf16"])
def test_ascend_output_matches_source(tiny_source, tmp_path, family, encoding):
    src = tiny_source(family, encoding)
    result = quantize(src, tmp_path / "out")
    out = tmp_path / "out"
    tensors, index = read_all(out, "quant_model_weights.safetensors.index.json")
    assert len(result.plan.parts) >= 2
    assert all(name.startswith("quant_model_weights-") for name in set(index["weight_map"].values()))

    description = json.loads((out / DESCRIPTION_NAME).read_text())
    assert description.pop("model_quant_type") == ASCEND_INT8 and description.pop("version") == "1.0.0"
    for key in ("metadata", "group_size", "optional"):
        description.pop(key)
    assert set(description) == set(tensors), "the description must list every saved tensor, nothing else"

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert (out / "tokenizer.json").is_file()

    reference = source_reference(src)
    int8_weights = [n for n, t in tensors.items() if t.dtype == torch.int8]
    assert int8_weights, "the default recipe must quantize something"
    for name in int8_weights:
        base = name.removesuffix("weight")
        q, scale, offset = tensors[name], tensors[base + "weight_scale"], tensors[base + "weight_offset"]
        assert scale.shape == (q.shape[0], 1) and scale.dtype == torch.float32
        assert offset.shape == scale.shape and not offset.any()
        assert description[name] == description[base + "weight_scale"] == ASCEND_INT8
        assert cosine(q.float() * scale, reference[name]) >= COSINE_MIN, name
    # msModelSlim's per-MTP-layer copies (V4's head and embedding) hold their originals' values
    copies = result.plan.checkpoint.family.ascend_mtp_copies(result.plan.checkpoint.arch)
    for name, value in tensors.items():
        if value.dtype == torch.int8 or name.endswith(("weight_scale", "weight_offset")):
            continue
        assert description[name] == ASCEND_FLOAT
        expected = reference[copies.get(name, name)]
        if expected.dtype == torch.float32 and value.dtype == torch.bfloat16:
            expected = expected.to(torch.bfloat16)  # an FP8/FP4 tensor the recipe keeps float
        assert value.dtype == expected.dtype and torch.equal(value, expected), name
    mtp = [n for n in tensors if ".layers." in n and result.plan.checkpoint.family.name != "deepseek_v4"
           and int(n.split(".layers.")[1].split(".")[0]) >= result.plan.checkpoint.arch.num_hidden_layers]
    mtp += [n for n in tensors if n.startswith("mtp.")]
    assert mtp and all(description[n] == ASCEND_FLOAT for n in mtp), "MTP tensors are kept float and listed"


@pytest.mark.parametrize("family", FAMILIES)
def test_recipes_pick_the_documented_linears(tiny_source, family):
    plan = build_plan(tiny_source(family), None, "ascend", SMALL_FILES)
    int8 = {item.weight.spec.name for item in plan.items if item.action == "int8"}
    if family == "deepseek_v4":
        expect_int8 = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".ffn.experts.0.w1.weight",
                       ".ffn.shared_experts.w2.weight")
        expect_float = (".attn.wo_a.weight", ".attn.wo_b.weight", ".ffn.gate.weight")
        expect_float_top = ("embed.weight", "head.weight")
    else:
        expect_int8 = (".self_attn.q_b_proj.weight", ".self_attn.o_proj.weight", ".mlp.experts.0.gate_proj.weight",
                       ".mlp.shared_experts.down_proj.weight")
        expect_float = (".self_attn.kv_b_proj.weight", ".self_attn.q_a_proj.weight",
                        ".self_attn.kv_a_proj_with_mqa.weight", ".mlp.gate.weight")
        expect_float_top = ("model.embed_tokens.weight", "lm_head.weight")
    for suffix in expect_int8:
        assert any(n.endswith(suffix) for n in int8), suffix
    for suffix in expect_float:
        assert not any(n.endswith(suffix) for n in int8), suffix
    assert not int8 & set(expect_float_top)
    assert not any(item.weight.spec.mtp for item in plan.items if item.action == "int8")
    if family == "deepseek_v32":  # msModelSlim keeps the whole Lightning indexer float
        assert not any(".indexer." in n for n in int8)


# vllm-ascend's per-layer rule for msModelSlim's layout (vllm_ascend/quantization/modelslim_config.py, at
# vllm-ascend 182b75ea; quant_config.py before 2026-01): a linear built with quant_config reads
# quant_model_description.json at `prefix + ".weight"`; "FLOAT" makes it unquantized, "W8A8_DYNAMIC" an INT8
# AscendW8A8DynamicLinearMethod; a missing key raises KeyError; a packed layer (deepseek_v32's fused_qkv_a_proj =
# q_a_proj + kv_a_proj_with_mqa, gate_up_proj = gate_proj + up_proj) reads each shard's key and raises ValueError
# when they differ. vLLM's V3.2 Indexer (vllm/model_executor/models/deepseek_v2.py, used by vllm-ascend's
# patch_deepseek_v2.py) builds wq_b with quant_config and wk + weights_proj as one MergedColumnParallelLinear with
# quant_config=None: those two are always loaded as float weights.
VLLM_ASCEND_PACKED = {"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "gate_up_proj": ("gate_proj", "up_proj")}


def vllm_ascend_quant_type(description: dict, prefix: str) -> str:
    """What vllm-ascend makes of a linear built with quant_config, or the exception it raises."""
    parent, _, name = prefix.rpartition(".")
    shards = VLLM_ASCEND_PACKED.get(name, (name,))
    types = {description[f"{parent}.{shard}.weight"] for shard in shards}  # KeyError when missing, as there
    if len(types) != 1:
        raise ValueError(f"{prefix}: shards of a fused layer have different quant types {types}")
    return types.pop()


def test_v32_indexer_recipe_as_vllm_ascend_loads_it(tiny_source, tmp_path):
    quantize(tiny_source("deepseek_v32"), tmp_path / "out", recipe="v32-indexer")
    out = tmp_path / "out"
    description = json.loads((out / DESCRIPTION_NAME).read_text())
    tensors, _ = read_all(out, "quant_model_weights.safetensors.index.json")
    config = json.loads((out / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        attn = f"model.layers.{layer}.self_attn"
        expected = {f"{attn}.fused_qkv_a_proj": ASCEND_FLOAT, f"{attn}.q_b_proj": ASCEND_INT8,
                    f"{attn}.kv_b_proj": ASCEND_FLOAT, f"{attn}.o_proj": ASCEND_INT8,
                    f"{attn}.indexer.wq_b": ASCEND_INT8}
        for prefix, quant_type in expected.items():
            assert vllm_ascend_quant_type(description, prefix) == quant_type, prefix
        wq_b = f"{attn}.indexer.wq_b"
        assert tensors[f"{wq_b}.weight"].dtype == torch.int8
        assert tensors[f"{wq_b}.weight_scale"].shape == (tensors[f"{wq_b}.weight"].shape[0], 1)
        for float_only in ("wk", "weights_proj"):  # built with quant_config=None: must be float weights
            name = f"{attn}.indexer.{float_only}.weight"
            assert description[name] == ASCEND_FLOAT and tensors[name].dtype == torch.bfloat16
    # recipe v3 (msModelSlim's V3.2 recipes exclude *wq_b): the same key says FLOAT
    quantize(tiny_source("deepseek_v32"), tmp_path / "v3")
    v3 = json.loads((tmp_path / "v3" / DESCRIPTION_NAME).read_text())
    assert vllm_ascend_quant_type(v3, "model.layers.0.self_attn.indexer.wq_b") == ASCEND_FLOAT
