"""Write a deterministic tiny DeepSeek checkpoint in the hub's on-disk format (see convert/tiny_checkpoint.py).

    python scripts/make_tiny_checkpoint.py OUT --family deepseek_v4 [--encoding bf16] [--real-vocab]

The maker lives in the package (`convert.tiny_checkpoint`, which the tests import) so `dsconv` and `dsrun` can
build their demo checkpoints; this script is its command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint


def main(out_dir: Path, family: str = "deepseek_v3", encoding: str = "fp8", seed: int = 0,
         real_vocab: bool = False, partial_block: bool = False, config_overrides: str = "{}",
         max_file_bytes: int | None = None) -> None:
    """Write a deterministic tiny checkpoint of FAMILY to OUT_DIR.

    --config-overrides is a JSON object merged into the tiny config.json; --max-file-bytes caps each file's
    tensor data (the header adds a few KB).
    """
    path = make_tiny_checkpoint(out_dir, family, encoding=encoding, seed=seed, real_vocab=real_vocab,
                                partial_block=partial_block, config_overrides=json.loads(config_overrides),
                                max_file_bytes=max_file_bytes)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path} ({size / 2**20:.1f} MiB of safetensors)")


if __name__ == "__main__":
    typer.run(main)
