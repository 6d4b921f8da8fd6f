"""Prefix-caching benchmark: what a cached prefix saves, cache on versus off, through the engine.

(a) ``shared``: requests that share one system prompt (``--shared`` tokens) and differ in a question
    (``--question`` tokens). Sent one at a time, each request's time to first token is its prefill: the
    first is cold, the rest hit (cache on). Then all at once (a burst): total wall time.
(b) ``chat``: a multi-turn chat where each turn resends the whole history plus a new user message.

Hit rate is ``prefix_hit_tokens`` over the tokens that were truly shared (each request's longest common
prefix with any earlier request). Random token ids and random weights: the cost of prefill does not
depend on the values, and outputs are checked equal between cache on and off.

    flock /tmp/bench.lock python -m benchmarks.prefix --recipe hybrid-1to7-small --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from os.path import commonprefix

import torch
from tqdm import tqdm

from hybrid import Engine, EngineConfig, HybridLM, SamplingParams, recipes


def _spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def truly_shared(prompts: list[list[int]], seen: list[list[int]] | None = None) -> int:
    """Tokens each prompt shares with an earlier request (its longest common prefix with any earlier
    request's tokens, ``seen[j]``: its prompt and output; at most all but its own last token, since one
    token is always computed), summed."""
    seen = prompts if seen is None else seen
    return sum(min(len(p) - 1, max((len(commonprefix([p, q])) for q in seen[:i]), default=0))
               for i, p in enumerate(prompts))


def _engine(model, on: bool, args) -> Engine:
    return Engine(model, EngineConfig(cache_bytes=args.cache_mib * 2**20, max_seqs=args.max_seqs,
                                      max_batch_tokens=args.max_batch_tokens, prefix_caching=on,
                                      prefix_state_bytes=args.state_mib * 2**20 if on else None))


def bench_shared(model, args, on: bool, g) -> dict:
    system = torch.randint(0, model.config.vocab_size, (args.shared,), generator=g).tolist()
    prompts = [system + torch.randint(0, model.config.vocab_size, (args.question,), generator=g).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    # one at a time: time to first token is the prefill
    e = _engine(model, on, args)
    ttft, outputs = [], []
    alone = prompts if on or not args.off_alone else prompts[:args.off_alone]
    for p in tqdm(alone, desc=f"shared one-by-one ({'on' if on else 'off'})", leave=False):
        rid = e.add_request(p, params)
        e.run()
        ttft.append(e.stats.time_to_first_token[rid])
        outputs.append(e.requests[rid].output)
    seq = {"cold_ttft_s": ttft[0], "hit_ttft_s": _spread(ttft[1:]) if on else None,
           "all_ttft_s": _spread(ttft), "prefix_hit_tokens": e.stats.prefix_hit_tokens,
           "truly_shared_tokens": truly_shared(alone), "prompt_tokens": e.stats.prompt_tokens,
           "prompt_tokens_computed": e.stats.prompt_tokens_computed}
    # a burst: all at once on a fresh engine
    e = _engine(model, on, args)
    t0 = time.perf_counter()
    ids = [e.add_request(p, params) for p in prompts]
    e.run()
    wall = time.perf_counter() - t0
    burst = {"wall_s": wall, "prefix_hit_tokens": e.stats.prefix_hit_tokens,
             "prompt_tokens_computed": e.stats.prompt_tokens_computed,
             "ttft_s": _spread([e.stats.time_to_first_token[i] for i in ids])}
    return {"one_by_one": seq, "burst": burst,
            "outputs": outputs[:args.off_alone or None] + [e.requests[i].output for i in ids]}


def bench_chat(model, args, on: bool, g) -> dict:
    e = _engine(model, on, args)
    history = torch.randint(0, model.config.vocab_size, (args.chat_first,), generator=g).tolist()
    prompts, ttft, outputs = [], [], []
    t0 = time.perf_counter()
    for _ in tqdm(range(args.turns), desc=f"chat ({'on' if on else 'off'})", leave=False):
        rid = e.add_request(history, SamplingParams(max_new_tokens=args.chat_reply))
        e.run()
        prompts.append(list(history))
        ttft.append(e.stats.time_to_first_token[rid])
        outputs.append(e.requests[rid].output)
        history = history + e.requests[rid].output + torch.randint(
            0, model.config.vocab_size, (args.chat_user,), generator=g).tolist()
    seen = [p + o for p, o in zip(prompts, outputs, strict=True)]
    return {"wall_s": time.perf_counter() - t0, "ttft_s": ttft, "prefix_hit_tokens": e.stats.prefix_hit_tokens,
            "truly_shared_tokens": truly_shared(prompts, seen), "prompt_tokens": e.stats.prompt_tokens,
            "prompt_tokens_computed": e.stats.prompt_tokens_computed, "outputs": outputs}


def bench_mmlu(model, args, on: bool, g) -> dict:
    """Real MMLU 5-shot through lm-eval (``mmlu_local``), log-likelihoods scored directly (off) or through
    the engine's prefix cache (on)."""
    from hybrid.eval.lm_eval_run import run, task_accuracy

    tasks = [f"mmlu_local_{s}" for s in args.subjects]
    extra = {"prefix_caching": True, "max_batch_tokens": args.max_batch_tokens} if on else {}
    t0 = time.perf_counter()
    results = run(model, tasks=tasks, num_fewshot=5, limit=args.limit, mmlu_dir=args.mmlu_dir,
                  batch_size=args.max_seqs, max_length=args.max_length, **extra)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens_computed": results["hybrid_tokens_computed"],
            "accuracy": {t: task_accuracy(results, t) for t in tasks}, "outputs": None}


SCENARIOS = {"shared": bench_shared, "chat": bench_chat, "mmlu": bench_mmlu}


def run_models(models: dict, scenarios: list[str], argv: list[str] | None = None) -> dict:
    """Run ``scenarios`` on already built ``models`` (name -> HybridLM), cache off then on; settings from
    this script's flags in ``argv``. Returns name -> scenario -> summary (``hybrid bench --prefix-caching``)."""
    args = build_parser().parse_args(argv or [])
    out = {}
    for name, model in models.items():
        for scenario in scenarios:
            runs = {on: SCENARIOS[scenario](model, args, on, torch.Generator().manual_seed(args.seed))
                    for on in (False, True)}
            same = runs[False].pop("outputs") == runs[True].pop("outputs")
            out.setdefault(name, {})[scenario] = summary(scenario, {"off": runs[False], "on": runs[True],
                                                                     "outputs_equal": same})
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", nargs="+", default=["hybrid-1to7-small", "llama-small", "mamba2-small"])
    p.add_argument("--scenarios", nargs="+", default=["shared", "chat"], choices=sorted(SCENARIOS))
    p.add_argument("--subjects", nargs="+", default=["anatomy", "astronomy", "marketing"], help="mmlu subjects")
    p.add_argument("--limit", type=int, default=5, help="mmlu questions per subject")
    p.add_argument("--mmlu-dir", default=None, help="MMLU folder (default: as hybrid eval finds it)")
    p.add_argument("--max-length", type=int, default=8192, help="mmlu: longest input (bytes with the byte tokenizer)")
    p.add_argument("--shared", type=int, default=2048, help="system-prompt tokens every request shares")
    p.add_argument("--question", type=int, default=64, help="distinct tokens per request after it")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--off-alone", type=int, default=0,
                   help="cache off, send only this many requests one at a time (every one is cold; 0: all)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--chat-first", type=int, default=512, help="first user message (tokens)")
    p.add_argument("--chat-user", type=int, default=128, help="each later user message (tokens)")
    p.add_argument("--chat-reply", type=int, default=32, help="tokens each assistant reply generates")
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--cache-mib", type=int, default=2048)
    p.add_argument("--state-mib", type=int, default=1024, help="prefix_state_bytes in MiB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the results as JSON here")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "args": vars(args), "models": {}}
    for name in args.recipe:
        torch.manual_seed(args.seed)
        model = HybridLM(recipes.get(name)).eval()
        res = {}
        for scenario in args.scenarios:
            fn = SCENARIOS[scenario]
            runs = {on: fn(model, args, on, torch.Generator().manual_seed(args.seed)) for on in (False, True)}
            same = runs[False].pop("outputs") == runs[True].pop("outputs")
            res[scenario] = {"off": runs[False], "on": runs[True], "outputs_equal": same}
            print(json.dumps({name: {scenario: summary(scenario, res[scenario])}}), flush=True)
        results["models"][name] = res
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


def summary(scenario: str, r: dict) -> dict:
    on, off = r["on"], r["off"]
    if scenario == "mmlu":
        return {"wall_s": {"off": round(off["wall_s"], 2), "on": round(on["wall_s"], 2)},
                "tokens_computed": {"off": off["tokens_computed"], "on": on["tokens_computed"]},
                "fewer_tokens_x": round(off["tokens_computed"] / max(1, on["tokens_computed"]), 2),
                "accuracy": {"off": off["accuracy"], "on": on["accuracy"]},
                "accuracies_identical": off["accuracy"] == on["accuracy"]}
    if scenario == "shared":
        s_on, s_off = on["one_by_one"], off["one_by_one"]
        return {"cold_ttft_s": round(s_on["cold_ttft_s"], 3),
                "hit_ttft_s": {k: round(v, 4) for k, v in s_on["hit_ttft_s"].items()},
                "hit/cold": round(s_on["hit_ttft_s"]["median"] / s_on["cold_ttft_s"], 4),
                "off_ttft_median_s": round(s_off["all_ttft_s"]["median"], 3),
                "hit_rate": round(s_on["prefix_hit_tokens"] / max(1, s_on["truly_shared_tokens"]), 4),
                "burst_wall_s": {"off": round(off["burst"]["wall_s"], 2), "on": round(on["burst"]["wall_s"], 2)},
                "burst_hit_rate": round(on["burst"]["prefix_hit_tokens"] / max(1, s_on["truly_shared_tokens"]), 4),
                "outputs_equal": r["outputs_equal"]}
    return {"wall_s": {"off": round(off["wall_s"], 2), "on": round(on["wall_s"], 2)},
            "ttft_s": {"off": [round(t, 3) for t in off["ttft_s"]], "on": [round(t, 3) for t in on["ttft_s"]]},
            "hit_rate": round(on["prefix_hit_tokens"] / max(1, on["truly_shared_tokens"]), 4),
            "prompt_tokens_computed": {"off": off["prompt_tokens_computed"], "on": on["prompt_tokens_computed"]},
            "outputs_equal": r["outputs_equal"]}


if __name__ == "__main__":
    main()
