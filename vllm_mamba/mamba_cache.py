"""Deprecated: the state cache's old module name. The cache serves every recurrent family, not
Mamba alone; it is `vllm_mamba.state_cache.StateCache` now. The old names stay importable from
here (plugins import them) and will go in a later release."""

from vllm_mamba.state_cache import SlotAllocator, StateCache, state_specs_of

MambaCache = StateCache  # deprecated alias of StateCache

__all__ = ["MambaCache", "SlotAllocator", "StateCache", "state_specs_of"]
