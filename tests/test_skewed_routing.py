"""Skewed routing at world 16: every token of every attention-DP rank routed to EP rank 0's experts, so that one
rank receives the step's whole exchange (every (token, expert) pair) and the others none. The greedy tokens are
transformers' on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.convert.tiny_checkpoint import Stored, TensorMaker, make_tiny_checkpoint
from dsconv.family.layout import Layout
from tests.helpers import NEW_TOKENS, PROMPTS, run_ranks, shard

pytestmark = pytest.mark.slow  # 16 ranks

LAYOUT = Layout(16, 16, 16, 1)  # attention DP16, MoE EP16, lm_head TP16
# Experts per layer so that EP rank 0 owns as many as a token picks: V3.2 top-4 of 64 (4 per rank), V4 top-2 of 32
EXPERTS = {"deepseek_v32": 64, "deepseek_v4": 32}
# Added to the routers' selection bias of rank 0's experts: their scores (sigmoid for V3.2, sqrt-softplus for V4)
# are far below it, so every top-k (and V3.2's group choice) picks them; the routing weights come from the scores
# alone, so the bias decides only where tokens go
FORCING_BIAS = 100.0


class EveryTokenToRankZero(TensorMaker):
    """The tiny fixture's random tensors, but every router sends every token to EP rank 0's experts: a selection
    bias on them (V3.2's e_score_correction_bias, V4's gate.bias), and V4's hash layers' token-to-expert table
    mapping every token to them."""

    def produce(self, item: Stored) -> torch.Tensor:
        value = super().produce(item)
        rank_zero = self.arch.n_routed_experts // LAYOUT.ep  # experts 0 .. rank_zero - 1 live on EP rank 0
        if item.spec.name.endswith(("gate.e_score_correction_bias", "gate.bias")):
            value = value.clone()
            value[:rank_zero] += FORCING_BIAS
        elif item.spec.name.endswith("gate.tid2eid"):
            value = torch.arange(value.shape[1], dtype=value.dtype).expand_as(value).contiguous()
        return value


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_every_token_to_one_ep_rank_gives_transformers_tokens(family, tmp_path):
    sources = {encoding: make_tiny_checkpoint(tmp_path / encoding, family, encoding=encoding,
                                              config_overrides={"n_routed_experts": EXPERTS[family]},
                                              maker=EveryTokenToRankZero)
               for encoding in ("fp8", "bf16")}
    reference = AutoModelForCausalLM.from_pretrained(sources["bf16"], dtype=torch.float32).eval()
    picked = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out: picked.append(out[-1]))
             for layer in reference.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        expected = [reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]
    for hook in hooks:
        hook.remove()
    # the premise: every routed (token, expert) pair of every MoE layer went to rank 0's experts
    per_rank = EXPERTS[family] // LAYOUT.ep
    assert picked and all(bool((chosen < per_rank).all()) for chosen in picked)
    assert {int(e) for chosen in picked for e in chosen.flatten()} == set(range(per_rank))

    shards = tmp_path / "shards"
    shard(sources["fp8"], shards, LAYOUT)
    assert run_ranks(shards, tmp_path, prompts=PROMPTS) == expected
