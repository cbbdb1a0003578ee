"""Training V3.2's Lightning indexer the way DeepSeek trained it, for the trained tiny checkpoint.

The indexer picks the `index_topk` keys each query attends to. Its top-k passes no gradient, so the language-model
loss never reaches the indexer's weights (transformers runs it under no_grad): a model trained on the LM loss alone
keeps a random indexer, attends to keys picked at random, and its selections flip between near-tied random scores
at the slightest change of input. DeepSeek's V3.2 report trains the indexer with its own loss, a KL divergence
towards the main attention, in two stages after dense pre-training:
  - dense warm-up: the model frozen and attending to every key; the indexer alone learns
        KL( p || softmax(index scores) ),   p = the layer's attention probabilities summed over heads, normalized
  - sparse training: the model attends to the indexer's top-k and trains on the LM loss, while the indexer keeps
    learning the same KL restricted to the keys it selected; its inputs are detached, so the two losses train
    disjoint weights.
`index_logits` recomputes transformers' index scores (DeepseekV32Indexer.forward) with gradients, from the inputs
transformers hands its indexer; tests/test_indexer_training.py checks that its top-k equals transformers' own.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def index_logits(indexer: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """transformers' index scores [B, S, T] before its causal mask, with gradients:
    sum_h weight[s, h] * H**-0.5 * relu(softmax_scale * q[s, h] . k[t]), the first qk_rope_head_dim dims of q and k
    rotated by half-split RoPE."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    batch, length, _ = hidden.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rope], k[..., :rope], *position_embeddings, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)  # [B, S, H, D]
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)  # [B, T, D]
    scores = torch.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * indexer.softmax_scale)  # [B, S, H, T]
    weights = indexer.weights_proj(hidden) * indexer.n_heads ** -0.5  # [B, S, H]
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def indexer_kl(logits: torch.Tensor, target: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target || softmax(logits over the allowed keys)); target [B, S, T] sums to 1 per
    query and is zero where `allowed` is False."""
    log_q = logits.masked_fill(~allowed, float("-inf")).log_softmax(dim=-1).masked_fill(~allowed, 0.0)
    log_p = target.clamp_min(torch.finfo(target.dtype).tiny).log()
    return (target * (log_p - log_q)).sum(dim=-1).mean()


@dataclass
class LayerCapture:
    """What one decoder layer's attention saw in a forward pass: the indexer's inputs (detached) and the
    attention probabilities [B, heads, S, T] (eager attention)."""
    indexer_inputs: tuple | None = None
    probs: torch.Tensor | None = None


@dataclass
class Captures:
    layers: list[LayerCapture] = field(default_factory=list)

    def indexer_loss(self, model: nn.Module, selected_only: bool) -> torch.Tensor:
        """The summed per-layer KL of each indexer towards its layer's attention (heads summed, normalized); with
        selected_only, over the keys the attention attended to (the sparse stage), else over every causal key."""
        total = 0.0
        for layer, capture in zip(model.model.layers, self.layers):
            hidden, q_resid, position_embeddings, mask = capture.indexer_inputs
            target = capture.probs.sum(dim=1)
            target = target / target.sum(dim=-1, keepdim=True)
            allowed = target > 0 if selected_only else mask
            total = total + indexer_kl(index_logits(layer.self_attn.indexer, hidden, q_resid, position_embeddings),
                                       target, allowed)
        return total


@contextmanager
def capture_attention(model: nn.Module):
    """Hooks every layer's attention and indexer for the duration: yields a Captures filled by each forward."""
    captures = Captures([LayerCapture() for _ in model.model.layers])
    handles = []
    for layer, capture in zip(model.model.layers, captures.layers):
        def keep_inputs(_module, args, _kwargs, capture=capture):
            hidden, q_resid, position_embeddings, mask = args[:4]
            allowed = mask if mask.dtype == torch.bool else mask == 0  # an additive mask is 0 where allowed
            capture.indexer_inputs = (hidden.detach(), q_resid.detach(),
                                      tuple(t.detach() for t in position_embeddings), allowed)

        def keep_probs(_module, _args, output, capture=capture):
            if output[1] is None:
                raise RuntimeError("indexer training needs the attention probabilities: load the model with "
                                   "attn_implementation='eager'")
            capture.probs = output[1].detach()

        handles.append(layer.self_attn.indexer.register_forward_pre_hook(keep_inputs, with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(keep_probs))
    try:
        yield captures
    finally:
        for handle in handles:
            handle.remove()


def set_index_topk(model: nn.Module, topk: int) -> None:
    """How many keys every layer's indexer selects (transformers reads it from the module on each call)."""
    for layer in model.model.layers:
        layer.self_attn.indexer.index_topk = topk


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for layer in model.model.layers for p in layer.self_attn.indexer.parameters()]
