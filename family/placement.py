"""The one placement table: where every tensor of every supported family lives on the ranks.

The sharder writes by it, `dsconv plan` sums sizes by it, `dsconv verify` checks coverage by it, and the
runner imports it to know what each rank must find. Rules are keyed by role (family.arch.Role), so a
tensor's name never decides its placement; which attention roles split with attention TP, and on which dim, is
the one thing a family adds (`Family.attention_tp`).

Modes: replicated (written once under `common/`, read by every rank); expert (a routed expert, owned by
one EP rank, or with redundant experts held by one EP rank per replica, family/expert_map.py: `ep-XXXXX/`); vocab
(lm_head rows split over the lm_head TP group: `tp-XXXXX/`); head_split (attention TP over heads, on dim 0 or
dim 1: `attn-tp-XXXXX/`); oproj_split (o_proj's output rows over the o_proj TP group: `oproj-tp-XXXXX/`);
embed_split (the embedding's vocabulary rows over the embedding TP group: `embed-tp-XXXXX/`, the MTP layer's
embedding too). A directory per group index, not per rank,
so a shard shared by several ranks (attention DP replicas, EP or TP groups smaller than the world) is
written once and listed with all its readers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dsconv.family.arch import Family, Role, TensorSpec
from dsconv.errors import InputError
from dsconv.family.expert_map import ExpertMap, experts_prefix
from dsconv.family.layout import Layout

COMMON_DIR = "common"


class Mode(str, enum.Enum):
    REPLICATED = "replicated"
    EXPERT = "expert"
    VOCAB = "vocab"
    HEAD_SPLIT = "head_split"
    OPROJ_SPLIT = "oproj_split"
    EMBED_SPLIT = "embed_split"


# A split mode -> the layout group it splits over (family.layout.Layout.groups()) and its directory prefix
SPLIT_GROUPS = {Mode.VOCAB.value: "tp", Mode.HEAD_SPLIT.value: "attn_tp", Mode.OPROJ_SPLIT.value: "oproj_tp",
                Mode.EMBED_SPLIT.value: "embed_tp"}
SPLIT_DIRS = {Mode.VOCAB: "tp", Mode.HEAD_SPLIT: "attn-tp", Mode.OPROJ_SPLIT: "oproj-tp", Mode.EMBED_SPLIT: "embed-tp"}


@dataclass(frozen=True)
class Rule:
    mode: Mode
    dim: int | None = None  # the split dimension for VOCAB / HEAD_SPLIT


_EXPERT = Rule(Mode.EXPERT)
_REPLICATED = Rule(Mode.REPLICATED)

# Roles whose placement does not depend on the family.
COMMON_RULES: dict[Role, Rule] = {
    Role.EXPERT_W1: _EXPERT,
    Role.EXPERT_W2: _EXPERT,
    Role.EXPERT_W3: _EXPERT,
    Role.HEAD: Rule(Mode.VOCAB, dim=0),  # [vocab, hidden]: contiguous vocabulary rows per lm_head TP rank
}


def rule_for(spec: TensorSpec, family: Family, layout: Layout) -> Rule:
    if spec.role in COMMON_RULES:
        return COMMON_RULES[spec.role]
    if layout.attn_tp > 1 and spec.role in family.attention_tp:
        return Rule(Mode.HEAD_SPLIT, family.attention_tp[spec.role])
    if layout.oproj_tp > 1 and spec.role is Role.ATTN_O:
        return Rule(Mode.OPROJ_SPLIT, dim=0)  # [hidden, heads * v]: output rows, each computed whole on one rank
    if layout.embed_tp > 1 and spec.role is Role.EMBED:
        return Rule(Mode.EMBED_SPLIT, dim=0)  # [vocab, hidden]: contiguous vocabulary rows
    return _REPLICATED


def check_layout(family: Family, arch: object, layout: Layout, redundant: int = 0) -> None:
    """Refuse a layout the model's shapes cannot split evenly, naming the numbers. redundant: the redundant experts
    (family/expert_map.py), which the EP ranks share with the logical ones."""
    experts, vocab = arch.n_routed_experts, arch.vocab_size
    if (experts + redundant) % layout.ep:
        raise InputError(f"n_routed_experts={experts}" + (f" + {redundant} redundant" if redundant else "")
                         + f" is not divisible by ep={layout.ep}")
    if vocab % layout.tp:
        raise InputError(f"vocab_size={vocab} is not divisible by tp={layout.tp}")
    heads = arch.num_attention_heads
    if heads % layout.attn_tp:
        raise InputError(f"num_attention_heads={heads} is not divisible by attn-tp={layout.attn_tp}")
    if family.check_attention_tp is not None:
        family.check_attention_tp(arch, layout.attn_tp)
    if layout.oproj_tp > 1:
        if layout.attn_tp > 1:
            raise InputError(f"oproj-tp={layout.oproj_tp} splits o_proj over attention-DP ranks, which needs "
                             f"attn-tp 1 (attn-tp={layout.attn_tp} already splits o_proj by heads)")
        if Role.ATTN_O not in family.attention_tp:
            raise InputError(f"oproj-tp={layout.oproj_tp}: {family.name} has no o_proj to split (its output "
                             f"projection is grouped); use --oproj-tp 1")
        if arch.hidden_size % layout.oproj_tp:
            raise InputError(f"hidden_size={arch.hidden_size} is not divisible by oproj-tp={layout.oproj_tp}")
    if vocab % layout.embed_tp:
        raise InputError(f"vocab_size={vocab} is not divisible by embed-tp={layout.embed_tp}")
    if layout.embed_tp > 1 and getattr(arch, "tie_word_embeddings", False):
        raise InputError(f"embed-tp={layout.embed_tp}: the embedding is tied to lm_head, which lm_head TP splits "
                         f"its own way; use --embed-tp 1")


@dataclass(frozen=True)
class Placement:
    directory: str  # under the shard root
    ranks: tuple[int, ...]  # every rank that maps this shard
    mode: Mode
    split: tuple[int, int, int] | None  # (dim, start, stop) of the source tensor; None = whole


def expert_owner(expert: int, n_routed_experts: int, ep: int) -> int:
    """The EP rank that owns a routed expert: EP rank k owns the contiguous block [k * E / ep, (k + 1) * E / ep)."""
    return expert // (n_routed_experts // ep)


def local_experts(n_routed_experts: int, ep: int, ep_rank: int) -> range:
    """The routed experts EP rank `ep_rank` owns, in order (the inverse of expert_owner)."""
    per_rank = n_routed_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def _split(spec: TensorSpec, dim: int, parts: int, index: int) -> tuple[int, int, int]:
    size = spec.shape[dim]
    if size % parts:
        raise InputError(f"{spec.name}: dim {dim} of size {size} does not split into {parts} equal parts")
    step = size // parts
    return (dim, index * step, (index + 1) * step)


def place(spec: TensorSpec, family: Family, arch: object, layout: Layout,
          experts: ExpertMap | None = None) -> list[Placement]:
    """Every shard of a tensor: one for replicated tensors, one per group index when split, one per replica for a
    routed expert (its owner by the blocks of expert_owner, or every EP rank the expert map puts a replica on)."""
    rule = rule_for(spec, family, layout)
    ranks = range(layout.world_size)
    if rule.mode is Mode.REPLICATED:
        return [Placement(COMMON_DIR, tuple(ranks), rule.mode, None)]
    if rule.mode is Mode.EXPERT:
        owners = [expert_owner(spec.expert, arch.n_routed_experts, layout.ep)] if experts is None else \
            experts.holders(experts_prefix(spec.name), spec.expert)
        return [Placement(f"ep-{owner:05d}", tuple(r for r in ranks if layout.ep_rank(r) == owner), rule.mode, None)
                for owner in owners]
    group, prefix = SPLIT_GROUPS[rule.mode.value], SPLIT_DIRS[rule.mode]
    parts = getattr(layout, group)
    return [Placement(f"{prefix}-{k:05d}", tuple(r for r in ranks if layout.group_rank(group, r) == k), rule.mode,
                      _split(spec, rule.dim, parts, k)) for k in range(parts)]


def place_companion(weight: Placement, layout: Layout) -> Placement:
    """A per-channel scale or offset [out, 1] follows its weight's rows: split with a row split, whole with
    a column split (and then identical on every rank, so replicated once; callers dedupe the copies)."""
    if weight.split is None or weight.split[0] == 0:
        return weight
    return Placement(COMMON_DIR, tuple(range(layout.world_size)), Mode.REPLICATED, None)


_EXPERT_W13 = (Role.EXPERT_W1, Role.EXPERT_W3)  # an expert's gate rows, then its up rows


def stack_of(spec: TensorSpec, family: Family) -> tuple[tuple, tuple] | None:
    """(stack, position) of a tensor dsrun stacks with others into one tensor at load; None for one taken alone.
    - A layer's routed experts: each expert's gate then up projection (w13 [experts, 2 * inter, hidden]), and
      their down projections (w2), each in expert order.
    - A layer's fused group (`Family.fused`: gate/up of dense MLPs and shared experts; V3's q_a, kv_a and V3.2's
      indexer wk and weights_proj), in the group's order.
    The sharder writes a stack's tensors of one directory back to back in position order (an INT8 stack's scales
    likewise), so a rank maps the stack as one view of its shard file instead of copying it
    (runner.models.weights.RankWeights.take_stacked): 16 local ranks then share a replicated stack's pages."""
    if spec.role in _EXPERT_W13:
        return ("experts w13", spec.layer, spec.mtp), (spec.expert, _EXPERT_W13.index(spec.role))
    if spec.role is Role.EXPERT_W2:
        return ("experts w2", spec.layer, spec.mtp), (spec.expert,)
    for group in family.fused:
        if spec.role in group:
            return ("fused", group, spec.layer, spec.mtp), (group.index(spec.role),)
    return None


CATEGORIES = ("experts", "attention", "embed", "lm_head", "other")
_ATTENTION_PREFIXES = ("attn.", "indexer.", "compressor.")


def category(spec: TensorSpec) -> str:
    """The bucket a tensor's bytes are reported under by `plan` and `--dry-run`."""
    if spec.role in (Role.EXPERT_W1, Role.EXPERT_W2, Role.EXPERT_W3):
        return "experts"
    if spec.role is Role.EMBED:
        return "embed"
    if spec.role is Role.HEAD:
        return "lm_head"
    if spec.role.value.startswith(_ATTENTION_PREFIXES):
        return "attention"
    return "other"


def sliced_shape(shape: tuple[int, ...], split: tuple[int, int, int] | None) -> tuple[int, ...]:
    if split is None:
        return shape
    dim, start, stop = split
    return (*shape[:dim], stop - start, *shape[dim + 1:])
