"""Benchmark `dsconv quantize` against a naive converter and a plain file copy, in one run on one checkpoint.

    python scripts/bench_quantize.py [--src DIR] [--work DIR] [--check]

Without --src it generates a >= 2 GB DeepSeek-V3-shaped FP8 checkpoint (cached in --work). Each contender
reads a page-cache-warm source. Targets: dsconv >= 4x faster than the naive converter, and within 2x of the
plain copy. Also prints dsconv's peak RSS (measured by the kernel for the child process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dsconv.convert.plan import TO_INT8, TO_BF16
from dsconv.convert.quantize import build_plan
from dsconv.kernels.int8 import quantize_rows_reference
from dsconv.convert.tiny_checkpoint import LARGE_CONFIG, LARGE_FILE_BYTES, make_tiny_checkpoint

SPEEDUP_TARGET = 4.0  # dsconv vs naive
COPY_RATIO_TARGET = 2.0  # dsconv time / copy time


def naive_convert(src: Path, out: Path) -> None:
    """What a straightforward script does: whole files in RAM, expanded scales, plain torch ops, save_file."""
    plan = build_plan(src, None, "ascend", 1 << 62)
    action = {item.weight.spec.name: item.action for item in plan.items}
    block = plan.checkpoint.block
    index = json.loads((src / "model.safetensors.index.json").read_text())
    out.mkdir(parents=True)
    for file_name in sorted(set(index["weight_map"].values())):
        tensors = load_file(src / file_name)
        result = {}
        for name, value in tensors.items():
            if name not in action:
                continue  # a scale; handled with its weight (which may live in another file)
            if action[name] in (TO_INT8, TO_BF16):
                scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
                scale_file = index["weight_map"][scale_name]
                scale = tensors[scale_name] if scale_name in tensors else load_file(src / scale_file)[scale_name]
                rows, cols = value.shape
                full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
                w = value.to(torch.float32) * full
                if action[name] == TO_INT8:
                    q, s = quantize_rows_reference(w)
                    base = name.removesuffix("weight")
                    result.update({name: q, base + "weight_scale": s, base + "weight_offset": torch.zeros_like(s)})
                else:
                    result[name] = w.to(torch.bfloat16)
            else:
                result[name] = value
        save_file(result, out / file_name, metadata={"format": "pt"})


def plain_copy(src: Path, out: Path, fsync: bool) -> None:
    out.mkdir(parents=True)
    for path in sorted(src.glob("*.safetensors")):
        shutil.copyfile(path, out / path.name)
        if fsync:
            with open(out / path.name, "rb+") as f:
                os.fsync(f.fileno())


def dsconv(src: Path, out: Path) -> int:
    """Runs the real CLI in a fresh wrapper process; returns the CLI's peak RSS in bytes."""
    wrapper = ("import resource, subprocess, sys; "
               "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    cli = [sys.executable, "-m", "dsconv.cli", "quantize", str(src), str(out)]
    proc = subprocess.run([sys.executable, "-c", wrapper, *cli], check=True, capture_output=True, text=True)
    return int(proc.stdout.strip()) * 1024  # ru_maxrss is in KiB on Linux


def timed(fn, *args):
    started = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - started, value


def warm(src: Path) -> int:
    total = 0
    for path in src.glob("*.safetensors"):
        with open(path, "rb") as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, help="checkpoint to convert (default: generate one in --work)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsconv-bench"))
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    src = args.src or args.work / "src"
    if args.src is None and not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        print(f"generating the benchmark checkpoint in {src} ...", flush=True)
        make_tiny_checkpoint(src, "deepseek_v3", config_overrides=LARGE_CONFIG, max_file_bytes=LARGE_FILE_BYTES)
    runs = args.work / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    nbytes = warm(src)
    print(f"source: {src} ({nbytes / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} files), "
          f"{os.cpu_count()} cores", flush=True)

    t_copy, _ = timed(plain_copy, src, runs / "copy", False)
    t_copy_sync, _ = timed(plain_copy, src, runs / "copy-fsync", True)
    shutil.rmtree(runs / "copy"), shutil.rmtree(runs / "copy-fsync")
    t_dsconv, rss = timed(dsconv, src, runs / "dsconv")
    shutil.rmtree(runs / "dsconv")
    t_naive, _ = timed(naive_convert, src, runs / "naive")
    naive_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shutil.rmtree(runs)

    speedup = t_naive / t_dsconv
    copy_ratio = t_dsconv / t_copy
    rows = [("plain copy", t_copy), ("plain copy + fsync", t_copy_sync), ("naive converter", t_naive),
            ("dsconv quantize (CLI, incl. start-up)", t_dsconv)]
    for label, seconds in rows:
        print(f"{label:40s} {seconds:8.2f} s  {nbytes / seconds / 1e9:6.2f} GB/s")
    print(f"dsconv vs naive: {speedup:.2f}x faster (target >= {SPEEDUP_TARGET}x)")
    print(f"dsconv / plain copy: {copy_ratio:.2f}x the time (target <= {COPY_RATIO_TARGET}x); "
          f"/ copy+fsync: {t_dsconv / t_copy_sync:.2f}x")
    print(f"peak RSS: dsconv {rss / 2**20:.0f} MiB, naive (this process) {naive_rss / 2**20:.0f} MiB")
    missed = speedup < SPEEDUP_TARGET or copy_ratio > COPY_RATIO_TARGET
    print("targets:", "MISSED" if missed else "met")
    return 1 if (missed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
