"""`dsrun`: the Typer commands and their options, nothing else. Each command's body (its checks, sizing, launch and
printing) is `main` in `runner/entrypoints/<command>.py`, beside the code its ranks run; options that several
commands take are declared once, below."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dsconv.comm.forkserver import start_rank_server
from dsconv.console import fail
from dsconv.errors import InputError
from dsconv.family.arch import DEFAULT_BLOCK_SIZE
from dsconv.family.layout import DEFAULT_MAX_NUM_BATCHED_TOKENS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run DeepSeek shards written by `dsconv shard` on their ranks and generate text.")


@app.callback()
def main() -> None:
    """Run DeepSeek shards written by `dsconv shard` on their ranks and generate text."""


# Below V3.2's index_topk (2048) the indexer keeps every key and a prompt's prefill is short: the group's step
# and its per-layer gathers are worth giving for longer ones (docs/benchmarks.md: 4,096 tokens at CP 2).
DEFAULT_CP_MIN_TOKENS = 2048
DEFAULT_TIMEOUT_S = 300.0

# -- the options several commands share ----------------------------------------------------------------------------

Shards = Annotated[Path, typer.Option(help="A `dsconv shard` output directory.")]
DemoShards = Annotated[Optional[Path], typer.Option(
    help="A `dsconv shard` output directory. Omit it to run the built-in demo (tiny model, RANDOM weights).")]
Device = Annotated[str, typer.Option(help="cpu (gloo), cuda (nccl) or npu (hccl, needs torch_npu); cuda and npu "
                                          "have not been run in CI.")]
Dtype = Annotated[str, typer.Option(help="Compute dtype: bfloat16 or float32.")]
WorldSize = Annotated[Optional[int], typer.Option(help="Ranks to start; must equal the manifest's.")]
Timeout = Annotated[float, typer.Option(help="Seconds a collective may wait before the job fails.")]
KvCacheDtype = Annotated[str, typer.Option(help=(
    "KV cache entries (vLLM's flag): auto keeps them in the compute dtype; int8 stores V3 / V3.2's MLA latent (a "
    "float32 scale per token and 128 values, the rope key kept in the compute dtype) and indexer keys (a scale per "
    "token; the indexer scores them INT8 x INT8) and dequantizes the latent before attention; for V4 (C8), its "
    "compressed entries and sliding-window rows (a scale per row, the rotary tail in the compute dtype) and indexer "
    "keys."))]
CacheTokens = Annotated[int, typer.Option(help="KV cache capacity per attention-DP rank, in tokens.")]
KV_CACHE_MEMORY_HELP = ("KV cache size per attention-DP rank in bytes (vLLM's flag), instead of --cache-tokens: as "
                        "many whole blocks as fit, in the cache's own layout (V4: after a fixed slot per "
                        "--max-num-seqs for its windows and compressor state).")
KvCacheMemoryBytes = Annotated[Optional[int], typer.Option(help=KV_CACHE_MEMORY_HELP)]
BlockSize = Annotated[int, typer.Option(help=(
    "Tokens per KV-cache block (vLLM's flag): a power of two; the default 16 is vLLM's GPU default (vllm-ascend "
    "runs 128 on Ascend, where its fused kernels take blocks of 128)."))]
MaxModelLen = Annotated[Optional[int], typer.Option(help=(
    "The most tokens one request may hold, prompt and reply (vLLM's flag). Default: the smaller of the model's "
    "max_position_embeddings and what one attention-DP rank's KV cache holds; a chat request without max_tokens "
    "gets what is left after its prompt."))]
CpSize = Annotated[int, typer.Option(help=(
    "Context-parallel prefill (vLLM's name): a prompt of at least --prefill-cp-min-tokens tokens is prefilled in "
    "one step by a group of this many attention-DP ranks (its own and the next ones), each feeding a "
    "causal-balanced share of its tokens; decode then continues on its own rank. Divides the attention-DP size; "
    "attention TP 1; V3 / V3.2 only."))]
CpMinTokens = Annotated[int, typer.Option(
    help="The shortest prompt a context-parallel group prefills (see --prefill-context-parallel-size).")]
RecordShapes = Annotated[Optional[Path], typer.Option(help=(
    "Append one JSON row of what the run's steps covered to this file: prompt lengths, batch size, layout, MoE "
    "handoff, dtypes, the compression ratios that ran in prefill and decode, and the blocks and compression windows "
    "crossed (docs/shape_matrix.md is rendered from such rows)."))]
Overlap = Annotated[bool, typer.Option("--overlap-shared-experts/--no-overlap-shared-experts", help=(
    "Compute each MoE layer's shared expert while its expert exchange travels (the dispatch and combine are issued "
    "asynchronously; on NPU / CUDA the shared expert runs on a second stream). Off: the shared expert runs after the "
    "combine. The tokens are the same either way."))]
PrefixCaching = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help=(
    "Reuse the KV cache of prompt blocks an earlier request on the same attention-DP rank has computed (vLLM's flag "
    "and default): a request computes only what follows its longest cached run of full --block-size blocks, and "
    "usage.prompt_tokens_details.cached_tokens says how many it reused."))]
Kernels = Annotated[str, typer.Option(help=(
    "Which kernels the decode steps run: torch (the default), or pypto, the PyPTO kernels of kernels/pypto/ (V3.2: "
    "RMSNorm with the residual add, the lightning indexer, sparse MLA, the MoE gate, the W8A8 experts; V4: its "
    "decode attention and MoE gate). On CPU they run through PyPTO's interpreter, seconds a call: for checking "
    "them against torch, not for speed. Prefill steps (all of perplexity's) and collectives stay torch. Needs "
    "`pip install -e \".[pypto]\"`."))]
EnableEplb = Annotated[bool, typer.Option("--enable-eplb", help=(
    "Expert-parallel load balancing while running (vLLM's flag): each MoE layer's per-expert load is counted over a "
    "sliding window, and every step_interval steps the experts are placed anew (DeepSeek's EPLB policy) over the "
    "shards' physical slots (`dsconv shard --num-redundant-experts`), their weights moving between EP ranks, one "
    "layer per step. The tokens are the same. CPU and CUDA; on --device npu place them statically with `dsconv shard "
    "--expert-load`."))]
EplbConfigOption = Annotated[Optional[str], typer.Option("--eplb-config", help=(
    "With --enable-eplb, vLLM's JSON: {\"window_size\": 1000, \"step_interval\": 3000, \"num_redundant_experts\": "
    "the shards' (checked), \"log_balancedness\": false, \"use_async\": true (one layer per step; false: every "
    "layer at one step)}."))]
ExpertLoadRecord = Annotated[Optional[Path], typer.Option(help=(
    "Write the run's tokens per logical expert of every MoE layer, summed over the ranks, to this JSON file at the "
    "end (SGLang's expert-distribution recorder): `dsconv shard --expert-load FILE` places redundant experts by "
    "it."))]
Speculative = Annotated[Optional[str], typer.Option(help=(
    "Speculative decoding, vLLM's JSON: '{\"method\": \"mtp\", \"num_speculative_tokens\": k}', k 1 to 3. The "
    "checkpoint's MTP layer drafts k tokens a step for each request and one target step verifies them: greedy output "
    "is the same as without, sampled output has the same distribution. DeepSeek-V3 / V3.2 / V4 shards with their MTP "
    "layer; a request's grammar constrains its drafts, a request with a logit_bias decodes one token a step."))]


# torch loads installed device extensions when it is imported (its "torch.backends" entry points): torch_npu,
# installed where Ascend's CANN toolkit is not, makes `import torch` itself fail (its libraries need libhccl.so).
NO_CANN = ("importing torch failed because torch_npu is installed but cannot load ({cause}): torch_npu needs "
           "Ascend's CANN toolkit (libhccl.so and the Ascend runtime; source CANN's set_env.sh). On a machine "
           "without CANN, uninstall torch_npu or set TORCH_DEVICE_BACKEND_AUTOLOAD=0")


def _enter(command: str, device: str) -> None:
    """A command's first steps: the rank server forks beside this process (comm/forkserver.py), then torch is
    imported, an installed torch_npu without CANN (which breaks the import) ending the command in one line."""
    start_rank_server(device, [f"dsconv.runner.entrypoints.{command}"])
    try:
        import torch  # noqa: F401
    except RuntimeError as exc:
        if "torch_npu" not in str(exc):
            raise
        cause = exc.__cause__ or exc
        fail(NO_CANN.format(cause=f"{type(cause).__name__}: {cause}".replace("\n", " ")))


def _finish(run_command, options) -> None:
    """Runs a command's body: bad input is one line and exit 2, a failed job its exit code."""
    try:
        code = run_command(options)
    except InputError as exc:
        fail(str(exc))
    if code:
        raise typer.Exit(code)


# -- the commands ---------------------------------------------------------------------------------------------------

@app.command()
def generate(
    prompt: Annotated[list[str], typer.Option("--prompt", help="Prompt text; repeat for a batch (prompts are "
                                                               "spread over the attention-DP ranks).")],
    shards: DemoShards = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop each sequence after this many tokens (or EOS).")] = 64,
    device: Device = "cpu",
    world_size: WorldSize = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (token ids, text, timings) "
                                                             "instead of streaming text.")] = False,
    no_chat: Annotated[bool, typer.Option("--no-chat", help="Feed the prompt as is, without the chat "
                                                            "format.")] = False,
    thinking: Annotated[bool, typer.Option("--thinking", help="Open the reply in thinking mode (V3.2 / V4: "
                                                              "`<think>` instead of `</think>`; V3: passed to the "
                                                              "chat template as `thinking`).")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt, given with every "
                                                                   "--prompt (chat format only).")] = None,
    dtype: Dtype = "bfloat16",
    cache_tokens: CacheTokens = 4096,
    kv_cache_memory_bytes: KvCacheMemoryBytes = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    max_model_len: MaxModelLen = None,
    kv_cache_dtype: KvCacheDtype = "auto",
    prefill_context_parallel_size: CpSize = 1,
    prefill_cp_min_tokens: CpMinTokens = DEFAULT_CP_MIN_TOKENS,
    logprobs: Annotated[Optional[int], typer.Option(
        help="With --json: each new token's logprob and this many most likely tokens' (vLLM's "
             "SamplingParams.logprobs; the server's top_logprobs limit applies).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 (the default) is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens only; 0: all.")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the smallest set of most likely tokens whose "
                                              "probability reaches top_p; 1: all.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the sampled tokens (prompt i draws with seed + i): "
                                                     "the same seed gives the same text at any world size.")] = None,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    record_shapes: RecordShapes = None,
    overlap_shared_experts: Overlap = True,
    kernels: Kernels = "torch",
    enable_prefix_caching: PrefixCaching = True,
    speculative_config: Speculative = None,
    enable_eplb: EnableEplb = False,
    eplb_config: EplbConfigOption = None,
    expert_load_record: ExpertLoadRecord = None,
) -> None:
    """Generate from PROMPT on every rank of the shard set (greedily unless --temperature is given) and print the
    text on rank 0."""
    options = dict(locals())
    _enter("generate", device)
    from dsconv.runner.entrypoints.generate import GenerateOptions, main as run_generate

    _finish(run_generate, GenerateOptions(**options))


@app.command()
def perplexity(
    shards: Shards,
    file: Annotated[Path, typer.Option(help="The text to score (UTF-8).")],
    context: Annotated[int, typer.Option(help="Tokens per window, BOS included in the first: each token after "
                                              "a window's first is scored given the window's earlier ones.")] = 512,
    dtype: Dtype = "bfloat16",
    device: Device = "cpu",
    world_size: WorldSize = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (perplexity, tokens "
                                                             "scored, windows).")] = False,
    max_model_len: Annotated[Optional[int], typer.Option(
        help="The most tokens a window may hold (vLLM's flag); default: the model's max_position_embeddings (and "
             "with --kv-cache-memory-bytes, at most what the cache holds).")] = None,
    kv_cache_dtype: KvCacheDtype = "auto",
    kv_cache_memory_bytes: Annotated[Optional[int], typer.Option(
        help=KV_CACHE_MEMORY_HELP + " Default: a cache of one window.")] = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
    prefill_context_parallel_size: CpSize = 1,
    prefill_cp_min_tokens: CpMinTokens = DEFAULT_CP_MIN_TOKENS,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    record_shapes: RecordShapes = None,
    overlap_shared_experts: Overlap = True,
    kernels: Kernels = "torch",
) -> None:
    """Perplexity of FILE under the model: exp(mean negative log-likelihood) of its tokens (BOS in front where the
    tokenizer's config says add_bos_token), in consecutive windows of --context tokens spread over the attention-DP
    ranks."""
    options = dict(locals())
    _enter("perplexity", device)
    from dsconv.runner.entrypoints.perplexity import PerplexityOptions, main as run_perplexity

    _finish(run_perplexity, PerplexityOptions(**options))


@app.command()
def serve(
    shards: DemoShards = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port, printed at start).")] = 8000,
    device: Device = "cpu",
    dtype: Dtype = "bfloat16",
    max_num_seqs: Annotated[int, typer.Option(help="Requests running at once per attention-DP rank.")] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Tokens one attention-DP rank feeds per step; longer "
                                                              "prompts are prefilled in chunks.")]
    = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    cache_tokens: CacheTokens = 16384,
    max_model_len: MaxModelLen = None,
    kv_cache_dtype: KvCacheDtype = "auto",
    prefill_context_parallel_size: CpSize = 1,
    prefill_cp_min_tokens: CpMinTokens = DEFAULT_CP_MIN_TOKENS,
    kv_cache_memory_bytes: KvCacheMemoryBytes = None,
    block_size: BlockSize = DEFAULT_BLOCK_SIZE,
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
    world_size: WorldSize = None,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    record_shapes: RecordShapes = None,
    overlap_shared_experts: Overlap = True,
    kernels: Kernels = "torch",
    enable_prefix_caching: PrefixCaching = True,
    speculative_config: Speculative = None,
    enable_eplb: EnableEplb = False,
    eplb_config: EplbConfigOption = None,
    expert_load_record: ExpertLoadRecord = None,
    drain_timeout: Annotated[float, typer.Option(help="On SIGTERM: seconds requests in flight may take to finish "
                                                      "before they are aborted.")] = 30.0,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="DSRUN_API_KEY", show_envvar=True,
        help="Require `Authorization: Bearer KEY` on /v1/* and /tokenize, /detokenize (401 otherwise); /health and "
             "/metrics stay open. Without it, a server on a non-loopback address warns at start.")] = None,
    kv_transfer_config: Annotated[Optional[str], typer.Option(
        help='Prefill/decode disaggregation, vLLM\'s JSON: {"kv_connector": "MooncakeConnector", "kv_role": '
             '"kv_producer" | "kv_consumer", "kv_connector_extra_config": {"host": ADDRESS, "lease_s": 30, '
             '"transfer_timeout_s": 30, "kv_load_failure_policy": "fail" | "recompute", "auth_key_file": PATH}}. A '
             'producer prefills and hands the KV cache over, signed with the key both are given (required); a '
             'consumer reads it (Mooncake) and decodes. `dsrun router` sends requests to both (docs/pd.md).')] = None,
    kv_offloading_size: Annotated[Optional[float], typer.Option(
        help="KV cache offload (vLLM's flag): GiB of host memory, over every rank, that keeps the prefix cache's "
             "blocks the KV cache gives up; a later request finds them there and copies them back instead of "
             "computing them. Needs prefix caching.")] = None,
    kv_offloading_path: Annotated[Optional[Path], typer.Option(
        help="A directory for a disk tier under the host one: blocks that fall out of host memory are written there "
             "(one checksummed file each), and a server restarted on it with the same shards finds them. Made when "
             "missing; refused when it holds another model's or layout's blocks. With --kv-offloading-disk-size.")]
    = None,
    kv_offloading_disk_size: Annotated[Optional[float], typer.Option(
        help="GiB the disk tier may fill, over every rank (the least recently used files go first).")] = None,
) -> None:
    """Serve the shards over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics, /tokenize, /detokenize), with continuous batching over every rank.

    Every parameter OpenAI documents is accepted; logit_bias is applied.
    reasoning_effort is the thinking switch: none and minimal turn it off; low, medium, high and xhigh on.
    store, metadata, service_tier, prompt_cache_key, safety_identifier, user, prediction, verbosity: ignored.
    A chat request without max_tokens gets --max-model-len minus its prompt."""
    options = dict(locals())
    _enter("serve", device)
    from dsconv.runner.entrypoints.serve import ServeOptions, main as run_serve

    _finish(run_serve, ServeOptions(**options))


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
    kv_cache_dtype: KvCacheDtype = "auto",
    device: Annotated[str, typer.Option(help="Our side's device: cpu (gloo), cuda (nccl) or npu (hccl); the "
                                             "reference runs on the CPU.")] = "cpu",
    world_size: WorldSize = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object: layers [{layer, cosine, "
                                                             "max_abs_diff}], logits_cosine, top1_agreement, "
                                                             "first_below.")] = False,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
) -> None:
    """Compare our forward on SHARDS with transformers' forward of the source checkpoint, layer by layer: each
    decoder layer's output cosine and largest difference, the logits' cosine and top-1 agreement, and the first
    layer below --min-cosine. Exit 0 if every layer holds, 1 if one does not, 2 on bad input."""
    options = dict(locals())
    _enter("compare", device)
    from dsconv.runner.entrypoints.compare import CompareOptions, main as run_compare

    _finish(run_compare, CompareOptions(**options))


@app.command()
def router(
    decode: Annotated[list[str], typer.Option("--decode", help="A decode instance's URL (`dsrun serve "
                                                               "--kv-transfer-config` with kv_role kv_consumer); "
                                                               "repeat for several.")],
    prefill: Annotated[Optional[list[str]], typer.Option("--prefill", help="A prefill instance's URL (kv_role "
                                                                           "kv_producer); repeat for several.")]
    = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port, printed at start).")] = 8000,
    timeout: Annotated[float, typer.Option(help="Seconds an instance may take to answer one request.")] = 600.0,
) -> None:
    """Serve one OpenAI-compatible endpoint over prefill/decode-disaggregated `dsrun serve` instances: each request is
    prefilled on a prefill instance (picked by cached prefix and load), its KV cache handed to a decode instance
    (picked by load), whose reply is relayed (docs/pd.md). /health, /metrics and /v1/models as `dsrun serve`'s."""
    from dsconv.runner.entrypoints.router import RouterOptions, main as run_router

    _finish(run_router, RouterOptions(prefill or [], decode, host, port, timeout))


if __name__ == "__main__":
    app()
