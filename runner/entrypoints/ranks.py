"""What the rank entry points of `dsrun generate` and `dsrun perplexity` share: every rank's result sent to rank 0
for the launcher to read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

RESULTS_NAME = "results.json"  # written by rank 0: every rank's sequences and timings


def gather_results(result: dict, rank: int, result_dir: str) -> None:
    """Every rank's result to rank 0, over the process group (no shared filesystem needed across machines);
    rank 0 writes them for the launcher's process to read."""
    everyone = [None] * torch.distributed.get_world_size() if torch.distributed.is_initialized() else [result]
    if torch.distributed.is_initialized():
        torch.distributed.gather_object(result, everyone if rank == 0 else None, dst=0)
    if rank == 0:
        (Path(result_dir) / RESULTS_NAME).write_text(json.dumps(everyone))
