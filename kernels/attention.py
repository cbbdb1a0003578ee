"""Scaled dot-product attention over explicit keys, with a mask of allowed keys and optional per-head sinks.

One function serves MLA prefill (q [H, S, 192] against expanded keys), absorbed decode (S = 1 against the
latent, q and k [.., 576], v [.., 512]), V3.2's sparse attention (the indexer's top-k as the mask) and
DeepSeek-V4's shared-KV attention with sinks (one key = value row for all heads).

The reference is transformers' eager attention: scores q @ k^T * scale in the inputs' dtype, softmax in
float32, probabilities rounded back to the inputs' dtype before @ v. A sink (V4, as gpt-oss) is one extra logit
per head in that softmax whose probability mass is dropped: it has no value, it only lowers the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsconv.kernels.device import cast, is_npu
from dsconv.kernels.linear import matmul


def causal_mask(query_len: int, key_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [S, T], True where a query may look: the S queries are the last S of the T key positions."""
    return torch.ones(query_len, key_len, dtype=torch.bool, device=device).tril(key_len - query_len)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              one_token: bool = False) -> torch.Tensor:
    """q [B?, H, S, D], k [B?, H, T, D], v [B?, H, T, Dv] -> [B?, H, S, Dv] in q's dtype. k and v may drop
    their leading axes ([T, D], [T, Dv]) when every head attends over the same keys, as MLA's absorbed decode
    does over the latent: one matmul for all heads, no per-head copies. Batched absorbed decode passes each
    sequence's heads as its S queries (q [B, heads, D] against k [B, T, D]) with one_token=True: the queries of
    one token, computed as decode is.

    mask: None (every key allowed), or [S, T] / [B, S, T], bool (True = allowed) or additive float.
    A query row must allow at least one key (a fully masked row gives NaN) unless it has a sink.
    sinks: None, or float [H], each head's extra logit (its probability mass dropped); with one_token, one per
    query of the S axis (the token's heads).

    Prefill without sinks runs torch's SDPA, equal to the reference within float rounding (it does not round
    the scores to BF16 before the softmax), and far faster than the formula at long prompts. Decode (S = 1, or
    one_token) and any step with sinks (SDPA has no sink term) run the reference's formula with kernels.linear's
    matmul (float32 products of BF16 inputs on CPU, rounded where the reference rounds), which for one token's
    queries is also faster than SDPA. On NPU the reference runs too (plain matmul/softmax ops): the fused
    npu_fused_infer_attention_score is not wired in yet (its MLA form takes the rope part as separate
    query_rope/key_rope inputs).
    """
    mask = _head_broadcast(mask, q)
    if is_npu(q):
        return _attention_formula(q, k, v, scale, mask, sinks, torch.matmul, one_token)
    if q.shape[-2] == 1 or one_token or sinks is not None:
        return _attention_formula(q, k, v, scale, mask, sinks, matmul, one_token)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                        one_token: bool = False) -> torch.Tensor:
    return _attention_formula(q, k, v, scale, _head_broadcast(mask, q), sinks, torch.matmul, one_token)


def _attention_formula(q, k, v, scale, mask, sinks, product, one_token: bool = False) -> torch.Tensor:
    """The reference's steps with `product` for its two matmuls: torch.matmul (the reference) or kernels.linear's
    matmul (the same rounding points, float32 products on CPU). one_token: q's heads are on its S axis."""
    scores = product(q, k.transpose(-1, -2)) * scale  # [B?, H, S, T] in q's dtype
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # each head's sink joins its softmax as one more logit, whose probability is then dropped
        per_head = sinks.float()[:, None] if one_token else sinks.float()[:, None, None]  # heads on S, or on H
        sink_logits = per_head.expand(*scores.shape[:-1], 1)  # [B?, H, S, 1]
        probs = torch.softmax(torch.cat([scores.float(), sink_logits], dim=-1), dim=-1)[..., :-1]
    return product(cast(probs, q.dtype), v)


def _head_broadcast(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """[S, T] stays (broadcasts over batch and heads); [B, S, T] becomes [B, 1, S, T]."""
    if mask is None or mask.dim() == q.dim():  # already has its head axis
        return mask
    if mask.dim() == 2:
        return mask
    if mask.dim() == 3 and q.dim() == 4:
        return mask[:, None]
    raise ValueError(f"attention mask {tuple(mask.shape)} must be [S, T] or, for q [B, H, S, D], [B, S, T]; "
                     f"q is {tuple(q.shape)}")
