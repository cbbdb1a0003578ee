"""One rank's side of the engine: its model built from its shards, and each step's batch turned into the model's
inputs (here only) and run through the model and the sampler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dsconv.family.arch import family_for
from dsconv.kernels.device import flush_denormals
from dsconv.runner.engine.grammar import Grammars
from dsconv.runner.engine.request import SeqResult
from dsconv.runner.engine.sampler import step_results
from dsconv.runner.models.batch import DUMMY_SEQ_ID, Batch
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.kv_cache import BLOCK_SIZE, KVCache, StepMeta
from dsconv.runner.models.registry import model_for
from dsconv.runner.models.weights import load_rank

if TYPE_CHECKING:
    from dsconv.runner.engine.config import RunConfig

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class CacheFactory:
    """A model's caches: `factory(tokens, kv_cache_dtype)` makes one holding `tokens` tokens per rank;
    `tokens_in(nbytes, kv_cache_dtype)` says how many tokens fit in a byte budget (whole blocks)."""

    def __init__(self, entry, cfg, model, device: torch.device):
        self.entry, self.cfg, self.model, self.device = entry, cfg, model, device

    def __call__(self, tokens: int, kv_cache_dtype: str = "auto"):
        return self.entry.new_cache(self.cfg, self.model, tokens, self.device, kv_cache_dtype)

    def tokens_in(self, nbytes: int, kv_cache_dtype: str = "auto") -> int:
        per_block = self.entry.bytes_per_token(self.cfg, self.model, kv_cache_dtype) * BLOCK_SIZE
        return nbytes // per_block * BLOCK_SIZE


def build_model(shards: Path, manifest: dict, rank: int, dist: Dist, dtype: torch.dtype):
    """-> (model, its config, a CacheFactory for the cache its forward takes), by the shards' family."""
    config = manifest["model"]["config"]
    family = family_for(config)
    entry = model_for(family.name)
    cfg = family.parse_config(config)
    flush_denormals(dist.device)  # the thread that builds the model is the one that runs it
    weights = load_rank(shards, manifest, rank, dist.device)
    model = entry.new_model(cfg, weights, dist, dtype)
    return model, cfg, CacheFactory(entry, cfg, model, dist.device)


def rank_device(device: str) -> torch.device:
    """The device this rank computes on: the launcher has already selected its accelerator (set_device)."""
    if device == "cpu":
        return torch.device("cpu")
    return torch.device(device, getattr(torch, device).current_device())  # torch.cuda / torch.npu


def start_rank(run: RunConfig):
    """On every rank, after the launcher's init_process_group: -> (Dist, model, new_cache) of this rank's shards."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    dist = Dist.from_layout(run.manifest["layout"], rank_device(run.device), run.scheduler.cp_size) \
        if torch.distributed.is_initialized() else Dist(device=rank_device(run.device))
    model, _, new_cache = build_model(run.shards, run.manifest, rank, dist, DTYPES[run.dtype])
    return dist, model, new_cache


@dataclass(frozen=True)
class StepInputs:
    """What the model's forward takes for one step, besides the cache."""
    tokens: torch.Tensor  # [T] int64: the batch's input ids
    meta: StepMeta  # positions, slots, each sequence's context
    rows: torch.Tensor | None  # the rows whose logits the step needs (Batch.logit_rows); None: every row
    dummy: bool = False  # an idle rank's throwaway token (batch.DUMMY_SEQ_ID): its results are dropped


def prepare_inputs(cache: KVCache, batch: Batch) -> StepInputs:
    """One step's model inputs from its batch, on the cache's device: the batch checked as received (before
    anything is written), the samples forked since the last step copied from their parents, the sequences
    finished, aborted or preempted since then released, the step's metadata from the batch's block tables and
    slots, and the token ids."""
    batch.validate(cache.block_size, cache.num_blocks)
    for fork in batch.forks:
        cache.fork(fork)
    for seq_id in batch.releases:
        cache.release(seq_id)
    dummy = cache.dummy_batch() if batch.num_tokens == 0 and batch.cp is None else None
    if dummy is not None:  # an idle rank on an accelerator: one throwaway token, its logits computed and dropped
        meta = cache.prepare_meta(dummy)
        return StepInputs(torch.tensor(dummy.input_ids, dtype=torch.long, device=meta.positions.device), meta,
                          None, dummy=True)
    meta = cache.prepare_meta(batch)
    device = meta.positions.device
    rows = batch.logit_rows()
    every_row = rows == list(range(batch.num_tokens))
    return StepInputs(torch.tensor(batch.input_ids, dtype=torch.long, device=device), meta,
                      None if every_row else torch.tensor(rows, dtype=torch.long, device=device))


class Worker:
    """One rank's side of a step: its DP index's batch through the model and the sampler."""

    def __init__(self, model, cache: KVCache, dist: Dist, dp_index: int, grammars: Grammars | None = None):
        self.model, self.cache, self.dist, self.dp_index = model, cache, dist, dp_index
        self.grammars = grammars  # constrained decoding on this rank (serve); None: requests carry no grammar
        self.reports = dist.attn_tp_rank == 0  # attention-TP ranks of one DP index compute the same rows
        self.steps = 0  # steps this rank has run

    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[SeqResult] | None:
        """-> one result per sequence of the batch from the reporting rank of the DP index (None from the
        others)."""
        inputs = prepare_inputs(self.cache, batch)
        if self.grammars is not None:
            for seq_id in batch.releases:
                self.grammars.release(seq_id)
        self.steps += 1
        logits = self.model.forward(inputs.tokens, inputs.meta, self.cache, rows=inputs.rows)
        if inputs.dummy:
            self.cache.release(DUMMY_SEQ_ID)
            return [] if self.reports else None
        if not self.reports:
            return None
        return step_results(batch.for_sampler(), logits, self.grammars)
