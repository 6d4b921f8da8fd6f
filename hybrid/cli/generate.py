"""``hybrid generate``: stream a continuation of a prompt; prefill and decode tokens/s at the end."""

from __future__ import annotations

import sys

from .common import (
    add_cache_dtype_args,
    add_dtype_device,
    add_pruning_flag,
    add_speculative_flags,
    engine_model,
    multi_step_flag,
    positive_int,
    speculative,
    threads_flag,
)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt; prefill and decode tokens/s at the end")
    p.add_argument("--model", help="checkpoint folder (its tokenizer.json is used if present, else bytes)")
    p.add_argument("--recipe", help="recipe name (random weights, byte tokenizer)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 is off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens "
                                                            "whose probabilities sum to p, in (0, 1] (1 is off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than min_p x the most likely, "
                                                            "in [0, 1] (0 is off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is off")
    p.add_argument("--stop", nargs="*", help="stop when the text contains any of these strings")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (and a --recipe's weights; default: 0 for "
                                                          "the weights, a random draw for sampling)")
    p.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk (tokens per step)")
    p.add_argument("--compile", action="store_true", help="compile the decode step (torch.compile)")
    p.add_argument("--prefix-caching", action="store_true", help="engine with the prefix cache on (reports its hits)")
    add_cache_dtype_args(p)
    add_pruning_flag(p)
    add_dtype_device(p)
    threads_flag(p)
    multi_step_flag(p, default=4)
    add_speculative_flags(p)
    p.set_defaults(func=run)


def run(args) -> None:
    from ..engine import Engine
    from ..sampling import SamplingParams

    # the sampling values first: a wrong one is named before a model is built
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=tuple(args.stop or ()))
    model, tokenizer = engine_model(args, seed=0 if args.seed is None else args.seed)
    prompt = tokenizer.encode(args.prompt)
    block_size = 16
    engine = Engine(model, num_blocks=-(-(len(prompt) + args.max_new_tokens) // block_size),
                    block_size=block_size, max_seqs=1, max_batch_tokens=args.chunk, tokenizer=tokenizer,
                    compile=args.compile, prefix_caching=args.prefix_caching,
                    speculative=speculative(args, model), kv_dtype=args.kv_dtype,
                    state_dtype=args.state_dtype, kv_pruning=args.kv_pruning, multi_step=args.multi_step)
    engine.add_request(prompt, params)
    sys.stdout.write(args.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    print(file=sys.stdout, flush=True)
    report(engine, args)


def report(engine, args) -> None:
    """Speeds, and what speculation, pruning and the prefix cache did, on stderr."""
    s = engine.stats
    print(f"prefill: {s.prefill_tokens} tokens in {s.prefill_seconds:.3f} s "
          f"({s.prefill_tokens / max(s.prefill_seconds, 1e-9):.1f} tok/s); "
          f"decode: {s.decode_tokens} tokens in {s.decode_seconds:.3f} s "
          f"({s.decode_tokens / max(s.decode_seconds, 1e-9):.1f} tok/s)"
          + (f"; compile: {s.compile_seconds:.1f} s (not counted)" if args.compile else ""), file=sys.stderr)
    if engine.speculative is not None:
        print(f"speculative ({engine.speculative.method}, k={engine.speculative.num_tokens}): "
              f"{s.draft_tokens_accepted} of {s.draft_tokens_proposed} draft tokens accepted "
              f"(rate {s.acceptance_rate:.2f}, {s.mean_accepted_length:.2f} per verify step)", file=sys.stderr)
    if args.kv_pruning is not None:
        r = engine.cache.report()
        print(f"kv pruning {r.kv_pruning}: {r.kv_blocks_pruned} KV blocks given back, "
              f"{r.kv_sequences_compressed} prompts compressed", file=sys.stderr)
    if args.prefix_caching:
        r = engine.cache.report()
        print(f"prefix cache: {s.prefix_hit_tokens} of {s.prompt_tokens} prompt tokens served; tree holds "
              f"{r.prefix_blocks} KV blocks, {r.prefix_checkpoints} state checkpoints ({r.prefix_state_bytes} bytes)",
              file=sys.stderr)
