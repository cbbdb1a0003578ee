"""Running PyPTO kernels on the host: the pass-verify interpreter, made to compute on host tensors.

PyPTO 0.2.0 (`pypto.frontend.jit`) compiles a kernel and, with `verify_options={"enable_pass_verify": True}`, runs a
torch-based interpreter (its "calculator") over the kernel's tensor graph and over the graph after each compiler pass,
comparing them. Without an NPU, as shipped, the interpreter sees zeros: the jit wrapper copies the inputs through a
device-to-host copy that the runtime stub leaves empty, and it builds the calculator in a temporary directory on every
process's first kernel. This module, the one place that touches those private pieces:
- hands the interpreter the host tensors themselves (`pypto_impl.SetVerifyData` with the runtime's own tensor-data
  conversion), so the outputs land in the torch tensors passed to the kernel;
- builds the calculator once (PyPTO's own CMake build, about 15-35 s, in a child process) into the dsconv cache, per
  torch version, and loads it from there;
- skips the three trace renderers PyPTO's cost model starts through `python3` after every call (its swim-lane
  PNG, HTML and Perfetto files: about 0.25 s a call, half of a small kernel's), through a `python3` first on PATH
  during the call that exits at once for those scripts and runs the real one for anything else (`_trace_shim`);
- writes PyPTO's per-call output (about 1 MB: the cost model's trace, the verify tables) under a directory of its
  own (TILE_FWK_OUTPUT_DIR) and reads the verify table back: a pass whose result is not PASS raises, it is never a
  log line. (The call's SIM run, PyPTO's cost model, is what copies the interpreter's outputs into the tensors: it
  stays.)
It checks at import that the pieces it relies on are there, and names the missing ones in one line (InputError).
One hook for tools, off by default: `on_call`, when set, is called after each `run` call with the kernel's name, the
tensors it was handed and the call's PyPTO directory, before that is removed (scripts/pypto_cost.py reads the cost
model's reports there, `CostModelSimulationOutput/` below `output_*`, and the operands' sizes).
The interpreter gives the tensor graph's meaning in torch arithmetic, not the AICore code a CANN build generates.
"""

import atexit
import csv
from collections import Counter
import ctypes
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from dsconv.errors import InputError

PYPTO_VERSION = "0.2.0"  # the private pieces below are 0.2.0's; the [pypto] extra pins it
# (module, attribute path) this module relies on
PRIVATE = (("pypto.frontend.parser.entry", "JitCallableWrapper._setup_verify_data"),
           ("pypto.runtime", "_pto_to_tensor_data"), ("pypto.runtime", "_pto_verify_datas.get_data"),
           ("pypto._utils", "BuildOnlineManager._CMakeContext.CompileContext"),
           ("pypto._utils", "BuildOnlineManager._TorchContext"), ("pypto", "pypto_impl.SetVerifyData"),
           ("pypto", "get_verify_options"))
CALCULATOR = "lib/libtile_fwk_calculator.so"  # where PyPTO's CMake install puts it
VERIFY_TABLE = "verify_result_brief.csv"
# What every kernel is jitted with: the interpreter on, and the comparison after InferDynShape, the last of PyPTO's
# default verified passes that does not write every leaf function's inputs (whole weights included) once per tile
# (InferParamIndex and CodegenPreproc do: with them a V3.2 expert's call took 60 s). Its graph is the nearest to the
# code a CANN build generates. Measured: the earlier passes' replays (ExpandFunction, SplitK, L1CopyInReuseMerge)
# fail inside PyPTO 0.2.0's interpreter at the real attention and expert sizes (FB200B, GetValidDataView), and a
# pass whose replay fails writes no row, so a missing row is an error too (check_results).
VERIFY_OPTIONS = {"enable_pass_verify": True,
                  "pass_verify_pass_filter": ["InferDynShape"]}
TRACE_RENDERERS = "*/pypto/lib/scripts/*swim_lane.py"  # a shell pattern: the scripts the cost model runs per call
PASS = "PASS"


def _resolve(module: str, path: str):
    value = importlib.import_module(module)
    for name in path.split("."):
        value = getattr(value, name)
    return value


def check() -> None:
    """PyPTO installed, at the pinned version, with every private piece this module uses (one InputError naming the
    missing)."""
    try:
        version = metadata.version("pypto")
    except metadata.PackageNotFoundError:
        raise InputError(f"PyPTO is not installed: pip install -e \".[pypto]\" (pypto=={PYPTO_VERSION})") from None
    if version != PYPTO_VERSION:
        raise InputError(f"pypto {version} is installed; the host shim (kernels/pypto/host.py) is written against "
                         f"{PYPTO_VERSION}'s internals: pip install pypto=={PYPTO_VERSION}")
    missing = []
    for module, path in PRIVATE:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    if not missing:  # the build manager's own state (a singleton's instance attributes)
        manager = _resolve("pypto._utils", "BuildOnlineManager")()
        missing += [f"pypto._utils.BuildOnlineManager().{name}" for name in ("pkg_lib_dir", "calculator_loaded")
                    if not hasattr(manager, name)]
    if missing:
        raise InputError(f"pypto {version} lacks what kernels/pypto/host.py relies on: {', '.join(missing)}")


def _cache_root() -> Path:
    # the dsconv cache, by convert/demo.cache_dir's rule (the kernels sit below convert and cannot import it)
    root = os.environ.get("DSCONV_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsconv"
    return Path(root)


def calculator_path() -> Path:
    """The interpreter's library, built once per torch version into the dsconv cache (whole or not at all). The build
    runs in a child process: building in this one leaves PyPTO writing every later call's files to ./output,
    whatever TILE_FWK_OUTPUT_DIR says (measured)."""
    import torch

    final = _cache_root() / f"pypto-{PYPTO_VERSION}-calculator-torch{torch.__version__}" / "libtile_fwk_calculator.so"
    if not final.is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-c", f"from {__name__} import build_calculator; "
                               f"build_calculator({str(final)!r})"], capture_output=True, text=True)
        if done.returncode or not final.is_file():
            raise RuntimeError(f"building PyPTO's calculator failed ({done.returncode}): {done.stderr[-2000:]}")
    return final


def build_calculator(final: str) -> None:
    """PyPTO's own CMake build of its calculator against the installed torch (what BuildOnlineManager runs in a
    temporary directory), its library copied to `final` (calculator_path's child process)."""
    from pypto._utils import BuildOnlineManager

    final = Path(final)
    manager = BuildOnlineManager()
    with tempfile.TemporaryDirectory(dir=final.parent) as scratch:
        compile_context = BuildOnlineManager._CMakeContext.CompileContext(
            src_dir=Path(manager.pkg_lib_dir, "calculator"), tmp_dir=Path(scratch))
        torch_context = BuildOnlineManager._TorchContext()  # the installed torch, as PyPTO's own build passes it
        compile_context.cfg_cmd_ext = (f"-DPY3_MOD_TORCH_VERSION={torch_context.torch_version}"
                                       f" -DPY3_MOD_TORCH_ROOT_PATH={torch_context.torch_root_dir}"
                                       f" -DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI="
                                       f"{torch_context.torch_c_use_cxx11_abi}")
        built = Path(BuildOnlineManager._CMakeContext().compile(ctx=compile_context), CALCULATOR)
        staged = Path(scratch, final.name)
        shutil.copyfile(built, staged)
        os.replace(staged, final)


_installed = False
_shim_dir: str | None = None


def _trace_shim() -> str:
    """A directory holding a `python3` that exits 0 for PyPTO's trace renderers (TRACE_RENDERERS) and runs the
    python3 the PATH had for anything else; made once per process, removed at exit."""
    global _shim_dir
    if _shim_dir is None:
        real = shutil.which("python3")
        fallback = f'exec "{real}" "$@"' if real else 'echo "python3: not found" >&2; exit 127'
        _shim_dir = tempfile.mkdtemp(prefix="dsconv-pypto-shim-")
        shim = Path(_shim_dir, "python3")
        shim.write_text(f'#!/bin/sh\n# dsconv kernels/pypto/host.py: PyPTO\'s trace renderers skipped\n'
                        f'case "$1" in {TRACE_RENDERERS}) exit 0;; esac\n{fallback}\n')
        shim.chmod(0o755)
        atexit.register(shutil.rmtree, _shim_dir, True)
    return _shim_dir


def install() -> None:
    """Checks PyPTO, loads the calculator and hands the interpreter host data (idempotent)."""
    global _installed
    if _installed:
        return
    check()
    import pypto
    from pypto import pypto_impl
    from pypto._utils import BuildOnlineManager
    from pypto.frontend.parser.entry import JitCallableWrapper
    from pypto.runtime import _pto_to_tensor_data, _pto_verify_datas

    ctypes.CDLL(str(calculator_path()), mode=ctypes.RTLD_GLOBAL)
    BuildOnlineManager().calculator_loaded = True  # the jit wrapper then builds nothing

    def host_verify_data(pto_tensors) -> None:  # the wrapper's _setup_verify_data, with the host tensors as they are
        if pypto.get_verify_options().get("enable_pass_verify"):
            pypto_impl.SetVerifyData(_pto_to_tensor_data(pto_tensors), [], _pto_verify_datas.get_data())

    JitCallableWrapper._setup_verify_data = staticmethod(host_verify_data)
    _installed = True


def run(kernel, *tensors) -> None:
    """kernel(*tensors) through the interpreter (the kernel jitted with VERIFY_OPTIONS): its outputs written into
    the output tensors passed; raises when a verified pass's result is not PASS, at once, or inside
    `deferred_checks` when the block ends. PyPTO's files go to a scratch directory per call, removed once read
    (`on_call`, when set, sees it first).

    PyPTO writes a call's verify table through a buffered stream that it closes only when the next call's
    verification starts (measured: the table stops at 4,096 bytes, mid-row, until then). So a call's table is read
    after the next call, or after a one-element kernel that `flush` runs for that: after every call, or once at the
    end of a `deferred_checks` block (a decode step's dozen calls then pay for one).

    PyPTO's runtime writes through every tensor it is handed, inputs too (measured: a weight memory-mapped read-only
    from its shard crashed it in a memcpy). So the kernel gets copies, and each tensor whose copy changed (an
    output) takes the copy's values."""
    import torch

    install()
    name = getattr(kernel, "__name__", str(kernel))
    _check_operands(name, kernel, tensors)
    CALLS[name] += 1
    copies = [t.clone() for t in tensors]
    scratch = _call(kernel, copies)
    if on_call is not None:
        on_call(name, list(tensors), scratch)
    for original, result in zip(tensors, copies):
        if not torch.equal(original, result):
            original.copy_(result)
    earlier = list(_pending)  # this call's verification has closed their tables
    _pending[:] = [(name, scratch)]
    _check(earlier)
    if not _deferring:
        flush()


def _check_operands(name: str, kernel, tensors) -> None:
    """Every tensor as the kernel's parameter declares it (shape and dtype): PyPTO reads and writes through raw
    pointers at the declared sizes, so a mismatch corrupts memory instead of failing (measured: a BF16 router handed
    to a float32 parameter). The declarations are the jitted function's annotations (JitCallableWrapper keeps it as
    _original_func)."""
    import pypto
    import torch

    dtypes = {pypto.DT_FP32: torch.float32, pypto.DT_BF16: torch.bfloat16, pypto.DT_FP16: torch.float16,
              pypto.DT_INT8: torch.int8, pypto.DT_INT32: torch.int32, pypto.DT_INT64: torch.int64}
    function = getattr(kernel, "_original_func", None)
    if function is None:
        raise InputError(f"{name}: pypto's jit wrapper has no _original_func (kernels/pypto/host.py reads the "
                         f"kernel's declared operands from it)")
    declared = [spec for param, spec in function.__annotations__.items() if param != "return"]
    if len(declared) != len(tensors):
        raise ValueError(f"{name}: {len(tensors)} tensors for {len(declared)} parameters")
    for index, (spec, tensor) in enumerate(zip(declared, tensors)):
        if list(spec.shape) != list(tensor.shape) or dtypes.get(spec.dtype) != tensor.dtype:
            raise ValueError(f"{name}: operand {index} is {tensor.dtype} {tuple(tensor.shape)}, the kernel declares "
                             f"{spec.dtype} {tuple(spec.shape)}")


CALLS: Counter = Counter()  # this process's kernel calls, by kernel name (what `dsrun generate --json` reports)
# None, or called as on_call(kernel name, tensors, PyPTO's directory for the call) after each run() call, before that
# directory is removed (the module docstring's hook)
on_call: Callable[[str, list, str], None] | None = None
_pending: list[tuple[str, str]] = []  # (kernel name, scratch directory) of calls whose tables are not read yet
_deferring = 0  # the depth of `deferred_checks` blocks


@contextmanager
def deferred_checks():
    """Inside the block, each call's verify table is read after the next call; the last ones when it ends."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring:
            flush()


def flush() -> None:
    """Reads and checks the pending calls' verify tables, after a one-element kernel has closed them."""
    if not _pending:
        return
    shutil.rmtree(_call(_closer(), [_one_row(), _one_row()]), ignore_errors=True)
    pending = list(_pending)
    _pending.clear()
    _check(pending)


def _call(kernel, tensors: list) -> str:
    """kernel(*tensors) with PyPTO's files in a new scratch directory (returned) and its trace renderers skipped."""
    scratch = tempfile.mkdtemp(prefix="dsconv-pypto-")
    previous = {name: os.environ.get(name) for name in ("TILE_FWK_OUTPUT_DIR", "PATH")}
    os.environ["TILE_FWK_OUTPUT_DIR"] = scratch
    os.environ["PATH"] = os.pathsep.join(p for p in (_trace_shim(), previous["PATH"]) if p)
    try:
        kernel(*tensors)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return scratch


def _check(calls: list[tuple[str, str]]) -> None:
    """Each call's verify table checked (check_results), its scratch directory removed."""
    try:
        for name, scratch in calls:
            tables = Path(scratch).rglob(VERIFY_TABLE)
            check_results(name, [row for table in tables for row in csv.DictReader(table.read_text().splitlines())])
    finally:
        for _, scratch in calls:
            shutil.rmtree(scratch, ignore_errors=True)


def check_results(name: str, results: list[dict]) -> None:
    """A call's verify table (rows of verify_result_brief.csv): an error unless it has rows and every one PASSed."""
    if not results:
        raise RuntimeError(f"{name}: PyPTO wrote no verify results (was the kernel jitted with "
                           f"verify_options={{'enable_pass_verify': True}}?)")
    failed = [f"{row.get('passName')} ({row.get('verifyResult')}, max abs diff {row.get('maxAbsDiff')})"
              for row in results if row.get("verifyResult") != PASS]
    # a pass whose replay itself fails writes no row (measured: PyPTO 0.2.0 logs "VerifyPass failed" and goes on)
    seen = {str(row.get("passName")).split("_", 2)[-1] for row in results}
    failed += [f"{name} (no result: its replay failed)" for name in VERIFY_OPTIONS["pass_verify_pass_filter"]
               if name not in seen]
    if failed:
        raise RuntimeError(f"{name}: PyPTO's pass verification failed: {'; '.join(failed)}")


_closer_kernel = None


def _closer():
    """A one-element copy, verified: its call closes the previous call's verify table (run's docstring)."""
    global _closer_kernel
    if _closer_kernel is None:
        import pypto

        @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
        def close_previous_table(x: pypto.Tensor((1, 8), pypto.DT_FP32), out: pypto.Tensor((1, 8), pypto.DT_FP32)):
            pypto.set_vec_tile_shapes(1, 8)
            out[:] = pypto.add(x, 0.0)

        _closer_kernel = close_previous_table
    return _closer_kernel


def _one_row():
    import torch

    return torch.zeros(1, 8)
