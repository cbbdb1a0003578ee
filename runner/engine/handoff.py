"""The block pools' side of P/D disaggregation (engine/kv_transfer.py says how the hand-over runs), on rank 0:

- a producer's **lease**: when a request that hands over ends, the published blocks of its prompt (and, for
  DeepSeek-V4, the state blocks of that boundary) are held by a lease of their own, so no other sequence is given
  them, until the consumer confirms or the lease runs out;
- a consumer's **load plan**: for a request arriving with a signed offer, the blocks of the usable prefix that its
  DP rank's pool already publishes are adopted as a prefix hit; the others (and the state blocks the hit's restore
  needs) get fresh blocks, which the ranks fill from the producer and the pool then publishes under the offer's
  hashes, once the producer has said that the lease held for the whole read.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from dsconv.errors import InputError
from dsconv.runner.engine.block_pool import BlockPool, StatePool, block_hashes
from dsconv.runner.engine.kv_auth import AuthKey
from dsconv.runner.engine.kv_transfer import Offer
from dsconv.runner.models.kv_cache import Restore


@dataclass
class Lease:
    transfer_id: str
    holder: int  # the pseudo-sequence whose table holds the blocks (a sequence id no request has)
    dp_rank: int
    expires: float  # time.monotonic()
    expires_at: float  # the same moment as time.time(), which the offer carries to the consumer


def offered(pool: BlockPool, states: StatePool | None, hashes: list[bytes], prompt_len: int, state_start
            ) -> tuple[int, list[int], list[tuple[int, int]]]:
    """A finished producer request's prompt as it can be handed over -> (full blocks, their published blocks, the
    boundary's (block index, state block) pairs). Every full block but the one holding the prompt's last token
    (whose logits the consumer computes), cut back, for a cache that needs state, to the longest boundary whose
    state blocks are published."""
    blocks = pool.match(hashes[:(prompt_len - 1) // pool.block_size])
    if states is None:
        return len(blocks), blocks, []
    for count in range(len(blocks), 0, -1):
        pairs = states.find(hashes[:count], state_start(count * pool.block_size) // pool.block_size)
        if pairs is not None:
            return count, blocks[:count], pairs
    return 0, [], []


def open_lease(pool: BlockPool, states: StatePool | None, holder: int, dp_rank: int, blocks: list[int],
               pairs: list[tuple[int, int]], lease_s: float) -> Lease:
    """Holds the blocks and state blocks under `holder` until the lease is closed."""
    pool.adopt(holder, blocks)
    if states is not None:
        states.read(holder, [block for _, block in pairs])
    return Lease(uuid.uuid4().hex, holder, dp_rank, time.monotonic() + lease_s, time.time() + lease_s)


def close_lease(pool: BlockPool, states: StatePool | None, lease: Lease) -> None:
    pool.release(lease.holder)
    if states is not None:
        states.done_reading(lease.holder)


def check_offer(offer: Offer, prompt_ids: list[int], block_size: int, salt: str | None, key: AuthKey) -> None:
    """InputError unless a producer holding our key signed the offer, its lease has not ended, and its blocks are
    this prompt's first blocks, in this server's block size."""
    if not key.verify(offer.payload(), offer.signature):
        raise InputError("kv_transfer_params are not signed by a producer sharing this server's auth key: pass the "
                         "producer's kv_transfer_params on unaltered (as `dsrun router` does)")
    if offer.expires_at <= time.time():
        raise InputError(f"kv_transfer_params: the producer's lease on transfer {offer.transfer_id} has ended")
    if offer.block_size != block_size:
        raise InputError(f"the producer's blocks are {offer.block_size} tokens, this server's {block_size}: run "
                         f"both with the same --block-size")
    usable = min(len(offer.hashes), (len(prompt_ids) - 1) // block_size)
    if list(offer.hashes[:usable]) != block_hashes(prompt_ids[:usable * block_size], block_size, salt):
        raise InputError("kv_transfer_params are not this prompt's: the producer hashed other tokens (P and D must "
                         "serve the same model, tokenizer and request)")


@dataclass(frozen=True)
class LoadPlan:
    """A consumer request's prefix: `length` tokens, from P the (P block, our block) and (P state block, our state
    block) pairs to read; restore: the state pairs its first step restores (DeepSeek-V4)."""
    length: int
    blocks: tuple[tuple[int, int], ...]
    state: tuple[tuple[int, int], ...]
    restore: tuple[tuple[int, int], ...]
    local: int  # of its blocks, those its DP rank's pool already published


def plan_load(pool: BlockPool, states: StatePool | None, seq_id: int, hashes: list[bytes], prompt_len: int,
              offer: Offer, state_start) -> LoadPlan | None:
    """Takes the blocks a consumer request's prefix needs (its table starts with them) -> the plan; None when
    there is nothing to read (the pool holds it all: an ordinary prefix hit) or no room for it now (the request
    then computes its prompt). The offer is this prompt's (`check_offer`)."""
    size = pool.block_size
    usable = min(len(offer.hashes), (prompt_len - 1) // size)
    local = pool.match(hashes[:usable])
    indices = range(state_start(usable * size) // size, usable) if states is not None else range(0)
    offered_state = dict(offer.state)
    if any(hashes[i] not in states.cached and i not in offered_state for i in indices):
        usable, indices = len(local), range(0)  # the offer lacks a state block: no boundary past our own hit
    fresh_state = [i for i in indices if hashes[i] not in states.cached]
    if usable == len(local) and not fresh_state:
        return None
    if usable - len(local) > pool.num_free - sum(1 for b in local if b in pool.evictable) or \
            (fresh_state and len(fresh_state) > states.num_free):
        return None
    pool.adopt(seq_id, local)
    taken = [pool.take(seq_id) for _ in range(usable - len(local))]
    restore, state_pairs = [], []
    for i in indices:
        if i in fresh_state:
            block = states.take_for(seq_id)
            state_pairs.append((offered_state[i], block))
        else:
            block = states.cached[hashes[i]]
            states.read(seq_id, [block])
        restore.append((i, block))
    return LoadPlan(usable * size, tuple(zip(offer.blocks[len(local):usable], taken)), tuple(state_pairs),
                    tuple(restore), len(local))


def finish_load(pool: BlockPool, states: StatePool | None, seq_id: int, hashes: list[bytes], plan: LoadPlan
                ) -> Restore | None:
    """The plan's blocks arrived: published under their hashes -> the restore its first step runs (V4)."""
    count = plan.length // pool.block_size
    pool.publish(seq_id, hashes[:count])
    if states is None:
        return None
    received = {block for _, block in plan.state}
    for index, block in plan.restore:
        if block in received:
            states.put(hashes[index], block)
    return Restore(seq_id, plan.length, plan.restore) if plan.restore else None


def drop_load(pool: BlockPool, states: StatePool | None, seq_id: int) -> None:
    """The plan's blocks did not arrive (or the request went): every block it took or held let go."""
    pool.release(seq_id)
    if states is not None:
        states.done_reading(seq_id)
