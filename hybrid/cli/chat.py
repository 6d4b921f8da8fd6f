"""``hybrid chat``: a conversation with a model on the terminal, its answers streamed.

Each turn renders the whole conversation through the model's chat template (the one renderer the server
uses, :mod:`hybrid.server.chat_template`) and submits it as one request to an engine with the prefix cache
on: the part of the conversation already computed in earlier turns is served from the cache (its KV blocks
and Mamba state checkpoints), so a turn costs its new tokens, not the whole history. ``/reset`` starts the
conversation again, ``/exit`` or the end of input (Ctrl-D) ends it; Ctrl-C stops an answer mid-way.
"""

from __future__ import annotations

import sys

from .common import add_dtype_device, engine_model, positive_int, threads_flag
from .engine_args import add_engine_args, engine_config
from .errors import CLIError
from .sampling_flags import add_sampling_flags, check_sampling_flags, sampling_params

BLOCK_SIZE = 16


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model on the terminal (streamed answers, the conversation's "
                                    "prefix cached between turns)")
    p.add_argument("--model", help="checkpoint folder, .gguf file or model name (smollm2-135m-instruct)")
    p.add_argument("--recipe", help="recipe name (random weights, byte tokenizer, the ChatML default template)")
    p.add_argument("--system", help="the system message (default: the template's own, if any)")
    add_sampling_flags(p, max_new_tokens=256)
    p.add_argument("--max-context", type=positive_int, default=4096,
                   help="tokens the conversation may reach (the KV cache is sized for it); /reset starts over")
    add_dtype_device(p)
    threads_flag(p)
    add_engine_args(p, ("multi_step",), multi_step=4)
    p.set_defaults(func=run)


def run(args) -> None:
    from ..engine import Engine
    from ..server.chat_template import load_chat_template

    check_sampling_flags(args)
    model, tokenizer = engine_model(args, seed=0 if args.seed is None else args.seed)
    template = load_chat_template(args.model)
    params = sampling_params(args, tokenizer, extra_stop=template.stop)
    if params.max_new_tokens >= args.max_context:
        raise CLIError(f"--max-new-tokens {params.max_new_tokens} leaves no room for a prompt in --max-context "
                       f"{args.max_context}")
    # the conversation's blocks, plus room for the prefix tree to keep the previous turn's own blocks while the
    # new request shares them (their refcounts keep them; the tree evicts the rest under pressure)
    config = engine_config(args, num_blocks=2 * -(-args.max_context // BLOCK_SIZE), block_size=BLOCK_SIZE,
                           max_seqs=1, max_batch_tokens=512, prefix_caching=True)
    engine = Engine(model, config, tokenizer=tokenizer)
    start = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(start)
    print(f"chat with {args.model or args.recipe}: /reset starts over, /exit or Ctrl-D ends", file=sys.stderr,
          flush=True)
    turns = 0
    for line in sys.stdin:
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(start)
            print("(conversation reset)", file=sys.stderr, flush=True)
            continue
        messages.append({"role": "user", "content": text})
        prompt = tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
        if len(prompt) + params.max_new_tokens > args.max_context:
            messages.pop()
            print(f"(the conversation would reach {len(prompt) + params.max_new_tokens} tokens, past --max-context "
                  f"{args.max_context}: /reset, or start again with a larger --max-context)", file=sys.stderr,
                  flush=True)
            continue
        messages.append({"role": "assistant", "content": answer(engine, prompt, params)})
        turns += 1
    s = engine.stats
    print(f"{turns} turns; prefix cache: {s.prefix_hit_tokens} of {s.prompt_tokens} prompt tokens served",
          file=sys.stderr, flush=True)


def answer(engine, prompt: list[int], params) -> str:
    """Stream one answer to stdout; returns its text (cut where Ctrl-C stopped it)."""
    rid = engine.add_request(prompt, params)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        engine.abort(rid)
    print(flush=True)
    return engine.forget(rid).text
