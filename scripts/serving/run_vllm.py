"""Run one exported folder with vLLM (its CPU build here): greedy continuations of token-id prompts, or a
prefill/decode timing. Runs in the vLLM venv (it does not import hybrid); writes one JSON result.

    python run_vllm.py tokens MODEL_DIR PROMPTS.json OUT.json [--no-prefix-caching] [--tp N] [--dtype D]
    python run_vllm.py bench MODEL_DIR OUT.json --prefill 8x2048 --decode 32x64 [--decode-prompt 16] [--dtype D]
        [--greedy 1,2,3 --greedy-tokens 32]   # also the greedy continuation of those ids, from the same engine
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path


def last_error_line(exc: BaseException) -> str:
    """The innermost message of an exception chain (vLLM wraps worker errors several times)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"


def make_llm(model_dir: str, prefix_caching: bool, max_model_len: int, max_num_seqs: int,
             max_batch_tokens: int | None = None, tp: int = 1, dtype: str = "float32"):
    if tp > 1 and "|" not in os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""):
        # vLLM's CPU workers take one core list each, "|"-separated: one core per tensor-parallel rank
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    from vllm import LLM
    kw = dict(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, enable_prefix_caching=prefix_caching, seed=0, tensor_parallel_size=tp)
    if max_batch_tokens:
        kw["max_num_batched_tokens"] = max_batch_tokens
    return LLM(**kw)


def greedy(llm, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_tokens(args) -> dict:
    spec = json.loads(Path(args.prompts).read_text())
    result = {"loads": False, "serves": False, "tokens": None, "error": None}
    try:
        llm = make_llm(args.model, args.prefix_caching, spec["max_model_len"], len(spec["prompts"]), tp=args.tp,
                       dtype=args.dtype)
        result["loads"] = True
        result["tokens"] = greedy(llm, spec["prompts"], spec["n_new"])
        result["serves"] = True
    except BaseException as e:  # noqa: BLE001  (the engine's failure is the result we report)
        result["error"] = last_error_line(e)
        result["traceback"] = traceback.format_exc()[-4000:]
    return result


def run_bench(args) -> dict:
    """Prefill: B prompts of L random ids, 1 new token each (median of repeats, after a warm-up).
    Decode: B prompts of P ids (``--decode-prompt``, default 16) x N new tokens, minus the same requests with 1
    new token (the least of the repeats: a fixed cost that noise only lengthens). ``--greedy IDS``: after the
    timing, that prompt's greedy continuation (``greedy_tokens``)."""
    import random
    bp, lp = (int(x) for x in args.prefill.split("x"))
    bd, nd = (int(x) for x in args.decode.split("x"))
    rng = random.Random(0)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]

    def ids(n):
        return [rng.randrange(vocab) for _ in range(n)]

    pd = args.decode_prompt
    check = [int(t) for t in args.greedy.split(",")] if args.greedy else []
    llm = make_llm(args.model, False, max(lp, pd + nd, len(check) + args.greedy_tokens) + 8, max(bp, bd),
                   max_batch_tokens=max(lp, 2048), dtype=args.dtype)

    def timed(prompts, n_new):
        t0 = time.perf_counter()
        greedy(llm, prompts, n_new)
        return time.perf_counter() - t0

    timed([ids(lp)], 1)  # warm-up (compiles, allocates)
    prefill = sorted(timed([ids(lp) for _ in range(bp)], 1) for _ in range(args.repeats))
    short = [ids(pd) for _ in range(bd)]
    timed(short, 2)
    first = min(timed(short, 1) for _ in range(args.repeats))
    decode = sorted(timed(short, nd) - first for _ in range(args.repeats))
    result = {"prefill_tok_s": [bp * lp / t for t in prefill], "decode_tok_s": [bd * (nd - 1) / t for t in decode]}
    if check:
        result["greedy_tokens"] = greedy(llm, [check], args.greedy_tokens)[0]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("model")
    t.add_argument("prompts")
    t.add_argument("out")
    t.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    t.add_argument("--tp", type=int, default=1, help="tensor-parallel size (CPU: one core per rank)")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b = sub.add_parser("bench")
    b.add_argument("model")
    b.add_argument("out")
    b.add_argument("--prefill", default="8x2048")
    b.add_argument("--decode", default="32x64")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--decode-prompt", type=int, default=16, help="prompt ids per decoding request")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b.add_argument("--greedy", default=None, metavar="IDS", help="comma-separated prompt ids to continue greedily")
    b.add_argument("--greedy-tokens", type=int, default=32, help="tokens of that continuation")
    args = ap.parse_args()
    result = run_tokens(args) if args.mode == "tokens" else run_bench(args)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
