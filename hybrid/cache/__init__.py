"""The cache room: what the engine keeps between steps, and the only code that touches it.

- :mod:`.specs`: what each layer caches (``AttentionSpec``, ``MambaStateSpec``, ...), the sizes every byte count
  reads; the pools are allocated from them.
- :mod:`.pools`: the storage: :class:`HybridCache` over a :class:`PagedKVCache` (K/V in fixed-size blocks) and an
  :class:`SSMStateCache` (one state slot per sequence), block allocation, cache dtypes, sizing.
- :mod:`.views`: what a layer reads and writes through (dtype, quantisation and pruning decided here, not in the
  layer).
- :mod:`.manager`: :class:`~hybrid.cache.manager.CacheManager`, the only code that hands out, shares and takes back
  blocks and state slots.
- :mod:`.prefix`: the prefix cache (a radix tree over token blocks and Mamba state checkpoints).
- :mod:`.pruning`: KV pruning policies (StreamingLLM, SnapKV).
- :mod:`.build`: how an engine's caches are built and sized from its config.

``from hybrid.cache import HybridCache`` (and the other names the module ``hybrid.cache`` had) keeps working.
"""

from .pools import (
    NULL_BLOCK,
    BlockAllocator,
    CacheFullError,
    CacheReport,
    HybridCache,
    PagedKVCache,
    SSMStateCache,
    StatePool,
    cache_dtypes,
    sequences_that_fit,
)

__all__ = ["NULL_BLOCK", "BlockAllocator", "CacheFullError", "CacheReport", "HybridCache", "PagedKVCache",
           "SSMStateCache", "StatePool", "cache_dtypes", "sequences_that_fit"]
