"""Memory is bounded by design: converting a >= 2 GB checkpoint keeps the converter's peak RSS under 1 GB."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from dsconv.convert.tiny_checkpoint import LARGE_CONFIG, LARGE_FILE_BYTES, make_tiny_checkpoint

pytestmark = pytest.mark.slow  # multi-process or large-checkpoint runs

MIN_CHECKPOINT_BYTES = 2 * 10**9
RSS_LIMIT_BYTES = 10**9


def peak_rss_of(cmd: list[str]) -> int:
    """Peak RSS of `cmd`, measured by the kernel, from inside a fresh wrapper process with no other children."""
    wrapper = ("import resource, subprocess, sys; "
               "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
               "print(r.stderr[-2000:], file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True)
    code, maxrss_kib = map(int, proc.stdout.split())
    assert code == 0, proc.stderr
    return maxrss_kib * 1024


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A >= 2 GB checkpoint, deleted when this module is done: the suite must not hold gigabytes of disk."""
    root = tmp_path_factory.mktemp("big")
    src = make_tiny_checkpoint(root / "src", "deepseek_v3",
                               config_overrides=LARGE_CONFIG, max_file_bytes=LARGE_FILE_BYTES)
    size = json.loads((src / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert size >= MIN_CHECKPOINT_BYTES
    yield src
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def big_w8a8(big_checkpoint, tmp_path_factory):
    """`dsconv quantize` of the big checkpoint, run once in a measured process -> (its W8A8 output, its peak RSS):
    the quantize test checks the RSS, the shard test reads the output, and either builds it when run alone."""
    root = tmp_path_factory.mktemp("big-w8a8")
    out = root / "out"
    rss = peak_rss_of([sys.executable, "-m", "dsconv.cli", "quantize", str(big_checkpoint), str(out)])
    assert (out / "quant_model_weights.safetensors.index.json").exists()
    yield out, rss
    shutil.rmtree(root)


def test_quantize_peak_rss_under_1gb(big_checkpoint, big_w8a8):
    out, rss = big_w8a8
    print(f"dsconv quantize peak RSS on a {sum(p.stat().st_size for p in big_checkpoint.glob('*.safetensors')) / 1e9:.2f} GB "
          f"checkpoint: {rss / 2**20:.0f} MiB")
    assert rss < RSS_LIMIT_BYTES, f"peak RSS {rss / 2**20:.0f} MiB"


def test_shard_peak_rss_under_1gb(big_w8a8, tmp_path):
    w8a8, _ = big_w8a8
    out = tmp_path / "shards"
    started = time.perf_counter()
    rss = peak_rss_of([sys.executable, "-m", "dsconv.cli", "shard", str(w8a8), str(out)])
    seconds = time.perf_counter() - started
    size = sum(p.stat().st_size for p in w8a8.glob("*.safetensors"))
    print(f"dsconv shard (EP16/TP16) peak RSS on a {size / 1e9:.2f} GB W8A8 checkpoint: {rss / 2**20:.0f} MiB, "
          f"{seconds:.1f} s incl. start-up ({size / seconds / 1e9:.2f} GB/s)")
    assert rss < RSS_LIMIT_BYTES, f"peak RSS {rss / 2**20:.0f} MiB"
    assert (out / "manifest.json").exists()
    shutil.rmtree(out)
