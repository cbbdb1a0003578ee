"""Where the suite's time goes: per test module and per test, from the durations a pytest run printed.

    .venv/bin/python -m pytest -q --durations=0 > suite.log 2>&1
    python scripts/suite_times.py suite.log [--slowest 15] [--json FILE]

pytest's `--durations=0` prints one line per phase of every test (`12.34s call     tests/test_x.py::test_y[p]`);
this sums setup, call and teardown per module and per test, and prints the modules slowest first with their share
of the whole, then the slowest tests. A module-scoped fixture's setup (a live server started for the module) is
charged to the test that first asked for it, as pytest reports it. Lines pytest hid (under 0.005 s) count as 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?\.py)::(\S+)")


def durations(text: str) -> dict[tuple[str, str], float]:
    """(module, test) -> seconds over its phases, from a pytest log."""
    tests: dict[tuple[str, str], float] = defaultdict(float)
    for line in text.splitlines():
        match = DURATION.match(line.strip())
        if match:
            seconds, _, module, test = match.groups()
            tests[(module, test)] += float(seconds)
    return dict(tests)


def by_module(tests: dict[tuple[str, str], float]) -> list[tuple[str, float, int]]:
    """(module, seconds, tests) slowest first."""
    modules: dict[str, list[float]] = defaultdict(list)
    for (module, _), seconds in tests.items():
        modules[module].append(seconds)
    return sorted(((m, sum(s), len(s)) for m, s in modules.items()), key=lambda row: -row[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="a pytest run's output, with --durations=0")
    parser.add_argument("--slowest", type=int, default=15, help="how many of the slowest tests to list (default 15)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    tests = durations(args.log.read_text(errors="replace"))
    if not tests:
        print(f"suite_times: no duration lines in {args.log}: run pytest with --durations=0", file=sys.stderr)
        return 2
    total = sum(tests.values())
    modules = by_module(tests)
    print(f"{'module':<44} {'tests':>6} {'seconds':>9} {'share':>6}")
    for module, seconds, count in modules:
        print(f"{module:<44} {count:>6} {seconds:>9.1f} {seconds / total:>6.1%}")
    print(f"{'all':<44} {len(tests):>6} {total:>9.1f} ({total / 60:.1f} min)")
    slowest = sorted(tests.items(), key=lambda item: -item[1])[:args.slowest]
    print(f"\nthe slowest {len(slowest)} tests:")
    for (module, test), seconds in slowest:
        print(f"{seconds:>9.1f}  {module}::{test}")
    if args.json:
        args.json.write_text(json.dumps({"total_s": total, "modules": [
            {"module": m, "seconds": s, "tests": c} for m, s, c in modules],
            "slowest": [{"test": f"{m}::{t}", "seconds": s} for (m, t), s in slowest]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
