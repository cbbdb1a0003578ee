"""Where a CPU's training of the tiny models parts from the recorded bytes (tests/trained.py, TRAINED_SHA256):
fingerprints of the training's inputs and of its first dense steps, under PINNED_CPU_ENV, to compare line by line
with another machine's (docs/benchmarks.md, "Trained tiny models", records an AMD EPYC's).

    python scripts/trained_fingerprints.py [--family deepseek_v32 deepseek_v4] [--steps 3]

prints, per family: the tokenizer's vocabulary and the token ids (sha256), the model as loaded, then each dense
step's loss (every bit, as a hex float) and the weights after it (sha256 over the state dict). The first line that
differs between two machines names what to pin next: the tokenizer, the initial weights, or a step's arithmetic.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the training lives with the tests (tests/trained.py), outside the installed package

from tests.trained import FAMILIES, PINNED_CPU_ENV, cpu_description, require_pinned, train_model, \
    training_config, training_tokens  # noqa: E402


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


def fingerprints(family: str, steps: int) -> None:
    require_pinned()
    tokenizer, ids = training_tokens()
    print(f"{family} tokenizer vocab {digest(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())}, "
          f"{len(ids)} token ids {digest(ids.numpy().tobytes())}", flush=True)
    torch.use_deterministic_algorithms(True)

    def on_dense_step(step: int, model, loss) -> None:
        if step < 0:
            print(f"{family} loaded: weights {weights_digest(model)}", flush=True)
            return
        print(f"{family} step {step}: loss {loss.item().hex()} weights {weights_digest(model)}", flush=True)
        if step + 1 >= steps:
            raise Enough

    with tempfile.TemporaryDirectory() as scratch:
        try:
            train_model(family, training_config(family), ids, Path(scratch), lambda line: None, on_dense_step)
        except Enough:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=3, help="dense steps to fingerprint")
    args = parser.parse_args()
    print(f"machine: {cpu_description()}", flush=True)
    for family in args.family:  # each in a fresh interpreter with PINNED_CPU_ENV, as training runs
        subprocess.run([sys.executable, "-m", "dsconv.scripts.trained_fingerprints", "--one", family,
                        str(args.steps)], env={**os.environ, **PINNED_CPU_ENV}, check=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        fingerprints(sys.argv[2], int(sys.argv[3]))
    else:
        main()
