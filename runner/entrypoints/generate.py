"""`dsrun generate`: `main` checks the options, sizes the run and launches its ranks; on every rank (`rank_main`) the
engine is built from the run's shards, every prompt submitted at the start (prompt i pinned to attention-DP index
i % dp, all of a rank's prompts running at once), greedy unless sampling is asked for, until all have finished.
Rank 0 streams the first prompt's text as it comes, then prints the others and the closing line (or the --json
object); the other ranks follow its steps.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from rich.markup import escape

from dsconv.comm.launch import launch
from dsconv.console import console
from dsconv.errors import InputError
from dsconv.family.text import Detokenizer, TextTokenizer
from dsconv.runner.engine.config import RunConfig
from dsconv.runner.engine.core import EngineClient, start_engine
from dsconv.runner.engine.request import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob, check_prompt, \
    resolve_max_model_len
from dsconv.runner.entrypoints.options import EngineOptions
from dsconv.runner.models.kv_cache import cache_blocks


@dataclass(frozen=True)
class GenerateOptions:
    """`dsrun generate`'s options (runner/cli.py says what each means)."""
    prompt: list[str]
    shards: Path | None
    max_new_tokens: int
    json_output: bool
    no_chat: bool
    thinking: bool
    system: str | None
    logprobs: int | None
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    engine: EngineOptions  # the engine flags generate takes (options.GENERATE)

    @property
    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed}


def main(o: GenerateOptions) -> int:
    """The command: the options checked, the run sized to hold every prompt at once, the ranks launched -> the job's
    exit code."""
    started = time.time()
    _check(o)
    run = _open(o)
    text = TextTokenizer.load(run.shards, run.model_config)
    prompts = [_prompt_ids(text, p, run.family, o) for p in o.prompt]
    run = _sized(run, prompts, o)
    return launch(rank_main, {"run": run, "prompts": prompts, "max_new_tokens": o.max_new_tokens,
                              "logprobs": o.logprobs, "json_output": o.json_output, "started_at": started,
                              "sampling": o.sampling},
                  world_size=run.layout.world_size, device=run.device, timeout_s=o.engine.timeout)


def _check(o: GenerateOptions) -> None:
    if o.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {o.max_new_tokens} must be at least 1")
    if o.no_chat and (o.thinking or o.system is not None):
        raise InputError("--thinking and --system shape the chat prompt; they cannot be used with --no-chat")
    if o.system is not None and not o.system.strip():
        raise InputError("--system is empty")
    if o.logprobs is not None and not 0 <= o.logprobs <= MAX_TOP_LOGPROBS:
        raise InputError(f"--logprobs {o.logprobs} must be between 0 and {MAX_TOP_LOGPROBS}")
    if o.logprobs is not None and not o.json_output:
        raise InputError("--logprobs goes with --json (the text output has no place for them)")
    SamplingParams(max_tokens=o.max_new_tokens, **o.sampling)  # its checks, before any rank starts


def _open(o: GenerateOptions) -> RunConfig:
    shards = o.shards
    if shards is None:
        from dsconv.shard.demo import announced_demo_shards  # the converter is imported only for the demo

        shards = announced_demo_shards("running")
    run = o.engine.run_config(shards, "generate", max_num_seqs=1, max_model_len=None)
    # every prompt runs at once, prompt i on attention-DP rank i % dp: a byte budget keeps a sequence slot for each
    # of a rank's prompts
    return run.with_max_num_seqs(-(-len(o.prompt) // run.layout.dp))


def _prompt_ids(text: TextTokenizer, prompt: str, family, o: GenerateOptions) -> list[int]:
    if not prompt.strip():
        raise InputError("--prompt is empty")
    if o.no_chat:
        return text.encode(prompt)
    messages = [{"role": "system", "content": o.system}] if o.system is not None else []
    return text.encode_chat(family, messages + [{"role": "user", "content": prompt}], o.thinking)


def _sized(run: RunConfig, prompts: list[list[int]], o: GenerateOptions) -> RunConfig:
    """The run with every prompt admitted at once and prefilled in one step, once the cache is known to hold them
    all (prompt i on attention-DP index i % dp, where rank_main submits it)."""
    run.check_holds(o.engine.max_model_len)
    model_len = resolve_max_model_len(o.engine.max_model_len, run.max_position_embeddings, run.cache_tokens)
    dp, block_size = run.layout.dp, run.cache.block_size
    need = max(sum(cache_blocks(len(p) + o.max_new_tokens, block_size) for p in prompts[index::dp])
               for index in range(dp))
    if need > run.cache_blocks:
        raise InputError(f"prompts + --max-new-tokens need {need} blocks of {block_size} tokens on one "
                         f"attention-DP rank, which exceed the KV cache's {run.cache_blocks} ({run.cache_flag})")
    for ids in prompts:
        check_prompt(ids, o.max_new_tokens, run.vocab_size, model_len)
    return replace(run, max_model_len=model_len,
                   scheduler=replace(run.scheduler, max_num_batched_tokens=sum(map(len, prompts))))


@dataclass
class Generated:
    """Rank 0's account of a run: each prompt's new tokens, when they came, and every rank's share of the work."""
    generated: list[list[int]]
    logprobs: list[list[TokenLogprob]] | None = None  # per prompt, one per new token (--logprobs)
    prefill_s: float = 0.0  # from the first step to the first token
    decode_s: float = 0.0  # from the first token to the last
    cp_prefills: int = 0  # prompts a context-parallel group prefilled
    cached_tokens: list[int] = field(default_factory=list)  # per prompt: its tokens found in the prefix cache
    ranks: list[dict] = field(default_factory=list)  # per rank: comm_s (inside collectives), steps
    speculative: dict | None = None  # --speculative-config: the drafts, accepted ones, mean acceptance length
    eplb: list[dict] | None = None  # --enable-eplb: each rebalance's step, balancedness measured and planned


def generate(run: RunConfig, prompts: list[list[int]], max_new_tokens: int, on_token=None,
             logprobs: int | None = None, sampling: dict | None = None) -> Generated | None:
    """Every rank: the prompts through the engine -> rank 0's account (None on the other ranks). sampling:
    SamplingParams' temperature, top_p, top_k and seed (default greedy); prompt i draws with seed + i. on_token(index,
    token) is called on rank 0 as each token comes; logprobs: also each new token's logprob and this many top
    entries."""
    engine = start_engine(run)
    result = None
    if engine.leads:
        door = EngineClient()
        door.open(engine)
        result = Generated([[] for _ in prompts], None if logprobs is None else [[] for _ in prompts])
        stamps: list[float] = []

        result.cached_tokens = [0] * len(prompts)

        def on_output(index: int, out) -> None:
            result.cached_tokens[index] = out.cached_tokens
            stamps.extend(time.perf_counter() for _ in out.new_token_ids)
            result.generated[index].extend(out.new_token_ids)
            if result.logprobs is not None:
                result.logprobs[index].extend(out.new_logprobs or [])
            if on_token is not None:
                for token in out.new_token_ids:
                    on_token(index, token)

        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            door.submit(prompt, _params(max_new_tokens, logprobs, sampling, index), partial(on_output, index),
                        dp_rank=index % run.layout.dp)  # as main's _sized sized the cache
        engine.run(door, until_idle=True)
        first = stamps[0] if stamps else started
        result.prefill_s, result.decode_s = first - started, (stamps[-1] - first) if stamps else 0.0
        result.cp_prefills = engine.scheduler.cp_prefills
        if run.speculative is not None:
            spec = engine.scheduler.spec
            result.speculative = {"num_speculative_tokens": run.speculative.num_speculative_tokens,
                                  "num_drafts": spec.drafts, "num_draft_tokens": spec.draft_tokens,
                                  "num_accepted_tokens": spec.accepted_tokens,
                                  "accepted_per_pos": spec.accepted_per_pos or [],
                                  "mean_acceptance_length": spec.mean_acceptance_length}
        balancer = engine.worker.balancer
        if run.eplb is not None:
            result.eplb = [figures.summary() for figures in balancer.history]
    else:
        engine.run()
    ranks = gather_to_rank0({"comm_s": engine.worker.dist.comm_seconds, "steps": engine.worker.steps,
                             "kernel_calls": engine.worker.dist.kernels.calls()})
    if result is not None:
        result.ranks = ranks
    return result


def _kernel_calls(ranks: list[dict]) -> dict[str, int]:
    """--kernels pypto: the PyPTO kernel calls of every rank, by kernel name."""
    total: dict[str, int] = {}
    for rank in ranks:
        for name, count in rank["kernel_calls"].items():
            total[name] = total.get(name, 0) + count
    return total


def gather_to_rank0(record: dict) -> list[dict] | None:
    """Every rank's record on rank 0, over the process group (None elsewhere)."""
    if not torch.distributed.is_initialized():
        return [record]
    rank = torch.distributed.get_rank()
    everyone = [None] * torch.distributed.get_world_size() if rank == 0 else None
    torch.distributed.gather_object(record, everyone, dst=0)
    return everyone


def _params(max_new_tokens: int, logprobs: int | None, sampling: dict | None, index: int) -> SamplingParams:
    """Prompt `index`'s SamplingParams: a given seed shifted by the prompt's index, so that equal prompts differ."""
    sampling = dict(sampling or {})
    if sampling.get("seed") is not None:
        sampling["seed"] += index
    return SamplingParams(max_tokens=max_new_tokens, logprobs=logprobs, **sampling)


def rank_main(run: RunConfig, prompts: list[list[int]], max_new_tokens: int, json_output: bool,
              started_at: float, logprobs: int | None = None, sampling: dict | None = None) -> None:
    """`dsrun generate`'s ranks (started_at: the command's start, time.time())."""
    tokenizer = printer = None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"dsrun: {run.cache_summary()}", file=sys.stderr, flush=True)
        if run.speculative is not None:
            print(f"dsrun: {run.speculative.summary}", file=sys.stderr, flush=True)
        tokenizer = TextTokenizer.load(run.shards, run.model_config)
        printer = None if json_output else _Streamer(tokenizer)

    def stream_first(index: int, token: int) -> None:
        if index == 0:
            printer.add(token)

    result = generate(run, prompts, max_new_tokens, on_token=None if printer is None else stream_first,
                      logprobs=logprobs, sampling=sampling)
    if result is None:
        return
    if printer is not None:
        printer.close()
    _report(result, prompts, tokenizer, json_output, time.time() - started_at, run.overlap_shared_experts)


def _report(result: Generated, prompts: list[list[int]], tokenizer: TextTokenizer, json_output: bool,
            seconds: float, overlap: bool) -> None:
    prefill_tps = sum(map(len, prompts)) / result.prefill_s if result.prefill_s else 0.0
    decoded = sum(len(g) - 1 for g in result.generated if g)
    decode_tps = decoded / result.decode_s if result.decode_s else 0.0
    if json_output:
        report = {"prompt_token_ids": prompts, "generated_token_ids": result.generated,
                  "text": [tokenizer.decode(o) for o in result.generated],
                  "timings": {"prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
                              "wall_s": seconds},
                  "context_parallel_prefills": result.cp_prefills, "overlap_shared_experts": overlap,
                  "cached_prompt_tokens": result.cached_tokens, "speculative": result.speculative,
                  "eplb": result.eplb, "kernel_calls": _kernel_calls(result.ranks)}
        if result.logprobs is not None:  # per prompt and new token: {"token_id", "logprob", "top_logprobs"}
            report["logprobs"] = [[{"token_id": lp.token_id, "logprob": lp.logprob,
                                    "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top.items()]}
                                   for lp in per_prompt] for per_prompt in result.logprobs]
        print(json.dumps(report, ensure_ascii=False), flush=True)
        return
    for i, out in list(enumerate(result.generated))[1:]:  # the first prompt was streamed; show the rest
        console.print(f"[bold]prompt {i}:[/] {escape(tokenizer.decode(out))}", highlight=False)
    console.print(f"[dim]{sum(map(len, prompts))} prompt tokens ({sum(result.cached_tokens)} cached), "
                  f"{sum(map(len, result.generated))} new tokens; "
                  f"rank 0: prefill {prefill_tps:.1f} tok/s, decode {decode_tps:.1f} tok/s; {seconds:.1f} s wall; "
                  f"shared experts {'overlapped' if overlap else 'not overlapped'}"
                  f"{_speculative_line(result.speculative)}{_eplb_line(result.eplb)}[/]", highlight=False)


def _eplb_line(rebalances: list[dict] | None) -> str:
    if not rebalances:
        return "" if rebalances is None else "; EPLB: no rebalance within the run"
    last = rebalances[-1]
    return (f"; EPLB: {len(rebalances)} rebalances, the last at step {last['step']}: balancedness "
            f"{last['measured']:.3f} measured, {last['planned']:.3f} planned")


def _speculative_line(spec: dict | None) -> str:
    if spec is None:
        return ""
    return (f"; MTP {spec['num_speculative_tokens']} drafts a step: mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f} ({spec['num_accepted_tokens']} of {spec['num_draft_tokens']} "
            f"drafts accepted)")


class _Streamer:
    """Prints the text of one sequence as its tokens arrive, a whole character at a time."""

    def __init__(self, tokenizer: TextTokenizer):
        self.detokenizer = Detokenizer(tokenizer.tokenizer, skip_special_tokens=True)
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
