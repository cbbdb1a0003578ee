"""Kernels written in PyPTO (CANN's tile framework, PyPI `pypto` 0.2.0, the `[pypto]` extra), one module per kernel,
each beside the torch path it must equal. `host.py` runs them on a machine without an NPU, through PyPTO's pass-verify
interpreter; nothing here is imported unless asked for."""
