"""What the four `dsrun` commands' bodies share, in the launching process: the demo when no shards are given, the
checked --record-shapes path, and the launch of the ranks."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from dsconv.comm.launch import launch
from dsconv.console import err_console
from dsconv.errors import InputError
from dsconv.runner.engine.config import RunConfig


def shards_or_demo(shards: Path | None, what: str) -> Path:
    """The given shards, or (None) the built-in demo's, built once per session, with a line saying so."""
    if shards is not None:
        return shards
    from dsconv.shard.demo import demo_shards  # builds and imports the converter only when the demo runs

    err_console.print(f"[yellow]No --shards given: {what} the built-in demo, a tiny DeepSeek-V4 model (real "
                      f"vocabulary, FP8 + FP4 source) with RANDOM weights (the text is noise), quantized to W8A8 "
                      f"and sharded for 16 ranks.[/]")
    return demo_shards()


def record_path(path: Path | None) -> Path | None:
    """--record-shapes as an absolute path (rank 0 appends to it), refused at once if it cannot be written."""
    if path is None:
        return None
    path = path.resolve()
    if not path.parent.is_dir():
        raise InputError(f"--record-shapes {path}: its directory does not exist")
    if path.is_dir():
        raise InputError(f"--record-shapes {path} is a directory, not a file")
    return path


def cache_flag(run: RunConfig) -> str:
    """The flag that sized the run's KV cache, with its value."""
    if run.cache.memory_bytes is not None:
        return f"--kv-cache-memory-bytes {run.cache.memory_bytes}"
    return f"--cache-tokens {run.cache.tokens}"


def launch_ranks(entry, args: dict, run: RunConfig, timeout: float, sigterm_to_rank0: bool = False) -> int:
    """The run's ranks, each running entry(**args); rank 0 prints what the command shows -> the job's exit code. A
    failed rank's logs are kept, in the directory its message names."""
    logs = Path(tempfile.mkdtemp(prefix="dsrun-logs-"))
    code = 1
    try:
        code = launch(entry, args, world_size=run.layout.world_size, device=run.device, timeout_s=timeout,
                      log_dir=logs, sigterm_to_rank0=sigterm_to_rank0)
    finally:
        if code == 0 or not any(logs.iterdir()):  # nothing to look at: a success, or refused before any rank ran
            shutil.rmtree(logs, ignore_errors=True)
    return code
