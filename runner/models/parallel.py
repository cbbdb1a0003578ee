"""The model's tensor-parallel layers, declared where the model is built (as DeepSeek's `inference/model.py` and
nano-vllm's `layers/linear.py` declare theirs): the vocabulary-parallel embedding (embedding TP), o_proj with its
output rows split (o_proj TP) and the parallel lm_head (lm_head TP); and attention TP's exchanges (the heads'
partial sums, the MoE's row shares) and context-parallel prefill's gather. Each takes its group's size from the rank's
process groups (models/dist.py), computes its local size from the model's config, checks it against the mapped
shard with a one-line error naming both, and runs its exchange.

Every member of a group enters the same exchanges in the same order, with zero rows if it has none; the sizes of
the embedding's and o_proj's exchanges are learnt once a step (`Dist.start_step`), lm_head's per call; both from the
step plan every rank holds, when the engine runs the step (`Dist.plan_step`), without an exchange.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsconv.comm.collectives import all_gather_cat, all_reduce_sum, all_to_all_variable, broadcast
from dsconv.errors import InputError
from dsconv.kernels.device import takes_npu_path
from dsconv.kernels.linear import quantize_activations
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.draw import Draw, merge, pick_full, slice_entries, width
from dsconv.runner.models.layers import Proj


def check_rows(name: str, shard_rows: int, total: int, size: int, group: str) -> None:
    """A split tensor's rows on this rank must be its share of the config's total."""
    if total % size or shard_rows != total // size:
        raise InputError(f"{name}: this rank's shard has {shard_rows} rows, but the config's {total} over {group} "
                         f"{size} give {total / size:g}: the shards were not written for this config and layout")


class VocabParallelEmbedding:
    """The embedding, its vocabulary rows split over the embedding-TP group (contiguous rows, in group-rank order),
    as vllm-ascend's embedding TP splits it: the group's token ids are gathered, each rank looks up the ids in its
    slice (zeros for the rest), and an all-to-all brings each rank its own rows' partial rows, summed. Exactly one
    partial is nonzero, so the sum is the row itself, bit for bit."""

    def __init__(self, table: torch.Tensor, vocab_size: int, dist: Dist):
        check_rows("the embedding", table.shape[0], vocab_size, dist.embed_tp, "embed-tp")
        self.table, self.dist = table, dist

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> their embedding rows [T, hidden] in the table's dtype."""
        table, dist = self.table, self.dist
        if dist.embed_tp == 1:
            return F.embedding(tokens, table)
        group, counts = dist.groups.embed_tp, dist.step_counts["embed_tp"]
        if not any(counts):
            return table.new_empty(0, table.shape[1])
        everyone = _to_every_member(dist, tokens, group, counts)  # [sum(counts)]: the group's ids, in rank order
        local = everyone - group.rank * table.shape[0]
        outside = (local < 0) | (local >= table.shape[0])
        partial = F.embedding(local.clamp(0, table.shape[0] - 1), table).masked_fill_(outside[:, None], 0)
        mine = _from_every_member(dist, partial, group, counts, tokens.shape[0])  # [size, T, hidden]
        return mine.sum(0)


class OutputSplitLinear:
    """o_proj with its output rows split over the o_proj-TP group, each rank holding [hidden / size, heads * v]:
    the group's inputs are gathered (INT8 with their per-token scales under W8A8, quantized once by their owner, as
    the whole layer would), each rank computes its output columns for all of them, and an all-to-all hands each rank
    its rows' columns. Every output is one rank's whole dot product: the same values as the unsplit layer
    (vllm-ascend splits the input columns instead and sums partial products in a reduce-scatter, moving fewer
    bytes)."""

    def __init__(self, proj: Proj, out_features: int, dist: Dist, name: str):
        check_rows(name, proj.weight.shape[0], out_features, dist.oproj_tp, "oproj-tp")
        self.proj, self.dist = proj, dist

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows x [T, heads * v] -> [T, hidden]."""
        proj, dist = self.proj, self.dist
        if dist.oproj_tp == 1:
            return proj(x)
        group, counts = dist.groups.oproj_tp, dist.step_counts["oproj_tp"]
        if not any(counts):
            return x.new_empty(0, proj.weight.shape[0] * group.size)
        if proj.scale is None:
            sliced = proj(_to_every_member(dist, x, group, counts))
        else:
            x_q, x_scale = quantize_activations(x)
            sliced = proj.quantized(_to_every_member(dist, x_q, group, counts),
                                    _to_every_member(dist, x_scale, group, counts), x.dtype)
        return _own_columns(_from_every_member(dist, sliced, group, counts, x.shape[0]))


EXACT_FLOAT32_IDS = 2**24  # every integer up to it is a float32


class ParallelLMHead:
    """lm_head with its vocabulary rows split over the lm_head-TP group: every rank's rows go to every member, each
    computes its vocabulary slice for all of them, and a second exchange hands each rank the slices of its own
    rows: the full logits of its rows. A step whose rows are all plain draws (models/draw.py: greedy, or sampled at
    a temperature over the whole vocabulary or its top k) takes each member's candidates instead: per row its best
    entry, or its k largest logits, 8 bytes each."""

    def __init__(self, head: Proj, vocab_size: int, dist: Dist):
        check_rows("lm_head", head.weight.shape[0], vocab_size, dist.tp, "tp")
        if vocab_size > EXACT_FLOAT32_IDS:
            raise InputError(f"vocab_size={vocab_size}: drawn steps send token ids as float32, exact only below "
                             f"{EXACT_FLOAT32_IDS}")
        self.head, self.dist = head, dist

    def __call__(self, h: torch.Tensor, draws: list[list[Draw]] | None = None) -> torch.Tensor:
        """h [rows, hidden] (this rank's own rows; DP ranks differ) -> [rows, vocab]; draws (per attention-DP index,
        one Draw per logits row, from the step plan every rank holds): -> [rows] the drawn tokens, and what returns to
        a row's rank is each member's candidates, not its slice. Every member of the group must pass the same."""
        head, dist = self.head, self.dist
        mine = None if draws is None else draws[dist.rank // dist.attn_tp]
        if mine is not None and len(mine) != h.shape[0]:
            raise ValueError(f"{len(mine)} draws for {h.shape[0]} logits rows")
        if dist.tp == 1:
            return head(h) if draws is None else pick_full(head(h), mine)
        group = dist.groups.tp
        counts = dist.row_counts(h.shape[0], group, "logit_rows")
        if not any(counts):  # no rank wants logits this step (e.g. every sequence is mid-prompt): all skip alike
            return h.new_empty(0, dtype=torch.long) if draws is not None else \
                h.new_empty(0, head.weight.shape[0] * group.size)
        sliced = head(_to_every_member(dist, h, group, counts))  # my vocabulary slice of everyone's rows
        if draws is not None:
            everyone = [d for member in group.ranks for d in draws[member // dist.attn_tp]]
            entries = width(everyone)
            if entries < sliced.shape[1]:  # candidates smaller than the slice: they travel instead
                return self._drawn(sliced, group, counts, everyone, entries, mine)
        logits = _own_columns(_from_every_member(dist, sliced, group, counts, h.shape[0]))
        return logits if draws is None else pick_full(logits, mine)

    def _drawn(self, sliced: torch.Tensor, group, counts: list[int], everyone: list[Draw], entries: int,
               mine: list[Draw]) -> torch.Tensor:
        """sliced [sum(counts), vocab / size], my slice of every member's rows -> [rows] this rank's rows' tokens.
        Each member sends, per row, its slice's candidates (draw.slice_entries: [entries, 2] float32, [value, id]);
        draw.merge picks each row's token from all members' candidates, as from the whole row."""
        if len(everyone) != sum(counts):
            raise ValueError(f"{len(everyone)} draws for the group's {sum(counts)} logits rows")
        candidates = slice_entries(sliced, group.rank * sliced.shape[1], everyone, entries)
        parts = _from_every_member(self.dist, candidates.view(sum(counts), -1), group, counts, len(mine))
        return merge(parts.view(group.size, len(mine), entries, 2), mine)


# The exchanges of the three layers above carry each member's real rows only, its count known to all (learnt once a
# step, or per call for lm_head), with no padding to the largest: one 2,400-token prompt on one attention-DP rank of
# 16 used to give every rank 16 x 2,400 padded rows, [38400, vocab / 16] logits (1.2 GB in float32) each, and ran
# 24 GB out of memory (docs/benchmarks.md, "Real dimensions").
def _to_every_member(dist: Dist, x: torch.Tensor, group, counts: list[int]) -> torch.Tensor:
    """This rank's rows x [rows, ...] to every member of `group` -> every member's rows [sum(counts), ...], in
    group-rank order."""
    with dist.timed():
        everyone, _ = all_to_all_variable(x.repeat(group.size, *[1] * (x.dim() - 1)), [x.shape[0]] * group.size,
                                          group, recv_counts=counts)
    return everyone


def _from_every_member(dist: Dist, sliced: torch.Tensor, group, counts: list[int], rows: int) -> torch.Tensor:
    """sliced [sum(counts), n]: this rank's result for every member's rows -> [size, rows, n], every member's
    result for this rank's rows, in group-rank order."""
    with dist.timed():
        mine, _ = all_to_all_variable(sliced.contiguous(), counts, group, recv_counts=[rows] * group.size)
    return mine.view(group.size, rows, sliced.shape[1])


def _own_columns(parts: torch.Tensor) -> torch.Tensor:
    """[size, rows, n / size], each member's output columns of this rank's rows -> [rows, n]."""
    return parts.transpose(0, 1).reshape(parts.shape[1], parts.shape[0] * parts.shape[2])


def attention_tp_sum(dist: Dist, x: torch.Tensor) -> torch.Tensor:
    """Heads split over attention TP: sum the partial o_proj outputs."""
    if dist.attn_tp == 1:
        return x
    with dist.timed():
        return all_reduce_sum(x.contiguous(), dist.groups.attn_tp)


def attention_tp_share(dist: Dist, x: torch.Tensor) -> torch.Tensor:
    """Under attention TP every rank of the group holds the same rows: each takes its share, rows
    [rank * per, (rank + 1) * per) with per = ceil(rows / size) (the last shares may be shorter or empty). No
    padding rows: an all-zero row would reach the MoE's quantizer, whose documented NPU formula (no floor
    on the scale) divides 0 by 0. On an accelerator an empty share is the group's first row instead, a
    throwaway that `attention_tp_unshare` drops, so that no kernel is handed a zero-size tensor."""
    if dist.attn_tp == 1:
        return x
    per = -(-x.shape[0] // dist.attn_tp)
    start = dist.attn_tp_rank * per
    if start >= x.shape[0] and x.shape[0] and takes_npu_path(x.device):
        return x[:1]
    return x[start:start + per]


def attention_tp_unshare(dist: Dist, share: torch.Tensor, rows: int) -> torch.Tensor:
    """The group's shares of `rows` rows gathered back into all of them: each member's share to every member in
    one all-to-all, the sizes known to all from `rows` (gloo's all-gather is a ring of size - 1 hops, an all-to-all
    one round of messages); a throwaway share (attention_tp_share) lands past `rows` and is dropped."""
    if dist.attn_tp == 1:
        return share
    per = -(-rows // dist.attn_tp)
    throwaway = 1 if rows and takes_npu_path(share.device) else 0  # an empty share's stand-in row
    counts = [min(per, rows - start) if start < rows else throwaway
              for start in range(0, per * dist.attn_tp, per)] if per else [0] * dist.attn_tp
    return _to_every_member(dist, share.contiguous(), dist.groups.attn_tp, counts)[:rows]


def cp_broadcast(dist: Dist, x: torch.Tensor, owner: int) -> torch.Tensor:
    """A context-parallel prefill's cached prefix rows: the owner's x (global rank `owner`) on every member."""
    if dist.cp == 1:
        return x
    with dist.timed():
        return broadcast(x.contiguous(), dist.groups.cp, owner)


def cp_gather(dist: Dist, x: torch.Tensor, most: int, order: torch.Tensor) -> torch.Tensor:
    """A context-parallel prefill's new rows: x [T, d], this member's positions -> [length, d], every
    member's rows in position order (`order`: each position's row among the gathered, member after member,
    each padded to `most`)."""
    if dist.cp == 1:
        return x.index_select(0, order)
    with dist.timed():
        everyone = all_gather_cat(F.pad(x, (0, 0, 0, most - x.shape[0])).contiguous(), dist.groups.cp, dim=0)
    return everyone.index_select(0, order)
