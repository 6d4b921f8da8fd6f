"""``hybrid doctor``: which kernel backend each op uses here, and why not the others; with ``--recipe`` /
``--model``, which decode backend that model's decode steps run on, and every backend's verdict."""

from __future__ import annotations

from .common import add_model_args, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="which kernel backend each op uses here, and why not the others; with a "
                                      "model, which decode backend its steps run on and why not the others")
    add_model_args(p)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 32],
                   help="decode batch sizes (sequences decoding together) to report the decode backends for")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..kernels.doctor import report

    print(report())
    if args.recipe or args.model:
        from .common import models_from_args

        for name, model in models_from_args(args).items():
            print("\n".join(["", *decode_report(name, model, args.rows)]))


def decode_report(name: str, model, rows: list[int]) -> list[str]:
    """Per decode batch size: the backend an engine's decode step of ``model`` runs on, then each backend's verdict
    (as ``repr(engine)`` shows it), one line each."""
    import torch

    from ..engine import Engine, EngineConfig
    from ..sampling import SamplingParams

    with torch.inference_mode():
        engine = Engine(model, EngineConfig(num_blocks=2 * max(rows) + 2, block_size=16, max_seqs=max(rows)))
        # one short request first: its prefill and decode build what a decode step binds (the program)
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
        engine.run()
        runner = engine.runner
        lines = [f"# decode backends for {name} ({str(model.embed.weight.dtype).removeprefix('torch.')}; asked in "
                 f"order, the first that says yes runs the step)"]
        for n in rows:
            shape = runner.decode_shape(n)
            chosen = runner.decode_backend(n).name
            lines.append(f"{n} row{'s' if n > 1 else ''}: {chosen}")
            for b in runner.decode_backends:
                why = b.supports(model, engine.cache, shape)
                lines.append(f"  {b.name:<17} " + ("chosen" if b.name == chosen else "yes" if why is None
                                                   else f"no: {why}"))
    return lines
