"""DeepSeek-V3 / V3.2-Exp forward over one rank's shards, top to bottom like DeepSeek's own model.py.

Tokens arrive flattened ([T] over this rank's sequences, vLLM style) with their positions and cache slots.
Attention is MLA over a paged latent cache: prefill expands the latent through kv_b_proj, decode absorbs
kv_b_proj into the query and attends over the latent directly. V3.2 adds the Lightning indexer, whose keys
are cached next to the latent, and attends only over its top-k positions. MoE experts are EP-sharded: the
exchange is written out in runner/models/moe.py; lm_head is vocabulary-sharded and its logits gathered in `logits()`.
The layers (projections, norms, rotary tables, MLPs, routed experts) come from runner/models/layers.py.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from dsconv.family.deepseek_v3 import V3Config
from dsconv.kernels.attention import attention
from dsconv.kernels.cache_int8 import hadamard, int8_scores, quantize_tokens
from dsconv.kernels.device import cast
from dsconv.kernels.linear import matmul_dtype
from dsconv.kernels.rope import apply_rope, apply_rope_prefix, softmax_scale
from dsconv.kernels.topk import topk_lowest_index
from dsconv.runner.models.kv_cache import LatentCache
from dsconv.runner.models.step import DECODE_GATHER_ROWS, DecodeRows, StepMeta, query_chunks
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.draw import Draw
from dsconv.runner.models.layers import GatedMLP, Proj, RMSNorm, Rope, RoutedExperts, StepRope
from dsconv.runner.models.moe import expert_parallel
from dsconv.runner.models.parallel import (OutputSplitLinear, ParallelLMHead, VocabParallelEmbedding,
                                          attention_tp_share, attention_tp_sum, attention_tp_unshare, check_rows,
                                          cp_broadcast, cp_gather)
from dsconv.runner.models.weights import RankWeights

INDEXER_K_NORM_EPS = 1e-6  # the indexer's LayerNorm epsilon in DeepSeek's and transformers' code
ROUTER_GROUP_TOPK = 2  # experts summed per group when ranking groups (noaux_tc)
ROUTER_NORM_EPS = 1e-20
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
# What a multiply-add of absorbed sparse prefill costs against one of the expanded form's fused attention
# (torch's SDPA) on CPU: each query gathers its own k latent rows and multiplies them in small batched products.
# scripts/bench_prefill.py at 4,096 tokens (docs/benchmarks.md): with k = 2048 the absorbed form does half the
# expanded form's multiply-adds and its whole step takes 2.7x as long, so at least 5x per multiply-add (any
# weight from 2 to 500 puts both measured regimes, k = 8 and k = 2048, on their faster form).
ABSORBED_MAC_COST = 5


class Attention:
    def __init__(self, cfg: V3Config, w: RankWeights, prefix: str, dist: Dist, dtype: torch.dtype):
        self.cfg = cfg
        # q_a, kv_a and V3.2's indexer wk and weights_proj all read the layer input: one merged projection, output
        # columns [q_lora | kv_lora + rope | index_head_dim | index_n_heads] (family.recipes gives them one type)
        names = [f"{prefix}.q_a_proj", f"{prefix}.kv_a_proj_with_mqa"]
        self.input_split = [cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim]
        if cfg.has_indexer:
            names += [f"{prefix}.indexer.wk", f"{prefix}.indexer.weights_proj"]
            self.input_split += [cfg.index_head_dim, cfg.index_n_heads]
        self.wqkv_a = Proj.merged(w, names, dtype)
        self.wq_b = Proj(w, f"{prefix}.q_b_proj", dtype)
        # this rank's heads under attention TP (all of them without), checked against its q_b_proj slice
        self.heads = cfg.num_attention_heads // dist.attn_tp
        q_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        check_rows(f"{prefix}.q_b_proj", self.wq_b.weight.shape[0], cfg.num_attention_heads * q_head_dim, dist.attn_tp,
                   "attention TP")
        self.q_norm = RMSNorm(w, f"{prefix}.q_a_layernorm.weight", cfg.rms_norm_eps, dtype)
        # kv_b_proj [heads * (nope + v), lora] split once into per-head W_UK and W_UV [heads, v, lora]: prefill
        # expands the latent with them, decode absorbs them. Copies (dequantized if INT8) in the dtype decode
        # multiplies in: float32 on CPU (kernels.linear.matmul_dtype), twice a BF16 copy's bytes
        kv_b = Proj(w, f"{prefix}.kv_b_proj", dtype).float_weight(dtype).view(self.heads, -1, cfg.kv_lora_rank)
        product_dtype = matmul_dtype(kv_b)
        # W_UK stored transposed, [heads, lora, nope], so that both absorbed products are matrix @ column (inside
        # a decode step as fast as row @ matrix with [heads, nope, lora])
        self.w_uk_t = kv_b[:, :cfg.qk_nope_head_dim].transpose(1, 2).to(product_dtype, copy=True,
                                                                        memory_format=torch.contiguous_format)
        self.w_uv = kv_b[:, cfg.qk_nope_head_dim:].to(product_dtype, copy=True, memory_format=torch.contiguous_format)
        self.kv_norm = RMSNorm(w, f"{prefix}.kv_a_layernorm.weight", cfg.rms_norm_eps, dtype)
        self.wo = OutputSplitLinear(Proj(w, f"{prefix}.o_proj", dtype), cfg.hidden_size, dist, f"{prefix}.o_proj")
        self.indexer = Indexer(cfg, w, f"{prefix}.indexer", dtype) if cfg.has_indexer else None
        self.dist = dist

    def __call__(self, x, step_rope: StepRope, cache: LatentCache, layer: int, meta: StepMeta, scale: float):
        cfg, heads = self.cfg, self.heads
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        # V3.2: index_k_w = the indexer's key and head weights
        q_a, c_kv, k_pe, *index_k_w = self.wqkv_a(x).split(self.input_split, dim=-1)
        side = self.dist.side_stream
        if self.indexer is not None:  # the indexer's prolog beside the MLA prolog (on CPU: in order, first)
            with side.beside():
                index_k = self.indexer.keys(index_k_w[0], step_rope, cache)
        q_resid = self.q_norm(q_a)
        q = self.wq_b(q_resid).view(-1, heads, nope + rope)  # [T, heads, qk_head]
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        # one rope call for every head's q_pe and the one rope key k_pe they share: [T, heads + 1, rope]
        pe = apply_rope(torch.cat([q_pe, k_pe[:, None]], dim=1), step_rope.cos, step_rope.sin, interleaved=True)
        q_pe, k_pe = pe[:, :heads], pe[:, heads]
        entries = {"c_kv_k_pe": torch.cat([self.kv_norm(c_kv), k_pe], dim=-1)}  # [T, lora + rope]
        if self.indexer is not None:
            side.join()
            entries["index_k"] = index_k
        out = x.new_empty(x.shape[0], heads, cfg.v_head_dim)
        if meta.cp is not None:
            self.context_parallel(out, q_nope, q_pe, q_resid, index_k_w, step_rope, entries, cache, layer,
                                  meta.cp, scale)
            return self.finish(out)
        cache.write(layer, meta, **entries)

        # the attention core: the step's one-token sequences (decodes) and short chunks (speculative decoding's
        # verifications) together, row by row, each longer chunk (prefill) alone
        for seq in meta.seqs:
            if seq.query_len > meta.batched_rows:
                rows = slice(seq.start, seq.stop)
                out[rows] = self.prefill(q_nope[rows], q_pe[rows], q_resid[rows], [w[rows] for w in index_k_w],
                                         step_rope, rows, cache, layer, seq, scale)
        for decode in meta.decodes:
            rows = decode.rows
            out[rows] = self.decode(q_nope[rows], q_pe[rows], q_resid[rows], [w[rows] for w in index_k_w],
                                    step_rope, rows, cache, layer, decode, scale)
        return self.finish(out)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """[T, heads, v] -> o_proj's output [T, hidden]."""
        o = self.wo(out.flatten(1))  # o_proj TP: an exchange
        return attention_tp_sum(self.dist, o)  # heads split over attention TP: sum the partial projections

    def context_parallel(self, out, q_nope, q_pe, q_resid, index_k_w, step_rope: StepRope, entries: dict,
                         cache: LatentCache, layer: int, cp, scale: float) -> None:
        """This rank's share of a context-parallel prefill: the group's new entries gathered into the whole
        prompt's, in position order (a latent row and an indexer key per token: small under MLA), stored in a
        scratch cache as the owner's cache stores them (the same rounding, INT8 included) and by the owner in
        its cache; then this rank's queries attend over the whole prompt, causally by position, as one prefill
        chunk does."""
        whole = {name: cp_gather(self.dist, value, cp.most, cp.order) for name, value in entries.items()}
        if cp.start:  # the owner's cached prefix, as its cache stores it
            for name, rows in cache.stored_rows(layer, cp.prefix_slots, cp.start).items():
                cp.scratch.data[name][0, :cp.start] = cp_broadcast(self.dist, rows, cp.owner)
        cp.scratch.write(0, cp.scratch_meta, **whole)
        if cp.owner_meta is not None:
            cache.write(layer, cp.owner_meta, **whole)
        if out.shape[0]:
            out[:] = self.prefill(q_nope, q_pe, q_resid, index_k_w, step_rope, slice(0, out.shape[0]), cp.scratch, 0,
                                  cp.seq, scale)

    def prefill(self, q_nope, q_pe, q_resid, index_k_w, step_rope: StepRope, rows, cache: LatentCache, layer: int,
                seq, scale: float) -> torch.Tensor:
        """One sequence's chunk of S > 1 queries -> [S, heads, v]. Without V3.2's indexer selecting (or where the
        count below favours it), the latent is expanded into per-head keys and values over the whole context;
        with it, each query may instead attend in the absorbed form over the latent of its own index_topk
        positions, as decode does (`absorbed`)."""
        cfg = self.cfg
        allowed = seq.causal  # [S, C] True where a query may look
        # V3.2's indexer keeps the top index_topk positions: a context no longer than that is kept whole (top-k
        # of C <= k scores picks all C), so the scoring is skipped. V3.2 uses 2048, longer than most prompts
        if self.indexer is None or seq.context_len <= cfg.index_topk:
            return self.expanded(q_nope, q_pe, cache, layer, seq, allowed, scale)
        top = self.indexer.select(q_resid, index_k_w[1], step_rope.index_cos[rows], step_rope.index_sin[rows],
                                  cache, layer, seq, allowed)  # [S, k]
        if self.absorbed_is_cheaper(q_nope.shape[0], seq.context_len):
            valid = allowed.gather(1, top)  # a query with fewer than k positions before it also picks later ones
            slots = seq.context_slots[top]  # [S, k]
            out = q_nope.new_empty(q_nope.shape[0], self.heads, cfg.v_head_dim)
            per_chunk = max(1, DECODE_GATHER_ROWS // top.shape[1])  # the gathered latent stays bounded
            for first in range(0, q_nope.shape[0], per_chunk):
                part = slice(first, first + per_chunk)
                ctx = cache.read_slots(layer, "c_kv_k_pe", slots[part])  # [chunk, k, lora + rope]
                out[part] = self.absorbed(q_nope[part], q_pe[part], ctx, valid[part], scale)
            return out
        chosen = torch.zeros(top.shape[0], seq.context_len, dtype=torch.bool, device=top.device)
        chosen.scatter_(-1, top, True)  # each query has its own choice: a mask over the whole context
        return self.expanded(q_nope, q_pe, cache, layer, seq, allowed & chosen, scale)  # not in place: shared

    def absorbed_is_cheaper(self, queries: int, context: int) -> bool:
        """Whether the absorbed form should take a prefill chunk, V3.2's indexer selecting k = index_topk
        positions per query, by multiply-adds. Expanded: the context's latent through W_UK and W_UV (context x
        heads x lora x (nope + v)), then every query against every position (queries x heads x context x (qk_head
        + v)): the sparse mask saves nothing. Absorbed: W_UK into the queries and W_UV after (queries x heads x
        lora x (nope + v)), then each query against its k latent rows (queries x heads x k x (lora + rope +
        lora)), each of those weighed ABSORBED_MAC_COST times. DeepSeek-V3.2 (k = 2048) at 4,096 tokens: expanded;
        at tens of thousands, absorbed."""
        cfg, heads, lora = self.cfg, self.heads, self.cfg.kv_lora_rank
        qk_head, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        projections = heads * lora * (cfg.qk_nope_head_dim + v)
        expanded = context * projections + queries * heads * context * (qk_head + v)
        k = min(cfg.index_topk, context)
        absorbed = queries * projections + ABSORBED_MAC_COST * queries * heads * k * (2 * lora + cfg.qk_rope_head_dim)
        return absorbed < expanded

    def expanded(self, q_nope, q_pe, cache: LatentCache, layer: int, seq, allowed, scale: float) -> torch.Tensor:
        """The latent expanded into per-head keys and values, every query against the context where `allowed`
        -> [S, heads, v], in the dtype decode multiplies in (float32 on CPU, where BF16 batched products are
        emulated and several times slower), rounded to the compute dtype once, at the end."""
        heads, lora = self.heads, self.cfg.kv_lora_rank
        (ctx,) = cache.read(layer, seq, "c_kv_k_pe")  # [C, lora + rope]: the latent keys of the context
        product_dtype = self.w_uk_t.dtype
        ctx = cast(ctx, product_dtype)
        ctx_c = ctx[:, :lora]  # [C, lora]: the latent values
        k_nope = torch.einsum("cl,hln->hcn", ctx_c, self.w_uk_t)
        values = torch.einsum("cl,hvl->hcv", ctx_c, self.w_uv)
        keys = torch.cat([k_nope, ctx[None, :, lora:].expand(heads, -1, -1)], dim=-1)
        query = cast(torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1), product_dtype)
        out = q_nope.new_empty(q_nope.shape[0], heads, values.shape[-1])
        for part in query_chunks(query.shape[1], heads * ctx.shape[0]):  # the scores stay bounded
            out[part] = cast(attention(query[:, part], keys, values, scale, allowed[part]).transpose(0, 1), out.dtype)
        return out

    def decode(self, q_nope, q_pe, q_resid, index_k_w, step_rope: StepRope, rows, cache: LatentCache, layer: int,
               decode: DecodeRows, scale: float) -> torch.Tensor:
        """B rows at once (their rows of the step: `rows`; one-token sequences', or short chunks' each as one), each
        over its context or, for V3.2 past index_topk, over its chosen positions -> [B, heads, v] (`absorbed`)."""
        cfg = self.cfg
        if self.dist.kernels.on:
            return self.decode_pypto(q_nope, q_pe, q_resid, index_k_w, step_rope, rows, cache, layer, decode, scale)
        slots, valid = decode.slots, decode.valid  # [B, C]
        if self.indexer is not None and decode.max_context > cfg.index_topk:
            # V3.2: each query attends over its index_topk chosen positions only, [B, index_topk, lora + rope]
            top = self.indexer.select_decode(q_resid, index_k_w[1], step_rope.index_cos[rows],
                                             step_rope.index_sin[rows], cache, layer, decode)
            slots = slots.gather(1, top)
            valid = None if valid is None else valid.gather(1, top)
            ctx = cache.read_slots(layer, "c_kv_k_pe", slots)
        else:
            ctx = cache.read_decode(layer, decode, "c_kv_k_pe")  # [B, C, lora + rope]
        return self.absorbed(q_nope, q_pe, ctx, valid, scale)

    def decode_pypto(self, q_nope, q_pe, q_resid, index_k_w, step_rope: StepRope, rows, cache: LatentCache,
                     layer: int, decode: DecodeRows, scale: float) -> torch.Tensor:
        """`decode` through the PyPTO kernels (--kernels pypto, runner/models/kernel_switch.py): the indexer's
        scores and top-k, then the sparse attention over the chosen latent rows; W_UK and W_UV absorbed as `absorbed`
        does."""
        from dsconv.kernels.pypto.sparse_mla import sparse_mla_decode

        cfg = self.cfg
        slots, valid = decode.slots, decode.valid  # [B, C]
        if self.indexer is not None and decode.max_context > cfg.index_topk:
            top = self.indexer.select_pypto(q_resid, index_k_w[1], step_rope.index_cos[rows],
                                            step_rope.index_sin[rows], cache, layer, slots, valid)
            slots = slots.gather(1, top)
            valid = None if valid is None else valid.gather(1, top)
        product_dtype = self.w_uk_t.dtype
        q_lat = torch.bmm(self.w_uk_t, cast(q_nope, product_dtype).permute(1, 2, 0))  # [heads, lora, B]
        query = torch.cat([q_lat.permute(2, 0, 1), cast(q_pe, product_dtype)], dim=-1)  # [B, heads, lora + rope]
        latent = {name: t[layer] for name, t in cache.data.items() if name.split(".")[0] == "c_kv_k_pe"}
        o_lat = sparse_mla_decode(query, latent, slots, valid, cfg.kv_lora_rank, scale)  # [B, heads, lora]
        return cast(torch.bmm(self.w_uv, o_lat.permute(1, 2, 0)).permute(2, 0, 1), q_nope.dtype)  # [B, heads, v]

    def absorbed(self, q_nope, q_pe, ctx, valid, scale: float) -> torch.Tensor:
        """B queries, each over its own latent rows ctx [B, C, lora + rope] (valid [B, C] or None: all): W_UK
        absorbed into the queries and W_UV into the outputs, every head attending over the latent itself -> [B,
        heads, v]. In the dtype matmul multiplies in (float32 on CPU, where the BF16 products are slow), rounded
        to the compute dtype once, at the end."""
        lora = self.cfg.kv_lora_rank
        product_dtype = self.w_uk_t.dtype
        ctx = cast(ctx, product_dtype)
        q_lat = torch.bmm(self.w_uk_t, cast(q_nope, product_dtype).permute(1, 2, 0))  # [heads, lora, B]
        query = torch.cat([q_lat.permute(2, 0, 1), cast(q_pe, product_dtype)], dim=-1)  # [B, heads, lora + rope]
        # the heads are one sequence's queries against the keys and values all of them share: [B, heads, lora]
        o_lat = attention(query, ctx, ctx[..., :lora], scale, None if valid is None else valid[:, None],
                          one_token=True)
        return cast(torch.bmm(self.w_uv, o_lat.permute(1, 2, 0)).permute(2, 0, 1), q_nope.dtype)  # [B, heads, v]


class Indexer:
    """V3.2's Lightning indexer: scores every cached position per query, keeps the top `index_topk`. With an INT8
    key cache the scores are A8C8: keys and queries rotated by a Hadamard matrix (dot products unchanged, outliers
    spread), quantized per token (queries per token and head), INT8 x INT8 sums, scales applied after."""

    def __init__(self, cfg: V3Config, w: RankWeights, prefix: str, dtype: torch.dtype):
        self.cfg = cfg
        self.wq_b = Proj(w, f"{prefix}.wq_b", dtype)  # wk and weights_proj are merged into Attention.wqkv_a
        # the LayerNorm's parameters in the compute dtype, once (F.layer_norm wants them in the input's dtype)
        self.k_norm_weight = cast(w.take(f"{prefix}.k_norm.weight"), dtype)
        self.k_norm_bias = cast(w.take(f"{prefix}.k_norm.bias"), dtype)
        # an INT8 key cache stores keys rotated by H and scores queries rotated alike (same dot products)
        self.rotation = hadamard(cfg.index_head_dim, torch.float32, w.device)

    def keys(self, k, step_rope: StepRope, cache: LatentCache) -> torch.Tensor:
        """k [T, index_head_dim]: wk of the layer input -> the keys to cache: normed, with rope, and rotated
        for an INT8 key cache."""
        cfg = self.cfg
        k = F.layer_norm(k, (cfg.index_head_dim,), self.k_norm_weight, self.k_norm_bias, INDEXER_K_NORM_EPS)
        k = apply_rope_prefix(k, step_rope.index_cos[:, 0], step_rope.index_sin[:, 0], cfg.qk_rope_head_dim)
        return self.rotate(k) if cache.is_int8("index_k") else k

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] @ H, multiplied in float32 and returned in x's dtype: what the A8C8 path quantizes."""
        return torch.matmul(x.float(), self.rotation).to(x.dtype)

    def select(self, q_resid, head_weights, cos, sin, cache: LatentCache, layer: int, seq, allowed) -> torch.Tensor:
        """One sequence's S queries; head_weights [S, index_n_heads]: weights_proj of the layer input. -> [S, k]
        per query the context positions of its top k = min(index_topk, C) index scores."""
        q = self.queries(q_resid, cos, sin)  # [S, heads, dim]
        int8 = cache.is_int8("index_k")
        if int8:  # A8C8: INT8 queries against the INT8 key cache
            keys, key_scale = cache.read_int8(layer, "index_k", seq=seq)  # [C, dim] int8, [C, 1]
        else:
            (keys,) = cache.read(layer, seq, "index_k")  # [C, dim]
            keys_t = cast(keys, torch.float32).t()
        top = []
        for part in query_chunks(q.shape[0], q.shape[1] * keys.shape[0]):  # the scores stay bounded
            rows = q[part]
            if int8:
                q_int8, q_scale = quantize_tokens(self.rotate(rows).reshape(-1, rows.shape[-1]))  # per query, head
                scores = int8_scores(q_int8, q_scale, keys, key_scale).view(*rows.shape[:2], -1)
            else:  # torch.mm: einsum and matmul fold to this product, with per-call setup on top
                scores = torch.mm(rows.float().reshape(-1, rows.shape[-1]), keys_t).view(*rows.shape[:2], -1)
            top.append(self.top(self.index(scores, head_weights[part]).masked_fill(~allowed[part], float("-inf"))))
        return top[0] if len(top) == 1 else torch.cat(top)

    def select_decode(self, q_resid, head_weights, cos, sin, cache: LatentCache, layer: int,
                      decode: DecodeRows) -> torch.Tensor:
        """B rows at once (a decode group's), their contexts padded to the longest (a padded position scores -inf,
        after every real one, so a context shorter than index_topk keeps all its positions and pads the rest).
        -> [B, k] positions, k = min(index_topk, longest context)."""
        q = self.queries(q_resid, cos, sin)  # [B, heads, dim]
        if cache.is_int8("index_k"):  # A8C8: INT8 queries against the INT8 key cache
            keys, key_scale = cache.read_int8(layer, "index_k", decode=decode)  # [B, C, dim] int8, [B, C, 1]
            scores = int8_scores(*quantize_tokens(self.rotate(q)), keys, key_scale)  # [B, heads, C]
        else:
            keys = cache.read_decode(layer, decode, "index_k")  # [B, C, dim]
            scores = torch.bmm(q.float(), cast(keys, torch.float32).transpose(1, 2))  # [B, heads, C]
        index = self.index(scores, head_weights)
        return self.top(index if decode.valid is None else index.masked_fill(~decode.valid, float("-inf")))

    def select_pypto(self, q_resid, head_weights, cos, sin, cache: LatentCache, layer: int, slots: torch.Tensor,
                     valid: torch.Tensor | None) -> torch.Tensor:
        """`select_decode` through the PyPTO kernel (kernels/pypto/indexer.py), over the layer's key cache as stored
        (INT8 with its scales: A8C8) -> [B, k] positions."""
        from dsconv.kernels.pypto.indexer import indexer_topk

        q = self.queries(q_resid, cos, sin)  # [B, heads, dim]
        if cache.is_int8("index_k"):
            q = self.rotate(q)
            keys, scales = cache.data["index_k.int8"][layer], cache.data["index_k.scale"][layer]
        else:
            keys, scales = cache.data["index_k"][layer], None
        return indexer_topk(q, head_weights, keys, scales, slots, valid, self.cfg.index_topk)

    def queries(self, q_resid, cos, sin) -> torch.Tensor:
        cfg = self.cfg
        q = self.wq_b(q_resid).view(-1, cfg.index_n_heads, cfg.index_head_dim)
        return apply_rope_prefix(q, cos, sin, cfg.qk_rope_head_dim)

    def index(self, scores: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
        """scores [N, heads, C] (float32, a new tensor: scaled and relu'd in place), head_weights [N, heads] ->
        the index scores [N, C]: relu(q . k / sqrt(dim)) summed over heads with weights / sqrt(heads)."""
        heads, dim = self.cfg.index_n_heads, self.cfg.index_head_dim
        scores.mul_(dim ** -0.5).relu_()
        head_weights = head_weights.float() * heads ** -0.5  # (.float() may return the input itself)
        return torch.bmm(head_weights[:, None], scores)[:, 0]  # [N, 1, heads] @ [N, heads, C] -> [N, C]

    def top(self, index: torch.Tensor) -> torch.Tensor:
        """[N, C] -> [N, min(index_topk, C)] the positions of each row's best scores (ties: lowest position)."""
        return topk_lowest_index(index, self.cfg.index_topk)


class MoE:
    def __init__(self, cfg: V3Config, w: RankWeights, prefix: str, dist: Dist, dtype: torch.dtype):
        self.cfg, self.dist = cfg, dist
        # routing runs in float32, as transformers' gate does: converted once here, not at every step
        self.router = w.take(f"{prefix}.gate.weight").float()
        self.bias = w.take(f"{prefix}.gate.e_score_correction_bias").float()
        self.experts = RoutedExperts(w, f"{prefix}.experts", MLP_NAMES, cfg.n_routed_experts, dist, dtype)
        self.shared = mlp(w, f"{prefix}.shared_experts", dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid scores + bias, best `topk_group` groups, top-k experts; weights from the unbiased scores."""
        cfg = self.cfg
        if self.dist.kernels.on:  # PyPTO's gate (kernels/pypto/moe_gate.py)
            from dsconv.kernels.pypto.moe_gate import v3_gate

            return v3_gate(x, self.router, self.bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
                           cfg.norm_topk_prob, cfg.routed_scaling_factor)
        scores = F.linear(x.float(), self.router).sigmoid()  # [T, E]
        groups = (scores + self.bias).view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_score = groups.topk(ROUTER_GROUP_TOPK, dim=-1).values.sum(-1)  # [T, n_group]
        best_groups = group_score.topk(cfg.topk_group, dim=-1).indices
        dropped = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, best_groups, False)  # [T, n_group]
        choice = groups.masked_fill(dropped[..., None], float("-inf")).view(-1, cfg.n_routed_experts)
        experts = choice.topk(cfg.num_experts_per_tok, dim=-1).indices  # [T, k]
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + ROUTER_NORM_EPS)
        return experts, weights * cfg.routed_scaling_factor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        share = attention_tp_share(self.dist, x)  # attention-TP ranks hold the same rows: each routes its share
        experts, weights = self.route(share)
        out = expert_parallel(share, experts, weights, self.experts, self.dist, self.shared)  # routed + shared
        return attention_tp_unshare(self.dist, out, x.shape[0])


class DecoderLayer:
    """One decoder layer: attention and its MLP (dense or MoE), each after its norm, each added to the residual."""

    def __init__(self, cfg: V3Config, w: RankWeights, layer: int, dist: Dist, dtype: torch.dtype):
        p = f"model.layers.{layer}"
        self.attn_norm = RMSNorm(w, f"{p}.input_layernorm.weight", cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, w, f"{p}.self_attn", dist, dtype)
        self.mlp_norm = RMSNorm(w, f"{p}.post_attention_layernorm.weight", cfg.rms_norm_eps, dtype)
        self.mlp = MoE(cfg, w, f"{p}.mlp", dist, dtype) if cfg.is_moe_layer(layer) else mlp(w, f"{p}.mlp", dtype)
        # attention enters no collective (no attention TP, o_proj TP or context-parallel group): a rank with no rows
        # skips it and the norms, whose hundreds of zero-row ops a step its peers would wait for at the exchange
        self.alone = dist.attn_tp == 1 and dist.oproj_tp == 1 and dist.cp == 1
        self.kernels = dist.kernels

    def __call__(self, x, step_rope: StepRope, cache: LatentCache, layer: int, meta: StepMeta, scale: float):
        if x.shape[0] == 0 and self.alone:  # an idle rank (on CPU): only the MoE's exchange has peers to meet
            if isinstance(self.mlp, MoE):
                self.mlp(x)
            return x
        attended = self.attn(self.attn_norm(x), step_rope, cache, layer, meta, scale)
        if self.kernels.on:  # PyPTO's RMSNorm with the residual add (kernels/pypto/rms_norm.py)
            from dsconv.kernels.pypto.rms_norm import add_rms_norm

            normed, x = add_rms_norm(attended, x, self.mlp_norm.weight, self.mlp_norm.eps)
            return x + self.mlp(normed)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x))


class MultiTokenPredictor:
    """DeepSeek's MTP layer (the checkpoint's layer num_hidden_layers): at position t it takes the main model's
    final hidden state h_t (after its norm) and the embedding of the token at t + 1, and predicts the token at
    t + 2 through the main model's lm_head. eh_proj mixes [enorm(embedding), hnorm(h)] (that order); the
    embedding is zero at position 0; then one decoder layer with attention over its own cache layer (the cache's
    last), and shared_head.norm before the head. vLLM and SGLang read the hub's weights the same way. The
    layer's copies of the embedding and head (`embed_tokens`, `shared_head.head`) are the main model's: dropped."""

    def __init__(self, cfg: V3Config, w: RankWeights, dist: Dist, dtype: torch.dtype):
        layer = cfg.num_hidden_layers
        p, eps = f"model.layers.{layer}", cfg.rms_norm_eps
        self.enorm = RMSNorm(w, f"{p}.enorm.weight", eps, dtype)
        self.hnorm = RMSNorm(w, f"{p}.hnorm.weight", eps, dtype)
        self.eh_proj = Proj(w, f"{p}.eh_proj", dtype)
        self.block = DecoderLayer(cfg, w, layer, dist, dtype)
        self.norm = RMSNorm(w, f"{p}.shared_head.norm.weight", eps, dtype)
        for name in (f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight"):
            w.discard(name)
        self.cache_layer = layer

    def __call__(self, model: DeepseekV3, hidden: torch.Tensor, next_tokens: torch.Tensor, meta: StepMeta,
                 cache: LatentCache) -> torch.Tensor:
        """hidden [T, H] the main model's (or the previous draft step's) states at meta's positions, next_tokens
        [T] the tokens one position later -> the MTP layer's states [T, H] (its cache entries written on the way);
        `logits` gives its predictions."""
        model.dist.start_step(next_tokens.shape[0])
        e = cast(model.embed(next_tokens), model.dtype)  # embedding TP: an exchange
        e = e.masked_fill((meta.positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        return self.block(x, model.step_rope(meta.positions), cache, self.cache_layer, meta, model.scale)

    def logits(self, model: DeepseekV3, hidden: torch.Tensor) -> torch.Tensor:
        return model.logits(self.norm(hidden))


class DeepseekV3:
    def __init__(self, cfg: V3Config, w: RankWeights, dist: Dist, dtype: torch.dtype, mtp: bool = False):
        """mtp: load the checkpoint's MTP layer (speculative decoding); without it its tensors are dropped."""
        self.cfg, self.dist, self.dtype = cfg, dist, dtype
        self.embed = VocabParallelEmbedding(w.take("model.embed_tokens.weight"), cfg.vocab_size, dist)
        self.layers = [DecoderLayer(cfg, w, i, dist, dtype) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(w, "model.norm.weight", cfg.rms_norm_eps, dtype)
        # [vocab / tp, hidden]: this rank's vocabulary rows
        self.head = ParallelLMHead(Proj.of(w.take("lm_head.weight").to(dtype), None), cfg.vocab_size, dist)
        self.mtp = MultiTokenPredictor(cfg, w, dist, dtype) if mtp else None
        for name in [n for n in w.tensors if _is_mtp(n, cfg)]:
            w.discard(name)  # the MTP layer's, when it is not asked for (or a second one, which it chains instead)
        w.finish()
        self.hidden: torch.Tensor | None = None  # with mtp: the last forward's final states [T, H], after the norm
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, dist.device)
        self.scale = softmax_scale(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.rope_scaling)
        # observe(layer index, its output [T, hidden]) after each layer and observe("logits", logits): set by
        # `dsrun compare` on the rank that records
        self.observe: Callable[[int | str, torch.Tensor], None] | None = None

    def forward(self, tokens: torch.Tensor, meta: StepMeta, cache: LatentCache, rows: torch.Tensor | None = None,
                draws: list[list[Draw]] | None = None) -> torch.Tensor:
        """tokens [T] -> logits [len(rows) or T, vocab] (full vocabulary, gathered over lm_head TP); draws (per
        attention-DP index, one per row): -> those rows' drawn tokens [len(rows) or T] (ParallelLMHead: candidates,
        not slices of the vocabulary, travel)."""
        with self.dist.kernels.step(meta.seqs, meta.cp is not None):
            return self._forward(tokens, meta, cache, rows, draws)

    def _forward(self, tokens: torch.Tensor, meta: StepMeta, cache: LatentCache, rows: torch.Tensor | None,
                 draws: list[list[Draw]] | None) -> torch.Tensor:
        self.dist.start_step(tokens.shape[0])
        x = cast(self.embed(tokens), self.dtype)  # embedding TP: an exchange
        step_rope = self.step_rope(meta.positions)  # rotary tables, made once for every layer
        for layer, block in enumerate(self.layers):
            x = block(x, step_rope, cache, layer, meta, self.scale)
            if self.observe is not None:
                self.observe(layer, x)
        h = self.norm(x)
        if self.mtp is not None:
            self.hidden = h
        logits = self.logits(h if rows is None else h[rows], draws)
        if self.observe is not None:
            self.observe("logits", logits)
        return logits

    def step_rope(self, positions: torch.Tensor) -> StepRope:
        return StepRope.at(self.rope, positions, self.dtype, self.cfg.index_head_dim if self.cfg.has_indexer else None)

    def logits(self, h: torch.Tensor, draws: list[list[Draw]] | None = None) -> torch.Tensor:
        return self.head(h, draws)  # [T, vocab]: lm_head TP, gathered to full vocabulary (draws: [T] tokens)


def mlp(w: RankWeights, prefix: str, dtype: torch.dtype) -> GatedMLP:
    """A dense MLP or the shared expert."""
    return GatedMLP(w, tuple(f"{prefix}.{name}" for name in MLP_NAMES), dtype)


def _is_mtp(name: str, cfg: V3Config) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= cfg.num_hidden_layers
