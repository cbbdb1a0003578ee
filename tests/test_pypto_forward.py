"""--kernels pypto end to end (runner/models/kernel_switch.py): the decode steps' hot parts through the PyPTO kernels
(kernels/pypto/, PyPTO's interpreter on the host) give the float32 greedy tokens of --kernels torch:
- `dsrun generate --kernels pypto --device cpu` at world 1 against `--kernels torch`, the trained tiny V4 (decode
  attention over the window and the compressed entries, the gate and its hash layers), W8A8 shards;
- V3.2 at world 2 (EP2), through `dsrun generate`'s ranks: the kernels (RMSNorm with the residual add, the lightning
  indexer selecting, sparse MLA, the MoE gate) run between gloo's collectives on the rank with the sequence, the
  routed experts' W8A8 grouped MLP on the rows the all-to-all delivers. V3.2 has no world-1 run of its own: its
  kernels and their assertions are the same at world 2, which adds the exchanges (one pypto run less, about a
  minute of the suite on a 2-core AVX2 EPYC);
- bad input: one line and exit 2."""

import json
import os
import subprocess
import sys

from importlib import metadata
from typer.testing import CliRunner

from dsconv.family.layout import Layout
from dsconv.runner.cli import app as dsrun_app
from dsconv.runner.engine.config import RunConfig
from dsconv.runner.engine.core import start_rank
from tests.helpers import generate_ranks, greedy, shard

NEW_TOKENS = 8
# 60 and 48 tokens once the chat template wraps them: past the trained V3.2's index_topk (32: the indexer selects
# from the first decode step on), V4's sliding window (16) and the top 8 of its ratio-4 entries
PROMPT = "def merge(left, right):\n    result = []\n    while left and right:\n        result.append(left.pop(0))"
FAMILY_KERNELS = {"deepseek_v32": {"add_rms_norm", "indexer_topk", "sparse_mla_decode", "v3_gate"},
                  "deepseek_v4": {"v4_decode_attention", "v4_gate", "v4_hash_gate"}}
PROMPT_IDS = list(range(100, 148))  # at world 2: on attention-DP rank 0; rank 1 only meets the exchanges


def generate(shards, kernels: str) -> subprocess.Popen:
    """`dsrun generate` at the shards' world size, float32, greedy, started (`report` reads what it prints)."""
    return subprocess.Popen([sys.executable, "-m", "dsconv.runner.cli", "generate", "--shards", str(shards),
                             "--prompt", PROMPT, "--dtype", "float32", "--max-new-tokens", str(NEW_TOKENS), "--json",
                             "--kernels", kernels], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "300"})


def report(run: subprocess.Popen) -> tuple[list[int], dict]:
    """A finished `generate` -> (the new token ids, PyPTO's kernel calls by kernel)."""
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    printed = json.loads(out)
    (generated,) = printed["generated_token_ids"]
    return generated, printed["kernel_calls"]


def test_world_1_and_2_pypto_give_the_torch_tokens(trained_shards, tmp_path):
    """World 1, V4: `dsrun generate --kernels torch` and `--kernels pypto`, a process of one rank each. World 2
    (EP2), V3.2: `dsrun generate`'s ranks with --kernels pypto. All of them side by side: each run's process
    computes on one core at a time, and none reads another's output."""
    shards = {family: trained_shards(family)[1] for family in FAMILY_KERNELS}
    ep2 = tmp_path / "ep2"
    shard(shards["deepseek_v32"].parent / "w8a8", ep2, Layout(2, 2, 2))
    world_1 = "deepseek_v4"
    started = {kernels: generate(shards[world_1], kernels) for kernels in ("pypto", "torch")}
    world_2 = generate_ranks(ep2, tmp_path / "pypto-ep2", [PROMPT_IDS], new_tokens=NEW_TOKENS, kernels="pypto")
    (tokens, calls), (reference, none) = report(started["pypto"]), report(started["torch"])
    assert len(reference) == NEW_TOKENS and none == {}
    assert tokens == reference
    # every decode step (NEW_TOKENS - 1 of them) ran the family's kernels in each of its layers
    kernels = FAMILY_KERNELS[world_1]
    assert set(calls) >= kernels and min(calls[name] for name in kernels) >= NEW_TOKENS - 1, calls
    # world 2 against --kernels torch at world 1, in this process: sharded runs give the unsharded tokens in float32,
    # which tests/test_runner_dist.py holds every layout to
    run = RunConfig.open(shards["deepseek_v32"], dtype="float32")
    _, model, new_cache = start_rank(run)
    expected = greedy(model, new_cache(256), [PROMPT_IDS], NEW_TOKENS, run.eos_token_id)
    assert world_2["generated"] == expected and len(expected[0]) == NEW_TOKENS
    # the rank with the sequence ran every kernel, the experts' on the rows the all-to-all brought it; the idle rank
    # has no decode step of its own (its share of the experts runs in torch)
    busy, idle = (rank["kernel_calls"] for rank in world_2["ranks"])
    assert set(busy) >= FAMILY_KERNELS["deepseek_v32"] | {"grouped_w8a8_mlp"} and idle == {}, (busy, idle)


def refused(*args):
    result = CliRunner().invoke(dsrun_app, ["generate", *map(str, args)], env={"COLUMNS": "300"})
    return result.exit_code, [line for line in result.stderr.splitlines() if line.strip()]


def test_bad_kernels_are_one_line(trained_shards, monkeypatch):
    _, w8a8 = trained_shards("deepseek_v32")
    cases = [(["--kernels", "triton"], "--kernels 'triton' is not one of torch, pypto"),
             (["--kernels", "pypto", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
              "--kernels pypto runs decode steps of one token each")]
    for args, needle in cases:
        code, lines = refused("--shards", w8a8, "--prompt", "hi", *args)
        assert code == 2 and len(lines) == 1 and needle in lines[0], lines

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr("dsconv.kernels.pypto.host.metadata.version", not_installed)
    code, lines = refused("--shards", w8a8, "--prompt", "hi", "--kernels", "pypto")
    assert code == 2 and len(lines) == 1 and "PyPTO is not installed" in lines[0], lines
