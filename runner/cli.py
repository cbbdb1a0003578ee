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
from dsconv.runner.entrypoints.options import (COMPARE, GENERATE, KV_CACHE_MEMORY_HELP, PERPLEXITY, SERVE,
                                               SERVE_CACHE_TOKENS, EngineOptions, engine_command)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run DeepSeek shards written by `dsconv shard` on their ranks and generate text.")


@app.callback()
def main() -> None:
    """Run DeepSeek shards written by `dsconv shard` on their ranks and generate text."""


# -- the options several commands share (the engine's flags are runner/entrypoints/options.py's) --------------------

Shards = Annotated[Path, typer.Option(help="A `dsconv shard` output directory.")]
DemoShards = Annotated[Optional[Path], typer.Option(
    help="A `dsconv shard` output directory. Omit it to run the built-in demo (tiny model, RANDOM weights).")]


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

@engine_command(app, GENERATE)
def generate(
    prompt: Annotated[list[str], typer.Option("--prompt", help="Prompt text; repeat for a batch (prompts are "
                                                               "spread over the attention-DP ranks).")],
    shards: DemoShards = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop each sequence after this many tokens (or EOS).")] = 64,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (token ids, text, timings) "
                                                               "instead of streaming text.")] = False,
    no_chat: Annotated[bool, typer.Option("--no-chat", help="Feed the prompt as is, without the chat "
                                                            "format.")] = False,
    thinking: Annotated[bool, typer.Option("--thinking", help="Open the reply in thinking mode (V3.2 / V4: "
                                                              "`<think>` instead of `</think>`; V3: passed to the "
                                                              "chat template as `thinking`).")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt, given with every "
                                                                   "--prompt (chat format only).")] = None,
    logprobs: Annotated[Optional[int], typer.Option(
        help="With --json: each new token's logprob and this many most likely tokens' (vLLM's "
             "SamplingParams.logprobs; the server's top_logprobs limit applies).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 (the default) is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens only; 0: all.")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the smallest set of most likely tokens whose "
                                              "probability reaches top_p; 1: all.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the sampled tokens (prompt i draws with seed + i): "
                                                     "the same seed gives the same text at any world size.")] = None,
    engine: EngineOptions = EngineOptions(),
) -> None:
    """Generate from PROMPT on every rank of the shard set (greedily unless --temperature is given) and print the
    text on rank 0."""
    options = dict(locals())
    _enter("generate", engine.device)
    from dsconv.runner.entrypoints.generate import GenerateOptions, main as run_generate

    _finish(run_generate, GenerateOptions(**options))


@engine_command(app, PERPLEXITY, helps={
    "max_model_len": "The most tokens a window may hold (vLLM's flag); default: the model's max_position_embeddings "
                     "(and with --kv-cache-memory-bytes, at most what the cache holds).",
    "kv_cache_memory_bytes": KV_CACHE_MEMORY_HELP + " Default: a cache of one window."})
def perplexity(
    shards: Shards,
    file: Annotated[Path, typer.Option(help="The text to score (UTF-8).")],
    context: Annotated[int, typer.Option(help="Tokens per window, BOS included in the first: each token after "
                                              "a window's first is scored given the window's earlier ones.")] = 512,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (perplexity, tokens "
                                                               "scored, windows).")] = False,
    engine: EngineOptions = EngineOptions(),
) -> None:
    """Perplexity of FILE under the model: exp(mean negative log-likelihood) of its tokens (BOS in front where the
    tokenizer's config says add_bos_token), in consecutive windows of --context tokens spread over the attention-DP
    ranks."""
    options = dict(locals())
    _enter("perplexity", engine.device)
    from dsconv.runner.entrypoints.perplexity import PerplexityOptions, main as run_perplexity

    _finish(run_perplexity, PerplexityOptions(**options))


@engine_command(app, SERVE, defaults={"cache_tokens": SERVE_CACHE_TOKENS})
def serve(
    shards: DemoShards = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port, printed at start).")] = 8000,
    served_model_name: Annotated[Optional[str], typer.Option(help="The model id clients send (default: the "
                                                                  "shards directory's name).")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="DSRUN_API_KEY", show_envvar=True,
        help="Require `Authorization: Bearer KEY` on /v1/* and /tokenize, /detokenize (401 otherwise); /health and "
             "/metrics stay open. Without it, a server on a non-loopback address warns at start.")] = None,
    engine: EngineOptions = EngineOptions(),
) -> None:
    """Serve the shards over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics, /tokenize, /detokenize), with continuous batching over every rank.

    Every parameter OpenAI documents is accepted; logit_bias is applied.
    reasoning_effort is the thinking switch: none and minimal turn it off; low, medium, high and xhigh on.
    store, metadata, service_tier, prompt_cache_key, safety_identifier, user, prediction, verbosity: ignored.
    A chat request without max_tokens gets --max-model-len minus its prompt."""
    options = dict(locals())
    _enter("serve", engine.device)
    from dsconv.runner.entrypoints.serve import ServeOptions, main as run_serve

    _finish(run_serve, ServeOptions(**options))


@engine_command(app, COMPARE, defaults={"dtype": "float32"}, helps={
    "dtype": "Compute dtype of both sides: float32 or bfloat16.",
    "device": "Our side's device: cpu (gloo), cuda (nccl) or npu (hccl); the reference runs on the CPU."})
def compare(
    shards: Annotated[Path, typer.Option(help="A `dsconv shard` output directory (any layout, BF16 or W8A8).")],
    reference: Annotated[Path, typer.Option(
        help="The source checkpoint as downloaded (FP8 / FP4 / BF16; the hub's names or transformers'), run by "
             "transformers one decoder layer at a time as the reference.")],
    prompt: Annotated[Optional[list[str]], typer.Option(
        "--prompt", help="Text to compare on, fed as is (no chat format); repeat for several. Default: a sentence "
                         "of prose and code.")] = None,
    min_cosine: Annotated[float, typer.Option(help="A layer whose output cosine is below this fails the "
                                                   "comparison (exit 1).")] = 0.999,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object: layers [{layer, cosine, "
                                                               "max_abs_diff}], logits_cosine, top1_agreement, "
                                                               "first_below.")] = False,
    engine: EngineOptions = EngineOptions(),
) -> None:
    """Compare our forward on SHARDS with transformers' forward of the source checkpoint, layer by layer: each
    decoder layer's output cosine and largest difference, the logits' cosine and top-1 agreement, and the first
    layer below --min-cosine. Exit 0 if every layer holds, 1 if one does not, 2 on bad input."""
    options = dict(locals())
    _enter("compare", engine.device)
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
