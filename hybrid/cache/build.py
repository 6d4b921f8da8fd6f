"""How an engine's caches are built and sized: the target's :class:`~hybrid.cache.HybridCache` from a block
count or a byte budget with its dtypes and KV pruning, the :class:`~hybrid.cache.prefix.PrefixCache` beside it,
and a draft model's cache sized to the target's (after vLLM v1's ``kv_cache_utils``: sizing is decided once,
before the cache manager hands anything out)."""

from __future__ import annotations

from .pools import HybridCache, cache_dtypes
from .prefix import PrefixCache, prefill_flops_fn

DEFAULT_CACHE_BYTES = 256 * 2**20
DEFAULT_PREFIX_STATE_BYTES = 256 * 2**20


def engine_cache(model, cache: HybridCache | None, *, num_blocks: int | None, cache_bytes: int | None,
                 block_size: int, max_seqs: int, kv_dtype, state_dtype, stochastic_state: bool,
                 kv_pruning) -> HybridCache:
    """``cache``, or one built for ``model`` from ``num_blocks`` KV blocks or ``cache_bytes`` (default
    :data:`DEFAULT_CACHE_BYTES`) in the dtypes asked for; with ``kv_pruning`` set on its KV pool (that pruning
    and prefix caching exclude each other is the :class:`~hybrid.engine.config.EngineConfig`'s check)."""
    if cache is None:
        if num_blocks is None and cache_bytes is None:
            cache_bytes = DEFAULT_CACHE_BYTES
        d = cache_dtypes(next(model.parameters()).dtype, kv_dtype, state_dtype)
        cache = HybridCache.for_model(model, num_blocks=num_blocks, cache_bytes=cache_bytes,
                                      block_size=block_size, max_seqs=max_seqs, kv_dtype=d.kv,
                                      conv_dtype=d.conv, ssm_dtype=d.ssm, stochastic_state=stochastic_state)
    elif kv_dtype is not None or state_dtype is not None or stochastic_state:
        raise ValueError("kv_dtype / state_dtype / stochastic_state shape the cache the engine builds; with "
                         "cache= pass them to that HybridCache instead")
    if kv_pruning is not None:
        cache.kv.set_pruning(kv_pruning)  # the attention layers' cache views apply it
    return cache


def prefix_cache_for(cache: HybridCache, model, *, enabled: bool, state_bytes: int | None,
                     checkpoint_interval: int | None, flop_weight: float) -> PrefixCache | None:
    """A prefix cache over ``cache``'s pools when ``enabled`` (Mamba checkpoints take at most ``state_bytes``,
    default :data:`DEFAULT_PREFIX_STATE_BYTES`), else None; its options without it are refused."""
    if enabled:
        return PrefixCache(cache.kv, cache.ssm, state_bytes=DEFAULT_PREFIX_STATE_BYTES if state_bytes is None
                           else state_bytes, checkpoint_interval=checkpoint_interval, flop_weight=flop_weight,
                           prefill_flops=prefill_flops_fn(model))
    if state_bytes is not None or checkpoint_interval is not None:
        raise ValueError("prefix_state_bytes / prefix_checkpoint_interval need prefix_caching=True")
    return None


def draft_cache(draft, target: HybridCache, spec, block_size: int) -> HybridCache:
    """The draft model's cache: ``spec``'s size, else as many tokens as the ``target`` cache holds plus each
    sequence's drafts (a target without KV: :data:`DEFAULT_CACHE_BYTES`), with the target's state slots."""
    num_blocks, cache_bytes = spec.draft_num_blocks, spec.draft_cache_bytes
    if num_blocks is None and cache_bytes is None:  # as many tokens as the target holds, plus drafts
        if target.kv.enabled:
            num_blocks = target.kv.num_blocks + target.ssm.num_slots * target.kv.blocks_for(spec.num_tokens)
        else:
            cache_bytes = DEFAULT_CACHE_BYTES
    return HybridCache.for_model(draft, num_blocks=num_blocks, cache_bytes=cache_bytes, block_size=block_size,
                                 max_seqs=target.ssm.num_slots)
