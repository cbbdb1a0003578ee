"""What every rank runs: map its shards, build the model, and run `dsrun generate`'s prompts through the
serving engine's loop (rank 0 schedules and streams the first prompt's text; the others follow its steps).
Every rank's timings go to rank 0, which writes them for the launcher to collect.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch

from dsconv.convert.arch import family_for
from dsconv.errors import InputError
from dsconv.kernels.device import flush_denormals
from dsconv.runner.dist import Dist
from dsconv.runner.frontend import EngineClient
from dsconv.runner.loop import EngineCore, Worker, follow
from dsconv.runner.requests import SamplingParams
from dsconv.runner.scheduler import Scheduler
from dsconv.runner.weights import load_rank

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
RESULTS_NAME = "results.json"  # written by rank 0: every rank's sequences and timings


def build_model(shards: Path, manifest: dict, rank: int, dist: Dist, dtype: torch.dtype):
    """-> (model, its config, new_cache(capacity_tokens) -> the cache its forward takes), by the shards' family."""
    config = manifest["model"]["config"]
    family = family_for(config)
    if family.new_model is None or family.new_cache is None:
        raise InputError(f"dsrun has no model for {family.name} shards (the family defines no runner)")
    cfg = family.parse_config(config)
    flush_denormals(dist.device)  # the thread that builds the model is the one that runs it
    weights = load_rank(shards, manifest, rank, dist.device)
    model = family.new_model(cfg, weights, dist, dtype)
    return model, cfg, lambda tokens: family.new_cache(cfg, model, tokens, dist.device)


def rank_device(device: str) -> torch.device:
    """The device this rank computes on: the launcher has already selected its accelerator (set_device)."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device(device, getattr(torch, device).current_device())  # torch.cuda / torch.npu


def start_rank(shards: str, manifest: dict, dtype: str, device: str):
    """On every rank, after the launcher's init_process_group: -> (rank, Dist, model, new_cache)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    dist = Dist.from_layout(manifest["layout"], rank_device(device)) if torch.distributed.is_initialized() \
        else Dist(device=rank_device(device))
    model, _, new_cache = build_model(Path(shards), manifest, rank, dist, DTYPES[dtype])
    return rank, dist, model, new_cache


def dp_share(n_items: int, manifest: dict, rank: int) -> list[int]:
    """The items (prompts, windows) of this rank's attention-DP index: item i belongs to index i % dp."""
    dp, dp_index = manifest["layout"]["dp"], rank // manifest["layout"]["attn_tp"]
    return [i for i in range(n_items) if i % dp == dp_index]


def gather_results(result: dict, rank: int, result_dir: str) -> None:
    """Every rank's result to rank 0, over the process group (no shared filesystem needed across machines);
    rank 0 writes them for the launcher's process to read."""
    everyone = [None] * torch.distributed.get_world_size() if torch.distributed.is_initialized() else [result]
    if torch.distributed.is_initialized():
        torch.distributed.gather_object(result, everyone if rank == 0 else None, dst=0)
    if rank == 0:
        (Path(result_dir) / RESULTS_NAME).write_text(json.dumps(everyone))


def rank_main(shards: str, manifest: dict, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
              dtype: str, cache_tokens: int, result_dir: str, stream_tokenizer: str | None = None,
              device: str = "cpu") -> None:
    """`dsrun generate`: the serving engine's loop with every prompt submitted at the start (prompt i pinned to
    attention-DP index i % dp), greedy, until all have finished."""
    rank, dist, model, new_cache = start_rank(shards, manifest, dtype, device)
    layout = manifest["layout"]
    worker = Worker(model, new_cache(cache_tokens), dist, dp_index=rank // layout["attn_tp"])
    result = {"rank": rank, "prompts": [], "generated": [], "prefill_s": 0.0, "decode_s": 0.0}
    if rank == 0:
        result.update(_generate_on_rank0(worker, manifest, prompts, max_new_tokens, eos_id, stream_tokenizer))
    elif torch.distributed.is_initialized():
        follow(worker)
    result.update(comm_s=dist.comm_seconds, steps=dist.steps)
    gather_results(result, rank, result_dir)


def _generate_on_rank0(worker: Worker, manifest: dict, prompts, max_new_tokens, eos_id, stream_tokenizer) -> dict:
    cache, layout, config = worker.cache, manifest["layout"], manifest["model"]["config"]
    scheduler = Scheduler(layout["dp"], cache.num_blocks, cache.block_size, max_num_seqs=max(1, len(prompts)),
                          max_num_batched_tokens=max(1, sum(map(len, prompts))), eos_token_id=eos_id)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    client = EngineClient(EngineCore(scheduler, worker, world, layout["attn_tp"]), vocab_size=config["vocab_size"],
                          max_model_len=config["max_position_embeddings"])
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
            "decode_s": (stamps[-1] - first) if stamps else 0.0}


class _Streamer:
    """Prints the text of one sequence as its tokens arrive (decoding the whole tail, so multi-byte
    characters split across tokens come out whole)."""

    def __init__(self, tokenizer_path: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.tokens: list[int] = []
        self.printed = ""

    def add(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if not text.endswith("\ufffd"):
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text

    def close(self) -> None:
        print(flush=True)
