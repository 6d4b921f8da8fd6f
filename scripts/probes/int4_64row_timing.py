"""Batch-1 int4 decode product on this CPU: the native product (kernels/native/decode.c hl_gemv_int4) on aten's own
int4pack layout (64-row blocks where aten's int4 kernels use AVX512) and, for comparison, on the other layout
(packed by kernels.projection.int4_pack), against aten's `_weight_int4pack_mm_for_cpu` (what torchao's
Int4OpaqueTensor runs), with activations and scales in DTYPES (bf16: a bf16 model's decode; fp32: an fp32 model's),
group 128, 2 threads. Each call timed alone (the pool's workers asleep between calls, as between two products of
eager decode; HYBRID_NATIVE_SPIN_US keeps them spinning): min / median / max of RUNS calls, and GB/s of the codes +
scales read (N K / 2 + 2 N K / group * bytes of a scale) at the median.
Run under the machine's benchmark lock: flock /tmp/bench.lock .venv/bin/python -P scripts/probes/int4_64row_timing.py"""
import functools
import statistics
import subprocess
import sys
import time

import torch
from hybrid.kernels import projection

RUNS = 41
DTYPES = [getattr(torch, d) for d in (sys.argv[1:] or ["bfloat16", "float32"])]
torch.set_num_threads(2)


def timed(fn):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts), max(ts)


print(subprocess.run("lscpu | grep -o 'avx512[a-z_0-9]*' | sort -u | tr '\\n' ' '", shell=True, capture_output=True,
                     text=True).stdout)
print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, aten packs {projection.int4pack_block()}-row "
      f"blocks here, {RUNS} runs each")
group = 128
g = torch.Generator().manual_seed(0)
native = projection._linear_int4_native
for dtype in DTYPES:
    for N, K in ((2048, 2048), (32000, 512), (8192, 2048)):
        codes = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=g)
        sz = torch.stack([torch.rand(K // group, N, generator=g) * 0.02 + 0.001,
                          torch.randn(K // group, N, generator=g) * 0.05], -1).to(dtype).contiguous()
        q_aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        x = torch.randn(1, K, generator=g).to(dtype)
        nbytes = N * K // 2 + N * (K // group) * 2 * sz.element_size()
        here = projection.int4pack_block()
        other = 32 if here == 64 else 64
        q_other = projection.int4_pack(codes, other)
        assert torch.equal(projection.int4_pack(codes, here), q_aten)
        ref = projection.linear_int4_ref(x, q_aten, sz, group).float()
        cases = {
            f"native {here}-row (aten's layout)": functools.partial(native, x, q_aten, sz, group),
            f"native {other}-row (int4_pack)": functools.partial(native, x, q_other, sz, group, block=other),
            "aten _weight_int4pack_mm_for_cpu": functools.partial(torch.ops.aten._weight_int4pack_mm_for_cpu, x,
                                                                  q_aten, group, sz),
        }
        for name, fn in cases.items():
            err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
            lo, med, hi = timed(fn)
            print(f"{str(dtype)[6:]:8s} {N}x{K} {name:34s} min {lo * 1e6:7.1f} us  median {med * 1e6:7.1f} us  "
                  f"max {hi * 1e6:7.1f} us  {nbytes / med / 1e9:5.1f} GB/s  (|err|/max|ref| {err:.1e})")
