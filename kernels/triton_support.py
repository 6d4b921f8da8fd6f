"""Optional Triton: the guarded import, the probe every ``triton`` backend registers with, and
small launch helpers shared by the Triton kernels of the op modules.

``import hybrid`` must work without Triton, so op modules decorate kernels with :func:`jit`, which
is ``triton.jit`` when Triton imports and otherwise a stand-in whose call raises. On a CPU, Triton
runs only in its interpreter (``TRITON_INTERPRET=1``), which Triton reads when a kernel is
*defined*, i.e. when ``hybrid`` is imported: set it before that (tests/conftest.py does).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR: str | None = None
except Exception as e:  # ImportError, or a broken install that fails while importing
    triton = tl = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

# Read once, as Triton does: kernels defined now are interpreted (or not) for good.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def jit(fn):
    """``triton.jit`` when Triton imports; else a stand-in that says why it cannot run."""
    if triton is not None:
        return triton.jit(fn)

    class _Missing:
        def __getitem__(self, grid):
            raise RuntimeError(f"Triton kernel {fn.__name__} cannot run: triton does not import ({_IMPORT_ERROR})")

    return _Missing()


def probe() -> str | None:
    """None when Triton kernels can be launched at all, else why not (shown by ``hybrid doctor``)."""
    if triton is None:
        return f"triton does not import ({_IMPORT_ERROR})"
    return None


def device_reason(device_type: str) -> str | None:
    """Why Triton cannot run on tensors of ``device_type`` (None when it can)."""
    if device_type == "cuda":
        return None
    if device_type == "cpu":
        return None if INTERPRET else ("Triton runs on a CPU only in its interpreter: set TRITON_INTERPRET=1 "
                                       "before importing hybrid (tests only: ~200x slower than torch)")
    return f"Triton has no {device_type} target here"


def needs_grad(*tensors) -> bool:
    """True when autograd would record through these inputs (Triton kernels here are forward-only)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def next_pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << (max(n, 1) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands use exact fp32 products (the default TF32 would be ~1e-3 off the reference)."""
    return "ieee" if dtype == torch.float32 else "tf32"
