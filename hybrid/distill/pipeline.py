"""A pretrained transformer distilled into its hybrid family: one alignment pass, then one student per share.

:func:`distill_family` runs the stages in order, each resumable and each skipped when its output exists:

1. every attention layer's replacement, initialised from it and aligned on the teacher's hidden states in one
   streaming pass (:mod:`.align`) -> ``OUT/align/<mixer>/``;
2. per attention share, the layers kept as attention (:func:`.align.choose_attention_layers`), the student
   assembled (:mod:`.student`) and trained end to end on the teacher's logits (:mod:`.kl`) ->
   ``OUT/students/<mixer>-share<S>/`` (a normal checkpoint folder with the teacher's tokenizer files), its
   record ``OUT/kl/<mixer>-share<S>.json``;
3. ``OUT/manifest.json`` (:class:`FamilyManifest`).

The data is a function ``batches(start)`` -> an iterator of global token batches [B, L] int64 from the stream's
batch number ``start`` on (the same batches for the same ``start``: resuming and sharding rely on it, e.g.
``hybrid.distill.data.token_batches``). Batch 0 is held out (the per-layer alignment losses and each student's
KL before and after are measured on it), the alignment trains on batches 1.. and every student on the batches
after those, the same for each share.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .align import PER_LAYER_CLIP, align_flops_per_token, align_layers, choose_attention_layers, load_replacements
from .compiled import compile_reason
from .ddp import World, world_from_env
from .init import MIXERS, attention_positions, check_teacher
from .kl import TRAIN_ATTENTION, distill_kl, kl_divergence, kl_flops_per_token
from .student import build_student, save_student, student_name


@dataclass
class FamilyManifest:
    """What :func:`distill_family` made: ``students`` (share -> checkpoint folder; 1.0 is the teacher's own),
    ``align_losses`` (per attention layer, the replacement's normalised MSE on the held-out batch),
    ``kept_layers`` (share -> attention-layer numbers kept as attention), ``kl`` (share -> the student's KL on
    the held-out batch before and after its KL stage, and its last training KLs), ``budget`` (tokens, wall
    seconds, GFLOP/s and share of peak per stage)."""

    teacher: str
    mixer: str
    students: dict[float, Path] = field(default_factory=dict)
    align_losses: list[float] = field(default_factory=list)
    kept_layers: dict[float, list[int]] = field(default_factory=dict)
    kl: dict[float, dict] = field(default_factory=dict)
    budget: dict = field(default_factory=dict)

    def to_json(self, path: str | Path | None = None) -> str:
        d = dataclasses.asdict(self)
        for key in ("students", "kept_layers", "kl"):
            d[key] = {f"{share:g}": (str(v) if isinstance(v, Path) else v) for share, v in getattr(self, key).items()}
        text = json.dumps(d, indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, path: str | Path) -> FamilyManifest:
        d = json.loads(Path(path).read_text())
        d["students"] = {float(k): Path(v) for k, v in d["students"].items()}
        d["kept_layers"] = {float(k): v for k, v in d["kept_layers"].items()}
        d["kl"] = {float(k): v for k, v in d["kl"].items()}
        return cls(**d)


def default_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies bf16 natively (AVX512-BF16 / AMX: several times fp32's rate), else fp32."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def precision_note(dtype: torch.dtype) -> str:
    """How a stage trains, for its progress line: bf16 with fp32 masters, or fp32 and why."""
    if dtype == torch.bfloat16:
        return "bf16 weights, fp32 masters"
    if dtype == torch.float32 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "fp32: this CPU has no native bf16 matmul (AVX512-BF16 / AMX)"
    return str(dtype).replace("torch.", "")


def _steps(tokens: int, per_step: int) -> int:
    if tokens < 0:
        raise ValueError(f"a token budget must be >= 0, got {tokens}")
    return math.ceil(tokens / per_step)


def _rate(flops_per_token: float, tokens: int, seconds: float, peak: float | None) -> dict:
    """GFLOP/s of a stage (model FLOPs: 2 per multiply-add; a backward counted at its matmuls) and its share of
    the measured matmul peak in the training dtype."""
    gflops = flops_per_token * tokens / seconds / 1e9 if seconds > 0 else None
    return {"GFLOP/s": round(gflops, 1) if gflops else None,
            "of_peak": round(gflops * 1e9 / peak, 3) if gflops and peak else None}


def distill_family(teacher: str | Path, out_dir: str | Path, *, shares: Sequence[float], mixer: str = "mamba2",
                   batches: Callable[[int], Iterable[torch.Tensor]], align_tokens: int, kl_tokens: int,
                   keep: str = "worst", progress: bool = True, threads: int | None = None,
                   dtype: torch.dtype | None = None, train_all: bool = False,
                   train_attention: bool | None = None, per_layer_clip: bool | None = None,
                   align_lr: float = 1e-3,
                   kl_lr: float = 3e-4, peak_flops: dict[str, float] | None = None, world: World | None = None,
                   checkpoint_every: int = 50, compile: bool | None = None) -> FamilyManifest:
    """Distil the transformer checkpoint ``teacher`` into students keeping each share of ``shares`` of its
    attention layers (the rest become ``mixer``: "mamba2" or "gdn"), with ``align_tokens`` tokens of layer
    alignment (once, for all shares) and ``kl_tokens`` of end-to-end KL per student. ``dtype`` of training
    (default bf16 where the CPU has it, with fp32 master weights), ``peak_flops`` ({"bf16": FLOP/s, "fp32": ...},
    measured by the caller) for the share of peak; ``compile``: the trained mixers through ``torch.compile``
    (None: on unless ``HYBRID_DISTILL_COMPILE=0``, where Inductor can run; :mod:`hybrid.distill.compiled`).
    Writes and returns the manifest (``out_dir/manifest.json``).
    A rerun with the same arguments resumes an interrupted stage and skips finished ones."""
    from ..pretrained import from_pretrained
    from ..pretrained_names import resolve

    teacher = resolve(teacher)  # a model name -> its converted folder

    if mixer not in MIXERS:
        raise ValueError(f"unknown mixer {mixer!r}; choose one of {sorted(MIXERS)}")
    shares = sorted(set(float(s) for s in shares))
    if not shares or any(not 0.0 <= s <= 1.0 for s in shares):
        raise ValueError(f"attention shares must be numbers in [0, 1], got {shares}")
    if threads:
        torch.set_num_threads(threads)
    world = world or world_from_env()
    out_dir = Path(out_dir)
    teacher_fp32 = from_pretrained(teacher, dtype=torch.float32).eval()
    check_teacher(teacher_fp32.config)
    dtype = dtype or default_dtype()
    dname = "bf16" if dtype == torch.bfloat16 else "fp32" if dtype == torch.float32 else str(dtype)
    peak = (peak_flops or {}).get(dname)
    precision = precision_note(dtype) + ", " + (compile_reason(compile) or "compiled mixers")
    teacher_train = teacher_fp32 if dtype == torch.float32 else _cast_copy(teacher_fp32, dtype)

    held_out = next(iter(batches(0)))
    if held_out.dim() != 2 or held_out.dtype != torch.int64:
        raise ValueError(f"batches must yield [batch, length] int64 token tensors, got {tuple(held_out.shape)} "
                         f"{held_out.dtype}")
    per_step, seq_len = held_out.numel(), held_out.shape[1]
    align_steps, kl_steps = _steps(align_tokens, per_step), _steps(kl_tokens, per_step)
    manifest = FamilyManifest(teacher=str(teacher), mixer=mixer)
    t0 = time.perf_counter()

    # 1. every attention layer's replacement, aligned once for all shares
    align_dir = out_dir / "align" / mixer
    aligned = align_layers(teacher_train, align_dir, mixer=mixer, batches=batches, held_out=held_out, start=1,
                           steps=align_steps, lr=align_lr, progress=progress, world=world,
                           checkpoint_every=checkpoint_every, desc=f"align {mixer} [{precision}]",
                           per_layer_clip=PER_LAYER_CLIP if per_layer_clip is None else per_layer_clip,
                           compile=compile)
    manifest.align_losses = aligned["losses"]
    n_attn = len(attention_positions(teacher_fp32.config))
    align_fpt = align_flops_per_token(teacher_fp32, mixer, seq_len)
    budget = {"dtype": dname, "training": precision, "tokens_per_step": per_step, "seq_len": seq_len,
              "align": {"tokens": aligned["tokens"], "steps": align_steps, "seconds": round(aligned["seconds"], 1),
                        "tokens_per_s": _per_s(aligned["tokens"], aligned["seconds"]),
                        **_rate(align_fpt, aligned["tokens"], aligned["seconds"], peak)},
              "kl": {}}
    replacements = load_replacements(teacher_fp32.config, align_dir, mixer)

    # 2. one student per share
    for share in shares:
        kept = choose_attention_layers(manifest.align_losses, share, keep)
        manifest.kept_layers[share] = kept
        if len(kept) == n_attn:  # every attention layer kept: the teacher itself
            manifest.students[share] = Path(teacher)
            continue
        name = student_name(mixer, share)
        folder, record_file = out_dir / "students" / name, out_dir / "kl" / f"{name}.json"
        if record_file.is_file():
            rec = json.loads(record_file.read_text())
        else:
            rec = _train_student(teacher_fp32, teacher_train, replacements, kept, mixer, dtype, folder,
                                 record_file, teacher, held_out=held_out, batches=batches, start=1 + align_steps,
                                 steps=kl_steps, lr=kl_lr, train_all=train_all, train_attention=train_attention,
                                 progress=progress, world=world,
                                 checkpoint_every=checkpoint_every, desc=f"kl {name} [{precision}]",
                                 compile=compile)
        manifest.students[share] = folder
        manifest.kl[share] = {k: rec[k] for k in ("kl_before", "kl_after", "kl_last_steps")}
        budget["kl"][f"{share:g}"] = {"tokens": rec["tokens"], "steps": kl_steps, "seconds": round(rec["seconds"], 1),
                                      "tokens_per_s": _per_s(rec["tokens"], rec["seconds"]),
                                      **_rate(rec["flops_per_token"], rec["tokens"], rec["seconds"], peak)}
    budget["peak_GFLOP/s"] = round(peak / 1e9, 1) if peak else None
    budget["wall_seconds_this_run"] = round(time.perf_counter() - t0, 1)
    manifest.budget = budget
    if world.main:
        manifest.to_json(out_dir / "manifest.json")
    world.barrier()
    return manifest


def _per_s(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 1) if seconds > 0 else None


def _cast_copy(model, dtype):
    import copy
    out = copy.deepcopy(model).to(dtype)
    out.tokenizer = model.tokenizer
    return out


def _train_student(teacher_fp32, teacher_train, replacements, kept, mixer, dtype, folder: Path, record_file: Path,
                   teacher_dir, *, held_out, batches, start, steps, lr, train_all, train_attention, progress, world,
                   checkpoint_every, desc, compile=None) -> dict:
    student = build_student(teacher_train, replacements, kept, mixer)
    before = kl_divergence(student, teacher_train, held_out)
    record_file.parent.mkdir(parents=True, exist_ok=True)
    record, masters = distill_kl(student, teacher_train, record_file.with_suffix(".state.pt"), batches=batches,
                                 start=start, steps=steps, lr=lr, train_all=train_all,
                                 train_attention=TRAIN_ATTENTION if train_attention is None else train_attention,
                                 progress=progress, world=world, desc=desc, checkpoint_every=checkpoint_every,
                                 compile=compile)
    after = kl_divergence(student, teacher_train, held_out)
    trained = sum(p.numel() for n, p in student.named_parameters() if n in masters and p.dim() == 2)
    hist = [h["loss"] for h in record["history"]]
    rec = {"kept_layers": kept, "kl_before": before, "kl_after": after,
           "kl_last_steps": hist[-max(1, len(hist) // 10):] if hist else [], "kl_history": hist,
           "tokens": record["tokens"], "seconds": record["seconds"], "dtype": str(dtype),
           "flops_per_token": kl_flops_per_token(student, teacher_train, held_out.shape[1], trained)}
    if world.main:
        # saved from the fp32 teacher and the fp32 masters, not from the weights rounded to the training dtype
        keep_fp32 = build_student(teacher_fp32, replacements, kept, mixer)
        with torch.no_grad():
            params = dict(keep_fp32.named_parameters())
            for n, m in masters.items():
                params[n].copy_(m)
        save_student(keep_fp32, folder, teacher_dir)
        record_file.write_text(json.dumps(rec, indent=1))
        record_file.with_suffix(".state.pt").unlink(missing_ok=True)
    world.barrier()
    return rec
