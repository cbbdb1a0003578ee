"""The shape matrix (`--record-shapes FILE`): what a run's steps covered, one JSON row per run appended to FILE.

Rank 0 sees every DP rank's batch of every step (the scheduler's plan), so it records for all of them:
  - prompt_lengths: each request's prompt, as scheduled; batch_size: the most sequences one step ran, all DP ranks;
  - the layout (attention DP and TP, EP, lm_head TP, o_proj / embedding TP), the weights' precision, the compute
    and cache dtypes;
  - handoff: how attention rows reach the MoE exchange. "direct": each attention-DP rank routes its own rows into
    the all-to-all (after o_proj TP's exchange where o_proj is split); "tp-share": an attention-TP group holds the
    same rows, each of its ranks routes an equal share and the results are all-gathered;
  - compression_ratios: the ratios of the layers that ran in prefill rows and in decode rows (V4: 0 for sliding
    window only, 4 CSA, 128 HCA; every layer runs in every step; none for the MLA families);
  - boundaries_crossed: over every row of every step, how many KV-cache blocks were completed, and for V4 how
    many sliding windows and compression windows of each ratio (an entry is complete when its window's last token
    is written); for V3.2, the rows whose context exceeded index_topk (the indexer selected) and the steps that
    ran a context-parallel prefill.
`docs/shape_matrix.md` is rendered from such rows by `scripts/shape_matrix.py`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dsconv.runner.engine.batch import Batch


def handoff(layout) -> str:
    return "tp-share" if layout.attn_tp > 1 else "direct"


@dataclass
class ShapeRecorder:
    path: Path
    fixed: dict  # the run's fields that no step changes
    block_size: int
    ratios: tuple[int, ...]  # the main layers' compression ratios (V4), () for the MLA families
    window: int | None  # V4's sliding window
    index_topk: int | None  # V3.2's
    prompt_lengths: list[int] = field(default_factory=list)
    batch_size: int = 0
    ran: dict[str, set[int]] = field(default_factory=lambda: {"prefill": set(), "decode": set()})
    crossed: Counter = field(default_factory=Counter)
    steps: int = 0

    @classmethod
    def of(cls, run, path: Path, command: str) -> "ShapeRecorder":
        layout, arch = run.layout, run.family.parse_config(run.model_config)
        fixed = {"command": command, "family": run.family.name, "weights": run.manifest["precision"],
                 "world_size": layout.world_size, "attention_dp": layout.dp, "attention_tp": layout.attn_tp,
                 "ep": layout.ep, "lm_head_tp": layout.tp, "oproj_tp": layout.oproj_tp, "embed_tp": layout.embed_tp,
                 "handoff": handoff(layout), "dtype": run.dtype, "kv_cache_dtype": run.cache.dtype,
                 "block_size": run.cache.block_size}
        ratios = tuple(sorted(set(getattr(arch, "compress_ratios", ()))))
        window = getattr(arch, "sliding_window", None) if ratios else None
        topk = getattr(arch, "index_topk", None) if not ratios else None
        return cls(Path(path), fixed, run.cache.block_size, ratios, window, topk)

    def observe(self, step) -> None:
        """One scheduled step (scheduler.Step): its new requests and every DP rank's batch."""
        self.steps += 1
        self.prompt_lengths += [len(request.prompt) for request in step.started]
        self.batch_size = max(self.batch_size, sum(len(batch.seq_ids) for batch in step.batches))
        for batch in step.batches:
            for start, end, kind in _rows(batch):
                self._row(start, end, kind)
            if batch.cp is not None and batch.cp.member == 0:
                self.crossed["context_parallel_prefills"] += 1

    def _row(self, start: int, end: int, kind: str) -> None:
        """Positions start .. end - 1 of one sequence, written this step."""
        self.ran[kind].update(self.ratios)
        self.crossed["blocks"] += end // self.block_size - start // self.block_size
        if self.window:
            self.crossed["sliding_windows"] += end // self.window - start // self.window
        for ratio in self.ratios:
            if ratio:
                self.crossed[f"compression_windows_ratio_{ratio}"] += end // ratio - start // ratio
        if self.index_topk is not None and end > self.index_topk:
            self.crossed["rows_beyond_index_topk"] += 1

    def flush(self) -> None:
        """Appends the row of what was observed since the last flush, if anything ran."""
        if not self.steps:
            return
        row = {**self.fixed, "prompt_lengths": self.prompt_lengths, "batch_size": self.batch_size,
               "compression_ratios": {kind: sorted(ratios) for kind, ratios in self.ran.items()},
               "boundaries_crossed": dict(sorted(self.crossed.items())), "steps": self.steps}
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")
        self.prompt_lengths, self.batch_size, self.steps = [], 0, 0
        self.ran, self.crossed = {"prefill": set(), "decode": set()}, Counter()


def _rows(batch: Batch) -> list[tuple[int, int, str]]:
    """(first position, end, "prefill" or "decode") of each sequence the batch writes. A decode row is one token
    drawn after the first; a context-parallel share counts once, on its owner, for the whole prompt."""
    if batch.cp is not None:
        return [(batch.cp.start, batch.cp.length, "prefill")] if batch.cp.member == 0 else []
    rows = []
    for i, end in enumerate(batch.context_lens):
        length = batch.query_start_loc[i + 1] - batch.query_start_loc[i]
        sample = batch.samples[i]
        kind = "decode" if length == 1 and sample is not None and sample.index > 0 else "prefill"
        rows.append((end - length, end, kind))
    return rows
