"""Which weights become INT8. A recipe is a set of roles; everything else keeps a float dtype.

Each family defines its own recipes (the default first) in its module; `all-linears`, defined here, applies to
every family. Projections that engines fuse into one matmul (gate/up everywhere, and each family's own groups:
`Family.fused`) always share a type, MTP layers always stay float, and routers, embeddings and lm_head are
never INT8: vllm-ascend fuses those pairs per layer and refuses a quantized kv_b_proj, and the router/embed/head
are small next to their effect on accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsconv.family.tensors import Role, TensorSpec

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
