"""The layers both model families are built from, each once: projections (plain, merged, grouped), RMSNorm in its
three orders, rotary tables, the gated MLP and a rank's routed experts.

The math lives in kernels/ (one function per primitive, each with a torch reference); a layer takes its weights
by name from the rank's shards, holds them in the form its kernel takes (made once, at load) and calls it.
Float weights are used in the compute dtype: a BF16 run keeps the mapped shard as is, stacks included (the
sharder writes what a layer stacks back to back), so the ranks on one machine share the pages of every replicated
weight (kernels.linear.FloatWeight says how a BF16 weight is multiplied on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsconv.errors import InputError
from dsconv.kernels.device import cast
from dsconv.kernels.linear import FloatWeight, w8a8_linear, w8a8_linear_quantized
from dsconv.kernels.moe import ExpertWeights, grouped_mlp, swiglu, token_mlp
from dsconv.kernels.norm import UNWEIGHTED, WEIGHT_AFTER_CAST, rms_norm
from dsconv.kernels.rope import cos_sin_at, half_split_tables, rope_inv_freq
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.eplb import ExpertRouting, move_experts
from dsconv.runner.models.weights import RankWeights
from dsconv.family.placement import local_experts


class Proj:
    """A projection whose weight is BF16 (multiplied as kernels.linear.FloatWeight says), or INT8 with a
    per-output-channel scale (W8A8)."""

    def __init__(self, weights: RankWeights, name: str, dtype: torch.dtype):
        weight = weights.take(f"{name}.weight")
        scale = weights.take_optional(f"{name}.weight_scale")
        self._set(weight.to(dtype) if scale is None else weight, scale)

    def _set(self, weight: torch.Tensor, scale: torch.Tensor | None) -> None:
        self.weight, self.scale = weight, scale
        self.projection = FloatWeight.of(weight) if scale is None else None

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor | None) -> "Proj":
        """A projection over tensors already in their final form (a float weight in the compute dtype)."""
        proj = cls.__new__(cls)
        proj._set(weight, scale)
        return proj

    @classmethod
    def merged(cls, weights: RankWeights, names: list[str], dtype: torch.dtype) -> "Proj":
        """Projections of the same input as one, their output rows stacked in `names` order: one GEMM (and
        under W8A8 one activation quantization) instead of several, as vLLM merges gate/up and q_a/kv_a. The
        stacked weight is a view of the shard (`_take_stacked`); the recipes give each such group one type
        (family.recipes)."""
        weight, scale = _take_stacked(weights, [names], dtype)
        return cls.of(weight[0], None if scale is None else scale[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return self.projection(x)
        return w8a8_linear(x, self.weight, self.scale, out_dtype=x.dtype)

    def quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The INT8 projection of activations quantized by the sender."""
        return w8a8_linear_quantized(x_q, x_scale, self.weight, self.scale, dtype)

    def float_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.scale is None:
            return self.weight.to(dtype)
        return (self.weight.to(torch.float32) * self.scale).to(dtype)


class GroupedProj:
    """V4's wo_a: weight [groups * rank, in / groups]; group g's rank rows project only group g's input slice."""

    def __init__(self, weights: RankWeights, name: str, groups: int, dtype: torch.dtype):
        proj = Proj(weights, name, dtype)
        scales = [None] * groups if proj.scale is None else proj.scale.chunk(groups)
        self.groups = [Proj.of(weight, scale) for weight, scale in zip(proj.weight.chunk(groups), scales)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in / groups] -> [T, groups, rank]."""
        return torch.stack([proj(x[:, g]) for g, proj in enumerate(self.groups)], dim=1)


def _take_stacked(weights: RankWeights, names: list[list[str]],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For each entry of `names`, those projections' output rows concatenated; the entries stacked -> weight
    [len(names), rows, in] (float in dtype, or INT8) and scale [len(names), rows, 1] (None for float).

    A view of the shard where the sharder wrote the stack back to back (RankWeights.take_stacked), so that the
    local ranks share its pages; otherwise one copy, written in place one source tensor at a time (shards written
    before the sharder ordered stacks, or float weights converted to another compute dtype)."""
    weight_names = [[f"{name}.weight" for name in group] for group in names]
    scale_names = [[f"{name}.weight_scale" for name in group] for group in names]
    first = weights.tensors.get(weight_names[0][0])
    scaled = {name in weights.tensors for group in scale_names for name in group}  # {True}: INT8, {False}: float
    int8 = scaled == {True}
    if first is not None and len(scaled) == 1 and (int8 or first.dtype == dtype):
        views = weights.take_stacked(weight_names, scale_names if int8 else None)
        if views is not None:
            return views
    stacked = scales = None
    for i, group in enumerate(names):
        parts = [(weights.take(f"{name}.weight"), weights.take_optional(f"{name}.weight_scale")) for name in group]
        kinds = {scale is not None for _, scale in parts} | ({scales is not None} if i else set())
        if len(kinds) != 1:
            raise InputError(f"{group} mix INT8 and float weights; convert with a recipe that keeps them alike")
        if stacked is None:
            first, int8 = parts[0][0], parts[0][1] is not None
            rows = sum(weight.shape[0] for weight, _ in parts)
            stacked = torch.empty(len(names), rows, first.shape[1], dtype=first.dtype if int8 else dtype,
                                  device=first.device)
            scales = torch.empty(len(names), rows, 1, dtype=torch.float32, device=first.device) if int8 else None
        start = 0
        for weight, scale in parts:
            stacked[i, start:start + weight.shape[0]].copy_(weight)
            if scale is not None:
                scales[i, start:start + weight.shape[0]].copy_(scale)
            start += weight.shape[0]
    return stacked, scales


class RMSNorm:
    """RMSNorm (kernels.norm) in the order the family's reference rounds in, its weight kept in `dtype`: V3's in
    the compute dtype, multiplied after the cast back (WEIGHT_AFTER_CAST); V4's in float32, multiplied before
    it (WEIGHT_IN_FLOAT32)."""

    def __init__(self, weights: RankWeights, name: str, eps: float, dtype: torch.dtype,
                 order: str = WEIGHT_AFTER_CAST):
        self.weight, self.eps, self.order = cast(weights.take(name), dtype), eps, order

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.order)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """V4's norm without a weight (its q heads and its hyper-connection mixes)."""
    return rms_norm(x, None, eps, UNWEIGHTED)


class Rope:
    """cos, sin float32 [..., dim // 2] at integer positions: plain or YaRN (kernels.rope), frequencies made once."""

    def __init__(self, dim: int, theta: float, rope_scaling: dict | None, device: torch.device):
        inv_freq, self.attention_scaling = rope_inv_freq(dim, theta, rope_scaling)
        self.inv_freq = inv_freq.to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin_at(self.inv_freq, self.attention_scaling, positions)


@dataclass(frozen=True)
class StepRope:
    """One V3 / V3.2 step's rotary tables, made once for every layer, in the compute dtype (as transformers
    multiplies)."""
    cos: torch.Tensor  # [T, 1, rope / 2], broadcast over heads: MLA's interleaved q_pe / k_pe (kernels.rope.apply_rope)
    sin: torch.Tensor
    index_cos: torch.Tensor | None = None  # [T, 1, index_head_dim]: V3.2's indexer (kernels.rope.apply_rope_prefix)
    index_sin: torch.Tensor | None = None

    @classmethod
    def at(cls, rope: Rope, positions: torch.Tensor, dtype: torch.dtype,
           index_head_dim: int | None = None) -> "StepRope":
        cos, sin = (t.to(dtype)[:, None] for t in rope(positions))
        if index_head_dim is None:
            return cls(cos, sin)
        return cls(cos, sin, *half_split_tables(cos, sin, index_head_dim))


class GatedMLP:
    """down(swiglu(gate_up(x))) with the gate and up projections merged into one, gate rows first (vLLM merges
    them the same way): dense MLPs and shared experts. limit: V4's swiglu_limit."""

    def __init__(self, weights: RankWeights, names: tuple[str, str, str], dtype: torch.dtype,
                 limit: float | None = None):
        gate, up, down = names
        self.gate_up = Proj.merged(weights, [gate, up], dtype)  # [2 * inter, hidden]
        self.down = Proj(weights, down, dtype)
        self.limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate_up(x), limit=self.limit))


class RoutedExperts:
    """This rank's routed experts, the placement table's `local_experts` for its EP rank (or, with redundant
    experts, its slots of the manifest's expert map, routed to by `routing`: models/eplb.py), run by the grouped
    kernel (kernels.moe.grouped_mlp). Their weights are stacked (views of the shard, `_take_stacked`): w13
    [E, 2 * inter, hidden] with each expert's gate rows, then its up rows (as GatedMLP merges them), w2 [E, hidden,
    inter]; INT8 with [E, n, 1] scales under W8A8. names: an expert's gate, up and down projections under
    `{prefix}.{expert}.`. Rows grouped by expert go through `__call__`, a lone token's k experts through
    `token` (the same kernel, nothing to group)."""

    def __init__(self, weights: RankWeights, prefix: str, names: tuple[str, str, str], n_routed_experts: int,
                 dist: Dist, dtype: torch.dtype, limit: float | None = None):
        self.prefix, self.experts, self.limit = prefix, n_routed_experts, limit
        self.kernels = dist.kernels
        experts_map = weights.experts
        if experts_map is None:  # the placement table's blocks
            self.ids = local_experts(n_routed_experts, dist.ep, dist.ep_rank)
            self.n_physical, self.routing = n_routed_experts, None
        else:  # physical experts (family/expert_map.py): this rank's slots, and the routing to them (models/eplb.py)
            self.ids = experts_map.held(prefix, dist.ep_rank)
            self.n_physical = experts_map.slots
            self.routing = ExpertRouting(experts_map.layers[prefix], n_routed_experts, weights.device)
        dist.experts.append(self)
        gate, up, down = names
        w13, w13_scale = _take_stacked(weights, [[f"{prefix}.{e}.{gate}", f"{prefix}.{e}.{up}"] for e in self.ids],
                                       dtype)
        w2, w2_scale = _take_stacked(weights, [[f"{prefix}.{e}.{down}"] for e in self.ids], dtype)
        if (w13_scale is None) != (w2_scale is None):
            raise InputError(f"{prefix}: the experts' {gate}/{up} and {down} mix INT8 and float weights")
        self.weights = ExpertWeights(w13, w2, w13_scale, w2_scale)
        self.int8 = self.weights.int8

    def __call__(self, x: torch.Tensor, counts: torch.Tensor | list[int], x_scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [N, hidden] rows grouped by local expert, counts[i] rows for local expert i -> [N, hidden]: float
        rows in their dtype, INT8 rows quantized by their sender with per-token scales x_scale [N, 1] in
        out_dtype."""
        if self.kernels.on and self.int8:  # PyPTO's W8A8 grouped MLP (kernels/pypto/experts.py)
            from dsconv.kernels.pypto.experts import grouped_w8a8_mlp

            counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
            return grouped_w8a8_mlp(x, counts, self.weights, x_scale, out_dtype, self.limit)
        return grouped_mlp(x, counts, self.weights, x_scale, out_dtype, self.limit)

    def counted(self) -> None:
        """Counts the load from now on (EPLB, --expert-load-record), routing through the identity where there are
        no replicas."""
        if self.routing is None:
            device = (self.weights.w13 if self.weights.npu is None else self.weights.npu.w13).device
            self.routing = ExpertRouting(tuple(range(self.experts)), self.experts, device)
        self.routing.counting = True

    def move(self, physical: tuple[int, ...], dist: Dist) -> None:
        """Takes a new placement: this rank's experts exchanged (models/eplb.move_experts), then the routing."""
        self.weights = move_experts(self.weights, self.routing.physical, physical, dist)
        per_rank = len(physical) // dist.ep
        self.ids = physical[dist.ep_rank * per_rank:(dist.ep_rank + 1) * per_rank]
        self.routing.set(physical)

    def token(self, x: torch.Tensor, local_ids: list[int], x_scale: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """One token [1, hidden] through each of its local experts -> [k, hidden], in local_ids' order."""
        return token_mlp(x, local_ids, self.weights, x_scale, out_dtype, self.limit)
