"""``hybrid serve``: an OpenAI-compatible HTTP server (completions, chat, metrics) over the engine."""

from __future__ import annotations

from .common import add_dtype_device, byte_size, engine_model, non_negative_float, port_number, threads_flag
from .engine_args import add_engine_args, engine_config
from .errors import CLIError


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics) over the engine")
    p.add_argument("--model", help="checkpoint folder (its tokenizer.json and chat template are used if present)")
    p.add_argument("--recipe", help="recipe name (random weights from --seed, byte tokenizer)")
    p.add_argument("--served-model-name", help="the name clients ask for (default: the recipe or folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    add_dtype_device(p)
    # a refused request is a 400; the limits are checked against the cache once the engine is built
    add_engine_args(p, ("cache_bytes", "max_seqs", "max_batch_tokens", "long_prefill_tokens", "max_model_len",
                        "max_prompt_tokens", "compile", "prefix_caching", "multi_step", "kv_dtype", "state_dtype",
                        "kv_pruning", "speculative"), cache_bytes=256 * 2**20, max_seqs=32)
    threads_flag(p)
    p.add_argument("--seed", type=int, default=0, help="initialises a --recipe's random weights")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that gives none (completions default to 16, as OpenAI)")
    p.add_argument("--max-body-bytes", type=byte_size, default=8 * 2**20,
                   help="refuse request bodies larger than this (413) before parsing them")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    # the names are spelled out here (not read from hybrid.server.tool_parsers): building the parser must not
    # import the server's fastapi; run() checks the name against the registry, and a test keeps the two in step
    p.add_argument("--tool-call-parser", metavar="NAME",
                   help="turn tool calls in chat output into the response's tool_calls when a request offers tools "
                        "(as vLLM's --tool-call-parser): hermes (<tool_call>{JSON}</tool_call>: Qwen2.5, Qwen3, "
                        "Hermes 2 Pro) or llama3_json (the output is {JSON}[; {JSON}]: Llama 3.1/3.2). Default: "
                        "off, the output stays text")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")
    p.set_defaults(func=run)


def run(args) -> None:
    import logging
    from pathlib import Path

    # a missing fastapi / uvicorn / jinja2 is a ModuleNotFoundError: one line naming the serve extra
    from ..engine import Engine
    from ..server import ServerSettings, create_app, load_chat_template, tool_parsers
    from ..server import run as run_server

    if args.tool_call_parser is not None and args.tool_call_parser not in tool_parsers.names():
        raise CLIError(f"--tool-call-parser {args.tool_call_parser!r} is not a tool call parser; give one of: "
                       f"{', '.join(tool_parsers.names())}")
    model, tokenizer = engine_model(args, seed=args.seed)
    template = load_chat_template(args.model)  # None for a recipe: the documented default
    name = args.served_model_name or args.recipe or Path(args.model).resolve().name
    config = engine_config(args, model)
    # the length limits are set below, once the cache (what one sequence can hold) and the checkpoint are known
    engine = Engine(model, config.replace(max_model_len=None, max_prompt_tokens=None), tokenizer=tokenizer)
    context = model_context(args.model)
    max_model_len = args.max_model_len
    if max_model_len is None and context is not None and (engine.max_model_len or context + 1) > context:
        max_model_len = context  # the checkpoint's own limit, where it is below the cache's
    try:
        engine.set_length_limits(max_model_len, args.max_prompt_tokens)
    except ValueError as e:
        raise CLIError(str(e).replace("max_model_len=", "--max-model-len ").replace(
            "max_prompt_tokens=", "--max-prompt-tokens ").replace("give the engine a bigger cache",
                                                                  "give a bigger --cache-bytes")) from None
    settings = ServerSettings(model_name=name, max_body_bytes=args.max_body_bytes,
                              default_chat_tokens=args.default_max_tokens, shutdown_timeout=args.shutdown_timeout,
                              tool_call_parser=args.tool_call_parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    report = engine.cache.report()
    chat = "ChatML default" if template.is_default else "the checkpoint's"
    print(f"hybrid serve: {name!r} ({model.num_parameters():,} parameters, pattern {model.config.pattern!r}) on "
          f"http://{args.host}:{args.port}/v1; cache {report.bytes_total / 2**20:.0f} MiB: "
          f"{plain(report.token_capacity)} KV tokens, {report.max_sequences} sequences; requests up to "
          f"{plain(engine.max_model_len)} tokens, prompts up to {plain(engine.max_prompt_tokens)}; "
          f"{engine.max_batch_tokens} tokens a step; chat template: {chat}; tool calls: "
          f"{args.tool_call_parser or 'not parsed'}", flush=True)
    run_server(create_app(engine, tokenizer, settings, template), args.host, args.port, log_level=args.log_level,
               shutdown_timeout=args.shutdown_timeout)


def plain(count) -> str:
    """A token count as a plain integer ("1030580", not "1.03058e+06"); "unbounded" for none or infinity."""
    return "unbounded" if count is None or count == float("inf") else str(int(count))


def model_context(model_dir: str | None) -> int | None:
    """The checkpoint's context length (its config.json's ``max_position_embeddings``, as Hugging Face writes
    it), or None: a recipe, a folder without one, or a file."""
    import json
    from pathlib import Path

    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None  # loading the checkpoint has already checked (and named) its config
    return value if isinstance(value, int) and value > 1 else None
