"""Paged KV cache bookkeeping: blocks, ref counts, block tables and the prefix cache.

A block holds ``block_size`` consecutive tokens of one sequence.  When a block is
full and computed it gets a hash = hash(parent block's hash, its token ids, extra
keys) and is registered in ``hash_to_block``; another sequence with the same prefix
then reuses it (ref count + 1) instead of recomputing.  A block whose ref count
drops to 0 goes to the free list but keeps its hash, so it can still be hit until it
is handed out again; the free list is in LRU order (the oldest freed is reused first;
blocks without a hash go to the front since nothing can hit them).
"""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class Block:
    __slots__ = ("block_id", "hash", "ref_count")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Prefix-cache counters in tokens, as vLLM counts them.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------- prefix lookup

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids for the longest computed prefix of ``seq``.

        At least the last token is always left to compute (its logits are needed), so
        only blocks ending before it can hit.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block.get(seq.block_hash(i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> int:
        """Free blocks taken if ``seq`` computes ``num_new_tokens`` more (after attaching ``cached``)."""
        have = len(seq.block_table)
        extra = 0
        if cached:
            have += len(cached)
            extra = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # they leave the free list
        total = seq.num_computed_tokens + (len(cached) * self.block_size if cached else 0) + num_new_tokens
        return max(0, self.blocks_for(total) - have) + extra

    # ------------------------------------------------------------- allocation

    def attach_cached(self, seq: Sequence, cached: list[int]) -> None:
        """Start ``seq``'s block table with prefix-cache hits (ref count + 1 each)."""
        assert not seq.block_table
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_registered_blocks = len(cached)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError("out of KV blocks (the scheduler should have checked)")
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            self._forget(block)  # evict: this cached content is gone
            block.ref_count = 1
            seq.block_table.append(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of ``seq``'s blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            h = seq.block_hash(i)
            if h not in self.hash_to_block:  # two sequences may have computed the same block
                block.hash = h
                self.hash_to_block[h] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def reset_prefix_cache(self) -> int:
        """Forget the cached content of every free block (as vLLM's ``reset_prefix_cache``), so the
        next requests compute their prompts again; blocks in use keep theirs.  Returns how many
        blocks were forgotten."""
        return sum(self._forget(self.blocks[block_id]) for block_id in self.free)

    def _forget(self, block: Block) -> bool:
        """Drop ``block``'s cached content from the prefix cache; whether it had any."""
        if block.hash is None:
            return False
        if self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash = None
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; the tail is freed first so it is evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
