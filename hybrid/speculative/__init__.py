"""Speculative decoding: drafts (a draft model or n-gram prompt lookup) checked by the target in one packed
forward, with the Mamba states rolled back to the last accepted token without rerunning anything.

- :mod:`.config`: :class:`SpeculativeConfig`;
- :mod:`.ngram` / :mod:`.draft_model`: the drafters;
- :mod:`.verifier`: the rejection rule (greedy: accept while the draft is the target's argmax);
- :mod:`.verify_states`: the Mamba layers' per-position states of a verify chunk.
- :mod:`.speculator`: the engine's side — the drafter built from the config, the draft allowance, drafting
  before a step's forward and the rejection rule, emitted tokens and rollback after it.

The cache side (writing the accepted state back, giving back rejected KV blocks) is
:meth:`hybrid.cache.manager.CacheManager.commit_verified` / :meth:`~hybrid.cache.manager.CacheManager.shrink`.
"""

from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
