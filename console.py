"""Console and error conventions shared by every dsconv command: rank-0-style console on stdout, one-line
errors on stderr with exit code 2 for user mistakes."""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import typer
from rich.console import Console
from rich.markup import escape
from tqdm import tqdm

from dsconv.errors import InputError

console = Console()
err_console = Console(stderr=True)

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise InputError(f"--max-file-size {text!r} is not a size like 4GB, 512MiB or 1000000")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise InputError(f"--max-file-size {text!r} must be positive")
    return size


def fail(message: str, code: int = 2) -> None:
    # the message is printed literally: rich reads "[pd]" in "dsconv's [pd] extra" as markup and drops it
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def user_errors():
    """User mistakes become one line and exit 2; Ctrl-C says how to resume and exits 130."""
    try:
        yield
    except InputError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted; run the same command again to resume", 130)
    except OSError as exc:  # disk full, permissions, a path under a file: the system's words, on one line
        where = f"{exc.filename}: " if exc.filename else ""
        fail(f"{where}{exc.strerror or exc}", 1)


@contextmanager
def byte_progress(desc: str, total: int) -> Iterator[Callable[[int], None]]:
    """An `on_progress(n_bytes)` that draws a bar on stderr from its first call, so an error found before any
    work is done (a refused OUT) is printed alone."""
    bar = None

    def update(n: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, dynamic_ncols=True)
        bar.update(n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def resolve_workers(workers: int | None) -> int:
    if workers is not None and workers < 1:
        raise InputError(f"--workers {workers} must be at least 1")
    if workers is not None:
        return workers
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
