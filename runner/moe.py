"""The expert-parallel step both model families share: (token, expert) pairs travel to the experts' owner
ranks, this rank's experts run on what arrives, the results travel back and are summed with the routing
weights. Every rank calls it once per MoE layer, with zero rows if it has no tokens."""

from __future__ import annotations

import torch

from dsconv.kernels.linear import quantize_activations
from dsconv.runner.dist import Dist


def expert_parallel(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, local_experts: list,
                    per_rank: int, dist: Dist) -> torch.Tensor:
    """x [T, H]; experts, weights [T, k] from the router; local_experts: this rank's experts (GatedMLP-like:
    callable on float rows and, when `int8`, on INT8 rows via `quantized(x_q, x_scale, dtype)` -> [T, H]; the
    one-token path uses their stages `gate_up`, `activation` and `down`)."""
    if dist.ep == 1 and x.shape[0] == 1:
        return _one_local_token(x, experts, weights, local_experts)
    k = experts.shape[1]
    flat = experts.flatten()  # [T*k] one row per (token, expert) pair
    # grouped by owning EP rank (sorting by expert id also groups each destination's rows by expert)
    order = torch.argsort(flat, stable=True)
    send_counts = torch.bincount(flat // per_rank, minlength=dist.ep)
    rows, local = x[order // k], flat[order] % per_rank
    int8 = local_experts[0].int8
    # EP dispatch: each row goes to its expert's owner with the expert's local index; W8A8 experts get INT8
    # activations and their per-token scales, quantized once here (what the expert itself would compute)
    columns = [*quantize_activations(rows), local] if int8 else [rows, local]
    received, recv_counts = dist.ep_dispatch(columns, send_counts)
    recv_local = received[-1]
    # rows from several source ranks are regrouped by local expert; from this rank alone (EP 1) they already are
    by_expert = torch.argsort(recv_local, stable=True) if dist.ep > 1 else None
    counts = torch.bincount(recv_local, minlength=per_rank).tolist()
    inputs = received[:-1] if by_expert is None else [column[by_expert] for column in received[:-1]]
    outputs, start = [], 0
    for expert, count in zip(local_experts, counts):
        if count:  # experts without rows are skipped
            mine = [column[start:start + count] for column in inputs]
            outputs.append(expert.quantized(mine[0], mine[1], x.dtype) if int8 else expert(mine[0]))
        start += count
    if by_expert is None:
        out = torch.cat(outputs) if outputs else x.new_empty(0, x.shape[1])
    else:
        out = torch.empty(recv_local.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        if outputs:
            out[by_expert] = torch.cat(outputs)
    back = dist.ep_combine(out, recv_counts, send_counts)  # rows return to their senders, in the same order
    combined = torch.empty_like(back)
    combined[order] = back
    # per token, its k rows weighted and summed in float32: [T, 1, k] @ [T, k, H]
    return torch.bmm(weights[:, None], combined.view(-1, k, x.shape[1]).float())[:, 0].to(x.dtype)


def _one_local_token(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     local_experts: list) -> torch.Tensor:
    """EP 1 and one token, a single sequence's decode step: nothing to exchange or group, so the token's k
    experts run on it directly, their k gate/up projections stacked so that the activation is one call for all
    k (each row's values are what the expert alone computes), then each expert's down projection on its row.
    The same values as the general path (same expert inputs, same weighted sum) with a fraction of its calls."""
    chosen = [local_experts[e] for e in experts[0].tolist()]
    if chosen[0].int8:
        x_q, x_scale = quantize_activations(x)
        gate_up = torch.cat([e.gate_up.quantized(x_q, x_scale, x.dtype) for e in chosen])  # [k, 2 * inter]
    else:
        gate_up = torch.cat([e.gate_up(x) for e in chosen])
    hidden = chosen[0].activation(gate_up)  # [k, inter]: the experts of a layer share their activation
    outputs = torch.cat([e.down(hidden[i:i + 1]) for i, e in enumerate(chosen)])  # [k, H]
    return torch.mm(weights, outputs.float()).to(x.dtype)  # [1, k] @ [k, H]: the weighted sum
