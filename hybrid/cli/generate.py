"""``hybrid generate``: stream a continuation of a prompt, or (``--chat``) the answer to it as a user message;
prefill and decode tokens/s at the end."""

from __future__ import annotations

import argparse
import sys

from .common import add_dtype_device, engine_model, threads_flag
from .engine_args import add_engine_args, engine_config
from .errors import CLIError
from .sampling_flags import add_sampling_flags, check_sampling_flags, sampling_params


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt, or a chat answer; prefill and decode "
                                        "tokens/s at the end")
    p.add_argument("--model", help="checkpoint folder, .gguf file or model name (smollm2-135m-instruct); its "
                                   "tokenizer is used if it has one, else bytes")
    p.add_argument("--recipe", help="recipe name (random weights, byte tokenizer)")
    p.add_argument("--prompt", required=True, help="the text to continue, or with --chat the user's message")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="send --prompt as a user message through the model's chat template and print only the "
                        "answer (default: on when the model has a chat template or --system is given; --no-chat "
                        "continues the raw text)")
    p.add_argument("--system", help="the system message of --chat (default: the template's own, if any)")
    add_sampling_flags(p, max_new_tokens=64)
    add_engine_args(p, ("max_batch_tokens", "compile", "prefix_caching", "kv_dtype", "state_dtype", "kv_pruning",
                        "multi_step", "speculative"), multi_step=4)
    add_dtype_device(p)
    threads_flag(p)
    p.set_defaults(func=run)


def run(args) -> None:
    from ..engine import Engine

    check_sampling_flags(args)  # a wrong value is named before a model is built
    model, tokenizer = engine_model(args, seed=0 if args.seed is None else args.seed)
    chat = chat_prompt(args, tokenizer)
    prompt, stop = (tokenizer.encode(args.prompt), ()) if chat is None else chat
    params = sampling_params(args, tokenizer, extra_stop=stop)
    block_size = 16  # a cache for this one request
    config = engine_config(args, model, num_blocks=-(-(len(prompt) + params.max_new_tokens) // block_size),
                           block_size=block_size, max_seqs=1)
    engine = Engine(model, config, tokenizer=tokenizer)
    engine.add_request(prompt, params)
    if chat is None:  # a continuation prints after its prompt; a chat answer stands alone
        sys.stdout.write(args.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    print(file=sys.stdout, flush=True)
    report(engine, args)


def chat_prompt(args, tokenizer) -> tuple[list[int], tuple[str, ...]] | None:
    """With chat on: the token ids of [system,] user rendered through the chat template (its text already
    holds the template's special tokens, so none are added) and the template's stop strings; None with chat off.
    Chat is on with ``--chat``, and by default when the model has a chat template or ``--system`` is given."""
    from ..server.chat_template import load_chat_template

    if args.chat is False:
        if args.system is not None:
            raise CLIError("--system is the system message of a chat: drop --no-chat, or --system")
        return None
    template = load_chat_template(args.model)  # the ChatML default for a recipe or a folder without one
    if args.chat is None and template.is_default and args.system is None:
        return None
    messages = [{"role": "user", "content": args.prompt}]
    if args.system is not None:
        messages.insert(0, {"role": "system", "content": args.system})
    text = template.render(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False), template.stop


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
