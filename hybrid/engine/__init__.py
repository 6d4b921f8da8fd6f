"""The engine room (after vLLM's v1 engine): :class:`Engine` (:mod:`.core`) is the small front door over

- :mod:`.config`: :class:`EngineConfig`, every setting, validated once;
- :mod:`.input`: a prompt and its sampling parameters become a :mod:`.request`;
- :mod:`.scheduler`: who runs this step and how many tokens;
- :mod:`.runner`: the step's metadata (:mod:`.packed_batch`, :mod:`.decode_inputs`), the forward, sampling, which
  decode program a step runs;
- :mod:`.output`: stop ids and strings, length, detokenising; :mod:`.stats`: counters and step times.

The caches it runs over are the cache room's (:mod:`hybrid.cache`). ``from hybrid.engine import Engine`` keeps
working.
"""

from .config import EngineConfig
from .core import Engine, length_limits

__all__ = ["Engine", "EngineConfig", "length_limits"]
