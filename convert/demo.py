"""The built-in demos: tiny DeepSeek checkpoints with random weights in the real hub format (FP8 block
scales; FP4 experts for V4; the real 129280-token vocabulary), built once into a cache so the tools run on
a fresh machine. `dsconv quantize` demos the V4 converter; `dsrun generate` the V4 runner on W8A8 shards
(shard/demo.py shards them)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint

DEMO_FAMILY = "deepseek_v4"
DEMO_VERSION = 4  # bump when a demo's contents change, so stale caches are rebuilt


def cache_dir() -> Path:
    root = os.environ.get("DSCONV_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsconv"
    return Path(root)


def build_once(final: Path, build) -> Path:
    """Build into a scratch directory of this process's own beside `final` and rename: a half-built demo never
    sits under the final name, and two processes building the same one at once (two test runs on one cache) each
    finish their own; the first rename wins and the other's copy is dropped."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.building-"))
    try:
        building = scratch / final.name
        build(building)
        try:
            os.replace(building, final)
        except OSError:  # another process renamed its copy first (a non-empty directory is never replaced)
            if not final.is_dir():
                raise
        return final
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def demo_source(family: str = DEMO_FAMILY) -> Path:
    return build_once(cache_dir() / f"demo-{family}-v{DEMO_VERSION}",
                       lambda out: make_tiny_checkpoint(out, family, encoding="fp8", real_vocab=True))


def demo_output(name: str, family: str = DEMO_FAMILY) -> Path:
    return cache_dir() / f"demo-{family}-v{DEMO_VERSION}-{name}"
