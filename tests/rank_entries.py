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


# torch.distributed's calls the runner makes, counted by `counted` (send and recv: a payload longer than its block
# after comm.collectives.gather_bytes' gather)
COUNTED_COLLECTIVES = ("all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
                       "gather", "reduce_scatter_tensor", "barrier", "send", "recv", "broadcast_object_list",
                       "gather_object", "all_gather_object", "scatter_object_list")


def counted(inner, record_dir: str, **kwargs):
    """inner(**kwargs) with every torch.distributed collective this rank calls counted, by step: this rank's steps to
    record_dir/rank{R}.json as [{"decode": every DP index's batch is one token per sequence (and some sequence
    runs), "logit_rows": per DP index, "calls": [[collective, site, bytes sent], ...]}, ...]. A step's calls run
    from its Worker.execute to the next one's (its results' gather and the next plan's broadcast among them); those
    before the first step are dropped. site: the qualified name of the innermost function of the package, outside comm/collectives.py, that
    made the call (e.g. "ep_dispatch", "ParallelLMHead.__call__"); bytes: the tensors this rank hands the call (0
    for the object collectives, which pickle)."""
    import sys

    import torch
    import torch.distributed as dist

    from dsconv.runner.engine.worker import Worker

    steps: list[dict] = []

    package = str(Path(__file__).resolve().parents[1])  # the repository root is the package's directory
    outside = (str(Path(package, "tests")), str(Path(package, "comm", "collectives.py")))

    def site() -> str:
        frame = sys._getframe(2)
        while frame is not None:
            path, code = frame.f_code.co_filename, frame.f_code
            if path.startswith(package) and not path.startswith(outside) and not _private(code.co_name):
                return code.co_qualname
            frame = frame.f_back
        return "?"

    def tensor_bytes(args) -> int:
        tensors = [a for a in args if torch.is_tensor(a)] + [t for a in args if isinstance(a, list)
                                                              for t in a if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def wrap(name, call):
        def counting(*args, **kw):
            if steps:
                sent = args[1:2] if name in ("all_to_all_single", "all_gather_into_tensor", "all_gather") else args[:1]
                nbytes = 0 if name.endswith(("_object", "_object_list")) else tensor_bytes(sent)
                steps[-1]["calls"].append([name, site(), nbytes])
            return call(*args, **kw)
        return counting

    for name in COUNTED_COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))
    execute = Worker.execute

    def stepping(self, batch, plan=None):
        batches = plan if plan is not None else [batch]
        decode = sum(len(b.seq_ids) for b in batches) > 0 and all(
            b.cp is None and b.num_tokens == len(b.seq_ids) for b in batches)
        steps.append({"decode": decode, "calls": [], "logit_rows": [len(b.logit_rows()) for b in batches]})
        return execute(self, batch, plan)

    Worker.execute = stepping
    try:
        return inner(**kwargs)
    finally:
        Worker.execute = execute
        rank = dist.get_rank() if dist.is_initialized() else 0
        Path(record_dir, f"rank{rank}.json").write_text(json.dumps(steps))


def dispatch_padding(then, pad_bytes: int, **kwargs):
    """then(**kwargs) with the MoE's counted dispatch allowed pad_bytes of padded blocks on CPU (models/moe.py,
    DISPATCH_PAD_BYTES): 0 sends every dispatch's counts first."""
    from dsconv.runner.models import moe

    moe.DISPATCH_PAD_BYTES["cpu"] = pad_bytes
    return then(**kwargs)


def quantize_on_arrival(then, **kwargs):
    """then(**kwargs) with the MoE's W8A8 dispatch sending each row in the compute dtype and its receiver quantizing
    it (models/moe.py's dispatch quantizes before sending)."""
    from dsconv.runner.models import moe

    columns, run_local = moe.dispatch_columns, moe._run_local

    def arriving(received, local, dist, out_dtype):
        if local.int8:  # [rows, local ids] -> [INT8 rows, their scales, local ids]
            received = [*moe.quantize_activations(received[0]), received[1]]
        return run_local(received, local, dist, out_dtype)

    moe.dispatch_columns = lambda rows, local_ids, int8: columns(rows, local_ids, False)
    moe._run_local = arriving
    return then(**kwargs)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


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
