"""The int8-activation decode products (kernels/native/int8_activation.c) on every native variant this CPU runs
(the AVX2 build on an AVX-512 machine too), against their references: the vectorised row quantisation and the
flipped-weight int8dq dot have AVX-512 / VNNI paths and a scalar / AVX2 one, and each must give torchao's numbers.
Widths with tails past the last 16 inputs (the quantisation's vectors), 64 (int8dq's dot) and 128 (8da4w's
four-group blocks); rows whose most negative input is their largest (int8dq's -128 code) and all-positive rows
(8da4w's zero point at -128)."""

from __future__ import annotations

import pytest
import torch
from hybrid.kernels import native, projection

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")

SHAPES = ((52, 576), (36, 100), (20, 17), (8, 1536), (12, 224), (4, 32))


def _variants() -> list[str]:
    from hybrid.kernels.native import variants

    flags = variants.cpu_flags()
    return [v.name for v in variants.runnable(flags)] if flags is not None else []


def _rows(B: int, K: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(B, K, generator=g) * torch.rand(B, 1, generator=g) * 4
    x[::2, K // 3] = -x[::2].abs().amax(-1)  # the row's largest magnitude negative: a -128 code
    if B > 1:
        x[1] = x[1].abs()
    return x.to(dtype)


@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_q_products_on_each_variant(variant, dtype, rows):
    """int8dq equal to its reference bit for bit; 8da4w to fp32 summation order (1e-5 of the largest output,
    plus one bf16 rounding in bf16), as tests/test_native_int8dq.py holds the loaded library."""
    lib = native.load_variant(variant, threads=2)
    g = torch.Generator().manual_seed(rows * 7 + (dtype == torch.bfloat16))
    with native.using_library(lib):
        for N, K in SHAPES:
            x = _rows(rows, K, dtype, g)
            bias = torch.randn(N, generator=g).to(dtype)
            codes = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
            ws = torch.rand(N, generator=g) * 0.01
            got = projection._linear_q_native(x, projection.QK_I8DQ, codes, ws, bias)
            ref = projection.linear_int8dq_ref(x, codes, ws, bias)
            assert torch.equal(got, ref), (variant, N, K, (got.float() - ref.float()).abs().max().item())
            if K % 32:
                continue
            values = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g)
            scale = (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).to(dtype)
            nibbles, packed = projection.pack_8da4w(values, scale)
            got = projection._linear_q_native(x, projection.QK_8DA4W, nibbles, packed, bias)
            ref = projection.linear_8da4w_ref(x, values, scale, bias)
            noise = 0.0 if dtype == torch.float32 else ref.float().abs().max().item() * 2.0 ** -8
            tol = 1e-5 * ref.float().abs().max().item() + noise
            assert (got.float() - ref.float()).abs().max().item() <= tol, (variant, N, K)


@pytest.mark.parametrize("variant", _variants())
def test_int8dq_codes_at_rounding_ties(variant):
    """Inputs at exact halves of the quantisation step (x * inv = n + 0.5): the vectorised quantisation rounds
    them to even as the scalar loop's rintf and torch.round do; the product then equals the reference exactly."""
    lib = native.load_variant(variant, threads=2)
    K, N = 48, 16
    # max|x| = 127.5 gives scale 1 and inv 1: the inputs are their own products
    x = (torch.arange(K, dtype=torch.float32) - 24.0) * 2.0 + 0.5
    x[0] = 127.5
    x = x.reshape(1, K)
    codes = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    ws = torch.ones(N)
    with native.using_library(lib):
        got = projection._linear_q_native(x, projection.QK_I8DQ, codes, ws)
    assert torch.equal(got, projection.linear_int8dq_ref(x, codes, ws)), variant
