"""KV cache manager: grows and frees requests' block tables on top of the block pool.

Blocks are allocated on demand: a request holds exactly ``ceil(tokens_in_cache / block_size)`` blocks, never a
reservation for its maximum length. The scheduler asks for slots before each step and frees them when a
request finishes, is aborted or is preempted.
"""
from __future__ import annotations

from pagellm.core.block_pool import BlockPool
from pagellm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones.

        Returns False (allocating nothing) when the pool has too few free blocks; the scheduler then preempts.
        """
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        request.blocks.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool, tail first."""
        if request.blocks:
            self.pool.free(list(reversed(request.blocks)))
            request.blocks = []

    def usage(self) -> float:
        return self.pool.usage()
