"""KV cache manager: grows and frees requests' block tables on top of the block pool; prefix caching.

Blocks are allocated on demand: a request holds exactly ``ceil(tokens_in_cache / block_size)`` blocks, never a
reservation for its maximum length. The scheduler asks for slots before each step and frees them when a
request finishes, is aborted or is preempted.

Prefix caching (``enable_prefix_caching``): every full block of a request gets a hash chained from its parent's:
``h_i = sha256(h_{i-1} || tokens_i)``, with ``h_{-1} = sha256(salt)``. SHA-256 makes a collision (two different
token prefixes sharing a block) practically impossible, so a hit is an exact match. A new request reuses the
longest run of cached blocks that match its tokens, but never all of them: at least the last token is computed,
so the step that admits it produces logits. Full blocks are registered when they are scheduled to be filled.

Forks (beam search, parallel sampling): a request can start from another's computed tokens (``fork``). It takes a
reference on each of the parent's blocks, the last, partial one included, and computes only what it adds. The
first sequence to write into a partial block that others also hold gets its own copy first (copy-on-write, in
``allocate_slots``): the copy is queued in ``copies`` for the runner, which performs it before the step's forward
pass. Only a fork shares a partial block; the prefix cache shares full blocks, which no one writes. (A fork of
fewer tokens than its parent computed can hold, as its partial block, one that the parent filled and the cache
lists: it copies that one too, even as its only holder.)
"""
from __future__ import annotations

import hashlib
from array import array

from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_hash(salt: str | None) -> bytes:
    return hashlib.sha256(b"pagellm-prefix:" + (salt or "").encode()).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # Swap preemption: a second pool of blocks in host memory (None when preemption is by recompute).
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks > 0 else None
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # of which found in the cache
        self.copies: list[tuple[int, int]] = []  # (source, destination) block copies for the next step
        self.num_copies = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The request's chained block hashes, extended to ``num_full_blocks`` full blocks."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(request.cache_salt)
            hashes.append(hash_block(parent, request.token_at(i * bs, (i + 1) * bs)))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Cached blocks matching the start of a request that has nothing computed (admission)."""
        if not self.enable_prefix_caching or request.num_computed_tokens or request.prompt_logprobs_pending:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size  # leave at least one token to compute
        hits = []
        for h in self._hashes(request, max_blocks):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones.

        ``computed_blocks`` (admission only) are prefix-cache hits: they become the head of the block table and
        count as computed. Returns False (changing nothing) when the pool has too few free blocks.
        """
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(request.blocks) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # they leave the free queue
        shared = self._shared_partial(request) if num_new_tokens > 0 else None
        if max(need, 0) + revived + (shared is not None) > self.pool.num_free_blocks:
            return False
        if shared is not None:  # copy-on-write: this request is about to write into a block that others hold
            copy = self.pool.allocate(1)[0]
            self.copies.append((request.blocks[shared].block_id, copy.block_id))
            self.num_copies += 1
            self.pool.free([request.blocks[shared]])
            request.blocks[shared] = copy
        if self.enable_prefix_caching and request.num_computed_tokens == 0:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed_blocks) * self.block_size
            request.num_cached_prompt_tokens = len(computed_blocks) * self.block_size
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.blocks = list(computed_blocks)
            request.num_cached_blocks = len(computed_blocks)
            request.num_computed_tokens = num_computed
        if need > 0:
            request.blocks.extend(self.pool.allocate(need))
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, (num_computed + num_new_tokens) // self.block_size)
        return True

    def _shared_partial(self, request: Request) -> int | None:
        """Index of the request's partly filled last block when another sequence holds it too, or when the prefix
        cache lists it (another sequence filled it: a fork of fewer tokens than its parent computed, whose parent
        has gone), else None: writing into it in place would change what others read."""
        i, filled = divmod(request.num_computed_tokens, self.block_size)
        if filled and i < len(request.blocks) and (request.blocks[i].ref_cnt > 1
                                                    or request.blocks[i].block_hash is not None):
            return i
        return None

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> None:
        """Start ``child`` from ``parent``'s computed tokens (the first ``num_tokens`` of them), which must be the
        head of the child's tokens: the child takes a reference on the blocks holding them (the partial last one
        included, copied on write) and counts them as computed."""
        n = parent.num_computed_tokens if num_tokens is None else num_tokens
        assert n <= parent.num_computed_tokens
        assert child.num_tokens > n, "a fork computes at least one token of its own"
        blocks = parent.blocks[:self.blocks_needed(n)]
        self.pool.incref(blocks)
        child.blocks = list(blocks)
        child.num_computed_tokens = n
        full = n // self.block_size
        child.block_hashes = parent.block_hashes[:full]
        child.num_cached_blocks = min(parent.num_cached_blocks, full)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies queued since the last call (each destination a fresh block, each source held)."""
        out, self.copies = self.copies, []
        return out

    def _cache_full_blocks(self, request: Request, num_full: int) -> None:
        """Register the blocks that this step fills completely, so later requests can find them."""
        if num_full <= request.num_cached_blocks:
            return
        hashes = self._hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            self.pool.cache_block(request.blocks[i], hashes[i])
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool, tail first (cached ones stay findable)."""
        if request.blocks:
            self.pool.free(list(reversed(request.blocks)))
            request.blocks = []
        request.num_cached_blocks = 0

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move a request's blocks to host blocks; returns (device, host) block pairs for the runner to copy,
        or None if the host pool cannot take them (the caller then recomputes instead)."""
        if self.host_pool is None or len(request.blocks) > self.host_pool.num_free_blocks:
            return None
        host = self.host_pool.allocate(len(request.blocks))
        pairs = [(d.block_id, h.block_id) for d, h in zip(request.blocks, host)]
        self.free(request)  # device blocks go back to the pool (cached ones stay findable)
        request.host_blocks = host
        return pairs

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        return need <= self.pool.num_free_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back into fresh device blocks (plus room for its next tokens); returns
        (host, device) block pairs to copy. Call can_swap_in first."""
        device = self.pool.allocate(len(request.host_blocks))
        pairs = [(h.block_id, d.block_id) for h, d in zip(request.host_blocks, device)]
        self.host_pool.free(list(reversed(request.host_blocks)))
        request.host_blocks = []
        request.blocks = device
        ok = self.allocate_slots(request, num_new_tokens)
        assert ok, "can_swap_in was not checked"
        return pairs

    def free_host(self, request: Request) -> None:
        if request.host_blocks:
            self.host_pool.free(list(reversed(request.host_blocks)))
            request.host_blocks = []

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
