"""The MoE's shared expert overlapped with the expert exchange (runner/models/moe.py), seen in a torch.profiler trace
of every rank: the dispatch is issued, the shared expert's first GEMM starts, and only then does the dispatch's wait
return, on every MoE layer of every step. With --no-overlap-shared-experts it starts after the exchange instead, so
the same check fails there."""

import json

import pytest

from dsconv.family.layout import Layout
from dsconv.runner.entrypoints.generate import generate
from dsconv.runner.models.moe import DISPATCH, DISPATCH_WAIT, SHARED_EXPERT
from dsconv.runner.models.weights import load_manifest
from tests.helpers import PROMPTS, run_ranks, shard
from tests.rank_entries import profiled

GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_int_mm", "aten::matmul", "aten::linear"}


def _spans(trace_path):
    """The trace's complete events on the thread that ran the forward: [(name, start, end)] by start (us)."""
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
    main = next(e["tid"] for e in events if e["name"] == DISPATCH)
    spans = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e["tid"] == main]
    return sorted(spans, key=lambda span: span[1])


def _layers(spans):
    """Per dispatch: (issued at, its wait returned at, the shared expert's first GEMM's start in the same layer)."""
    dispatches = [s for s in spans if s[0] == DISPATCH]
    out = []
    for i, (_, issued, issue_end) in enumerate(dispatches):
        next_issue = dispatches[i + 1][1] if i + 1 < len(dispatches) else float("inf")
        wait_end = next(end for name, start, end in spans if name == DISPATCH_WAIT and start >= issue_end)
        shared = next((start, end) for name, start, end in spans if name == SHARED_EXPERT and start >= issued
                      and start < next_issue)
        gemm = next(start for name, start, _ in spans if name in GEMMS and shared[0] <= start <= shared[1])
        out.append((issue_end, wait_end, gemm))
    return out


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_shared_expert_runs_while_the_dispatch_travels(tiny_source, tmp_path, overlap):
    shards = tmp_path / "w2"
    shard(tiny_source("deepseek_v32"), shards, Layout(2, 2, 2, 1))
    traces = tmp_path / "traces"
    traces.mkdir()
    run_ranks(shards, tmp_path, [PROMPTS[0], PROMPTS[1]], new_tokens=3, entry=profiled, inner=generate,
              trace_dir=str(traces), overlap_shared_experts=overlap)
    config = load_manifest(shards)["model"]["config"]
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    for rank in range(2):
        layers = _layers(_spans(traces / f"rank{rank}.json"))
        assert layers and len(layers) % moe_layers == 0, (rank, len(layers))  # every MoE layer of every step
        inside = [issued <= gemm < returned for issued, returned, gemm in layers]
        assert inside == [overlap] * len(layers), (rank, layers)
