"""The KV cache's one allocator: one attention-DP rank's cache blocks, which are free and which each sequence
holds (its block table, in position order). The scheduler keeps one pool per DP rank and writes each step's
tables and slots into the Batch; the ranks' caches are storage that take them as given.

A sample forked from another (n > 1) shares the full blocks of the prompt they have in common, which neither
writes again (a sequence writes only at positions past its context, and a recomputed one into new blocks); a
block returns to the free blocks when the last table holding it lets it go.

Prefix caching (vLLM's automatic prefix caching, at block granularity): a full block whose entries have been
computed is published under its hash (`block_hashes`: a chain over the parent block's hash, the block's token ids
and the request's cache_salt). A new sequence whose first blocks' hashes are published starts its table with those
blocks (`adopt`) and computes only the rest. A published block nobody holds stays in the pool with its entries
(`evictable`, least recently released first) and is given out again, its hash forgotten, only when no never-used
or forgotten block is left. A block's entries are never written again while it is published: a sequence writes
only past its context, and its own full blocks are published only after the step that wrote them."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

from dsconv.errors import InputError

HASH_BYTES = 16  # of sha256: a block's identity (collisions at 2^-64 per pair of blocks)
TOKEN_BYTES = 4  # a token id in the hashed bytes (little-endian; vocabularies stay below 2^32)
# A first block's hash starts from ROOT and its salt's length, a later block's from PARENT and its parent's hash, so
# no salt (a client's text) can make a first block hash as another chain's later block, or two salts collide
ROOT, PARENT, SALT_LENGTH_BYTES = b"\x00", b"\x01", 8
# The chain's version: KV offload's directories record it (files named by another scheme are another run's), and P
# and D must hash alike (an offer's hashes are checked against the consumer's own)
BLOCK_HASH_SCHEME = "sha256-salt-length-v2"


def salt_root(salt: str | None) -> bytes:
    """What a chain's first block hash starts from: ROOT, the salt's UTF-8 length, the salt."""
    data = (salt or "").encode()
    return ROOT + len(data).to_bytes(SALT_LENGTH_BYTES, "little") + data


def block_hashes(tokens: list[int], block_size: int, salt: str | None = None, known: list[bytes] = ()) -> list[bytes]:
    """The hashes of `tokens`' full blocks, each over its parent's hash, its token ids and the salt (a request's
    cache_salt: requests with different salts share no block). known: the hashes of the first blocks, already
    computed (extended, not recomputed)."""
    hashes = list(known)
    for i in range(len(hashes), len(tokens) // block_size):
        digest = hashlib.sha256(PARENT + hashes[-1] if hashes else salt_root(salt))
        digest.update(b"".join(t.to_bytes(TOKEN_BYTES, "little") for t in tokens[i * block_size:(i + 1) * block_size]))
        hashes.append(digest.digest()[:HASH_BYTES])
    return hashes


class CachedBlocks:
    """What BlockPool and StatePool share: blocks that are free, held (by how many), or published under a hash and
    kept while nobody holds them (`evictable`, least recently let go first) until given out again, their hash
    forgotten, only when no never-used or forgotten block is left. on_evict(block, hash) is called just before a
    published block is given out again (KV offload saves it first)."""

    def __init__(self, num_blocks: int, block_size: int, on_evict: Callable[[int, bytes], None] | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # never used or forgotten; popped from the end: 0, 1, ...
        self.holders = [0] * num_blocks  # how many holders (tables, restores) each block has
        self.cached: dict[bytes, int] = {}  # a published block by its hash
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # published blocks nobody holds, oldest first
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Blocks that can be taken: the free ones and the published ones nobody holds."""
        return len(self.free) + len(self.evictable)

    def _take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:  # the least recently let go published block: its entries are given up
            block, _ = self.evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block, self.hash_of[block])
            del self.cached[self.hash_of[block]]
            self.hash_of[block] = None
        self.holders[block] = 1
        return block

    def _hold(self, block: int) -> None:
        """One more holder of a block (published or held already): it is not given out while held."""
        self.holders[block] += 1
        self.evictable.pop(block, None)

    def _let_go(self, block: int) -> None:
        self.holders[block] -= 1
        if not self.holders[block]:
            if self.hash_of[block] is None:
                self.free.append(block)
            else:
                self.evictable[block] = None  # the most recently let go last

    def _publish_one(self, block: int, digest: bytes) -> None:
        """A filled block published under its hash, unless it stands for one already or another block stands for
        this hash (that block is kept)."""
        if self.hash_of[block] is None and digest not in self.cached:
            self.cached[digest], self.hash_of[block] = block, digest


class BlockPool(CachedBlocks):
    def __init__(self, num_blocks: int, block_size: int, on_evict: Callable[[int, bytes], None] | None = None):
        super().__init__(num_blocks, block_size, on_evict)
        self.tables: dict[int, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def missing(self, seq_id: int, tokens: int) -> int:
        """Blocks seq_id lacks to hold `tokens` tokens."""
        return max(0, self.blocks_for(tokens) - len(self.tables.get(seq_id, ())))

    def grow(self, seq_id: int, tokens: int) -> list[int]:
        """seq_id's block table, grown to hold `tokens` tokens (the scheduler checks `missing` first)."""
        need = self.missing(seq_id, tokens)
        if need > self.num_free:
            raise InputError(f"the KV cache holds {self.capacity_tokens} tokens; sequence {seq_id} needs {tokens} "
                             f"(raise --cache-tokens or shorten the prompt)")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._take())
        return table

    def take(self, seq_id: int) -> int:
        """One more block at the end of seq_id's table (the scheduler checks num_free first)."""
        block = self._take()
        self.tables[seq_id].append(block)
        return block

    def match(self, hashes: list[bytes]) -> list[int]:
        """The published blocks of the longest prefix of `hashes`."""
        blocks = []
        for digest in hashes:
            block = self.cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def adopt(self, seq_id: int, blocks: list[int]) -> None:
        """A new sequence's table starts with these published blocks (`match`), held like its own."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        for block in blocks:
            self._hold(block)
        self.tables[seq_id] = list(blocks)

    def adopt_with(self, seq_id: int, blocks: list[int | None]) -> list[int] | None:
        """A new sequence's table from published blocks and, where `blocks` has None, fresh ones (KV offload fills
        them from the host tier before the step reads them) -> the table; None when the free blocks do not suffice
        (nothing is taken)."""
        held = [block for block in blocks if block is not None]
        if len(blocks) - len(held) > self.num_free - sum(1 for block in set(held) if block in self.evictable):
            return None
        self.adopt(seq_id, held)
        self.tables[seq_id] = [block if block is not None else self._take() for block in blocks]
        return self.tables[seq_id]

    def publish(self, seq_id: int, hashes: list[bytes]) -> None:
        """seq_id's first len(hashes) blocks are full and computed: each is published under its hash (a hash that
        another block already stands for keeps that block)."""
        for block, digest in zip(self.tables[seq_id], hashes):
            self._publish_one(block, digest)

    def fork(self, parent: int, child: int, tokens: int) -> list[tuple[int, int]] | None:
        """child's table for the first `tokens` tokens of parent's -> the (parent block, child block) pairs
        whose contents the ranks copy; None when the free blocks do not suffice (nothing is taken). The full
        blocks are shared; only a partial last block is copied."""
        source = self.tables[parent][:self.blocks_for(tokens)]
        shared = source[:tokens // self.block_size]
        own = source[len(shared):]
        if len(own) > self.num_free:
            return None
        for block in shared:
            self.holders[block] += 1
        copies = [(block, self._take()) for block in own]
        self.tables[child] = shared + [block for _, block in copies]
        return copies

    def release(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id, [])):
            self._let_go(block)

    @property
    def used_fraction(self) -> float:
        return 1.0 - self.num_free / self.num_blocks


class StatePool(CachedBlocks):
    """DeepSeek-V4's state blocks (runner/models/v4_cache.py): per block of a sequence's tokens, the rows a
    sequence slot holds of them (window keys, compressor rows), which a prefix hit copies into a new sequence's slot.
    A running sequence holds the state blocks its steps write (`hold`), only for blocks it writes from their first
    position; once a block is full and computed its state block is published under the block's hash and let go
    (`publish`), to stay until evicted, least recently used first. A hit at a block boundary needs the published
    state blocks of the positions it restores (`find`), held from the lookup until the step that restores them
    has run (`read` .. `done_reading`)."""

    def __init__(self, num_blocks: int, block_size: int, on_evict: Callable[[int, bytes], None] | None = None):
        super().__init__(num_blocks, block_size, on_evict)
        self.held: dict[int, dict[int, int]] = {}  # seq_id -> block index -> the state block it writes
        self.reading: dict[int, list[int]] = {}  # seq_id -> the published state blocks its restore copies

    def hold(self, seq_id: int, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """The state blocks seq_id writes feeding positions start .. stop - 1: those it holds, and new ones for
        the blocks it writes from their first position while any is left -> (block index, state block) pairs."""
        held = self.held.setdefault(seq_id, {})
        for index in range(start // self.block_size, -(-stop // self.block_size)):
            if index not in held and index * self.block_size >= start and self.num_free:
                held[index] = self._take()
        return tuple((index, block) for index, block in sorted(held.items())
                     if start // self.block_size <= index < -(-stop // self.block_size))

    def publish(self, seq_id: int, hashes: list[bytes]) -> None:
        """seq_id's blocks 0 .. len(hashes) - 1 are full and computed: the state blocks it holds for them are
        published under their hashes (unless one stands for a hash already) and let go."""
        held = self.held.get(seq_id, {})
        for index in [i for i in held if i < len(hashes)]:
            block = held.pop(index)
            self._publish_one(block, hashes[index])
            self._let_go(block)

    def find(self, hashes: list[bytes], first: int) -> list[tuple[int, int]] | None:
        """The published state blocks of blocks first .. len(hashes) - 1 (hashes: a prefix's blocks), as (block
        index, state block) pairs; None when one is missing."""
        pairs = []
        for index in range(first, len(hashes)):
            block = self.cached.get(hashes[index])
            if block is None:
                return None
            pairs.append((index, block))
        return pairs

    def read(self, seq_id: int, blocks: list[int]) -> None:
        """seq_id's restore copies these published blocks (besides any it reads already): none is given out until
        `done_reading`."""
        for block in blocks:
            self._hold(block)
        self.reading.setdefault(seq_id, []).extend(blocks)

    def take_for(self, seq_id: int) -> int:
        """A fresh state block that seq_id's restore reads once it is filled (P/D: from the producer's, then `put`);
        let go with the blocks it reads."""
        block = self._take()
        self.reading.setdefault(seq_id, []).append(block)
        return block

    def put(self, digest: bytes, block: int) -> None:
        """A filled state block published under its block's hash (unless another stands for it)."""
        self._publish_one(block, digest)

    def done_reading(self, seq_id: int) -> None:
        for block in self.reading.pop(seq_id, []):
            self._let_go(block)

    def release(self, seq_id: int) -> None:
        """A finished or preempted sequence: its unpublished state blocks are free again."""
        for block in self.held.pop(seq_id, {}).values():
            self._let_go(block)
        self.done_reading(seq_id)
