"""`dsconv shard`: every tensor's shards reassemble bit-exactly into the unsharded tensor, by the placement table."""

import json
from collections import defaultdict

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from dsconv.cli import app
from dsconv.convert.source import open_checkpoint
from dsconv.manifest.verify import verify
from dsconv.family.layout import Layout
from tests.helpers import SMALL_FILES, read_all, shard, source_reference


def reassemble(out):
    """name -> {rank: [(split, tensor)] that rank maps}, name -> placement mode, and the manifest."""
    manifest = json.loads((out / "manifest.json").read_text())
    handles, modes = {}, {}
    per_rank = defaultdict(lambda: defaultdict(list))
    for t in manifest["tensors"]:
        if t["file"] not in handles:
            handles[t["file"]] = safe_open(out / t["file"], "pt")
        value = handles[t["file"]].get_tensor(t["name"])
        key = t["name"] if t["scale_of"] else t["source"]["name"]
        for rank in t["ranks"]:
            per_rank[key][rank].append((t["split"], value))
        modes[key] = t["mode"]
    return per_rank, modes, manifest


def check_exact(out, expected: dict, layout: Layout):
    per_rank, modes, manifest = reassemble(out)
    assert manifest["layout"]["groups"] == layout.groups()
    assert set(per_rank) == set(expected) - {n for n in expected if n.endswith("weight_offset")}
    for name, by_rank in per_rank.items():
        whole = expected[name]
        # every group of ranks that splits a tensor must, together, hold all of it exactly once
        split_dims = {s["dim"] for pieces in by_rank.values() for s, _ in pieces if s}
        if not split_dims:
            for rank, pieces in by_rank.items():
                assert len(pieces) == 1 and torch.equal(pieces[0][1], whole), (name, rank)
            continue
        (dim,) = split_dims
        groups = layout.groups()["tp" if modes[name] == "vocab" else "attn_tp"]
        for group in groups:
            pieces = {}
            for rank in group:
                (split, value), = by_rank[rank]
                pieces[split["start"]] = value
            assert torch.equal(torch.cat([pieces[k] for k in sorted(pieces)], dim=dim), whole), name


@pytest.mark.parametrize("family,attn_tp", [("deepseek_v3", 1), ("deepseek_v32", 1), ("deepseek_v32", 8),
                                            ("deepseek_v4", 1), ("deepseek_v4", 2)])
def test_w8a8_shards_reassemble_exactly(w8a8_source, tmp_path, family, attn_tp):
    src = w8a8_source(family)
    layout = Layout(16, 16, 16, attn_tp)
    shard(src, tmp_path / "shards", layout)
    assert verify(tmp_path / "shards", full=True) == []
    expected, _ = read_all(src, "quant_model_weights.safetensors.index.json")
    checkpoint = open_checkpoint(src)
    for copy in checkpoint.family.ascend_mtp_copies(checkpoint.arch):
        del expected[copy]  # msModelSlim's MTP copies of head and embed: the shards keep the originals only
    check_exact(tmp_path / "shards", expected, layout)

    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    experts = [t for t in manifest["tensors"] if t["mode"] == "expert" and not t["scale_of"]]
    assert experts and all(len(t["ranks"]) == 1 for t in experts)
    per_rank = defaultdict(set)
    for t in experts:
        per_rank[t["ranks"][0]].add(t["expert"])
    n_experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    assert all(per_rank[r] == set(range(r * n_experts // 16, (r + 1) * n_experts // 16)) for r in range(16))
    assert not any(t["name"].endswith("weight_offset") for t in manifest["tensors"])  # symmetric: dropped
    assert manifest["precision"] == "w8a8"
    # replicated tensors are stored once, not 16 times
    assert len({t["file"] for t in manifest["tensors"] if t["mode"] == "replicated"}) >= 1
    assert all(t["file"].startswith("common/") for t in manifest["tensors"] if t["mode"] == "replicated")


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v4"])
def test_fp8_source_shards_to_bf16_exactly(tiny_source, tmp_path, family):
    src = tiny_source(family, "fp8")
    layout = Layout(16, 16, 16, 1)
    shard(src, tmp_path / "shards", layout)
    assert verify(tmp_path / "shards", full=True) == []
    expected = {n: (t.to(torch.bfloat16) if t.dtype == torch.float32 and t.dim() == 2 else t)
                for n, t in source_reference(src).items()}
    # tensors shipped as float32 stay float32; FP8/FP4 ones are decoded to BF16 (transformers' decode here)
    raw, _ = read_all(src, "model.safetensors.index.json")
    expected = {n: (expected[n] if raw[n].dtype in (torch.float8_e4m3fn, torch.int8) else raw[n]) for n in expected}
    check_exact(tmp_path / "shards", expected, layout)
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["precision"] == "bf16"


def test_lm_head_slices_concatenate_to_lm_head(w8a8_source, tmp_path):
    src = w8a8_source("deepseek_v4")
    shard(src, tmp_path / "s", Layout(16, 16, 16, 1))
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    heads = sorted((t for t in manifest["tensors"] if t["name"] == "head.weight"), key=lambda t: t["split"]["start"])
    assert [t["ranks"] for t in heads] == [[r] for r in range(16)]
    pieces = [safe_open(tmp_path / "s" / t["file"], "pt").get_tensor("head.weight") for t in heads]
    expected, _ = read_all(src, "quant_model_weights.safetensors.index.json")
    assert torch.equal(torch.cat(pieces), expected["head.weight"])


def cli(*args):
    return CliRunner().invoke(app, [*map(str, args)], env={"COLUMNS": "200"})


@pytest.mark.parametrize("flags,needle", [
    (["--ep", "3"], "ep=3 must divide world size 16"),
    (["--world-size", "32", "--ep", "32", "--tp", "32"], "n_routed_experts=16 is not divisible by ep=32"),
    (["--world-size", "48", "--ep", "16", "--tp", "48"], "vocab_size=1024 is not divisible by tp=48"),
    (["--attn-tp", "16"], "num_attention_heads=8 is not divisible by attn-tp=16"),
])
def test_bad_layouts_are_refused(w8a8_source, tmp_path, flags, needle):
    result = cli("shard", w8a8_source("deepseek_v3"), tmp_path / "o", *flags)
    assert result.exit_code == 2 and needle in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_v4_o_groups_must_divide_attn_tp(w8a8_source, tmp_path):
    result = cli("shard", w8a8_source("deepseek_v4"), tmp_path / "o", "--attn-tp", "4")
    assert result.exit_code == 2 and "o_groups=2 is not divisible by attn-tp=4" in result.output, result.output


@pytest.mark.parametrize("flags,line", [
    ([], "world size 16: attention DP 16 x attention TP 1, EP 16, lm_head TP 16"),
    (["--ep", "1", "--tp", "1"], "world size 1: attention DP 1 x attention TP 1, EP 1, lm_head TP 1"),
    (["--ep", "4", "--tp", "2"], "world size 4: attention DP 4 x attention TP 1, EP 4, lm_head TP 2"),
    (["--ep", "1", "--tp", "1", "--attn-tp", "8"], "world size 8: attention DP 1 x attention TP 8, EP 1, lm_head TP 1"),
    (["--ep", "2", "--tp", "2", "--world-size", "4"], "world size 4: attention DP 4 x attention TP 1, EP 2, lm_head TP 2"),
])
def test_world_size_defaults_to_the_largest_size(w8a8_source, tmp_path, flags, line):
    result = cli("shard", w8a8_source("deepseek_v32"), tmp_path / "o", *flags, "--dry-run")
    assert result.exit_code == 0 and line in result.output, result.output


def test_dry_run_table(w8a8_source, tmp_path):
    result = cli("shard", w8a8_source("deepseek_v32"), tmp_path / "o", "--attn-tp", "8", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "experts" in result.output and "lm_head" in result.output and "0-15" in result.output
    assert not (tmp_path / "o").exists()


def test_interrupted_shard_resumes_identically(w8a8_source, tmp_path, monkeypatch):
    import dsconv.shard.shard as shard_module

    src = w8a8_source("deepseek_v32")
    reference = tmp_path / "ref"
    assert cli("shard", src, reference, "--attn-tp", "8", "--max-file-size", "200KB").exit_code == 0

    real_write_part, calls = shard_module.write_part, []

    def write_then_die(*args, **kwargs):
        if len(calls) == 5:
            raise KeyboardInterrupt
        calls.append(1)
        return real_write_part(*args, **kwargs)

    monkeypatch.setattr(shard_module, "write_part", write_then_die)
    out = tmp_path / "out"
    interrupted = cli("shard", src, out, "--attn-tp", "8", "--max-file-size", "200KB")
    assert interrupted.exit_code == 130 and not (out / "manifest.json").exists()
    monkeypatch.setattr(shard_module, "write_part", real_write_part)
    resumed = cli("shard", src, out, "--attn-tp", "8", "--max-file-size", "200KB")
    assert resumed.exit_code == 0 and "5 kept from an earlier run" in resumed.output, resumed.output
    files = lambda d: {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}  # noqa: E731
    assert files(out) == files(reference)


def test_compressed_tensors_output_shards_and_verifies(tiny_source, tmp_path):
    from dsconv.convert.quantize import build_plan, run_quantize

    quantized = tmp_path / "ct"
    run_quantize(build_plan(tiny_source("deepseek_v32"), None, "compressed-tensors", SMALL_FILES), quantized, 2,
                 lambda n: None)
    shard(quantized, tmp_path / "s", Layout(16, 16, 16, 8))
    assert verify(tmp_path / "s", full=True) == []
    expected, _ = read_all(quantized, "model.safetensors.index.json")
    check_exact(tmp_path / "s", expected, Layout(16, 16, 16, 8))


def test_bf16_shards_drop_the_fp8_quantization_config(tiny_source, tmp_path):
    shard(tiny_source("deepseek_v3", "fp8"), tmp_path / "s", Layout(16, 16, 16, 1))
    assert "quantization_config" not in json.loads((tmp_path / "s" / "config.json").read_text())
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert "quantization_config" not in manifest["model"]["config"]


def test_out_under_a_file_is_one_line(w8a8_source, tmp_path):
    (tmp_path / "afile").write_text("x")
    result = cli("shard", w8a8_source("deepseek_v3"), tmp_path / "afile" / "out")
    assert result.exit_code == 1 and result.output.strip().startswith("error:") and "Traceback" not in result.output


def test_file_size_cap_includes_headers(w8a8_source, tmp_path):
    cap = 300_000
    result = cli("shard", w8a8_source("deepseek_v3"), tmp_path / "s", "--max-file-size", str(cap))
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    largest_tensor = max(t["shape"][0] * (t["shape"][1] if len(t["shape"]) > 1 else 1)
                         * {"I8": 1, "BF16": 2, "F32": 4, "I64": 8}.get(t["dtype"], 4) for t in manifest["tensors"])
    for f in manifest["files"]:
        assert f["bytes"] <= max(cap, largest_tensor + 4096), f
