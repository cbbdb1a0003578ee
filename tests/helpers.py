"""What several test modules share: building outputs, reading them back with other projects' loaders, running
ranks. Test modules import from here (or take conftest's fixtures), never from each other."""

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from dsconv.comm.launch import launch
from dsconv.family.arch import DEFAULT_BLOCK_SIZE
from dsconv.convert.quantize import build_plan, run_quantize
from dsconv.kernels.int8 import quantize_rows_reference
from dsconv.kernels.moe import ExpertWeights
from dsconv.runner.engine.block_pool import BlockPool
from dsconv.runner.engine.config import CacheConfig, RunConfig, EngineConfig, SchedulerConfig
from dsconv.runner.engine.core import EngineClient, new_engine
from dsconv.runner.engine.request import SamplingParams
from dsconv.runner.engine.worker import InputBuilder, StepInputs
from dsconv.runner.entrypoints.generate import generate
from dsconv.runner.entrypoints.perplexity import score
from dsconv.runner.models.dist import Dist
from dsconv.runner.engine.batch import Batch
from dsconv.runner.models.step import StepMeta
from dsconv.runner.models.v4_cache import V4Cache
from dsconv.shard.shard import ExpertRequest, make_shard_plan, run_shard
from tests.rank_entries import recorded

FAMILIES = ("deepseek_v3", "deepseek_v32", "deepseek_v4")
SMALL_FILES = 1_000_000  # bytes: a file cap that gives several output files even on the tiny fixtures
COSINE_MIN = 0.9999  # every INT8 tensor against its source, dequantized (docs/testing.md: measured minimum 0.99997)

# Distributed runs: prompts of different lengths, one longer than a 16-token cache block
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 137)), [42] * 20]
NEW_TOKENS = 10
RANKS_TIMEOUT_S = 120


class Steps:
    """Steps chosen by a test rather than a scheduler, on one cache: each step's (seq_id, new tokens) pairs become a
    Batch whose block tables a BlockPool of the cache's size gives, as the scheduler's does, and the worker's
    InputBuilder turns it into the model's inputs."""

    def __init__(self, cache):
        self.cache, self.pool = cache, BlockPool(cache.num_blocks, cache.block_size)
        self.builder = InputBuilder(cache)
        self.lengths: dict[int, int] = {}  # seq_id -> tokens fed so far

    def inputs(self, new_tokens: list[tuple[int, list[int]]]) -> StepInputs:
        batch = Batch()
        for seq_id, tokens in new_tokens:
            stop = self.lengths.get(seq_id, 0) + len(tokens)
            table = self.pool.grow(seq_id, stop)  # InputError when the cache cannot hold it
            batch.add(seq_id, list(tokens), stop, table, self.pool.block_size, None, None)
            self.lengths[seq_id] = stop
        return self.builder(batch)

    def forward(self, model, new_tokens: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One step -> the logits of every row [T, vocab]."""
        inputs = self.inputs(new_tokens)
        return model.forward(inputs.tokens, inputs.meta, self.cache)

    def release(self, seq_id: int) -> None:
        self.pool.release(seq_id)
        self.builder.release(seq_id)
        self.lengths.pop(seq_id, None)


def last_rows(meta: StepMeta) -> torch.Tensor | None:
    """The row of each sequence's last token, where its next-token logits come from; None when that is every
    row, as in a decode step (one token per sequence)."""
    if all(s.query_len == 1 for s in meta.seqs):
        return None
    return torch.tensor([s.stop - 1 for s in meta.seqs], dtype=torch.long, device=meta.positions.device)


def forward_full(model, tokens: torch.Tensor) -> torch.Tensor:
    """A DeepSeek-V4 model over one whole sequence from position 0, in one step on a new state -> logits [T, vocab]:
    what stepped, chunked and batched runs are compared with."""
    cache = V4Cache(model.cfg, tokens.shape[0], model.dtype, tokens.device)
    return Steps(cache).forward(model, [(0, tokens.tolist())])


class Recorder:
    """Wraps a callable of a model (a layer, a norm) and appends what each call returns, or with inputs=True the
    first argument it gets, to `seen`."""

    def __init__(self, wrapped, seen: list, inputs: bool = False):
        self.wrapped, self.seen, self.inputs = wrapped, seen, inputs

    def __call__(self, *args, **kwargs):
        if self.inputs:
            self.seen.append(args[0])
        out = self.wrapped(*args, **kwargs)
        if not self.inputs:
            self.seen.append(out)
        return out


def window_nll(logits, window: list[int]) -> float:
    """logits [len(window), vocab] -> the summed negative log-likelihood of window[1:], in float64."""
    targets = torch.tensor(window[1:], device=logits.device)
    log_probs = torch.nn.functional.log_softmax(logits[:-1].float(), dim=-1)  # [len - 1, vocab]
    return -log_probs.gather(1, targets[:, None]).double().sum().item()


def transformers_perplexity(model, cut: list[list[int]]) -> tuple[float, int]:
    """transformers' perplexity of the windows, each scored from its second token on -> (perplexity, tokens
    scored); log-softmax in float64."""
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for window in cut:
            log_probs = torch.log_softmax(model(torch.tensor([window])).logits[0, :-1].double(), dim=-1)
            nll -= log_probs.gather(1, torch.tensor(window[1:])[:, None]).sum().item()
            tokens += len(window) - 1
    return math.exp(nll / tokens), tokens


def quantized_weight(out_features, in_features, gen):
    """A random weight as INT8 [out, in] with its per-channel scale [out, 1] (the reference quantizer)."""
    return quantize_rows_reference(torch.randn(out_features, in_features, generator=gen))


def random_experts(n_experts, hidden, inter, seed, int8=True) -> ExpertWeights:
    """n_experts random stacked experts: BF16, or INT8 with their scales."""
    gen = torch.Generator().manual_seed(seed)
    if not int8:
        return ExpertWeights(torch.randn(n_experts, 2 * inter, hidden, generator=gen).to(torch.bfloat16),
                             torch.randn(n_experts, hidden, inter, generator=gen).to(torch.bfloat16))
    w13, s13 = zip(*(quantized_weight(2 * inter, hidden, gen) for _ in range(n_experts)))
    w2, s2 = zip(*(quantized_weight(hidden, inter, gen) for _ in range(n_experts)))
    return ExpertWeights(torch.stack(w13), torch.stack(w2), torch.stack(s13), torch.stack(s2))


def expert_scales_to_bf16(source, out) -> int:
    """A copy of the W8A8 checkpoint `source` at `out` whose routed experts' channel scales are rounded to values
    BF16 holds exactly (still float32): what the NPU's grouped experts compute with (kernels.moe.NpuExperts).
    Returns how many scale tensors it rounded; none is an error."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    rounded = 0
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if ".experts." in name and name.endswith("weight_scale"):
                tensors[name] = tensor.to(torch.bfloat16).to(torch.float32)
                rounded += 1
        save_file(tensors, path, metadata=metadata)
    if not rounded:
        raise ValueError(f"no routed expert scales in {source}")
    return rounded


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def quantize(src, out, fmt="ascend", recipe=None):
    return run_quantize(build_plan(src, recipe, fmt, SMALL_FILES), out, workers=2, on_progress=lambda n: None)


def shard(src, out, layout, experts=ExpertRequest()):
    return run_shard(make_shard_plan(src, layout, SMALL_FILES, experts), out, 2, lambda n: None)


def read_all(directory, index_name):
    """name -> tensor for every tensor of a checkpoint, through safetensors' own loader and the index."""
    index = json.loads((directory / index_name).read_text())
    tensors = {}
    for file_name in sorted(set(index["weight_map"].values())):
        with safe_open(directory / file_name, "pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    assert set(tensors) == set(index["weight_map"]), "index and files disagree"
    return tensors, index


def source_reference(src):
    """Source tensors decoded to float32 by transformers' dequantization (independent of our decoders)."""
    # imported here: helpers load in every rank and pinned gate process, which need nothing of transformers (2 s)
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    raw, _ = read_all(src, "model.safetensors.index.json")
    scale_of = {}  # weight name -> its scale's name
    for name in raw:
        for suffix in (".weight_scale_inv", ".scale"):
            weight = name.removesuffix(suffix) + ".weight"
            if name.endswith(suffix) and weight in raw:
                scale_of[weight] = name
    dequantize = Fp8Dequantize(None)._dequantize_one
    return {name: dequantize(value, raw[scale_of[name]], output_dtype=torch.float32) if name in scale_of else value
            for name, value in raw.items() if name not in scale_of.values()}


def greedy(model, cache, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
           vocab_size: int | None = None) -> list[list[int]]:
    """In-process greedy generation on one rank through the engine dsrun builds (core.new_engine): every prompt
    admitted at once and prefilled in one step, then one token per sequence per step, each stopping at EOS (None:
    never) or after max_new_tokens. The finished sequences' room is given back to the cache, which the next call
    may reuse."""
    scheduler = SchedulerConfig(max_num_seqs=max(1, len(prompts)),
                                max_num_batched_tokens=max(1, sum(map(len, prompts))))
    engine = new_engine(model, cache, Dist(), EngineConfig(vocab_size=vocab_size or model.cfg.vocab_size,
                                                           max_model_len=cache.num_blocks * cache.block_size,
                                                           eos_token_id=eos_id, scheduler=scheduler))
    door = EngineClient()
    door.open(engine)
    outputs: list[list[int]] = [[] for _ in prompts]
    for index, prompt in enumerate(prompts):
        door.submit(prompt, SamplingParams(max_tokens=max_new_tokens),
                    lambda out, index=index: outputs[index].extend(out.new_token_ids))
    engine.run(door, until_idle=True)
    for seq_id in engine.scheduler.ranks[0].releases:  # freed by the scheduler, to free on the rank with a next step
        cache.release(seq_id)
    return outputs


def run_config(shards, dtype="float32", cache_tokens=256, kv_cache_dtype="auto", cp_size=1, cp_min_tokens=None,
               max_num_seqs=16, max_num_batched_tokens=4096, block_size=DEFAULT_BLOCK_SIZE,
               overlap_shared_experts=True, enable_prefix_caching=True, speculative=None, eplb=None,
               expert_load_record=None, kernels="torch") -> RunConfig:
    return RunConfig.open(shards, dtype=dtype, cache=CacheConfig(cache_tokens, None, kv_cache_dtype, block_size),
                          scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, cp_size=cp_size,
                                                    cp_min_tokens=cp_min_tokens,
                                                    enable_prefix_caching=enable_prefix_caching),
                          overlap_shared_experts=overlap_shared_experts, speculative=speculative, eplb=eplb,
                          expert_load_record=expert_load_record, kernels=kernels)


def launch_ranks(entry, args: dict, run: RunConfig, results) -> dict:
    """entry(run=run, **args) on every rank of the run's layout, as local processes over gloo -> rank 0's return
    value (read from the file tests.rank_entries.recorded writes in `results`)."""
    results.mkdir()
    record = results / "rank0.json"
    code = launch(recorded, {"entry": entry, "record_path": str(record), "run": run, **args},
                  world_size=run.layout.world_size, device="cpu", timeout_s=RANKS_TIMEOUT_S, log_dir=results / "logs")
    assert code == 0, [p.read_text()[-2000:] for p in (results / "logs").glob("*.log")]
    return json.loads(record.read_text())


def generate_ranks(shards, results, prompts=PROMPTS, dtype="float32", new_tokens=NEW_TOKENS, kv_cache_dtype="auto",
                   cp_size=1, cp_min_tokens=None, entry=generate, block_size=DEFAULT_BLOCK_SIZE,
                   overlap_shared_experts=True, speculative=None, eplb=None, expert_load_record=None,
                   kernels="torch", **extra) -> dict:
    """dsrun generate's ranks (entry: generate, or one that installs a test double first) -> rank 0's account
    (generate.Generated as a dict). eplb, expert_load_record: as RunConfig's."""
    run = run_config(shards, dtype, 256, kv_cache_dtype, cp_size, cp_min_tokens, max(1, len(prompts)),
                     sum(map(len, prompts)), block_size, overlap_shared_experts, speculative=speculative, eplb=eplb,
                     expert_load_record=expert_load_record, kernels=kernels)
    return launch_ranks(entry, {"prompts": prompts, "max_new_tokens": new_tokens, **extra}, run, results)


def run_ranks(shards, tmp_path, prompts=PROMPTS, dtype="float32", new_tokens=NEW_TOKENS, results_name=None,
              **options) -> list[list[int]]:
    """Generation on every rank -> each prompt's generated tokens; the results directory is tmp_path /
    results_name (default: named after the shards)."""
    results = tmp_path / (results_name or f"results-{shards.name}")
    return generate_ranks(shards, results, prompts, dtype, new_tokens, **options)["generated"]


def score_ranks(shards, results, windows: list[list[int]], dtype="float32", kv_cache_dtype="auto", cp_size=1,
                cp_min_tokens=None) -> dict:
    """dsrun perplexity's ranks on these windows -> rank 0's summary (perplexity, tokens, nll, CP prefills)."""
    longest = max(map(len, windows))
    run = run_config(shards, dtype, longest, kv_cache_dtype, cp_size, cp_min_tokens, 1, longest)
    return launch_ranks(score, {"windows": windows}, run, results)


SERVER_START_S = 300  # a 16-rank server loads 16 shard sets on 2 cores


LISTENING = re.compile(r"dsrun serve: listening on http://[^:\s]+:(\d+),")  # rank 0's line once uvicorn has bound


class Server:
    """`dsrun serve --port 0` as a subprocess on the port the OS chose (read back from its log), ready (/health 200)
    when constructed; its output goes to log_path."""

    def __init__(self, shards, log_path, *flags, preexec_fn=None):
        import subprocess
        import sys
        import time

        import httpx

        self.log_path, self.port = log_path, None
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dsconv.runner.cli", "serve", "--shards", str(shards), "--port", "0",
                 *map(str, flags)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # a group of its own
                preexec_fn=preexec_fn,
                env={**os.environ, "TMPDIR": str(Path(log_path).parent)})  # a failed run's logs stay in the test's dir
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.log()}"
            if self.port is None:
                bound = LISTENING.search(self.log_path.read_text())
                self.port = int(bound.group(1)) if bound else None
            try:
                if self.port is not None and httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise AssertionError(f"the server was not ready within {SERVER_START_S} s:\n{self.log()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def openai(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self, timeout=60, group: bool = False) -> int:
        """SIGTERM, as a service manager stops it -> its exit code: to the launcher, or (group) to every process of
        the server's process group at once, as systemd's KillMode=control-group and `kill -- -PGID` do."""
        import signal

        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the server leads its own group (start_new_session)
            else:
                self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def _stable_topk(tensor, k, dim=-1, largest=True, sorted=True):
    values, indices = tensor.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class stable_index_ties:
    """transformers' V3.2 lightning indexer with ties broken by position, as ours breaks them.

    The indexer keeps the top index_topk of sum_h w_h relu(q_h . k) per query; relu leaves exact ties (every
    head's product <= 0 gives 0), and on the tiny fixtures' 4 index heads that is one key in 16. torch.topk
    leaves the order of ties unspecified (on CPU it depends on the row's length), so transformers' choice among
    tied keys changes with the shape of the call; ours keeps the lowest positions whatever the chunking. Only
    the tie order changes here: inside the indexer's forward, topk becomes a stable descending sort."""

    def __enter__(self):
        from transformers.models.deepseek_v32 import modeling_deepseek_v32

        indexer = modeling_deepseek_v32.DeepseekV32Indexer
        self.original = original = indexer.forward

        def forward(module, *args, **kwargs):
            saved = torch.Tensor.topk
            torch.Tensor.topk = _stable_topk
            try:
                return original(module, *args, **kwargs)
            finally:
                torch.Tensor.topk = saved

        indexer.forward = forward
        return self

    def __exit__(self, *exc):
        from transformers.models.deepseek_v32 import modeling_deepseek_v32

        modeling_deepseek_v32.DeepseekV32Indexer.forward = self.original


def answer_ctrl_c() -> None:
    """subprocess.Popen's preexec_fn for a child a test interrupts with SIGINT: the default disposition, so the
    child's Python raises KeyboardInterrupt as one started from a terminal does. A job started in the background
    by a non-interactive shell (`cmd &`: CI scripts, nohup'd runs) inherits SIGINT ignored, and Python keeps an
    ignored SIGINT ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_one_line_error(result, *needles):
    """A CliRunner result of bad input: exit 2 and one line, `error: ...`, holding every needle."""
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
