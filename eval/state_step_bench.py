"""Per-op timing of the one-token Mamba state steps at the real shapes of the ``-small`` recipes (issue 15).

For each state layout (``mamba2-small``'s Mamba-2 SSM state ``[24, 64, 128]``, ``jamba-small``'s Mamba-1
state ``[1536, 16]``) and storage dtype (fp32, bf16, int8) one decode step of ``batch`` sequences through
:class:`hybrid.cache.StatePool.step`, exactly as a layer calls it (rows ``slots`` of a pool of ``batch + 1``
rows, the slots one increasing run as the engine hands them out, or shuffled with ``--scatter``):
min / median / max milliseconds per layer over ``repeats`` timed runs (the dtypes' runs interleaved), each
stepping ``layers`` pools in turn (a state is not in cache from its own last step, as in a model's
forward). ``python -m hybrid.eval.state_step_bench --threads 2`` (wrap it in ``flock /tmp/bench.lock``; a
shared machine's timings are noisy).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from .. import recipes
from ..cache import StatePool
from ..kernels import dispatch, int8_state_step
from ..kernels.packing import with_host_values
from ..kernels.selective import selective_step
from ..kernels.ssd import ssd_step
from ..layers.registry import cache_specs
from ..specs import CacheDtypes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def step_inputs(recipe: str, batch: int, g: torch.Generator):
    """(op, state shape, groups of an int8 state, the op's arguments) of one Mamba layer of ``recipe``."""
    cfg = recipes.get(recipe)
    spec = next(iter(cache_specs(cfg, CacheDtypes.for_dtype(torch.bfloat16, ssm=torch.int8)).mamba.values()))
    if cfg.pattern.replace("-", "").replace("*", "").startswith("m"):  # Mamba-1
        d, n = spec.ssm_shape
        A = -torch.rand(d, n, generator=g) * 8 - 0.5
        args = (torch.randn(batch, d, generator=g), torch.rand(batch, d, generator=g) * 0.1, A,
                torch.randn(batch, n, generator=g), torch.randn(batch, n, generator=g))
        return selective_step, spec.ssm_shape, spec.ssm_groups, args, torch.randn(d, generator=g)
    h, p, n = spec.ssm_shape
    args = (torch.randn(batch, h, p, generator=g), torch.rand(batch, h, generator=g) * 0.1,
            -torch.rand(h, generator=g) * 8 - 0.5, torch.randn(batch, 1, n, generator=g),
            torch.randn(batch, 1, n, generator=g))
    return ssd_step, spec.ssm_shape, spec.ssm_groups, args, torch.randn(h, generator=g)


def backend_of(op, dtype: str) -> str:
    """Which implementation a pool's step of ``op`` runs for ``dtype`` storage."""
    if dtype != "int8":
        return dispatch.choose(op.__name__, "cpu")[0]
    fused = int8_state_step.fused_int8_step(op)
    if fused is None:
        return "dequantise -> fp32 step -> quantise"
    return f"{fused.__name__}: " + dispatch.choose(fused.__name__, "cpu")[0]


def _pools(recipe: str, dtype: str, batch: int, layers: int, g: torch.Generator):
    op, shape, groups, args, D = step_inputs(recipe, batch, torch.Generator().manual_seed(0))
    pools = []
    for _ in range(layers):
        pool = StatePool(shape, DTYPES[dtype], batch + 1, groups)
        pool.write(torch.arange(batch + 1), torch.randn(batch + 1, *shape, generator=g))
        pools.append(pool)
    return op, shape, args, D, pools


def time_steps(recipe: str, dtypes: list[str], batch: int, repeats: int, warmup: int = 3, scatter: bool = False,
               layers: int = 8) -> list[dict]:
    """Milliseconds of one layer's step per storage dtype: each timed run steps ``layers`` pools (as many
    layers of a model) in turn, so a state is not still in cache from its own previous step, as in a real
    forward; the dtypes take their runs in turn (a burst of load from other work hits them alike)."""
    g = torch.Generator().manual_seed(1)
    setups = {d: _pools(recipe, d, batch, layers, g) for d in dtypes}
    order = torch.randperm(batch, generator=g) if scatter else torch.arange(batch)
    slots = with_host_values(order, tuple(order.tolist()))
    times = {d: [] for d in dtypes}
    for i in tqdm(range(warmup + repeats), desc=f"{recipe} state steps", unit="round", leave=False):
        for d, (op, _, args, D, pools) in setups.items():
            t = time.perf_counter()
            for pool in pools:
                pool.step(op, *args, D=D, slots=slots)
            if i >= warmup:
                times[d].append(1e3 * (time.perf_counter() - t) / layers)
    rows = []
    for d, ts in times.items():
        op, shape = setups[d][0], setups[d][1]
        ts.sort()
        rows.append({"recipe": recipe, "state": f"{op.__name__} {list(shape)}", "dtype": d, "batch": batch,
                     "backend": backend_of(op, d), "ms_min": round(ts[0], 3),
                     "ms_median": round(ts[len(ts) // 2], 3), "ms_max": round(ts[-1], 3)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--recipes", default="mamba2-small,jamba-small")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--scatter", action="store_true", help="slots in shuffled order (a gather and a scatter)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for recipe in args.recipes.split(","):
        for row in time_steps(recipe, args.dtypes.split(","), args.batch, args.repeats, scatter=args.scatter):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
