"""`dsconv quantize` as a user meets it: bad input, --dry-run, and interrupted runs that resume."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dsconv.cli import app
from tests.helpers import answer_ctrl_c

INDEX = "model.safetensors.index.json"
OUT_INDEX = "quant_model_weights.safetensors.index.json"


def run_cli(*args):
    return CliRunner().invoke(app, ["quantize", *map(str, args)])


def assert_clean_failure(result, out: Path, *needles):
    text = result.output
    assert result.exit_code == 2, text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in text
    # the progress bar may have started (errors found while converting); the error is still one line
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("quantize:")]
    assert len(lines) == 1 and lines[0].startswith("error:"), text
    for needle in needles:
        assert needle in text, (needle, text)
    assert not (out / OUT_INDEX).exists(), "a failed run must not leave output that looks complete"


def file_of(src: Path, tensor: str) -> Path:
    return src / json.loads((src / INDEX).read_text())["weight_map"][tensor]


def rewrite(path: Path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def drop_from_index(src: Path, tensor: str):
    index = json.loads((src / INDEX).read_text())
    del index["weight_map"][tensor]
    (src / INDEX).write_text(json.dumps(index))


def first(src: Path, suffix: str) -> str:
    return next(n for n in json.loads((src / INDEX).read_text())["weight_map"] if n.endswith(suffix))


def test_missing_file_from_index(copy_source, tmp_path):
    src = copy_source()
    victim = file_of(src, first(src, "q_b_proj.weight"))
    victim.unlink()
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", victim.name, "missing")


def test_weight_without_scale(copy_source, tmp_path):
    src = copy_source()
    scale = first(src, "q_b_proj.weight_scale_inv")
    rewrite(file_of(src, scale), lambda t: t.pop(scale))
    drop_from_index(src, scale)
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out",
                         scale.removesuffix("_scale_inv"), "without a scale")


def test_unknown_dtype(copy_source, tmp_path):
    src = copy_source()
    name = first(src, "input_layernorm.weight")
    rewrite(file_of(src, name), lambda t: t.__setitem__(name, t[name].to(torch.float64)))
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", name, "float64")


def edit_header_entry(path, name, edit):
    """Rewrite one tensor's entry in a safetensors header in place (the data stays as it is)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header[name])
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_unknown_dtype_in_header(copy_source, tmp_path):
    src = copy_source()
    name = first(src, "input_layernorm.weight")
    edit_header_entry(file_of(src, name), name, lambda entry: entry.__setitem__("dtype", "Q3"))  # no such dtype
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", name, "Q3")


def test_unknown_architecture(copy_source, tmp_path):
    src = copy_source()
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(config))
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", "llama")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_in_a_quantized_weight(copy_source, tmp_path, value):
    src = copy_source(encoding="bf16")
    name = first(src, "experts.3.down_proj.weight")

    def poison(t):
        t[name][1, 2] = value

    rewrite(file_of(src, name), poison)
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", name, "NaN or Inf")


def test_nan_in_an_fp8_weight_kept_float(copy_source, tmp_path):
    src = copy_source()
    name = first(src, "kv_b_proj.weight")

    def poison(t):
        t[name].view(torch.uint8)[0, 0] = 0x7F  # the e4m3fn NaN code

    rewrite(file_of(src, name), poison)
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", name, "NaN or Inf")


def test_truncated_file(copy_source, tmp_path):
    src = copy_source()
    path = file_of(src, first(src, "q_b_proj.weight"))
    os.truncate(path, path.stat().st_size - 100)
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", path.name, "truncated")


def test_corrupt_header(copy_source, tmp_path):
    src = copy_source()
    path = file_of(src, first(src, "q_b_proj.weight"))
    raw = bytearray(path.read_bytes())
    raw[8:40] = b"\x00\xff" * 16
    path.write_bytes(bytes(raw))
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", path.name, "corrupt")


def test_pickle_checkpoint_is_refused(tmp_path, tiny_source):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text((tiny_source("deepseek_v3") / "config.json").read_text())
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", "pytorch_model.bin", "pickle")


def test_out_not_empty(tiny_source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert_clean_failure(run_cli(tiny_source("deepseek_v3"), out), out, "not empty")
    assert (out / "notes.txt").read_text() == "mine"


def test_out_holds_a_different_job(tiny_source, tmp_path):
    out = tmp_path / "out"
    src = tiny_source("deepseek_v3")
    assert run_cli(src, out, "--max-file-size", "2MB").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run_cli(src, out, "--max-file-size", "2MB", "--recipe", "all-linears")
    assert result.exit_code == 2 and "different dsconv run" in result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "a refused run must not touch OUT"


def test_bad_flags(tiny_source, tmp_path):
    src = tiny_source("deepseek_v3")
    assert_clean_failure(run_cli(src, tmp_path / "o1", "--recipe", "v4"), tmp_path / "o1", "deepseek_v4")
    assert_clean_failure(run_cli(src, tmp_path / "o2", "--recipe", "w4a8"), tmp_path / "o2", "unknown recipe")
    assert_clean_failure(run_cli(src, tmp_path / "o3", "--format", "gguf"), tmp_path / "o3", "unknown format")
    assert_clean_failure(run_cli(src, tmp_path / "o4", "--max-file-size", "lots"), tmp_path / "o4", "lots")


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_source, tmp_path):
    src = tiny_source("deepseek_v4")
    result = CliRunner().invoke(app, ["quantize", str(src), str(tmp_path / "out"), "--dry-run"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "layers.0.attn.wq_a.weight" in result.output and "int8" in result.output
    assert "float8_e4m3fn + float8_e8m0fnu scale (fp8)" in result.output
    assert "int8 + float8_e8m0fnu scale (fp4)" in result.output
    assert not (tmp_path / "out").exists()


def test_rerun_of_a_finished_job_is_a_no_op(tiny_source, tmp_path):
    out = tmp_path / "out"
    src = tiny_source("deepseek_v32")
    assert run_cli(src, out, "--max-file-size", "2MB").exit_code == 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("*.safetensors")}
    again = run_cli(src, out, "--max-file-size", "2MB")
    assert again.exit_code == 0 and "kept from an earlier run" in again.output
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("*.safetensors")} == before


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


QUANTIZE_ARGS = ("--max-file-size", "4MB", "--workers", "1")

# `dsconv quantize` that pauses in the middle of its second weight file: the first file is finished and the
# second has its first chunk written when it touches READY and sleeps until it is signalled. The test signals a
# run that is certainly half done, however fast or loaded the machine.
PAUSING_QUANTIZE = """
import sys, time
from pathlib import Path
import dsconv.convert.quantize as quantize
from dsconv.cli import app

ready, finished = Path(sys.argv[1]), []
write_part = quantize.write_part

def write_part_pausing_in_the_second(part, path, block, workers, on_progress):
    def progress(n_bytes):
        on_progress(n_bytes)
        if finished:
            ready.touch()
            while True:
                time.sleep(1)
    write_part(part, path, block, workers, progress)
    finished.append(path)

quantize.write_part = write_part_pausing_in_the_second
app(["quantize", *sys.argv[2:]], prog_name="dsconv")
"""
EVENT_BOUND_S = 300  # polls for the pause end as soon as it comes; the bound only ends a broken run


def cli_process(src, out, *extra, pause_at: Path | None = None):
    args = [str(src), str(out), *QUANTIZE_ARGS, *extra]
    entry = ["-m", "dsconv.cli", "quantize"] if pause_at is None else ["-c", PAUSING_QUANTIZE, str(pause_at)]
    return subprocess.Popen([sys.executable, *entry, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=answer_ctrl_c)


def wait_for_pause(proc: subprocess.Popen, ready: Path) -> None:
    deadline = time.monotonic() + EVENT_BOUND_S
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not ready.exists():
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"the run never reached its second file (exit code {proc.returncode}): {stderr[-1500:]}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_run_resumes_byte_identical(tiny_source, tmp_path, sig):
    src = tiny_source("deepseek_v3", "bf16", config_overrides={"moe_intermediate_size": 1024})
    reference = tmp_path / "reference"
    assert run_cli(src, reference, *QUANTIZE_ARGS).exit_code == 0

    out = tmp_path / "out"
    proc = cli_process(src, out, pause_at=tmp_path / "paused")
    wait_for_pause(proc, tmp_path / "paused")
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=EVENT_BOUND_S)
    seen = f"exit code {proc.returncode}, stderr ends: {stderr[-1500:]!r}"  # for a failure's message
    assert proc.returncode != 0, seen
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "run the same command again to resume" in stderr, seen
        assert "Traceback" not in stderr, seen
        assert not list(out.glob("*.partial")), "Ctrl-C removes the file it was writing"
    else:
        assert list(out.glob("*.partial")), "a killed run leaves its half-written file for the resume to drop"
    assert not (out / OUT_INDEX).exists(), seen
    written = list(out.glob("quant_model_weights-*.safetensors"))
    assert written, "at least one part was finished before the interruption"

    resumed = cli_process(src, out)
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert "kept from an earlier run" in stdout
    assert snapshot(out) == snapshot(reference)


def test_corrupt_json_files_are_one_line(copy_source, tmp_path):
    src = copy_source()
    (src / "config.json").write_text("[]")
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", "not a JSON object")


def test_header_with_wrong_types(copy_source, tmp_path):
    src = copy_source()
    name = first(src, "input_layernorm.weight")
    edit_header_entry(file_of(src, name), name,
                      lambda entry: entry.__setitem__("data_offsets", [str(v) for v in entry["data_offsets"]]))
    assert_clean_failure(run_cli(src, tmp_path / "out"), tmp_path / "out", "corrupt header entry")
