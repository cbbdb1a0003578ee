"""torch_npu's own operator schemas, read from the torch_npu wheel and registered on CPU torch for the contract
double (tests/npu_double.py), so every torch_npu call the runner makes binds against the real signature.

The wheel is downloaded (pip download, never installed: an installed torch_npu registers itself under torch's
`torch.backends` autoload entry point and breaks `import torch` on a machine without CANN) and only its schema
file is kept, in the dsconv cache ($DSCONV_CACHE or ~/.cache/dsconv). `npu_native_functions_by_codegen.yaml` lists
each op as torch_npu registers it in the `npu` namespace (`torch.ops.npu.<op>`, which `torch_npu.<op>` exposes):
`func: npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, ...) -> (Tensor, Tensor)`. Of its 1,488
entries, 1,453 define on CPU torch 2.13; the others are bare aten names or aten overloads that torch_npu only
re-dispatches.

The x86-64 / CPython 3.11 build is fetched whatever this machine runs: every build ships the same schema file.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from functools import cache
from pathlib import Path

import torch

from dsconv.convert.demo import cache_dir

TORCH_NPU_VERSION = "2.14.0"
SCHEMA_MEMBER = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
NAMESPACE = "npu"  # torch_npu's: its ops are torch.ops.npu.<name>
WHEEL_PLATFORM = ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64")
DOWNLOAD_TIMEOUT_S = 600


class SchemasUnavailable(RuntimeError):
    """The torch_npu wheel could not be fetched or read; the message is one line saying why."""


def schema_file() -> Path:
    """The cached schema file of torch_npu TORCH_NPU_VERSION, downloaded on first use; SchemasUnavailable if
    that fails."""
    return wheel_member(SCHEMA_MEMBER)


def wheel_member(member: str) -> Path:
    """One file of the torch_npu TORCH_NPU_VERSION wheel (its path in the wheel), kept in the dsconv cache:
    downloaded on first use; SchemasUnavailable if that fails."""
    final = cache_dir() / f"torch_npu-{TORCH_NPU_VERSION}" / member.replace("/", "__")
    legacy = final.parent / Path(member).name  # the schema file's name before other members were kept
    if member == SCHEMA_MEMBER and legacy.is_file():
        return legacy
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   *WHEEL_PLATFORM, "--dest", scratch, f"torch_npu=={TORCH_NPU_VERSION}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SchemasUnavailable(f"pip download torch_npu=={TORCH_NPU_VERSION} took over "
                                     f"{DOWNLOAD_TIMEOUT_S} s") from None
        wheels = list(Path(scratch).glob("torch_npu-*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise SchemasUnavailable(f"pip download torch_npu=={TORCH_NPU_VERSION} failed: {last}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise SchemasUnavailable(f"{wheels[0].name} has no {member}")
            partial = Path(scratch) / final.name
            with wheel.open(member) as source, open(partial, "wb") as target:
                shutil.copyfileobj(source, target)
        os.replace(partial, final)  # whole or absent: a parallel run reads one complete file
    return final


def read_schemas(path: Path) -> list[str]:
    """Every `func:` schema of the file, in its order."""
    import yaml  # a transformers dependency, so in the test extras

    sections = yaml.safe_load(path.read_text())
    return [entry["func"] for entries in sections.values() if isinstance(entries, list)
            for entry in entries if isinstance(entry, dict) and "func" in entry]


class Registered:
    """The schemas that CPU torch accepts, defined in the `npu` namespace of this process (once: a namespace is
    defined by one library). `op(name)` is the dispatcher's op, which binds every call against the schema."""

    def __init__(self, schemas: list[str]):
        self.library = torch.library.Library(NAMESPACE, "DEF")
        self.defined: dict[str, str] = {}  # "name" or "name.overload" -> schema
        self.refused: list[str] = []
        for schema in schemas:
            try:
                self.library.define(schema)
            except RuntimeError:
                self.refused.append(schema)
                continue
            self.defined[schema.split("(", 1)[0]] = schema

    def schema(self, name: str) -> str:
        if name not in self.defined:
            raise KeyError(f"torch_npu {TORCH_NPU_VERSION} registers no op {name!r}")
        return self.defined[name]

    def implement(self, name: str, kernel) -> None:
        """kernel as the CPU implementation of torch_npu's op `name` ("op" or "op.overload")."""
        self.schema(name)
        self.library.impl(name, kernel, "CPU")


@cache
def registered() -> Registered:
    """This process's registration of torch_npu's schemas (SchemasUnavailable when they cannot be fetched)."""
    return Registered(read_schemas(schema_file()))


@cache
def scalar_type_codes() -> dict[int, torch.dtype]:
    """What the dispatcher hands an `int` or `ScalarType` argument given a torch.dtype (c10's ScalarType number),
    mapped back to the dtype, read from the dispatcher itself."""
    library = torch.library.Library("npu_double_probe", "DEF")
    library.define("code(Tensor anchor, int value) -> int")  # a tensor argument picks the CPU kernel
    library.impl("code", lambda anchor, value: value, "CPU")
    dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
              torch.float64, torch.bool, torch.bfloat16]
    anchor = torch.empty(1)
    codes = {torch.ops.npu_double_probe.code(anchor, dtype): dtype for dtype in dtypes}
    scalar_type_codes.library = library  # kept alive with the cache
    return codes


# The stream and event calls of torch_npu.npu that kernels.streams makes, and the wheel's files that define them
# (torch_npu.npu re-exports both files' names).
STREAM_SOURCES = {"Stream": "torch_npu/npu/streams.py", "Stream.wait_event": "torch_npu/npu/streams.py",
                  "Event": "torch_npu/npu/streams.py", "Event.record": "torch_npu/npu/streams.py",
                  "current_stream": "torch_npu/npu/utils.py", "stream": "torch_npu/npu/utils.py"}


def stream_api() -> dict[str, inspect.Signature]:
    """The signatures STREAM_SOURCES names as torch_npu's wheel defines them, read from its source (never imported):
    a class as its __new__ without `cls`, a method without `self`."""
    import ast

    def signature(node: ast.FunctionDef, bound: bool) -> inspect.Signature:
        args = node.args
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        params = [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=inspect.Parameter.empty if d is None else ast.literal_eval(d))
                  for a, d in zip(positional, defaults)]
        if args.vararg:
            params.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
        for a, d in zip(args.kwonlyargs, args.kw_defaults):
            params.append(inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY,
                                            default=inspect.Parameter.empty if d is None else ast.literal_eval(d)))
        if args.kwarg:
            params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
        return inspect.Signature(params[1:] if bound else params)

    found = {}
    for member in sorted(set(STREAM_SOURCES.values())):
        tree = ast.parse(wheel_member(member).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                found[node.name] = signature(node, bound=False)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        name = node.name if item.name == "__new__" else f"{node.name}.{item.name}"
                        found.setdefault(name, signature(item, bound=True))
    missing = [name for name in STREAM_SOURCES if name not in found]
    if missing:
        raise SchemasUnavailable(f"torch_npu {TORCH_NPU_VERSION}'s wheel defines none of {missing}")
    return {name: found[name] for name in STREAM_SOURCES}
