"""`dsrun perplexity`: how well the model predicts a text, scored on every rank like `generate`.

The text's tokens (no special tokens) with BOS in front are cut into consecutive windows of `context` tokens;
every token after the first of its window is scored given the window's earlier tokens, and
perplexity = exp(mean negative log-likelihood) over all scored tokens (llama.cpp's `llama-perplexity` scores
the second half of each window only; here every position after the first counts, which is what
`exp(loss)` of a causal LM over the same windows gives). Window i belongs to attention-DP index i % dp; a
rank holds one window's cache and one window's logits at a time, never a [tokens, vocab] tensor of the file.
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dsconv.errors import InputError
from dsconv.runner.engine.worker import start_rank
from dsconv.runner.entrypoints.ranks import dp_share, gather_results

SEQ_ID = 0  # a rank scores one window at a time, as one sequence of its cache


def windows(ids: list[int], context: int) -> list[list[int]]:
    """ids (BOS first) -> consecutive windows of `context` tokens; a last window of one token scores nothing
    and is dropped."""
    if context < 2:
        raise InputError(f"--context {context} must be at least 2 (a window's first token is never scored)")
    cut = [ids[start:start + context] for start in range(0, len(ids), context)]
    return [window for window in cut if len(window) > 1]


def window_nll(logits: torch.Tensor, window: list[int]) -> float:
    """logits [len(window), vocab] -> the summed negative log-likelihood of window[1:], in float64."""
    targets = torch.tensor(window[1:], device=logits.device)
    log_probs = F.log_softmax(logits[:-1].float(), dim=-1)  # [len - 1, vocab]
    return -log_probs.gather(1, targets[:, None]).double().sum().item()


@torch.inference_mode()
def score(model, new_cache, my_windows: list[list[int]], dist, on_window=None) -> tuple[float, int]:
    """This rank's windows -> (summed NLL, tokens scored). Every rank steps until no rank has a window left,
    running zero-token steps when it has none, so all ranks enter the same collectives in the same order."""
    cache = new_cache(max((len(w) for w in my_windows), default=1))
    pending, nll, scored = list(my_windows), 0.0, 0
    while dist.any_active(bool(pending)):
        window = pending.pop(0) if pending else []
        meta = cache.step([(SEQ_ID, len(window))] if window else [])
        tokens = torch.tensor(window, dtype=torch.long, device=meta.positions.device)
        logits = model.forward(tokens, meta, cache)  # [len(window), vocab]: every position's logits
        if window:
            nll += window_nll(logits, window)
            scored += len(window) - 1
            cache.release(SEQ_ID)
        if on_window is not None:
            on_window()
    return nll, scored


def rank_main(shards: str, manifest: dict, windows: list[list[int]], dtype: str, result_dir: str,
              device: str = "cpu", progress: bool = False) -> None:
    rank, dist, model, new_cache = start_rank(shards, manifest, dtype, device)
    mine = dp_share(len(windows), manifest, rank)
    # rank 0 shows the whole job's progress: ranks step in lockstep, one window per attention-DP index a step
    bar = tqdm(total=len(windows), unit="window", desc="perplexity", file=sys.stderr, dynamic_ncols=True) \
        if progress and rank == 0 else None
    dp, step = manifest["layout"]["dp"], 0

    def on_window() -> None:
        nonlocal step
        if bar is not None:
            bar.update(min(dp, len(windows) - step * dp))
        step += 1

    started = time.perf_counter()
    nll, scored = score(model, new_cache, [windows[i] for i in mine], dist, on_window)
    if bar is not None:
        bar.close()
    reports = dist.attn_tp_rank == 0  # attention-TP ranks of one DP index score the same windows
    gather_results({"rank": rank, "nll": nll if reports else 0.0, "tokens": scored if reports else 0,
                    "seconds": time.perf_counter() - started}, rank, result_dir)


def summarize(records: list[dict]) -> dict:
    nll, tokens = sum(r["nll"] for r in records), sum(r["tokens"] for r in records)
    return {"perplexity": math.exp(nll / tokens), "tokens": tokens, "nll": nll}
