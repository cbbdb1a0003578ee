"""Train the tiny DeepSeek models again and say whether they are the shipped bytes (tests/trained.py says what
they are and why they ship).

    python -m tests.tools.train_tiny OUT_DIR [--family deepseek_v4]...    # from the repository root

Trains every family given (default: both) at once, each in its own one-thread interpreter (20 to 26 minutes each
on one core), writes OUT_DIR/<family>.safetensors and OUT_DIR/tokenizer.json, and prints each file's sha256 against
the one recorded for tests/data/trained/ (SHIPPED_SHA256); exit status 1 when one differs. Run it when the training
changes, then copy the files into tests/data/trained/ and record the printed sha256s.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import typer

from tests.trained import FAMILIES, SHIPPED, SHIPPED_SHA256, TOKENIZER_FILE, sha256_of, train_into, \
    training_tokens


def main(out_dir: Path = typer.Argument(..., help="a new directory for the trained files"),
         family: Optional[list[str]] = typer.Option(None, help=f"one of {', '.join(FAMILIES)}; repeat for more "
                                                               "(default: all)")) -> None:
    """Train the tiny models into OUT_DIR and compare their bytes with the shipped ones."""
    families = tuple(family or FAMILIES)
    unknown = [name for name in families if name not in FAMILIES]
    if unknown:
        raise typer.BadParameter(f"--family {unknown[0]} is not one of {', '.join(FAMILIES)}")
    if out_dir.exists():
        raise typer.BadParameter(f"{out_dir} exists; refusing to mix checkpoints")
    out_dir.mkdir(parents=True)
    started = time.perf_counter()
    tokenizer, _ = training_tokens()
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    with ThreadPoolExecutor(max_workers=len(families)) as pool:
        list(pool.map(lambda name: train_into(out_dir, name), families))
    print(f"trained {', '.join(families)} in {time.perf_counter() - started:.0f} s")
    differ = 0
    for name in [f"{family}.safetensors" for family in families] + [TOKENIZER_FILE]:
        got, want = sha256_of(out_dir / name), SHIPPED_SHA256[name]
        differ += got != want
        verdict = f"the bytes of {SHIPPED / name}" if got == want else f"differs from {SHIPPED / name} ({want})"
        print(f"{name}: sha256 {got}: {verdict}")
    raise typer.Exit(1 if differ else 0)


if __name__ == "__main__":
    typer.run(main)
