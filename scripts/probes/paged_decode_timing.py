"""The native paged decode attention alone (kernels/native/decode.c hl_paged_decode, `kernels.native.ops.paged_decode`)
at llama-d512's shapes: Hq 8, Hkv 2, D 64, block 16, one query token per sequence, contexts 16 / 512 / 2048 / 8192,
batch 1 and 8, bf16 and fp32 pools, 2 threads inside `owns_threads()` as the engine runs it. Each call timed alone:
min / median / max of RUNS calls, and GB/s of the K/V read (2 * batch * context * Hkv * D * bytes) at the median.
`--old REV` also times the kernel of git revision REV (its decode.c / linear_attention.c / program.c built as a second
library with its own pool of 2 threads) on the same inputs, side by side, and checks both against each other.
Run under the machine's benchmark lock:
flock /tmp/bench.lock .venv/bin/python -P scripts/probes/paged_decode_timing.py [--old REV] [bfloat16|float32 ...]"""
import argparse
import ctypes
import statistics
import subprocess
import time
from pathlib import Path

import torch
from hybrid.kernels import native
from hybrid.kernels.native import ops
from hybrid.kernels.native.build import FLAGS, build

RUNS = 25
Hq, Hkv, D, BS = 8, 2, 64, 16
CONTEXTS = (16, 512, 2048, 8192)
BATCHES = (1, 8)

ap = argparse.ArgumentParser()
ap.add_argument("--old", default=None, help="a git revision whose kernel is timed too")
ap.add_argument("dtypes", nargs="*", default=["bfloat16", "float32"])
args = ap.parse_args()
torch.set_num_threads(2)
print(subprocess.run("lscpu | grep -o 'avx512[a-z_0-9]*' | sort -u | tr '\\n' ' '", shell=True, capture_output=True,
                     text=True).stdout)
print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {RUNS} runs each")

old = None
if args.old:
    root = Path(__file__).resolve().parents[2]
    src = "\n".join(subprocess.run(["git", "show", f"{args.old}:kernels/native/{f}"], cwd=root, check=True,
                                   capture_output=True, text=True).stdout
                    for f in ("decode.c", "linear_attention.c", "program.c"))
    old, why = build("hybrid_decode_old", src, FLAGS, ("-lm", "-lpthread"))
    assert old is not None, why
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    old.hl_set_threads.argtypes, old.hl_set_threads.restype = [i32, i64], i32
    old.hl_paged_decode.argtypes = [p, i32, p, p, i32, p, p, i64, p, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    old.hl_set_threads(2, native.SPIN)


def old_paged_decode(q, k_pool, v_pool, lens, tables):
    out = torch.empty_like(q)
    old.hl_paged_decode(q.data_ptr(), native.DTYPE_CODES[q.dtype], k_pool.data_ptr(), v_pool.data_ptr(),
                        native.DTYPE_CODES[k_pool.dtype], lens.data_ptr(), tables.data_ptr(), tables.stride(0),
                        out.data_ptr(), q.shape[0], Hq, Hkv, D, BS, 0, D ** -0.5)
    return out


def timed(fn):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts), max(ts)


g = torch.Generator().manual_seed(0)
with native.owns_threads():
    for dtype in [getattr(torch, d) for d in args.dtypes]:
        for B in BATCHES:
            for ctx in CONTEXTS:
                nblk = -(-ctx // BS)
                NB = B * nblk + 1
                k_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
                v_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
                q = torch.randn(B, Hq, D, generator=g).to(dtype)
                lens = torch.full((B,), ctx, dtype=torch.int32)
                tables = (torch.randperm(NB - 1, generator=g)[:B * nblk] + 1).view(B, nblk).to(torch.int32)
                nbytes = 2 * B * ctx * Hkv * D * k_pool.element_size()
                inputs = (q, k_pool, v_pool, lens, tables)
                cases = {"new": lambda inputs=inputs: ops.paged_decode(*inputs)}
                if old is not None:
                    cases["old"] = lambda inputs=inputs: old_paged_decode(*inputs)
                    diff = (cases["new"]().float() - cases["old"]().float()).abs().max().item()
                else:
                    diff = None
                line = f"{str(dtype)[6:]:9s} B {B} ctx {ctx:5d}:"
                for name, fn in cases.items():
                    lo, med, hi = timed(fn)
                    line += (f"  {name} {lo * 1e6:8.1f} / {med * 1e6:8.1f} / {hi * 1e6:8.1f} us "
                             f"{nbytes / med / 1e9:6.1f} GB/s")
                if diff is not None:
                    line += f"  |new-old| {diff:.2e}"
                print(line, flush=True)
