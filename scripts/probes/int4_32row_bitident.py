"""The 32-row int4 path of a build that takes the block size (hl_gemv_int4 & co. with a trailing bn) against a build
from before it (6fb6002, 32-row blocks only), bit for bit, for hl_gemv_int4, hl_gated_up_int4 and hl_qkv_rope_int4
(fp32 and bf16, B = 1, 2, 3, 5, 64, tails, bias, residual); then the new build against the reference in both layouts.
Build each with the library's flags (kernels/native/build.py FLAGS; add -mno-avx512f for the AVX2 code), e.g.
  for f in decode.c linear_attention.c program.c; do git show 6fb6002:kernels/native/$f; done > /tmp/old.c
  cat kernels/native/{decode,linear_attention,program}.c > /tmp/new.c
  gcc -O3 -march=native -ffast-math -fno-unsafe-math-optimizations -fPIC -shared /tmp/old.c -o /tmp/old.so -lm -lpthread
  (the same for new.c), then: .venv/bin/python -P scripts/probes/int4_32row_bitident.py /tmp/new.so /tmp/old.so
Result on the Zen 4 (AVX-512 and -mno-avx512f builds): 172 cases bit-identical; both layouts within 6.5e-07 of
max|ref|."""
import ctypes
import sys

import torch
from hybrid.kernels import projection

new, old = ctypes.CDLL(sys.argv[1]), ctypes.CDLL(sys.argv[2])
p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
for lib, extra in ((new, [i32]), (old, [])):
    lib.hl_set_threads.argtypes, lib.hl_set_threads.restype = [i32, i64], i32
    lib.hl_set_threads(2, 0)
    lib.hl_gemv_int4.argtypes = [p, p, i32, i64, p, i32, p, i32, p, p, i32, i64, i64, i64] + extra
    lib.hl_gated_up_int4.argtypes = [p, p, p, p, p, p, i32, i64, i32, p, i32, p, i32, i64, i64, i64] + extra
    lib.hl_qkv_rope_int4.argtypes = [p] * 9 + [i32, i64, i32, p, i32, p, p, p, i32, p, p, p] + [i64] * 6 + extra
C = {torch.float32: 0, torch.bfloat16: 1}


def ptr(t):
    return None if t is None else t.data_ptr()


g = torch.Generator().manual_seed(1)


def operands(N, K, group, sdt, bn):
    codes = torch.randint(0, 16, (N, K), generator=g)
    sz = torch.stack([torch.rand(K // group, N, generator=g) * 0.02 + 0.001,
                      torch.randn(K // group, N, generator=g) * 0.05], -1).to(sdt)
    return projection.int4_pack(codes, bn), sz


def gemv(lib, q, sz, group, bias, x, res, bn=None):
    N, K = q.shape[0], x.shape[-1]
    y = torch.empty(x.shape[0], N, dtype=x.dtype)
    args = [ptr(q), ptr(sz), C[sz.dtype], group, ptr(bias), C[bias.dtype] if bias is not None else -1, ptr(x),
            C[x.dtype], ptr(res), ptr(y), C[x.dtype], x.shape[0], N, K] + ([bn] if bn else [])
    assert lib.hl_gemv_int4(*args) == 0
    return y


def gated(lib, qg, szg, qu, szu, bias, x, bn=None):
    N, K = qg.shape[0], x.shape[-1]
    y = torch.empty(x.shape[0], N, dtype=x.dtype)
    args = [ptr(qg), ptr(szg), ptr(bias), ptr(qu), ptr(szu), ptr(bias), C[szg.dtype], group,
            C[bias.dtype] if bias is not None else -1, ptr(x), C[x.dtype], ptr(y), 0, x.shape[0], N, K] + \
        ([bn] if bn else [])
    assert lib.hl_gated_up_int4(*args) == 0
    return y


def qkv(lib, ws, bias, x, Hq, Hkv, D, rot, bn=None):
    B, K = x.shape
    q_out = torch.zeros(B, Hq, D, dtype=x.dtype)
    kp, vp = torch.zeros(B + 3, Hkv, D, dtype=x.dtype), torch.zeros(B + 3, Hkv, D, dtype=x.dtype)
    slots = torch.arange(B, dtype=torch.int64) + 2
    ang = torch.randn(B, rot, generator=torch.Generator().manual_seed(5))
    cos, sin = ang.cos().to(x.dtype).contiguous(), ang.sin().to(x.dtype).contiguous()
    (qq, szq), (qk, szk), (qv, szv) = ws
    args = [ptr(qq), ptr(szq), ptr(bias[0]), ptr(qk), ptr(szk), ptr(bias[1]), ptr(qv), ptr(szv), ptr(bias[2]),
            C[szq.dtype], group, C[bias[0].dtype], ptr(x), C[x.dtype], ptr(q_out), ptr(kp), ptr(vp), C[x.dtype],
            ptr(slots), ptr(cos), ptr(sin), rot, B, Hq, Hkv, D, K] + ([bn] if bn else [])
    assert lib.hl_qkv_rope_int4(*args) == 0
    return q_out, kp, vp


checked = 0
for dt in (torch.float32, torch.bfloat16):
    for N, K, group in ((96, 384, 128), (80, 256, 32), (16, 128, 64), (4112, 512, 128)):
        q, sz = operands(N, K, group, dt, 32)
        q2, sz2 = operands(N, K, group, dt, 32)
        for B in (1, 2, 3, 5, 64):
            x = torch.randn(B, K, generator=g).to(dt)
            b, r = torch.randn(N, generator=g).to(dt), torch.randn(B, N, generator=g).to(dt)
            for bias, res in ((None, None), (b, None), (b, r)):
                assert torch.equal(gemv(new, q, sz, group, bias, x, res, 32), gemv(old, q, sz, group, bias, x, res))
                checked += 1
            assert torch.equal(gated(new, q, sz, q2, sz2, b, x, 32), gated(old, q, sz, q2, sz2, b, x))
            checked += 1
    for Hq, Hkv, D, K, group in ((4, 2, 48, 256, 64), (6, 2, 32, 128, 32), (2, 1, 80, 128, 128)):
        ws = [operands(H * D, K, group, dt, 32) for H in (Hq, Hkv, Hkv)]
        bias = [torch.randn(H * D, generator=g).to(dt) for H in (Hq, Hkv, Hkv)]
        for B in (1, 3):
            x = torch.randn(B, K, generator=g).to(dt)
            ours, theirs = qkv(new, ws, bias, x, Hq, Hkv, D, D // 2, 32), qkv(old, ws, bias, x, Hq, Hkv, D, D // 2)
            for a, o in zip(ours, theirs, strict=True):
                assert torch.equal(a, o)
            checked += 1
print(f"32-row path bit-identical to the old build: {checked} cases")
# the new build against the reference, both layouts (what the AVX2-only build is run for)
worst = 0.0
for bn in (32, 64):
    for N, K, group in ((96, 384, 128), (80, 256, 32), (112, 128, 64), (48, 256, 128), (4144, 256, 64)):
        if bn == 32 and N % 32 not in (0, 16):
            continue
        q, sz = operands(N, K, group, torch.float32, bn)
        for B in (1, 2, 3, 5):
            x = torch.randn(B, K, generator=g)
            b, r = torch.randn(N, generator=g), torch.randn(B, N, generator=g)
            got = gemv(new, q, sz, group, b, x, r, bn)
            ref = projection.linear_int4_ref(x, q, sz, group, b, r, block=bn)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err <= 1e-5, (bn, N, K, group, B, err)
            worst = max(worst, err)
print(f"both layouts vs linear_int4_ref: worst |err| / max|ref| = {worst:.2e}")
