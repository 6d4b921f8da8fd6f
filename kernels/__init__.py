"""Compute ops with their backends (``torch`` now; ``triton`` and ``cuda`` plug into the same
dispatch). Each op module holds the public function, its fast torch path and its ``*_ref``
reference. Imports only torch (and, lazily, the optional GPU packages): knows nothing of models.
"""

from . import dispatch
from .attention import causal_attention, causal_attention_ref, decode_attention, decode_attention_ref
from .conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_step, causal_conv1d_step_ref
from .dispatch import BackendError, use_backend
from .selective_scan import selective_scan, selective_scan_ref, selective_step, selective_step_ref
from .ssd import ssd_chunk_scan, ssd_scan_ref, ssd_step, ssd_step_ref

__all__ = [
    "BackendError", "causal_attention", "causal_attention_ref", "causal_conv1d", "causal_conv1d_ref",
    "causal_conv1d_step", "causal_conv1d_step_ref", "decode_attention", "decode_attention_ref", "dispatch",
    "selective_scan", "selective_scan_ref", "selective_step", "selective_step_ref", "ssd_chunk_scan",
    "ssd_scan_ref", "ssd_step", "ssd_step_ref", "use_backend",
]
