"""Rotary position embedding as transformers 5.23 computes it for DeepSeek-V3 / V3.2 / V4, default or YaRN.

Each rotated pair (x1, x2) at angle a becomes (x1 cos a - x2 sin a, x2 cos a + x1 sin a) (`_rotated`). The
layouts of the pairs:
- `apply_rope(interleaved=True)`, MLA's q_pe / k_pe (`rope_interleave`, the default): pairs (x0, x1),
  (x2, x3), ...; the result is written half-split, [rotated evens | rotated odds], as transformers'
  apply_rotary_pos_emb_interleave does. q and k get the same permutation, so q.k is unchanged.
- `apply_rope(interleaved=False)`, pairs (x_i, x_{i+d/2}) (rotate_half), layout kept; `apply_rope_prefix` does
  the same on the first dims of a longer vector (V3.2's indexer), from whole-vector tables.
- `rope_tail`, DeepSeek-V4: interleaved pairs on the last dims of a vector, layout kept, in float32.

YaRN touches two places: the frequencies and cos/sin (`rope_cos_sin`, times attention_scaling, which is 1.0
when mscale == mscale_all_dim as in DeepSeek's configs), and the softmax scale of MLA (`softmax_scale`:
times yarn_mscale(factor, mscale_all_dim)**2). The indexer's own scale does not get that factor.
"""

from __future__ import annotations

import math

import torch

from dsconv.kernels.device import cast

# YaRN paper defaults, used by transformers when a config leaves beta_fast / beta_slow out
YARN_BETA_FAST = 32
YARN_BETA_SLOW = 1
# transformers widens a zero-width ramp by this much to avoid dividing by zero
YARN_MIN_RAMP_WIDTH = 0.001


def rope_type(rope_scaling: dict | None) -> str:
    """"default" or "yarn"; hub configs write the key as "type", transformers 5 as "rope_type"."""
    if rope_scaling is None:
        return "default"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"rope_scaling type={kind!r} is not supported (only 'default' and 'yarn')")
    return kind


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    # YaRN's attention temperature; 1 when the context is not extended
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(dim: int, theta: float, rope_scaling: dict | None) -> tuple[torch.Tensor, float]:
    """inv_freq float32 [dim // 2] and the factor cos/sin are multiplied by (attention_scaling)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    if rope_type(rope_scaling) == "default":
        return 1.0 / (theta**exponents), 1.0
    p = rope_scaling
    if p.get("factor") is None or p.get("original_max_position_embeddings") is None:
        raise ValueError(f"YaRN rope_scaling needs factor and original_max_position_embeddings, got {p}")
    factor, original_len = p["factor"], p["original_max_position_embeddings"]
    wavelength_base = theta**exponents  # [dim // 2]
    extrapolated = 1.0 / wavelength_base  # the trained frequencies, kept for fast-rotating dims
    interpolated = 1.0 / (factor * wavelength_base)  # stretched by `factor`, for slow-rotating dims
    low, high = _yarn_correction_range(p, dim, theta, original_len)
    if low == high:
        high += YARN_MIN_RAMP_WIDTH
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp  # 1 below `low`, 0 above `high`, linear between
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, _yarn_attention_scaling(p)


def _yarn_correction_range(p: dict, dim: int, theta: float, original_len: int) -> tuple[float, float]:
    """The dims that complete beta_fast (low) and beta_slow (high) rotations over the original context."""
    def dim_for(rotations: float) -> float:
        return (dim * math.log(original_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_for(p.get("beta_fast") or YARN_BETA_FAST), dim_for(p.get("beta_slow") or YARN_BETA_SLOW)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_attention_scaling(p: dict) -> float:
    if p.get("attention_factor") is not None:
        return p["attention_factor"]
    factor, mscale, mscale_all_dim = p["factor"], p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def rope_cos_sin(config_like, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int -> cos, sin float32 [..., qk_rope_head_dim // 2], one angle per rotated pair.

    config_like: anything with the hub's names qk_rope_head_dim, rope_theta, rope_scaling (None or a dict).
    """
    inv_freq, attention_scaling = rope_inv_freq(config_like.qk_rope_head_dim, config_like.rope_theta,
                                                config_like.rope_scaling)
    return cos_sin_at(inv_freq, attention_scaling, positions)


def cos_sin_at(inv_freq: torch.Tensor, attention_scaling: float,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_cos_sin from rope_inv_freq's result, which a model computes once rather than at every step."""
    if inv_freq.device != positions.device:
        inv_freq = inv_freq.to(positions.device)
    angles = positions[..., None].to(torch.float32) * inv_freq
    if attention_scaling == 1.0:  # DeepSeek's YaRN configs (mscale == mscale_all_dim) and plain rope
        return angles.cos(), angles.sin()
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [..., d]; cos, sin broadcastable to [..., d // 2]. Computed in x's dtype, like transformers."""
    cos, sin = cast(cos, x.dtype), cast(sin, x.dtype)  # a model converts them once per step: no-ops then
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat(_rotated(x1, x2, cos, sin), dim=-1)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4: rotate the last 2 * cos.shape[-1] dims of x as interleaved pairs (x0, x1), (x2, x3), ...,
    keeping that layout (V4 reads the rotated key back as a value, so the layout reaches the output projection).
    cos, sin float32, broadcastable to [..., rope / 2]; computed in float32, returned in x's dtype."""
    rope_dim = 2 * cos.shape[-1]
    rope = x[..., -rope_dim:].float()
    rotated = torch.stack(_rotated(rope[..., 0::2], rope[..., 1::2], cos, sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def _rotated(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of every pair (x1, x2) by its angle."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def half_split_tables(cos: torch.Tensor, sin: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., r / 2] -> the [..., dim] tables `apply_rope_prefix` takes for vectors of `dim` whose first
    r dims rotate, the rest passing through: [cos, cos, 1 ...] and [-sin, sin, 0 ...]. A model makes them once
    per step."""
    rest = dim - 2 * cos.shape[-1]
    if rest < 0:
        raise ValueError(f"{2 * cos.shape[-1]} rotated dims do not fit in dim={dim}")
    ones = torch.ones(*cos.shape[:-1], rest, dtype=cos.dtype, device=cos.device)
    return torch.cat([cos, cos, ones], dim=-1), torch.cat([-sin, sin, torch.zeros_like(ones)], dim=-1)


def apply_rope_prefix(x: torch.Tensor, cos_full: torch.Tensor, sin_full: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Half-split rope on x's first rope_dim dims, the rest passed through (V3.2's indexer q and k), in x's dtype.

    On the rotated dims this is transformers' x * cos + rotate_half(x) * sin with the same roundings (its
    rotate_half negates x's second half; here the table's first half is -sin instead, and a product's sign flips
    exactly), so bit-equal; on the rest x * 1 + x * 0 = x exactly. Four calls for the whole vector, where
    splitting off the rotated part, rotating it (`apply_rope`) and concatenating the rest back takes about ten.
    cos_full, sin_full from `half_split_tables`, broadcastable to x, in x's dtype."""
    half = rope_dim // 2
    rotated = torch.cat([x[..., half:rope_dim], x[..., :half], x[..., rope_dim:]], dim=-1)
    return x * cos_full + rotated * sin_full


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """MLA's softmax scale: qk_head_dim ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2 under YaRN."""
    scale = qk_head_dim**-0.5
    if rope_type(rope_scaling) != "default" and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale
