"""Kernel benchmark: each op's torch path, Triton kernel and CUDA package side by side on a GPU.

    python -m benchmarks.kernels                 # realistic shapes, needs a CUDA GPU
    python -m benchmarks.kernels --smoke         # tiny shapes; on a CPU under TRITON_INTERPRET=1

Shapes (default): attention over 8K packed tokens with 32 query heads, 8 KV heads, head dim 128;
Mamba-2 with 64 heads of 64 channels, d_state 128; decode at batch 64. Times are medians of CUDA-event
timings after warm-up; rates are TFLOP/s (attention: the causal half of QK^T and PV; SSD: its chunked
matmuls) or GB/s (minimal bytes moved, for the memory-bound ops); ``vs torch`` is the speed-up over the
torch path. Then end-to-end prefill tokens/s of the ``*-small`` recipes per backend.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hybrid.eval.timing import median_seconds
from hybrid.kernels import dispatch
from tqdm import tqdm

from hybrid import kernels

from .common import add_json, record


@dataclass
class Case:
    op: str
    shape: str
    run: Callable[[], object]  # calls the public op (dispatch decides the backend)
    work: float  # FLOPs or bytes of one call
    unit: str  # "TFLOP/s" or "GB/s"


def _cu(lens: list[int], device) -> torch.Tensor:
    return F.pad(torch.tensor(lens, device=device).cumsum(0), (1, 0)).to(torch.int32)


def _pool(nseq: int, ctx: int, block: int, hkv: int, d: int, dtype, device):
    per = -(-ctx // block)
    k_pool, v_pool = (torch.randn(nseq * per, block, hkv, d, device=device, dtype=dtype) for _ in range(2))
    tables = torch.randperm(nseq * per, device=device).view(nseq, per).int()
    return k_pool, v_pool, tables


def cases(*, tokens: int, seqs: int, hq: int, hkv: int, d: int, heads: int, p: int, n: int, batch: int,
          ctx: int, block: int, dtype: torch.dtype, device: str) -> list[Case]:
    es = torch.tensor([], dtype=dtype).element_size()
    lens = [tokens // seqs] * seqs
    cu = _cu(lens, device)
    q = torch.randn(tokens, hq, d, device=device, dtype=dtype)
    k, v = (torch.randn(tokens, hkv, d, device=device, dtype=dtype) for _ in range(2))
    attn_flops = sum(2 * L * L * hq * d for L in lens)  # causal: half of 4 L^2 H D
    out = [Case("varlen_attention", f"T={tokens} ({seqs} seqs) Hq={hq} Hkv={hkv} D={d}",
                lambda: kernels.varlen_attention(q, k, v, cu), attn_flops, "TFLOP/s")]

    # chunked prefill: the last quarter of each sequence on top of the first three quarters in the pool
    k_pool, v_pool, tables = _pool(seqs, tokens // seqs, block, hkv, d, dtype, device)
    new = [L // 4 for L in lens]
    qn = torch.randn(sum(new), hq, d, device=device, dtype=dtype)
    seq_lens = torch.tensor(lens, device=device, dtype=torch.int32)
    cu_new = _cu(new, device)
    chunk_flops = sum(4 * m * (L - m / 2) * hq * d for m, L in zip(new, lens, strict=True))
    out.append(Case("paged_prefill_attention", f"{sum(new)} new on {tokens - sum(new)} cached, block {block}",
                    lambda: kernels.paged_prefill_attention(qn, k_pool, v_pool, cu_new, seq_lens, tables),
                    chunk_flops, "TFLOP/s"))

    kd_pool, vd_pool, dtables = _pool(batch, ctx, block, hkv, d, dtype, device)
    qd = torch.randn(batch, hq, d, device=device, dtype=dtype)
    dlens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    out.append(Case("paged_decode_attention", f"B={batch} ctx={ctx} block {block}",
                    lambda: kernels.paged_decode_attention(qd, kd_pool, vd_pool, dlens, dtables),
                    2 * batch * ctx * hkv * d * es, "GB/s"))

    groups, chunk = 1, 64
    x = torch.randn(tokens, heads, p, device=device, dtype=dtype)
    dt = F.softplus(torch.randn(tokens, heads, device=device) - 2)
    A = -torch.rand(heads, device=device) * 4
    B, C = (torch.randn(tokens, groups, n, device=device, dtype=dtype) for _ in range(2))
    Dv = torch.randn(heads, device=device)
    ssd_flops = 2 * tokens * heads * (chunk * p + 2 * p * n) + 2 * tokens * groups * chunk * n
    out.append(Case("ssd_varlen_scan", f"T={tokens} ({seqs} seqs) H={heads} P={p} N={n}",
                    lambda: kernels.ssd_varlen_scan(x, dt, A, B, C, cu, D=Dv), ssd_flops, "TFLOP/s"))

    state = torch.randn(batch, heads, p, n, device=device)
    xs = torch.randn(batch, heads, p, device=device, dtype=dtype)
    dts = F.softplus(torch.randn(batch, heads, device=device))
    Bs, Cs = (torch.randn(batch, groups, n, device=device, dtype=dtype) for _ in range(2))
    slots = torch.arange(batch, device=device)
    out.append(Case("ssd_step", f"B={batch} H={heads} P={p} N={n} (fp32 state)",
                    lambda: kernels.ssd_step(state, xs, dts, A, Bs, Cs, D=Dv, slots=slots),
                    2 * state.numel() * 4, "GB/s"))

    d_inner, n1 = heads * p, 16
    state1 = torch.randn(batch, d_inner, n1, device=device)
    A1 = -torch.rand(d_inner, n1, device=device)
    x1, dt1 = torch.randn(batch, d_inner, device=device, dtype=dtype), F.softplus(torch.randn(batch, d_inner,
                                                                                               device=device))
    B1, C1 = (torch.randn(batch, n1, device=device, dtype=dtype) for _ in range(2))
    out.append(Case("selective_step", f"B={batch} D={d_inner} N={n1} (fp32 state)",
                    lambda: kernels.selective_step(state1, x1, dt1, A1, B1, C1, slots=slots),
                    2 * state1.numel() * 4, "GB/s"))

    channels, width = heads * p + 2 * groups * n, 4
    xc = torch.randn(tokens, channels, device=device, dtype=dtype)
    w = torch.randn(channels, width, device=device, dtype=dtype)
    bias = torch.randn(channels, device=device, dtype=dtype)
    out.append(Case("causal_conv1d_varlen", f"T={tokens} C={channels} K={width}",
                    lambda: kernels.causal_conv1d_varlen(xc, w, bias, cu, activation="silu"),
                    2 * xc.numel() * es, "GB/s"))
    cstate = torch.randn(batch, channels, width - 1, device=device, dtype=dtype)
    xcs = torch.randn(batch, channels, device=device, dtype=dtype)
    out.append(Case("causal_conv1d_step", f"B={batch} C={channels} K={width}",
                    lambda: kernels.causal_conv1d_step(cstate, xcs, w, bias, activation="silu", slots=slots),
                    2 * cstate.numel() * es, "GB/s"))
    return out


def bench_kernels(case_list: list[Case], device: str, warmup: int, repeats: int) -> list[dict]:
    rows = []
    for case in tqdm(case_list, desc="kernels", unit="op"):
        base = None
        for backend in ("torch", "triton", "cuda"):
            why_not = dispatch.why_not(case.op, backend, device)
            row = {"op": case.op, "shape": case.shape, "backend": backend}
            if why_not is None:
                try:
                    with torch.inference_mode(), dispatch.use_backend(backend):
                        sec = median_seconds(case.run, torch.device(device), warmup=warmup, repeats=repeats)
                except dispatch.BackendError as e:  # a per-call constraint of the package
                    why_not = str(e)
            if why_not is not None:
                rows.append({**row, "median_ms": "-", "rate": "-", "vs torch": "-", "note": why_not[:80]})
                continue
            base = sec if backend == "torch" else base
            scale = 1e12 if case.unit == "TFLOP/s" else 1e9
            rows.append({**row, "median_ms": f"{sec * 1e3:.3f}", "rate": f"{case.work / sec / scale:.2f} {case.unit}",
                         "vs torch": f"{base / sec:.2f}x" if base else "-", "note": ""})
    return rows


def bench_models(names: list[str], seq_len: int, dtype: torch.dtype, device: str, warmup: int,
                 repeats: int) -> list[dict]:
    from hybrid import recipes
    from hybrid.model import HybridLM

    rows = []
    for name in tqdm(names, desc="models", unit="model"):
        with torch.device(device):
            model = HybridLM(recipes.get(name)).to(dtype).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
        base = None
        for backend in ("torch", "triton", "cuda", None):
            with torch.inference_mode(), dispatch.use_backend(backend):
                try:
                    sec = median_seconds(functools.partial(model, ids), torch.device(device), warmup=warmup,
                                         repeats=repeats)
                except dispatch.BackendError as e:
                    rows.append({"model": name, "backend": backend or "default", "tokens/s": "-",
                                 "vs torch": "-", "note": str(e)[:80]})
                    continue
            base = sec if backend == "torch" else base
            rows.append({"model": name, "backend": backend or "default", "tokens/s": f"{seq_len / sec:,.0f}",
                         "vs torch": f"{base / sec:.2f}x", "note": ""})
    return rows


def _table(rows: list[dict]) -> str:
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat: checks the script runs (CPU ok)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=8192, help="prompt length for the end-to-end prefill")
    ap.add_argument("--models", nargs="*", default=None, help="recipes for end-to-end prefill (default: *-small)")
    add_json(ap)
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("kernel_bench times GPU kernels and needs a CUDA device; none was found. Run with --smoke "
                 "(and TRITON_INTERPRET=1) for a tiny CPU check that the script and every backend path run.")
    dtype = getattr(torch, args.dtype)
    if args.smoke:
        if device == "cpu":
            dtype = torch.float32  # the interpreter's bf16 arithmetic is wrong, and fp16 matmuls are slow on CPU
        shapes = dict(tokens=128, seqs=2, hq=4, hkv=2, d=32, heads=2, p=16, n=16, batch=2, ctx=96, block=16)
        warmup, repeats, seq_len = 0, 1, 32
        models = args.models if args.models is not None else ["hybrid-1to7-tiny"]
    else:
        shapes = dict(tokens=8192, seqs=4, hq=32, hkv=8, d=128, heads=64, p=64, n=128, batch=64, ctx=4096, block=256)
        warmup, repeats, seq_len = args.warmup, args.repeats, args.seq_len
        from hybrid import recipes

        models = args.models if args.models is not None else [m for m in recipes.names() if m.endswith("-small")]
    where = torch.cuda.get_device_name() if device == "cuda" else \
        f"CPU, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')} (smoke: numbers mean nothing)"
    print(f"# kernel_bench on {where}, {dtype}, median of {repeats} after {warmup} warm-up")
    torch.manual_seed(0)
    ops = bench_kernels(cases(**shapes, dtype=dtype, device=device), device, warmup, repeats)
    print(_table(ops))
    prefill = []
    if models:
        print(f"\n# end-to-end prefill, 1 x {seq_len} tokens ('default' = the dispatch's own choice per op)")
        prefill = bench_models(models, seq_len, dtype, device, warmup, repeats)
        print(_table(prefill))
    record(args.json, "kernels", ops, device=where, dtype=str(dtype), prefill=prefill)


if __name__ == "__main__":
    main()
