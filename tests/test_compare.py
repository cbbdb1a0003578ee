"""`dsrun compare` (runner/entrypoints/compare.py): our forward on shards against transformers' forward of the
source checkpoint, one layer at a time. BF16 shards of an FP8 source agree to float32 rounding at world 1 and 16;
W8A8 shards of the trained models stay above 0.999 at every layer; a reference with one layer changed is named as
the first layer below the bound (exit 1); bad input is one line (exit 2)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsconv.family.layout import Layout
from tests.helpers import assert_one_line_error, shard

pytestmark = pytest.mark.slow  # ranks and a reference model per call

BF16_MIN_COSINE = 0.99999  # BF16 shards of an FP8 source hold its values exactly (power-of-two scales)
W8A8_MIN_COSINE = 0.999
PROMPT = "def area(r):\n    return 3.14159 * r * r  # the area of a circle of radius r, as the Forbidden City's"


def dsrun_compare(shards, reference, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dsconv.runner.cli", "compare", "--shards", str(shards),
                           "--reference", str(reference), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def report_of(result) -> dict:
    assert result.returncode in (0, 1), result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family,layout", [
    ("deepseek_v32", Layout(1, 1, 1, 1)),
    ("deepseek_v32", Layout(16, 16, 16, 8)),  # attention DP2 x TP8
    ("deepseek_v4", Layout(16, 16, 16, 1)),
], ids=["v32-w1", "v32-dp2tp8", "v4-w16"])
def test_bf16_shards_equal_the_fp8_source_layer_by_layer(family, layout, tiny_source, tmp_path):
    source = tiny_source(family, "fp8", real_vocab=True)
    shard(source, tmp_path / "shards", layout)
    result = dsrun_compare(tmp_path / "shards", source, "--prompt", PROMPT, "--json")
    report = report_of(result)
    assert result.returncode == 0 and report["first_below"] is None
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    assert [row["layer"] for row in report["layers"]] == list(range(layers))
    assert min(row["cosine"] for row in report["layers"]) >= BF16_MIN_COSINE, report
    assert report["logits_cosine"] >= BF16_MIN_COSINE and report["top1_agreement"] == 1.0, report
    assert report["tokens"] > 20


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_w8a8_shards_of_the_trained_models_hold_every_layer(family, trained_source, trained_shards):
    _, w8a8 = trained_shards(family)
    result = dsrun_compare(w8a8, trained_source(family), "--prompt", PROMPT, "--prompt",
                           "import os\nfor name in sorted(os.listdir(path)):\n    print(name)", "--json")
    report = report_of(result)
    cosines = ", ".join(f"{row['cosine']:.6f}" for row in report["layers"])
    print(f"{family} W8A8 vs FP8 source: layer cosines {cosines}; logits {report['logits_cosine']:.6f}, "
          f"top-1 {report['top1_agreement']:.4f} over {report['tokens']} tokens")
    assert result.returncode == 0 and report["first_below"] is None
    assert min(row["cosine"] for row in report["layers"]) >= W8A8_MIN_COSINE


def scaled_copy(source, destination, layer: int, factor: float):
    """A copy of `source` with one float tensor of layer `layer` (its post-attention norm) scaled."""
    shutil.copytree(source, destination)
    index = json.loads((destination / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in index if n.startswith(f"model.layers.{layer}.") and "post_attention_layernorm" in n)
    path = destination / index[name]
    tensors = load_file(path)
    tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_changed_layer_is_the_first_below(tiny_source, tmp_path):
    source = tiny_source("deepseek_v32", "fp8", real_vocab=True)
    shard(source, tmp_path / "shards", Layout(1, 1, 1, 1))
    scaled_copy(source, tmp_path / "changed", layer=1, factor=1.5)
    result = dsrun_compare(tmp_path / "shards", tmp_path / "changed", "--json")
    report = report_of(result)
    assert result.returncode == 1 and report["first_below"] == 1, report
    assert report["layers"][0]["cosine"] >= BF16_MIN_COSINE  # the layer before it still agrees
    assert all(row["cosine"] < W8A8_MIN_COSINE for row in report["layers"][1:])


def cli_compare(shards, reference, *args):
    """`dsrun compare` in this process (bad input ends it before any rank starts)."""
    from typer.testing import CliRunner

    from dsconv.runner.cli import app

    return CliRunner().invoke(app, ["compare", "--shards", str(shards), "--reference", str(reference),
                                    *map(str, args)], env={"COLUMNS": "200"})


def test_bad_input_is_one_line(tiny_source, tmp_path):
    v32 = tiny_source("deepseek_v32", "fp8", real_vocab=True)
    shard(v32, tmp_path / "shards", Layout(1, 1, 1, 1))
    v4 = tiny_source("deepseek_v4", "fp8", real_vocab=True)
    assert_one_line_error(cli_compare(tmp_path / "shards", v4), "shards are deepseek_v32", "reference is deepseek_v4")
    other = tiny_source("deepseek_v32", "fp8", real_vocab=True, config_overrides={"index_topk": 4})
    assert_one_line_error(cli_compare(tmp_path / "shards", other), "differ in index_topk", "not the same model")
    # a reference missing one tensor
    missing = tmp_path / "missing"
    shutil.copytree(v32, missing)
    index_path = missing / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(n for n in index["weight_map"] if n.endswith("layers.2.input_layernorm.weight"))
    path = missing / index["weight_map"].pop(name)
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    assert_one_line_error(cli_compare(tmp_path / "shards", missing), "lacks tensor", name)
    unknown = tmp_path / "unknown"
    shutil.copytree(v32, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert_one_line_error(cli_compare(tmp_path / "shards", unknown), "llama")
    assert_one_line_error(cli_compare(tmp_path / "shards", v32, "--min-cosine", 1.5), "--min-cosine 1.5")
    assert_one_line_error(cli_compare(tmp_path / "shards", tmp_path / "nowhere"), "nowhere")


def test_the_reference_holds_one_part_at_a_time(tiny_source):
    """The reference's model is on the meta device between parts: after a forward no decoder layer, embedding
    or head keeps storage."""
    from dsconv.runner.entrypoints.reference import LOGITS, Reference

    reference = Reference(tiny_source("deepseek_v4", "fp8", real_vocab=True), torch.float32)
    runs = []
    for _ in range(2):  # the second run loads every part again
        seen = {}
        reference.run([0, 5, 6, 7, 8, 9, 10, 11], lambda name, output: seen.setdefault(name, output.clone()))
        runs.append(seen)
        model = reference.model
        for module in (*model.model.layers, model.get_input_embeddings(), model.get_output_embeddings()):
            assert all(p.is_meta for p in module.parameters())
    layers = reference.config.num_hidden_layers
    assert list(runs[0]) == [*range(layers), LOGITS]
    assert runs[0][0].shape == (1, 8, reference.config.hc_mult, reference.config.hidden_size)  # V4: the streams
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])


# A checkpoint of more than 2 GB in the hub's FP8 encoding (V3 layout, the real vocabulary): 256 experts of
# 1024 x 1024 in each of its two MoE layers, 0.81 GB of FP8 per layer and 1.62 GB in BF16
BIG = {"hidden_size": 1024, "moe_intermediate_size": 1024, "intermediate_size": 2048, "n_routed_experts": 256,
       "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "num_nextn_predict_layers": 0}
GB = 10**9
PEAK_HEADROOM = 1 * GB  # the reference may hold one part plus this (the interpreter, torch and transformers included)
# The reference's peak of anonymous memory (what it holds: tensors, the interpreter's heap), sampled from
# /proc/self/status every millisecond. ru_maxrss would count file-backed pages too: the mapped libraries' and the
# checkpoint's pages that happen to sit in the page cache, which the kernel maps in around each fault. Those
# depend on what ran before on the machine (in the full suite, 0.45 GB more than alone), not on what the reference
# holds.
MEASURE_REFERENCE = """
import json, resource, sys, threading, time, torch
from dsconv.runner.entrypoints.reference import Reference

peak = [0]
def sample():
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        time.sleep(0.001)

threading.Thread(target=sample, daemon=True).start()
reference = Reference(sys.argv[1], torch.bfloat16)
reference.run(list(range(2, 66)), lambda name, output: None)
print(json.dumps({"peak": peak[0], "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "largest_part": reference.largest_part_bytes}))
"""


def test_the_reference_of_a_2gb_checkpoint_holds_one_layer_at_a_time(tmp_path):
    from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint

    source = make_tiny_checkpoint(tmp_path / "big", "deepseek_v3", encoding="fp8", real_vocab=True,
                                  config_overrides=BIG)
    assert sum(path.stat().st_size for path in source.glob("*.safetensors")) > 2 * GB
    done = subprocess.run([sys.executable, "-c", MEASURE_REFERENCE, str(source)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"reference of a {sum(p.stat().st_size for p in source.glob('*.safetensors')) / GB:.2f} GB checkpoint: "
          f"peak anonymous RSS {figures['peak'] / GB:.2f} GB (ru_maxrss {figures['max_rss'] / GB:.2f} GB), largest "
          f"part {figures['largest_part'] / GB:.2f} GB")
    assert figures["largest_part"] > 1.5 * GB  # one MoE layer in BF16
    assert figures["peak"] < figures["largest_part"] + PEAK_HEADROOM


def test_the_reference_decodes_partial_fp8_blocks():
    """A weight the FP8 block grid does not divide (the real V3.2's kv_a_proj_with_mqa: [576, 7168], a [5, 56] grid
    of 128 x 128 blocks), which transformers' Fp8Dequantize refuses as it is: every value is its code times its
    block's scale."""
    from types import SimpleNamespace

    from dsconv.runner.entrypoints.reference import decode

    block, rows, cols = (4, 8), 10, 20  # a [3, 3] grid: the last block row and column partial
    gen = torch.Generator().manual_seed(3)
    codes = (torch.randn(rows, cols, generator=gen) * 8).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, generator=gen) + 0.5
    tensor = lambda value: SimpleNamespace(read=lambda: value, entry=SimpleNamespace(dtype=value.dtype))
    weight = SimpleNamespace(value=tensor(codes), scale=tensor(scale), encoding="fp8", spec=None)
    expected = codes.float() * scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    assert torch.equal(decode(weight, block), expected)
