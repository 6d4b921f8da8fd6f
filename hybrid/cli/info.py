"""``hybrid info``: parameters, FLOPs/token and cache bytes of recipes or checkpoints."""

from __future__ import annotations

from .common import add_model_args, models_from_args, positive_int, progress
from .engine_args import add_engine_args


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="parameters, FLOPs/token and cache bytes of recipes or checkpoints")
    add_model_args(p)
    p.add_argument("--seq-len", type=positive_int, default=2048, help="context length for FLOPs/token")
    p.add_argument("--list", action="store_true", help="list recipe names")
    add_engine_args(p, ("kv_dtype", "state_dtype"))
    p.set_defaults(func=run)


def run(args) -> None:
    from .. import recipes
    from ..report import format_table, model_facts

    if args.list:
        print("\n".join(recipes.names()))
        return
    models = models_from_args(args)
    rows = [model_facts(n, m, args.seq_len) for n, m in progress(models.items(), "counting")]
    if args.kv_dtype or args.state_dtype:
        for row, model in zip(rows, models.values(), strict=True):
            row.update(compressed_facts(model, args.kv_dtype, args.state_dtype, args.seq_len))
    print(format_table(rows))


def compressed_facts(model, kv_dtype, state_dtype, seq_len: int) -> dict:
    """Cache bytes per token and per sequence of ``model`` at the given cache dtypes (block and state scales
    included), from the layers' cache specs, as the engine would allocate them (blocks of 16)."""
    from ..cache import cache_dtypes
    from ..kernels.kv_quant import dtype_name

    d = cache_dtypes(next(model.parameters()).dtype, kv_dtype, state_dtype)
    spec = model.cache_spec(kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm)
    tag = f"{dtype_name(d.kv)}/{dtype_name(d.ssm)}"
    return {f"KV_bytes/token({tag})": round(spec.kv_bytes_per_token_with_scales(16), 2),
            f"state_bytes/seq({tag})": spec.state_bytes_per_sequence,
            f"cache_MiB/seq@{seq_len}({tag})": round(spec.bytes_per_sequence(seq_len, block_size=16) / 2**20, 3)}
