"""Which weights become INT8. A recipe is a set of roles; everything else keeps a float dtype.

Each family defines its own recipes (the default first) in its module; `all-linears`, defined here, applies to
every family. Projections that engines fuse into one matmul (gate/up everywhere, and each family's own groups:
`Family.fused`) always share a type, MTP layers always stay float, and routers, embeddings and lm_head are
never INT8: vllm-ascend fuses those pairs per layer and refuses a quantized kv_b_proj, and the router/embed/head
are small next to their effect on accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsconv.family.arch import Family, Role, TensorSpec, families
from dsconv.errors import InputError

EXPERTS = frozenset({Role.EXPERT_W1, Role.EXPERT_W2, Role.EXPERT_W3, Role.SHARED_W1, Role.SHARED_W2,
                     Role.SHARED_W3})
# Not matmul weights, or too sensitive for INT8: never quantized by any recipe.
_NEVER = {Role.EMBED, Role.HEAD, Role.ROUTER, Role.ROUTER_BIAS, Role.ROUTER_TID2EID, Role.HC, Role.NORM,
          Role.ATTN_SINK, Role.COMPRESSOR_APE, Role.INDEXER_K_NORM_BIAS}
# Engines fuse these into one matmul in every family; a family adds its own groups to `Family.fused`.
FUSED_PAIRS = ((Role.EXPERT_W1, Role.EXPERT_W3), (Role.SHARED_W1, Role.SHARED_W3), (Role.DENSE_W1, Role.DENSE_W3))


@dataclass(frozen=True)
class Recipe:
    name: str  # the --recipe value; unique over all families
    int8_roles: frozenset[Role]
    help: str

    def is_int8(self, spec: TensorSpec) -> bool:
        return spec.is_linear and not spec.mtp and spec.role in self.int8_roles


ALL_LINEARS = Recipe("all-linears", frozenset(set(Role) - _NEVER),
                     "every projection, kv_b_proj and wo_a/wo_b included (vllm-ascend refuses a quantized "
                     "kv_b_proj: for experiments); router, embed, head, norms and MTP stay float")


def accepted(family: Family) -> tuple[Recipe, ...]:
    return (*family.recipes, ALL_LINEARS)


def check_recipes(family: Family, registered: list[Family]) -> None:
    """Refuses a family whose recipes would split a fused group, or reuse another family's recipe name."""
    if not family.recipes:
        raise ValueError(f"family {family.name} defines no recipe (its first is the default)")
    for recipe in accepted(family):
        for group in family.fused:
            if len({role in recipe.int8_roles for role in group}) != 1:
                raise ValueError(f"recipe {recipe.name} quantizes some of {[r.value for r in group]} but not all; "
                                 f"{family.name} fuses them into one matmul")
    taken = {r.name: r for r in (ALL_LINEARS, *(r for other in registered for r in other.recipes))}
    for recipe in family.recipes:
        if recipe.name in taken and taken[recipe.name] is not recipe:
            raise ValueError(f"recipe name {recipe.name!r} of {family.name} is already taken by another recipe")


def recipe_for(name: str | None, family: Family) -> Recipe:
    by_name = {r.name: r for r in accepted(family)}
    if name is None:
        return family.recipes[0]
    if name in by_name:
        return by_name[name]
    owners = [f.name for f in families().values() if any(r.name == name for r in f.recipes)]
    if owners:
        raise InputError(f"recipe {name!r} is for {', '.join(owners)}, not {family.name}")
    raise InputError(f"unknown recipe {name!r}; choose from {', '.join(by_name)}")


def recipes_help() -> str:
    registered = families().values()
    recipes = {r.name: r for family in registered for r in family.recipes}
    lines = [f"{r.name}: {r.help}." for r in (*recipes.values(), ALL_LINEARS)]
    defaults = ", ".join(f"{family.name} -> {family.recipes[0].name}" for family in registered)
    return " ".join(lines) + f" Default by model: {defaults}."
