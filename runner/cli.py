"""`dsrun`: generate text from `dsconv shard` output, or score a text's perplexity, on `world_size` ranks (local
processes, or torchrun's)."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsconv.comm.forkserver import start_rank_server
from dsconv.console import err_console, fail
from dsconv.errors import InputError
from dsconv.family.arch import DEFAULT_BLOCK_SIZE
from dsconv.family.layout import DEFAULT_MAX_NUM_BATCHED_TOKENS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run DeepSeek shards written by `dsconv shard` on their ranks and generate text.")

@app.callback()
def main() -> None:
    """Run DeepSeek shards written by `dsconv shard` on their ranks and generate text."""


def _prompt_ids(text_tokenizer, text: str, family, chat: bool, system: str | None, thinking: bool) -> list[int]:
    if not text.strip():
        raise InputError("--prompt is empty")
    if not chat:
        return text_tokenizer.encode(text)
    messages = [{"role": "system", "content": system}] if system is not None else []
    return text_tokenizer.encode_chat(family, messages + [{"role": "user", "content": text}], thinking)


KV_CACHE_DTYPE_HELP = ("KV cache entries (vLLM's flag): auto keeps them in the compute dtype; int8 stores V3 / "
                       "V3.2's MLA latent (a float32 scale per token and 128 values, the rope key kept in the "
                       "compute dtype) and indexer keys (a scale per token; the indexer scores them INT8 x INT8) "
                       "and dequantizes the latent before attention; for V4 (C8), its compressed entries and "
                       "sliding-window rows (a scale per row, the rotary tail in the compute dtype) and indexer keys.")


CP_SIZE_HELP = ("Context-parallel prefill (vLLM's name): a prompt of at least --prefill-cp-min-tokens tokens is "
                "prefilled in one step by a group of this many attention-DP ranks (its own and the next ones), "
                "each feeding a causal-balanced share of its tokens; decode then continues on its own rank. "
                "Divides the attention-DP size; attention TP 1; V3 / V3.2 only.")
MAX_MODEL_LEN_HELP = ("The most tokens one request may hold, prompt and reply (vLLM's flag). Default: the smaller of "
                      "the model's max_position_embeddings and what one attention-DP rank's KV cache holds; a chat "
                      "request without max_tokens gets what is left after its prompt.")
RECORD_SHAPES_HELP = ("Append one JSON row of what the run's steps covered to this file: prompt lengths, batch size, "
                      "layout, MoE handoff, dtypes, the compression ratios that ran in prefill and decode, and the "
                      "blocks and compression windows crossed (docs/shape_matrix.md is rendered from such rows).")
CP_MIN_TOKENS_HELP = "The shortest prompt a context-parallel group prefills (see --prefill-context-parallel-size)."
# Below V3.2's index_topk (2048) the indexer keeps every key and a prompt's prefill is short: the group's step
# and its per-layer gathers are worth giving for longer ones (docs/benchmarks.md: 4,096 tokens at CP 2).
DEFAULT_CP_MIN_TOKENS = 2048


# torch loads installed device extensions when it is imported (its "torch.backends" entry points): torch_npu,
# installed where Ascend's CANN toolkit is not, makes `import torch` itself fail (its libraries need libhccl.so).
NO_CANN = ("importing torch failed because torch_npu is installed but cannot load ({cause}): torch_npu needs "
           "Ascend's CANN toolkit (libhccl.so and the Ascend runtime; source CANN's set_env.sh). On a machine "
           "without CANN, uninstall torch_npu or set TORCH_DEVICE_BACKEND_AUTOLOAD=0")


def _import_torch() -> None:
    """Imports torch first thing in a command: an installed torch_npu without CANN, which breaks the import, ends
    the command with one line."""
    try:
        import torch  # noqa: F401
    except RuntimeError as exc:
        if "torch_npu" not in str(exc):
            raise
        cause = exc.__cause__ or exc
        fail(NO_CANN.format(cause=f"{type(cause).__name__}: {cause}".replace("\n", " ")))


BLOCK_SIZE_HELP = ("Tokens per KV-cache block (vLLM's flag): a power of two; the default 16 is vLLM's GPU default "
                   "(vllm-ascend runs 128 on Ascend, where its fused kernels take blocks of 128).")
KV_CACHE_MEMORY_HELP = ("KV cache size per attention-DP rank in bytes (vLLM's flag), instead of --cache-tokens: as "
                        "many whole blocks as fit, in the cache's own layout (V4: after a fixed slot per "
                        "--max-num-seqs for its windows and compressor state).")


OVERLAP_HELP = ("Compute each MoE layer's shared expert while its expert exchange travels (the dispatch and combine "
                "are issued asynchronously; on NPU / CUDA the shared expert runs on a second stream). Off: the "
                "shared expert runs after the combine. The tokens are the same either way.")


PREFIX_CACHING_HELP = ("Reuse the KV cache of prompt blocks an earlier request on the same attention-DP rank has "
                       "computed (vLLM's flag and default): a request computes only what follows its longest cached "
                       "run of full --block-size blocks, and usage.prompt_tokens_details.cached_tokens says how many "
                       "it reused.")
SPECULATIVE_HELP = ("Speculative decoding, vLLM's JSON: '{\"method\": \"mtp\", \"num_speculative_tokens\": k}', k 1 "
                    "to 3. The checkpoint's MTP layer drafts k tokens a step for each request and one target step "
                    "verifies them: greedy output is the same as without, sampled output has the same distribution. "
                    "DeepSeek-V3 / V3.2 / V4 shards with their MTP layer; a request's grammar constrains its drafts, "
                    "a request with a logit_bias decodes one token a step.")


@app.command()
def generate(
    prompt: Annotated[list[str], typer.Option("--prompt", help="Prompt text; repeat for a batch (prompts are "
                                                               "spread over the attention-DP ranks).")],
    shards: Annotated[Optional[Path], typer.Option(help="A `dsconv shard` output directory. Omit it to run "
                                                        "the built-in demo (tiny model, RANDOM weights).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop each sequence after this many tokens (or EOS).")] = 64,
    device: Annotated[str, typer.Option(help="cpu (gloo), cuda (nccl) or npu (hccl, needs torch_npu); cuda and "
                                             "npu have not been run in CI.")] = "cpu",
    world_size: Annotated[Optional[int], typer.Option(help="Ranks to start; must equal the manifest's.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (token ids, text, timings) "
                                                             "instead of streaming text.")] = False,
    no_chat: Annotated[bool, typer.Option("--no-chat", help="Feed the prompt as is, without the chat "
                                                            "format.")] = False,
    thinking: Annotated[bool, typer.Option("--thinking", help="Open the reply in thinking mode (V3.2 / V4: "
                                                              "`<think>` instead of `</think>`; V3: passed to the "
                                                              "chat template as `thinking`).")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt, given with every "
                                                                   "--prompt (chat format only).")] = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype: bfloat16 or float32.")] = "bfloat16",
    cache_tokens: Annotated[int, typer.Option(help="KV cache capacity per attention-DP rank, in tokens.")] = 4096,
    kv_cache_memory_bytes: Annotated[Optional[int], typer.Option(help=KV_CACHE_MEMORY_HELP)] = None,
    block_size: Annotated[int, typer.Option(help=BLOCK_SIZE_HELP)] = DEFAULT_BLOCK_SIZE,
    max_model_len: Annotated[Optional[int], typer.Option(help=MAX_MODEL_LEN_HELP)] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help=KV_CACHE_DTYPE_HELP)] = "auto",
    prefill_context_parallel_size: Annotated[int, typer.Option(help=CP_SIZE_HELP)] = 1,
    prefill_cp_min_tokens: Annotated[int, typer.Option(help=CP_MIN_TOKENS_HELP)] = DEFAULT_CP_MIN_TOKENS,
    logprobs: Annotated[Optional[int], typer.Option(
        help="With --json: each new token's logprob and this many most likely tokens' (vLLM's "
             "SamplingParams.logprobs; the server's top_logprobs limit applies).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 (the default) is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens only; 0: all.")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the smallest set of most likely tokens whose "
                                              "probability reaches top_p; 1: all.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the sampled tokens (prompt i draws with seed + i): "
                                                     "the same seed gives the same text at any world size.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds a collective may wait before the job fails.")] = 300.0,
    record_shapes: Annotated[Optional[Path], typer.Option(help=RECORD_SHAPES_HELP)] = None,
    overlap_shared_experts: Annotated[bool, typer.Option("--overlap-shared-experts/--no-overlap-shared-experts",
                                                         help=OVERLAP_HELP)] = True,
    enable_prefix_caching: Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching",
                                                        help=PREFIX_CACHING_HELP)] = True,
    speculative_config: Annotated[Optional[str], typer.Option(help=SPECULATIVE_HELP)] = None,
) -> None:
    """Generate from PROMPT on every rank of the shard set (greedily unless --temperature is given) and print the
    text on rank 0."""
    start_rank_server(device, ["dsconv.runner.entrypoints.generate"])  # importing beside this process
    _import_torch()
    from dsconv.family.text import TextTokenizer
    from dsconv.runner.engine.config import CacheConfig, RunConfig, SchedulerConfig
    from dsconv.runner.engine.request import MAX_TOP_LOGPROBS, SamplingParams, check_prompt, resolve_max_model_len
    from dsconv.runner.engine.speculative import SpeculativeConfig
    from dsconv.runner.entrypoints.generate import rank_main
    from dsconv.runner.models.kv_cache import cache_blocks

    started = time.time()
    try:
        if max_new_tokens < 1:
            raise InputError(f"--max-new-tokens {max_new_tokens} must be at least 1")
        if no_chat and (thinking or system is not None):
            raise InputError("--thinking and --system shape the chat prompt; they cannot be used with --no-chat")
        if system is not None and not system.strip():
            raise InputError("--system is empty")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise InputError(f"--logprobs {logprobs} must be between 0 and {MAX_TOP_LOGPROBS}")
        if logprobs is not None and not json_output:
            raise InputError("--logprobs goes with --json (the text output has no place for them)")
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        SamplingParams(max_tokens=max_new_tokens, **sampling)  # its checks, before any rank starts
        if shards is None:
            from dsconv.shard.demo import demo_shards

            err_console.print("[yellow]No --shards given: running the built-in demo, a tiny DeepSeek-V4 model "
                              "(real vocabulary, FP8 + FP4 source) with RANDOM weights (the text is noise), "
                              "quantized to W8A8 and sharded for 16 ranks.[/]")
            shards = demo_shards()
        run = RunConfig.open(shards, world_size, dtype=dtype, device=device,
                             cache=CacheConfig(cache_tokens, kv_cache_memory_bytes, kv_cache_dtype, block_size),
                             scheduler=SchedulerConfig(max_num_seqs=1, cp_size=prefill_context_parallel_size,
                                                       cp_min_tokens=prefill_cp_min_tokens,
                                                       enable_prefix_caching=enable_prefix_caching),
                             record_shapes=_record_path(record_shapes),
                             overlap_shared_experts=overlap_shared_experts,
                             speculative=SpeculativeConfig.parse(speculative_config))
        # every prompt runs at once, prompt i on attention-DP rank i % dp: a byte budget keeps a sequence slot for
        # each of a rank's prompts
        run = run.with_max_num_seqs(-(-len(prompt) // run.layout.dp))
        text = TextTokenizer.load(run.shards, run.model_config)
        prompts = [_prompt_ids(text, p, run.family, not no_chat, system, thinking) for p in prompt]
        run.check_holds(max_model_len)
        model_len = resolve_max_model_len(max_model_len, run.max_position_embeddings, run.cache_tokens)
        dp = run.layout.dp  # prompt i runs on attention-DP index i % dp, all of its prompts at once
        need = max(sum(cache_blocks(len(p) + max_new_tokens, block_size) for p in prompts[index::dp])
                   for index in range(dp))
        if need > run.cache_blocks:
            raise InputError(f"prompts + --max-new-tokens need {need} blocks of {block_size} tokens on one "
                             f"attention-DP rank, which exceed the KV cache's {run.cache_blocks} ({_cache_flag(run)})")
        for ids in prompts:
            check_prompt(ids, max_new_tokens, run.vocab_size, model_len)
        # every prompt admitted at once and prefilled in one step
        run = replace(run, max_model_len=model_len, scheduler=replace(
            run.scheduler, max_num_batched_tokens=sum(map(len, prompts))))
        _launch(rank_main, {"run": run, "prompts": prompts, "max_new_tokens": max_new_tokens, "logprobs": logprobs,
                            "json_output": json_output, "started_at": started, "sampling": sampling}, run, timeout)
    except InputError as exc:
        fail(str(exc))


@app.command()
def perplexity(
    shards: Annotated[Path, typer.Option(help="A `dsconv shard` output directory.")],
    file: Annotated[Path, typer.Option(help="The text to score (UTF-8).")],
    context: Annotated[int, typer.Option(help="Tokens per window, BOS included in the first: each token after "
                                              "a window's first is scored given the window's earlier ones.")] = 512,
    dtype: Annotated[str, typer.Option(help="Compute dtype: bfloat16 or float32.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu (gloo), cuda (nccl) or npu (hccl, needs torch_npu).")] = "cpu",
    world_size: Annotated[Optional[int], typer.Option(help="Ranks to start; must equal the manifest's.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (perplexity, tokens "
                                                             "scored, windows).")] = False,
    max_model_len: Annotated[Optional[int], typer.Option(
        help="The most tokens a window may hold (vLLM's flag); default: the model's max_position_embeddings (and "
             "with --kv-cache-memory-bytes, at most what the cache holds).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help=KV_CACHE_DTYPE_HELP)] = "auto",
    kv_cache_memory_bytes: Annotated[Optional[int], typer.Option(
        help=KV_CACHE_MEMORY_HELP + " Default: a cache of one window.")] = None,
    block_size: Annotated[int, typer.Option(help=BLOCK_SIZE_HELP)] = DEFAULT_BLOCK_SIZE,
    prefill_context_parallel_size: Annotated[int, typer.Option(help=CP_SIZE_HELP)] = 1,
    prefill_cp_min_tokens: Annotated[int, typer.Option(help=CP_MIN_TOKENS_HELP)] = DEFAULT_CP_MIN_TOKENS,
    timeout: Annotated[float, typer.Option(help="Seconds a collective may wait before the job fails.")] = 300.0,
    record_shapes: Annotated[Optional[Path], typer.Option(help=RECORD_SHAPES_HELP)] = None,
    overlap_shared_experts: Annotated[bool, typer.Option("--overlap-shared-experts/--no-overlap-shared-experts",
                                                         help=OVERLAP_HELP)] = True,
) -> None:
    """Perplexity of FILE under the model: exp(mean negative log-likelihood) of its tokens (BOS in front where the
    tokenizer's config says add_bos_token), in consecutive windows of --context tokens spread over the attention-DP
    ranks."""
    start_rank_server(device, ["dsconv.runner.entrypoints.perplexity"])  # importing beside this process
    _import_torch()
    from dsconv.family.text import TextTokenizer
    from dsconv.runner.engine.config import CacheConfig, RunConfig, SchedulerConfig
    from dsconv.runner.engine.request import check_prompt, resolve_max_model_len
    from dsconv.runner.entrypoints.perplexity import rank_main, windows

    started = time.time()
    try:
        run = RunConfig.open(shards, world_size, dtype=dtype, device=device,
                             cache=CacheConfig(memory_bytes=kv_cache_memory_bytes, dtype=kv_cache_dtype,
                                               block_size=block_size),
                             scheduler=SchedulerConfig(max_num_seqs=1, cp_size=prefill_context_parallel_size,
                                                       cp_min_tokens=prefill_cp_min_tokens),
                             record_shapes=_record_path(record_shapes),
                             overlap_shared_experts=overlap_shared_experts)
        try:
            text = file.read_bytes().decode("utf-8")
        except OSError as exc:
            raise InputError(f"--file {file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise InputError(f"--file {file} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        if not text.strip():
            raise InputError(f"--file {file} holds no text")
        run.check_holds(max_model_len)
        model_len = resolve_max_model_len(max_model_len, run.max_position_embeddings,
                                          None if kv_cache_memory_bytes is None else run.cache_tokens)
        cut = windows(TextTokenizer.load(run.shards, run.model_config).encode(text), context)
        if not cut:
            raise InputError(f"--file {file} is one token: nothing to score")
        longest = max(map(len, cut))
        if kv_cache_memory_bytes is not None and longest > run.cache_tokens:
            raise InputError(f"windows of up to {longest} tokens exceed the KV cache's {run.cache_tokens} tokens "
                             f"({_cache_flag(run)}): lower --context or raise the budget")
        for window in cut:  # each window is scored as a prompt of the engine
            check_prompt(window, 0, run.vocab_size, model_len)
        # A DP rank scores one window at a time, with a token budget of one window (and, unless a byte budget says
        # otherwise, a cache of one window): a step's logits are one window's at most, never a [tokens, vocab]
        # tensor of the file.
        if kv_cache_memory_bytes is None:
            run = replace(run, cache=replace(run.cache, tokens=longest))
        run = replace(run, scheduler=replace(run.scheduler, max_num_batched_tokens=longest))
        _launch(rank_main, {"run": run, "windows": cut, "context": context, "json_output": json_output,
                            "started_at": started}, run, timeout)
    except InputError as exc:
        fail(str(exc))


@app.command()
def serve(
    shards: Annotated[Optional[Path], typer.Option(help="A `dsconv shard` output directory. Omit it to serve the "
                                                        "built-in demo (tiny model, RANDOM weights).")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port, printed at start).")] = 8000,
    device: Annotated[str, typer.Option(help="cpu (gloo), cuda (nccl) or npu (hccl, needs torch_npu).")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Compute dtype: bfloat16 or float32.")] = "bfloat16",
    max_num_seqs: Annotated[int, typer.Option(help="Requests running at once per attention-DP rank.")] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Tokens one attention-DP rank feeds per step; longer "
                                                              "prompts are prefilled in chunks.")]
    = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    cache_tokens: Annotated[int, typer.Option(help="KV cache capacity per attention-DP rank, in tokens.")] = 16384,
    max_model_len: Annotated[Optional[int], typer.Option(help=MAX_MODEL_LEN_HELP)] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help=KV_CACHE_DTYPE_HELP)] = "auto",
    prefill_context_parallel_size: Annotated[int, typer.Option(help=CP_SIZE_HELP)] = 1,
    prefill_cp_min_tokens: Annotated[int, typer.Option(help=CP_MIN_TOKENS_HELP)] = DEFAULT_CP_MIN_TOKENS,
    kv_cache_memory_bytes: Annotated[Optional[int], typer.Option(help=KV_CACHE_MEMORY_HELP)] = None,
    block_size: Annotated[int, typer.Option(help=BLOCK_SIZE_HELP)] = DEFAULT_BLOCK_SIZE,
    dp_balancing: Annotated[str, typer.Option(help="Placing requests on attention-DP ranks: cache-aware (the "
                                                   "least work, queued and running tokens plus the request's prompt "
                                                   "less what that rank's prefix cache holds), least-loaded (queued "
                                                   "and running tokens) or round-robin.")] = "cache-aware",
    scheduling_policy: Annotated[str, typer.Option(help="Which waiting request runs first: fcfs (by arrival) or "
                                                        "priority (the request's `priority`, lower first, ties by "
                                                        "arrival; preemption takes the highest value first), as in "
                                                        "vLLM.")] = "fcfs",
    served_model_name: Annotated[Optional[str], typer.Option(help="The model id clients send (default: the "
                                                                  "shards directory's name).")] = None,
    world_size: Annotated[Optional[int], typer.Option(help="Ranks to start; must equal the manifest's.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds a collective may wait before the job fails.")] = 300.0,
    record_shapes: Annotated[Optional[Path], typer.Option(help=RECORD_SHAPES_HELP)] = None,
    overlap_shared_experts: Annotated[bool, typer.Option("--overlap-shared-experts/--no-overlap-shared-experts",
                                                         help=OVERLAP_HELP)] = True,
    enable_prefix_caching: Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching",
                                                        help=PREFIX_CACHING_HELP)] = True,
    speculative_config: Annotated[Optional[str], typer.Option(help=SPECULATIVE_HELP)] = None,
    drain_timeout: Annotated[float, typer.Option(help="On SIGTERM: seconds requests in flight may take to finish "
                                                      "before they are aborted.")] = 30.0,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="DSRUN_API_KEY", show_envvar=True,
        help="Require `Authorization: Bearer KEY` on /v1/* and /tokenize, /detokenize (401 otherwise); /health and "
             "/metrics stay open. Without it, a server on a non-loopback address warns at start.")] = None,
) -> None:
    """Serve the shards over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics, /tokenize, /detokenize), with continuous batching over every rank.

    Every parameter OpenAI documents is accepted; logit_bias is applied.
    reasoning_effort is the thinking switch: none and minimal turn it off; low, medium, high and xhigh on.
    store, metadata, service_tier, prompt_cache_key, safety_identifier, user, prediction, verbosity: ignored.
    A chat request without max_tokens gets --max-model-len minus its prompt."""
    start_rank_server(device, ["dsconv.runner.entrypoints.serve"])  # importing beside this process
    _import_torch()
    from dsconv.runner.engine.config import CacheConfig, RunConfig, SchedulerConfig
    from dsconv.runner.engine.request import resolve_max_model_len
    from dsconv.runner.engine.scheduler import BALANCING, SCHEDULING_POLICIES
    from dsconv.runner.engine.speculative import SpeculativeConfig
    from dsconv.runner.entrypoints.serve import rank_main

    try:
        if dp_balancing not in BALANCING:
            raise InputError(f"--dp-balancing {dp_balancing!r} is not one of {', '.join(BALANCING)}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise InputError(f"--scheduling-policy {scheduling_policy!r} is not one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        if not 0 <= port < 65536:
            raise InputError(f"--port {port} is not a port number")
        if api_key is not None and (not api_key.strip() or not api_key.isascii() or not api_key.isprintable()):
            raise InputError("--api-key (or DSRUN_API_KEY) must be non-empty printable ASCII (HTTP headers carry it)")
        for name, value in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens)):
            if value < 1:
                raise InputError(f"{name} {value} must be at least 1")
        if shards is None:
            from dsconv.shard.demo import demo_shards

            err_console.print("[yellow]No --shards given: serving the built-in demo, a tiny DeepSeek-V4 model with "
                              "RANDOM weights (the text is noise).[/]")
            shards = demo_shards()
        run = RunConfig.open(shards, world_size, dtype=dtype, device=device,
                             cache=CacheConfig(cache_tokens, kv_cache_memory_bytes, kv_cache_dtype, block_size),
                             scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, dp_balancing,
                                                       prefill_context_parallel_size, prefill_cp_min_tokens,
                                                       enable_prefix_caching, scheduling_policy),
                             max_model_len=max_model_len, drain_timeout_s=drain_timeout,
                             record_shapes=_record_path(record_shapes),
                             overlap_shared_experts=overlap_shared_experts,
                             speculative=SpeculativeConfig.parse(speculative_config))
        run.check_holds(max_model_len)
        resolve_max_model_len(max_model_len, run.max_position_embeddings, run.cache_tokens)
        _launch(rank_main, {"run": run, "host": host, "port": port,
                            "model_name": served_model_name or Path(shards).resolve().name, "timeout_s": timeout,
                            "api_key": api_key}, run, timeout, sigterm_to_rank0=True)
    except InputError as exc:
        fail(str(exc))


# The default prompt of `dsrun compare`: prose and code, so that every layer sees a varied context
COMPARE_PROMPT = ("The Forbidden City in Beijing was the home of emperors for five centuries. def area(r): return "
                  "3.14159 * r * r  # a circle's area")


@app.command()
def compare(
    shards: Annotated[Path, typer.Option(help="A `dsconv shard` output directory (any layout, BF16 or W8A8).")],
    reference: Annotated[Path, typer.Option(
        help="The source checkpoint as downloaded (FP8 / FP4 / BF16; the hub's names or transformers'), run by "
             "transformers one decoder layer at a time as the reference.")],
    prompt: Annotated[Optional[list[str]], typer.Option(
        "--prompt", help="Text to compare on, fed as is (no chat format); repeat for several. Default: a sentence "
                         "of prose and code.")] = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype of both sides: float32 or bfloat16.")] = "float32",
    min_cosine: Annotated[float, typer.Option(help="A layer whose output cosine is below this fails the "
                                                   "comparison (exit 1).")] = 0.999,
    kv_cache_dtype: Annotated[str, typer.Option(help=KV_CACHE_DTYPE_HELP)] = "auto",
    device: Annotated[str, typer.Option(help="Our side's device: cpu (gloo), cuda (nccl) or npu (hccl); the "
                                             "reference runs on the CPU.")] = "cpu",
    world_size: Annotated[Optional[int], typer.Option(help="Ranks to start; must equal the manifest's.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object: layers [{layer, cosine, "
                                                             "max_abs_diff}], logits_cosine, top1_agreement, "
                                                             "first_below.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds a collective may wait before the job fails.")] = 300.0,
) -> None:
    """Compare our forward on SHARDS with transformers' forward of the source checkpoint, layer by layer: each
    decoder layer's output cosine and largest difference, the logits' cosine and top-1 agreement, and the first
    layer below --min-cosine. Exit 0 if every layer holds, 1 if one does not, 2 on bad input."""
    start_rank_server(device, ["dsconv.runner.entrypoints.compare"])  # importing beside this process
    _import_torch()
    import json
    import resource

    import torch

    from dsconv.family.text import TextTokenizer
    from dsconv.runner.engine.config import CacheConfig, RunConfig, SchedulerConfig
    from dsconv.runner.engine.request import check_prompt
    from dsconv.runner.entrypoints.compare import check_same_model, compare as run_compare, print_report, \
        rank_main
    from dsconv.runner.entrypoints.reference import Reference

    try:
        if not 0 < min_cosine <= 1:
            raise InputError(f"--min-cosine {min_cosine} must be in (0, 1]")
        run = RunConfig.open(shards, world_size, dtype=dtype, device=device,
                             cache=CacheConfig(dtype=kv_cache_dtype), scheduler=SchedulerConfig(max_num_seqs=1))
        ref = Reference(reference, getattr(torch, dtype))
        check_same_model(run, ref)
        text = TextTokenizer.load(run.shards, run.model_config)
        texts = prompt or [COMPARE_PROMPT]
        prompts = [text.encode(p) for p in texts]
        for given, ids in zip(texts, prompts):
            if len(ids) < 2 or not given.strip():
                raise InputError(f"--prompt {given!r} is {len(ids)} token(s): give at least two")
            check_prompt(ids, 1, run.vocab_size, run.max_position_embeddings)
        longest = max(map(len, prompts))
        # one prompt at a time on attention-DP rank 0, each prefilled in one step with a cache of one prompt and the
        # token that ends it (the engine computes the last position's logits to choose one)
        run = replace(run, cache=replace(run.cache, tokens=longest + 1),
                      scheduler=replace(run.scheduler, max_num_batched_tokens=longest))
    except InputError as exc:
        fail(str(exc))
    with tempfile.TemporaryDirectory(prefix="dsrun-compare-") as scratch:
        _launch(rank_main, {"run": run, "prompts": prompts, "out": scratch}, run, timeout)
        report = run_compare(ref, prompts, Path(scratch)).report(min_cosine)
    # this process ran the reference (the ranks are processes of their own, their shards memory-mapped)
    report.update(reference_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  reference_largest_part_bytes=ref.largest_part_bytes)
    if json_output:
        print(json.dumps(report))
    else:
        print_report(report)
    if report["first_below"] is not None:
        raise typer.Exit(1)


def _record_path(path: Optional[Path]) -> Optional[Path]:
    """--record-shapes as an absolute path (rank 0 appends to it), refused at once if it cannot be written."""
    if path is None:
        return None
    path = path.resolve()
    if not path.parent.is_dir():
        raise InputError(f"--record-shapes {path}: its directory does not exist")
    if path.is_dir():
        raise InputError(f"--record-shapes {path} is a directory, not a file")
    return path


def _cache_flag(run) -> str:
    """The flag that sized the run's KV cache, with its value."""
    if run.cache.memory_bytes is not None:
        return f"--kv-cache-memory-bytes {run.cache.memory_bytes}"
    return f"--cache-tokens {run.cache.tokens}"


def _launch(entry, args: dict, run, timeout: float, sigterm_to_rank0: bool = False) -> None:
    """The run's ranks, each running entry(**args); rank 0 prints what the command shows. A failed rank ends the
    command with its exit code and keeps the ranks' logs, whose directory its message names."""
    from dsconv.comm.launch import launch

    logs = Path(tempfile.mkdtemp(prefix="dsrun-logs-"))
    code = 1
    try:
        code = launch(entry, args, world_size=run.layout.world_size, device=run.device, timeout_s=timeout,
                      log_dir=logs, sigterm_to_rank0=sigterm_to_rank0)
    finally:
        if code == 0 or not any(logs.iterdir()):  # nothing to look at: a success, or refused before any rank ran
            shutil.rmtree(logs, ignore_errors=True)
    if code != 0:
        raise typer.Exit(code)


if __name__ == "__main__":
    app()
