"""Rank entries the tests launch (light imports: every rank of a 16-rank test imports this module): dsrun's rank
functions with rank 0's return value written to a file for the test process to read. dsrun itself writes no such
file; its rank 0 prints."""

import dataclasses
import json
from pathlib import Path


def recorded(entry, record_path: str, **kwargs) -> None:
    """entry(**kwargs) on this rank; rank 0's result (a dict or a dataclass) to record_path as JSON."""
    result = entry(**kwargs)
    if result is not None:
        record = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result
        Path(record_path).write_text(json.dumps(record))
