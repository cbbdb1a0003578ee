"""`dsrun perplexity`: how well the model predicts a text, as a client of the serving engine like `generate`.

The text's ids, as family/text.py encodes any text (BOS in front where the tokenizer's config says so), are cut
into consecutive windows of `context` tokens;
every token after the first of its window is scored given the window's earlier tokens, and
perplexity = exp(mean negative log-likelihood) over all scored tokens (llama.cpp's `llama-perplexity` scores
the second half of each window only; here every position after the first counts, which is what
`exp(loss)` of a causal LM over the same windows gives).

Each window is a prompt the engine scores and generates nothing for (prompt logprobs, max_tokens 0): rank 0
submits window i to attention-DP index i % dp, sums the negative log-likelihood from the logprobs it gets back
and prints the figure; the other ranks follow its steps. A DP rank runs one window at a time, with a cache and a
token budget of one window, so a step's logits are one window's at most, never a [tokens, vocab] tensor of the
file.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
from tqdm import tqdm

from dsconv.console import console
from dsconv.errors import InputError
from dsconv.runner.engine.config import RunConfig
from dsconv.runner.engine.core import EngineClient, start_engine
from dsconv.runner.engine.shapes import recorder_for
from dsconv.runner.engine.request import RequestOutput, SamplingParams

SCORE = SamplingParams(max_tokens=0, prompt_logprobs=0)  # each prompt token's logprob, no top entries, no output


def windows(ids: list[int], context: int) -> list[list[int]]:
    """ids -> consecutive windows of `context` tokens; a last window of one token scores nothing and is
    dropped."""
    if context < 2:
        raise InputError(f"--context {context} must be at least 2 (a window's first token is never scored)")
    cut = [ids[start:start + context] for start in range(0, len(ids), context)]
    return [window for window in cut if len(window) > 1]


def score(run: RunConfig, windows: list[list[int]], progress: bool = False) -> dict | None:
    """Every rank: every window through the engine -> on rank 0 {"perplexity", "tokens" (scored), "nll" (their
    summed negative log-likelihood), "context_parallel_prefills"}; None on the other ranks."""
    engine = start_engine(run)
    if not engine.leads:
        engine.run()
        return None
    engine.shapes = recorder_for(run, "perplexity")
    door = EngineClient()
    door.open(engine)
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

    for index, window in enumerate(windows):
        door.submit(window, SCORE, on_output, dp_rank=index % run.layout.dp)
    engine.run(door, until_idle=True)
    if bar is not None:
        bar.close()
    expected = sum(len(window) - 1 for window in windows)
    if totals["tokens"] != expected:
        raise RuntimeError(f"the engine scored {totals['tokens']} of the windows' {expected} tokens")
    return {"perplexity": math.exp(totals["nll"] / totals["tokens"]), **totals,
            "context_parallel_prefills": engine.scheduler.cp_prefills}


def rank_main(run: RunConfig, windows: list[list[int]], context: int, json_output: bool, started_at: float) -> None:
    """`dsrun perplexity`'s ranks: rank 0 prints the figure (started_at: the command's start, time.time())."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"dsrun: {run.cache_summary()}", file=sys.stderr, flush=True)
    summary = score(run, windows, progress=not json_output)
    if summary is None:
        return
    summary.update(windows=len(windows), context=context, seconds=time.time() - started_at,
                   overlap_shared_experts=run.overlap_shared_experts)
    if json_output:
        print(json.dumps(summary), flush=True)
        return
    console.print(f"perplexity [bold]{summary['perplexity']:.4f}[/] over {summary['tokens']} tokens "
                  f"({len(windows)} windows of up to {context}); {summary['seconds']:.1f} s; {run.overlap_summary}",
                  highlight=False)
