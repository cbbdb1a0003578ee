"""`dsconv verify` catches each way a shard set can be broken, with exit 1 and one line per problem."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from dsconv.cli import app
from dsconv.family.layout import Layout
from tests.helpers import shard


@pytest.fixture(scope="session")
def good_shards(w8a8_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("good") / "shards"
    shard(w8a8_source("deepseek_v4"), out, Layout(16, 16, 16, 1))
    return out


@pytest.fixture
def shards(good_shards, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(good_shards, copy)
    return copy


def run_verify(out, *flags):
    return CliRunner().invoke(app, ["verify", str(out), *flags], env={"COLUMNS": "300"})


def edit_manifest(out, edit):
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


def assert_problem(result, *needles):
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("problem:")]
    assert problems and "Traceback" not in result.output
    assert any(all(n in p for n in needles) for p in problems), (needles, result.output)


def test_good_shards_pass(good_shards):
    for flags in ((), ("--full",)):
        result = run_verify(good_shards, *flags)
        assert result.exit_code == 0 and "ok" in result.output, result.output


def test_flipped_byte_needs_full(shards):
    victim = next(shards.glob("ep-00003/*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0x01
    victim.write_bytes(bytes(data))
    assert run_verify(shards).exit_code == 0  # same size, same header: only the hash can tell
    assert_problem(run_verify(shards, "--full"), victim.name, "sha256")


def test_missing_file(shards):
    victim = next(shards.glob("tp-00007/*.safetensors"))
    victim.unlink()
    assert_problem(run_verify(shards), victim.name, "missing")


def test_truncated_file(shards):
    victim = next(shards.glob("common/*.safetensors"))
    data = victim.read_bytes()
    victim.write_bytes(data[:-1000])
    assert_problem(run_verify(shards), victim.name, "truncated")


def test_manifest_shape_that_lies(shards):
    def lie(manifest):
        t = next(t for t in manifest["tensors"] if t["name"] == "layers.1.attn.wq_b.weight")
        t["shape"] = [t["shape"][0] + 1, t["shape"][1]]

    edit_manifest(shards, lie)
    assert_problem(run_verify(shards), "layers.1.attn.wq_b.weight", "manifest says")


def test_missing_expert(shards):
    def drop(manifest):
        manifest["tensors"] = [t for t in manifest["tensors"] if not (t["expert"] == 5 and t["layer"] == 2)]

    edit_manifest(shards, drop)
    assert_problem(run_verify(shards), "layers.2.ffn.experts.5.", "on no rank")


def test_expert_on_two_ranks(shards):
    def duplicate(manifest):
        t = next(t for t in manifest["tensors"] if t["expert"] == 5 and t["name"].endswith("w1.weight"))
        t["ranks"] = [5, 6]

    edit_manifest(shards, duplicate)
    assert_problem(run_verify(shards), "experts.5.w1.weight", "held by 2 ranks")


def test_overlapping_vocab_slice(shards):
    def overlap(manifest):
        t = next(t for t in manifest["tensors"] if t["name"] == "head.weight" and t["ranks"] == [3])
        t["split"]["start"] -= 10

    edit_manifest(shards, overlap)
    assert_problem(run_verify(shards), "head.weight", "overlap")


def test_missing_vocab_slice(shards):
    def drop(manifest):
        manifest["tensors"] = [t for t in manifest["tensors"] if not (t["name"] == "head.weight" and t["ranks"] == [9])]

    edit_manifest(shards, drop)
    assert_problem(run_verify(shards), "head.weight", "on no rank")


def test_path_escaping_out(shards):
    def escape(manifest):
        manifest["side_files"][0]["path"] = "../../x"

    edit_manifest(shards, escape)
    assert_problem(run_verify(shards), "../../x", "escapes")


def test_int8_weight_without_scale(shards):
    def drop_scale(manifest):
        manifest["tensors"] = [t for t in manifest["tensors"] if t["name"] != "layers.0.attn.wq_a.weight_scale"]

    edit_manifest(shards, drop_scale)
    result = run_verify(shards)
    assert_problem(result, "layers.0.attn.wq_a.weight", "scale")


def test_not_a_manifest(shards):
    (shards / "manifest.json").write_text("{not json")
    assert_problem(run_verify(shards), "not valid JSON")
    (shards / "manifest.json").write_text(json.dumps({"schema": "other", "version": 1}))
    assert_problem(run_verify(shards), "schema")


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m["tensors"][0].__setitem__("split", {}), "split needs"),
    (lambda m: m.__setitem__("model", {}), "model: needs"),
    (lambda m: m["tensors"][0].__setitem__("source", {}), "source needs"),
    (lambda m: m["tensors"][0].__setitem__("ranks", [[0]]), "ranks"),
])
def test_malformed_fields_are_problems_not_crashes(shards, edit, needle):
    edit_manifest(shards, edit)
    assert_problem(run_verify(shards), needle)


def test_shape_lie_in_file_and_manifest_is_caught_by_the_inventory(shards):
    # the manifest and the file agree, but not with what the model's config implies
    def lie(manifest):
        t = next(t for t in manifest["tensors"] if t["name"] == "layers.1.attn.wq_b.weight")
        t["shape"] = [t["shape"][0] // 2, t["shape"][1] * 2]

    edit_manifest(shards, lie)
    assert_problem(run_verify(shards), "layers.1.attn.wq_b.weight", "does not match the model's")


@pytest.fixture(scope="session")
def fine_tp_shards(w8a8_source, tmp_path_factory):
    """V3.2 W8A8 with o_proj and the embedding split over all 16 ranks."""
    out = tmp_path_factory.mktemp("fine-tp") / "shards"
    shard(w8a8_source("deepseek_v32"), out, Layout(16, 16, 16, 1, oproj_tp=16, embed_tp=16))
    return out


def test_fine_tp_slices_are_checked(fine_tp_shards, tmp_path):
    assert run_verify(fine_tp_shards).exit_code == 0
    manifest = json.loads((fine_tp_shards / "manifest.json").read_text())
    assert manifest["layout"]["oproj_tp"] == manifest["layout"]["embed_tp"] == 16
    modes = {t["name"].split(".")[-2]: t["mode"] for t in manifest["tensors"] if t["scale_of"] is None}
    assert modes["o_proj"] == "oproj_split" and modes["embed_tokens"] == "embed_split"
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    for name, edit, needle in (
            (o_proj, lambda t: t["split"].update(start=t["split"]["start"] - 4), "overlap"),
            ("model.embed_tokens.weight", None, "on no rank"),
            (o_proj, lambda t: t.update(ranks=[2, 3]), "placement")):
        copy = tmp_path / f"copy-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(fine_tp_shards, copy)

        def change(manifest, name=name, edit=edit):
            pieces = [t for t in manifest["tensors"] if t["name"] == name and t["ranks"] == [3]]
            if edit is None:
                manifest["tensors"] = [t for t in manifest["tensors"] if t not in pieces]
            else:
                edit(pieces[0])

        edit_manifest(copy, change)
        assert_problem(run_verify(copy), name.split(".")[-2], needle)
