"""Prefill speed versus accuracy on a real model's distilled family (``hybrid tradeoff --teacher DIR``).

Stages, each timed and its tokens counted in the report's budget:

1. **data**: the teacher writes its own training text (:func:`hybrid.distill.data.build_token_source`,
   guarded against MMLU's test questions, cached under ``OUT/data``);
2. **distill**: per constant-state mixer, ``hybrid.distill.pipeline.distill_family`` turns the teacher into
   students at the family's attention shares (:data:`FAMILY`: Mamba-2 at 1/2, 1/4, 1/8, 0; Gated DeltaNet
   at 1/4 and 0), all on the same batches (``OUT/distill/<mixer>``);
3. **measure**: every member, the teacher (share 1) included: MMLU cloze and multiple choice 0-shot
   (question-weighted over the budget's subjects, Wilson 95% intervals), perplexity and top-1 agreement with
   the teacher on held-out teacher text, the phonebook recall probe at ~1K and ~4K tokens
   (:mod:`.real_tradeoff_measure`); then, holding the timing lock, engine prefill at 2K/8K (and 32K in the
   large budget), batch-1 decode tok/s and cache bytes at 32K.

A member's numbers are saved as ``OUT/members/<name>.json`` as soon as they are measured, keyed by its
checkpoint and the measuring settings; a rerun reuses the ones whose key still matches (resumable), and the
data and distillation stages resume on their own. ``OUT/tradeoff.{md,csv,json,png}`` are written at the end
(:mod:`.real_tradeoff_report`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from fractions import Fraction
from pathlib import Path

from .real_tradeoff_measure import DEFAULT_SUBJECTS

# (attention share, constant-state mixer); share 1 is the teacher itself
FAMILY = ((1.0, "attention"), (0.5, "mamba2"), (0.25, "mamba2"), (0.125, "mamba2"), (0.0, "mamba2"),
          (0.25, "gdn"), (0.0, "gdn"))


@dataclass(frozen=True)
class Budget:
    """Tokens and sample sizes of every stage. ``default`` finishes in about 20 minutes on 2 quiet CPU
    cores (see docs/evaluation.md for the measured cost of each part); ``large`` is the one for the record."""

    name: str
    data_tokens: int  # teacher-written training tokens (+5% held out)
    align_tokens: int  # per-layer alignment, once per mixer
    kl_tokens: int  # end-to-end KL, per student
    seq_len: int
    batch_size: int
    mmlu_subjects: tuple[str, ...]
    mmlu_limit: int | None  # questions per subject
    mmlu_mc: bool  # also multiple-choice MMLU (the letter format; near chance at 135M)
    heldout_tokens: int
    recall_queries: int  # per context
    recall_contexts: int  # per length
    recall_lengths: tuple[int, ...]
    prefill_lengths: tuple[int, ...]
    decode_context: int
    decode_steps: int
    repeats: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self) -> None:
        """Refuse a budget whose stages cannot all be fed, before hours of training find out: the data stage
        holds out :func:`hybrid.distill.data.heldout_size` of ``data_tokens``."""
        from ..distill.data import heldout_size

        held = heldout_size(self.data_tokens)
        if self.heldout_tokens > held:
            raise ValueError(f"budget {self.name!r} asks for {self.heldout_tokens} held-out tokens but its "
                             f"{self.data_tokens} data tokens hold out {held}; lower heldout_tokens or raise "
                             f"data_tokens")


BUDGETS = {
    "default": Budget("default", data_tokens=32_768, align_tokens=16_384, kl_tokens=8192, seq_len=512,
                      batch_size=4, mmlu_subjects=DEFAULT_SUBJECTS, mmlu_limit=10, mmlu_mc=True,
                      heldout_tokens=4096, recall_queries=8, recall_contexts=1, recall_lengths=(1024, 4096),
                      prefill_lengths=(2048, 8192), decode_context=1024, decode_steps=16, repeats=1),
    "large": Budget("large", data_tokens=1_000_000, align_tokens=262_144, kl_tokens=524_288, seq_len=1024,
                    batch_size=2, mmlu_subjects=DEFAULT_SUBJECTS, mmlu_limit=60, mmlu_mc=True,
                    heldout_tokens=16_384, recall_queries=16, recall_contexts=2, recall_lengths=(1024, 4096),
                    prefill_lengths=(2048, 8192, 32768), decode_context=2048, decode_steps=32, repeats=3),
}
# between the two: 8x the default's training and 3x its questions, about 2 hours on 2 cores (the accuracy part
# can run on one busy core with --no-speed, the timing part then on a quiet machine). Batches of 2 x 1024: the KL
# stage holds [B, L, 49152] fp32 logits of teacher and student and their softmax terms (B = 4 reached 12.7 GB
# and was OOM-killed on a 24 GB machine)
BUDGETS["medium"] = dataclasses.replace(BUDGETS["large"], name="medium", data_tokens=98_304, align_tokens=65_536,
                                        kl_tokens=65_536, batch_size=2, mmlu_limit=30, heldout_tokens=4096,
                                        recall_queries=16, recall_contexts=1, repeats=2)
MEMORY_LENGTH = 32768


def member_name(share: float, mixer: str) -> str:
    return "teacher" if mixer == "attention" else f"{mixer}-attn{Fraction(share).limit_denominator(64)}".replace(
        "/", "_")


def _key(folder: Path, measuring: dict) -> str:
    files = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in folder.iterdir() if f.is_file())
    return hashlib.sha256(json.dumps([str(folder.resolve()), files, measuring], sort_keys=True).encode()).hexdigest()


def _default_distill():
    from ..distill.pipeline import distill_family  # the distill helper's pipeline

    return distill_family


def run(teacher: str | os.PathLike, *, output: str | os.PathLike = "out/tradeoff_real",
        budget: Budget | str = "default",
        mmlu_dir: str | None = None, text_files: tuple[str, ...] = (), family=FAMILY, lock: str | None = None,
        threads: int | None = None, seed: int = 0, progress: bool = True, speed: bool = True,
        distill: Callable | None = None) -> tuple[dict, dict[str, Path]]:
    """The whole report for ``teacher`` (a Llama-family checkpoint folder). ``distill``: the family builder
    (default ``hybrid.distill.pipeline.distill_family``). Returns the result dict and the written files.

    ``speed=False`` stops after the accuracy stage (nothing timed, no report written, no files returned): the
    training and the accuracy columns tolerate a busy machine, the timings do not, so a long run can do those
    first and a later run with the same arguments (members reused by key) times them on a quiet machine."""
    from tqdm import tqdm

    from ..distill.data import build_token_source, token_batches
    from ..distill.pipeline import default_dtype
    from ..tokenizer import load_tokenizer
    from . import real_tradeoff_measure as measure
    from .perplexity import top1
    from .real_tradeoff_report import write_report
    from .tasks.mmlu_local_data import resolve_dir
    from .timing import set_threads, training_peaks
    from .tradeoff import _load, machine_facts, timing_lock

    t_start = time.perf_counter()
    budget = BUDGETS[budget] if isinstance(budget, str) else budget
    budget.check()
    from ..pretrained_names import resolve

    teacher = Path(resolve(teacher))  # a model name -> its converted folder
    if not (teacher / "config.json").is_file():
        raise FileNotFoundError(f"teacher {teacher} is not a checkpoint folder (no config.json); give a Llama-family "
                                f"folder such as the one `hybrid convert` or transformers' save_pretrained writes")
    mmlu_root = str(resolve_dir(mmlu_dir))
    threads = set_threads(threads)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    settings = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_facts(),
                "threads": threads, "teacher": str(teacher), "budget": budget.to_dict(), "mmlu_dir": mmlu_root,
                "seed": seed, "load_before": _load(), "stages": {}}
    stages = settings["stages"]

    # 1. data
    t0 = time.perf_counter()
    source = build_token_source(teacher, cache_dir=output / "data", n_tokens=budget.data_tokens,
                                text_files=text_files, seed=seed, progress=progress, mmlu_dir=mmlu_root)
    stages["data"] = {"tokens": len(source), "heldout_tokens": int(source.heldout_tokens.numel()),
                      "seconds": round(time.perf_counter() - t0, 1), "made": source.meta}

    # 2. distill, one call per mixer
    def batches(start: int):
        return token_batches(source, seq_len=budget.seq_len, batch_size=budget.batch_size, start=start)

    distill = distill or _default_distill()
    # the matmul peaks the stages' GFLOP/s are read against (their "of_peak"), probed once here
    peaks = training_peaks(default_dtype())
    settings["peak_GFLOP/s"] = {k: round(v / 1e9, 1) for k, v in peaks.items()}
    folders: dict[tuple[float, str], Path] = {}
    stages["distill"] = {}
    for mixer in sorted({m for _, m in family if m != "attention"}):
        shares = sorted(s for s, m in family if m == mixer)
        t0 = time.perf_counter()
        manifest = distill(teacher, output / "distill" / mixer, shares=shares, mixer=mixer, batches=batches,
                           align_tokens=budget.align_tokens, kl_tokens=budget.kl_tokens, progress=progress,
                           threads=threads, peak_flops=peaks)
        for s in shares:
            folders[(s, mixer)] = Path(manifest.students[s])
        stages["distill"][mixer] = {"seconds": round(time.perf_counter() - t0, 1), "budget": manifest.budget,
                                    "kept_layers": {f"{k:g}": v for k, v in manifest.kept_layers.items()},
                                    "align_losses": manifest.align_losses}
    if any(m == "attention" for _, m in family):
        folders[(1.0, "attention")] = teacher

    # 3. measure
    tokenizer = load_tokenizer(teacher)
    heldout = source.heldout(budget.heldout_tokens)
    ppl_len = min(budget.seq_len, budget.heldout_tokens)
    teacher_top1 = top1(measure.load(teacher), heldout, seq_len=ppl_len)
    measuring = {k: v for k, v in budget.to_dict().items() if k not in ("name", "data_tokens", "align_tokens",
                                                                         "kl_tokens", "batch_size")}
    measuring.update(mmlu_dir=mmlu_root, data=str(source.path), memory_length=MEMORY_LENGTH)
    members_dir = output / "members"
    members_dir.mkdir(exist_ok=True)
    members = []
    t_acc = time.perf_counter()
    reused = 0
    for share, mixer in family:
        folder = folders[(share, mixer)]
        name = member_name(share, mixer)
        key = _key(folder, measuring)
        path = members_dir / f"{name}.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                members.append(saved)
                reused += 1
                continue
        model = measure.load(folder)
        m = {"model": name, "key": key, "checkpoint": str(folder), "attn_share": share, "mixer": mixer,
             "pattern": model.config.pattern, "params": model.num_parameters()}
        m["mmlu_cloze"] = measure.mmlu(model, str(teacher), subjects=budget.mmlu_subjects, limit=budget.mmlu_limit,
                                       mmlu_dir=mmlu_root, cloze=True)
        if budget.mmlu_mc:
            m["mmlu_mc"] = measure.mmlu(model, str(teacher), subjects=budget.mmlu_subjects, limit=budget.mmlu_limit,
                                        mmlu_dir=mmlu_root, cloze=False)
        m.update(measure.heldout_and_recall(model, tokenizer, heldout, teacher_top1, seq_len=ppl_len,
                                            recall_lengths=budget.recall_lengths,
                                            recall_queries=budget.recall_queries,
                                            recall_contexts=budget.recall_contexts, progress=progress))
        path.write_text(json.dumps(m, indent=1) + "\n")
        members.append(m)
    stages["measure_accuracy"] = {"seconds": round(time.perf_counter() - t_acc, 1), "members_reused": reused}
    if not speed:
        settings["wall_s"] = round(time.perf_counter() - t_start, 1)
        return {"settings": settings, "members": members}, {}

    t0 = time.perf_counter()
    with timing_lock(lock, settings, progress):
        settings["load_at_timing"] = _load()
        todo = [m for m in members if "prefill" not in m]  # the others were timed by an earlier run (same key)
        for m in tqdm(todo, desc=f"time prefill {'/'.join(f'{n // 1024}K' for n in budget.prefill_lengths)} and "
                      "decode", unit="member", disable=not progress or not todo):
            model = measure.load(m["checkpoint"])
            m.update(measure.speed(model, prefill_lengths=budget.prefill_lengths, memory_length=MEMORY_LENGTH,
                                   decode_context=budget.decode_context, decode_steps=budget.decode_steps,
                                   repeats=budget.repeats))
            (members_dir / f"{m['model']}.json").write_text(json.dumps(m, indent=1) + "\n")
    stages["measure_speed"] = {"seconds": round(time.perf_counter() - t0, 1)}
    settings["load_after"] = _load()
    settings["wall_s"] = round(time.perf_counter() - t_start, 1)
    result = {"settings": settings, "members": members}
    return result, write_report(result, output)
