"""Where the trained tiny models (tests/trained.py) are, for tools outside the tests (scripts/bench_mtp.py).

    python -m tests.tools.trained_model FAMILY [--encoding fp8|bf16]   # prints the checkpoint's directory
    python -m tests.tools.trained_model --heldout                      # prints the held-out text's files

Run from the repository root. FAMILY is deepseek_v32 or deepseek_v4; the checkpoint (the hub's layout, with its
trained MTP layer and tokenizer) is derived from tests/data/trained/ into the cache on first use, a second or two.
The held-out files are the standard library modules the models never trained on (HELDOUT_MODULES), one per line.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from tests.trained import ENCODINGS, FAMILIES, HELDOUT_MODULES, trained_source


def heldout_files() -> list[Path]:
    """The held-out modules' files, in HELDOUT_MODULES' order (tests.trained.heldout_texts reads the same)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / module for module in HELDOUT_MODULES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", nargs="?", choices=FAMILIES)
    parser.add_argument("--encoding", choices=ENCODINGS, default="fp8",
                        help="fp8: the hub's encodings (what dsconv converts); bf16: the same model decoded")
    parser.add_argument("--heldout", action="store_true", help="print the held-out text's files instead")
    args = parser.parse_args()
    if args.heldout == bool(args.family):
        parser.error("give a FAMILY or --heldout")
    for path in heldout_files() if args.heldout else [trained_source(args.family, args.encoding)]:
        print(path)


if __name__ == "__main__":
    main()
