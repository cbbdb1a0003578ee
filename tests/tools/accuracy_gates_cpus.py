"""The accuracy gates' figures on other CPUs, simulated on this one: each gate of tests/test_accuracy_gate.py
evaluated (tests/accuracy_gates.py) under environments that make this machine choose the kernels another CPU
would, and under the pinned environment the gates use (PINNED_CPU_ENV).

    python -m tests.tools.accuracy_gates_cpus [--env pinned native avx2 baseline pinned-sse42] [--gate ...]
                                              [--work DIR]    # from the repository root

Environments: `native`, this CPU's own choice (a thread per core); `avx2`, an AVX2-only CPU such as an AMD EPYC of
family 25 (ATen's AVX2 kernels, MKL's AVX2 path, glibc without its AVX-512 variants, a thread per core);
`baseline`, ATen's baseline kernels with MKL's compatible path on one thread but glibc as the CPU picks it;
`pinned`, PINNED_CPU_ENV; `pinned-sse42`, PINNED_CPU_ENV with MKL also capped at SSE4.2. Prints one line per gate
and environment, with the same figures the test records and checks (docs/benchmarks.md has a run's table).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from dsconv.family.layout import Layout
from tests.accuracy_gates import CACHE_GATE_WINDOWS, CONTEXT, EVAL_TOKENS, V4_CACHE_GATE_WINDOWS, gate_report, \
    pinned_gate_figures
from tests.helpers import quantize, shard
from tests.trained import PINNED_CPU_ENV, cpu_description, trained_source, unrecorded_bytes

# what each environment sets; an empty value removes the variable, so the CPU's own choice applies
ENVS = {
    "native": {"ATEN_CPU_CAPABILITY": "", "MKL_CBWR": "", "OMP_NUM_THREADS": "", "MKL_NUM_THREADS": "",
               "GLIBC_TUNABLES": ""},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "OMP_NUM_THREADS": "", "MKL_NUM_THREADS": "", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
                 "MKL_NUM_THREADS": "1", "GLIBC_TUNABLES": ""},
    "pinned": PINNED_CPU_ENV,
    "pinned-sse42": {**PINNED_CPU_ENV, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
GATES = ("deepseek_v32 w8a8 vs bf16", "deepseek_v4 w8a8 vs bf16", "deepseek_v32 int8 KV cache",
         "deepseek_v32 recipe v32-indexer vs v3", "deepseek_v4 int8 KV cache")


def environment(name: str) -> dict:
    env = {**os.environ}
    for key, value in ENVS[name].items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def sides(root: Path, cache_windows: int | None) -> dict:
    """The gates' shard sets, one rank each: gate name -> (family, eval tokens, base side, other side)."""
    for family in ("deepseek_v32", "deepseek_v4"):
        quantize(trained_source(family), root / family / "w8a8")
        shard(trained_source(family), root / family / "bf16-shards", Layout(1, 1, 1, 1))
        shard(root / family / "w8a8", root / family / "w8a8-shards", Layout(1, 1, 1, 1))
    quantize(trained_source("deepseek_v32"), root / "indexer", recipe="v32-indexer")
    shard(root / "indexer", root / "indexer-shards", Layout(1, 1, 1, 1))
    v32 = root / "deepseek_v32"
    v32_windows, v4_windows = (cache_windows, cache_windows) if cache_windows else (CACHE_GATE_WINDOWS,
                                                                                     V4_CACHE_GATE_WINDOWS)
    return {
        GATES[0]: ("deepseek_v32", EVAL_TOKENS, (v32 / "bf16-shards", "auto"), (v32 / "w8a8-shards", "auto")),
        GATES[1]: ("deepseek_v4", EVAL_TOKENS, (root / "deepseek_v4" / "bf16-shards", "auto"),
                   (root / "deepseek_v4" / "w8a8-shards", "auto")),
        GATES[2]: ("deepseek_v32", v32_windows * CONTEXT, (v32 / "bf16-shards", "auto"),
                   (v32 / "bf16-shards", "int8")),
        GATES[3]: ("deepseek_v32", v32_windows * CONTEXT, (v32 / "w8a8-shards", "auto"),
                   (root / "indexer-shards", "auto")),
        GATES[4]: ("deepseek_v4", v4_windows * CONTEXT, (root / "deepseek_v4" / "bf16-shards", "auto"),
                   (root / "deepseek_v4" / "bf16-shards", "int8")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", nargs="+", choices=list(ENVS), default=list(ENVS))
    parser.add_argument("--gate", nargs="+", choices=GATES, default=list(GATES))
    parser.add_argument("--cache-windows", type=int,
                        help=f"windows of the cache gates (default: the tests': {CACHE_GATE_WINDOWS} for V3.2's, "
                             f"{V4_CACHE_GATE_WINDOWS} for V4's)")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    print(f"machine: {cpu_description()}", flush=True)
    for family in ("deepseek_v32", "deepseek_v4"):
        print(unrecorded_bytes(family) or f"trained {family}: the recorded bytes", flush=True)
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        gates = sides(Path(scratch), args.cache_windows)
        for name in args.gate:
            family, tokens, base, other = gates[name]
            for env in args.env:
                started = time.perf_counter()
                figures = pinned_gate_figures(trained_source(family) / "tokenizer.json", tokens, base, other,
                                              environment(env))
                print(f"[{env}, {time.perf_counter() - started:.0f} s] {gate_report(name, figures)}", flush=True)


if __name__ == "__main__":
    main()
