"""Where a CPU's training of the tiny models parts from the shipped bytes (tests/trained.py, SHIPPED_SHA256):
fingerprints of the training's inputs and of its first dense steps, under PINNED_CPU_ENV, to compare line by line
with another machine's (docs/benchmarks.md, "Trained tiny models", records an AMD EPYC's).

    python -m tests.tools.trained_fingerprints [--family deepseek_v32 deepseek_v4] [--steps 3] [--ops DIR]

prints, per family: the tokenizer's vocabulary and the token ids (sha256), the model as loaded, then each dense
step's loss (every bit, as a hex float) and the weights after it (sha256 over the state dict). The first line that
differs between two machines names what to pin next: the tokenizer, the initial weights, or a step's arithmetic.
--ops DIR also writes DIR/<family>.ops: every ATen op of the first dense step (forward, backward, clipping and
AdamW), one line each with its outputs' sha256; `diff` two machines' files and the first differing line is the op
that rounds by CPU. Without a second machine, `qemu-x86_64 -cpu EPYC python -m tests.tools...` is one (about 12 minutes
a step): that is how AdamW's sqrt was found (tests/trained.py, IeeeSquareRoot).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.trained import FAMILIES, PINNED_CPU_ENV, IeeeSquareRoot, cpu_description, require_pinned, \
    train_model, training_config, training_tokens

REPO = Path(__file__).resolve().parents[2]


class Enough(Exception):
    """Stops the training after the steps asked for."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def weights_digest(model: torch.nn.Module) -> str:
    state = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        state.update(name.encode())
        state.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return state.hexdigest()[:16]


def tensor_digest(tensor: torch.Tensor) -> str:
    return digest(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())


class OpLog(TorchDispatchMode):
    """Writes each ATen op's name, output shapes and output digests, one line per op."""

    def __init__(self, path: Path):
        super().__init__()
        self.lines = path.open("w")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = [out for out in (result if isinstance(result, (tuple, list)) else [result])
                   if isinstance(out, torch.Tensor) and out.layout == torch.strided and out.numel()]
        self.lines.write(f"{func} {[tuple(out.shape) for out in outputs]} "
                         f"{' '.join(tensor_digest(out) for out in outputs)}\n")
        return result

    def close(self) -> None:
        self.lines.close()


def fingerprints(family: str, steps: int, ops: Path | None = None) -> None:
    require_pinned()
    tokenizer, ids = training_tokens()
    print(f"{family} tokenizer vocab {digest(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())}, "
          f"{len(ids)} token ids {digest(ids.numpy().tobytes())}", flush=True)
    torch.use_deterministic_algorithms(True)

    log = [OpLog(ops / f"{family}.ops")] if ops else []

    def on_dense_step(step: int, model, loss) -> None:
        if log and step < 0:  # the first dense step alone
            log[0].__enter__()
        elif log:
            log[0].__exit__(None, None, None)
            log.pop().close()
        if step < 0:
            print(f"{family} loaded: weights {weights_digest(model)}", flush=True)
            return
        print(f"{family} step {step}: loss {loss.item().hex()} weights {weights_digest(model)}", flush=True)
        if step + 1 >= steps:
            raise Enough

    with tempfile.TemporaryDirectory() as scratch, IeeeSquareRoot():  # as training runs
        try:
            train_model(family, training_config(family), ids, Path(scratch), lambda line: None, on_dense_step)
        except Enough:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=3, help="dense steps to fingerprint")
    parser.add_argument("--ops", type=Path, help="write every op of the first dense step to OPS/<family>.ops")
    args = parser.parse_args()
    if args.ops:
        args.ops.mkdir(parents=True, exist_ok=True)
    print(f"machine: {cpu_description()}", flush=True)
    for family in args.family:  # each in a fresh interpreter with PINNED_CPU_ENV, as training runs
        subprocess.run([sys.executable, "-m", "tests.tools.trained_fingerprints", "--one", family,
                        str(args.steps), *([str(args.ops.resolve())] if args.ops else [])],
                       env={**os.environ, **PINNED_CPU_ENV}, check=True, cwd=REPO)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        fingerprints(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]) if sys.argv[4:] else None)
    else:
        main()
