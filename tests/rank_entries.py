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


def one_after_another(run, prompts: list[list[int]], max_new_tokens: int, dp_rank: int = 0) -> dict | None:
    """Every rank: the prompts through one engine, each submitted on rank 0 when the one before has finished, all on
    attention-DP rank `dp_rank` (so a later one can find an earlier one's blocks in that rank's prefix cache) ->
    rank 0: {"generated": tokens per prompt, "cached": cached prompt tokens per prompt, "cp_prefills": how many
    prompts a context-parallel group prefilled}."""
    from dsconv.runner.engine.core import EngineClient, start_engine
    from dsconv.runner.engine.request import SamplingParams

    engine = start_engine(run)
    if not engine.leads:
        engine.run()
        return None
    door = EngineClient()
    door.open(engine)
    generated, cached = [[] for _ in prompts], [0] * len(prompts)

    def submit(index: int) -> None:
        def on_output(out) -> None:
            generated[index].extend(out.new_token_ids)
            cached[index] = out.cached_tokens
            if out.finished and index + 1 < len(prompts):
                submit(index + 1)

        door.submit(prompts[index], SamplingParams(max_tokens=max_new_tokens), on_output, dp_rank=dp_rank)

    submit(0)
    engine.run(door, until_idle=True)
    return {"generated": generated, "cached": cached, "cp_prefills": engine.scheduler.cp_prefills}
