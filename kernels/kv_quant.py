"""Low-precision cache storage: int8 and fp8 (e4m3) K/V pages with per-token, per-KV-head scales, and
int8 / bf16 Mamba state rows with per-head (per head-row) scales.

**KV pages.** A quantised layer keeps beside its pools ``k_scale, v_scale: [num_blocks, block_size, Hkv]``
(:data:`KV_SCALE_DTYPE`, fp16): token ``p`` of block ``b``, head ``h`` dequantises as
``q[b, p, h, :] * scale[b, p, h]``. The write op (:func:`write_kv_quantized`) takes each new token's own
largest |value| per head over the format's largest value as its scale, so writing a token never touches
the tokens already cached (no re-quantisation, ever; LMDeploy's int8 K/V quantises per token and head too)
and moving a token (SnapKV compaction, copy on write) moves its codes with its scale, exactly.

Measured against the per-block scales this replaced (one scale per block and head, grown by re-quantising
the block's tokens when a new token exceeded it; ``eval/compression_bench.py``, README "Cache
compression"): per-token scales lift top-1 agreement of int8 K/V on the trained 1:7 MQAR hybrid from
98.4% to above 99%, and the write is one absmax, one scale, one code pass and two ``index_copy_`` instead
of ~15 ops per layer and step. The cost is the scale's bytes: 2 per token and head (fp16), +3% of the
int8 codes at head_dim 64. fp16 rather than fp32 scales: the codes are computed from the rounded scale,
so its rounding (2^-11) only moves the code grid and at most saturates a code by 0.06 of a step; measured
equal to fp32 (the ``kv_scale`` table). The scale is kept at or above fp16's smallest normal (2^-14): a
head whose values are all below 127 * 2^-14 (about 0.008) keeps an absolute error of at most 2^-15, and
no scale underflows to zero.

**Mamba state.** :func:`quantize_rows` / :func:`dequantize_rows` turn state rows ``[n, *shape]`` into
int8 with one fp32 scale per equal slice of the row (Mamba-2's SSM state: per head and head_dim row, its
``d_state`` values), or into bf16; ``stochastic=True`` rounds stochastically (unbiased) instead of to
nearest (measured: no better here, so off by default). The scale is recomputed from the row at every
write; the other formats measured against it (kept scales, finer groups, mu-law codes, fp8 e4m3, error
feedback with a 2- or 4-bit residual) are in ``eval/state_drift_bench.py``. The Mamba decode steps on int8
rows have kernels of their own (:mod:`.int8_state_step`); which step a cache's state runs is the cache's
choice (:class:`hybrid.cache.StatePool`), not this module's: here are the formats only.
"""

from __future__ import annotations

import math

import torch

from . import state_tiles

FP8 = torch.float8_e4m3fn

# name -> storage dtype; the names the engine, the CLI and the benchmarks accept (plus the aliases below)
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
             "fp8": FP8}
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
            "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8"}
QUANTIZED = (torch.int8, FP8)
_QMAX = {torch.int8: 127.0, FP8: 448.0}
# the storage dtype of the per-token K/V scales (read when a cache is built and when bytes are counted, so
# the benchmark can compare fp32); see the module docstring for why fp16
KV_SCALE_DTYPE = torch.float16
KV_SCALE_MIN = 2.0 ** -14  # fp16's smallest normal: no subnormal (imprecise) or zero scale


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a cache dtype (``int8``, ``fp8``, ``bfloat16``...)."""
    for name, d in KV_DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: str | torch.dtype | None, allowed: dict[str, torch.dtype], what: str) -> torch.dtype | None:
    """A cache dtype from a name (``"int8"``, ``"fp8"``, ``"bf16"``...) or a torch dtype; None stays None.
    Anything else is a ValueError listing what is accepted."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value in allowed.values():
            return value
        raise ValueError(f"{what} {value} is not supported; choose one of {sorted(allowed)}")
    name = _ALIASES.get(str(value).lower(), str(value).lower())
    if name not in allowed:
        raise ValueError(f"{what} {value!r} is not supported; choose one of {sorted(allowed)}")
    return allowed[name]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` stores scaled codes (int8, fp8) that need a scale to mean anything."""
    return dtype in QUANTIZED


def qmax(dtype: torch.dtype) -> float:
    """The largest magnitude the format stores (127 for int8, 448 for e4m3)."""
    return _QMAX[dtype]


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in ``dtype`` (round to nearest; saturating). ``scale`` broadcasts against ``x``; a zero
    scale (nothing written yet, or an all-zero group) gives zero codes."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x.float() / safe
    m = _QMAX[dtype]
    if dtype == torch.int8:
        return y.round_().clamp_(-m, m).to(torch.int8)
    return y.clamp_(-m, m).to(dtype)


# e4m3 codes read as fp16 bits: sign to bit 15, exponent and mantissa (7 bits) to bits 13..7. A normal e4m3
# value 2^(e-7) (1 + m/8) then reads as 2^(e-15) (1 + m/8) and a subnormal one m/8 2^-6 as fp16's subnormal
# m/8 2^-14: every finite code is its value / 256, exactly. On CPU torch converts fp8 element by element
# (measured 13x slower than bf16 -> fp32); these int16 ops and the fp16 -> fp32 cast are vectorised (about
# 2x bf16's one cast), so fp8 pages cost little more than bf16 ones to read.
FP8_AS_FP16_FACTOR = 256.0


def fp8_codes_as_fp16(q: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (or their int8 / uint8 bits) -> fp16 values equal to the codes' values / 256 (exact;
    NaN codes, which the cache never writes since quantize saturates, read as 480 / 256)."""
    y = q.view(torch.int8).to(torch.int16)  # sign-extended: a negative code has bits 15..8 set
    y.mul_(128)  # << 7: exponent and mantissa to bits 13..7, the sign leaves bits 15 and 14 set (products wrap)
    y.bitwise_and_(-16512)  # 0xBF80: keep bit 15 (sign) and bits 13..7, clear bit 14 and the low bits
    return y.view(torch.float16)


_FP8_SIGN_EXP_MANTISSA = -16512  # 0xBF80 as int16: bit 15 (sign) and bits 13..7 (exponent, mantissa)
def scratch(numel: int, dtype: torch.dtype, role: str) -> torch.Tensor:
    """A reused flat CPU buffer of ``numel`` elements (contents undefined), one per thread, dtype and role
    (:func:`.state_tiles.scratch`): a fresh multi-MB temporary per column group and layer page-faults on first
    touch (~1 GB/s here). The buffers are bounded by the decode walk's column groups (``DECODE_GROUP_BYTES``),
    so they stay a few MB."""
    return state_tiles.scratch(numel, torch.device("cpu"), role, dtype)


def fp8_codes_to_float_into(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """e4m3 codes ``q`` (fp8, or their int8 bits) -> ``out`` (fp32, same number of elements, contiguous) = the
    codes' values / :data:`FP8_AS_FP16_FACTOR`, bit for bit as :func:`fp8_codes_as_fp16` gives them, with no
    fresh temporary: sign-extend into a reused int16 buffer, times 128 (the shift left by 7: the same bits,
    int16 products wrap; measured 2x faster than ``bitwise_left_shift`` on int16), keep the sign, exponent
    and mantissa bits, cast fp16 -> fp32 into ``out``."""
    bits = scratch(q.numel(), torch.int16, "fp8 bits")
    bits.copy_(q.view(torch.int8).reshape(-1))
    bits.mul_(128)
    bits.bitwise_and_(_FP8_SIGN_EXP_MANTISSA)
    out.view(-1).copy_(bits.view(torch.float16))
    return out


def gather_pages_as_float(pool: torch.Tensor, blocks: torch.Tensor, role: str) -> tuple[torch.Tensor, float]:
    """Pages ``pool[blocks]`` (int8 / fp8 codes, or bf16 / fp16 / fp32 values; a CPU pool) as fp32 in a reused
    buffer of ``role`` (valid until the next call with that role), and the factor their values still need (as
    :func:`codes_to_float`). The eager CPU decode walk's gather: into a reused buffer of the pool's dtype, then
    converted into the fp32 one (float and int8 pages: one cast; fp8: :func:`fp8_codes_to_float_into`).
    Measured and dropped: converting each distinct page once when blocks repeat (forked sequences) and
    gathering the fp32 pages from those (no gain in the engine bench, whose 32 sequences share their prompt)."""
    shape = (blocks.numel(), *pool.shape[1:])
    numel = math.prod(shape)
    out = scratch(numel, torch.float32, role).view(shape)
    if pool.dtype == torch.float32:  # nothing to convert: gather straight into the fp32 buffer
        return torch.index_select(pool, 0, blocks, out=out), 1.0
    pages = scratch(numel, torch.uint8 if pool.dtype == FP8 else pool.dtype, "pages").view(shape)
    torch.index_select(_bits(pool), 0, blocks, out=pages)
    if pool.dtype == FP8:
        return fp8_codes_to_float_into(pages, out), FP8_AS_FP16_FACTOR
    return out.copy_(pages), 1.0


def codes_to_float(q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Codes as fp32 and the factor their values still need (fp8: 256, see :func:`fp8_codes_as_fp16`; 1 for
    int8 and float pages), so a caller folds the factor into a scale it multiplies by anyway."""
    if q.dtype == FP8 and q.device.type == "cpu":
        return fp8_codes_as_fp16(q).float(), FP8_AS_FP16_FACTOR
    return q.float(), 1.0


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes times their scale (broadcast), in ``dtype``."""
    values, factor = codes_to_float(q)
    return (values * (scale * factor if factor != 1.0 else scale)).to(dtype)


def dequantize_pages(pages: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered pages ``[..., BS, Hkv, D]`` with their per-token scales ``[..., BS, Hkv]`` -> values in
    ``dtype`` (pages that are not quantised, ``scale`` None, are only cast)."""
    if scale is None:
        return pages.to(dtype)
    return dequantize(pages, scale.float()[..., None], dtype)


# Adding and subtracting 1.5 * 2^23 rounds an fp32 |y| < 2^22 to the nearest integer, ties to even (the sum
# lies in [2^23, 2^24), where fp32's step is 1): exactly torch.round. Why: torch.round goes parallel (OpenMP)
# from a few thousand values, two elementwise adds only from ~100K; measured with 2 threads while the other
# core was busy (the usual state of this shared 2-core machine), every parallel region costs 4-8 ms waiting
# for the descheduled thread (round of 8K values 4-8 ms, add 0.008 ms; 1 thread 0.004 ms each). On a quiet
# machine the two cost about the same. Under torch.compile Inductor emits its own rounding, so the compiled
# step keeps torch.round (and no compiler gets to fold the two adds away).
_ROUND_MAGIC = 1.5 * 2.0 ** 23


def round_nearest_(y: torch.Tensor) -> torch.Tensor:
    """``y.round_()`` for fp32 values of magnitude below 2^22 (the codes: clamped to qmax first), in place."""
    if torch.compiler.is_compiling():
        return y.round_()
    return y.add_(_ROUND_MAGIC).sub_(_ROUND_MAGIC)


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype,
                    scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values ``x [T, Hkv, D]`` -> codes ``[T, Hkv, D]`` in ``dtype`` and per-token, per-head scales
    ``[T, Hkv]`` in ``scale_dtype`` (default :data:`KV_SCALE_DTYPE`). The codes are computed from the stored
    (rounded) scale, so dequantising them with it is within the format's rounding of ``x``."""
    scale_dtype = KV_SCALE_DTYPE if scale_dtype is None else scale_dtype
    m = _QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1) * (1.0 / m)).clamp_min_(KV_SCALE_MIN).to(scale_dtype)  # [T, Hkv]
    y = xf * scale.float().reciprocal()[..., None]  # the scale is >= KV_SCALE_MIN: no division by zero
    y.clamp_(-m, m)
    return (round_nearest_(y).to(torch.int8) if dtype == torch.int8 else y.to(dtype)), scale


def write_kv_quantized(pool: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantise new keys (or values) ``x [T, Hkv, D]`` into their slots of ``pool [NB, BS, Hkv, D]``, each token
    and head with its own scale, stored in its slot of ``scale [NB, BS, Hkv]``.

    Nothing already in the pool is read or rewritten: static shapes, no sync, no data-dependent branch, so the
    compiled decode step traces it as it is (absmax, scale, codes, two ``index_copy_``)."""
    if x.shape[0] == 0:
        return
    codes, s = quantize_tokens(x, pool.dtype, scale.dtype)
    _bits(pool).view(-1, *pool.shape[2:]).index_copy_(0, slot_mapping, _bits(codes))
    scale.view(-1, scale.shape[-1]).index_copy_(0, slot_mapping, s)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors seen as bytes (index_copy_ has no fp8 kernel on CPU; a copy of the bits is the same)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


# ---- Mamba state rows ----------------------------------------------------------------------------

def _round_stochastic(y: torch.Tensor) -> torch.Tensor:
    return torch.floor(y + torch.rand_like(y))


def bf16_stochastic(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded stochastically: add uniform random low 16 bits, then truncate (exact cast)."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def quantize_rows(x: torch.Tensor, groups: int, *, stochastic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """State rows ``x [n, *shape]`` -> int8 codes ``[n, *shape]`` and fp32 scales ``[n, groups]`` (one per
    equal slice of the flattened row: per head when the leading dimension is the heads)."""
    n = x.shape[0]
    g = x.float().reshape(n, groups, -1)
    scale = g.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    y = g / safe
    y = _round_stochastic(y) if stochastic else y.round()
    return y.clamp_(-127, 127).to(torch.int8).view(x.shape), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: fp32 rows ``[n, *shape]``."""
    n, groups = scale.shape
    return (q.float().reshape(n, groups, -1) * scale[..., None]).view(q.shape)
