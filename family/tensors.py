"""What a checkpoint's tensors are, name by name: the role a tensor plays (`Role`, which recipes and the placement
table are keyed by), how the hub ships its values (`Encoding`), and the two together with its shape and place
(`TensorSpec`). family/arch.py's `Family` lists a checkpoint's TensorSpecs from its config.json."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(str, enum.Enum):
    """What a tensor does. Recipes and the placement table are keyed by role, never by name patterns."""

    EMBED = "embed"
    HEAD = "head"
    NORM = "norm"  # any RMSNorm / LayerNorm weight
    # MLA (V3 / V3.2) and V4 attention linears; the V3 and V4 names map onto the same roles where they match
    ATTN_Q_A = "attn.wq_a"  # q_a_proj / wq_a
    ATTN_Q_B = "attn.wq_b"  # q_b_proj / wq_b
    ATTN_KV_A = "attn.wkv_a"  # kv_a_proj_with_mqa
    ATTN_KV_B = "attn.wkv_b"  # kv_b_proj
    ATTN_KV = "attn.wkv"  # V4 single-KV-head projection
    ATTN_O = "attn.wo"  # o_proj
    ATTN_O_A = "attn.wo_a"  # V4 grouped output projection, per-group part
    ATTN_O_B = "attn.wo_b"  # V4 grouped output projection, final part
    ATTN_SINK = "attn.sink"  # V4 attention sinks (a vector)
    # Lightning indexer (V3.2 on every layer; V4 on CSA layers)
    INDEXER_Q_B = "indexer.wq_b"
    INDEXER_K = "indexer.wk"
    INDEXER_WEIGHTS = "indexer.weights_proj"
    INDEXER_K_NORM_BIAS = "indexer.k_norm.bias"
    # V4 compressors (main attention and the indexer's own)
    COMPRESSOR_KV = "compressor.wkv"
    COMPRESSOR_GATE = "compressor.wgate"
    COMPRESSOR_APE = "compressor.ape"
    # MoE
    ROUTER = "router"  # gate.weight [n_routed_experts, hidden]
    ROUTER_BIAS = "router.bias"  # e_score_correction_bias / gate.bias
    ROUTER_TID2EID = "router.tid2eid"  # V4 hash routing table [vocab, topk]
    EXPERT_W1 = "expert.w1"  # routed expert gate_proj / w1
    EXPERT_W2 = "expert.w2"  # routed expert down_proj / w2
    EXPERT_W3 = "expert.w3"  # routed expert up_proj / w3
    SHARED_W1 = "shared.w1"
    SHARED_W2 = "shared.w2"
    SHARED_W3 = "shared.w3"
    DENSE_W1 = "dense.w1"  # V3 dense-MLP layers
    DENSE_W2 = "dense.w2"
    DENSE_W3 = "dense.w3"
    # V4 hyper-connections (hc_attn_*, hc_ffn_*, hc_head_*)
    HC = "hc"
    # MTP-only linears (V3 eh_proj, V4 e_proj / h_proj)
    MTP_PROJ = "mtp.proj"


class Encoding(str, enum.Enum):
    """How the hub ships a tensor's values (what the tiny-checkpoint maker writes)."""

    BF16 = "bf16"
    F32 = "f32"
    I32 = "i32"  # integer tables
    I64 = "i64"  # V4 ships tid2eid as int64
    FP8 = "fp8"  # float8_e4m3fn + 128x128 block scale
    FP4 = "fp4"  # packed e2m1 + e8m0 scale per 32 inputs


@dataclass(frozen=True)
class TensorSpec:
    name: str  # exactly as stored in the hub checkpoint
    shape: tuple[int, ...]  # logical (decoded) shape: FP4 weights report [out, in], not [out, in/2]
    role: Role
    encoding: Encoding  # as the hub ships it
    layer: int | None = None  # decoder layer index; MTP layers included
    expert: int | None = None  # routed expert index
    mtp: bool = False  # part of a multi-token-prediction layer

    @property
    def is_linear(self) -> bool:
        not_linear = (Role.EMBED, Role.ROUTER_TID2EID, Role.HC, Role.COMPRESSOR_APE)  # 2-D tables, not weights
        return len(self.shape) == 2 and self.role not in not_linear
