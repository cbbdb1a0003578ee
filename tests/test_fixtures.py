"""The tiny V3 / V3.2 checkpoints are what the hub would ship: transformers loads them, FP8 and BF16 agree.

The reference is transformers 5.23 itself (its FP8 block dequantization and its forward), independent of
this project's decoders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsconv.family.arch import ArchError, Encoding, family_for
from dsconv.family.deepseek_v3 import parse_config, tiny_config
from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint

V3_FAMILIES = ("deepseek_v3", "deepseek_v32")
BLOCK = 128
FP8_MAX = 448.0
PROMPT_LEN = 24  # longer than the tiny V3.2 index_topk, so the indexer really drops tokens
SCALE_SUFFIX = ".weight_scale_inv"


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def _headers(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (dtype name, shape, file) over every safetensors file in the directory."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (s.get_dtype(), tuple(s.get_shape()), file.name)
    return out


def _tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(path / _index(path)["weight_map"][name], framework="pt") as f:
        return f.get_tensor(name)


def _prompt(vocab_size: int) -> torch.Tensor:
    # BOS then a fixed spread of ids, so positions see different tokens
    return torch.tensor([[0] + [(17 * i + 5) % vocab_size for i in range(1, PROMPT_LEN)]])


def _load(path: Path, encoding: str):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    extra = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if encoding == "fp8" else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True, **extra)


@pytest.mark.parametrize("family", V3_FAMILIES)
def test_transformers_loads_fp8_and_bf16_to_identical_logits(family, tiny_source):
    logits = {}
    for encoding in ("fp8", "bf16"):
        path = tiny_source(family, encoding)
        config = _config(path)
        model, info = _load(path, encoding)
        assert not info["missing_keys"], info["missing_keys"]
        assert not info["mismatched_keys"], info["mismatched_keys"]
        assert not info["error_msgs"], info["error_msgs"]
        # transformers has no MTP module: the MTP layers, and only they, come back unexpected
        mtp = range(config["num_hidden_layers"], config["num_hidden_layers"] + config["num_nextn_predict_layers"])
        ignored_layers = {int(k.split(".")[2]) for k in info["unexpected_keys"] if k.startswith("model.layers.")}
        assert all(k.startswith("model.layers.") for k in info["unexpected_keys"]), info["unexpected_keys"]
        assert ignored_layers == set(mtp)
        if family == "deepseek_v32":
            assert PROMPT_LEN > config["index_topk"]
        with torch.no_grad():
            logits[encoding] = model(_prompt(config["vocab_size"])).logits[0].float()

    fp8, bf16 = logits["fp8"], logits["bf16"]
    assert torch.isfinite(fp8).all()
    assert fp8.std() > 0.1 and fp8.argmax(-1).unique().numel() > 1  # not a constant or collapsed output
    # Exactly equal, not close: transformers dequantizes q * s in float32, which is exact because the
    # fixture's scales keep 16 significant bits, and rounds once to bf16, which is what the BF16 fixture
    # stores. Same parameters bit for bit, same CPU kernels, same logits.
    assert torch.equal(fp8, bf16)


@pytest.mark.parametrize("encoding", ("fp8", "bf16"))
@pytest.mark.parametrize("family", V3_FAMILIES)
def test_inventory_matches_written_checkpoint(family, encoding, tiny_source):
    path = tiny_source(family, encoding)
    config = _config(path)
    fam = family_for(config)
    assert fam.name == family
    specs = {s.name: s for s in fam.inventory(fam.parse_config(config))}
    headers = _headers(path)
    scales = {n for n in headers if n.endswith(SCALE_SUFFIX)}
    assert set(headers) - scales == set(specs)

    for name, spec in specs.items():
        dtype, shape, _ = headers[name]
        assert shape == spec.shape, name
        scale = name.removesuffix(".weight") + SCALE_SUFFIX
        if spec.encoding == Encoding.FP8:
            assert dtype == "F8_E4M3", name
            assert headers[scale][:2] == ("F32", tuple(math.ceil(d / BLOCK) for d in spec.shape)), name
        else:
            assert dtype == {Encoding.BF16: "BF16", Encoding.F32: "F32"}[spec.encoding], name
            assert scale not in headers, name
    if encoding == "bf16":
        assert "quantization_config" not in config and not scales
    else:
        assert config["quantization_config"]["weight_block_size"] == [BLOCK, BLOCK]
        # every linear of a decoder layer ships FP8, as on the hub
        kinds = {s.name.split(".")[-2] for s in specs.values() if s.encoding == Encoding.FP8}
        assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj"} <= kinds
        assert (family == "deepseek_v32") == ({"wq_b", "wk"} <= kinds)
        assert not {"eh_proj", "head", "weights_proj", "gate"} & kinds
    assert all(s.mtp == (s.layer is not None and s.layer >= config["num_hidden_layers"]) for s in specs.values())


@pytest.mark.parametrize("family", V3_FAMILIES)
def test_index_maps_every_tensor_and_splits_a_weight_from_its_scale(family, tiny_source):
    path = tiny_source(family, "fp8")
    index = _index(path)
    headers = _headers(path)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) >= 2 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert index["weight_map"] == {name: file for name, (_, _, file) in headers.items()}
    with_data = {name: _tensor(path, name).nbytes for name in index["weight_map"]}
    assert index["metadata"]["total_size"] == sum(with_data.values())
    split = [n for n in index["weight_map"] if n.endswith(SCALE_SUFFIX)
             and index["weight_map"][n] != index["weight_map"][n.removesuffix(SCALE_SUFFIX) + ".weight"]]
    assert split


def test_max_file_bytes_caps_every_file(tmp_path):
    cap = 2 << 20
    path = make_tiny_checkpoint(tmp_path / "capped", "deepseek_v3", max_file_bytes=cap)
    sizes: dict[str, int] = {}
    for name, file in _index(path)["weight_map"].items():
        sizes[file] = sizes.get(file, 0) + _tensor(path, name).nbytes
    assert len(sizes) > 3 and max(sizes.values()) <= cap


def test_same_arguments_give_identical_bytes(tmp_path, tiny_source):
    first = tiny_source("deepseek_v32", "fp8")
    second = make_tiny_checkpoint(tmp_path / "again", "deepseek_v32", encoding="fp8")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other_seed = make_tiny_checkpoint(tmp_path / "seed1", "deepseek_v32", encoding="fp8", seed=1)
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    assert not torch.equal(_tensor(first, name).view(torch.uint8), _tensor(other_seed, name).view(torch.uint8))


@pytest.mark.parametrize("family", V3_FAMILIES)
def test_partial_block_decodes_by_the_block_formula(family, tiny_source):
    fp8 = tiny_source(family, "fp8", partial_block=True)
    bf16 = tiny_source(family, "bf16", partial_block=True)
    partial = [n for n in _index(fp8)["weight_map"]
               if n.endswith(".weight") and n + "_scale_inv" in _index(fp8)["weight_map"]
               and _tensor(fp8, n).shape[0] % BLOCK]
    assert any("kv_a_proj_with_mqa" in n for n in partial)
    for name in partial:
        q = _tensor(fp8, name).to(torch.float64)
        s = _tensor(fp8, name + "_scale_inv").to(torch.float64)
        rows = torch.arange(q.shape[0])[:, None] // BLOCK
        cols = torch.arange(q.shape[1])[None, :] // BLOCK
        reference = q * s[rows, cols]  # W[i, j] = q[i, j] * s[i // 128, j // 128]
        assert torch.equal(_tensor(bf16, name), reference.to(torch.bfloat16)), name
        # the scales are each block's amax / 448, the last, 64-row block included
        for r in range(s.shape[0]):
            for c in range(s.shape[1]):
                block = reference[r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK]
                assert block.abs().max() == FP8_MAX * s[r, c], (name, r, c)


def test_parse_config_names_what_is_wrong():
    config = tiny_config("deepseek_v3")
    assert parse_config({**config, "some_future_key": 1}).hidden_size == config["hidden_size"]
    missing = {k: v for k, v in config.items() if k != "kv_lora_rank"}
    with pytest.raises(ArchError, match="kv_lora_rank"):
        parse_config(missing)
    with pytest.raises(ArchError, match="q_lora_rank=None"):
        parse_config({**config, "q_lora_rank": None})
    with pytest.raises(ArchError, match="index_topk"):
        parse_config({k: v for k, v in tiny_config("deepseek_v32").items() if k != "index_topk"})
    with pytest.raises(ArchError, match="n_routed_experts=10"):
        parse_config({**config, "n_routed_experts": 10})


def test_build_once_with_two_builders_at_once(tmp_path):
    """Two processes building the same cached checkpoint at once (two test runs on one empty cache) each finish
    their own copy; one is renamed into place, the other dropped, and no scratch directory is left."""
    import threading

    from dsconv.convert.demo import build_once

    both_building = threading.Barrier(2)
    final = tmp_path / "cache" / "demo"

    def build(out: Path) -> None:
        out.mkdir()
        both_building.wait(timeout=60)  # neither renames before the other has started
        (out / "weights").write_text(threading.current_thread().name)

    results = {}
    threads = [threading.Thread(target=lambda name=name: results.update({name: build_once(final, build)}), name=name)
               for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {"a": final, "b": final}
    assert (final / "weights").read_text() in ("a", "b")
    assert sorted(path.name for path in final.parent.iterdir()) == ["demo"]
