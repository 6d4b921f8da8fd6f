"""Compute ops with their backends (``torch`` now; ``triton`` and ``cuda`` plug into the same
dispatch). Each op module holds the public function, its fast torch path and its ``*_ref``
reference. Imports only torch (and, lazily, the optional GPU packages): knows nothing of models.

Ops, by module:
- ``attention``: ``causal_attention`` (batched [B, L, H, D], training/scoring)
- ``paged_attention``: ``varlen_attention`` (packed, no cache), ``paged_prefill_attention``
  (packed new tokens over a paged KV pool), ``paged_decode_attention``, ``write_kv``
- ``ssd``: ``ssd_chunk_scan`` (batched), ``ssd_varlen_scan`` (packed), ``ssd_step``
- ``selective_scan``: ``selective_scan``, ``selective_varlen_scan``, ``selective_step``
- ``conv1d``: ``causal_conv1d``, ``causal_conv1d_varlen``, ``causal_conv1d_step``
- ``gated_delta``: ``gated_delta_chunk`` (batched), ``gated_delta_varlen`` (packed), ``gated_delta_step``
- ``projection``: ``linear`` (the layers' projections; decode-sized ones through the native matrix-vector product)
"""

from . import dispatch
from .attention import causal_attention, causal_attention_ref, causal_mask
from .conv1d import (
                     causal_conv1d,
                     causal_conv1d_ref,
                     causal_conv1d_step,
                     causal_conv1d_step_ref,
                     causal_conv1d_varlen,
                     causal_conv1d_varlen_ref,
)
from .dispatch import BackendError, use_backend
from .gated_delta import (
                     gated_delta_chunk,
                     gated_delta_ref,
                     gated_delta_step,
                     gated_delta_step_ref,
                     gated_delta_varlen,
                     gated_delta_varlen_ref,
)
from .paged_attention import (
                     gather_kv,
                     paged_decode_attention,
                     paged_decode_attention_ref,
                     paged_prefill_attention,
                     paged_prefill_attention_ref,
                     varlen_attention,
                     varlen_attention_ref,
                     write_kv,
)
from .projection import linear, linear_ref
from .selective import (
                     selective_scan,
                     selective_scan_ref,
                     selective_step,
                     selective_step_ref,
                     selective_varlen_scan,
                     selective_varlen_scan_ref,
)
from .ssd import ssd_chunk_scan, ssd_scan_ref, ssd_step, ssd_step_ref, ssd_varlen_scan, ssd_varlen_scan_ref

__all__ = [
    "BackendError", "causal_attention", "causal_attention_ref", "causal_conv1d", "causal_conv1d_ref",
    "causal_conv1d_step", "causal_conv1d_step_ref", "causal_conv1d_varlen", "causal_conv1d_varlen_ref",
    "causal_mask", "dispatch", "gated_delta_chunk", "gated_delta_ref", "gated_delta_step", "gated_delta_step_ref",
    "gated_delta_varlen", "gated_delta_varlen_ref", "gather_kv", "linear", "linear_ref", "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention", "paged_prefill_attention_ref", "selective_scan", "selective_scan_ref",
    "selective_step", "selective_step_ref", "selective_varlen_scan", "selective_varlen_scan_ref",
    "ssd_chunk_scan", "ssd_scan_ref", "ssd_step", "ssd_step_ref", "ssd_varlen_scan", "ssd_varlen_scan_ref",
    "use_backend", "varlen_attention", "varlen_attention_ref", "write_kv",
]
