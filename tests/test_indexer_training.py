"""The indexer training of the trained tiny V3.2 and V4 (tests/indexer_training.py) against transformers' own
indexers: the scores it recomputes with gradients select what transformers' DeepseekV32Indexer / DeepseekV4Indexer
select, and its KL loss reaches the indexers' weights alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.indexer_training import (capture_attention, index_logits, indexer_kl, indexer_parameters,
                                    set_index_topk, v4_index_scores)
from dsconv.convert.tiny_checkpoint import make_tiny_checkpoint
from tests.trained import training_config, transformers_config


def tiny_v32(tmp_path, index_topk: int):
    config = training_config("deepseek_v32")
    init = make_tiny_checkpoint(tmp_path / "init", "deepseek_v32", encoding="bf16", seed=3,
                                config_overrides={"num_nextn_predict_layers": 0})
    model = AutoModelForCausalLM.from_pretrained(init, config=transformers_config("deepseek_v32", config),
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    set_index_topk(model, index_topk)
    return model


def test_index_logits_select_what_transformers_selects(tmp_path):
    model = tiny_v32(tmp_path, index_topk=5)
    tokens = torch.randint(2, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    chosen = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda _m, _a, out: chosen.append(out))
             for layer in model.model.layers]
    with torch.no_grad(), capture_attention(model) as captured:
        model(tokens)
    for hook in hooks:
        hook.remove()
    assert len(chosen) == len(model.model.layers) == len(captured.layers)
    for layer, capture, theirs in zip(model.model.layers, captured.layers, chosen):
        hidden, q_resid, position_embeddings, allowed = capture.indexer_inputs
        with torch.no_grad():
            ours = index_logits(layer.self_attn.indexer, hidden, q_resid, position_embeddings)
        scores = ours.masked_fill(~allowed, float("-inf"))
        # the same selection up to ties (relu makes many scores exactly 0): each query's selected scores are the
        # same values, and the top 5 of ours
        theirs = theirs.long()
        assert torch.equal(scores.gather(-1, theirs).sort(-1).values, scores.topk(5, dim=-1).values.sort(-1).values)
        # the attention attended to exactly the causal keys transformers' indexer selected
        selected = torch.zeros_like(allowed).scatter(-1, theirs, True) & allowed
        assert torch.equal(capture.probs.sum(dim=1) > 0, selected)
        assert bool((selected.sum(-1) == allowed.sum(-1).clamp(max=5)).all())


def test_indexer_kl_is_zero_only_at_the_target():
    target = torch.tensor([[[0.5, 0.25, 0.25, 0.0]]])
    allowed = torch.tensor([[[True, True, True, False]]])
    exact = target.clamp_min(1e-30).log()
    assert indexer_kl(exact, target, allowed).abs() < 1e-6
    assert indexer_kl(torch.zeros(1, 1, 4), target, allowed) > 0.01
    # what the disallowed key scores does not matter
    assert torch.equal(indexer_kl(exact, target, allowed),
                       indexer_kl(exact.clone().index_fill_(-1, torch.tensor([3]), 50.0), target, allowed))


def tiny_v4(tmp_path, index_topk: int):
    config = training_config("deepseek_v4")
    init = make_tiny_checkpoint(tmp_path / "init", "deepseek_v4", encoding="bf16", seed=3,
                                config_overrides={k: config[k] for k in ("num_nextn_predict_layers",
                                                                         "compress_ratios")})
    model = AutoModelForCausalLM.from_pretrained(init, config=transformers_config("deepseek_v4", config),
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    set_index_topk(model, index_topk)
    return model


def test_v4_index_scores_select_what_transformers_selects(tmp_path):
    """V4's CSA layers: the scores recomputed with gradients rank the entries as transformers' indexer chose them,
    and the attention attended to exactly the chosen complete entries."""
    model = tiny_v4(tmp_path, index_topk=3)
    tokens = torch.randint(2, 1024, (2, 40), generator=torch.Generator().manual_seed(0))
    chosen = []
    with torch.no_grad(), capture_attention(model) as captured:
        hooks = [capture.indexer.register_forward_hook(lambda _m, _a, out: chosen.append(out))
                 for capture in captured.layers]
        model(tokens)
    for hook in hooks:
        hook.remove()
    assert len(captured.layers) == len(chosen) == 2  # the training config's two CSA layers
    for capture, theirs in zip(captured.layers, chosen):
        hidden, q_resid, position_ids = capture.indexer_inputs
        with torch.no_grad():
            scores = v4_index_scores(capture.indexer, hidden, q_resid, position_ids)
        entries = torch.arange(scores.shape[-1])
        complete = (entries < ((position_ids + 1) // capture.indexer.compress_rate).unsqueeze(-1)).expand_as(scores)
        scores = scores.masked_fill(~complete, float("-inf"))
        valid = theirs >= 0
        past_the_end = torch.full_like(theirs, scores.shape[-1])  # invalid picks (-1) land in a column dropped after
        selected = torch.zeros(*scores.shape[:-1], scores.shape[-1] + 1, dtype=torch.bool)
        selected = selected.scatter(-1, torch.where(valid, theirs, past_the_end), True)[..., :-1]
        assert torch.equal(selected.sum(-1), complete.sum(-1).clamp(max=3))
        picked = scores.masked_fill(~selected, float("-inf")).topk(3, dim=-1).values
        best = scores.topk(3, dim=-1).values
        assert torch.equal(picked, best)  # the same scores, up to ties between equal ones
        attended = capture.probs[..., hidden.shape[1]:].sum(dim=1) > 0
        assert torch.equal(attended, selected)


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_indexer_kl_trains_only_the_indexers(family, tmp_path):
    model = (tiny_v32 if family == "deepseek_v32" else tiny_v4)(tmp_path, index_topk=3)
    tokens = torch.randint(2, 1024, (2, 24), generator=torch.Generator().manual_seed(1))
    with capture_attention(model) as captured:
        with torch.no_grad():
            model(tokens)
        loss = captured.indexer_loss(model, selected_only=False)
        assert torch.isfinite(loss) and loss > 0
        loss.backward()
    indexer = {id(p) for p in indexer_parameters(model)}
    assert indexer
    for p in model.parameters():
        has_grad = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert has_grad == (id(p) in indexer)
