"""The pipeline at the real dimensions, truncated in depth and experts, end to end at world 16 on this machine.

    python scripts/real_dims.py [--family deepseek_v32 deepseek_v4] [--experts 32] [--work DIR] [--tiny]

For each family it builds a checkpoint in the hub's encodings from the real config (tests/data/*.config.json) with
the real attention, indexer and vocabulary sizes and routing, but few layers and `--experts` routed experts per
layer (random weights: FP8 e4m3 with 128 x 128 block scales; V4's experts FP4 with e8m0 scales per 32):
  - V3.2: one dense layer and two MoE layers, 7168 hidden, 128 heads, index top-k 2048, top-8 of 8 groups / top-4;
  - V4-Flash: four layers with ratios 0, 4, 128, 4, the first hash-routed, 4096 hidden, 64 x 512 heads, top-6.
Then `dsconv quantize`, `dsconv shard` (EP16 / lm_head TP16 at attention DP16; V3.2 also DP2 x TP8, and DP16 with
o_proj and embedding TP16), `dsrun generate` at world 16 with a prompt of more than 2048 tokens (so that V3.2's
indexer selects, and V4's CSA layers hold more than index_topk entries), and `dsrun compare` of the BF16 and W8A8
shards against the source (in BF16: float32 compute would give each of the 16 ranks a float32 copy of every
replicated weight; the tiny configs compare in float32). It prints, and appends to --work/real_dims.jsonl: seconds per stage, the peak memory of each
stage's process tree (PSS per rank and in all, and the machine's used memory, from psutil), per-layer cosines, and
decode tokens per second.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"deepseek_v32": REPO / "tests" / "data" / "deepseek_v32_exp.config.json",
           "deepseek_v4": REPO / "tests" / "data" / "deepseek_v4_flash.config.json"}
# what each family's truncated checkpoint changes in the real config (the rest is the real model's)
TRUNCATION = {
    "deepseek_v32": {"num_hidden_layers": 3, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0},
    "deepseek_v4": {"num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1,
                    "num_nextn_predict_layers": 0},
}
LAYOUTS = {"deepseek_v32": {"dp16": ["--ep", 16, "--tp", 16], "dp2-tp8": ["--ep", 16, "--tp", 16, "--attn-tp", 8],
                            "dp16-fine": ["--ep", 16, "--tp", 16, "--oproj-tp", 16, "--embed-tp", 16]},
           "deepseek_v4": {"dp16": ["--ep", 16, "--tp", 16]}}
NEW_TOKENS = 8
PROMPT_CHARS = 9000  # Python source: about 2,400 tokens with DeepSeek's tokenizer
# --tiny: the families' tiny test configs at attention DP16 only, the suite's smaller variant
# (tests/test_real_dims.py); about 190 tokens, past the tiny V3.2's index_topk and V4's compression windows
TINY_PROMPT_CHARS = 700
TINY_LAYOUTS = ("dp16",)
POLL_S = 0.5


class TreePeak:
    """Peak memory of a process and its descendants, polled: their proportional set sizes (PSS: a page mapped by n
    processes counts 1/n in each, so the 16 ranks' shared shard pages are not counted 16 times) in all and of the
    largest process, and the machine's used memory (total less available) above what it was at the start."""

    def __init__(self, pid: int):
        self.root, self.total, self.largest, self._stop = psutil.Process(pid), 0, 0, threading.Event()
        self.baseline = self.used = self._machine_used()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    @staticmethod
    def _machine_used() -> int:
        memory = psutil.virtual_memory()
        return memory.total - memory.available

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                sizes = [p.memory_full_info().pss for p in procs if p.is_running()]
            except psutil.Error:
                continue
            self.total, self.largest = max(self.total, sum(sizes)), max(self.largest, max(sizes, default=0))
            self.used = max(self.used, self._machine_used())

    def stop(self) -> dict:
        self._stop.set()
        self.thread.join()
        return {"peak_pss_total_gb": round(self.total / 1e9, 2), "peak_pss_one_process_gb": round(self.largest / 1e9, 2),
                "peak_machine_used_gb": round((self.used - self.baseline) / 1e9, 2)}


class StageFailed(Exception):
    pass


def stage(record: dict, name: str, cmd: list, capture: bool = False, figures_exit: int | None = None) -> str:
    """Runs one stage, recording its seconds and peak memory; a failed stage is recorded with the last line of its
    error and ends the family's run (figures_exit: an exit code that carries figures, as dsrun compare's 1)."""
    started = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    peak = TreePeak(proc.pid)
    out, err = proc.communicate()
    figures = {"seconds": round(time.perf_counter() - started, 1), **peak.stop()}
    record[name] = figures
    if proc.returncode not in (0, figures_exit) or (proc.returncode and not (out or "").strip()):
        lines = [line for line in err.splitlines() if line.strip()]
        figures["failed"] = f"exit {proc.returncode}: {lines[-1] if lines else ''}"
        print(f"  {name}: {figures}", flush=True)
        raise StageFailed(name)
    print(f"  {name}: {figures}", flush=True)
    return out or ""


def build_source(family: str, out: Path, experts: int, tiny: bool) -> None:
    from dsconv.convert.tiny_checkpoint import TensorMaker, _copy_tokenizer, make_tiny_checkpoint, write_checkpoint
    from dsconv.family.arch import family_for

    if tiny:
        make_tiny_checkpoint(out, family, real_vocab=True)  # the real tokenizer reads the prompt
        return
    config = {**json.loads(CONFIGS[family].read_text()), **TRUNCATION[family], "n_routed_experts": experts}
    out.mkdir(parents=True)
    write_checkpoint(out, config, TensorMaker(family_for(config), config, seed=0), "fp8")
    _copy_tokenizer(out)


def run_family(family: str, work: Path, experts: int, record: dict, tiny: bool = False) -> None:
    """Every stage of one family, its figures into `record`; raises StageFailed at the first that fails."""
    record.update(variant="tiny" if tiny else "truncated", **({} if tiny else {"experts_per_layer": experts,
                                                                              **TRUNCATION[family]}))
    py = sys.executable
    source, w8a8 = work / f"{family}-src", work / f"{family}-w8a8"
    if not source.exists():
        stage(record, "build source", [py, __file__, "--build", family, "--experts", experts, "--work", work,
                                       *(["--tiny"] if tiny else [])])
    record["source_gb"] = round(sum(p.stat().st_size for p in source.glob("*.safetensors")) / 1e9, 2)
    subprocess.run(["rm", "-rf", str(w8a8)], check=True)  # a whole run each time, not a resumed one
    stage(record, "quantize", [py, "-m", "dsconv.cli", "quantize", source, w8a8])
    prompt = Path(inspect.__file__).read_text(encoding="utf-8")[:TINY_PROMPT_CHARS if tiny else PROMPT_CHARS]
    for layout, flags in LAYOUTS[family].items():
        if tiny and layout not in TINY_LAYOUTS:
            continue
        for precision, src in (("bf16", source), ("w8a8", w8a8)):
            if precision == "bf16" and layout != "dp16":
                continue  # BF16 shards once, for the comparison at the first layout
            shards = work / f"{family}-{precision}-{layout}"
            subprocess.run(["rm", "-rf", str(shards)], check=True)
            stage(record, f"shard {precision} {layout}", [py, "-m", "dsconv.cli", "shard", src, shards, *flags])
            out = stage(record, f"generate {precision} {layout}",
                        [py, "-m", "dsconv.runner.cli", "generate", "--shards", shards, "--prompt", prompt, "--no-chat",
                         "--max-new-tokens", NEW_TOKENS, "--json"], capture=True)
            generated = json.loads(out.strip().splitlines()[-1])
            record[f"generate {precision} {layout}"].update(
                prompt_tokens=len(generated["prompt_token_ids"][0]), timings=generated.get("timings"))
            if layout == "dp16":
                out = stage(record, f"compare {precision}",
                            [py, "-m", "dsconv.runner.cli", "compare", "--shards", shards, "--reference", source,
                             "--prompt", prompt, "--dtype", "float32" if tiny else "bfloat16", "--json"], capture=True,
                            figures_exit=1)
                report = json.loads(out.strip().splitlines()[-1])
                record[f"compare {precision}"].update(
                    layer_cosines=[round(row["cosine"], 6) for row in report["layers"]],
                    logits_cosine=round(report["logits_cosine"], 6), top1=round(report["top1_agreement"], 4),
                    reference_peak_gb=round(report["reference_peak_rss_bytes"] / 1e9, 2),
                    reference_largest_part_gb=round(report["reference_largest_part_bytes"] / 1e9, 2))
            if shards.exists():
                subprocess.run(["rm", "-rf", str(shards)], check=True)  # the disk holds one shard set at a time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--experts", type=int, default=32, help="routed experts per MoE layer (the real: 256)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/real_dims"))
    parser.add_argument("--tiny", action="store_true",
                        help="the families' tiny test configs, at attention DP16 only: the suite's smaller variant")
    parser.add_argument("--build", help=argparse.SUPPRESS)  # the source build's own process (its memory measured)
    args = parser.parse_args()
    if args.build:
        build_source(args.build, args.work / f"{args.build}-src", args.experts, args.tiny)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    stopped = []
    for family in args.family:
        what = "the tiny config" if args.tiny else f"experts {args.experts}"
        print(f"{family}: {what}, work {args.work}", flush=True)
        record = {"family": family}
        try:
            run_family(family, args.work, args.experts, record, args.tiny)
        except StageFailed as failed:
            print(f"{family}: stopped at {failed}", flush=True)
            stopped.append(family)
        with (args.work / "real_dims.jsonl").open("a") as out:
            out.write(json.dumps(record) + "\n")
    sys.exit(1 if stopped else 0)


if __name__ == "__main__":
    main()
