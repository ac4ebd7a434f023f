"""The placeholder block manager of attention-free models: there are no KV blocks to manage.

It keeps the scheduler's interface of a paged engine; admission is limited by state slots
(`mamba_cache.SlotAllocator`) and the token budget, never by blocks.
"""

from __future__ import annotations


class PlaceholderBlockManager:
    """Always admits; frees nothing."""

    def can_allocate(self, num_tokens: int) -> bool:
        """Blocks never limit admission."""
        return True

    def free(self) -> None:
        """Nothing to free."""
