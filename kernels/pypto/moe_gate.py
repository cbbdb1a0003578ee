"""The MoE gates in PyPTO: the router's matmul, the scores, the expert choice and the routing weights of one step's
rows, as the runners' `route` computes them in torch (runner/models/deepseek_v3.py and deepseek_v4.py).

- V3 / V3.2 (`v3_gate`): sigmoid scores; the choice adds the selection bias, ranks the experts' groups by their best
  ROUTER_GROUP_TOPK biased scores summed, keeps the best `topk_group` groups and takes the top k experts there; the
  weights are the unbiased scores of the chosen, renormalized (norm_topk_prob) and scaled.
- V4 (`v4_gate`): sqrt(softplus) scores; the top k of score + bias, or on its hash layers the token's row of
  `tid2eid`; the weights renormalized and scaled.

Everything runs in float32 (the router's logits too, as the torch path casts x and the router), in one tile of the
step's rows by the experts: at the real sizes (V3.2: 256 experts, V4-Flash: 256) a float32 tile of 16 rows is
16 KiB, inside the unified buffer. The matmul's cube tiles cover the hidden size in chunks of CUBE_K.
"""

import functools  # no `from __future__ import annotations`: PyPTO's jit reads the annotations as objects

import pypto
import torch

from dsconv.kernels.pypto.host import VERIFY_OPTIONS, run

ROUTER_GROUP_TOPK = 2  # experts summed per group when ranking groups (noaux_tc), as runner/models/deepseek_v3.py
ROUTER_NORM_EPS = 1e-20  # as the runners' (transformers' routers)
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus: x itself above it
CUBE_M, CUBE_K = 16, 64  # the matmul's tiles (rows, hidden chunk); the experts' side takes all of them


# PyPTO 0.2.0's parser inlines only helpers marked @pypto.frontend.function with fixed shapes (a plain Python helper
# called from a kernel crashes it, as does reading a tensor after assigning it to an output), so each kernel spells
# its steps out; the Python `if`s on closure constants choose what is traced.


@functools.cache
def _v4_kernel(tokens: int, hidden: int, experts: int, k: int, dtype: torch.dtype, scale: float, wrong=None):
    dt = pypto.DT_FP32 if dtype == torch.float32 else pypto.DT_BF16

    @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
    def v4_gate(x: pypto.Tensor((tokens, hidden), dt), router: pypto.Tensor((experts, hidden), dt),
                bias: pypto.Tensor((1, experts), pypto.DT_FP32), chosen: pypto.Tensor((tokens, k), pypto.DT_INT32),
                weights: pypto.Tensor((tokens, k), pypto.DT_FP32)):
        pypto.set_vec_tile_shapes(tokens, experts)
        pypto.set_cube_tile_shapes([CUBE_M, CUBE_M], [CUBE_K, CUBE_K], [experts, experts])
        logits = pypto.matmul(pypto.cast(x, pypto.DT_FP32), pypto.cast(router, pypto.DT_FP32), pypto.DT_FP32,
                              b_trans=True)  # [T, E]
        scores = pypto.sqrt(pypto.where(pypto.gt(logits, SOFTPLUS_THRESHOLD), logits,
                                        pypto.log1p(pypto.exp(logits))))
        biased = pypto.add(scores, bias)
        if wrong == "shifted":  # expert e's score read at index e - 1: every index off by one
            biased = pypto.concat([pypto.view(biased, [tokens, experts - 1], [0, 1]),
                                   pypto.view(biased, [tokens, 1], [0, 0])], -1)
        _, picked = pypto.topk(biased, k, -1, True)
        picked_scores = pypto.gather(scores, 1, picked)  # before `chosen` takes `picked` (PyPTO moves it there)
        chosen[:] = picked
        if wrong != "no_scale":
            picked_scores = pypto.div(picked_scores, pypto.add(pypto.sum(picked_scores, -1, keepdim=True),
                                                               ROUTER_NORM_EPS))
        weights[:] = pypto.mul(picked_scores, scale)

    return v4_gate


@functools.cache
def _v4_hash_kernel(tokens: int, hidden: int, experts: int, k: int, dtype: torch.dtype, scale: float, vocab: int,
                    wrong=None):
    dt = pypto.DT_FP32 if dtype == torch.float32 else pypto.DT_BF16

    @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
    def v4_hash_gate(x: pypto.Tensor((tokens, hidden), dt), router: pypto.Tensor((experts, hidden), dt),
                     tid2eid: pypto.Tensor((vocab, k), pypto.DT_INT32),
                     token_ids: pypto.Tensor((tokens,), pypto.DT_INT32),
                     chosen: pypto.Tensor((tokens, k), pypto.DT_INT32),
                     weights: pypto.Tensor((tokens, k), pypto.DT_FP32)):
        pypto.set_vec_tile_shapes(tokens, experts)
        pypto.set_cube_tile_shapes([CUBE_M, CUBE_M], [CUBE_K, CUBE_K], [experts, experts])
        logits = pypto.matmul(pypto.cast(x, pypto.DT_FP32), pypto.cast(router, pypto.DT_FP32), pypto.DT_FP32,
                              b_trans=True)  # [T, E]
        scores = pypto.sqrt(pypto.where(pypto.gt(logits, SOFTPLUS_THRESHOLD), logits,
                                        pypto.log1p(pypto.exp(logits))))
        picked = pypto.index_select(tid2eid, 0, token_ids)  # [T, k]: the token's row of the table
        picked_scores = pypto.gather(scores, 1, picked)  # before `chosen` takes `picked` (PyPTO moves it there)
        chosen[:] = picked
        if wrong != "no_scale":
            picked_scores = pypto.div(picked_scores, pypto.add(pypto.sum(picked_scores, -1, keepdim=True),
                                                               ROUTER_NORM_EPS))
        weights[:] = pypto.mul(picked_scores, scale)

    return v4_hash_gate


def v4_gate(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, k: int, scale: float,
            tid2eid: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
            wrong=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router [E, H] (taken in x's dtype: the kernel casts both to float32, as the torch path does), bias [E]
    (None on a hash layer), tid2eid [vocab, k] and tokens [T] on a hash layer ->
    (experts [T, k] int64, weights [T, k] float32), through PyPTO's interpreter (host.run). wrong: a deliberately
    wrong variant for the negative tests ("shifted": each expert's score read one index off, top-k layers only;
    "no_scale": weights not renormalized)."""
    tokens_n, hidden = x.shape
    experts = router.shape[0]
    chosen, weights = torch.empty(tokens_n, k, dtype=torch.int32), torch.empty(tokens_n, k)
    if tid2eid is None:
        kernel = _v4_kernel(tokens_n, hidden, experts, k, x.dtype, scale, wrong)
        run(kernel, x.contiguous(), router.to(x.dtype).contiguous(), bias.float().reshape(1, experts).contiguous(),
            chosen, weights)
    else:
        kernel = _v4_hash_kernel(tokens_n, hidden, experts, k, x.dtype, scale, tid2eid.shape[0], wrong)
        run(kernel, x.contiguous(), router.to(x.dtype).contiguous(), tid2eid.to(torch.int32).contiguous(),
            tokens.to(torch.int32).contiguous(), chosen, weights)
    return chosen.long(), weights


@functools.cache
def _v3_kernel(tokens: int, hidden: int, experts: int, groups: int, topk_group: int, k: int, dtype: torch.dtype,
               scale: float, renormalize: bool, wrong=None):
    dt = pypto.DT_FP32 if dtype == torch.float32 else pypto.DT_BF16
    per_group = experts // groups

    @pypto.frontend.jit(verify_options=VERIFY_OPTIONS)
    def v3_gate(x: pypto.Tensor((tokens, hidden), dt), router: pypto.Tensor((experts, hidden), pypto.DT_FP32),
                bias: pypto.Tensor((1, experts), pypto.DT_FP32), chosen: pypto.Tensor((tokens, k), pypto.DT_INT32),
                weights: pypto.Tensor((tokens, k), pypto.DT_FP32)):
        pypto.set_vec_tile_shapes(tokens, experts)
        pypto.set_cube_tile_shapes([CUBE_M, CUBE_M], [CUBE_K, CUBE_K], [experts, experts])
        scores = pypto.sigmoid(pypto.matmul(pypto.cast(x, pypto.DT_FP32), router, pypto.DT_FP32, b_trans=True))
        biased = pypto.add(scores, bias)
        # each group's experts as a [T, per_group] view (a Python loop, unrolled as the kernel is traced; the parser
        # evaluates no comprehension)
        members, group_scores = [], []
        for g in range(groups):
            member = pypto.view(biased, [tokens, per_group], [0, g * per_group])
            best, _ = pypto.topk(member, ROUTER_GROUP_TOPK, -1, True)
            members.append(member)
            group_scores.append(pypto.sum(best, -1, keepdim=True))  # [T, 1]
        kept, _ = pypto.topk(pypto.concat(group_scores, -1), topk_group, -1, True)  # [T, topk_group]
        threshold = pypto.amin(kept, -1, keepdim=True)  # the topk_group-th best group's score, [T, 1]
        choices = []
        for g in range(groups):
            choices.append(pypto.where(pypto.ge(group_scores[g], threshold), members[g], float("-inf")))
        masked = pypto.concat(choices, -1)  # [T, E]
        if wrong == "shifted":  # expert e's score read at index e - 1: every index off by one
            masked = pypto.concat([pypto.view(masked, [tokens, experts - 1], [0, 1]),
                                   pypto.view(masked, [tokens, 1], [0, 0])], -1)
        _, picked = pypto.topk(masked, k, -1, True)
        picked_scores = pypto.gather(scores, 1, picked)  # before `chosen` takes `picked` (PyPTO moves it there)
        chosen[:] = picked
        if renormalize and wrong != "no_scale":
            picked_scores = pypto.div(picked_scores, pypto.add(pypto.sum(picked_scores, -1, keepdim=True),
                                                               ROUTER_NORM_EPS))
        weights[:] = pypto.mul(picked_scores, scale)

    return v3_gate


def v3_gate(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, groups: int, topk_group: int, k: int,
            renormalize: bool, scale: float, wrong=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router [E, H] float32, bias [E] -> (experts [T, k] int64, weights [T, k] float32), through PyPTO's
    interpreter. The group choice keeps every group whose score reaches the topk_group-th best (ties: more than
    topk_group groups stay, where torch.topk keeps exactly that many)."""
    tokens_n, hidden = x.shape
    experts = router.shape[0]
    chosen, weights = torch.empty(tokens_n, k, dtype=torch.int32), torch.empty(tokens_n, k)
    kernel = _v3_kernel(tokens_n, hidden, experts, groups, topk_group, k, x.dtype, scale, renormalize, wrong)
    run(kernel, x.contiguous(), router.float().contiguous(), bias.float().reshape(1, experts).contiguous(), chosen,
        weights)
    return chosen.long(), weights
