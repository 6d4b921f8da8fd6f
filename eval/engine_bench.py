"""Inference-engine benchmark: prefill and decode speed through the engine, cache memory, and
greedy decoding against ``transformers``' ``generate`` on the same (random) Llama weights.

    python -m hybrid.eval.engine_bench --recipes llama-small hybrid-1to7-small --threads 8

Prints markdown tables (medians); ``--plot PATH`` also draws decode tokens/s against batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from .. import recipes
from ..cache import sequences_that_fit
from ..engine import Engine
from ..model import HybridLM
from ..pretrained import save_pretrained
from ..report import format_table
from ..sampling import SamplingParams
from ..specs import CacheDtypes, cache_specs

BLOCK = 16


def _sync(model: HybridLM) -> None:
    p = next(model.parameters())
    if p.device.type == "cuda":
        torch.cuda.synchronize(p.device)


def _prompt(model: HybridLM, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()


def prefill_speed(model: HybridLM, context: int, repeats: int) -> dict:
    """One prompt of ``context`` tokens prefilled in one engine step (sampling its first token)."""
    times = []
    for r in range(repeats + 1):  # the first run warms up and is not counted
        engine = Engine(model, num_blocks=-(-context // BLOCK) + 1, block_size=BLOCK, max_seqs=1,
                        max_batch_tokens=context)
        engine.add_request(_prompt(model, context, r), SamplingParams(max_new_tokens=1))
        _sync(model)
        t0 = time.perf_counter()
        engine.step()
        _sync(model)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    return {"context": context, "prefill_ms": round(med * 1e3, 1), "prefill_tok/s": round(context / med, 1)}


def decode_speed(model: HybridLM, batch: int, prompt_len: int, steps: int) -> dict:
    """``batch`` sequences decoding together: median time of a step of one token each."""
    engine = Engine(model, num_blocks=batch * -(-(prompt_len + steps + 1) // BLOCK), block_size=BLOCK,
                    max_seqs=batch, max_batch_tokens=batch * prompt_len)
    for b in range(batch):
        engine.add_request(_prompt(model, prompt_len, b), SamplingParams(max_new_tokens=steps + 1))
    engine.step()  # every prompt prefilled, first tokens sampled
    times = []
    for _ in range(steps):
        _sync(model)
        t0 = time.perf_counter()
        engine.step()
        _sync(model)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"batch": batch, "context": prompt_len, "step_ms": round(med * 1e3, 2),
            "decode_tok/s": round(batch / med, 1)}


def memory_rows(names: list[str], context: int, seq_len: int, cache_gib: float, chunk: int) -> list[dict]:
    """KV and state bytes per sequence, and how many ``seq_len``-token sequences fit in the cache
    (prefilled ``chunk`` tokens per step: sliding-window models keep only their window's blocks).

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


# ---- transformers comparison (Llama configs only) ------------------------------------------------
def llama_pair(cfg) -> tuple[torch.nn.Module, HybridLM]:
    """A random HybridLM with a Llama pattern and the ``transformers`` LlamaForCausalLM loaded from its
    export (``hybrid.interop``): the same weights on both sides."""
    from transformers import LlamaForCausalLM

    ours = HybridLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(ours, d, format="llama")  # refuses, with the reason, what Llama cannot represent
        hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return hf, ours


@torch.inference_mode()
def versus_transformers(cfg, prompt_len: int, new_tokens: int) -> dict:
    hf, ours = llama_pair(cfg)
    # random weights give near-uniform logits; sharpen them so greedy ties are rare (a tied head is the
    # embedding: HF's lm_head shares its weight, ours has none and reads embed)
    hf.lm_head.weight.mul_(20)
    if ours.lm_head is not None:
        ours.lm_head.weight.mul_(20)
    elif ours.embed.weight.data_ptr() != hf.lm_head.weight.data_ptr():
        ours.embed.weight.mul_(20)
    prompt = _prompt(ours, prompt_len, 0)
    ids = torch.tensor([prompt])
    hf.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    hf_out = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    hf_s = time.perf_counter() - t0
    engine = Engine(ours, num_blocks=-(-(prompt_len + new_tokens) // BLOCK), block_size=BLOCK, max_seqs=1,
                    max_batch_tokens=prompt_len)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens))
    t0 = time.perf_counter()
    engine.run()
    ours_s = time.perf_counter() - t0
    same = hf_out[0, prompt_len:].tolist() == engine.requests[rid].output
    return {"prompt": prompt_len, "new_tokens": new_tokens, "transformers_tok/s": round(new_tokens / hf_s, 1),
            "engine_tok/s": round(new_tokens / ours_s, 1), "speedup": round(hf_s / ours_s, 2),
            "same_greedy_tokens": same}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hybrid.eval.engine_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["llama-small", "hybrid-1to7-small"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192], help="prefill lengths")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    ap.add_argument("--decode-context", type=int, default=128, help="prompt length before decoding")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-context", type=int, default=8192, help="context for the KV bytes per sequence")
    ap.add_argument("--fit-seq-len", type=int, default=4096)
    ap.add_argument("--cache-gib", type=float, default=4.0)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk assumed for the memory table")
    ap.add_argument("--memory-recipes", nargs="+", default=None,
                    help="recipes for the memory table (default: --recipes)")
    ap.add_argument("--hf-recipe", default=None, help="Llama recipe to race against transformers "
                    "(default: the first llama-* in --recipes); 'none' skips it")
    ap.add_argument("--hf-prompt", type=int, default=128)
    ap.add_argument("--hf-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write all rows here")
    ap.add_argument("--plot", default=None, help="PNG of decode tokens/s against batch size")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    speed = {"prefill": [], "decode": []}
    todo = [(n, "prefill", c) for n in args.recipes for c in args.contexts]
    todo += [(n, "decode", b) for n in args.recipes for b in args.batches]
    models = {}
    for name, kind, x in tqdm(todo, desc="engine bench", unit="run"):
        if name not in models:
            models[name] = HybridLM(recipes.get(name)).to(dtype).eval()
        m = models[name]
        row = (prefill_speed(m, x, args.repeats) if kind == "prefill"
               else decode_speed(m, x, args.decode_context, args.decode_steps))
        speed[kind].append({"model": name, **row})
    # print each table as soon as it exists: a late failure must not lose the runs before it
    print(f"# engine on {torch.get_num_threads()} CPU threads, dtype {args.dtype}; medians")
    print("\n## prefill (one sequence, one step)\n" + format_table(speed["prefill"]))
    print("\n## decode (one token per sequence per step)\n" + format_table(speed["decode"]), flush=True)
    memory = memory_rows(args.memory_recipes or args.recipes, args.kv_context, args.fit_seq_len, args.cache_gib,
                         args.chunk)
    print("\n## cache memory (KV and conv state bf16, SSM state fp32)\n" + format_table(memory), flush=True)
    hf_name = args.hf_recipe or next((n for n in args.recipes if n.startswith("llama-")), "none")
    hf_rows = []
    if hf_name != "none":
        torch.manual_seed(0)
        hf_rows.append({"model": hf_name, **versus_transformers(recipes.get(hf_name), args.hf_prompt,
                                                                args.hf_new_tokens)})
    if hf_rows:
        print("\n## greedy decode vs transformers generate (same weights, batch 1, fp32)\n" + format_table(hf_rows))
    else:
        print("\n(transformers comparison skipped: no llama-* recipe given)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**speed, "memory": memory, "transformers": hf_rows}, f, indent=2)
    if args.plot:
        _plot(speed["decode"], args.plot)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        ax.plot([r["batch"] for r in mine], [r["decode_tok/s"] for r in mine], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences decoding together")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
