"""The built-in demo: a tiny DeepSeek-V4 checkpoint with random weights in the real hub format (FP8 + FP4
experts, real 129280-token vocabulary), built once into a cache so the tools run on a fresh machine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from convert.tiny_checkpoint import make_tiny_checkpoint

DEMO_FAMILY = "deepseek_v4"
DEMO_VERSION = 1  # bump when the demo checkpoint's contents change, so stale caches are rebuilt


def cache_dir() -> Path:
    root = os.environ.get("DSCONV_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsconv"
    return Path(root)


def demo_source() -> Path:
    """The demo checkpoint, built on first use; a half-built one is never left under the final name."""
    final = cache_dir() / f"demo-{DEMO_FAMILY}-v{DEMO_VERSION}"
    if (final / "config.json").is_file():
        return final
    building = final.with_name(final.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    make_tiny_checkpoint(building, DEMO_FAMILY, encoding="fp8", real_vocab=True)
    os.replace(building, final)
    return final


def demo_output(name: str) -> Path:
    return cache_dir() / f"demo-{DEMO_FAMILY}-v{DEMO_VERSION}-{name}"
