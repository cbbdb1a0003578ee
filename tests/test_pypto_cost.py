"""scripts/pypto_cost.py's pieces: the host shim's `on_call` hook hands a call's PyPTO directory, where the cost
model's reports are read (cycles, the AICore span, the target), the expert rows' spread, and the roofline's
arithmetic. The real shapes themselves take minutes (their figures: docs/benchmarks.md)."""

import pytest
import torch

from dsconv.kernels.pypto import host
from dsconv.kernels.pypto.rms_norm import add_rms_norm
from dsconv.scripts.pypto_cost import CLOCK_MHZ, Case, aicore_span, cost_of, expert_counts, figures

OPERANDS = 5  # add_rms_norm's: x, residual, weight, out, residual_out


def test_a_call_hands_its_cost_model_reports_to_the_hook(monkeypatch):
    calls = []

    def record(name, tensors, directory):
        calls.append((name, sum(t.numel() * t.element_size() for t in tensors), cost_of(directory)))

    assert host.on_call is None  # off by default
    monkeypatch.setattr(host, "on_call", record)
    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    add_rms_norm(x, residual, weight, 1e-6)
    [(name, moved, cost)] = calls
    assert name == "add_rms_norm" and moved == (OPERANDS - 1) * x.nbytes + weight.nbytes
    assert 0 < cost["aicore_cycles"] <= cost["total_cycles"] and cost["graphs"] == 1
    assert cost["device_arch"] == "A2A3" and cost["cube_cores"] > 0 and cost["vector_cores"] > 0


@pytest.mark.parametrize("tokens,topk,experts,expected", [(8, 8, 16, [4] * 16), (8, 6, 16, [3] * 16),
                                                          (3, 2, 4, [2, 2, 1, 1])])
def test_expert_rows_spread_round_robin(tokens, topk, experts, expected):
    assert expert_counts(tokens, topk, experts) == expected


def test_the_aicore_span_is_the_aicore_tasks_first_start_to_last_end():
    cores = [{"coreType": "AIC", "tasks": [{"execStart": 100, "execEnd": 400}]},
             {"coreType": "AIV", "tasks": [{"execStart": 50, "execEnd": 300}, {"execStart": 350, "execEnd": 900}]},
             {"coreType": "HUB", "tasks": [{"execStart": 0, "execEnd": 5000}]},
             {"coreType": "AIV", "tasks": []}]
    assert aicore_span(cores) == 850
    assert aicore_span([{"coreType": "AIC", "tasks": []}]) == 0


def test_the_roofline_figures():
    call = {"total_cycles": 2 * CLOCK_MHZ, "aicore_cycles": CLOCK_MHZ, "bytes": 10**6, "device_arch": "A2A3",
            "cube_cores": 24, "vector_cores": 48}
    got = figures([call, call], bandwidth=10**12)  # two calls: summed
    assert got["model_us"] == pytest.approx(4.0) and got["aicore_us"] == pytest.approx(2.0)
    assert got["floor_us"] == pytest.approx(2.0) and got["ratio"] == pytest.approx(2.0)


def test_a_kernel_moves_the_cache_rows_it_gathers_and_no_placeholder():
    case = Case("k", "m", "kernel", "shape", 1, "", unread=(2,), rows_read={1: 3})
    cache, placeholder, out = torch.zeros(100, 8, dtype=torch.bfloat16), torch.zeros(100, 1), torch.zeros(4, 8)
    assert [case.operand_bytes(i, t) for i, t in enumerate([out, cache, placeholder])] == [4 * 8 * 4, 3 * 8 * 2, 0]
