"""The demo shards `dsrun generate` runs when no shards are given: convert/demo.py's tiny checkpoint quantized
and sharded for 16 ranks, built once into the same cache."""

from __future__ import annotations

import os
from pathlib import Path

from dsconv.console import err_console
from dsconv.convert.demo import DEMO_FAMILY, build_once, demo_output, demo_source
from dsconv.convert.quantize import build_plan, run_quantize
from dsconv.family.layout import Layout
from dsconv.shard.shard import make_shard_plan, run_shard


def demo_shards(family: str = DEMO_FAMILY) -> Path:
    """The demo checkpoint quantized to W8A8 (ascend layout) and sharded for 16 ranks (EP16, lm_head TP16)."""
    def build(out: Path) -> None:
        quantized = demo_output("w8a8", family)
        run_quantize(build_plan(demo_source(family), None, "ascend", 4 * 10**9), quantized, os.cpu_count() or 1,
                     lambda n: None)
        run_shard(make_shard_plan(quantized, Layout(), 4 * 10**9), out, os.cpu_count() or 1, lambda n: None)

    return build_once(demo_output("shards-ep16-tp16", family), build)


def announced_demo_shards(doing: str) -> Path:
    """The demo shards, for a dsrun command given no --shards, with a line saying what it is `doing` them."""
    err_console.print(f"[yellow]No --shards given: {doing} the built-in demo, a tiny DeepSeek-V4 model (real "
                      f"vocabulary, FP8 + FP4 source) with RANDOM weights (the text is noise), quantized to W8A8 and "
                      f"sharded for 16 ranks.[/]")
    return demo_shards()
