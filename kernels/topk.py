"""The indexer's top-k with the project's tie rule: among equal scores the lowest index wins.

Both DeepSeek indexers (V3.2's over cached positions, V4's over compressed entries) score with a relu, which
leaves exact ties (often many scores at exactly 0). `torch.topk` breaks ties in an unspecified order that can
change with the shape of the call, so the same query could choose differently in a chunked prefill, a decode
step or a batch of sequences. A stable descending sort breaks them by index instead, whatever the call holds.
"""

from __future__ import annotations

import torch


def topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., n] -> [..., min(k, n)] the indices of each row's k best scores, best first, ties toward the
    lowest index."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :min(k, scores.shape[-1])]
