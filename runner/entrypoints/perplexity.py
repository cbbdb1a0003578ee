"""`dsrun perplexity`: how well the model predicts a text, as a client of the serving engine like `generate`.

The text's tokens (no special tokens) with BOS in front are cut into consecutive windows of `context` tokens;
every token after the first of its window is scored given the window's earlier tokens, and
perplexity = exp(mean negative log-likelihood) over all scored tokens (llama.cpp's `llama-perplexity` scores
the second half of each window only; here every position after the first counts, which is what
`exp(loss)` of a causal LM over the same windows gives).

Each window is a prompt the engine scores and generates nothing for (prompt logprobs, max_tokens 0): rank 0
submits window i to attention-DP index i % dp and sums the negative log-likelihood from the logprobs it gets
back; the other ranks follow its steps. A DP rank runs one window at a time, with a cache and a token budget
of one window, so a step's logits are one window's at most, never a [tokens, vocab] tensor of the file.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from tqdm import tqdm

from dsconv.errors import InputError
from dsconv.runner.engine.client import EngineClient
from dsconv.runner.engine.core import EngineCore, follow
from dsconv.runner.engine.request import RequestOutput, SamplingParams
from dsconv.runner.engine.scheduler import Scheduler
from dsconv.runner.engine.worker import Worker, start_rank
from dsconv.runner.entrypoints.ranks import gather_results

SCORE = SamplingParams(max_tokens=0, prompt_logprobs=0)  # each prompt token's logprob, no top entries, no output


def windows(ids: list[int], context: int) -> list[list[int]]:
    """ids (BOS first) -> consecutive windows of `context` tokens; a last window of one token scores nothing
    and is dropped."""
    if context < 2:
        raise InputError(f"--context {context} must be at least 2 (a window's first token is never scored)")
    cut = [ids[start:start + context] for start in range(0, len(ids), context)]
    return [window for window in cut if len(window) > 1]


def rank_main(shards: str, manifest: dict, windows: list[list[int]], dtype: str, result_dir: str,
              device: str = "cpu", progress: bool = False, kv_cache_dtype: str = "auto", cp_size: int = 1,
              cp_min_tokens: int | None = None, max_model_len: int | None = None) -> None:
    rank, dist, model, new_cache = start_rank(shards, manifest, dtype, device, cp_size)
    longest = max(map(len, windows))
    worker = Worker(model, new_cache(longest, kv_cache_dtype), dist, dp_index=rank // manifest["layout"]["attn_tp"])
    result = {"rank": rank, "nll": 0.0, "tokens": 0}
    started = time.perf_counter()
    if rank == 0:
        result.update(_score_on_rank0(worker, manifest, windows, longest, progress, cp_size, cp_min_tokens,
                                                max_model_len))
    elif torch.distributed.is_initialized():
        follow(worker)
    result["seconds"] = time.perf_counter() - started
    gather_results(result, rank, result_dir)


def _score_on_rank0(worker: Worker, manifest: dict, windows: list[list[int]], longest: int, progress: bool,
                    cp_size: int = 1, cp_min_tokens: int | None = None, max_model_len: int | None = None) -> dict:
    """Every window through the engine -> {"nll": summed over the scored tokens, "tokens": their count, and how
    many windows a context-parallel group prefilled}."""
    cache, layout, config = worker.cache, manifest["layout"], manifest["model"]["config"]
    scheduler = Scheduler(layout["dp"], cache.num_blocks, cache.block_size, max_num_seqs=1,
                          max_num_batched_tokens=longest, eos_token_id=None, cp_size=cp_size,
                          cp_min_tokens=cp_min_tokens)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    client = EngineClient(EngineCore(scheduler, worker, world, layout["attn_tp"]), vocab_size=config["vocab_size"],
                          max_model_len=max_model_len or config["max_position_embeddings"])
    bar = tqdm(total=len(windows), unit="window", desc="perplexity", file=sys.stderr, dynamic_ncols=True) \
        if progress else None
    totals = {"nll": 0.0, "tokens": 0}

    def on_output(out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:  # once per window: None for its first token, then one per token
            scored = out.prompt_logprobs[1:]
            totals["nll"] -= sum(entry.logprob for entry in scored)
            totals["tokens"] += len(scored)
        if out.finished and bar is not None:
            bar.update(1)

    client.set_ready()
    for index, window in enumerate(windows):
        client.submit(window, SCORE, on_output, dp_rank=index % layout["dp"])
    client.run(until_idle=True)
    if bar is not None:
        bar.close()
    expected = sum(len(window) - 1 for window in windows)
    if totals["tokens"] != expected:
        raise RuntimeError(f"the engine scored {totals['tokens']} of the windows' {expected} tokens")
    return {**totals, "cp_prefills": scheduler.cp_prefills}


def summarize(records: list[dict]) -> dict:
    nll, tokens = sum(r["nll"] for r in records), sum(r["tokens"] for r in records)
    return {"perplexity": math.exp(nll / tokens), "tokens": tokens, "nll": nll,
            "context_parallel_prefills": sum(r.get("cp_prefills", 0) for r in records)}
