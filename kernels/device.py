"""Device dispatch: a tensor on an Ascend NPU takes the torch_npu path, any other tensor the plain torch path.

The choice follows the tensor, never the environment, so a CPU test run cannot reach NPU code and an NPU run
cannot quietly fall back to the slow path. There is no NPU in CI: the NPU branches run there against a
contract double of torch_npu (tests/npu_double.py), which a test installs with `route_to_npu_path`, the one
hook that sends other tensors down the NPU branches.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import torch

NPU_DEVICE_TYPE = "npu"

_npu_types = frozenset({NPU_DEVICE_TYPE})  # device types whose tensors take the NPU branches
_torch_npu: ModuleType | None = None  # the module those branches call; None: import the real torch_npu


def is_npu(tensor: torch.Tensor) -> bool:
    return takes_npu_path(tensor.device)


def takes_npu_path(device: torch.device) -> bool:
    """Whether tensors on `device` take the NPU branches (an NPU, or the device a test routed there)."""
    return device.type in _npu_types


def route_to_npu_path(device_type: str, torch_npu: ModuleType) -> None:
    """For tests only: tensors on `device_type` (e.g. "cpu") take the NPU branches, which call `torch_npu`
    (a stand-in module) instead of the real one. Undo with `reset_npu_path`."""
    global _npu_types, _torch_npu
    _npu_types, _torch_npu = frozenset({NPU_DEVICE_TYPE, device_type}), torch_npu


def reset_npu_path() -> None:
    global _npu_types, _torch_npu
    _npu_types, _torch_npu = frozenset({NPU_DEVICE_TYPE}), None


def require_torch_npu() -> ModuleType:
    """The module the NPU branches call (torch_npu), or a RuntimeError saying why the NPU path cannot run."""
    if _torch_npu is not None:
        return _torch_npu
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise RuntimeError(
            "an NPU kernel was requested but torch_npu cannot be imported; install the torch_npu build that "
            f"matches torch {torch.__version__} (pip install 'dsconv[npu]')"
        ) from e


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, returning x itself when it already is: the check costs far less than a no-op `.to()` call
    through the dispatcher, and a decode step makes hundreds of them."""
    return x if x.dtype == dtype else x.to(dtype)


def flush_denormals(device: torch.device) -> None:
    """On CPU, treat denormal floats (magnitudes below 1.2e-38, which a softmax or an activation of tiny values
    leaves behind) as zero in this thread's arithmetic. x86 multiplies them through a microcode assist many
    times slower than a normal multiply (docs/benchmarks.md, "Kernel choices"). Results change by less than
    1.2e-38 per value. Accelerators flush or handle them in hardware.
    Raises if the CPU cannot flush (every x86-64 with SSE3 can)."""
    if device.type == "cpu" and not torch.set_flush_denormal(True):
        raise RuntimeError("this CPU cannot flush denormal floats to zero (torch.set_flush_denormal)")


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """This machine's CPU model name and instruction-set flags (Linux's /proc/cpuinfo; ("unknown", set()) where it
    cannot be read): the flags say which kernels the CPU path picks, so figures that depend on rounding name them."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return model, flags
