"""The model's tensor-parallel layers, declared where the model is built (as DeepSeek's `inference/model.py` and
nano-vllm's `layers/linear.py` declare theirs): the vocabulary-parallel embedding (embedding TP), o_proj with its
output rows split (o_proj TP) and the parallel lm_head (lm_head TP); and attention TP's exchanges (the heads'
partial sums, the MoE's row shares) and context-parallel prefill's gather. Each takes its group's size from the rank's
process groups (models/dist.py), computes its local size from the model's config, checks it against the mapped
shard with a one-line error naming both, and runs its exchange.

Every member of a group enters the same exchanges in the same order, with zero rows if it has none; the sizes of
the embedding's and o_proj's exchanges are learnt once a step (`Dist.start_step`), lm_head's per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsconv.comm.collectives import all_gather_cat, all_reduce_sum, all_to_all_variable
from dsconv.errors import InputError
from dsconv.kernels.device import takes_npu_path
from dsconv.kernels.linear import quantize_activations
from dsconv.runner.models.dist import Dist
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
        group, most = dist.groups.embed_tp, dist.step_most["embed_tp"]
        if most == 0:
            return table.new_empty(0, table.shape[1])
        with dist.timed():
            everyone = all_gather_cat(F.pad(tokens, (0, most - tokens.shape[0])), group, dim=0)  # [size * most]
        local = everyone - group.rank * table.shape[0]
        outside = (local < 0) | (local >= table.shape[0])
        partial = F.embedding(local.clamp(0, table.shape[0] - 1), table).masked_fill_(outside[:, None], 0)
        with dist.timed():
            # every member sends `most` rows to each, so the counts need no exchange (nor a host sync)
            mine, _ = all_to_all_variable(partial, [most] * group.size, group, recv_counts=[most] * group.size)
        return mine.view(group.size, most, -1).sum(0)[:tokens.shape[0]]


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
        group, most = dist.groups.oproj_tp, dist.step_most["oproj_tp"]
        if most == 0:
            return x.new_empty(0, proj.weight.shape[0] * group.size)
        pad = most - x.shape[0]
        with dist.timed():
            if proj.scale is None:
                sliced_in = (all_gather_cat(F.pad(x, (0, 0, 0, pad)), group, dim=0),)
            else:
                x_q, x_scale = quantize_activations(x)
                sliced_in = (all_gather_cat(F.pad(x_q, (0, 0, 0, pad)), group, dim=0),
                             all_gather_cat(F.pad(x_scale, (0, 0, 0, pad)), group, dim=0))
        sliced = proj(*sliced_in) if proj.scale is None else proj.quantized(*sliced_in, x.dtype)
        return _own_rows(dist, sliced, group, most, x.shape[0])


class ParallelLMHead:
    """lm_head with its vocabulary rows split over the lm_head-TP group: every rank's rows are gathered (padded to
    the group's largest count), each rank computes its vocabulary slice for all of them, and an all-to-all hands
    each rank the slices of its own rows: the full logits of its rows."""

    def __init__(self, head: Proj, vocab_size: int, dist: Dist):
        check_rows("lm_head", head.weight.shape[0], vocab_size, dist.tp, "tp")
        self.head, self.dist = head, dist

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [rows, hidden] (this rank's own rows; DP ranks differ) -> [rows, vocab]."""
        head, dist = self.head, self.dist
        if dist.tp == 1:
            return head(h)
        group = dist.groups.tp
        most = dist.most_rows(h.shape[0], group)
        if most == 0:  # no rank wants logits this step (e.g. every sequence is mid-prompt): all skip alike
            return h.new_empty(0, head.weight.shape[0] * group.size)
        with dist.timed():
            everyone = all_gather_cat(F.pad(h, (0, 0, 0, most - h.shape[0])).contiguous(), group, dim=0)
        return _own_rows(dist, head(everyone), group, most, h.shape[0])  # my vocabulary slice of everyone's rows


def _own_rows(dist: Dist, sliced: torch.Tensor, group, most: int, rows: int) -> torch.Tensor:
    """sliced [size * most, n / size]: this rank's output columns of every member's rows (padded to `most`)
    -> [rows, n], this rank's rows with every member's columns, in group-rank order."""
    with dist.timed():
        # slice i, from rank i: `most` rows from each, known here, so no exchange of counts
        mine, _ = all_to_all_variable(sliced.contiguous(), [most] * group.size, group, recv_counts=[most] * group.size)
    return mine.view(group.size, most, -1).transpose(0, 1).reshape(most, -1)[:rows]


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
    """The group's shares of `rows` rows gathered back into all of them (each padded to an equal size for
    the gather only; a throwaway share lands past `rows` and is dropped)."""
    if dist.attn_tp == 1:
        return share
    per = -(-rows // dist.attn_tp)
    with dist.timed():
        padded = F.pad(share, (0, 0, 0, per - share.shape[0])).contiguous()
        return all_gather_cat(padded, dist.groups.attn_tp, dim=0)[:rows]


def cp_gather(dist: Dist, x: torch.Tensor, most: int, order: torch.Tensor) -> torch.Tensor:
    """A context-parallel prefill's new rows: x [T, d], this member's positions -> [length, d], every
    member's rows in position order (`order`: each position's row among the gathered, member after member,
    each padded to `most`)."""
    if dist.cp == 1:
        return x.index_select(0, order)
    with dist.timed():
        everyone = all_gather_cat(F.pad(x, (0, 0, 0, most - x.shape[0])).contiguous(), dist.groups.cp, dim=0)
    return everyone.index_select(0, order)
