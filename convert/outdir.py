"""Output directories that are crash-safe and resumable, shared by `dsconv quantize` and `dsconv shard`.

OUT holds a job file from the first moment, naming the command and a digest of everything that decides the
output bytes. A re-run of the same job resumes (finished files are kept, `*.partial` leftovers dropped); an
OUT that is not empty and not this job is refused untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsconv.errors import InputError
from dsconv.convert.safetensors_io import write_json_atomic

JOB_FILE = ".dsconv-job.json"
PARTIAL_SUFFIX = ".partial"


def prepare_out(out: Path, src: Path, job: dict) -> None:
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise InputError(f"OUT {out} must not be the source directory or inside it")
    if out.exists() and not out.is_dir():
        raise InputError(f"OUT {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        try:
            previous = json.loads((out / JOB_FILE).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            previous = None
        if not isinstance(previous, dict):
            raise InputError(f"OUT {out} is not empty and holds no dsconv run; choose an empty or new directory")
        if {k: previous.get(k) for k in job} != job:
            raise InputError(f"OUT {out} holds a different dsconv run ({previous.get('command')}: other source, "
                             f"options or layout); choose an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.rglob(f"*{PARTIAL_SUFFIX}"):
        stale.unlink()
    write_json_atomic(out / JOB_FILE, {**job, "complete": False})


def mark_complete(out: Path, job: dict) -> None:
    write_json_atomic(out / JOB_FILE, {**job, "complete": True})
