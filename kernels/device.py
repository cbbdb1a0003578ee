"""Device dispatch: a tensor on an Ascend NPU takes the torch_npu path, any other tensor the plain torch path.

The choice follows the tensor, never the environment, so a CPU test run cannot reach NPU code and an NPU run
cannot quietly fall back to the slow path. The NPU branches are not run in CI (there is no NPU there).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

NPU_DEVICE_TYPE = "npu"


def is_npu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == NPU_DEVICE_TYPE


def require_torch_npu() -> ModuleType:
    """The torch_npu module, or a RuntimeError saying why the NPU path cannot run."""
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
