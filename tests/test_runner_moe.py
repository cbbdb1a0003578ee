"""runner.moe's EP step at EP 1 over runner.layers' routed experts: the one-token path a single sequence's
decode takes equals the general path, and both are the routing-weighted sum of each chosen expert's MLP."""

import pytest
import torch
import torch.nn.functional as F

from dsconv.errors import InputError
from dsconv.kernels.int8 import quantize_rows_reference
from dsconv.kernels.linear import w8a8_linear
from dsconv.kernels.moe import swiglu
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.layers import RoutedExperts
from dsconv.runner.models.moe import expert_parallel
from dsconv.runner.models.weights import RankWeights

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 6, 3
NAMES = ("gate_proj", "up_proj", "down_proj")
SHAPES = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}


def checkpoint(int8: bool, gen) -> dict[str, torch.Tensor]:
    """A layer's experts as a shard holds them: BF16 weights, or INT8 with per-output-channel scales."""
    tensors = {}
    for e in range(EXPERTS):
        for name, shape in SHAPES.items():
            w = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
            if int8:
                tensors[f"experts.{e}.{name}.weight"], tensors[f"experts.{e}.{name}.weight_scale"] = \
                    quantize_rows_reference(w)
            else:
                tensors[f"experts.{e}.{name}.weight"] = w.to(torch.bfloat16)
    return tensors


def expert_mlp(tensors, e, x, limit):
    """One expert's MLP from its own tensors: the independent per-expert formula."""
    def proj(name, rows):
        weight, scale = tensors[f"experts.{e}.{name}.weight"], tensors.get(f"experts.{e}.{name}.weight_scale")
        return F.linear(rows, weight) if scale is None else w8a8_linear(rows, weight, scale, rows.dtype)
    return proj("down_proj", swiglu(proj("gate_proj", x), proj("up_proj", x), limit))


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "w8a8"])
@pytest.mark.parametrize("limit", [None, 0.5], ids=["swiglu", "v4-clamped"])
def test_one_token_path_equals_the_general_path(int8, limit):
    gen = torch.Generator().manual_seed(0)
    tensors = checkpoint(int8, gen)
    weights = RankWeights(0, {}, dict(tensors), {})
    experts = RoutedExperts(weights, "experts", NAMES, EXPERTS, Dist(), torch.bfloat16, limit)
    weights.finish()  # every tensor taken
    assert experts.int8 == int8 and experts.ids == range(EXPERTS)
    x = torch.randn(3, HIDDEN, generator=gen).to(torch.bfloat16)
    chosen = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(3)])  # [3, k]
    weights = torch.rand(3, TOP_K, generator=gen)
    no_shared = torch.zeros_like  # routed + 0: the routed sum alone
    batch = expert_parallel(x, chosen, weights, experts, Dist(), no_shared)  # grouped by expert
    for t in range(3):  # each token alone takes the one-token path
        alone = expert_parallel(x[t:t + 1], chosen[t:t + 1], weights[t:t + 1], experts, Dist(), no_shared)
        assert torch.equal(alone, batch[t:t + 1])
        # and both are the routing-weighted sum of the chosen experts, each computed on its own
        expected = sum(weights[t, j] * expert_mlp(tensors, e, x[t:t + 1], limit).float()
                       for j, e in enumerate(chosen[t].tolist()))
        torch.testing.assert_close(batch[t:t + 1].float(), expected, atol=1e-2, rtol=1e-2)


def test_experts_refuse_mixed_types():
    tensors = checkpoint(False, torch.Generator().manual_seed(1))
    tensors["experts.2.down_proj.weight_scale"] = torch.ones(HIDDEN, 1)
    tensors["experts.2.down_proj.weight"] = tensors["experts.2.down_proj.weight"].to(torch.int8)
    with pytest.raises(InputError, match="mix INT8 and float"):
        RoutedExperts(RankWeights(0, {}, tensors, {}), "experts", NAMES, EXPERTS, Dist(), torch.bfloat16)


def test_each_ep_rank_takes_its_placement_block():
    tensors = checkpoint(False, torch.Generator().manual_seed(2))
    ep = 3
    for ep_rank in range(ep):
        mine = range(ep_rank * EXPERTS // ep, (ep_rank + 1) * EXPERTS // ep)
        weights = RankWeights(0, {}, {n: t for n, t in tensors.items() if int(n.split(".")[1]) in mine}, {})
        experts = RoutedExperts(weights, "experts", NAMES, EXPERTS, Dist(ep=ep, ep_rank=ep_rank), torch.bfloat16)
        weights.finish()
        assert experts.ids == mine
        first = mine[0]
        assert torch.equal(experts.weights.w2[0], tensors[f"experts.{first}.down_proj.weight"])
        assert torch.equal(experts.weights.w13[0], torch.cat([tensors[f"experts.{first}.gate_proj.weight"],
                                                              tensors[f"experts.{first}.up_proj.weight"]]))
