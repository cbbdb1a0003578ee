"""The parallel layout over one set of ranks: module-level modes, not a grid.

Attention runs attention-TP inside consecutive blocks of `attn_tp` ranks (attention DP = world / attn_tp
across those blocks), MoE experts run EP inside consecutive blocks of `ep` ranks, and lm_head runs
vocabulary TP inside consecutive blocks of `tp` ranks. V4-Flash: attn_tp 1, ep 16, tp 16 on 16 ranks.
V3.2: attn_tp 8 (tp groups {0..7}, {8..15}; dp groups {0,8}, {1,9}, ...), ep 16, tp 16.

Two fine-grained TP groups (vllm-ascend's oproj_tensor_parallel_size and embedding_tensor_parallel_size), also
consecutive blocks of ranks: `oproj_tp` splits o_proj's output rows over attention-DP ranks (attention DP only,
attn_tp 1), `embed_tp` the embedding's vocabulary rows. 1 keeps the weight whole on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsconv.errors import InputError

DEFAULT_WORLD_SIZE = 16
# Tokens one attention-DP rank feeds per step (dsrun's --max-num-batched-tokens; dsconv plan sizes the worst-case
# MoE exchange of such a step)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096


@dataclass(frozen=True)
class Layout:
    world_size: int = DEFAULT_WORLD_SIZE
    ep: int = DEFAULT_WORLD_SIZE  # MoE expert-parallel size
    tp: int = DEFAULT_WORLD_SIZE  # lm_head vocabulary-parallel size
    attn_tp: int = 1  # attention tensor-parallel size; 1 = attention replicated (DP = world)
    oproj_tp: int = 1  # o_proj split over this many attention-DP ranks (output rows)
    embed_tp: int = 1  # embedding vocabulary split over this many ranks

    def __post_init__(self):
        if self.world_size < 1:
            raise InputError(f"world_size={self.world_size} must be at least 1")
        for name in ("ep", "tp", "attn_tp", "oproj_tp", "embed_tp"):
            size = getattr(self, name)
            if size < 1 or self.world_size % size:
                raise InputError(f"{name.replace('_', '-')}={size} must divide world size {self.world_size}")

    @classmethod
    def sized(cls, world_size: int | None, ep: int, tp: int, attn_tp: int = 1, oproj_tp: int = 1,
              embed_tp: int = 1) -> "Layout":
        """The layout the CLIs' flags ask for: world_size None is the largest of the sizes (`--ep 1 --tp 1` is one
        rank; the default sizes give 16)."""
        world = max(ep, tp, attn_tp, oproj_tp, embed_tp) if world_size is None else world_size
        return cls(world, ep, tp, attn_tp, oproj_tp, embed_tp)

    @property
    def dp(self) -> int:
        return self.world_size // self.attn_tp

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def attn_tp_rank(self, rank: int) -> int:
        return rank % self.attn_tp

    def group_rank(self, group: str, rank: int) -> int:
        """A rank's index in its group of `group` ("tp", "attn_tp", "oproj_tp", "embed_tp"): blocks of consecutive
        ranks."""
        return rank % getattr(self, group)

    @classmethod
    def from_json(cls, layout: dict) -> "Layout":
        """The layout of a manifest's `layout` object (its sizes; dp and groups follow from them)."""
        return cls(world_size=layout["world_size"], ep=layout["ep"], tp=layout["tp"], attn_tp=layout["attn_tp"],
                   oproj_tp=layout["oproj_tp"], embed_tp=layout["embed_tp"])

    def groups(self) -> dict[str, list[list[int]]]:
        """Rank membership of every process group, as torch.distributed.new_group takes it."""
        ranks = range(self.world_size)

        def blocks(size: int) -> list[list[int]]:
            return [list(ranks[i:i + size]) for i in range(0, self.world_size, size)]

        return {
            "attn_tp": blocks(self.attn_tp),
            "attn_dp": [list(ranks[i::self.attn_tp]) for i in range(self.attn_tp)],
            "ep": blocks(self.ep),
            "tp": blocks(self.tp),
            "oproj_tp": blocks(self.oproj_tp),
            "embed_tp": blocks(self.embed_tp),
        }

    def to_json(self) -> dict:
        return {**asdict(self), "dp": self.dp, "groups": self.groups()}
