"""The native paged decode attention as an AVX2-only CPU builds it (the library compiled here with -mno-avx512f: the
8-lane dots and D-wide loops, no AVX-512 tiles), against `paged_decode_attention_ref` within the bound of
tests/test_native_decode.py, at short and long contexts (spans combined), windows, rep 1/4/8, D 64/72/80/128, fp32
and bf16, batch 1-5. Prints the largest error over the bound per case; exits 1 if any case fails.
Run under the machine's benchmark lock:
flock /tmp/bench.lock .venv/bin/python -P scripts/probes/paged_decode_noavx512_check.py"""
import sys

import torch
from hybrid.kernels import native, paged_attention

lib = native.build_variant("avx2", ("-mno-avx512f",))

bad = 0
for Hq, Hkv, D, BS in ((8, 2, 64, 16), (4, 4, 64, 16), (8, 2, 128, 16), (16, 2, 80, 7), (8, 1, 72, 16)):
    for dtype in (torch.float32, torch.bfloat16):
        for lens in ([5, 40, 70], [2047], [1000, 3001], [17, 256, 257, 512, 1537]):
            for window in (None, 17, 300):
                g = torch.Generator().manual_seed(D + len(lens))
                B, cols = len(lens), -(-max(lens) // BS)
                NB = B * cols + 3
                k_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
                v_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
                q = (torch.randn(B, Hq, D, generator=g) * 2).to(dtype)
                seq_lens = torch.tensor(lens, dtype=torch.int32)
                tables = (torch.randperm(NB - 1, generator=g)[:B * cols] + 1).view(B, cols).to(torch.int32)
                out = torch.empty_like(q)
                rc = lib.hl_paged_decode(q.data_ptr(), native.DTYPE_CODES[dtype], k_pool.data_ptr(), v_pool.data_ptr(),
                                         native.DTYPE_CODES[dtype], seq_lens.data_ptr(), tables.data_ptr(),
                                         tables.stride(0), out.data_ptr(), B, Hq, Hkv, D, BS, window or 0, D ** -0.5)
                ref = paged_attention.paged_decode_attention_ref(q, k_pool, v_pool, seq_lens, tables, window=window)
                noise = 0.0 if dtype == torch.float32 else ref.float().abs().max().item() * 2.0 ** -8
                err = (out.float() - ref.float()).abs().max().item()
                ok = rc == 0 and err <= 1e-5 + 2 * noise
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} Hq {Hq} Hkv {Hkv} D {D} BS {BS} {str(dtype)[6:]:8s} lens {lens} "
                      f"window {window}: err {err:.2e} bound {1e-5 + 2 * noise:.2e}")
print(f"{bad} failed")
sys.exit(1 if bad else 0)
