"""The pool of KV-cache blocks: ids, reference counts, an O(1) free queue and the prefix-cache index.

Every physical block of the KV tensor is one ``KVCacheBlock``. A block is either *free* (ref_cnt == 0, linked
into the free queue) or *in use* (ref_cnt > 0, reachable from at least one request's block table). The free
queue is a doubly linked list so that a block can be taken out of the middle in O(1), and so that freed blocks
go to the tail (last to be reused) while allocation pops the head: the queue is the LRU order of eviction.

Prefix caching: a full block may carry ``block_hash`` (see kv_cache_manager) and be listed in ``cached``. When
its last request ends it stays in the free queue *with* its hash, still findable; ``touch`` revives it (out of
the queue, ref + 1). Only when ``allocate`` pops it for new tokens is the hash dropped (lazy eviction).

    head <-> b7 <-> b2 <-> b9 <-> tail        popleft() -> b7;  append(b4) -> ... b9 <-> b4 <-> tail
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel ends; append, popleft and remove are O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("no free block")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """Owns all blocks. ``allocate`` hands out free blocks with ref_cnt 1; ``free`` drops one reference per
    block and returns a block to the free queue when its count reaches zero."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.peak_used = 0
        self.num_evictions = 0
        # Blocks with this id or above have never been handed out (the free queue starts in id order and freed
        # blocks go to its tail, so fresh blocks leave it lowest id first): the KV cache's memory there may still
        # be unmapped, and holds nothing (ModelRunner.prefault_blocks).
        self.first_unused = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take n free blocks (all or none)."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            assert b.ref_cnt == 0, f"{b} was in the free queue with references"
            if b.block_hash is not None:  # evict: its old contents are about to be overwritten
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
                self.num_evictions += 1
            b.ref_cnt = 1
            self.first_unused = max(self.first_unused, b.block_id + 1)
            out.append(b)
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return out

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cached blocks, reviving those that sat free in the queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
        self.peak_used = max(self.peak_used, self.num_used_blocks)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Make a full, in-use block findable by its hash (the first block with a given hash wins)."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def incref(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference per entry (all or nothing)."""
        for b in blocks:
            if b.ref_cnt == 0:
                raise ValueError(f"{b} is free; take it with allocate()")
        for b in blocks:
            b.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference per entry (all or nothing); pass a request's blocks tail-first so that its tail is
        reused first."""
        drops = Counter(blocks)
        for b, n in drops.items():
            if b.ref_cnt < n:
                raise ValueError(f"double free of {b}")
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)
