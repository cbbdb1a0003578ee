"""The engine's flags, each declared once (vLLM's EngineArgs is the model): its name, default, help and, where no
config checks it, its check, as a field of `EngineOptions`. `dsrun generate`, `serve`, `perplexity` and `compare`
take the ones they name (`engine_command` adds them to the Typer command, with a command's own default or help where
it differs) and hand them to their body as one `EngineOptions`; `EngineOptions.run_config` derives the run
(engine/config.py's RunConfig) from it.

This module imports no torch and no engine at import time: the command line imports it before it forks its rank
server (runner/cli.py)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from dsconv.errors import InputError
from dsconv.family.arch import DEFAULT_BLOCK_SIZE
from dsconv.family.layout import DEFAULT_MAX_NUM_BATCHED_TOKENS

if TYPE_CHECKING:
    from dsconv.runner.engine.config import RunConfig
    from dsconv.runner.engine.kv_offload import OffloadConfig
    from dsconv.runner.engine.kv_transfer import KVTransferConfig

# Below V3.2's index_topk (2048) the indexer keeps every key and a prompt's prefill is short: the group's step
# and its per-layer gathers are worth giving for longer ones (docs/benchmarks.md: 4,096 tokens at CP 2).
DEFAULT_CP_MIN_TOKENS = 2048
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CACHE_TOKENS = 4096  # generate's and perplexity's; serve's is SERVE_CACHE_TOKENS
SERVE_CACHE_TOKENS = 16384
KV_CACHE_MEMORY_HELP = ("KV cache size per attention-DP rank in bytes (vLLM's flag), instead of --cache-tokens: as "
                        "many whole blocks as fit, in the cache's own layout (V4: after a fixed slot per "
                        "--max-num-seqs for its windows and compressor state).")


def _must(flag: str, holds: Callable[[Any], bool], what: str) -> Callable[[Any], None]:
    """A flag's check: InputError "FLAG VALUE must be WHAT" unless holds(value)."""
    def check(value) -> None:
        if not holds(value):
            raise InputError(f"{flag} {value} must be {what}")
    return check


def flag(default, help: str, *decls: str, check: Callable[[Any], None] | None = None):
    """One engine flag: its default, its help, Typer's declarations where the name is not the field's (a boolean's
    --x/--no-x) and a check of its value where no config checks it (InputError, one line)."""
    return field(default=default, metadata={"help": help, "decls": decls, "check": check})


@dataclass(frozen=True)
class EngineOptions:
    """Every engine flag, with its default and help. A command that does not take a flag runs its default."""
    device: str = flag("cpu", "cpu (gloo), cuda (nccl) or npu (hccl, needs torch_npu); cuda and npu have not been run "
                              "in CI.")
    dtype: str = flag("bfloat16", "Compute dtype: bfloat16 or float32.")
    world_size: Optional[int] = flag(None, "Ranks to start; must equal the manifest's.")
    timeout: float = flag(DEFAULT_TIMEOUT_S, "Seconds a collective may wait before the job fails.",
                          check=_must("--timeout", lambda s: s > 0, "a positive number of seconds"))
    max_num_seqs: int = flag(16, "Requests running at once per attention-DP rank.")
    max_num_batched_tokens: int = flag(DEFAULT_MAX_NUM_BATCHED_TOKENS, "Tokens one attention-DP rank feeds per step; "
                                                                       "longer prompts are prefilled in chunks.")
    cache_tokens: int = flag(DEFAULT_CACHE_TOKENS, "KV cache capacity per attention-DP rank, in tokens.")
    kv_cache_memory_bytes: Optional[int] = flag(None, KV_CACHE_MEMORY_HELP)
    block_size: int = flag(DEFAULT_BLOCK_SIZE, (
        "Tokens per KV-cache block (vLLM's flag): a power of two; the default 16 is vLLM's GPU default (vllm-ascend "
        "runs 128 on Ascend, where its fused kernels take blocks of 128)."))
    max_model_len: Optional[int] = flag(None, (
        "The most tokens one request may hold, prompt and reply (vLLM's flag). Default: the smaller of the model's "
        "max_position_embeddings and what one attention-DP rank's KV cache holds; a chat request without max_tokens "
        "gets what is left after its prompt."))
    kv_cache_dtype: str = flag("auto", (
        "KV cache entries (vLLM's flag): auto keeps them in the compute dtype; int8 stores V3 / V3.2's MLA latent (a "
        "float32 scale per token and 128 values, the rope key kept in the compute dtype) and indexer keys (a scale "
        "per token; the indexer scores them INT8 x INT8) and dequantizes the latent before attention; for V4 (C8), "
        "its compressed entries and sliding-window rows (a scale per row, the rotary tail in the compute dtype) and "
        "indexer keys."))
    prefill_context_parallel_size: int = flag(1, (
        "Context-parallel prefill (vLLM's name): a prompt of at least --prefill-cp-min-tokens tokens is prefilled in "
        "one step by a group of this many attention-DP ranks (its own and the next ones), each feeding a "
        "causal-balanced share of its tokens; decode then continues on its own rank. Divides the attention-DP size; "
        "attention TP 1; V3 / V3.2 only."))
    prefill_cp_min_tokens: int = flag(DEFAULT_CP_MIN_TOKENS, "The shortest prompt a context-parallel group prefills "
                                                             "(see --prefill-context-parallel-size).")
    dp_balancing: str = flag("cache-aware", (
        "Placing requests on attention-DP ranks: cache-aware (the least work, queued and running tokens plus the "
        "request's prompt less what that rank's prefix cache holds), least-loaded (queued and running tokens) or "
        "round-robin."))
    scheduling_policy: str = flag("fcfs", (
        "Which waiting request runs first: fcfs (by arrival) or priority (the request's `priority`, lower first, "
        "ties by arrival; preemption takes the highest value first), as in vLLM."))
    enable_prefix_caching: bool = flag(True, (
        "Reuse the KV cache of prompt blocks an earlier request on the same attention-DP rank has computed (vLLM's "
        "flag and default): a request computes only what follows its longest cached run of full --block-size blocks, "
        "and usage.prompt_tokens_details.cached_tokens says how many it reused."),
        "--enable-prefix-caching/--no-enable-prefix-caching")
    record_shapes: Optional[Path] = flag(None, (
        "Append one JSON row of what the run's steps covered to this file: prompt lengths, batch size, layout, MoE "
        "handoff, dtypes, the compression ratios that ran in prefill and decode, and the blocks and compression "
        "windows crossed (docs/shape_matrix.md is rendered from such rows)."))
    overlap_shared_experts: bool = flag(True, (
        "Compute each MoE layer's shared expert while its expert exchange travels (the dispatch and combine are "
        "issued asynchronously; on NPU / CUDA the shared expert runs on a second stream). Off: the shared expert runs "
        "after the combine. The tokens are the same either way."),
        "--overlap-shared-experts/--no-overlap-shared-experts")
    kernels: str = flag("torch", (
        "Which kernels the decode steps run: torch (the default), or pypto, the PyPTO kernels of kernels/pypto/ "
        "(V3.2: RMSNorm with the residual add, the lightning indexer, sparse MLA, the MoE gate, the W8A8 experts; V4: "
        "its decode attention and MoE gate). On CPU they run through PyPTO's interpreter, seconds a call: for "
        "checking them against torch, not for speed. Prefill steps (all of perplexity's) and collectives stay torch. "
        "Needs `pip install -e \".[pypto]\"`."))
    speculative_config: Optional[str] = flag(None, (
        "Speculative decoding, vLLM's JSON: '{\"method\": \"mtp\", \"num_speculative_tokens\": k}', k 1 to 3. The "
        "checkpoint's MTP layer drafts k tokens a step for each request and one target step verifies them: greedy "
        "output is the same as without, sampled output has the same distribution. DeepSeek-V3 / V3.2 / V4 shards "
        "with their MTP layer; a request's grammar constrains its drafts, a request with a logit_bias decodes one "
        "token a step."))
    enable_eplb: bool = flag(False, (
        "Expert-parallel load balancing while running (vLLM's flag): each MoE layer's per-expert load is counted over "
        "a sliding window, and every step_interval steps the experts are placed anew (DeepSeek's EPLB policy) over the "
        "shards' physical slots (`dsconv shard --num-redundant-experts`), their weights moving between EP ranks, one "
        "layer per step. The tokens are the same. CPU and CUDA; on --device npu place them statically with `dsconv "
        "shard --expert-load`."), "--enable-eplb")
    eplb_config: Optional[str] = flag(None, (
        "With --enable-eplb, vLLM's JSON: {\"window_size\": 1000, \"step_interval\": 3000, \"num_redundant_experts\": "
        "the shards' (checked), \"log_balancedness\": false, \"use_async\": true (one layer per step; false: every "
        "layer at one step)}."))
    expert_load_record: Optional[Path] = flag(None, (
        "Write the run's tokens per logical expert of every MoE layer, summed over the ranks, to this JSON file at "
        "the end (SGLang's expert-distribution recorder): `dsconv shard --expert-load FILE` places redundant experts "
        "by it."))
    drain_timeout: float = flag(30.0, "On SIGTERM: seconds requests in flight may take to finish before they are "
                                      "aborted.", check=_must("--drain-timeout", lambda s: s >= 0, "0 or more seconds"))
    kv_transfer_config: Optional[str] = flag(None, (
        'Prefill/decode disaggregation, vLLM\'s JSON: {"kv_connector": "MooncakeConnector", "kv_role": '
        '"kv_producer" | "kv_consumer", "kv_connector_extra_config": {"host": ADDRESS, "lease_s": 30, '
        '"transfer_timeout_s": 30, "kv_load_failure_policy": "fail" | "recompute", "auth_key_file": PATH}}. A '
        'producer prefills and hands the KV cache over, signed with the key both are given (required); a consumer '
        'reads it (Mooncake) and decodes. `dsrun router` sends requests to both (docs/pd.md).'))
    kv_offloading_size: Optional[float] = flag(None, (
        "KV cache offload (vLLM's flag): GiB of host memory, over every rank, that keeps the prefix cache's blocks "
        "the KV cache gives up; a later request finds them there and copies them back instead of computing them. "
        "Needs prefix caching."))
    kv_offloading_path: Optional[Path] = flag(None, (
        "A directory for a disk tier under the host one: blocks that fall out of host memory are written there (one "
        "checksummed file each), and a server restarted on it with the same shards finds them. Made when missing; "
        "refused when it holds another model's or layout's blocks. With --kv-offloading-disk-size."))
    kv_offloading_disk_size: Optional[float] = flag(None, "GiB the disk tier may fill, over every rank (the least "
                                                          "recently used files go first).")

    def check(self) -> tuple[OffloadConfig | None, KVTransferConfig | None]:
        """What can be checked without the shards: each flag's own check, then the KV offload and P/D flags parsed
        -> their configs (None: off); InputError, one line."""
        from dsconv.runner.engine.kv_offload import OffloadConfig
        from dsconv.runner.engine.kv_transfer import KVTransferConfig, check_transfer_engine

        for each in dataclasses.fields(self):
            if each.metadata["check"] is not None:
                each.metadata["check"](getattr(self, each.name))
        offload = OffloadConfig.of(self.kv_offloading_size, self.kv_offloading_path, self.kv_offloading_disk_size)
        kv_transfer = None
        if self.kv_transfer_config is not None:
            kv_transfer = KVTransferConfig.parse(self.kv_transfer_config)
            check_transfer_engine()
        return offload, kv_transfer

    def run_config(self, shards: Path, command: str, **fixed) -> RunConfig:
        """The run these options ask for on `shards` (RunConfig.open and with_offload check it against them);
        fixed: flags the command sets itself, whatever was given (generate, perplexity and compare run one sequence
        per DP rank until they have sized the cache, and derive the engine's max_model_len from it)."""
        from dsconv.runner.engine.config import CacheConfig, RunConfig, SchedulerConfig, eplb_config
        from dsconv.runner.engine.speculative import SpeculativeConfig

        o = replace(self, **fixed)
        offload, kv_transfer = o.check()
        scheduler = SchedulerConfig(o.max_num_seqs, o.max_num_batched_tokens, o.dp_balancing,
                                    o.prefill_context_parallel_size, o.prefill_cp_min_tokens, o.enable_prefix_caching,
                                    o.scheduling_policy, kv_transfer)
        run = RunConfig.open(shards, o.world_size, command=command, dtype=o.dtype, device=o.device,
                             cache=CacheConfig(o.cache_tokens, o.kv_cache_memory_bytes, o.kv_cache_dtype,
                                               o.block_size),
                             scheduler=scheduler, max_model_len=o.max_model_len, drain_timeout_s=o.drain_timeout,
                             record_shapes=o.record_shapes, overlap_shared_experts=o.overlap_shared_experts,
                             kernels=o.kernels, speculative=SpeculativeConfig.parse(o.speculative_config),
                             eplb=eplb_config(o.enable_eplb, o.eplb_config), expert_load_record=o.expert_load_record)
        return run.with_offload(offload)


# the flags each command takes, in its --help's order
GENERATE = ("dtype", "device", "world_size", "cache_tokens", "kv_cache_memory_bytes", "block_size", "max_model_len",
            "kv_cache_dtype", "prefill_context_parallel_size", "prefill_cp_min_tokens", "timeout", "record_shapes",
            "overlap_shared_experts", "kernels", "enable_prefix_caching", "speculative_config", "enable_eplb",
            "eplb_config", "expert_load_record")
PERPLEXITY = ("dtype", "device", "world_size", "max_model_len", "kv_cache_dtype", "kv_cache_memory_bytes",
              "block_size", "prefill_context_parallel_size", "prefill_cp_min_tokens", "timeout", "record_shapes",
              "overlap_shared_experts", "kernels")
SERVE = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "cache_tokens", "max_model_len",
         "kv_cache_dtype", "prefill_context_parallel_size", "prefill_cp_min_tokens", "kv_cache_memory_bytes",
         "block_size", "dp_balancing", "scheduling_policy", "world_size", "timeout", "record_shapes",
         "overlap_shared_experts", "kernels", "enable_prefix_caching", "speculative_config", "enable_eplb",
         "eplb_config", "expert_load_record", "drain_timeout", "kv_transfer_config", "kv_offloading_size",
         "kv_offloading_path", "kv_offloading_disk_size")
COMPARE = ("dtype", "device", "kv_cache_dtype", "world_size", "timeout")


def engine_command(app: typer.Typer, names: tuple[str, ...], defaults: dict | None = None,
                   helps: dict | None = None) -> Callable:
    """Registers `body` as a Typer command of `app` whose options are body's own parameters but `engine`, then the
    engine flags `names` as EngineOptions declares them (defaults, helps: a command's own, by name); body is called
    with engine=EngineOptions(those flags)."""
    defaults, helps = defaults or {}, helps or {}
    declared = {each.name: each for each in dataclasses.fields(EngineOptions)}
    hints = typing.get_type_hints(EngineOptions)

    def register(body: Callable) -> Callable:
        own = [p for p in inspect.signature(body, eval_str=True).parameters.values() if p.name != "engine"]
        flags = []
        for name in names:
            meta = declared[name].metadata
            option = typer.Option(*meta["decls"], help=helps.get(name, meta["help"]))
            flags.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                           annotation=Annotated[hints[name], option],
                                           default=defaults.get(name, declared[name].default)))

        @functools.wraps(body)
        def command(**given) -> None:
            engine = EngineOptions(**{name: given.pop(name) for name in names})
            body(**given, engine=engine)

        del command.__wrapped__  # Typer reads the signature below, not body's
        command.__signature__ = inspect.Signature(own + flags)
        command.__annotations__ = {p.name: p.annotation for p in own + flags}
        return app.command()(command)

    return register
