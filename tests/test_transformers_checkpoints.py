"""Checkpoints saved by transformers' own `save_pretrained` (its config keys and defaults, its tensor names, no MTP
tensors) go through quantize, shard and dsrun like the hub's; outputs are in the hub's form; msModelSlim's MTP
copies; any positive V4 compression ratio; a hub config whose MTP tensors are missing is refused."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from dsconv.family.deepseek_v4 import AttnType, parse_config as parse_v4
from dsconv.cli import app
from dsconv.convert.source import open_checkpoint
from tests.trained import transformers_config
from dsconv.errors import InputError
from dsconv.family.layout import Layout
from tests.helpers import NEW_TOKENS, PROMPTS, SMALL_FILES, quantize, read_all, run_ranks, shard

HEAVY_RATIO = 16  # a V4 ratio the hub does not ship: DeepSeek's code compresses it like 128 (no overlap, no indexer)


def save_with_transformers(src, out, config) -> None:
    """Our BF16 fixture's weights (not degenerate, fixed seed) in a transformers model, saved by transformers."""
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def transformers_tokens(directory, prompts, config=None) -> list[list[int]]:
    kwargs = {"config": config} if config is not None else {}
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return [reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]


@pytest.fixture(scope="module")
def saved(tiny_source, tmp_path_factory):
    """saved(family) -> (directory written by transformers' save_pretrained, transformers' greedy tokens)."""
    cache = {}

    def build(family: str):
        if family not in cache:
            src = tiny_source(family, "bf16")
            out = tmp_path_factory.mktemp(f"{family}-transformers") / "saved"
            save_with_transformers(src, out, transformers_config(family, json.loads((src / "config.json").read_text())))
            cache[family] = out, transformers_tokens(out, PROMPTS)
        return cache[family]

    return build


def test_transformers_saved_configs_are_in_transformers_form(saved):
    v32 = json.loads((saved("deepseek_v32")[0] / "config.json").read_text())
    assert "scoring_func" not in v32 and "topk_method" not in v32 and "rope_parameters" in v32
    v4, _ = saved("deepseek_v4")
    config = json.loads((v4 / "config.json").read_text())
    assert "compress_ratios" not in config and "num_hash_layers" not in config
    assert len(config["layer_types"]) == config["num_hidden_layers"] and config["num_nextn_predict_layers"] == 1
    names = {name for part in v4.glob("*.safetensors") for name in load_file(part)}
    assert "model.layers.0.attn.norm.weight" in names and not any(n.startswith(("mtp.", "model.mtp")) for n in names)


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_shards_of_a_transformers_checkpoint_generate_transformers_tokens(family, saved, tmp_path):
    directory, want = saved(family)
    shards = tmp_path / "w1"
    shard(directory, shards, Layout(1, 1, 1, 1))
    manifest = json.loads((shards / "manifest.json").read_text())
    assert not any(t["mtp"] for t in manifest["tensors"])
    assert run_ranks(shards, tmp_path, PROMPTS) == want


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_world_16_shards_of_a_transformers_checkpoint(family, saved, tmp_path):
    directory, want = saved(family)
    shards = tmp_path / "w16"
    shard(directory, shards, Layout(16, 16, 16, 1))
    assert run_ranks(shards, tmp_path, PROMPTS) == want


@pytest.mark.parametrize("fmt", ["ascend", "compressed-tensors"])
def test_v4_outputs_are_in_the_hub_form(saved, tmp_path, fmt):
    directory, _ = saved("deepseek_v4")
    out = tmp_path / "w8a8"
    result = CliRunner().invoke(app, ["quantize", str(directory), str(out), "--format", fmt, "--max-file-size",
                                      str(SMALL_FILES)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "no MTP tensors" in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["compress_ratios"] == [0, 0, 4, 128, 4] and config["num_hash_layers"] == 2
    assert config["num_nextn_predict_layers"] == 0 and config["qk_rope_head_dim"] == 32
    assert (config["rope_theta"], config["compress_rope_theta"]) == (10000, 160000)
    assert config["rope_scaling"] == {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                      "original_max_position_embeddings": 256, "type": "yarn"}
    assert not {"layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "dtype"} & set(config)
    index = next(out.glob("*.safetensors.index.json"))
    names = set(json.loads(index.read_text())["weight_map"])
    assert {"embed.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight", "layers.2.attn.wq_a.weight"} <= names
    assert not any(n.startswith("model.") or n.startswith("mtp.") for n in names)
    # The shards of the output carry the same hub names and config
    shards = tmp_path / "s"
    shard(out, shards, Layout(1, 1, 1, 1))
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["model"]["config"]["compress_ratios"] == config["compress_ratios"]
    assert json.loads((shards / "config.json").read_text())["num_hash_layers"] == 2


def test_v32_output_config_has_the_hub_routing_and_rope_keys(saved, tmp_path):
    directory, _ = saved("deepseek_v32")
    out = tmp_path / "w8a8"
    quantize(directory, out)
    config = json.loads((out / "config.json").read_text())
    assert (config["scoring_func"], config["topk_method"], config["num_nextn_predict_layers"]) == \
        ("sigmoid", "noaux_tc", 0)
    assert config["rope_theta"] == 10000 and config["rope_scaling"]["type"] == "yarn"
    assert "rope_parameters" not in config


def test_ascend_output_holds_msmodelslim_mtp_copies(w8a8_source):
    out = w8a8_source("deepseek_v4")
    tensors, _ = read_all(out, "quant_model_weights.safetensors.index.json")
    assert torch.equal(tensors["mtp.0.head.weight"], tensors["head.weight"])
    assert torch.equal(tensors["mtp.0.emb.tok_emb.weight"], tensors["embed.weight"])
    assert tensors["mtp.0.head.weight"].dtype == torch.bfloat16
    description = json.loads((out / "quant_model_description.json").read_text())
    assert description["mtp.0.head.weight"] == description["mtp.0.emb.tok_emb.weight"] == "FLOAT"
    # Read back (as `dsconv shard` does), the copies are checked and left out
    assert not {"mtp.0.head.weight", "mtp.0.emb.tok_emb.weight"} & {w.spec.name for w in open_checkpoint(out).weights}


def test_compressed_tensors_output_holds_no_mtp_copies(tiny_source, tmp_path):
    out = tmp_path / "ct"
    quantize(tiny_source("deepseek_v4"), out, fmt="compressed-tensors")
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "mtp.0.ffn.gate.bias" in names and "mtp.0.head.weight" not in names


def test_any_positive_compression_ratio_equals_transformers(tiny_source, tmp_path):
    """A heavy ratio of 16: transformers takes it as the HCA rate (its configs hold one rate per layer type)."""
    ratios = [0, 0, 4, HEAVY_RATIO, 4, 0]
    src = tiny_source("deepseek_v4", "bf16", config_overrides={"compress_ratios": ratios})
    raw = json.loads((src / "config.json").read_text())
    cfg = parse_v4(raw)
    assert cfg.attn_types[3] is AttnType.HCA and cfg.hca_compress_rate == HEAVY_RATIO
    theirs = {k: v for k, v in raw.items() if k != "compress_ratios"}
    theirs.update(layer_types=[kind.value for kind in cfg.attn_types],
                  compress_rates={AttnType.CSA.value: 4, AttnType.HCA.value: HEAVY_RATIO})
    prompts = [PROMPTS[1], PROMPTS[1][:HEAVY_RATIO * 2 + 3]]  # complete windows of 16 before decoding
    want = transformers_tokens(src, prompts, config=transformers_config("deepseek_v4", theirs))
    shards = tmp_path / "s"
    shard(src, shards, Layout(1, 1, 1, 1))
    assert run_ranks(shards, tmp_path, prompts) == want


def test_layers_with_different_heavy_ratios_parse_and_size():
    from dsconv.family.deepseek_v4 import FAMILY, inventory, tiny_config

    cfg = parse_v4(tiny_config(compress_ratios=[0, 8, 4, 128, 4, 0]))
    assert cfg.attn_types == (AttnType.SLIDING, AttnType.HCA, AttnType.CSA, AttnType.HCA, AttnType.CSA)
    assert cfg.hca_compress_rate is None
    apes = {s.name: s.shape for s in inventory(cfg) if s.name.endswith("attn.compressor.ape")}
    assert apes["layers.1.attn.compressor.ape"] == (8, cfg.head_dim)
    assert apes["layers.3.attn.compressor.ape"] == (128, cfg.head_dim)
    per_token = FAMILY.kv_cache_bytes_per_token(cfg, 2)
    assert per_token["HCA compressed KV"] == cfg.head_dim * 2 / 8 + cfg.head_dim * 2 / 128


def test_missing_mtp_tensors_of_a_hub_config_are_refused(copy_source):
    src = copy_source("deepseek_v4", "bf16")
    tensors = {}
    for part in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(part))
        part.unlink()
    (src / "model.safetensors.index.json").unlink()
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, src / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(InputError) as error:
        open_checkpoint(src)
    message = str(error.value)
    assert "\n" not in message and "lacks tensor mtp.0." in message and "num_nextn_predict_layers" in message
