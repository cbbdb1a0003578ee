"""Sharded runs give the same tokens as one process: world 1, 2 and 16 (EP16 + lm_head TP16), V3.2 also with
attention DP2 x TP8, and with o_proj and embedding TP over all 16 attention-DP ranks, several prompts of different
lengths spread over the attention-DP ranks."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsconv.family.layout import Layout
from tests.helpers import NEW_TOKENS, PROMPTS, run_ranks, shard

pytestmark = pytest.mark.slow  # multi-process or large-checkpoint runs


@pytest.mark.parametrize("family,layouts", [
    ("deepseek_v3", [Layout(1, 1, 1, 1), Layout(2, 2, 2, 1), Layout(16, 16, 16, 1)]),
    ("deepseek_v32", [Layout(1, 1, 1, 1), Layout(16, 16, 16, 8)]),
])
def test_same_tokens_at_every_world_size(tiny_source, tmp_path, family, layouts):
    tokens = []
    for layout in layouts:
        shards = tmp_path / f"w{layout.world_size}-tp{layout.attn_tp}"
        shard(tiny_source(family, "fp8"), shards, layout)
        tokens.append(run_ranks(shards, tmp_path))
    assert all(len(t) == NEW_TOKENS for t in tokens[0])
    for other in tokens[1:]:
        assert other == tokens[0]


def test_w8a8_same_tokens_at_world_16_as_world_1(w8a8_source, tmp_path):
    tokens = []
    for layout in (Layout(1, 1, 1, 1), Layout(16, 16, 16, 1)):
        shards = tmp_path / f"w8a8-w{layout.world_size}"
        shard(w8a8_source("deepseek_v3"), shards, layout)
        tokens.append(run_ranks(shards, tmp_path))
    assert tokens[1] == tokens[0]


FINE_TP = Layout(16, 16, 16, 1, oproj_tp=16, embed_tp=16)


def test_oproj_and_embedding_tp_tokens_equal_transformers(tiny_source, tmp_path):
    """V3.2 at world 16 with o_proj and the embedding split over all 16 attention-DP ranks: float32 greedy tokens
    equal transformers' generate on the same weights."""
    shards = tmp_path / "fine-tp"
    shard(tiny_source("deepseek_v32", "fp8"), shards, FINE_TP)
    assert {p.name.split("-0")[0] for p in shards.iterdir() if p.is_dir()} >= {"oproj-tp", "embed-tp"}
    reference = AutoModelForCausalLM.from_pretrained(tiny_source("deepseek_v32", "bf16"), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist() for ids in PROMPTS]
    assert run_ranks(shards, tmp_path) == expected


def test_w8a8_oproj_tp_and_int8_cache_same_tokens_as_world_1(w8a8_source, tmp_path):
    """W8A8 with o_proj TP (INT8 activations exchanged with their per-token scales) and embedding TP, and the
    INT8 KV cache: the same tokens at world 16 as in one process. Each prompt runs alone on its attention-DP rank
    at world 16, so each runs alone at world 1 too: batched with the others, a product of a different row count
    rounds its last bits differently, and on this random-weight model an INT8 cache entry near a rounding
    boundary can turn that into another step of the grid and a near-tie into another token."""
    w1, w16 = tmp_path / "w8a8-w1", tmp_path / "w8a8-w16"
    shard(w8a8_source("deepseek_v32"), w1, Layout(1, 1, 1, 1))
    shard(w8a8_source("deepseek_v32"), w16, FINE_TP)
    for kv in ("auto", "int8"):
        alone = [run_ranks(w1, tmp_path, prompts=[ids], kv_cache_dtype=kv, results_name=f"w1-{kv}-{i}")[0]
                 for i, ids in enumerate(PROMPTS)]
        assert run_ranks(w16, tmp_path, kv_cache_dtype=kv, results_name=f"w16-{kv}") == alone, kv


def test_parallel_layers_check_their_shard_against_the_config():
    """A parallel layer computes its local size from the config and the group's size: a shard of another size (shards
    written for another config or layout) is one line naming both, before any step runs."""
    from dsconv.errors import InputError
    from dsconv.runner.models.dist import Dist
    from dsconv.runner.models.layers import Proj
    from dsconv.runner.models.parallel import OutputSplitLinear, ParallelLMHead, VocabParallelEmbedding

    four = Dist(tp=4, embed_tp=4, oproj_tp=4)
    VocabParallelEmbedding(torch.zeros(16, 8), 64, four)  # 64 / 4
    with pytest.raises(InputError, match="the embedding: this rank's shard has 32 rows, but the config's 64 over "
                                         "embed-tp 4 give 16"):
        VocabParallelEmbedding(torch.zeros(32, 8), 64, four)
    with pytest.raises(InputError, match="lm_head: this rank's shard has 16 rows, but the config's 60 over tp 4 "
                                         "give 15"):
        ParallelLMHead(Proj.of(torch.zeros(16, 8), None), 60, four)
    with pytest.raises(InputError, match="o_proj: this rank's shard has 8 rows, but the config's 64 over oproj-tp 4"):
        OutputSplitLinear(Proj.of(torch.zeros(8, 8), None), 64, four, "o_proj")
