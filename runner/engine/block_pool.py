"""The KV cache's one allocator: one attention-DP rank's cache blocks, which are free and which each sequence
holds (its block table, in position order). The scheduler keeps one pool per DP rank and writes each step's
tables and slots into the Batch; the ranks' caches are storage that take them as given."""

from __future__ import annotations

from dsconv.errors import InputError


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: blocks 0, 1, ... go first
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
        if need > len(self.free):
            raise InputError(f"the KV cache holds {self.capacity_tokens} tokens; sequence {seq_id} needs {tokens} "
                             f"(raise --cache-tokens or shorten the prompt)")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.free.pop() for _ in range(need))
        return table

    def release(self, seq_id: int) -> None:
        self.free.extend(reversed(self.tables.pop(seq_id, [])))

    @property
    def used_fraction(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks
