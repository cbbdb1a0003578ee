"""The indexer training of the trained tiny V3.2 (tests/indexer_training.py) against transformers' own
indexer: the scores it recomputes with gradients select what transformers' DeepseekV32Indexer selects, and its
KL loss reaches the indexer's weights alone."""

import torch
from transformers import AutoModelForCausalLM

from tests.indexer_training import (capture_attention, index_logits, indexer_kl, indexer_parameters,
                                             set_index_topk)
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


def test_indexer_kl_trains_only_the_indexer(tmp_path):
    model = tiny_v32(tmp_path, index_topk=5)
    tokens = torch.randint(2, 1024, (2, 16), generator=torch.Generator().manual_seed(1))
    with capture_attention(model) as captured:
        with torch.no_grad():
            model(tokens)
        captured.indexer_loss(model, selected_only=False).backward()
    indexer = {id(p) for p in indexer_parameters(model)}
    for p in model.parameters():
        has_grad = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert has_grad == (id(p) in indexer)


def test_indexer_kl_is_zero_only_at_the_target():
    target = torch.tensor([[[0.5, 0.25, 0.25, 0.0]]])
    allowed = torch.tensor([[[True, True, True, False]]])
    exact = target.clamp_min(1e-30).log()
    assert indexer_kl(exact, target, allowed).abs() < 1e-6
    assert indexer_kl(torch.zeros(1, 1, 4), target, allowed) > 0.01
    # what the disallowed key scores does not matter
    assert torch.equal(indexer_kl(exact, target, allowed),
                       indexer_kl(exact.clone().index_fill_(-1, torch.tensor([3]), 50.0), target, allowed))
