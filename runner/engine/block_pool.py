"""The KV cache's one allocator: one attention-DP rank's cache blocks, which are free and which each sequence
holds (its block table, in position order). The scheduler keeps one pool per DP rank and writes each step's
tables and slots into the Batch; the ranks' caches are storage that take them as given.

A sample forked from another (n > 1) shares the full blocks of the prompt they have in common, which neither
writes again (a sequence writes only at positions past its context, and a recomputed one into new blocks); a
block returns to the free list when the last table holding it lets it go."""

from __future__ import annotations

from dsconv.errors import InputError


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: blocks 0, 1, ... go first
        self.tables: dict[int, list[int]] = {}
        self.holders = [0] * num_blocks  # how many tables hold each block

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
        if need > len(self.free):
            raise InputError(f"the KV cache holds {self.capacity_tokens} tokens; sequence {seq_id} needs {tokens} "
                             f"(raise --cache-tokens or shorten the prompt)")
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._take())
        return table

    def _take(self) -> int:
        block = self.free.pop()
        self.holders[block] = 1
        return block

    def fork(self, parent: int, child: int, tokens: int) -> list[tuple[int, int]] | None:
        """child's table for the first `tokens` tokens of parent's -> the (parent block, child block) pairs
        whose contents the ranks copy; None when the free blocks do not suffice (nothing is taken). The full
        blocks are shared; only a partial last block is copied."""
        source = self.tables[parent][:self.blocks_for(tokens)]
        shared = source[:tokens // self.block_size]
        own = source[len(shared):]
        if len(own) > len(self.free):
            return None
        for block in shared:
            self.holders[block] += 1
        copies = [(block, self._take()) for block in own]
        self.tables[child] = shared + [block for _, block in copies]
        return copies

    def release(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id, [])):
            self.holders[block] -= 1
            if not self.holders[block]:
                self.free.append(block)

    @property
    def used_fraction(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks
