"""DeepSeek-V4 forward over one rank's shards, top to bottom like DeepSeek's own model.py.

What V4 changes from V3 (the math follows transformers 5.23 `deepseek_v4`; tensors keep the hub's names):
- The residual is `hc_mult` parallel streams (manifold-constrained hyper-connections): before each attention
  and MoE block a learned "pre" mix collapses the streams into the block's input, after it a "post" mix
  spreads the block's output back and a Sinkhorn-normalized (doubly stochastic) "comb" matrix mixes the old
  streams. `hc_head` collapses them once more before the final norm.
- Attention is shared-KV MQA (one head serves as key and value) with a per-head sink, partial RoPE on the
  last qk_rope_head_dim dims (interleaved pairs, layout kept) and a grouped low-rank output projection.
  Every layer attends over a sliding window; CSA layers add ratio-4 overlapping compressed entries chosen
  per query by the Lightning indexer (top `index_topk`), HCA layers add every compressed entry of their own
  ratio (128 on the hub; DeepSeek's code takes any ratio other than 4 as HCA).
- MoE scores experts with sqrt(softplus) (plus a bias for the choice), or by a fixed token -> expert table
  on the first `num_hash_layers` layers; expert and shared SwiGLUs clamp at `swiglu_limit`.

Each step continues what the cache (runner/models/v4_cache.py) holds for a sequence: the sliding window's keys
and each compressor's unfinished window in its sequence slot, the compressed entries and the indexer's keys in its
blocks, where the step's metadata (step.V4Step) says. A prompt fed in chunks of any size and the tokens after it
continue one sequence; a chunk of several rows attends alone (`Attention.prefill`), a step's one-row sequences and
the short chunks of speculative decoding together, row by row (`Attention.decode`, batched over the gathered
caches). Attention TP is future work (attention runs DP).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from dsconv.family.deepseek_v4 import AttnType, MlpType, V4Config, attn_type_of
from dsconv.kernels.attention import attention
from dsconv.kernels.cache_int8 import hadamard, int8_scores, quantize_tokens
from dsconv.kernels.norm import WEIGHT_IN_FLOAT32
from dsconv.kernels.rope import rope_tail
from dsconv.kernels.topk import topk_lowest_index
from dsconv.runner.models.step import StepMeta, V4Decode, V4Entries, V4Prefill, V4StateWrites, V4Step, query_chunks
from dsconv.runner.models.v4_cache import CompressorPool, LayerPool, V4Cache
from dsconv.runner.models.dist import Dist
from dsconv.runner.models.kernel_switch import KernelSwitch
from dsconv.runner.models.draw import Draw
from dsconv.runner.models.layers import GatedMLP, GroupedProj, Proj, RMSNorm, Rope, RoutedExperts, unweighted_rms_norm
from dsconv.runner.models.moe import expert_parallel
from dsconv.runner.models.parallel import (ParallelLMHead, VocabParallelEmbedding, attention_tp_share,
                                          attention_tp_unshare)
from dsconv.runner.models.weights import RankWeights

ROUTER_NORM_EPS = 1e-20  # as transformers' V4 routers
EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down
SCORE_FUNCS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
}


def norm(w: RankWeights, name: str, cfg: V4Config) -> RMSNorm:
    """V4 keeps norm weights in float32: the weight multiplies before the one cast back (unlike V3's order)."""
    return RMSNorm(w, name, cfg.rms_norm_eps, torch.float32, WEIGHT_IN_FLOAT32)


def _yarn_dict(cfg: V4Config) -> dict | None:
    if cfg.rope_scaling is None:
        return None
    y = cfg.rope_scaling
    # attention_factor 1: DeepSeek's reference does not scale cos/sin by YaRN's mscale (transformers agrees)
    return {"type": "yarn", "factor": y.factor, "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "attention_factor": 1.0}


class Compressor:
    """Pools every `ratio` tokens into one key (= value) entry: a softmax over the window of learned gates
    (plus the per-slot bias `ape`) weighs the projected tokens, per dim. Overlapping (CSA) compressors emit
    two series per token: entry w pools window w-1's first series with window w's second, 2 * ratio slots.
    Only whole windows are pooled; entry w is rotated at position w * ratio. The unfinished window's rows wait in
    the sequence's slot of the cache (v4_cache.CompressorPool), the entries in its blocks."""

    def __init__(self, cfg: V4Config, w: RankWeights, prefix: str, ratio: int, head_dim: int, overlap: bool,
                 rope: Rope, dtype: torch.dtype, rotation: torch.Tensor | None = None):
        """rotation: the Hadamard matrix an INT8 cache stores this compressor's entries rotated by (the
        indexer's keys, for A8C8 scoring); None: stored as pooled."""
        self.ratio, self.head_dim, self.overlap, self.rope = ratio, head_dim, overlap, rope
        self.rotation = rotation
        self.wkv, self.wgate = Proj(w, f"{prefix}.wkv", dtype), Proj(w, f"{prefix}.wgate", dtype)
        self.ape = w.take(f"{prefix}.ape").float()  # [ratio, series * head_dim]
        self.norm = norm(w, f"{prefix}.norm.weight", cfg)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (any sequences' rows) -> each row's (kv, gate + its window slot's bias), [T, series *
        head_dim]: what `prefill` and `decode` pool."""
        return self.wkv(x), self.wgate(x).float() + self.ape[positions % self.ratio]

    def prefill(self, pool: CompressorPool, state: int, start: int, new_kv: torch.Tensor, new_gate: torch.Tensor,
                slots: torch.Tensor | None) -> None:
        """One sequence's projected rows (`project`) at positions start, start + 1, ..., in sequence slot `state`;
        slots [n]: where its entries 0 .. n - 1 live once these rows are in (None when there is none yet). The new
        rows join the unfinished window's; each window they complete is pooled into its entry."""
        ratio, d = self.ratio, self.head_dim
        base = start // ratio * ratio  # the unfinished window's first position
        first = base // ratio  # its number
        kv, gate = new_kv, new_gate
        if start > base:  # the window's rows from earlier steps (a window's rows are consecutive in the slot)
            row = pool.row(state, base)
            kv = torch.cat([pool.kv[row:row + start - base], new_kv])
            gate = torch.cat([pool.gate[row:row + start - base], new_gate])
        n = kv.shape[0] // ratio  # windows completed
        if n:
            windows, gates = kv[:n * ratio].view(n, ratio, -1), gate[:n * ratio].view(n, ratio, -1)
            prev_kv = prev_gate = None
            if self.overlap:  # each window after the previous one's first series (the slot's, for the first)
                # copies: the slot's are overwritten below
                before = pool.prev(state, first - 1)
                prev_kv, prev_gate = pool.prev_kv[before][None].clone(), pool.prev_gate[before][None].clone()
                if n > 1:
                    prev_kv = torch.cat([prev_kv, windows[:-1, :, :d]])
                    prev_gate = torch.cat([prev_gate, gates[:-1, :, :d]])
                for w in range(max(0, n - pool.windows), n):  # the last ones the slot keeps
                    keep = pool.prev(state, first + w)
                    pool.prev_kv[keep], pool.prev_gate[keep] = windows[w, :, :d], gates[w, :, :d]
            index = torch.arange(first, first + n, device=kv.device)
            self.store(pool, slots[first:first + n], self.pool(windows, gates, prev_kv, prev_gate, index))
        # the slot keeps the rows of the window still filling, and of the `windows - 1` before it which a step that
        # rewinds may pool again (rows from `base` on, one window at a time: each is consecutive in the slot)
        stop = base + kv.shape[0]
        for window_start in range(max(base, (stop // ratio - pool.windows + 1) * ratio), stop, ratio):
            at = max(window_start, start)  # rows before `start` are the slot's already
            count = min(window_start + ratio, stop) - at
            row = pool.row(state, at)
            pool.kv[row:row + count] = kv[at - base:at - base + count]
            pool.gate[row:row + count] = gate[at - base:at - base + count]

    def store(self, pool: CompressorPool, slots: torch.Tensor, entries: torch.Tensor) -> None:
        if self.rotation is not None and pool.entries.int8:
            entries = torch.matmul(entries.float(), self.rotation)
        pool.entries.write(slots, entries)

    def decode(self, pool: CompressorPool, group: V4Decode, entries: V4Entries, new_kv: torch.Tensor,
               new_gate: torch.Tensor) -> None:
        """The group's B projected rows ([B, series * head_dim], `project`; at most one per sequence completes a
        window) into their slots' unfinished windows; the windows these rows complete (entries.pool_rows) are
        pooled in one call, their entries written to their blocks."""
        ratio, d = self.ratio, self.head_dim
        ring = pool.row(group.state, group.positions)
        pool.kv.index_copy_(0, ring, new_kv)
        pool.gate.index_copy_(0, ring, new_gate)
        if entries.pool_rows is None:
            return
        states, index = group.state[entries.pool_rows], entries.pool_index  # [k]
        first_rows = pool.row(states, index * ratio)  # each window's rows are consecutive in its slot
        rows = (first_rows[:, None] + torch.arange(ratio, device=states.device)).flatten()
        kv = torch.index_select(pool.kv, 0, rows).view(-1, ratio, pool.kv.shape[1])  # [k, ratio, width]
        gate = torch.index_select(pool.gate, 0, rows).view(-1, ratio, pool.gate.shape[1])
        prev_kv = prev_gate = None
        if self.overlap:
            before, keep = pool.prev(states, index - 1), pool.prev(states, index)
            prev_kv, prev_gate = pool.prev_kv[before], pool.prev_gate[before]
            pool.prev_kv.index_copy_(0, keep, kv[:, :, :d].contiguous())
            pool.prev_gate.index_copy_(0, keep, gate[:, :, :d].contiguous())
        self.store(pool, entries.pool_slots, self.pool(kv, gate, prev_kv, prev_gate, entries.pool_index))

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None,
             prev_gate: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor:
        """n whole windows, kv and gate [n, ratio, series * head_dim] (overlap: prev_kv, prev_gate [n, ratio,
        head_dim], the first series of the window before each), index [n] the entries' numbers -> the entries
        [n, head_dim], normalized and rotated at position index * ratio."""
        d = self.head_dim
        if self.overlap:  # slots [n, 2 * ratio, d]: the previous window's first series, then this one's second
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)  # [n, d]
        cos, sin = self.rope(index * self.ratio)
        return rope_tail(self.norm(pooled), cos, sin)


class Indexer:
    """Lightning indexer: score_{t,s} = sum_h w_{t,h} relu(q_{t,h} . k_s) over its own compressed keys; each
    query keeps the top `index_topk` entries among those already complete. With an INT8 cache the products are
    A8C8, as V3.2's indexer computes them: keys stored rotated by a Hadamard matrix (dot products unchanged,
    outliers spread) and INT8 per key, queries rotated alike and quantized per token and head, INT8 x INT8 sums,
    the scales applied after."""

    def __init__(self, cfg: V4Config, w: RankWeights, prefix: str, rope: Rope, dtype: torch.dtype):
        self.cfg = cfg
        self.wq_b, self.weights_proj = Proj(w, f"{prefix}.wq_b", dtype), Proj(w, f"{prefix}.weights_proj", dtype)
        self.rotation = hadamard(cfg.index_head_dim, torch.float32, w.device)
        self.compressor = Compressor(cfg, w, f"{prefix}.compressor", cfg.csa_compress_rate, cfg.index_head_dim,
                                     True, rope, dtype, self.rotation)

    def project(self, x, q_resid, cos, sin, positions) -> tuple[torch.Tensor, ...]:
        """Any sequences' rows -> per row (queries [T, heads, dim], head weights [T, heads], the compressor's
        projected kv and gate): what `select` takes, one sequence's rows of each."""
        cfg = self.cfg
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        q = rope_tail(self.wq_b(q_resid).view(-1, heads, dim), cos[:, None], sin[:, None])
        head_weights = self.weights_proj(x).float() * heads**-0.5
        return q, head_weights, *self.compressor.project(x, positions)

    def keys(self, pool: CompressorPool, slots: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The keys at these entry slots ([...]): [..., dim] in the compute dtype, or from an INT8 cache as stored
        (int8 [..., dim], float32 scales [..., 1])."""
        return pool.entries.read_int8(slots) if pool.entries.int8 else pool.entries.read(slots)

    def dot(self, q: torch.Tensor, keys) -> torch.Tensor:
        """q [T, heads, dim] against one sequence's keys ([n, dim]) or q [B, heads, dim] against B sequences' ([B, n,
        dim]), keys as `keys` gives them -> float32 [T or B, heads, n] products."""
        if not isinstance(keys, tuple):
            return torch.matmul(q.float(), keys.float().transpose(-1, -2))
        k, k_scale = keys  # A8C8
        q_int8, q_scale = quantize_tokens(torch.matmul(q.float(), self.rotation))  # a scale per query and head
        if k.dim() == 2:
            return int8_scores(q_int8.flatten(0, 1), q_scale.flatten(0, 1), k, k_scale).view(*q.shape[:2], -1)
        return int8_scores(q_int8, q_scale, k, k_scale)

    def select(self, q, head_weights, keys, complete: torch.Tensor) -> torch.Tensor:
        """One sequence's rows of the queries and head weights (`project`), its compressed keys (`keys`), complete
        [T, n] bool (entry s pools only tokens <= t) -> chosen [T, n] bool."""
        dim = self.cfg.index_head_dim
        chosen = torch.zeros_like(complete)
        keys = keys if isinstance(keys, tuple) else keys.float()  # once, not per chunk (`dot` takes it as is)
        for part in query_chunks(q.shape[0], q.shape[1] * complete.shape[1]):  # the scores stay bounded
            scores = F.relu(self.dot(q[part], keys)) * dim**-0.5  # [T, heads, n]
            index = (scores * head_weights[part, :, None]).sum(dim=1).masked_fill(~complete[part], float("-inf"))
            chosen[part].scatter_(-1, topk_lowest_index(index, self.cfg.index_topk), True)  # ties: the lowest entry
        # early queries have fewer complete entries than index_topk: their extra picks are not complete
        return chosen & complete

    def select_decode(self, q: torch.Tensor, head_weights: torch.Tensor, keys,
                      valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """B rows (a decode group's): q [B, heads, dim], head_weights [B, heads], keys ([B, n, dim], `keys`)
        each row's sequence's compressed keys with this row pooled (all complete for it), padded (valid [B, n];
        None: none is) -> (the chosen entries [B, min(n, index_topk)] in entry order, the padding last; True where
        one is real). What `select` chooses for the row, in one call (a padded entry scores -inf, its pick is invalid).
        Exact ties (relu's zeros) break by entry order as in `select`; a GEMM whose blocking changes with the
        padded length may round a near-tie the other way, as any change of batch can on an accelerator."""
        dim = self.cfg.index_head_dim
        scores = F.relu(self.dot(q, keys)) * dim**-0.5  # [B, heads, n]
        index = (scores * head_weights[..., None]).sum(dim=1)
        if valid is None:
            top = topk_lowest_index(index, self.cfg.index_topk).sort(dim=-1).values  # ties as `select`
            return top, torch.ones_like(top, dtype=torch.bool)
        top = topk_lowest_index(index.masked_fill(~valid, float("-inf")), self.cfg.index_topk)
        # a padded pick sorts last: its index is pushed past every real one, then brought back in range
        n = index.shape[1]
        picked = top.masked_fill(~valid.gather(1, top), n).sort(dim=-1).values
        return picked.clamp(max=n - 1), picked < n


class Attention:
    def __init__(self, cfg: V4Config, w: RankWeights, prefix: str, ratio: int, ropes: dict, dtype: torch.dtype,
                 kernels: KernelSwitch):
        self.kernels = kernels  # --kernels: PyPTO's decode attention on its steps
        attn_type = attn_type_of(ratio)  # DeepSeek's rule: overlap and an indexer at ratio 4 only
        self.cfg, self.attn_type = cfg, attn_type
        self.rope = ropes["main"] if attn_type is AttnType.SLIDING else ropes["compress"]
        self.wq_a, self.wq_b = Proj(w, f"{prefix}.wq_a", dtype), Proj(w, f"{prefix}.wq_b", dtype)
        self.q_norm = norm(w, f"{prefix}.q_norm.weight", cfg)
        self.wkv = Proj(w, f"{prefix}.wkv", dtype)
        self.kv_norm = norm(w, f"{prefix}.kv_norm.weight", cfg)
        self.wo_a = GroupedProj(w, f"{prefix}.wo_a", cfg.o_groups, dtype)
        self.wo_b = Proj(w, f"{prefix}.wo_b", dtype)
        self.sinks = w.take(f"{prefix}.attn_sink").float()  # [heads]
        self.compressor = self.indexer = None
        if attn_type is not AttnType.SLIDING:
            self.ratio = ratio
            self.compressor = Compressor(cfg, w, f"{prefix}.compressor", self.ratio, cfg.head_dim,
                                         attn_type is AttnType.CSA, self.rope, dtype)
        if attn_type is AttnType.CSA:
            self.indexer = Indexer(cfg, w, f"{prefix}.indexer", self.rope, dtype)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, step: V4Step, pool: LayerPool) -> torch.Tensor:
        """x [T, hidden]: the step's rows, each sequence's (its seq.start .. stop) at consecutive positions
        continuing what the cache holds for it in this layer, `pool` -> [T, hidden]. The projections run once over
        all rows; a sequence's chunk of several rows attends alone (`prefill`), the one-row sequences (decode) and
        the short chunks of speculative decoding together, row by row, one call per group of them (`decode`)."""
        cfg = self.cfg
        T, heads, head_dim = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        cos, sin = self.rope(positions)  # [T, rope / 2]
        q_resid = self.q_norm(self.wq_a(x))  # [T, q_lora_rank]
        q = unweighted_rms_norm(self.wq_b(q_resid).view(T, heads, head_dim), cfg.rms_norm_eps)
        q = rope_tail(q, cos[:, None], sin[:, None])
        kv = rope_tail(self.kv_norm(self.wkv(x)), cos, sin)  # [T, head_dim]: the one key, also the value
        # the compressors' and the indexer's projections of every row, each sequence's rows pooled in its slot
        compress = () if self.compressor is None else self.compressor.project(x, positions)
        index = () if self.indexer is None else self.indexer.project(x, q_resid, cos, sin, positions)
        if step.state is not None:
            self.keep_state(step.state, pool, kv, [p for p in (compress, index[2:]) if p])
        out = q.new_empty(T, heads, head_dim)
        for prefill in step.prefills:
            # [S, heads, head_dim]: every head attends over the one key = value row per position, its sink too
            rows = slice(prefill.seq.start, prefill.seq.stop)
            keys, allowed = self.prefill(kv[rows], positions[rows], [t[rows] for t in compress],
                                         [t[rows] for t in index], prefill, pool)
            for part in query_chunks(rows.stop - rows.start, heads * keys.shape[0]):  # the scores stay bounded
                chunk = slice(rows.start + part.start, rows.start + part.stop)
                out[chunk] = attention(q[chunk].transpose(0, 1), keys, keys, head_dim**-0.5, allowed[part],
                                       sinks=self.sinks).transpose(0, 1)
        for group in step.decodes:
            rows = group.rows
            out[rows] = self.decode(q[rows], kv[rows], [t[rows] for t in compress], [t[rows] for t in index], group,
                                    pool)
        # the value carried its key's rotation: rotating back by the query's position leaves the relative one
        out = rope_tail(out, cos[:, None], -sin[:, None])
        grouped = self.wo_a(out.reshape(T, cfg.o_groups, heads * head_dim // cfg.o_groups))  # [T, groups, o_lora_rank]
        return self.wo_b(grouped.flatten(1))

    @staticmethod
    def keep_state(writes: V4StateWrites, pool: LayerPool, kv: torch.Tensor, projected: list[tuple]) -> None:
        """Prefix caching: the step's window keys and compressor rows (projected, one (kv, gate) per compressor of
        the layer) also written to the state blocks, as the slot keeps them (v4_cache.py)."""
        state = pool.state
        if state.block_size in writes.by_kept:
            rows, slots = writes.by_kept[state.block_size]
            state.window.write(slots, kv[rows])
        for kept, (new_kv, new_gate) in zip(state.compressors, projected, strict=True):
            if kept is None or kept.kept not in writes.by_kept:
                continue
            rows, slots = writes.by_kept[kept.kept]
            kept.kv.index_copy_(0, slots, new_kv[rows, :kept.width])
            kept.gate.index_copy_(0, slots, new_gate[rows, :kept.width])

    def decode(self, q: torch.Tensor, kv: torch.Tensor, compress: list[torch.Tensor], index: list[torch.Tensor],
               group: V4Decode, pool: LayerPool) -> torch.Tensor:
        """A decode group's B rows (V4Decode): their rows of the step's queries q [B, heads, head_dim], keys
        kv [B, head_dim] and the compressors' and indexer's projections -> [B, heads, head_dim].

        Every row goes into its slot (window, unfinished windows); the windows the rows complete are pooled in one
        call per compressor; then one indexer scoring and one attention call for all of them, over keys gathered
        from the cache. A decode query sees its window (the last sliding_window keys, itself included) and every
        compressed entry, all complete once its row is pooled; on CSA layers only the indexer's index_topk of them,
        in entry order as `prefill` keeps them. A short chunk's rows each see their sequence up to their own
        position: the rows before it were written by this group or an earlier one, those after it are outside its
        window and entries (v4_inputs.V4Inputs.batched_rows says why no write reaches a key a row sees)."""
        cfg, ring = self.cfg, pool.window_rows
        B = q.shape[0]
        pool.window.write(group.state * ring + group.positions % ring, kv)
        keys = [pool.window.read(group.window)]
        allowed = [group.window_valid]
        if self.compressor is not None:
            entries = group.entries[self.ratio]
            self.compressor.decode(pool.compressor, group, entries, *compress)
            if self.indexer is not None:  # the same ratio: the same entry slots
                self.indexer.compressor.decode(pool.indexer, group, entries, *index[2:])
            if entries.most and self.indexer is not None:  # each sequence's chosen entries, in entry order
                index_keys = self.indexer.keys(pool.indexer, entries.slots)
                top, real = self.indexer.select_decode(index[0], index[1], index_keys, entries.valid)
                keys.append(pool.compressor.entries.read(entries.slots.gather(1, top)))
                allowed.append(real)
            elif entries.most:
                keys.append(pool.compressor.entries.read(entries.slots))
                allowed.append(entries.valid if entries.valid is not None
                               else torch.ones(B, entries.most, dtype=torch.bool, device=q.device))
        keys, allowed = torch.cat(keys, dim=1), torch.cat(allowed, dim=1)  # [B, K, head_dim], [B, K]
        # each sequence's heads are its queries: [B, heads, head_dim] against its own keys, the masked ones out
        if self.kernels.on:  # PyPTO's decode attention (kernels/pypto/v4_attention.py)
            from dsconv.kernels.pypto.v4_attention import v4_decode_attention

            return v4_decode_attention(q, keys, allowed, self.sinks, cfg.head_dim**-0.5)
        return attention(q, keys, keys, cfg.head_dim**-0.5, allowed[:, None], sinks=self.sinks, one_token=True)

    def prefill(self, kv, positions, compress: list[torch.Tensor], index: list[torch.Tensor], prefill: V4Prefill,
                pool: LayerPool) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's chunk of S > 1 new rows (their keys kv [S, head_dim], positions, their rows of the
        compressor's and the indexer's projections) -> (keys [K, head_dim]: its sliding window, then its compressed
        entries; allowed [S, K]: which of them each query sees). Its rows go into the cache on the way."""
        window, state, ring = self.cfg.sliding_window, prefill.state, pool.window_rows
        stop = prefill.seq.context_len
        start = stop - kv.shape[0]
        first = max(0, start - window + 1)  # the first position the chunk's first query sees
        keys = pool.window.stored(kv)  # the chunk's own keys as the cache keeps them (INT8: rounded alike)
        if start > first:  # the window's earlier keys, from the slot (before this chunk's overwrite them)
            earlier = torch.arange(first, start, device=kv.device) % ring + state * ring
            keys = torch.cat([pool.window.read(earlier), keys])
        kept = max(start, stop - ring)  # the positions the slot keeps for the next steps
        pool.window.write(torch.arange(kept, stop, device=kv.device) % ring + state * ring, kv[kept - start:])
        key_positions = torch.arange(first, stop, device=positions.device)
        offset = positions[:, None] - key_positions[None, :]  # [S, K] query minus key position
        allowed = (offset >= 0) & (offset < window)
        if self.compressor is None:
            return keys, allowed
        slots = prefill.entries[self.ratio]
        self.compressor.prefill(pool.compressor, state, start, *compress, slots)
        if self.indexer is not None:  # its keys advance whether or not an entry exists yet
            self.indexer.compressor.prefill(pool.indexer, state, start, *index[2:], slots)
        if slots is not None:
            entries = pool.compressor.entries.read(slots)
            # entry s pools tokens [s * ratio, (s + 1) * ratio): visible once the query has passed them all
            entry = torch.arange(entries.shape[0], device=positions.device)
            complete = entry[None, :] < ((positions + 1) // self.ratio)[:, None]  # [S, n]
            if self.indexer is not None:
                complete = self.indexer.select(index[0], index[1], self.indexer.keys(pool.indexer, slots), complete)
            keys = torch.cat([keys, entries])
            allowed = torch.cat([allowed, complete], dim=-1)
        return keys, allowed


class MoE:
    def __init__(self, cfg: V4Config, w: RankWeights, prefix: str, mlp_type: MlpType, dist: Dist,
                 dtype: torch.dtype):
        self.cfg, self.dist = cfg, dist
        self.router = w.take(f"{prefix}.gate.weight")
        self.score = SCORE_FUNCS[cfg.scoring_func]
        self.tid2eid = self.bias = None
        if mlp_type is MlpType.HASH:
            self.tid2eid = w.take(f"{prefix}.gate.tid2eid")  # [vocab, k] int64
        else:
            self.bias = w.take(f"{prefix}.gate.bias").float()
        # expert and shared SwiGLUs clamp at swiglu_limit
        self.experts = RoutedExperts(w, f"{prefix}.experts", EXPERT_NAMES, cfg.n_routed_experts, dist, dtype,
                                     cfg.swiglu_limit)
        self.shared = GatedMLP(w, tuple(f"{prefix}.shared_experts.{name}" for name in EXPERT_NAMES), dtype,
                               cfg.swiglu_limit)

    def route(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hash layers: experts = tid2eid[token]; others: top-k of score + bias. Weights from the scores."""
        cfg = self.cfg
        if self.dist.kernels.on:  # PyPTO's gate (kernels/pypto/moe_gate.py)
            from dsconv.kernels.pypto.moe_gate import v4_gate

            return v4_gate(x, self.router, self.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                           self.tid2eid, tokens)
        scores = self.score(F.linear(x.float(), self.router.float()))  # [T, E]
        if self.tid2eid is not None:
            experts = self.tid2eid[tokens].long()
        else:
            experts = (scores + self.bias).topk(self.cfg.num_experts_per_tok, dim=-1).indices  # [T, k]
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(-1, keepdim=True) + ROUTER_NORM_EPS)  # transformers always renormalizes
        return experts, weights * self.cfg.routed_scaling_factor

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        share = attention_tp_share(self.dist, x)  # attention-TP ranks hold the same rows: each routes its share
        share_tokens = attention_tp_share(self.dist, tokens[:, None])[:, 0]
        experts, weights = self.route(share, share_tokens)
        out = expert_parallel(share, experts, weights, self.experts, self.dist, self.shared,  # routed + shared
                              distinct=self.tid2eid is None)
        return attention_tp_unshare(self.dist, out, x.shape[0])


class HyperConnection:
    """From the streams [T, m, D]: pre [T, m] collapses them into a block's input, post [T, m] spreads the
    block's output back, comb [T, m, m] (Sinkhorn-normalized) mixes the old streams. Computed in float32."""

    def __init__(self, cfg: V4Config, w: RankWeights, name: str):
        self.cfg = cfg
        self.fn = w.take(f"{name}_fn").float()  # [(2 + m) * m, m * D]
        self.base = w.take(f"{name}_base").float()  # [(2 + m) * m]
        self.scale = w.take(f"{name}_scale").float()  # [3]: pre, post, comb

    def __call__(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, m = self.cfg, self.cfg.hc_mult
        flat = streams.flatten(1).float()
        mixes = F.linear(unweighted_rms_norm(flat, cfg.rms_norm_eps), self.fn)  # [T, (2 + m) * m]
        pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
        pre_b, post_b, comb_b = self.base.split([m, m, m * m])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + cfg.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax((comb_w * self.scale[2] + comb_b).view(-1, m, m), dim=-1) + cfg.hc_eps
        # Sinkhorn-Knopp: alternately normalize columns and rows towards a doubly stochastic matrix (in place: the
        # same values as comb / (sum + eps), with fewer allocations in these 20 iterations of tiny calls)
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(cfg.hc_eps))
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb.div_(comb.sum(dim=-1, keepdim=True).add_(cfg.hc_eps))
            comb.div_(comb.sum(dim=-2, keepdim=True).add_(cfg.hc_eps))
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)  # [T, D]
        return post, comb, collapsed

    @staticmethod
    def merge(streams, post, comb, block_out) -> torch.Tensor:
        """new stream k = post_k * block_out + sum_j comb[j, k] * stream j  ->  [T, m, D]."""
        dtype = streams.dtype
        return post.to(dtype)[..., None] * block_out[:, None] + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead:
    """The final collapse of the streams (a "pre" mix only) before the model's norm (prefix "mtp.0.": the MTP
    layer's own)."""

    def __init__(self, cfg: V4Config, w: RankWeights, prefix: str = ""):
        self.cfg = cfg
        self.fn = w.take(f"{prefix}hc_head_fn").float()  # [m, m * D]
        self.base = w.take(f"{prefix}hc_head_base").float()  # [m]
        self.scale = w.take(f"{prefix}hc_head_scale").float()  # [1]

    def __call__(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.cfg.rms_norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.cfg.hc_eps  # [T, m]
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


class Block:
    def __init__(self, cfg: V4Config, w: RankWeights, layer: int, ropes: dict, dist: Dist, dtype: torch.dtype):
        """layer: a decoder layer (tensors layers.{layer}.*), or num_hidden_layers + i for MTP layer i's block
        (mtp.{i}.*: a MoE layer, its ratio the config's entry after the decoder layers')."""
        mtp = layer >= cfg.num_hidden_layers
        p = f"mtp.{layer - cfg.num_hidden_layers}" if mtp else f"layers.{layer}"
        mlp_type = MlpType.MOE if mtp else cfg.mlp_types[layer]
        self.hc_attn, self.hc_ffn = HyperConnection(cfg, w, f"{p}.hc_attn"), HyperConnection(cfg, w, f"{p}.hc_ffn")
        self.attn_norm = norm(w, f"{p}.attn_norm.weight", cfg)
        self.attn = Attention(cfg, w, f"{p}.attn", cfg.compress_ratios[layer], ropes, dtype, dist.kernels)
        self.ffn_norm = norm(w, f"{p}.ffn_norm.weight", cfg)
        self.ffn = MoE(cfg, w, f"{p}.ffn", mlp_type, dist, dtype)

    def __call__(self, streams, tokens, meta: StepMeta, pool: LayerPool) -> torch.Tensor:
        """Attention's keys come from each sequence's own rows and cache (none sees another's); everything else,
        the MoE's EP exchange included, runs once over all rows. A rank with no rows this step (an idle one, on CPU)
        only takes part in the exchange: nothing else of the layer has a row to compute or a collective to enter,
        and at world 16 the idle ranks' hundreds of zero-row ops a step were most of what their peers waited for."""
        if streams.shape[0] == 0:
            self.ffn(streams[:, 0], tokens)
            return streams
        post, comb, x = self.hc_attn(streams)
        x = self.attn_norm(x)
        streams = HyperConnection.merge(streams, post, comb, self.attn(x, meta.positions, meta.v4, pool))
        post, comb, x = self.hc_ffn(streams)
        return HyperConnection.merge(streams, post, comb, self.ffn(self.ffn_norm(x), tokens))


class MultiTokenPredictor:
    """DeepSeek-V4's MTP layer (`mtp.0.*`), as DeepSeek's own model.py computes it: at position t it takes the
    main model's final hyper-connection streams at t (before hc_head) and the embedding of the token at t + 1,
    and predicts the token at t + 2: e_proj(enorm(embedding)), added to every stream of h_proj(hnorm(streams));
    one block like the decoder layers' (hyper-connections, attention over its own cache layer, the cache's last,
    a MoE), then its own hc_head and norm before the main model's head. It shares the main model's embedding and
    head (the hub ships no copy of either under mtp.0; vllm-ascend's output format adds one, which the shards
    do not carry)."""

    def __init__(self, cfg: V4Config, w: RankWeights, ropes: dict, dist: Dist, dtype: torch.dtype):
        layer, p = cfg.num_hidden_layers, "mtp.0"
        self.enorm, self.hnorm = norm(w, f"{p}.enorm.weight", cfg), norm(w, f"{p}.hnorm.weight", cfg)
        self.e_proj, self.h_proj = Proj(w, f"{p}.e_proj", dtype), Proj(w, f"{p}.h_proj", dtype)
        self.block = Block(cfg, w, layer, ropes, dist, dtype)
        self.hc_head = HyperHead(cfg, w, f"{p}.")
        self.norm = norm(w, f"{p}.norm.weight", cfg)
        self.cache_layer = layer

    def __call__(self, model: DeepseekV4, streams: torch.Tensor, next_tokens: torch.Tensor, meta: StepMeta,
                 cache: V4Cache) -> torch.Tensor:
        """streams [T, m, D] the main model's (or the previous draft pass's) at meta's positions, next_tokens [T]
        the tokens one position later -> the MTP layer's streams [T, m, D] (its cache rows written on the way);
        `logits` gives its predictions."""
        model.dist.start_step(next_tokens.shape[0])
        e = self.enorm(model.embed(next_tokens).to(model.dtype))  # embedding TP: an exchange
        x = self.e_proj(e)[:, None] + self.h_proj(self.hnorm(streams))
        return self.block(x, next_tokens, meta, cache.layers[self.cache_layer])

    def logits(self, model: DeepseekV4, streams: torch.Tensor) -> torch.Tensor:
        return model.head(self.norm(self.hc_head(streams)))


class DeepseekV4:
    def __init__(self, cfg: V4Config, w: RankWeights, dist: Dist, dtype: torch.dtype, mtp: bool = False):
        """mtp: load the checkpoint's MTP layer (speculative decoding); without it its tensors are dropped."""
        if dist.attn_tp != 1:
            raise ValueError(f"attn_tp={dist.attn_tp}: DeepSeek-V4 attention TP is not implemented yet")
        self.cfg, self.dist, self.dtype = cfg, dist, dtype
        ropes = {"main": Rope(cfg.qk_rope_head_dim, cfg.rope_theta, None, dist.device),
                 "compress": Rope(cfg.qk_rope_head_dim, cfg.compress_rope_theta, _yarn_dict(cfg), dist.device)}
        table = w.take("embed.weight")
        self.embed = VocabParallelEmbedding(table, cfg.vocab_size, dist)
        self.layers = [Block(cfg, w, layer, ropes, dist, dtype) for layer in range(cfg.num_hidden_layers)]
        self.hc_head = HyperHead(cfg, w)
        self.norm = norm(w, "norm.weight", cfg)
        head = table if cfg.tie_word_embeddings else w.take("head.weight")
        # [vocab / tp, hidden]: this rank's vocabulary rows
        self.head = ParallelLMHead(Proj.of(head.to(dtype), None), cfg.vocab_size, dist)
        self.mtp = MultiTokenPredictor(cfg, w, ropes, dist, dtype) if mtp else None
        for name in [n for n in w.tensors if n.startswith("mtp.")]:
            w.discard(name)  # the MTP layer's, when it is not asked for (or a second one, which it chains instead)
        w.finish()
        self.hidden: torch.Tensor | None = None  # with mtp: the last forward's final streams [T, m, D]
        # observe(layer index, its output streams [T, hc_mult, hidden]) after each layer and observe("logits",
        # logits): set by `dsrun compare` on the rank that records
        self.observe: Callable[[int | str, torch.Tensor], None] | None = None

    def forward(self, tokens: torch.Tensor, meta: StepMeta, cache: V4Cache, rows: torch.Tensor | None = None,
                draws: list[list[Draw]] | None = None) -> torch.Tensor:
        """The step function (the interface of deepseek_v3.py's DeepseekV3.forward): tokens [T] are this step's new tokens, laid out as meta
        says, each sequence continuing what `cache` holds for it -> logits [len(rows) or T, vocab] of those rows;
        draws (per attention-DP index, one per row): their drawn tokens [len(rows) or T] (ParallelLMHead: candidates,
        not slices of the vocabulary, travel).

        Every rank enters each layer's EP exchange and the lm_head gather exactly once per step, whatever
        its number of sequences (zero included)."""
        with self.dist.kernels.step(meta.seqs):
            return self._forward(tokens, meta, cache, rows, draws)

    def _forward(self, tokens: torch.Tensor, meta: StepMeta, cache: V4Cache, rows: torch.Tensor | None,
                 draws: list[list[Draw]] | None) -> torch.Tensor:
        self.dist.start_step(tokens.shape[0])
        x = self.embed(tokens).to(self.dtype)  # [T, D]; embedding TP: an exchange
        streams = x[:, None].expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, m, D]: m copies
        for layer, block in enumerate(self.layers):
            streams = block(streams, tokens, meta, cache.layers[layer])
            if self.observe is not None:
                self.observe(layer, streams)
        if self.mtp is not None:
            self.hidden = streams
        if rows is not None:
            streams = streams[rows]  # the rest of the head is per row
        h = self.norm(self.hc_head(streams))
        logits = self.head(h, draws)  # [rows, vocab]: lm_head TP, gathered to full vocabulary
        if self.observe is not None:
            self.observe("logits", logits)
        return logits
