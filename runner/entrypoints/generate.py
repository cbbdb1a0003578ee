"""What every rank runs: map its shards, build the model, and run `dsrun generate`'s prompts through the
serving engine's loop (rank 0 schedules and streams the first prompt's text; the others follow its steps).
Every rank's timings go to rank 0, which writes them for the launcher to collect.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from dsconv.runner.engine.client import EngineClient
from dsconv.runner.engine.core import EngineCore, follow
from dsconv.runner.engine.detokenizer import Detokenizer
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.engine.scheduler import Scheduler
from dsconv.runner.engine.worker import Worker, start_rank
from dsconv.runner.entrypoints.ranks import gather_results


def rank_main(shards: str, manifest: dict, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
              dtype: str, cache_tokens: int, result_dir: str, stream_tokenizer: str | None = None,
              device: str = "cpu", kv_cache_dtype: str = "auto", cp_size: int = 1,
              cp_min_tokens: int | None = None, max_model_len: int | None = None) -> None:
    """`dsrun generate`: the serving engine's loop with every prompt submitted at the start (prompt i pinned to
    attention-DP index i % dp), greedy, until all have finished; with cp_size > 1, prompts of at least
    cp_min_tokens tokens are prefilled by context parallelism."""
    rank, dist, model, new_cache = start_rank(shards, manifest, dtype, device, cp_size)
    layout = manifest["layout"]
    worker = Worker(model, new_cache(cache_tokens, kv_cache_dtype), dist, dp_index=rank // layout["attn_tp"])
    result = {"rank": rank, "prompts": [], "generated": [], "prefill_s": 0.0, "decode_s": 0.0}
    if rank == 0:
        result.update(_generate_on_rank0(worker, manifest, prompts, max_new_tokens, eos_id, stream_tokenizer,
                                         cp_size, cp_min_tokens, max_model_len))
    elif torch.distributed.is_initialized():
        follow(worker)
    result.update(comm_s=dist.comm_seconds, steps=dist.steps)
    gather_results(result, rank, result_dir)


def _generate_on_rank0(worker: Worker, manifest: dict, prompts, max_new_tokens, eos_id, stream_tokenizer,
                       cp_size: int = 1, cp_min_tokens: int | None = None, max_model_len: int | None = None) -> dict:
    cache, layout, config = worker.cache, manifest["layout"], manifest["model"]["config"]
    scheduler = Scheduler(layout["dp"], cache.num_blocks, cache.block_size, max_num_seqs=max(1, len(prompts)),
                          max_num_batched_tokens=max(1, sum(map(len, prompts))), eos_token_id=eos_id,
                          cp_size=cp_size, cp_min_tokens=cp_min_tokens)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    client = EngineClient(EngineCore(scheduler, worker, world, layout["attn_tp"]), vocab_size=config["vocab_size"],
                          max_model_len=max_model_len or config["max_position_embeddings"])
    printer = _Streamer(stream_tokenizer) if stream_tokenizer else None
    generated: list[list[int]] = [[] for _ in prompts]
    stamps: list[float] = []

    def on_output(index: int, out) -> None:
        stamps.extend(time.perf_counter() for _ in out.new_token_ids)
        generated[index].extend(out.new_token_ids)
        if printer is not None and index == 0:
            for token in out.new_token_ids:
                printer.add(token)

    started = time.perf_counter()
    client.set_ready()
    for index, prompt in enumerate(prompts):
        client.submit(prompt, SamplingParams(max_tokens=max_new_tokens), partial(on_output, index),
                      dp_rank=index % layout["dp"])
    client.run(until_idle=True)
    if printer is not None:
        printer.close()
    first = stamps[0] if stamps else started
    return {"prompts": list(range(len(prompts))), "generated": generated, "prefill_s": first - started,
            "decode_s": (stamps[-1] - first) if stamps else 0.0, "cp_prefills": scheduler.cp_prefills}


class _Streamer:
    """Prints the text of one sequence as its tokens arrive, a whole character at a time."""

    def __init__(self, tokenizer_path: str):
        from tokenizers import Tokenizer

        self.detokenizer = Detokenizer(Tokenizer.from_file(tokenizer_path), skip_special_tokens=True)
        self.printed = 0

    def add(self, token: int) -> None:
        self.detokenizer.add([token])
        self._print()

    def close(self) -> None:
        self.detokenizer.flush()
        self._print()
        print(flush=True)

    def _print(self) -> None:
        text = self.detokenizer.text
        if len(text) > self.printed:
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)
