"""Distillation data: text the teacher writes itself (sequence-level distillation), cached as tokens.

:func:`build_token_source` asks the teacher to answer templated instructions (:data:`TASKS` x
:data:`TOPICS`, written here; no benchmark questions), many at once through :class:`hybrid.Engine`
with temperature sampling and the checkpoint's chat template when it has one, adds any local text files
the user passes, tokenises everything, joins the documents with EOS separators and caches the tokens on
disk (``tokens.npy`` / ``heldout.npy``, int32, and ``meta.json`` saying how they were made) in a folder
keyed by the teacher and every setting, so the next run with the same teacher and settings reuses them.

The held-out split is whole generated documents set aside *before* the training stream is cut, so no
held-out token is ever a training token (perplexity and top-1 agreement are measured on it).

:func:`token_batches` cuts the training stream into non-overlapping ``seq_len`` windows and yields them
``[B, L]`` in a seeded order per epoch: step ``s`` of rank ``r`` reads slots ``[(s * world + r) * B, +B)``
of its epoch's permutation, so ranks never share a window within a step and a run restarted at step
``start`` continues with exactly the batches it would have seen.

The contamination guard (:class:`MMLUGuard`) drops any generated sample or text-file paragraph that holds an
MMLU test question verbatim (13-word shingles of the normalised question text, as GPT-3's contamination
study used; a question of 8-12 words is matched whole, shorter ones are too generic to count) and records
how many it dropped.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

# how the teacher is asked to write; bump VERSION when the lists or the sampling change (it is in the cache key)
VERSION = 2
TEMPERATURE = 0.8
TOP_P = 0.95
MAX_NEW_TOKENS = 320
HELDOUT_FRACTION = 0.05
MIN_HELDOUT_TOKENS = 4096

TASKS = (
    "Write a short story about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Give me five interesting facts about {topic}.",
    "Write a short blog post about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a friendly email to a colleague about {topic}.",
    "Summarize the history of {topic} in a few paragraphs.",
    "Write a poem about {topic}.",
    "Describe a typical day for someone who works with {topic}.",
    "What are common misconceptions about {topic}?",
    "Write a dialogue between two friends discussing {topic}.",
    "Give step-by-step advice for a beginner interested in {topic}.",
    "Write a product description for something related to {topic}.",
    "Compare {topic} with something similar and explain the differences.",
    "What questions would you ask an expert on {topic}? Answer two of them.",
    "Write a news report about a recent discovery involving {topic}.",
    "Plan a weekend activity around {topic}.",
    "Write a persuasive paragraph about why {topic} deserves more attention.",
    "Describe {topic} using only simple words.",
    "Tell me a fun fact about {topic} and explain why it is true.",
)
TOPICS = (
    "gardening", "the ocean", "volcanoes", "bicycles", "coffee", "the moon", "honeybees", "rainforests",
    "trains", "chess", "baking bread", "recycling", "the internet", "dinosaurs", "music lessons", "deserts",
    "electric cars", "birds migrating", "public libraries", "mountains", "cooking pasta", "photography",
    "the weather", "friendship", "sleep", "city parks", "board games", "kites", "the post office", "rivers",
    "robots", "learning a language", "museums", "camping", "clocks", "bridges", "penguins", "painting",
    "the solar system", "soccer", "rain", "lighthouses", "cheese", "hiking boots", "zoos", "snow",
    "windmills", "old maps", "the kitchen", "a small bakery", "video games", "pianos", "fireflies",
    "airports", "tea ceremonies", "farmers markets", "spiders", "sailing", "the alphabet", "umbrellas",
)
SYSTEM_PROMPT = None  # the checkpoint's template supplies its own default system turn


@dataclass
class TokenSource:
    """The training token stream (``tokens``, int32 ``[N]``) and the held-out one, with how they were made."""

    tokens: torch.Tensor
    heldout_tokens: torch.Tensor
    meta: dict = field(default_factory=dict)
    path: Path | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def heldout(self, n_tokens: int) -> torch.Tensor:
        """The first ``n_tokens`` held-out tokens (int64 ``[n_tokens]``), never part of the training stream."""
        have = int(self.heldout_tokens.numel())
        if n_tokens < 1 or n_tokens > have:
            raise ValueError(f"asked for {n_tokens} held-out tokens, this source holds {have} (1..{have}); build it "
                             f"with more n_tokens (the held-out part is {HELDOUT_FRACTION:.0%} of it, at least "
                             f"{MIN_HELDOUT_TOKENS})")
        return self.heldout_tokens[:n_tokens].long()


# ---- contamination guard ------------------------------------------------------------------------------

SHINGLE = 13
MIN_WHOLE = 8
_WORD = re.compile(r"[a-z0-9]+")


def heldout_size(n_tokens: int) -> int:
    """The held-out tokens a source of ``n_tokens`` training tokens is built with: :data:`HELDOUT_FRACTION` of
    them, at least :data:`MIN_HELDOUT_TOKENS`."""
    return max(MIN_HELDOUT_TOKENS, int(n_tokens * HELDOUT_FRACTION))


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class MMLUGuard:
    """Finds MMLU test questions (``<mmlu_dir>/test/*_test.csv``) inside a text, verbatim up to case and
    punctuation."""

    def __init__(self, mmlu_dir: str | os.PathLike):
        test = Path(mmlu_dir) / "test"
        files = sorted(test.glob("*_test.csv"))
        if not files:
            raise FileNotFoundError(f"no test/*_test.csv under {mmlu_dir}: give the MMLU folder (holding dev/ and "
                                    f"test/) or no folder to skip the contamination guard")
        self.shingles: set[tuple[str, ...]] = set()
        self.whole: set[tuple[str, ...]] = set()
        for path in files:
            with open(path, newline="", encoding="utf-8") as f:
                for row in csv.reader(f):
                    if row:
                        self.add_question(row[0])
        self.questions_files = len(files)

    def add_question(self, question: str) -> None:
        w = _words(question)
        if len(w) >= SHINGLE:
            self.shingles.update(tuple(w[i:i + SHINGLE]) for i in range(len(w) - SHINGLE + 1))
        elif len(w) >= MIN_WHOLE:
            self.whole.add(tuple(w))

    def contaminated(self, text: str) -> bool:
        w = _words(text)
        if any(tuple(w[i:i + SHINGLE]) in self.shingles for i in range(len(w) - SHINGLE + 1)):
            return True
        lengths = {len(q) for q in self.whole}
        return any(tuple(w[i:i + n]) in self.whole for n in lengths for i in range(len(w) - n + 1))


# ---- the teacher writes ----------------------------------------------------------------------------------

def instructions(n: int, seed: int) -> list[str]:
    """``n`` instructions, every task over every topic in a seeded order (repeating only after all
    ``len(TASKS) * len(TOPICS)`` pairs are used)."""
    pairs = [t.format(topic=topic) for t in TASKS for topic in TOPICS]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        rng.shuffle(pairs)
        out += pairs[:n - len(out)]
    return out


def _chat_template(teacher_dir: Path | None):
    """The checkpoint's own chat template, or None when it has none (then prompts are plain text)."""
    if teacher_dir is None:
        return None
    from ..server.chat_template import load_chat_template

    template = load_chat_template(teacher_dir)
    return None if template.is_default else template


def _prompt_ids(instruction: str, tokenizer, template) -> list[int]:
    if template is None:
        return tokenizer.encode(instruction + "\n\n")
    messages = [{"role": "user", "content": instruction}]
    return tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)


def generate_documents(model, tokenizer, prompts: list[list[int]], *, n_tokens: int, seed: int, max_seqs: int = 16,
                       guard: MMLUGuard | None = None, progress: bool = True) -> tuple[list[list[int]], dict]:
    """Sample answers to ``prompts`` (in order, ``max_seqs`` in flight) until the documents (prompt + answer
    tokens) hold ``n_tokens``; returns the documents and counts (samples, dropped by the guard, tokens/s)."""
    from ..engine import Engine
    from ..engine.config import EngineConfig
    from ..sampling import SamplingParams

    longest = max(len(p) for p in prompts) + MAX_NEW_TOKENS
    config = EngineConfig(max_seqs=max_seqs, max_batch_tokens=max(512, longest),
                          cache_bytes=max_seqs * longest * model.kv_bytes_per_token() * 2 + 64 * 2**20)
    engine = Engine(model, config, tokenizer=tokenizer)
    docs, total, dropped, made, next_prompt = [], 0, 0, 0, 0
    in_flight: set[int] = set()
    bar = tqdm(total=n_tokens, desc="teacher writes", unit="tok", unit_scale=True, disable=not progress)
    t0 = time.perf_counter()
    while total < n_tokens:
        while len(in_flight) < max_seqs and next_prompt < len(prompts):
            params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=TOP_P,
                                    seed=seed * 1_000_003 + next_prompt)
            in_flight.add(engine.add_request(prompts[next_prompt], params))
            next_prompt += 1
        if not in_flight:
            raise ValueError(f"the {len(prompts)} prompts gave only {total} of the {n_tokens} tokens asked for")
        engine.step()
        for rid in [r for r in in_flight if engine.requests[r].finished]:
            in_flight.discard(rid)
            req = engine.forget(rid)
            doc = list(req.prompt) + list(req.output)
            made += len(req.output)
            if guard is not None and guard.contaminated(tokenizer.decode(doc)):
                dropped += 1
                continue
            if total < n_tokens:  # samples finishing in the same step as the last needed one are not kept
                docs.append(doc)
                total += len(doc) + 1
                bar.update(min(len(doc) + 1, bar.total - bar.n))
        running = made + sum(len(engine.requests[r].output) for r in in_flight)
        bar.set_postfix(gen_tok_s=f"{running / max(time.perf_counter() - t0, 1e-9):.0f}", refresh=False)
    for rid in in_flight:
        engine.abort(rid)
    bar.close()
    seconds = time.perf_counter() - t0
    return docs, {"samples": len(docs), "dropped_by_guard": dropped, "generated_tokens": made,
                  "generate_s": round(seconds, 1), "generated_tok_s": round(made / max(seconds, 1e-9), 1)}


def file_documents(paths: Sequence[str | os.PathLike], tokenizer,
                   guard: MMLUGuard | None) -> tuple[list[list[int]], dict]:
    """Each text file as one document, less any paragraph (blank-line separated) the guard flags."""
    docs, dropped = [], 0
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} does not exist; pass readable UTF-8 text files")
        paragraphs = [x for x in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")) if x.strip()]
        kept = [x for x in paragraphs if guard is None or not guard.contaminated(x)]
        dropped += len(paragraphs) - len(kept)
        if kept:
            docs.append(tokenizer.encode("\n\n".join(kept), add_special_tokens=False))
    return docs, {"files": len(paths), "paragraphs_dropped_by_guard": dropped}


# ---- cache ---------------------------------------------------------------------------------------------

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def teacher_identity(teacher, teacher_dir: Path | None) -> str:
    """What names the teacher's weights in the cache key: its folder's files (names, sizes, mtimes), or for a
    model object its config and a hash of its parameters."""
    if teacher_dir is not None:
        files = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in teacher_dir.iterdir() if f.is_file())
        return _sha(json.dumps([str(teacher_dir.resolve()), files]).encode())
    h = hashlib.sha256(json.dumps(teacher.config.to_dict(), sort_keys=True, default=str).encode())
    for t in teacher.state_dict().values():
        h.update(t.detach().float().flatten()[:4096].cpu().numpy().tobytes())
    return h.hexdigest()


def _eos(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        ids = getattr(tokenizer, "eos_token_ids", ())
        eos = ids[0] if ids else None
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to separate documents with")
    return int(eos)


def _join(docs: list[list[int]], eos: int) -> np.ndarray:
    flat = [t for d in docs for t in (*d, eos)]
    return np.asarray(flat, dtype=np.int32)


def _load(folder: Path) -> TokenSource | None:
    try:
        meta = json.loads((folder / "meta.json").read_text())
        train = np.load(folder / "tokens.npy")
        held = np.load(folder / "heldout.npy")
    except (OSError, ValueError):
        return None
    return TokenSource(torch.from_numpy(train), torch.from_numpy(held), meta, folder)


def build_token_source(teacher, tokenizer=None, *, cache_dir, n_tokens: int, text_files=(), seed: int = 0,
                       progress: bool = True, mmlu_dir: str | os.PathLike | None = None,
                       max_seqs: int = 32) -> TokenSource:
    """``n_tokens`` training tokens (and a held-out split, :data:`HELDOUT_FRACTION` of them, at least
    :data:`MIN_HELDOUT_TOKENS`) written by ``teacher`` (a checkpoint folder or a HybridLM) plus ``text_files``.

    ``tokenizer``: the teacher's (a tokenizer, or a folder / tokenizer.json to load it from; None: the teacher
    folder's). ``mmlu_dir``: an MMLU folder to guard against (its
    test questions never enter the data). Cached under ``cache_dir/<key>`` with the key from the teacher
    and every setting; a second call with the same ones loads the tokens instead of generating."""
    from ..pretrained import from_pretrained
    from ..tokenizer import load_tokenizer

    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    teacher_dir = Path(teacher) if isinstance(teacher, (str, os.PathLike)) else None
    if teacher_dir is not None and not teacher_dir.is_dir():
        raise FileNotFoundError(f"teacher {teacher_dir} is not a checkpoint folder")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    if tokenizer is None:
        if teacher_dir is None:
            raise ValueError("a HybridLM teacher needs its tokenizer: build_token_source(model, tokenizer, ...)")
        tokenizer = load_tokenizer(teacher_dir)
    heldout_n = heldout_size(n_tokens)
    files = [Path(f) for f in text_files]
    settings = {"version": VERSION, "n_tokens": n_tokens, "heldout_tokens": heldout_n, "seed": seed,
                "temperature": TEMPERATURE, "top_p": TOP_P, "max_new_tokens": MAX_NEW_TOKENS,
                "text_files": [[str(f), _sha(f.read_bytes())] for f in files],
                "mmlu_guard": str(Path(mmlu_dir).resolve()) if mmlu_dir is not None else None}
    key = _sha(json.dumps({"teacher": teacher_identity(teacher, teacher_dir), **settings}, sort_keys=True).encode())
    folder = Path(cache_dir) / key[:16]
    cached = _load(folder)
    if cached is not None:
        return cached

    guard = MMLUGuard(mmlu_dir) if mmlu_dir is not None else None
    file_docs, file_counts = file_documents(files, tokenizer, guard)
    model = from_pretrained(teacher_dir, dtype=torch.float32) if teacher_dir is not None else teacher
    template = _chat_template(teacher_dir)
    from_files = sum(len(d) + 1 for d in file_docs)
    want = heldout_n + max(0, n_tokens - from_files)
    # a generated document averages well over 100 tokens; 4x the prompts that would need leaves room for short ones
    prompts = [_prompt_ids(x, tokenizer, template) for x in instructions(max(64, want // 25), seed)]
    # one document of slack: the held-out part takes whole documents and may overshoot its share by one
    want += max(len(p) for p in prompts) + MAX_NEW_TOKENS + 1
    gen_docs, gen_counts = generate_documents(model, tokenizer, prompts, n_tokens=want, seed=seed,
                                              max_seqs=max_seqs, guard=guard, progress=progress)
    # the last generated documents are held out whole, before the training stream is cut
    eos = _eos(tokenizer)
    held, held_n = [], 0
    while gen_docs and held_n < heldout_n:
        held.insert(0, gen_docs.pop())
        held_n += len(held[0]) + 1
    train_docs = file_docs + gen_docs
    random.Random(seed).shuffle(train_docs)
    train = _join(train_docs, eos)[:n_tokens]
    heldout = _join(held, eos)
    if len(train) < n_tokens:
        raise ValueError(f"made {len(train)} training tokens of the {n_tokens} asked for")
    meta = {**settings, "teacher": str(teacher_dir) if teacher_dir is not None else type(teacher).__name__,
            "chat_template": template is not None, "eos_id": eos, "train_tokens": int(len(train)),
            "heldout_tokens_made": int(len(heldout)), "heldout_documents": len(held), **gen_counts, **file_counts,
            "file_tokens": from_files, "guard_question_files": guard.questions_files if guard else 0}
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "tokens.npy", train)
    np.save(tmp / "heldout.npy", heldout)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if folder.exists():  # another process made the same data meanwhile: theirs is as good
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.rename(folder)
    return TokenSource(torch.from_numpy(train), torch.from_numpy(heldout), meta, folder)


# ---- batches -------------------------------------------------------------------------------------------

def token_batches(source: TokenSource, *, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1,
                  start: int = 0) -> Iterator[torch.Tensor]:
    """Endless ``[batch_size, seq_len]`` int64 batches of the training stream for ``rank`` of ``world_size``,
    from step ``start`` on. Windows are the stream's non-overlapping ``seq_len`` slices; each epoch visits them
    in the order of a permutation seeded by the source's seed and the epoch; a step's ``world_size *
    batch_size`` windows are consecutive in it and split by rank (disjoint), the epoch's leftover windows are
    skipped. The same arguments give the same batches."""
    if seq_len < 1 or batch_size < 1 or start < 0:
        raise ValueError(f"seq_len and batch_size must be >= 1 and start >= 0, got {seq_len}, {batch_size}, {start}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    windows = len(source) // seq_len
    per_step = batch_size * world_size
    steps_per_epoch = windows // per_step
    if steps_per_epoch < 1:
        raise ValueError(f"the stream's {len(source)} tokens make {windows} windows of {seq_len}, fewer than one step "
                         f"needs ({batch_size} x {world_size} ranks); build the source with more n_tokens")
    grid = source.tokens[:windows * seq_len].view(windows, seq_len)
    seed = int(source.meta.get("seed", 0))
    step = start
    epoch, perm = -1, None
    while True:
        e, j = divmod(step, steps_per_epoch)
        if e != epoch:
            epoch = e
            perm = torch.randperm(windows, generator=torch.Generator().manual_seed(seed * 7919 + e))
        first = j * per_step + rank * batch_size
        yield grid[perm[first:first + batch_size]].long()
        step += 1
