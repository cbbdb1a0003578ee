"""Skewed routing at world 16: every token of every attention-DP rank routed to EP rank 0's experts, so that one
rank receives the step's whole exchange (every (token, expert) pair) and the others none. The greedy tokens are
transformers' on the same weights, without expert-parallel load balancing and with it (redundant experts placed by
a recorded load, and rebalanced while generating), and EPLB spreads the load evenly over the ranks."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.convert.tiny_checkpoint import EveryTokenToRankZero, make_tiny_checkpoint
from dsconv.family.layout import Layout
from dsconv.runner.models.eplb import EplbConfig, overall
from dsconv.shard.shard import ExpertRequest
from tests.helpers import PROMPTS, generate_ranks, run_ranks, shard

pytestmark = pytest.mark.slow  # 16 ranks

LAYOUT = Layout(16, EveryTokenToRankZero.EP, 16, 1)  # attention DP16, MoE EP16 (the maker's), lm_head TP16
# Experts per layer so that EP rank 0 owns as many as a token picks: V3.2 top-4 of 64 (4 per rank), V4 top-2 of 32
EXPERTS = {"deepseek_v32": 64, "deepseek_v4": 32}
REDUNDANT = 16  # the R at world 16
# A rebalance every 8 steps over a window of 8: the hot experts' replicas then take the same rows (V4's 2 hot experts
# get 8 replicas each, and 8 decode steps give each replica 3 of the 3 prompts' 24 rows). 17 new tokens give two
# rebalances, the second's window the first with the moved layers (every layer at one boundary; the world-16
# servers of tests/test_serve.py run EPLB's default, one layer a step).
EPLB = EplbConfig(window_size=8, step_interval=8)
EPLB_TOKENS = 17
BALANCED = 0.85  # the floor, with R = 16 at world 16


def rank_balancedness(record: Path, ep: int) -> float:
    """The balancedness (mean over max tokens per EP rank, layers' means summed over their maxima summed) a load
    record's layers had under the placement table's blocks, rank k holding experts [k * E / ep, (k + 1) * E / ep)."""
    loads = json.loads(record.read_text())["loads"]
    ranks = [[sum(layer[k * len(layer) // ep:(k + 1) * len(layer) // ep]) for k in range(ep)]
             for layer in loads.values() if sum(layer)]
    return overall(ranks)


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_every_token_to_one_ep_rank_gives_transformers_tokens_and_eplb_spreads_it(family, tmp_path):
    """Without EPLB every token's experts are EP rank 0's; with 16 redundant experts placed by the recorded load, and
    again placed round-robin and rebalanced halfway through the generation (requests in flight), the tokens are
    transformers' and the ranks' loads are even."""
    sources = {encoding: make_tiny_checkpoint(tmp_path / encoding, family, encoding=encoding,
                                              config_overrides={"n_routed_experts": EXPERTS[family]},
                                              maker=EveryTokenToRankZero)
               for encoding in ("fp8", "bf16")}
    reference = AutoModelForCausalLM.from_pretrained(sources["bf16"], dtype=torch.float32).eval()
    picked = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out: picked.append(out[-1]))
             for layer in reference.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        expected = [reference.generate(torch.tensor([ids]), max_new_tokens=EPLB_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]
    for hook in hooks:
        hook.remove()
    # the premise: every routed (token, expert) pair of every MoE layer went to rank 0's experts
    per_rank = EXPERTS[family] // LAYOUT.ep
    assert picked and all(bool((chosen < per_rank).all()) for chosen in picked)
    assert {int(e) for chosen in picked for e in chosen.flatten()} == set(range(per_rank))

    shards, record = tmp_path / "shards", tmp_path / "load.json"
    shard(sources["fp8"], shards, LAYOUT)
    assert run_ranks(shards, tmp_path, prompts=PROMPTS, new_tokens=EPLB_TOKENS, expert_load_record=record) == expected
    without = rank_balancedness(record, LAYOUT.ep)
    assert without == 1 / LAYOUT.ep  # every token on rank 0

    # 16 redundant experts placed by the recorded load; EPLB on, its first rebalance measuring that placement
    static, rebalanced = tmp_path / "static", tmp_path / "rebalanced"
    shard(sources["fp8"], static, LAYOUT, ExpertRequest(REDUNDANT, load=record))
    account = generate_ranks(static, tmp_path / "results-static", new_tokens=EPLB_TOKENS, eplb=EPLB)
    assert account["generated"] == expected
    measured_static = account["eplb"][0]["measured"]
    # round-robin replicas, rebalanced halfway: the layers move at once, the next window measures the new placement
    # round-robin replicas, rebalanced halfway through (requests in flight)
    shard(sources["fp8"], rebalanced, LAYOUT, ExpertRequest(REDUNDANT))
    account = generate_ranks(rebalanced, tmp_path / "results-rebalanced", new_tokens=EPLB_TOKENS,
                             eplb=replace(EPLB, use_async=False))
    assert account["generated"] == expected
    first, second = account["eplb"]
    print(f"{family}: balancedness without EPLB {without:.3f}; with {REDUNDANT} redundant experts placed by the "
          f"recorded load {measured_static:.3f}; placed round-robin {first['measured']:.3f}, after a rebalance "
          f"{second['measured']:.3f}")
    assert first["layers_moved"] > 0 and first["measured"] < BALANCED
    assert measured_static >= BALANCED and second["measured"] >= BALANCED
