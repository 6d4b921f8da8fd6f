"""MOHAWK's independent layer alignment (stage 2): every attention layer's replacement trained in one pass.

The teacher streams over token batches once (no gradient). Forward hooks on each attention mixer capture what
it sees (the block's normed hidden state) and what it returns; each replacement mixer, initialised from its
layer (:mod:`.init`), is trained to reproduce its layer's output from the teacher's own input. The loss of a
layer is the normalised MSE, ``mean((y - y_teacher)^2) / mean(y_teacher^2)``: layers' outputs differ in scale by
orders of magnitude, and a scale-free loss both balances the one optimizer over all layers and makes the
per-layer losses comparable for the ranking (:func:`choose_attention_layers`). The loss summed over layers is
what is minimised (each replacement's gradient comes from its own term alone).

Written under ``DIR`` (``DIR/<mixer>/`` in the pipeline): ``layer_07.safetensors`` per attention layer (the
replacement's fp32 weights), ``losses.json`` (per layer the normalised MSE on a held-out batch after the
pass, and the training curve), and ``state.pt`` while it runs (resume).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import HybridConfig
from ..layers.mamba2 import Mamba2
from .compiled import compile_for_training, restore_eager
from .ddp import World
from .init import attention_positions, check_teacher, new_mixer, replacement_from_attention
from .trainer import MasterAdamW, load_state, train

# each replacement's gradient clipped alone (not one norm over all layers): the replacements are trained on
# independent losses, and one global clip lets the layer with the largest gradient shrink every other layer's
# step. On SmolLM2-135M (6 steps of 4x512 tokens, benchmarks/distill_align_clip.py) the held-out mean nMSE
# went 0.729 -> 0.564 with it against 0.729 -> 0.598 with one clip, lower on 30 of 30 layers (docs/distill.md)
PER_LAYER_CLIP = True


def layer_file(directory: Path, n: int) -> Path:
    return Path(directory) / f"layer_{n:02d}.safetensors"


class _Capture:
    """Forward hooks storing each attention mixer's input and output (detached) for the current batch."""

    def __init__(self, teacher, positions: list[int]):
        self.io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = [teacher.layers[pos].mixer.register_forward_hook(self._hook(n))
                        for n, pos in enumerate(positions)]

    def _hook(self, n: int):
        def hook(module, args, output):
            self.io[n] = (args[0].detach(), output.detach())
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def nmse(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Normalised MSE in fp32: mean squared error over the target's mean square."""
    y, target = y.float(), target.float()
    return (y - target).square().mean() / target.square().mean().clamp_min(1e-12)


@torch.no_grad()
def calibrate_head_scales(rep: torch.nn.Module, u: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Scale each head's columns of ``rep.out_proj`` by the least-squares factor that best fits ``target``
    from input ``u`` (returns the factors [H]).

    Why: the mapped mixer's per-head norm outputs ~unit RMS per channel, while softmax attention outputs a
    convex mix of values whose size differs by layer and head by orders of magnitude (a head parked on the
    first token outputs almost nothing); the raw mapping can be further from the target than zero is.
    One linear solve per layer (H unknowns) puts every head at its best scale before the first step."""
    cap = {}
    hook = rep.out_proj.register_forward_hook(lambda mod, args, out: cap.__setitem__("x", args[0]))
    rep(u)
    hook.remove()
    H = rep.n_heads
    W = rep.out_proj.weight
    d_out, d_in = W.shape
    x = cap["x"].float().reshape(-1, H, d_in // H)
    cols = torch.einsum("nhk,dhk->hnd", x, W.float().view(d_out, H, d_in // H)).reshape(H, -1)
    t = target.float().reshape(-1, d_out)
    if rep.out_proj.bias is not None:
        t = t - rep.out_proj.bias.float()
    gram = cols @ cols.T
    ridge = 1e-6 * gram.diagonal().mean().clamp_min(1e-12) * torch.eye(H)
    alpha = torch.linalg.solve(gram + ridge, cols @ t.reshape(-1))
    W.view(d_out, H, d_in // H).mul_(alpha.to(W.dtype)[None, :, None])
    return alpha


def mixer_flops(cfg: HybridConfig, mixer: torch.nn.Module, seq_len: int) -> float:
    """Forward FLOPs per token of one replacement mixer: its projections and what its kind adds."""
    weights = sum(m.weight.numel() for m in mixer.modules() if isinstance(m, torch.nn.Linear))
    return 2.0 * weights + type(mixer).flops_per_token(_with_section(cfg, mixer), seq_len)


def align_flops_per_token(teacher, mixer: str, seq_len: int) -> float:
    """Model FLOPs per token of the alignment pass: the teacher's forward and every replacement's forward and
    backward (about twice the forward: input and weight gradients)."""
    cfg = teacher.config
    n = len(attention_positions(cfg))
    return teacher.flops_per_token(seq_len) + 3 * n * mixer_flops(cfg, new_mixer(cfg, mixer), seq_len)


def _with_section(cfg: HybridConfig, mixer) -> HybridConfig:
    import dataclasses
    key = "mamba2" if isinstance(mixer, Mamba2) else "gated_deltanet"
    return dataclasses.replace(cfg, **{key: mixer.cfg})


def align_layers(teacher, out_dir: str | Path, *, mixer: str, batches: Callable[[int], Iterable[torch.Tensor]],
                 held_out: torch.Tensor, start: int, steps: int, lr: float = 1e-3, progress: bool = True,
                 world: World | None = None, checkpoint_every: int = 50, desc: str | None = None,
                 per_layer_clip: bool = PER_LAYER_CLIP, compile: bool | None = None) -> dict:
    """Train one ``mixer`` replacement per attention layer of ``teacher`` (a :class:`hybrid.HybridLM`, in the
    dtype to train in) for ``steps`` batches ``batches(start + i)``; write them and ``losses.json`` to
    ``out_dir`` and return ``losses.json``'s content (``"losses"``: per layer, on the batch ``held_out`` [B, L];
    ``"initial_losses"``: the same before training, after :func:`calibrate_head_scales` on the first
    training batch; ``"uncalibrated_losses"``: the mapping's alone; ``"loss_history"``, ``"tokens"``, ``"seconds"``,
    ``"steps"``). A finished ``out_dir`` is read back, not retrained. ``per_layer_clip``: each replacement's
    gradient norm clipped alone instead of one norm over all of them. ``compile``: the replacements' training
    forward and backward through ``torch.compile`` (:mod:`hybrid.distill.compiled`; None: on unless
    ``HYBRID_DISTILL_COMPILE=0``, and where Inductor can run)."""
    out_dir, world = Path(out_dir), world or World()
    done = out_dir / "losses.json"
    if done.is_file():
        return json.loads(done.read_text())
    check_teacher(teacher.config)
    cfg, positions = teacher.config, attention_positions(teacher.config)
    dtype = teacher.embed.weight.dtype
    reps = torch.nn.ModuleList(replacement_from_attention(cfg, teacher.layers[p].mixer, mixer)
                               for p in positions).to(dtype)
    teacher.requires_grad_(False)
    out_dir.mkdir(parents=True, exist_ok=True)
    capture = _Capture(teacher, positions)
    compile_for_training(reps, compile)

    def run_teacher(batch: torch.Tensor) -> None:
        with torch.no_grad():
            h = teacher.embed(batch)
            for layer in teacher.layers:
                h = layer(h)

    @torch.no_grad()
    def held_out_losses() -> list[float]:
        run_teacher(held_out)
        out = [float(nmse(rep(capture.io[n][0]), capture.io[n][1])) for n, rep in enumerate(reps)]
        capture.io.clear()
        return out

    def step_fn(batch: torch.Tensor) -> dict:
        run_teacher(batch)
        per_layer = []
        for n, rep in enumerate(reps):
            u, target = capture.io[n]
            loss = nmse(rep(u), target)
            loss.backward()  # layer by layer: each graph is freed before the next is built
            per_layer.append(float(loss.detach()))
        capture.io.clear()
        return {"loss": sum(per_layer) / len(per_layer), "layers": per_layer}

    try:
        uncalibrated = held_out_losses()
        if load_state(out_dir / "state.pt") is None:  # a fresh start (a resumed run's weights come from its state)
            run_teacher(next(iter(batches(start))))
            for n, rep in enumerate(reps):
                calibrate_head_scales(rep, *capture.io[n])
            capture.io.clear()
        initial = held_out_losses()
        params = list(reps.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        groups = [[index[id(p)] for p in rep.parameters()] for rep in reps] if per_layer_clip else None
        opt = MasterAdamW(params, lr=lr, clip_groups=groups)
        record = train(opt=opt, step_fn=step_fn, batches=batches, start=start, steps=steps, lr=lr,
                       state_path=out_dir / "state.pt", world=world, record={}, desc=desc or f"align {mixer}",
                       progress=progress, checkpoint_every=checkpoint_every)
        losses = held_out_losses()
    finally:
        capture.close()
        restore_eager(reps)
    result = {"mixer": mixer, "losses": losses, "initial_losses": initial, "uncalibrated_losses": uncalibrated,
              "steps": steps,
              "tokens": record["tokens"], "seconds": record["seconds"],
              "loss_history": [h["loss"] for h in record["history"]],
              "step_seconds": [h["seconds"] for h in record["history"]]}
    if world.main:
        # the fp32 masters, not the weights rounded to the training dtype
        masters = dict(zip((id(p) for p in opt.params), opt.masters, strict=True))
        for n, rep in enumerate(reps):
            save_file({k: masters[id(p)].detach().float().contiguous() for k, p in rep.named_parameters()},
                      layer_file(out_dir, n))
        done.write_text(json.dumps(result, indent=1))
        (out_dir / "state.pt").unlink(missing_ok=True)
    world.barrier()
    return result


def load_replacements(cfg: HybridConfig, directory: str | Path, mixer: str) -> dict[int, dict[str, torch.Tensor]]:
    """The saved replacements of an alignment run: attention-layer number -> the mixer's state dict."""
    directory = Path(directory)
    out = {}
    for n in range(len(attention_positions(cfg))):
        f = layer_file(directory, n)
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: the alignment in {directory} did not finish; rerun the "
                                    f"distill command to complete it")
        out[n] = load_file(f)
    new_mixer(cfg, mixer).load_state_dict(out[0])  # a clear error now if they are another mixer's weights
    return out


def choose_attention_layers(losses: list[float], share: float, how: str = "worst") -> list[int]:
    """Which attention layers to keep as attention for a share ``share`` of them (rounded to whole layers):
    ``"worst"``, those whose replacement aligned worst (highest loss: the layers a recurrence imitates least);
    ``"even"``, evenly spaced ones (the usual hybrid layout), ignoring the losses."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"an attention share must be in [0, 1], got {share}")
    n_all = len(losses)
    n = round(share * n_all)
    if how == "worst":
        return sorted(sorted(range(n_all), key=lambda i: (-losses[i], i))[:n])
    if how == "even":
        return sorted({min(n_all - 1, int((i + 0.5) * n_all / n)) for i in range(n)}) if n else []
    raise ValueError(f"unknown keep rule {how!r}; choose 'worst' or 'even'")
