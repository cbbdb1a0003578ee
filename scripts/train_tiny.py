"""Train the tiny DeepSeek checkpoints on the Python standard library's source (see tests/trained.py).

    python scripts/train_tiny.py OUT --family deepseek_v4

writes OUT/fp8 (the hub's encodings) and OUT/bf16 (the same model decoded), each with its tokenizer.json.
Tests and the accuracy gate use the cached copy instead (`trained_source`, built on first use).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the training lives with the tests (tests/trained.py), outside the installed package

from tests.trained import FAMILIES, build_trained  # noqa: E402


def main(out_dir: Path, family: str = "deepseek_v4") -> None:
    """Train FAMILY's tiny model (CPU, fixed seed, a couple of minutes) and write it to OUT_DIR."""
    if family not in FAMILIES:
        raise typer.BadParameter(f"--family {family} is not one of {', '.join(FAMILIES)}")
    if out_dir.exists():
        raise typer.BadParameter(f"{out_dir} exists; refusing to mix checkpoints")
    started = time.perf_counter()
    build_trained(out_dir, family)
    print(f"wrote {out_dir}/fp8 and {out_dir}/bf16 in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    typer.run(main)
