"""runner.moe's EP step at EP 1: the one-token path a single sequence's decode takes equals the general path."""

import pytest
import torch

from dsconv.kernels.linear import w8a8_linear, w8a8_linear_quantized
from dsconv.runner.dist import Dist
from dsconv.runner.moe import expert_parallel

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 6, 3


class FloatProj:
    def __init__(self, n_in, n_out, gen):
        self.w = torch.randn(n_in, n_out, generator=gen).to(torch.bfloat16) / n_in**0.5

    def __call__(self, rows):
        return rows @ self.w


class Int8Proj:
    def __init__(self, n_in, n_out, gen):
        self.w = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8, generator=gen)
        self.scale = torch.rand(n_out, 1, generator=gen) / 127 / n_in**0.5

    def __call__(self, rows):
        return w8a8_linear(rows, self.w, self.scale, rows.dtype)

    def quantized(self, x_q, x_scale, dtype):
        return w8a8_linear_quantized(x_q, x_scale, self.w, self.scale, dtype)


def gated(gate_up):  # any [T, 2I] -> [T, I] map that mixes both halves
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.tanh(gate) * up


class Expert:
    """The stages runner.moe uses (as runner.model_v3.GatedMLP has them), with random small projections."""

    def __init__(self, proj, gen):
        self.gate_up, self.down, self.activation = proj(HIDDEN, 2 * INTER, gen), proj(INTER, HIDDEN, gen), gated
        self.int8 = proj is Int8Proj

    def __call__(self, rows):
        return self.down(self.activation(self.gate_up(rows)))

    def quantized(self, x_q, x_scale, dtype):
        return self.down(self.activation(self.gate_up.quantized(x_q, x_scale, dtype)))


@pytest.mark.parametrize("proj", [FloatProj, Int8Proj])
def test_one_token_path_equals_the_general_path(proj):
    gen = torch.Generator().manual_seed(0)
    experts = [Expert(proj, gen) for _ in range(EXPERTS)]
    x = torch.randn(3, HIDDEN, generator=gen).to(torch.bfloat16)
    chosen = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(3)])  # [3, k]
    weights = torch.rand(3, TOP_K, generator=gen)
    batch = expert_parallel(x, chosen, weights, experts, EXPERTS, Dist.single())  # grouped by expert
    for t in range(3):  # each token alone takes the one-token path
        alone = expert_parallel(x[t:t + 1], chosen[t:t + 1], weights[t:t + 1], experts, EXPERTS, Dist.single())
        assert torch.equal(alone, batch[t:t + 1])
    if proj is FloatProj:  # and both are the routing-weighted sum of the chosen experts
        expected = sum(weights[0, j] * experts[e](x[:1]).float() for j, e in enumerate(chosen[0].tolist()))
        torch.testing.assert_close(batch[:1].float(), expected, atol=1e-2, rtol=1e-2)
