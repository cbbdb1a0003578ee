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
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from dsconv.comm.launch import launch
from dsconv.console import console
from dsconv.errors import InputError
from dsconv.family.text import TextTokenizer
from dsconv.runner.engine.config import RunConfig
from dsconv.runner.engine.core import EngineClient, start_engine
from dsconv.runner.engine.request import RequestOutput, SamplingParams, check_prompt, resolve_max_model_len
from dsconv.runner.entrypoints.options import EngineOptions

SCORE = SamplingParams(max_tokens=0, prompt_logprobs=0)  # each prompt token's logprob, no top entries, no output


@dataclass(frozen=True)
class PerplexityOptions:
    """`dsrun perplexity`'s options (runner/cli.py says what each means)."""
    shards: Path
    file: Path
    context: int
    json_output: bool
    engine: EngineOptions  # the engine flags perplexity takes (options.PERPLEXITY)


def main(o: PerplexityOptions) -> int:
    """The command: the file read and cut into windows, the run sized for one window per DP rank at a time, the ranks
    launched -> the job's exit code."""
    started, e = time.time(), o.engine
    run = e.run_config(o.shards, "perplexity", max_num_seqs=1, max_model_len=None)
    text = _read(o.file)
    run.check_holds(e.max_model_len)
    model_len = resolve_max_model_len(e.max_model_len, run.max_position_embeddings,
                                      None if e.kv_cache_memory_bytes is None else run.cache_tokens)
    cut = windows(TextTokenizer.load(run.shards, run.model_config).encode(text), o.context)
    if not cut:
        raise InputError(f"--file {o.file} is one token: nothing to score")
    longest = max(map(len, cut))
    if e.kv_cache_memory_bytes is not None and longest > run.cache_tokens:
        raise InputError(f"windows of up to {longest} tokens exceed the KV cache's {run.cache_tokens} tokens "
                         f"({run.cache_flag}): lower --context or raise the budget")
    for window in cut:  # each window is scored as a prompt of the engine
        check_prompt(window, 0, run.vocab_size, model_len)
    # A DP rank scores one window at a time, with a token budget of one window (and, unless a byte budget says
    # otherwise, a cache of one window): a step's logits are one window's at most, never a [tokens, vocab] tensor of
    # the file.
    if e.kv_cache_memory_bytes is None:
        run = replace(run, cache=replace(run.cache, tokens=longest))
    run = replace(run, scheduler=replace(run.scheduler, max_num_batched_tokens=longest))
    return launch(rank_main, {"run": run, "windows": cut, "context": o.context, "json_output": o.json_output,
                              "started_at": started}, world_size=run.layout.world_size, device=run.device,
                  timeout_s=e.timeout)


def _read(file: Path) -> str:
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise InputError(f"--file {file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"--file {file} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if not text.strip():
        raise InputError(f"--file {file} holds no text")
    return text


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
