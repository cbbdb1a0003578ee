"""What every rank runs: map its shards, build the model, generate its attention-DP share of the prompts.

Prompt i belongs to attention-DP index i % dp; the attention-TP ranks of that index run it together. Rank 0
owns the console (it streams its own sequences' text); each rank whose attention-TP index is 0 writes its
sequences' results for the launcher to collect.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dsconv.convert.arch import family_for
from dsconv.errors import InputError
from dsconv.runner.dist import Dist
from dsconv.runner.generate import greedy
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
    rank, dist, model, new_cache = start_rank(shards, manifest, dtype, device)
    mine = dp_share(len(prompts), manifest, rank)
    cache = new_cache(cache_tokens)

    printer = _Streamer(stream_tokenizer) if rank == 0 and stream_tokenizer else None
    steps: list[float] = []

    def on_token(seq: int, token: int) -> None:
        steps.append(time.perf_counter())
        if printer is not None and seq == 0:
            printer.add(token)

    started = time.perf_counter()
    outputs = greedy(model, cache, [prompts[i] for i in mine], max_new_tokens, eos_id, on_token, dist)
    if printer is not None:
        printer.close()
    first = steps[0] if steps else started
    result = {"rank": rank, "prompts": mine if dist.attn_tp_rank == 0 else [], "generated": outputs,
              "prefill_s": first - started, "decode_s": (steps[-1] - first) if steps else 0.0,
              "comm_s": dist.comm_seconds, "steps": dist.steps}
    gather_results(result, rank, result_dir)


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
