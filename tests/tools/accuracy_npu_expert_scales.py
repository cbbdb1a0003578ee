"""What the NPU experts' BF16 channel scales cost in accuracy, measured on CPU with the trained tiny models.

On an NPU the routed experts run in vllm-ascend's W8A8_DYNAMIC form (kernels.moe.NpuExperts), whose grouped
matmul takes each channel's weight scale in BF16 where the CPU path keeps it in float32. This script compares, per
family, the W8A8 checkpoint as dsconv writes it against the same checkpoint with its routed experts' scales rounded
to BF16 (tests/helpers.expert_scales_to_bf16), both run by dsrun's CPU path in float32 compute, with the accuracy
gate's figures (tests/accuracy_gates.py, evaluated pinned): perplexity over the held-out windows, logits cosine, top-1
agreement along the float32-scale model's greedy text. Only the scales differ; NPU rounding is not modelled.

    python -m tests.tools.accuracy_npu_expert_scales [--family deepseek_v32 deepseek_v4] [--work DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from dsconv.family.layout import Layout
from tests.accuracy_gates import EVAL_TOKENS, gate_report, pinned_gate_figures
from tests.helpers import expert_scales_to_bf16, quantize, shard
from tests.trained import cpu_description, trained_source

FAMILIES = ("deepseek_v32", "deepseek_v4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    print(f"machine: {cpu_description()}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        for family in args.family:
            root = Path(scratch) / family
            quantize(trained_source(family), root / "w8a8")
            rounded = expert_scales_to_bf16(root / "w8a8", root / "w8a8-bf16-scales")
            for name in ("w8a8", "w8a8-bf16-scales"):
                shard(root / name, root / f"{name}-shards", Layout(1, 1, 1, 1))
            figures = pinned_gate_figures(trained_source(family) / "tokenizer.json", EVAL_TOKENS,
                                          (root / "w8a8-shards", "auto"), (root / "w8a8-bf16-scales-shards", "auto"))
            print(gate_report(f"{family}: W8A8 expert scales float32 -> BF16 ({rounded} scale tensors)", figures),
                  flush=True)


if __name__ == "__main__":
    main()
