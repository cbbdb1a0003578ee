"""Which weights become INT8. A recipe is a set of roles; everything else keeps a float dtype.

Projections that are fused into one matmul (gate/up, V3's q_a/kv_a, and in dsrun V3.2's indexer wk/weights_proj
with those two) always share a type, MTP layers always stay float, and routers, embeddings and lm_head are never
INT8: vllm-ascend fuses those pairs per layer and refuses a quantized kv_b_proj, and the router/embed/head are
small next to their effect on accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsconv.convert.arch import Role, TensorSpec
from dsconv.errors import InputError

_EXPERTS = {Role.EXPERT_W1, Role.EXPERT_W2, Role.EXPERT_W3, Role.SHARED_W1, Role.SHARED_W2, Role.SHARED_W3}
# Not matmul weights, or too sensitive for INT8: never quantized by any recipe.
_NEVER = {Role.EMBED, Role.HEAD, Role.ROUTER, Role.ROUTER_BIAS, Role.ROUTER_TID2EID, Role.HC, Role.NORM,
          Role.ATTN_SINK, Role.COMPRESSOR_APE, Role.INDEXER_K_NORM_BIAS}
# Engines fuse these into one matmul, so one recipe must give both the same type.
FUSED_PAIRS = ((Role.EXPERT_W1, Role.EXPERT_W3), (Role.SHARED_W1, Role.SHARED_W3), (Role.DENSE_W1, Role.DENSE_W3))
# V3/V3.2 only (V4 has a single wkv and no kv_a): q_a and kv_a, which engines fuse, and V3.2's indexer wk and
# weights_proj, which read the same layer input and which dsrun runs in the same merged projection
MLA_FUSED = (Role.ATTN_Q_A, Role.ATTN_KV_A, Role.INDEXER_K, Role.INDEXER_WEIGHTS)


@dataclass(frozen=True)
class Recipe:
    name: str
    families: tuple[str, ...]  # model_types it is meant for
    int8_roles: frozenset[Role]
    help: str

    def is_int8(self, spec: TensorSpec) -> bool:
        return spec.is_linear and not spec.mtp and spec.role in self.int8_roles


RECIPES = {
    r.name: r
    for r in (
        # msModelSlim's DeepSeek-V3.2 recipes (lab_practice/deepseek_v3_2/deepseek_w8a8.yaml, deepseek_w4a8.yaml)
        # exclude "*wq_b", "*wk", "*weights_proj" from linear_quant: the whole Lightning indexer stays BF16 (its
        # output is a discrete top-k choice, which INT8 error flips). Their per-token W8A8 attention group
        # (deepseek_w4a8.yaml) also excludes q_a_proj, kv_a_proj_with_mqa and kv_b_proj; deepseek_w8a8.yaml
        # quantizes q_a/kv_a only with calibrated per-tensor activation scales, which this converter has not.
        Recipe("v3", ("deepseek_v3", "deepseek_v32"),
               frozenset({Role.ATTN_Q_B, Role.ATTN_O, Role.DENSE_W1, Role.DENSE_W2, Role.DENSE_W3} | _EXPERTS),
               "q_b_proj, o_proj, routed + shared experts, dense MLP (msModelSlim's per-token Ascend recipe); "
               "q_a/kv_a/kv_b, the V3.2 indexer (wq_b, wk, weights_proj), router, embed, head stay BF16"),
        Recipe("v4", ("deepseek_v4",),
               frozenset({Role.ATTN_Q_A, Role.ATTN_Q_B, Role.ATTN_KV, Role.INDEXER_Q_B} | _EXPERTS),
               "wq_a, wq_b, wkv, indexer wq_b, routed + shared experts (msModelSlim's recipe without "
               "smoothing); wo_a/wo_b, compressors, indexer weights_proj, router, embed, head, hc_* stay BF16"),
        Recipe("all-linears", ("deepseek_v3", "deepseek_v32", "deepseek_v4"),
               frozenset(set(Role) - _NEVER),
               "every projection, kv_b_proj and wo_a/wo_b included (vllm-ascend refuses a quantized "
               "kv_b_proj: for experiments); router, embed, head, norms and MTP stay float"),
    )
}
DEFAULT_RECIPE = {"deepseek_v3": "v3", "deepseek_v32": "v3", "deepseek_v4": "v4"}

for _recipe in RECIPES.values():
    _mla = any(f in ("deepseek_v3", "deepseek_v32") for f in _recipe.families)
    for _group in FUSED_PAIRS + ((MLA_FUSED,) if _mla else ()):
        if len({role in _recipe.int8_roles for role in _group}) != 1:
            raise AssertionError(f"recipe {_recipe.name} quantizes some of {[r.value for r in _group]} but not all; "
                                 "they are fused into one matmul")


def recipe_for(name: str | None, model_type: str) -> Recipe:
    name = name or DEFAULT_RECIPE[model_type]
    if name not in RECIPES:
        raise InputError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    if model_type not in recipe.families:
        raise InputError(f"recipe {name!r} is for {', '.join(recipe.families)}, not {model_type}")
    return recipe


def recipes_help() -> str:
    lines = [f"{r.name}: {r.help}." for r in RECIPES.values()]
    defaults = ", ".join(f"{fam} -> {rec}" for fam, rec in DEFAULT_RECIPE.items())
    return " ".join(lines) + f" Default by model: {defaults}."
