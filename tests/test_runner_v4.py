"""The V4 runner's one-sequence prefill against transformers' DeepseekV4ForCausalLM on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from convert.arch_v4 import AttnType, parse_config
from runner.dist import Dist
from runner.model_v4 import DeepseekV4
from runner.weights import load_manifest, load_rank
from shard.layout import Layout
from tests.test_shard import shard

COSINE_MIN = 0.999
# The tiny config's sliding_window is 16, its compress rates 4 and 128, its index_topk 8: 300 tokens cross
# 18 windows, give CSA layers 75 entries to choose 8 from and HCA layers 2 complete windows
PROMPT_LEN = 300


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.fixture(scope="module")
def pair(tiny_source, tmp_path_factory):
    """(our model, its config, transformers' model) on identical float32 weights."""
    shards = tmp_path_factory.mktemp("deepseek_v4-bf16-shards") / "s"
    shard(tiny_source("deepseek_v4", "fp8"), shards, Layout(1, 1, 1, 1))
    reference = AutoModelForCausalLM.from_pretrained(tiny_source("deepseek_v4", "bf16"), dtype=torch.float32).eval()
    manifest = load_manifest(shards)
    cfg = parse_config(manifest["model"]["config"])
    model = DeepseekV4(cfg, load_rank(shards, manifest, 0), Dist.single(), torch.float32)
    return model, cfg, reference


def test_fixture_schedule_has_every_attention_type(pair):
    _, cfg, _ = pair
    assert set(cfg.attn_types) == set(AttnType)
    assert PROMPT_LEN > cfg.hca_compress_rate * 2 and PROMPT_LEN // cfg.csa_compress_rate > cfg.index_topk


def test_prefill_hidden_states_and_logits(pair):
    model, cfg, reference = pair
    ids = torch.randint(2, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(ids[None], output_hidden_states=True)
        hidden = []
        logits = model.forward_full(ids, hidden_out=hidden)
    # transformers: the embedding's hc_mult copies, then each layer's streams [T, hc_mult, hidden] but the
    # last layer's, whose place holds the final norm's output
    assert len(ref.hidden_states) == cfg.num_hidden_layers + 1
    assert len(hidden) == cfg.num_hidden_layers
    for layer, (mine, theirs) in enumerate(zip(hidden[:-1], ref.hidden_states[1:-1])):
        assert mine.shape == theirs[0].shape == (PROMPT_LEN, cfg.hc_mult, cfg.hidden_size)
        assert cosine(mine, theirs[0]) >= COSINE_MIN, layer
    with torch.no_grad():
        final = model.norm(model.hc_head(hidden[-1]))  # the last layer, seen through hc_head and the norm
    assert cosine(final, ref.hidden_states[-1][0]) >= COSINE_MIN
    assert cosine(logits, ref.logits[0]) >= COSINE_MIN


def test_mtp_tensors_are_dropped_and_nothing_is_left(tiny_source, tmp_path):
    shards = tmp_path / "s"
    shard(tiny_source("deepseek_v4", "fp8"), shards, Layout(1, 1, 1, 1))
    manifest = load_manifest(shards)
    weights = load_rank(shards, manifest, 0)
    assert any(name.startswith("mtp.") for name in weights.tensors)
    DeepseekV4(parse_config(manifest["model"]["config"]), weights, Dist.single(), torch.float32)
    assert not weights.tensors
