"""The accuracy gates' evaluation (tests/test_accuracy_gate.py): two shard sets of a trained tiny model, each with
its --kv-cache-dtype, read the same held-out windows through dsrun's model on one rank in float32 compute; the
figures are perplexities, logits cosines and top-1 agreement.

The figures are computed in fresh interpreters (PARTS at once, a share of the windows each) under the same
pinned environment as training (tests.trained.PINNED_CPU_ENV: ATen's baseline kernels, MKL's compatible
path, one thread, glibc's baseline function variants) and, as training, with IEEE's square root for ATen's
vector-math one (tests.trained.IeeeSquareRoot: V4's sqrtsoftplus router), so that every x86-64 CPU gives the same
bits; the test records them and checks that it reproduced them. Evaluated on the kernels a CPU picks for itself, the
per-position figures of the V3.2 cache gates moved with the CPU: a near-tied indexer choice that one rounding
tips is a different key attended (docs/benchmarks.md, "The accuracy gates on every CPU").

    python -m tests.accuracy_gates TOKENIZER EVAL_TOKENS BASE_SHARDS BASE_KV OTHER_SHARDS OTHER_KV PART PARTS

prints one share of a gate's evaluation as one JSON line (run from the repository root; pinned_gate_figures
runs the shares and combines them).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from tests.trained import PINNED_CPU_ENV, IeeeSquareRoot, heldout_texts, unpinned_settings
from tests.helpers import greedy
from dsconv.runner.engine.config import RunConfig
from dsconv.runner.engine.core import start_rank
from dsconv.runner.entrypoints.perplexity import windows
from tests.helpers import Steps, window_nll

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 128  # the training sequence length
PROMPT_TOKENS = 32  # each prompt: BOS + the first tokens of one held-out module
NEW_TOKENS = 64
# How much held-out text each gate reads (tests/test_accuracy_gate.py says why; tests/tools/ evaluates the same)
EVAL_TOKENS = 4096  # held-out tokens scored by the W8A8 gates (32 windows)
CACHE_GATE_WINDOWS = 827  # V3.2's cache and recipe gates: every whole 128-token window of the 105,947 held-out tokens
V4_CACHE_GATE_WINDOWS = 256  # V4's cache gate: the first 256 windows
# Processes per gate, one core each, a share of the windows each (the CI machine's 2 cores); the figures are the
# same bits for any number (figures_of)
PARTS = 2
SQRT_FAMILIES = ("deepseek_v4",)  # the families whose forward computes a square root (takes_square_roots)


def heldout_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text).ids for text in heldout_texts()]


def window_logits(shards, cut: list[list[int]], kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """Every window's logits [len, vocab] from dsrun's model on one rank, in this process, float32."""
    _, model, new_cache = start_rank(RunConfig.open(shards, dtype="float32"))
    out = []
    with torch.inference_mode():
        for window in cut:
            out.append(Steps(new_cache(len(window), kv_cache_dtype)).forward(model, [(0, window)]).float())
    return out


def greedy_tokens(shards, prompts: list[list[int]], kv_cache_dtype: str = "auto") -> list[list[int]]:
    _, model, new_cache = start_rank(RunConfig.open(shards, dtype="float32"))
    with torch.inference_mode():
        return greedy(model, new_cache(sum(len(p) + NEW_TOKENS for p in prompts), kv_cache_dtype), prompts,
                      NEW_TOKENS, None)


def top1_agreement(base: tuple, other: tuple, prompts: list[list[int]]) -> tuple[int, int]:
    """(matched, scored): the positions of the base side's greedy continuations, and how many of them the other
    side, reading the same text, ranks the same token first at (both through the same forward pass). base, other:
    (shards, kv_cache_dtype). Each position is judged on its own, so a near-tie that rounding tips moves one."""
    continuations = greedy_tokens(base[0], prompts, base[1])
    texts = [prompt + continuation for prompt, continuation in zip(prompts, continuations)]
    matched = scored = 0
    for prompt, ref, new in zip(prompts, window_logits(base[0], texts, base[1]),
                                window_logits(other[0], texts, other[1])):
        predicting = slice(len(prompt) - 1, -1)  # the logits that chose each continuation token
        matched += (ref[predicting].argmax(-1) == new[predicting].argmax(-1)).sum().item()
        scored += ref[predicting].shape[0]
    return matched, scored


def gate_share(tokenizer_path, eval_tokens: int, base: tuple, other: tuple, part: int = 0, parts: int = 1) -> dict:
    """One process's share of a gate: base, other: (shards, kv_cache_dtype); the gate's windows are the first
    eval_tokens held-out tokens in windows of CONTEXT tokens, and this share is windows part, part + parts, ...
    -> each one's summed NLL on both sides and its per-position logits cosines; the last share also runs the
    top-1 agreement. Every window is its own forward pass (a fresh cache), so a share computes the same bits for
    its windows as one process computing all."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = [0] + [t for module in heldout_ids(tokenizer) for t in module][:eval_tokens - 1]
    if len(ids) < eval_tokens:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than the {eval_tokens} asked for")
    cut = [w for w in windows(ids, CONTEXT) if len(w) == CONTEXT]
    mine = list(range(part, len(cut), parts))
    share = [cut[i] for i in mine]
    ref, new = window_logits(base[0], share, base[1]), window_logits(other[0], share, other[1])
    cosines = torch.nn.functional.cosine_similarity(torch.stack(ref).double(), torch.stack(new).double(), dim=-1)
    out = {"windows": mine, "of": len(cut), "nll_ref": [window_nll(l, w) for l, w in zip(ref, share)],
           "nll_new": [window_nll(l, w) for l, w in zip(new, share)], "cosines": cosines.tolist()}
    if part == parts - 1:
        prompts = [[0] + module[:PROMPT_TOKENS - 1] for module in heldout_ids(tokenizer)]
        out["agreement"] = top1_agreement(base, other, prompts)
    return out


def figures_of(shares: list[dict]) -> dict:
    """A gate's shares -> perplexities, logits cosines (mean, min, and the worst of the per-position means over
    the windows, with that position's lowest windows), top-1 agreement; every sum in window order, so the figures
    do not depend on how the windows were shared."""
    count = shares[0]["of"]
    rows = {}
    for share in shares:
        rows.update({index: (ref, new, cosines) for index, ref, new, cosines in
                     zip(share["windows"], share["nll_ref"], share["nll_new"], share["cosines"])})
    if sorted(rows) != list(range(count)):
        raise ValueError(f"the shares cover windows {sorted(rows)[:5]}..., not each of the {count} once")
    ordered = [rows[index] for index in range(count)]
    tokens = count * (CONTEXT - 1)
    ppl_ref = math.exp(sum(ref for ref, _, _ in ordered) / tokens)
    ppl_new = math.exp(sum(new for _, new, _ in ordered) / tokens)
    cosines = torch.tensor([row for _, _, row in ordered], dtype=torch.float64)  # [windows, CONTEXT]
    per_position = cosines.mean(0)  # [CONTEXT]: each position's mean over the windows
    worst = per_position.argmin().item()
    lowest = cosines[:, worst].sort().values  # the worst position's windows, lowest first
    [(matched, scored)] = [share["agreement"] for share in shares if "agreement" in share]
    return {"ppl_ref": ppl_ref, "ppl_new": ppl_new, "relative": ppl_new / ppl_ref - 1,
            "cosine_mean": cosines.mean().item(), "cosine_min": cosines.min().item(),
            "position_min": per_position.min().item(), "worst_position": worst,
            "worst_position_lowest": lowest[:3].tolist(), "worst_position_rest": lowest[1:].mean().item(),
            "matched": matched, "scored": scored, "agreement": matched / scored, "windows": count}


def pinned_gate_figures(tokenizer_path, eval_tokens: int, base: tuple, other: tuple, env: dict | None = None,
                        parts: int = PARTS) -> dict:
    """A gate's figures from `parts` fresh interpreters at once, each with PINNED_CPU_ENV over this environment (or
    with the whole environment `env`, to measure what other kernels give) and a share of the windows."""
    args = [str(tokenizer_path), str(eval_tokens), str(base[0]), base[1], str(other[0]), other[1]]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.accuracy_gates", *args, str(part), str(parts)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **PINNED_CPU_ENV} if env is None else env)
             for part in range(parts)]
    shares = []
    for proc in procs:
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            for other_proc in procs:
                other_proc.kill()
            raise RuntimeError(f"the gate's evaluation failed (exit {proc.returncode}):\n{stderr[-4000:]}")
        shares.append(json.loads(stdout.strip().splitlines()[-1]))
    return figures_of(shares)


def gate_report(name: str, figures: dict) -> str:
    lowest = ", ".join(f"{cosine:.4f}" for cosine in figures["worst_position_lowest"])
    return (f"{name}: perplexity {figures['ppl_ref']:.4f} -> {figures['ppl_new']:.4f} ({figures['relative']:+.3%}) "
            f"over {figures['windows']} windows; logits cosine mean {figures['cosine_mean']:.7f} min "
            f"{figures['cosine_min']:.6f}, worst position {figures['position_min']:.6f} (position "
            f"{figures['worst_position']}: lowest windows {lowest}, the others' mean "
            f"{figures['worst_position_rest']:.6f}); top-1 agreement {figures['matched']}/{figures['scored']} "
            f"({figures['agreement']:.4f})")


def takes_square_roots(shards) -> bool:
    """Whether the shards' model computes aten.sqrt in its forward: V4's router does (sqrtsoftplus); V3.2's forward
    takes none (tests/test_accuracy_gate.py checks), and is evaluated without IeeeSquareRoot, whose Python dispatch
    of every op costs about a tenth of a window's time, for the same bits."""
    return json.loads((Path(shards) / "config.json").read_text())["model_type"] in SQRT_FAMILIES


if __name__ == "__main__":
    tokenizer_arg, tokens_arg, base_shards, base_kv, other_shards, other_kv, part_arg, parts_arg = sys.argv[1:]
    # other environments measure the CPU's own arithmetic
    ieee = not unpinned_settings() and any(map(takes_square_roots, (base_shards, other_shards)))
    with IeeeSquareRoot() if ieee else nullcontext():
        share = gate_share(tokenizer_arg, int(tokens_arg), (base_shards, base_kv), (other_shards, other_kv),
                           int(part_arg), int(parts_arg))
    print(json.dumps(share))
