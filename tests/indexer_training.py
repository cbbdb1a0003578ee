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

DeepSeek-V4's CSA layers have the same kind of indexer, over compressed entries instead of tokens: it picks the
`index_topk` entries (one per `compress_ratio` tokens) each query attends to beside its sliding window, and its top-k
passes no gradient either. It trains the same way, its target being the layer's attention probabilities on the
compressed entries (heads summed, normalized over the entries); the scores with gradients are transformers' own
(`v4_index_scores` runs DeepseekV4Indexer.forward without a cache and keeps its scorer's output). A query before the
first complete entry attends to none and has no target.
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


def v4_index_scores(indexer: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor,
                    position_ids: torch.Tensor) -> torch.Tensor:
    """transformers' V4 index scores [B, S, entries] before its causal mask, with gradients: DeepseekV4Indexer.forward
    without a cache (its compressor pools every complete window of the sequence), its scorer's output kept."""
    kept = []
    handle = indexer.scorer.register_forward_hook(lambda _module, _args, output: kept.append(output))
    try:
        indexer(hidden, q_resid, position_ids, None, 0)  # the layer index only addresses a cache
    finally:
        handle.remove()
    return kept[0]


def v4_indexer_kl(indexer: nn.Module, inputs: tuple, probs: torch.Tensor, selected_only: bool) -> torch.Tensor:
    """KL of a V4 CSA layer's indexer towards the attention on its compressed entries. probs [B, heads, S, S +
    entries]: eager attention over the sequence's own keys, then the entries. Queries with no entry to attend to
    are left out."""
    hidden, q_resid, position_ids = inputs
    length = hidden.shape[1]
    target = probs[..., length:].sum(dim=1)  # [B, S, entries]
    entries = torch.arange(target.shape[-1])
    causal = (entries < ((position_ids + 1) // indexer.compress_rate).unsqueeze(-1)).expand_as(target)  # complete
    allowed = target > 0 if selected_only else causal
    queries = allowed.any(dim=-1)  # [B, S]
    target = target[queries]
    return indexer_kl(v4_index_scores(indexer, hidden, q_resid, position_ids)[queries],
                      target / target.sum(dim=-1, keepdim=True), allowed[queries])


@dataclass
class LayerCapture:
    """What one decoder layer's attention saw in a forward pass: the indexer's inputs (detached) and the
    attention probabilities [B, heads, S, keys] (eager attention)."""
    attention: nn.Module | None = None
    indexer: nn.Module | None = None
    indexer_inputs: tuple | None = None
    probs: torch.Tensor | None = None

    def kl(self, selected_only: bool) -> torch.Tensor:
        if is_v4(self.indexer):
            return v4_indexer_kl(self.indexer, self.indexer_inputs, self.probs, selected_only)
        hidden, q_resid, position_embeddings, mask = self.indexer_inputs
        target = self.probs.sum(dim=1)
        target = target / target.sum(dim=-1, keepdim=True)
        allowed = target > 0 if selected_only else mask
        return indexer_kl(index_logits(self.indexer, hidden, q_resid, position_embeddings), target, allowed)


@dataclass
class Captures:
    layers: list[LayerCapture] = field(default_factory=list)

    def indexer_loss(self, model: nn.Module, selected_only: bool) -> torch.Tensor:
        """The summed per-layer KL of each indexer towards its layer's attention (heads summed, normalized); with
        selected_only, over the keys the attention attended to (the sparse stage), else over every causal key."""
        total = 0.0
        for capture in self.layers:
            total = total + capture.kl(selected_only)
        return total


def is_v4(indexer: nn.Module) -> bool:
    return hasattr(indexer, "scorer")  # DeepseekV4Indexer scores in a submodule; DeepseekV32Indexer in itself


def indexed_layers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(attention, indexer) of every layer that has an indexer: each V3.2 layer; V4's CSA layers, in their
    compressor."""
    pairs = []
    for layer in model.model.layers:
        attention = layer.self_attn
        indexer = getattr(attention, "indexer", None)
        if indexer is None:
            indexer = getattr(getattr(attention, "compressor", None), "indexer", None)
        if indexer is not None:
            pairs.append((attention, indexer))
    return pairs


@contextmanager
def capture_attention(model: nn.Module):
    """Hooks every indexed layer's attention and indexer for the duration: yields a Captures filled by each
    forward."""
    captures = Captures([LayerCapture(attention, indexer) for attention, indexer in indexed_layers(model)])
    handles = []
    for capture in captures.layers:
        def keep_inputs(_module, args, _kwargs, capture=capture):
            if is_v4(capture.indexer):
                hidden, q_resid, position_ids = args[:3]
                capture.indexer_inputs = (hidden.detach(), q_resid.detach(), position_ids)
                return
            hidden, q_resid, position_embeddings, mask = args[:4]
            allowed = mask if mask.dtype == torch.bool else mask == 0  # an additive mask is 0 where allowed
            capture.indexer_inputs = (hidden.detach(), q_resid.detach(),
                                      tuple(t.detach() for t in position_embeddings), allowed)

        def keep_probs(_module, _args, output, capture=capture):
            if output[1] is None:
                raise RuntimeError("indexer training needs the attention probabilities: load the model with "
                                   "attn_implementation='eager'")
            capture.probs = output[1].detach()

        handles.append(capture.indexer.register_forward_pre_hook(keep_inputs, with_kwargs=True))
        handles.append(capture.attention.register_forward_hook(keep_probs))
    try:
        yield captures
    finally:
        for handle in handles:
            handle.remove()


def set_index_topk(model: nn.Module, topk: int) -> None:
    """How many keys (V4: compressed entries) every indexer selects (transformers reads it from the module on each
    call)."""
    for _, indexer in indexed_layers(model):
        indexer.index_topk = topk


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, indexer in indexed_layers(model) for p in indexer.parameters()]
