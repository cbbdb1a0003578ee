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


def profiled(inner, trace_dir: str, **kwargs):
    """inner(**kwargs) under torch.profiler (CPU ops and the package's record_function spans); this rank's trace to
    trace_dir/rank{R}.json (Chrome's trace format)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as trace:
        result = inner(**kwargs)
    rank = dist.get_rank() if dist.is_initialized() else 0
    trace.export_chrome_trace(str(Path(trace_dir) / f"rank{rank}.json"))
    return result
