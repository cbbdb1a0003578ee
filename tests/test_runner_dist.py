"""Sharded runs give the same tokens as one process: world 1, 2 and 16 (EP16 + lm_head TP16), V3.2 also with
attention DP2 x TP8, several prompts of different lengths spread over the attention-DP ranks."""

import pytest

from dsconv.family.layout import Layout
from tests.helpers import NEW_TOKENS, run_ranks, shard

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
