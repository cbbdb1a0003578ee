import json
import os
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `tests` is a folder of the repo, not an installed package

from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from tests.helpers import quantize, stable_index_ties  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def transformers_index_ties_by_position():
    """Every comparison with transformers' V3.2 breaks the indexer's exact ties by position (helpers.py says why)."""
    with stable_index_ties():
        yield


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory):
    """Session cache of tiny source checkpoints: tiny_source(family, encoding) -> read-only directory."""
    cache: dict[tuple, Path] = {}

    def build(family: str, encoding: str = "fp8", **kwargs) -> Path:
        key = (family, encoding, json.dumps(kwargs, sort_keys=True))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{encoding}")
            cache[key] = make_tiny_checkpoint(out / "src", family, encoding=encoding, **kwargs)
        return cache[key]

    return build


@pytest.fixture
def copy_source(tiny_source, tmp_path):
    """A private, writable copy of a tiny checkpoint, for tests that break it."""

    def build(family: str = "deepseek_v3", encoding: str = "fp8", **kwargs) -> Path:
        dst = tmp_path / "broken-src"
        shutil.copytree(tiny_source(family, encoding, **kwargs), dst)
        return dst

    return build


@pytest.fixture(scope="session")
def w8a8_source(tiny_source, tmp_path_factory):
    """w8a8_source(family): the family's FP8 fixture quantized by dsconv (ascend layout), built once."""
    cache: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in cache:
            out = tmp_path_factory.mktemp(f"{family}-w8a8") / "w8a8"
            quantize(tiny_source(family), out)
            cache[family] = out
        return cache[family]

    return build


@pytest.fixture(scope="session")
def trained_source():
    """trained_source(family, encoding="fp8") -> the family's trained tiny checkpoint (tests/trained.py), derived
    from the shipped one into the dsconv cache ($DSCONV_CACHE or ~/.cache/dsconv) on first use."""
    from tests.trained import trained_source as build

    return build


@pytest.fixture(scope="session")
def trained_shards(trained_source, tmp_path_factory):
    """trained_shards(family) -> (BF16 shards, W8A8 shards) of the family's trained model, one rank each (dsconv
    quantize with the default recipe, then shard), built once per session."""
    from dsconv.family.layout import Layout
    from tests.helpers import quantize, shard

    cache = {}

    def build(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"trained-{family}")
            quantize(trained_source(family), root / "w8a8")
            shard(trained_source(family), root / "bf16-shards", Layout(1, 1, 1, 1))
            shard(root / "w8a8", root / "w8a8-shards", Layout(1, 1, 1, 1))
            cache[family] = root / "bf16-shards", root / "w8a8-shards"
        return cache[family]

    return build


@pytest.fixture(scope="module")
def pypto_deferred_checks():
    """The PyPTO kernels' verify tables checked once, when the module's tests are done (kernels/pypto/host.py,
    deferred_checks): one closing kernel a module instead of one a call (about 0.25 s each). A failed verification
    still fails the run, as an error at the module's teardown that names the kernel and the pass."""
    from dsconv.kernels.pypto.host import deferred_checks

    with deferred_checks():
        yield


# Where a run's time went, per test module (setup, call and teardown summed; a module-scoped server's start charged
# to the test that first asked for it), printed after pytest's own slowest-15 report (`--durations=15` in
# pyproject.toml): what each change adds to the suite shows at the end of every run. Modules under this share of the
# run's test time are left out of the table.
MODULE_SHARE_SHOWN = 0.01
# The AVX2 stand-in's settings (docs/testing.md, "The AVX2 stand-in"): named in the summary when a run has them
STAND_IN = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
_module_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _module_seconds[report.nodeid.split("::")[0]] += report.duration


@pytest.hookimpl(trylast=True)  # after pytest's own report of the slowest tests
def pytest_terminal_summary(terminalreporter):
    total = sum(_module_seconds.values())
    if total <= 0:
        return
    shown = sorted(((s, m) for m, s in _module_seconds.items() if s >= MODULE_SHARE_SHOWN * total), reverse=True)
    terminalreporter.write_sep("=", f"seconds per test module, those over {MODULE_SHARE_SHOWN:.0%} of {total:.0f} s")
    for seconds, module in shown:
        terminalreporter.write_line(f"{seconds:9.1f} s {seconds / total:6.1%}  {module}")
    # every figure goes with its CPU: the model and flags, and what the AVX2 stand-in (docs/testing.md) would cap
    from tests.trained import cpu_description  # (the trained models' module, imported once the run is over)

    caps = " ".join(f"{name}={os.environ[name]}" for name in STAND_IN if name in os.environ)
    terminalreporter.write_line(f"on {cpu_description()}; ATen's kernels {torch.backends.cpu.get_cpu_capability()}"
                                f"{'; ' + caps if caps else ''}")
