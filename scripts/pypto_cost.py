"""PyPTO 0.2.0's cost model on the PyPTO kernels of kernels/pypto/ at DeepSeek-V3.2's and DeepSeek-V4-Flash's real
decode shapes: each kernel's modelled cycles and time, a decode step's (the kernel times the layers that run it),
and a memory roofline: the bytes the kernel's operands and outputs hold against the chip's memory bandwidth.

    python scripts/pypto_cost.py [--only KEY ...] [--context 8192] [--expert-tokens 8] [--kv-cache bf16|int8]
                                 [--bandwidth-tbs 1.6]
                                 [--timeout 1800] [--json FILE]

Every figure is a model's estimate, nothing is measured on an NPU: every host call of a PyPTO kernel
(kernels/pypto/host.py) runs PyPTO's cost model (its SIM run) on the call's tile graph, for the target architecture
PyPTO reports (pypto.platform.npuarch, DAV_2201: the Ascend A2/A3 class; the model's config says A2A3 and its core
counts). The CPU the script runs on does not enter the model's cycles. Per kernel:
- cycles: the model's "Total Cycles" (its statistic report: the whole simulated run, AICPU scheduling included),
  and the AICore end-to-end span (the first task's start to the last task's end on the AIC / AIV cores, as PyPTO's
  draw_swim_lane.py computes its "AICore End-to-End Time" from the swim-lane JSON);
- time: cycles at CLOCK_MHZ;
- floor: the kernel's operand and output bytes (weights, the cache rows it gathers through its slots, not the whole
  cache it is handed, activations; placeholder operands a form never reads left out) over the bandwidth, the
  memory-bound floor; ratio: the model's time over the floor. The caches hold --context rows (one sequence's).
A decode step's figure is each kernel times the decoder layers that run it under `--kernels pypto`
(runner/models/kernel_switch.py), the layer counts from the real configs (tests/data/*.config.json); the MTP layer,
the projections, the shared expert, the collectives and the lm_head are not in it.

Shapes (batch 1: one token of one sequence per card, attention DP), from the configs: V3.2: hidden 7168, 128 heads
of 512 + 64 (absorbed MLA) over top-2048 of --context positions, index 64 x 128, 256 experts in 8 groups (4 kept,
top-8), moe_intermediate 2048, its indexer scoring --context positions for their top index_topk (2048). V4-Flash:
hidden 4096, 64 heads of 512
against a 128-key window, plus top-512 compressed entries (CSA, ratio 4) or every ratio-128 entry (HCA), 256
experts top-6 (3 hash-routed layers). Experts: EP16, 16 experts a card; --expert-tokens tokens reach the card,
each picking top-k of its experts, the rows spread evenly (round robin).

Each kernel runs in a child process of its own (a PyPTO crash costs one row: its failure is printed in one line).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"V3.2": REPO / "tests" / "data" / "deepseek_v32_exp.config.json",
           "V4-Flash": REPO / "tests" / "data" / "deepseek_v4_flash.config.json"}
# PyPTO 0.2.0's cost model counts cycles at 1800 MHz: libtile_fwk_simulation.so starts draw_swim_lane.py with
# --time_convert_denominator=1800 (cycles / 1800 = microseconds), and the script's trans_cycles_to_time converts
# with freq_convert = 1800 (pypto/lib/scripts/draw_swim_lane.py)
CLOCK_MHZ = 1800
# Ascend 910B (A2) HBM2e bandwidth, about 1.6 TB/s as commonly quoted: a public spec figure, not measured here
# and not checked against a datasheet (--bandwidth-tbs for another)
BANDWIDTH_TBS = 1.6
TERA = 1e12
MIB = 2**20
CONTEXT = 8192  # cached positions per sequence
EP = 16  # expert parallelism: a card holds n_routed_experts / EP experts
EXPERT_TOKENS = 8  # tokens reaching a card's experts in a decode step (--expert-tokens)
TIMEOUT_S = 1800  # per kernel (its child process)
RESULT = "PYPTO_COST_RESULT "  # the child's result line on stdout (PyPTO prints there too)
COST_DIR = "output_*/CostModelSimulationOutput"  # below a call's TILE_FWK_OUTPUT_DIR
STAT_REPORT, CONFIG_INI, SWIM = "_simulate.stat.report.txt", "_simulate.config.ini", "_simulate.swim.json"
AICORES = ("AIC", "AIV")
ESTIMATE = "cost model estimate, PyPTO 0.2.0, not measured on an NPU"


@dataclass
class Case:
    """One kernel at one shape: `call` runs it (host.run once), `layers` decoder layers run it per decode step."""
    key: str
    model: str
    kernel: str
    shape: str
    layers: int
    layers_note: str
    call: object = field(repr=False, default=None)
    unread: tuple = ()  # operand indices the kernel declares but this form never reads (placeholders)
    rows_read: dict = field(default_factory=dict)  # operand index -> rows read of it (a cache gathered through slots)

    def operand_bytes(self, index: int, tensor) -> int:
        """What the kernel moves of operand `index`: nothing for a placeholder, the rows it gathers of a cache,
        else the whole tensor."""
        if index in self.unread:
            return 0
        if index in self.rows_read:
            return self.rows_read[index] * tensor.element_size() * (tensor.numel() // tensor.shape[0])
        return tensor.numel() * tensor.element_size()


def config(model: str) -> dict:
    return json.loads(CONFIGS[model].read_text())


def expert_counts(tokens: int, topk: int, experts: int) -> list[int]:
    """tokens x topk rows spread round robin over a card's experts."""
    rows = tokens * topk
    return [rows // experts + (e < rows % experts) for e in range(experts)]


def rows_text(tokens: int, topk: int, experts: int) -> str:
    counts = expert_counts(tokens, topk, experts)
    spread = f"{counts[0]}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
    return f"{tokens} tokens x top-{topk} = {sum(counts)} rows ({spread} an expert)"


def _rand(*shape, dtype=None):
    import torch

    return torch.randn(*shape).to(dtype or torch.float32)


def _int8(*shape):
    import torch

    return torch.randint(-127, 128, shape, dtype=torch.int8)


def _experts(count: int, hidden: int, inter: int):
    import torch

    from dsconv.kernels.moe import ExpertWeights

    return ExpertWeights(_int8(count, 2 * inter, hidden), _int8(count, hidden, inter),
                         torch.rand(count, 2 * inter, 1) * 1e-3, torch.rand(count, hidden, 1) * 1e-3)


def _expert_call(tokens: int, topk: int, count: int, hidden: int, inter: int, limit: float | None):
    def call():
        import torch

        from dsconv.kernels.pypto.experts import grouped_w8a8_mlp

        counts = expert_counts(tokens, topk, count)
        grouped_w8a8_mlp(_rand(sum(counts), hidden, dtype=torch.bfloat16), counts, _experts(count, hidden, inter),
                         limit=limit)
    return call


def _norm_call(hidden: int, eps: float):
    def call():
        import torch

        from dsconv.kernels.pypto.rms_norm import add_rms_norm

        add_rms_norm(_rand(1, hidden, dtype=torch.bfloat16), _rand(1, hidden, dtype=torch.bfloat16),
                     _rand(hidden, dtype=torch.bfloat16), eps)
    return call


def _v3_gate_call(c: dict):
    """V3 / V3.2's MoE gate on one token, as the model calls it."""
    def call():
        import torch

        from dsconv.kernels.pypto.moe_gate import v3_gate

        v3_gate(_rand(1, c["hidden_size"], dtype=torch.bfloat16), _rand(c["n_routed_experts"], c["hidden_size"]) * 0.02,
                torch.zeros(c["n_routed_experts"]), c["n_group"], c["topk_group"], c["num_experts_per_tok"],
                c["norm_topk_prob"], c["routed_scaling_factor"])
    return call


def v32_cases(args) -> list[Case]:
    """V3.2's decode-step kernels, as runner/models/deepseek_v3.py calls them under --kernels pypto."""
    c = config("V3.2")
    hidden, heads, lora, rope = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    layers, moe = c["num_hidden_layers"], c["num_hidden_layers"] - c["first_k_dense_replace"]
    local, inter, topk = c["n_routed_experts"] // EP, c["moe_intermediate_size"], c["num_experts_per_tok"]
    int8 = args.kv_cache == "int8"
    idx_heads, idx_dim, keys_n = c["index_n_heads"], c["index_head_dim"], min(c["index_topk"], args.context)

    def indexer():
        import torch

        from dsconv.kernels.pypto.indexer import indexer_topk

        positions = args.context
        keys = _int8(positions, idx_dim) if int8 else _rand(positions, idx_dim, dtype=torch.bfloat16)
        indexer_topk(_rand(1, idx_heads, idx_dim), _rand(1, idx_heads), keys,
                     torch.rand(positions, 1) * 1e-2 if int8 else None, torch.arange(positions)[None], None,
                     c["index_topk"])

    def mla():
        import torch

        from dsconv.kernels.pypto.sparse_mla import sparse_mla_decode

        bf16 = torch.bfloat16
        cache = ({"c_kv_k_pe.int8": _int8(args.context, lora), "c_kv_k_pe.scale": torch.rand(args.context, 1) * 1e-2,
                  "c_kv_k_pe.rest": _rand(args.context, rope, dtype=bf16)} if int8
                 else {"c_kv_k_pe": _rand(args.context, lora + rope, dtype=bf16)})
        slots = torch.randperm(args.context)[:keys_n].sort().values[None]
        sparse_mla_decode(_rand(1, heads, lora + rope, dtype=bf16), cache, slots, None, lora,
                          (c["qk_nope_head_dim"] + rope) ** -0.5)

    cache = "INT8 cache" if int8 else "BF16 cache"
    return [
        Case("v32.norm", "V3.2", "add_rms_norm", f"1 x {hidden} BF16", layers,
             "every layer (post-attention)", _norm_call(hidden, c["rms_norm_eps"])),
        Case("v32.indexer", "V3.2", "indexer_topk",
             f"{idx_heads} x {idx_dim} heads, {args.context} positions, top-{c['index_topk']} ({cache})", layers,
             "every layer", indexer,
             # keys [S, dim] and their scales [S, 1] (placeholders for a float cache), every context row read
             unread=() if int8 else (3,), rows_read={2: args.context, 3: args.context}),
        Case("v32.mla", "V3.2", "sparse_mla_decode", f"{heads} heads x {lora}+{rope}, {keys_n} of {args.context} "
             f"rows ({cache})", layers, "every layer", mla,
             # the latent cache [S, ...], its scales and rope keys (placeholders for a BF16 cache): keys_n rows read
             unread=() if int8 else (2, 3), rows_read={1: keys_n, 2: keys_n, 3: keys_n}),
        Case("v32.gate", "V3.2", "v3_gate", f"1 x {hidden}, {c['n_routed_experts']} experts, {c['n_group']} groups "
             f"(keep {c['topk_group']}), top-{topk}", moe, f"MoE layers ({layers} - {c['first_k_dense_replace']} "
             "dense)", _v3_gate_call(c)),
        Case("v32.experts", "V3.2", "grouped_w8a8_mlp", f"{local} experts {hidden} x {inter} W8A8, "
             f"{rows_text(args.expert_tokens, topk, local)}", moe,
             "MoE layers", _expert_call(args.expert_tokens, topk, local, hidden, inter, None), unread=(1,)),
    ]


def v4_attention_call(heads: int, keys_n: int, dim: int):
    def call():
        import torch

        from dsconv.kernels.pypto.v4_attention import v4_decode_attention

        v4_decode_attention(_rand(1, heads, dim, dtype=torch.bfloat16), _rand(1, keys_n, dim, dtype=torch.bfloat16),
                            torch.ones(1, keys_n, dtype=torch.bool), _rand(heads), dim ** -0.5)
    return call


def v4_cases(args) -> list[Case]:
    """V4-Flash's decode-step kernels, as runner/models/deepseek_v4.py calls them under --kernels pypto (and the
    RMSNorm kernel at its hidden size, which V4's step does not run)."""
    c = config("V4-Flash")
    hidden, heads, dim, window = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["sliding_window"]
    layers, experts, topk = c["num_hidden_layers"], c["n_routed_experts"], c["num_experts_per_tok"]
    ratios = c["compress_ratios"][:layers]  # one per decoder layer, then the MTP layer's
    hashed, local, inter = c["num_hash_layers"], experts // EP, c["moe_intermediate_size"]
    csa = window + min(c["index_topk"], args.context // 4)
    hca = window + args.context // 128

    def gate(hash_layer: bool):
        def call():
            import torch

            from dsconv.kernels.pypto.moe_gate import v4_gate

            x, router = _rand(1, hidden, dtype=torch.bfloat16), _rand(experts, hidden, dtype=torch.bfloat16) * 0.02
            if hash_layer:
                v4_gate(x, router, None, topk, c["routed_scaling_factor"],
                        torch.randint(0, experts, (c["vocab_size"], topk)), torch.tensor([5]))
            else:
                v4_gate(x, router, torch.zeros(experts), topk, c["routed_scaling_factor"])
        return call

    attention = [("swa", "window only", window, 0), ("csa", f"window + top-{c['index_topk']} of the ratio-4 entries",
                                                      csa, 4),
                 ("hca", f"window + all {args.context // 128} ratio-128 entries", hca, 128)]
    return [
        *[Case(f"v4.attn.{kind}", "V4-Flash", "v4_decode_attention", f"{heads} heads x {dim}, {n} keys ({what})",
               ratios.count(ratio), f"layers with compress ratio {ratio}", v4_attention_call(heads, n, dim))
          for kind, what, n, ratio in attention],
        Case("v4.gate", "V4-Flash", "v4_gate", f"1 x {hidden}, {experts} experts, top-{topk}", layers - hashed,
             f"top-k layers ({layers} - {hashed} hash)", gate(False)),
        Case("v4.gate.hash", "V4-Flash", "v4_hash_gate", f"1 x {hidden}, tid2eid {c['vocab_size']} x {topk}", hashed,
             "hash layers", gate(True)),
        Case("v4.experts", "V4-Flash", "grouped_w8a8_mlp", f"{local} experts {hidden} x {inter} W8A8, "
             f"{rows_text(args.expert_tokens, topk, local)}, swiglu limit {c['swiglu_limit']}", layers,
             "every layer (all MoE)",
             _expert_call(args.expert_tokens, topk, local, hidden, inter, c["swiglu_limit"]), unread=(1,)),
        Case("v4.norm", "V4-Flash", "add_rms_norm", f"1 x {hidden} BF16", 0, "not in V4's step (its norms stay "
             "torch)", _norm_call(hidden, c["rms_norm_eps"])),
    ]


def all_cases(args) -> list[Case]:
    return v32_cases(args) + v4_cases(args)


# --- the child: one kernel, its cost model's reports read through host.on_call


def cost_of(directory: str) -> dict:
    """The cost model's figures for one call's PyPTO directory (summed if the call ran more than one graph)."""
    outputs = sorted(Path(directory).glob(COST_DIR))
    if not outputs:
        raise RuntimeError(f"no {COST_DIR} below the call's directory: did the cost model run?")
    figures = {"total_cycles": 0, "aicore_cycles": 0, "graphs": len(outputs)}
    for out in outputs:
        report = (out / STAT_REPORT).read_text()
        figures["total_cycles"] += int(_field(report, r"Total Cycles\.*:\s*(\d+)"))
        figures["cube_cores"] = int(_field(report, r"Cube Count\.*:\s*(\d+)"))
        figures["vector_cores"] = int(_field(report, r"Vector Count\.*:\s*(\d+)"))
        figures["device_arch"] = _field((out / CONFIG_INI).read_text(), r"deviceArch\s*=\s*(\S+)")
        figures["aicore_cycles"] += aicore_span(json.loads((out / SWIM).read_text()))
    return figures


def _field(text: str, pattern: str) -> str:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"the cost model's report lacks {pattern!r}")
    return found.group(1)


def aicore_span(cores: list[dict]) -> int:
    """draw_swim_lane.py's "AICore End-to-End Time", in cycles: the AIC / AIV tasks' last end less first start."""
    tasks = [t for core in cores if core.get("coreType") in AICORES for t in core["tasks"]
             if t.get("execEnd", 0) >= t.get("execStart", 0)]
    if not tasks:
        return 0
    return max(t["execEnd"] for t in tasks) - min(t["execStart"] for t in tasks)


def child(args) -> None:
    """Runs one case and prints its calls' figures on one RESULT line."""
    from dsconv.kernels.pypto import host

    case = next(c for c in all_cases(args) if c.key == args.child)
    calls = []

    def record(name: str, tensors: list, directory: str) -> None:
        moved = sum(case.operand_bytes(i, t) for i, t in enumerate(tensors))
        calls.append({"kernel": name, "bytes": moved, **cost_of(directory)})

    host.install()  # outside the timing: the calculator's load
    host.on_call = record
    started = time.perf_counter()
    case.call()
    print(RESULT + json.dumps({"calls": calls, "host_s": time.perf_counter() - started}), flush=True)


# --- the parent


def run_case(case: Case, args) -> dict:
    """The case in a child process -> its row: the figures, or `error` (one line)."""
    cmd = [sys.executable, __file__, "--child", case.key, "--context", str(args.context), "--expert-tokens",
           str(args.expert_tokens), "--kv-cache", args.kv_cache]
    row = {k: v for k, v in asdict(case).items() if k not in ("call", "unread", "rows_read")}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {args.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        return {**row, "error": failure_line(done)}
    result = json.loads(lines[-1][len(RESULT):])
    cost = figures(result["calls"], args.bandwidth_tbs * TERA)
    return {**row, **cost, "step_us": cost["model_us"] * case.layers, "host_s": result["host_s"]}


def failure_line(done: subprocess.CompletedProcess) -> str:
    """A failed child's last error line (a signal named when it died of one)."""
    if done.returncode < 0:
        return f"killed by signal {-done.returncode}"
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return ((errors or lines or ["no output"])[-1])[:300]


def figures(calls: list[dict], bandwidth: float) -> dict:
    """A case's calls summed: cycles, the model's times, the bytes, the floor and the ratio."""
    total = sum(c["total_cycles"] for c in calls)
    moved = sum(c["bytes"] for c in calls)
    floor_us = moved / bandwidth * 1e6
    model_us = total / CLOCK_MHZ
    return {"total_cycles": total, "aicore_cycles": sum(c["aicore_cycles"] for c in calls), "model_us": model_us,
            "aicore_us": sum(c["aicore_cycles"] for c in calls) / CLOCK_MHZ, "bytes": moved, "floor_us": floor_us,
            "ratio": model_us / floor_us if floor_us else None,
            **{k: calls[-1][k] for k in ("device_arch", "cube_cores", "vector_cores")}}


def steps(rows: list[dict]) -> dict:
    """Per model: the decode step's kernels summed (each kernel's time and floor times its layers)."""
    out = {}
    for model in CONFIGS:
        done = [r for r in rows if r["model"] == model and "error" not in r]
        out[model] = {"model_us": sum(r["model_us"] * r["layers"] for r in done),
                      "floor_us": sum(r["floor_us"] * r["layers"] for r in done),
                      "failed": [r["key"] for r in rows if r["model"] == model and "error" in r],
                      "layers": config(model)["num_hidden_layers"]}
    return out


def header(rows: list[dict], args) -> dict:
    import pypto
    from importlib import metadata

    done = [r for r in rows if "error" not in r]
    first = done[0] if done else {}
    return {"estimate": ESTIMATE, "pypto": metadata.version("pypto"), "npuarch": str(pypto.platform.npuarch),
            "device_arch": first.get("device_arch"), "cube_cores": first.get("cube_cores"),
            "vector_cores": first.get("vector_cores"), "clock_mhz": CLOCK_MHZ,
            "bandwidth_bytes_per_s": args.bandwidth_tbs * TERA, "context": args.context,
            "expert_tokens": args.expert_tokens,
            "ep": EP, "kv_cache": args.kv_cache}


def print_report(head: dict, rows: list[dict], step: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    console.print(f"[bold]{ESTIMATE}[/bold]. Cost model (SIM run) target {head['npuarch']} "
                  f"({head['device_arch']}, {head['cube_cores']} cube + {head['vector_cores']} vector cores), "
                  f"cycles at {CLOCK_MHZ} MHz; roofline at {head['bandwidth_bytes_per_s'] / TERA:g} TB/s (Ascend "
                  f"910B HBM2e, the quoted spec figure, not measured); batch 1, context {head['context']}, "
                  f"{head['kv_cache']} KV cache, EP{EP}")
    table = Table(show_lines=False)
    for name in ("model", "kernel", "shape", "cycles", "model µs", "AICore µs", "MiB", "floor µs", "ratio",
                 "layers", "step µs"):
        table.add_column(name, justify="left" if name in ("model", "kernel", "shape") else "right",
                         overflow="fold")
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["kernel"], r["shape"], f"[red]failed: {r['error']}[/red]", *[""] * 7)
            continue
        table.add_row(r["model"], r["kernel"], r["shape"], f"{r['total_cycles']:,}", f"{r['model_us']:.1f}",
                      f"{r['aicore_us']:.1f}", f"{r['bytes'] / MIB:.2f}", f"{r['floor_us']:.2f}",
                      f"{r['ratio']:.1f}x", f"{r['layers']}", f"{r['step_us']:,.0f}")
    console.print(table)
    console.print(f"layers: a decode step's decoder layers that run the kernel (MTP layer not counted); step µs = "
                  f"model µs x layers; experts: EP{EP}, {head['expert_tokens']} tokens reach the card, spread evenly")
    if any(r.get("ratio") is not None and r["ratio"] < 1 for r in rows):
        console.print("ratio < 1: the model's time is under the bandwidth floor; its config "
                      f"({CONFIG_INI}) sets per-core copy pipes and L2 latencies, no memory bandwidth limit, so "
                      "there the floor, not the model, is the lower bound")
    for model, s in step.items():
        failed = f"; failed, not counted: {', '.join(s['failed'])}" if s["failed"] else ""
        console.print(f"{model} decode step ({s['layers']} layers), these kernels only: model "
                      f"{s['model_us'] / 1e3:.2f} ms, memory floor {s['floor_us'] / 1e3:.3f} ms{failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="case keys (default: all)")
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--expert-tokens", type=int, default=EXPERT_TOKENS)
    parser.add_argument("--kv-cache", choices=("bf16", "int8"), default="bf16")
    parser.add_argument("--bandwidth-tbs", type=float, default=BANDWIDTH_TBS)
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cases = all_cases(args)
    unknown = set(args.only or ()) - {c.key for c in cases}
    if unknown:
        parser.error(f"unknown --only keys {sorted(unknown)}: one of {[c.key for c in cases]}")
    cases = [c for c in cases if args.only is None or c.key in args.only]
    started = time.perf_counter()
    rows = []
    for case in cases:
        print(f"+ {case.key}", file=sys.stderr, flush=True)
        rows.append({"key": case.key, **run_case(case, args)})
    head = header(rows, args)
    step = steps(rows)
    print_report(head, rows, step)
    if args.json is not None:
        args.json.write_text(json.dumps({**head, "wall_s": time.perf_counter() - started, "kernels": rows,
                                         "steps": step}, indent=1))


if __name__ == "__main__":
    main()
