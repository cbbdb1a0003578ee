"""runner.moe's EP step at EP 1: the one-token path a single sequence's decode takes equals the general path."""

import pytest
import torch

from kernels.linear import w8a8_linear_quantized
from runner.dist import Dist
from runner.moe import expert_parallel

HIDDEN, EXPERTS, TOP_K = 32, 6, 3


class FloatExpert:
    int8 = False

    def __init__(self, gen):
        self.w = torch.randn(HIDDEN, HIDDEN, generator=gen).to(torch.bfloat16) / HIDDEN**0.5

    def __call__(self, rows):
        return torch.tanh(rows @ self.w)


class Int8Expert:
    int8 = True

    def __init__(self, gen):
        self.w = torch.randint(-127, 128, (HIDDEN, HIDDEN), dtype=torch.int8, generator=gen)
        self.scale = torch.rand(HIDDEN, 1, generator=gen) / 127

    def quantized(self, x_q, x_scale, dtype):
        return w8a8_linear_quantized(x_q, x_scale, self.w, self.scale, dtype)


@pytest.mark.parametrize("kind", [FloatExpert, Int8Expert])
def test_one_token_path_equals_the_general_path(kind):
    gen = torch.Generator().manual_seed(0)
    experts = [kind(gen) for _ in range(EXPERTS)]
    x = torch.randn(3, HIDDEN, generator=gen).to(torch.bfloat16)
    chosen = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(3)])  # [3, k]
    weights = torch.rand(3, TOP_K, generator=gen)
    batch = expert_parallel(x, chosen, weights, experts, EXPERTS, Dist.single())  # grouped by expert
    for t in range(3):  # each token alone takes the one-token path
        alone = expert_parallel(x[t:t + 1], chosen[t:t + 1], weights[t:t + 1], experts, EXPERTS, Dist.single())
        assert torch.equal(alone, batch[t:t + 1])
    if kind is FloatExpert:  # and both are the routing-weighted sum of the chosen experts
        expected = sum(weights[0, j] * experts[e](x[:1]).float() for j, e in enumerate(chosen[0].tolist()))
        torch.testing.assert_close(batch[:1].float(), expected, atol=1e-2, rtol=1e-2)
