"""Redundant experts on disk: family/expert_map.py's maps, `dsconv shard --num-redundant-experts` with a recorded load
or a placement, what `dsconv verify` checks of them, `dsconv plan`'s count, and bad input refused in one line.
(Running on them, and rebalancing while running, is tests/test_skewed_routing.py's.)"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsconv.cli import app
from dsconv.convert.safetensors_io import read_header
from dsconv.convert.source import open_checkpoint
from dsconv.errors import InputError
from dsconv.family.expert_map import ExpertMap, ModelKey, load_record, placement_record
from dsconv.manifest.schema import sha256_of
from dsconv.manifest.verify import verify
from dsconv.runner.cli import app as dsrun_app
from tests.helpers import assert_one_line_error

DATA = Path(__file__).parent / "data"


def cli(*args, runner_app=app):
    return CliRunner().invoke(runner_app, [*map(str, args)], env={"COLUMNS": "200"})


def test_round_robin_maps():
    assert ExpertMap.round_robin(["a"], 16, 0, 4).layers["a"] == tuple(range(16))  # R = 0: the table's blocks
    m = ExpertMap.round_robin(["a"], 16, 4, 4)  # 20 slots, 5 a rank: slot p holds p mod 16, each rank's sorted
    assert m.held("a", 0) == (0, 1, 2, 3, 4) and m.held("a", 3) == (0, 1, 2, 3, 15)
    assert m.holders("a", 0) == [0, 3] and m.holders("a", 15) == [3] and m.redundant == 4


@pytest.mark.parametrize("physical,needle", [
    ((0, 1, 2, 2), "omits experts [3]"),
    ((1, 0, 2, 3), "not distinct experts in ascending order"),
    ((0, 1, 2, 7), "outside the 4 experts"),
    ((0, 1, 2), "do not give 2 EP ranks equal slots"),
])
def test_a_bad_physical_list_is_refused(physical, needle):
    with pytest.raises(InputError) as caught:
        ExpertMap(4, 2, 1, {"layer": physical})
    assert needle in str(caught.value)


def test_a_map_needs_equal_layers_and_nodes_that_divide_the_ranks():
    with pytest.raises(InputError, match=r"differ in number \(\[4, 8\]\)"):
        ExpertMap(4, 2, 1, {"a": (0, 1, 2, 3), "b": (0, 1, 2, 3, 0, 1, 2, 3)})
    for nodes in (0, 3):
        with pytest.raises(InputError, match=f"2 EP ranks do not divide over {nodes} nodes"):
            ExpertMap(4, 2, nodes, {"a": (0, 1, 2, 3)})


def model_key(src: Path) -> ModelKey:
    checkpoint = open_checkpoint(src)
    return ModelKey.of(checkpoint.family.name, checkpoint.arch.n_routed_experts,
                       (w.spec.name for w in checkpoint.weights))


def test_replicas_follow_a_recorded_load_and_verify_checks_them(w8a8_source, tmp_path):
    src = w8a8_source("deepseek_v32")
    key = model_key(src)
    hot = 5  # every layer's expert 5 takes most tokens
    record = tmp_path / "load.json"
    record.write_text(json.dumps(load_record(key, {p: [40 if e == hot else 1 for e in range(key.experts)]
                                                   for p in key.layers})))
    out = tmp_path / "shards"
    result = cli("shard", src, out, "--ep", 4, "--tp", 4, "--num-redundant-experts", 4, "--expert-load", record)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    experts = ExpertMap.from_json(manifest["experts"], key.experts, 4)
    assert set(experts.layers) == set(key.layers) and experts.redundant == 4
    for prefix in key.layers:
        holders = experts.holders(prefix, hot)
        assert len(holders) == 4 == len(set(holders))  # the hot expert on every rank; the others once each
        # each replica's tensors are listed in its rank's directory
        name = f"{prefix}.{hot}.gate_proj.weight"
        assert sorted(t["file"].split("/")[0] for t in manifest["tensors"] if t["name"] == name) == \
            [f"ep-{r:05d}" for r in sorted(holders)]
    assert verify(out, full=True) == []

    # a replica whose bytes differ, the manifest's sizes and hashes rewritten to match: only the replica check sees it
    name = f"{key.layers[0]}.{hot}.down_proj.weight"
    entry = next(t for t in manifest["tensors"] if t["name"] == name and t["file"].startswith("ep-00001"))
    path = out / entry["file"]
    data = bytearray(path.read_bytes())
    data[read_header(path)[name].offset] ^= 1
    path.write_bytes(data)
    record_of = next(f for f in manifest["files"] if f["path"] == entry["file"])
    record_of["sha256"] = sha256_of(path)
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert verify(out) == []  # the fast check reads no tensor
    assert [p for p in verify(out, full=True) if "replica" in p] == \
        [f"{name} ({entry['file']}): a replica whose bytes differ from ep-00000/part-00001-of-00001.safetensors's"]

    # a map that omits an expert; one that is not lists of ints
    manifest["experts"]["layers"][key.layers[0]] = [0] * len(manifest["experts"]["layers"][key.layers[0]])
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert any("omits experts" in p for p in verify(out))
    manifest["experts"]["layers"][key.layers[0]] = "0, 1"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert verify(out) == ["experts: needs redundant and nodes (ints) and layers (an object of lists of ints), or "
                           "null"]


def test_a_placement_file_is_taken_as_it_is(w8a8_source, tmp_path):
    src = w8a8_source("deepseek_v32")
    key = model_key(src)
    chosen = ExpertMap.round_robin(list(key.layers), key.experts, 4, 2)
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps(placement_record(key, chosen)))
    out = tmp_path / "shards"
    result = cli("shard", src, out, "--ep", 2, "--tp", 2, "--expert-placement", placement)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["experts"] == chosen.to_json()


def test_bad_input_is_one_line(w8a8_source, tiny_source, tmp_path):
    src = w8a8_source("deepseek_v32")
    out = tmp_path / "o"
    assert_one_line_error(cli("shard", src, out, "--num-redundant-experts", 5),
                          "16 experts + 5 redundant = 21 physical experts do not divide over EP 16")
    other = model_key(tiny_source("deepseek_v4"))
    record = tmp_path / "v4-load.json"
    record.write_text(json.dumps(load_record(other, {p: [1] * other.experts for p in other.layers})))
    assert_one_line_error(cli("shard", src, out, "--num-redundant-experts", 16, "--expert-load", record),
                          "is for another model", "deepseek_v4")
    key = model_key(src)
    data = placement_record(key, ExpertMap.round_robin(list(key.layers), 16, 4, 2))  # 20 slots, 10 a rank
    data["layers"][key.layers[0]] = list(range(1, 11)) + list(range(6, 16))  # no expert 0
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps(data))
    assert_one_line_error(cli("shard", src, out, "--ep", 2, "--tp", 2, "--expert-placement", placement),
                          "omits experts [0]")
    assert not out.exists()
    # dsrun: --eplb-config's keys are vLLM's, and it goes with --enable-eplb
    shards = tmp_path / "never-read"
    for flags, needle in ((["--enable-eplb", "--eplb-config", '{"window": 3}'], "keys among"),
                          (["--eplb-config", "{}"], "--eplb-config needs --enable-eplb")):
        assert_one_line_error(cli("generate", "--prompt", "hi", "--shards", shards, *flags, runner_app=dsrun_app),
                              needle)


def test_plan_counts_the_redundant_experts():
    config = DATA / "deepseek_v32_exp.config.json"

    def experts_bytes(redundant: int) -> int:
        result = cli("plan", "--config", config, "--num-redundant-experts", redundant, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["precisions"][0]["ranks"][0]["weights"]["experts"]

    raw = json.loads(config.read_text())
    moe_layers = raw["num_hidden_layers"] - raw["first_k_dense_replace"] + raw["num_nextn_predict_layers"]
    one_expert = 3 * raw["hidden_size"] * raw["moe_intermediate_size"] * 2  # BF16 gate, up and down
    assert experts_bytes(16) - experts_bytes(0) == moe_layers * one_expert  # one more expert a rank a layer
    assert_one_line_error(cli("plan", "--config", config, "--num-redundant-experts", 8),
                          "256 + 8 redundant is not divisible by ep=16")
