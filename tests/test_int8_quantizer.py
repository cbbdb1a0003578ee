"""The INT8 quantizer against an independent NumPy evaluation of the same formula, bit for bit."""

import numpy as np
import pytest
import torch

from dsconv.kernels.int8 import AMAX_FLOOR, INT8_MAX, quantize_rows_, quantize_rows_reference


def numpy_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = w.astype(np.float32)
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.maximum(amax, np.float32(AMAX_FLOOR)) / np.float32(INT8_MAX)
    q = np.clip(np.round(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale.astype(np.float32)


def edge_rows(cols: int) -> np.ndarray:
    fmax = np.finfo(np.float32).max
    rng = np.random.default_rng(7)
    rows = [
        np.zeros(cols),  # all zero: scale floor, q == 0
        np.full(cols, fmax),  # +max everywhere
        np.full(cols, -fmax),  # -max everywhere
        np.where(np.arange(cols) % 2, fmax, -fmax),  # alternating +-max
        np.concatenate([[1.0], np.zeros(cols - 1)]),  # a single non-zero
        # exact ties after scaling: amax 127 gives scale 1, so k + 0.5 must round half to even
        np.concatenate([[127.0], np.arange(cols - 1) % 254 - 126.5]),
        rng.standard_normal(cols) * 1e-30,  # tiny but above the floor
        rng.standard_normal(cols) * 1e-12,  # below the floor: quantizes against AMAX_FLOOR
    ]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("cols", [1, 7, 256, 1000])
def test_bit_exact_against_numpy(cols):
    rng = np.random.default_rng(cols)
    w = np.concatenate([rng.standard_normal((64, cols)).astype(np.float32) * rng.uniform(1e-3, 1e3, (64, 1)),
                        edge_rows(cols)]).astype(np.float32)
    q_ref, s_ref = numpy_quantize(w)

    q, s = quantize_rows_reference(torch.from_numpy(w))
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_array_equal(s.numpy(), s_ref)

    q_fast = torch.empty(w.shape, dtype=torch.int8)
    s_fast = torch.empty(w.shape[0], 1)
    x = torch.from_numpy(w.copy())
    amax = quantize_rows_(x, q_fast, s_fast)
    np.testing.assert_array_equal(q_fast.numpy(), q_ref)
    np.testing.assert_array_equal(s_fast.numpy(), s_ref)
    np.testing.assert_array_equal(amax.numpy(), np.abs(w).max(axis=1, keepdims=True))


def test_edge_rows_land_where_expected():
    q, s = numpy_quantize(edge_rows(8))
    assert (q[0] == 0).all() and s[0, 0] == np.float32(AMAX_FLOOR) / np.float32(INT8_MAX)
    assert (q[1] == 127).all() and (q[2] == -127).all()
    assert q.min() >= -127  # symmetric: -128 never appears
    # ties: 126.5 -> 126 (even), -126.5 -> -126, 125.5 -> 126
    assert q[5, 0] == 127


def test_nan_and_inf_show_in_amax():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 0.0], [1.0, 2.0]])
    amax = quantize_rows_(x.clone(), torch.empty(3, 2, dtype=torch.int8), torch.empty(3, 1))
    assert torch.isfinite(amax).tolist() == [[False], [False], [True]]
