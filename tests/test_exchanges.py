"""What a 16-rank decode step sends, counted on every rank (tests/rank_entries.counted wraps torch.distributed's
collectives and names the function of the package that made each call):
- each MoE layer makes two all-to-alls, the dispatch (its counts in its blocks' headers) and the combine;
- a greedy step's lm_head (TP16) sends each rank its rows' best token per vocabulary slice, 8 bytes a row, never a
  [rows, vocab / 16] slice of logits;
- under W8A8 the dispatch carries INT8 rows with their float32 scales: at the real hidden sizes (V3.2's 7168,
  V4-Flash's 4096) at most 0.55x the bytes of BF16 rows, from the wire format, and on the tiny models in the ratio
  their hidden size gives.
The greedy tokens of the same layouts equal transformers' in tests/test_runner_dist.py and test_skewed_routing.py."""

import json
from pathlib import Path

import pytest
import torch

from dsconv.family.layout import Layout
from dsconv.runner.entrypoints.generate import generate
from dsconv.runner.models.moe import dispatch_columns, row_bytes
from dsconv.runner.models.weights import load_manifest
from tests.helpers import PROMPTS, generate_ranks, run_ranks, shard
from tests.rank_entries import counted, dispatch_padding, quantize_on_arrival

pytestmark = pytest.mark.slow  # 16 ranks

NEW_TOKENS = 4
ARGMAX_ENTRY_BYTES = 8  # per row and member: its slice's best logit and that token's id, float32 each
W8A8_BOUND = 0.55
REAL_CONFIGS = ("deepseek_v32_exp.config.json", "deepseek_v4_flash.config.json")  # the hub's, in tests/data


def _count_steps(shards, tmp_path, prompts, dtype="float32", name="run", **entry) -> list[list[dict]]:
    """Generation at world 16 with its collectives counted -> per rank its steps (rank_entries.counted); entry: the
    inner entry and its arguments (default: generate)."""
    return _generate_counted(shards, tmp_path, prompts, dtype, name, **entry)[1]


def _generate_counted(shards, tmp_path, prompts, dtype="float32", name="run", **entry):
    """-> (the generated tokens, per rank its steps)."""
    record = tmp_path / f"{name}-counts"
    record.mkdir()
    entry = entry or {"inner": generate}
    tokens = run_ranks(shards, tmp_path, prompts=prompts, dtype=dtype, new_tokens=NEW_TOKENS,
                       results_name=f"{name}-results", entry=counted, record_dir=str(record), **entry)
    return tokens, [json.loads((record / f"rank{rank}.json").read_text()) for rank in range(16)]


def _moe_layers(shards) -> int:
    config = load_manifest(shards)["model"]["config"]
    if "first_k_dense_replace" in config:  # DeepSeek-V3 / V3.2: dense layers first
        return config["num_hidden_layers"] - config["first_k_dense_replace"]
    return config["num_hidden_layers"]  # DeepSeek-V4: every layer's MLP is a (hash or routed) MoE


def _decode_steps(ranks: list[list[dict]]) -> list[tuple[int, dict]]:
    steps = [(rank, step) for rank, record in enumerate(ranks) for step in record if step["decode"]]
    assert len(steps) >= 16 * (NEW_TOKENS - 2), "too few decode steps counted"
    return steps


def _calls(step: dict, collective: str, site: str) -> list[int]:
    return [nbytes for name, where, nbytes in step["calls"] if name == collective and where == site]


def _check_decode_steps(ranks: list[list[dict]], moe_layers: int, attn_tp: int) -> None:
    for rank, step in _decode_steps(ranks):
        where = (rank, step)
        assert len(_calls(step, "all_to_all_single", "ep_dispatch")) == moe_layers, where
        assert len(_calls(step, "all_to_all_single", "ep_combine")) == moe_layers, where
        head = _calls(step, "all_to_all_single", "ParallelLMHead.__call__")
        assert len(head) == 2, where  # the rows to every member, and each member's best entries back
        # lm_head TP16 spans the world: every rank holds its DP index's rows, and sends its best entries for every
        # member's; a rank that sends or receives none adds one throwaway row (collectives.all_to_all_variable)
        group_rows, own = attn_tp * sum(step["logit_rows"]), step["logit_rows"][rank // attn_tp]
        assert head[1] == ARGMAX_ENTRY_BYTES * (group_rows + (not group_rows or not own)), where
        assert not [call for call in step["calls"] if call[0].startswith("all_gather") and call[1].startswith(
            "ParallelLMHead")], where


@pytest.mark.parametrize("family, attn_tp, prompts", [("deepseek_v32", 8, 16), ("deepseek_v4", 1, 16)],
                         ids=["v32-dp2xtp8-16", "v4-dp16-16"])
def test_a_decode_step_makes_two_exchanges_per_moe_layer(tiny_source, tmp_path, family, attn_tp, prompts):
    shards = tmp_path / "shards"
    shard(tiny_source(family), shards, Layout(16, 16, 16, attn_tp))
    ranks = _count_steps(shards, tmp_path, (PROMPTS * 16)[:prompts])
    _check_decode_steps(ranks, _moe_layers(shards), attn_tp)


SAMPLING = {"temperature": 0.8, "top_k": 20, "top_p": 1.0, "seed": 7}  # a plain sampled request (models/draw.py)


@pytest.mark.parametrize("family, attn_tp", [("deepseek_v32", 8), ("deepseek_v4", 1)], ids=["v32-dp2xtp8", "v4-dp16"])
def test_sampled_steps_send_candidates_and_draw_the_world_1_tokens(tiny_source, tmp_path, family, attn_tp):
    """Sampled requests (temperature 0.8, top_k 20, seeded) at world 16: lm_head sends each rank, per row and
    member, its slice's 20 largest logits with their ids (8 bytes each), never a slice of the logits, and the tokens
    drawn from those candidates equal the world-1 run's, which draws from whole rows."""
    shards, single = tmp_path / "shards", tmp_path / "single"
    shard(tiny_source(family), shards, Layout(16, 16, 16, attn_tp))
    shard(tiny_source(family), single, Layout(1, 1, 1, 1))
    prompts = PROMPTS[:4]
    tokens, ranks = _generate_counted(shards, tmp_path, prompts, sampling=SAMPLING, inner=generate)
    assert tokens == run_ranks(single, tmp_path, prompts, new_tokens=NEW_TOKENS, sampling=SAMPLING)
    for rank, step in _decode_steps(ranks):
        head = _calls(step, "all_to_all_single", "ParallelLMHead.__call__")
        group_rows, own = attn_tp * sum(step["logit_rows"]), step["logit_rows"][rank // attn_tp]
        assert head[1] == SAMPLING["top_k"] * ARGMAX_ENTRY_BYTES * (group_rows + (not group_rows or not own)), \
            (rank, step)
        assert not [call for call in step["calls"] if call[0].startswith("all_gather")], (rank, step)


def test_w8a8_dispatch_sends_int8_rows_at_batch_one(tiny_source, w8a8_source, tmp_path):
    """V3.2 at attention DP16, one prompt (fifteen idle ranks), BF16 and W8A8 shards: two exchanges per MoE layer in
    both, and the W8A8 dispatch's bytes against BF16's in the ratio of their rows on the wire."""
    runs = {}
    for name, source in (("bf16", tiny_source("deepseek_v32")), ("w8a8", w8a8_source("deepseek_v32"))):
        shards = tmp_path / f"shards-{name}"
        shard(source, shards, Layout(16, 16, 16, 1))
        runs[name] = _count_steps(shards, tmp_path, PROMPTS[:1], dtype="bfloat16", name=name)
        _check_decode_steps(runs[name], _moe_layers(shards), 1)
    hidden = load_manifest(tmp_path / "shards-w8a8")["model"]["config"]["hidden_size"]
    sent = {name: sum(nbytes for _, step in _decode_steps(ranks) for nbytes in _calls(step, "all_to_all_single",
                                                                                     "ep_dispatch"))
            for name, ranks in runs.items()}
    # the same steps, blocks and capacities on both sides: only the row's width differs
    assert sent["w8a8"] / sent["bf16"] == pytest.approx(_wire_ratio(hidden), rel=1e-9)


def _wire_ratio(hidden: int) -> float:
    """A W8A8 dispatch row's bytes over a BF16 one's at this hidden size, from the columns the dispatch sends."""
    rows, local_ids = torch.randn(3, hidden, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long)
    int8, bf16 = (sum(row_bytes(c) for c in dispatch_columns(rows, local_ids, int8)) for int8 in (True, False))
    return int8 / bf16


@pytest.mark.parametrize("config", REAL_CONFIGS)
def test_w8a8_dispatch_rows_at_real_hidden_sizes_are_at_most_055_of_bf16(config):
    hidden = json.loads((Path(__file__).parent / "data" / config).read_text())["hidden_size"]  # 7168, 4096
    assert _wire_ratio(hidden) <= W8A8_BOUND


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_counts_sent_first_give_the_same_tokens(tiny_source, tmp_path, family):
    """With no room for padding every dispatch takes the variable form, its counts exchanged first (the form long
    prefill chunks take): three exchanges per MoE layer, and the same tokens as the counted form."""
    shards = tmp_path / "shards"
    shard(tiny_source(family), shards, Layout(16, 16, 16, 1))
    tokens, _ = _generate_counted(shards, tmp_path, PROMPTS, name="counted")
    variable, ranks = _generate_counted(shards, tmp_path, PROMPTS, name="variable", inner=dispatch_padding,
                                        then=generate, pad_bytes=0)
    assert variable == tokens
    for rank, step in _decode_steps(ranks):
        assert len(_calls(step, "all_to_all_single", "ep_dispatch")) == 2 * _moe_layers(shards), (rank, step)


def test_int8_on_the_wire_gives_the_logits_of_quantizing_after_the_exchange(w8a8_source, tmp_path):
    """W8A8 V3.2 at EP2: the rows quantized by their sender (as dsrun sends them) and the rows sent in float32 and
    quantized by the expert's rank give bit-identical logits (quantization is per row: every new token's logprob and
    its top 8 are equal as floats) and tokens."""
    shards = tmp_path / "shards"
    shard(w8a8_source("deepseek_v32"), shards, Layout(2, 2, 2, 1))
    sent = generate_ranks(shards, tmp_path / "int8-sent", PROMPTS, logprobs=8)
    after = generate_ranks(shards, tmp_path / "quantized-after", PROMPTS, entry=quantize_on_arrival, then=generate,
                           logprobs=8)
    assert sent["generated"] == after["generated"]
    assert sent["logprobs"] == after["logprobs"]
