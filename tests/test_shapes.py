"""`--record-shapes FILE` (runner/engine/shapes.py): dsrun generate, perplexity and serve each append one row of what
their steps covered; its boundary counts equal what the prompts' and replies' positions give by hand."""

import json
import subprocess
import sys

import httpx
import pytest

from dsconv.family.layout import Layout
from tests.helpers import Server, shard

pytestmark = pytest.mark.slow  # ranks per command

FIELDS = {"family", "prompt_lengths", "batch_size", "attention_dp", "attention_tp", "ep", "lm_head_tp", "handoff",
          "dtype", "kv_cache_dtype", "compression_ratios", "boundaries_crossed"}
NEW_TOKENS = 6
BLOCK = 16  # the default --block-size


def dsrun(command, *args):
    done = subprocess.run([sys.executable, "-m", "dsconv.runner.cli", command, *map(str, args)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def crossed(n: int, writes: list[tuple[int, int]]) -> int:
    """How many multiples of n the written position ranges [start, end) complete."""
    return sum(end // n - start // n for start, end in writes)


@pytest.fixture(scope="module")
def v4_shards(tiny_source, tmp_path_factory):
    shards = tmp_path_factory.mktemp("v4") / "shards"
    shard(tiny_source("deepseek_v4", "fp8", real_vocab=True), shards, Layout(1, 1, 1, 1))
    return shards


def test_generate_and_perplexity_rows(v4_shards, tmp_path):
    record = tmp_path / "shapes.jsonl"
    dsrun("generate", "--shards", v4_shards, "--prompt", "The Forbidden City, its halls and courtyards",
          "--prompt", "def f(x): return x * x", "--no-chat", "--max-new-tokens", NEW_TOKENS, "--dtype", "float32",
          "--record-shapes", record)
    text = tmp_path / "text.txt"
    text.write_text("import os\n" * 40)
    dsrun("perplexity", "--shards", v4_shards, "--file", text, "--context", 64, "--record-shapes", record)
    generated, scored = map(json.loads, record.read_text().splitlines())
    assert FIELDS <= set(generated) and generated["command"] == "generate" and scored["command"] == "perplexity"
    assert generated["family"] == "deepseek_v4" and generated["handoff"] == "direct"
    assert (generated["attention_dp"], generated["ep"], generated["lm_head_tp"]) == (1, 1, 1)
    assert generated["batch_size"] == 2 and len(generated["prompt_lengths"]) == 2
    # every prompt position is written, then each new token but the last (it ends the reply unwritten)
    writes = [(0, length + NEW_TOKENS - 1) for length in generated["prompt_lengths"]]
    assert generated["boundaries_crossed"] == {
        "blocks": crossed(BLOCK, writes), "sliding_windows": crossed(16, writes),
        "compression_windows_ratio_4": crossed(4, writes), "compression_windows_ratio_128": crossed(128, writes)}
    assert generated["compression_ratios"] == {"prefill": [0, 4, 128], "decode": [0, 4, 128]}
    # perplexity: prompts scored, nothing decoded; windows of 64 tokens
    assert scored["compression_ratios"] == {"prefill": [0, 4, 128], "decode": []}
    assert all(length <= 64 for length in scored["prompt_lengths"]) and len(scored["prompt_lengths"]) >= 2
    windows = [(0, length) for length in scored["prompt_lengths"]]
    assert scored["boundaries_crossed"]["compression_windows_ratio_4"] == crossed(4, windows)


def test_serve_row_when_it_stops(tiny_source, tmp_path):
    shards = tmp_path / "shards"
    shard(tiny_source("deepseek_v32", "fp8", real_vocab=True), shards, Layout(1, 1, 1, 1))
    record = tmp_path / "shapes.jsonl"
    server = Server(shards, tmp_path / "server.log", "--dtype", "float32", "--record-shapes", record)
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": "shards", "prompt": "Hello, world",
                                                             "max_tokens": 3}, timeout=60).json()
    assert server.stop() == 0, server.log()
    (row,) = map(json.loads, record.read_text().splitlines())
    assert row["command"] == "serve" and row["family"] == "deepseek_v32"
    assert row["prompt_lengths"] == [reply["usage"]["prompt_tokens"]]
    assert row["compression_ratios"] == {"prefill": [], "decode": []}  # MLA: no compressed layers
    assert row["boundaries_crossed"]["blocks"] == crossed(BLOCK, [(0, row["prompt_lengths"][0] + 2)])
