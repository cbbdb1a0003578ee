"""Ascend's MC2 dispatch and combine (runner/models/mc2.py) against the torch_npu contract double: at EP16 one MoE
layer through npu_moe_distribute_dispatch_v2 / combine_v2 with the schema's parameters equals the all-to-all path's
output, bit for bit under BF16 and within the rows' INT8 rounding under W8A8, with two ops per layer and no
all-to-all; outside MC2's documented limits the layer takes the all-to-all path. The tiny models' hidden sizes are
below MC2's 1024, so their 16-rank runs on the double (test_npu_contract) take the all-to-all path."""

from types import SimpleNamespace

import pytest
import torch

from dsconv.comm.launch import launch
from dsconv.kernels.device import reset_npu_path
from dsconv.runner.models import mc2
from dsconv.runner.models.dist import Dist
from tests.mc2_layer import mc2_layer
from tests.npu_double import ContractError, install
from tests.npu_schemas import TORCH_NPU_VERSION, SchemasUnavailable, registered

HIDDEN, EXPERTS, INTER, TOP_K = 1024, 32, 32, 8  # MC2's smallest hidden size; 2 experts per rank at EP16
ROWS = [3, 0, 1, 2, 0, 0, 1, 3, 2, 1, 0, 0, 0, 1, 2, 3]  # each rank's tokens: idle ranks among them
DISPATCH, COMBINE = "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"


@pytest.fixture(autouse=True, scope="module")
def torch_npu_schemas():
    try:
        return registered()
    except SchemasUnavailable as e:
        pytest.skip(f"torch_npu {TORCH_NPU_VERSION}'s schemas are unavailable: {e}")


@pytest.fixture
def double():
    installed = install()
    yield installed
    reset_npu_path()


def _mesh(most: int | None = 4, ep: int = 16) -> Dist:
    """A Dist that has MC2's communicator (a stand-in: fits() only asks whether there is one) and a step plan."""
    mesh = Dist(ep=ep, groups=SimpleNamespace(mc2=object()))
    if most is not None:
        mesh.plan_step([(most, most)] + [(1, 1)] * (ep - 1))
    return mesh


def _fits(mesh=None, hidden=7168, k=8, experts=256, dtype=torch.bfloat16, distinct=True) -> bool:
    x = torch.zeros(2, hidden, dtype=dtype)
    return mc2.fits(x, k, SimpleNamespace(n_physical=experts), mesh or _mesh(), distinct)


def test_mc2_takes_the_steps_within_its_limits(double, monkeypatch):
    """Real V3.2 at EP16 (H 7168, 256 experts, top-8) fits with a large enough HCCL buffer; each documented limit
    past, or a step that MC2 cannot take, goes to the all-to-all path."""
    monkeypatch.setenv(mc2.HCCL_BUFFSIZE_ENV, "4096")
    assert _fits()
    assert _fits(_mesh(most=mc2.MAX_TOKENS))
    assert not _fits(_mesh(most=mc2.MAX_TOKENS + 1))  # BS per rank
    assert not _fits(_mesh(most=None))  # no step plan: BS unknown
    assert not _fits(hidden=1023) and not _fits(hidden=7169) and _fits(hidden=1024)
    assert not _fits(k=17) and _fits(k=16)
    assert not _fits(experts=1024) and not _fits(experts=250)  # above combine's 512; not divisible by EP16
    assert not _fits(dtype=torch.float32)  # float32 exactness runs
    assert not _fits(distinct=False)  # a hash layer's table may name an expert twice
    assert not _fits(_mesh(ep=1))
    without = _mesh()
    without.groups = SimpleNamespace(mc2=None)  # not on the NPU path: no communicator made
    assert not _fits(without)
    reset_npu_path()
    assert not _fits()  # a CPU tensor off the NPU path


def test_mc2_needs_its_hccl_buffer(double, monkeypatch):
    """The documented A3 buffer at real V3.2's EP16 (16 local experts, H 7168, top-8) is 7,831,552 bytes per token
    of BS: HCCL's default 200 MB holds BS 26, not 27."""
    per_token = mc2.buffer_bytes(16, 1, 16, 7168, 8)
    assert per_token == 2 * (16 * 16 * 14848 + 8 * 14336)  # Align512(Align32(14336) + 64) = 14848
    monkeypatch.delenv(mc2.HCCL_BUFFSIZE_ENV, raising=False)
    assert mc2.buffer_bytes(16, 26, 16, 7168, 8) <= mc2.hccl_buffer_bytes() < mc2.buffer_bytes(16, 27, 16, 7168, 8)
    assert _fits(_mesh(most=26)) and not _fits(_mesh(most=27))


def _dispatch(double, **change):
    args = dict(x=torch.randn(4, HIDDEN).to(torch.bfloat16), expert_ids=torch.tensor([[0, 1]] * 4, dtype=torch.int32),
                group_ep="no communicator", ep_world_size=16, ep_rank_id=0, moe_expert_num=32)
    args.update(change)
    return double.npu_moe_distribute_dispatch_v2(**args)


@pytest.mark.parametrize("change, refusal", [
    ({"x": torch.randn(0, HIDDEN).to(torch.bfloat16), "expert_ids": torch.zeros(0, 2, dtype=torch.int32)}, "BS 0"),
    ({"x": torch.randn(513, HIDDEN).to(torch.bfloat16), "expert_ids": torch.tensor([[0, 1]] * 513, dtype=torch.int32)},
     "BS 513"),
    ({"x": torch.randn(4, 1000).to(torch.bfloat16)}, "H 1000"),
    ({"x": torch.randn(4, HIDDEN)}, "bfloat16 or float16"),
    ({"expert_ids": torch.tensor([[0, 1]] * 4)}, "int32"),
    ({"expert_ids": torch.tensor([[0, 0]] * 4, dtype=torch.int32)}, "twice"),
    ({"expert_ids": torch.tensor([[0, 32]] * 4, dtype=torch.int32)}, "outside"),
    ({"expert_ids": torch.arange(17, dtype=torch.int32).expand(4, 17)}, "K 17"),
    ({"moe_expert_num": 33}, "divisible"),
    ({"x_active_mask": torch.tensor([True, False, True, False])}, "before its False"),
    ({}, "names no communicator"),
])
def test_double_refuses_what_dispatch_v2_documents_as_unsupported(double, change, refusal):
    with pytest.raises(ContractError, match=refusal):
        _dispatch(double, **change)


def test_combine_v2_needs_its_dispatch(double):
    with pytest.raises(ContractError, match="used together"):
        double.npu_moe_distribute_combine_v2(torch.zeros(8, HIDDEN, dtype=torch.bfloat16),
                                             torch.zeros(1, 2, dtype=torch.int32), torch.zeros(8, dtype=torch.int32),
                                             torch.zeros(32, dtype=torch.int32), torch.zeros(1, 2), "nothing sent",
                                             16, 0, 32)


@pytest.mark.slow
@pytest.mark.parametrize("int8,redundant", [(False, 16), (True, 0)], ids=["bf16-redundant16", "w8a8"])
def test_ep16_layer_through_mc2_equals_the_all_to_all_path(int8, redundant, tmp_path):
    """16 ranks, idle ones among them (padded to the step's most rows and masked out): MC2's two ops per layer, no
    all-to-all, each expert owner's grouped matmuls on exactly its rows; the output equals the all-to-all path's, bit
    for bit under BF16. Under W8A8 MC2 quantizes each row by its documented formula, int8(x * (127 / max|x|)), where
    npu_dynamic_quant divides by max|x| / 127: a row may round one step apart, so the outputs agree within that.
    The BF16 case runs 16 redundant experts (48 physical, 3 a rank): MC2 takes the physical ids and slots."""
    assert launch(mc2_layer, dict(result_dir=str(tmp_path), hidden=HIDDEN, n_experts=EXPERTS, inter=INTER, k=TOP_K,
                                  rows=ROWS, int8=int8, redundant=redundant), world_size=16, device="cpu",
                  timeout_s=600, log_dir=tmp_path / "logs") == 0
    for rank, rows in enumerate(ROWS):
        runs = torch.load(tmp_path / f"rank{rank}.pt")
        mc2_run, all_to_all = runs["mc2"], runs["all_to_all"]
        assert mc2_run["calls"][DISPATCH] == mc2_run["calls"][COMBINE] == 1, (rank, mc2_run["calls"])
        assert mc2_run["all_to_all_single"] == 0, rank
        assert DISPATCH not in all_to_all["calls"] and all_to_all["all_to_all_single"] == 2, (rank, all_to_all)
        assert mc2_run["out"].shape == (rows, HIDDEN)
        assert mc2_run["calls"].get("npu_grouped_matmul", 0) == all_to_all["calls"].get("npu_grouped_matmul", 0)
        if int8:
            torch.testing.assert_close(mc2_run["out"].float(), all_to_all["out"].float(), rtol=0.05, atol=0.02)
        else:
            assert torch.equal(mc2_run["out"], all_to_all["out"]), rank
    assert sum(torch.load(tmp_path / f"rank{r}.pt")["mc2"]["calls"].get("npu_grouped_matmul", 0)
               for r in range(16)) > 0
