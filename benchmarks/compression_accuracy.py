"""Accuracy through a compressed cache: the ``accuracy``, ``long_decode`` and ``pruning`` parts of
:mod:`benchmarks.compression`.

- MQAR models trained here (:func:`train_models`: a weakly trained 1:7 hybrid, :data:`TRAIN`;
  :func:`train_drift_models`: the tradeoff report's MQAR family, which learns the task) run teacher-forced
  through the paged cache with *every* token a decode step (:func:`teacher_forced_logits`); per dtype pair:
  logit KL(uncompressed || compressed), top-1 agreement, MQAR accuracy next to the uncompressed cache's.
- Long-context recall under KV pruning (:func:`recall_rows`). Models that have learned recall: MQAR members of
  the tradeoff family (``mqar.build_model("tiny", share, 4)``: ``recipes.attention_family("tiny", share, 4,
  mlp=False)``, the residual outputs zeroed, trained with ``mqar.train`` and :data:`RECALL_TRAIN`: the pair
  curriculum up to 64 pairs, ``mamba_lr_scale`` 0.1, then :data:`RECALL_FINETUNE` steps on sequences with
  filler), all-attention and one hybrid (``MMM*``), kept in ``--models``/recall (safetensors).

  The sequences put the keys far from their queries (:func:`recall_batch`): ``RECALL_PAIRS`` key-value pairs, then
  ``FILLER`` random filler tokens (drawn from the value half of the vocabulary, so no filler token is ever a
  key), then the queries. The prompt ends after the first ``PROMPT_QUERIES`` queries; SnapKV's observation
  window is their ``2 * PROMPT_QUERIES`` tokens, the rest of the queries are decoded teacher-forced one token
  per step through the engine's cache manager and model forward (exactly the engine's path: prefill, SnapKV
  compression when the prompt is done, StreamingLLM trims after every step) and scored there. Per model and
  policy: MQAR accuracy on the decoded queries, top-1 agreement and KL(unpruned || pruned) over every decoded
  position (and at the query positions alone), and the KV blocks a sequence holds at the end. StreamingLLM at
  the same budget keeps ``sinks=4`` and ``window=budget - 4``; SnapKV ``window=2 * PROMPT_QUERIES``, kernel 7,
  max pooling.

The uncompressed reference is the same model in fp32 with fp32 K/V and state.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hybrid.eval import mqar
from hybrid.kernels import kv_quant
from tqdm import tqdm

from hybrid.cache import HybridCache, cache_dtypes
from hybrid.cache.manager import CacheManager
from hybrid.cache.pruning import SnapKV, StreamingLLM
from hybrid.engine import Engine
from hybrid.engine.config import EngineConfig
from hybrid.engine.packed_batch import SeqChunk, build_batch
from hybrid.model import HybridLM

# the dtype pairs (K/V, state): the four the tables compare, and each part compressed alone
PAIRS = [("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("int8", "int8"), ("fp8", "bfloat16")]
EXTRA_PAIRS = [("int8", "float32"), ("float32", "int8"), ("fp8", "float32")]  # one part compressed at a time
# the accuracy models: (name, attention share of the 8 mixers) of recipes.attention_family("tiny", ...)
FAMILY = [("hybrid-1to7", 0.125)]
# about a quarter of an hour on one shared CPU core
TRAIN = dict(steps=600, tokens_per_step=2048, train_kv_pairs=(2, 4, 8, 16), eval_kv_pairs=(4, 8),
             eval_sequences=128, lr=3e-3, seed=0)
EVAL_PAIRS = 8  # key-value pairs of the accuracy sequences (4 * 8 = 32 tokens, every one a decode step)

# the long-decode accuracy models (name, attention share, mixers): the tradeoff report's MQAR members, trained
# as it trains them, which learn the task (97-99.5% held-out at 64 pairs)
DRIFT_FAMILY = [("MMM*", 0.25, 4), ("M***", 0.75, 4), ("hybrid-1to7", 0.125, 8)]
DRIFT_TRAIN_STEPS = {"MMM*": 300, "M***": 300, "hybrid-1to7": 600}


def train_drift_models(directory: Path, progress: bool = True) -> dict[str, HybridLM]:
    """The models of :data:`DRIFT_FAMILY` with the tradeoff report's training (``mqar.TrainConfig()``
    defaults, seed 0, :data:`DRIFT_TRAIN_STEPS` steps), trained once and kept in ``directory``."""
    from hybrid.pretrained import from_pretrained, save_pretrained

    models = {}
    for name, share, n in DRIFT_FAMILY:
        path = directory / name.replace("*", "A")
        if not (path / "config.json").exists():
            cfg = mqar.TrainConfig(steps=DRIFT_TRAIN_STEPS[name], seed=0)
            torch.manual_seed(cfg.seed)
            model = mqar.build_model("tiny", share, n, cfg)
            mqar.train(model, cfg, desc=f"train {name}", progress=progress)
            acc = mqar.evaluate(model, cfg)
            save_pretrained(model, path)
            (path / "mqar_eval.json").write_text(json.dumps({str(k): v for k, v in acc.items()}))
        models[name] = from_pretrained(path).float().eval()
    return models

# ---- accuracy --------------------------------------------------------------------------------------

def train_models(directory: Path, progress: bool = True) -> dict[str, HybridLM]:
    """The MQAR models of :data:`FAMILY`, trained once and kept in ``directory`` (safetensors)."""
    from hybrid.pretrained import from_pretrained, save_pretrained

    cfg = mqar.TrainConfig(**TRAIN)
    models = {}
    for name, share in FAMILY:
        path = directory / name
        if not (path / "config.json").exists():
            torch.manual_seed(cfg.seed)
            model = HybridLM(mqar.family_config("tiny", share, 8, cfg.vocab_size, cfg.init_std))
            mqar.train(model, cfg, desc=f"train {name}", progress=progress)
            save_pretrained(model, path)
        models[name] = from_pretrained(path).float().eval()
    return models


@torch.inference_mode()
def teacher_forced_logits(model: HybridLM, inputs: torch.Tensor, kv: str | None, state: str | None, *,
                          stochastic: bool = False, block_size: int = 16, prefill: int = 1) -> torch.Tensor:
    """Logits [B, L, V] of every position of ``inputs [B, L]`` through the paged cache at the given dtypes: the
    first ``prefill`` tokens of every sequence in one packed prefill, then each further token as a decode
    step of all B sequences."""
    B, L = inputs.shape
    d = cache_dtypes(next(model.parameters()).dtype, kv, state)
    cache = HybridCache.for_model(model, num_blocks=B * -(-L // block_size) + 1, block_size=block_size, max_seqs=B,
                                  kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm, stochastic_state=stochastic)
    manager = CacheManager(cache)
    rows = inputs.tolist()
    for b in range(B):
        manager.admit(b, prefill)
    out = torch.empty(B, L, model.config.vocab_size)
    first = model.forward_packed(build_batch(manager, [SeqChunk(b, rows[b][:prefill], 0) for b in range(B)]), cache,
                                 all_logits=True)
    out[:, :prefill] = first.float().view(B, prefill, -1)
    for t in range(prefill, L):
        for b in range(B):
            manager.grow(b, t + 1)
        out[:, t] = model.forward_packed(build_batch(manager, [SeqChunk(b, [rows[b][t]], t) for b in range(B)]),
                                         cache).float()
    return out


def compare(ref: torch.Tensor, out: torch.Tensor, batch: mqar.MQARBatch) -> dict:
    """KL(ref || out) and top-1 agreement over all positions; MQAR accuracy of ``out``."""
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    target = batch.labels[:, 1:]
    asked = target != mqar.IGNORE
    acc = (out[:, :-1].argmax(-1)[asked] == target[asked]).float().mean()
    agree = ref.argmax(-1) == out.argmax(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agree_%": round(100 * float(agree.float().mean()), 2),
            # at the positions that answer a query (the rest predict random context tokens, near-uniform)
            "top1_agree_queries_%": round(100 * float(agree[:, :-1][asked].float().mean()), 2),
            "mqar_acc_%": round(100 * float(acc), 2)}


def with_scale_dtype(dtype: torch.dtype, fn):
    """``fn()`` with caches built with per-token K/V scales of ``dtype`` (and their bytes counted so)."""
    old, kv_quant.KV_SCALE_DTYPE = kv_quant.KV_SCALE_DTYPE, dtype
    try:
        return fn()
    finally:
        kv_quant.KV_SCALE_DTYPE = old


def scale_dtype_rows(name: str, model: HybridLM, batch: mqar.MQARBatch, ref: torch.Tensor) -> list[dict]:
    """int8 / fp8 K/V (state fp32) with the per-token scales stored in fp16 (the default) and in fp32."""
    rows = []
    for kv in ("int8", "fp8"):
        for sd in (torch.float16, torch.float32):
            m = with_scale_dtype(sd, lambda kv=kv: compare(ref, teacher_forced_logits(model, batch.inputs, kv,
                                                                                      "float32"), batch))
            per_token = with_scale_dtype(sd, lambda kv=kv: model.cache_spec(kv_dtype=kv_quant.KV_DTYPES[kv])
                                         .kv_bytes_per_token)
            rows.append({"model": name, "kv": kv, "scale_dtype": kv_quant.dtype_name(sd), "kv_bytes/token": per_token,
                         **m})
    return rows


def accuracy_rows(models: dict[str, HybridLM], sequences: int) -> tuple[list[dict], list[dict], list[dict]]:
    g = torch.Generator().manual_seed(12345)
    batch = mqar.make_batch(sequences, EVAL_PAIRS, TRAIN.get("vocab_size", 256), generator=g)
    acc, scale, rounding = [], [], []
    for name, model in tqdm(models.items(), desc="accuracy", unit="model"):
        ref = teacher_forced_logits(model, batch.inputs, "float32", "float32")
        base = compare(ref, ref, batch)["mqar_acc_%"]
        has_kv, has_state = bool(model.cache_spec().attention), bool(model.cache_spec().mamba)
        seen = set()
        for kv, state in PAIRS + EXTRA_PAIRS:
            effective = (kv if has_kv else "-", state if has_state else "-")
            if effective in seen:
                continue  # the dtype of a part the model does not have changes nothing
            seen.add(effective)
            kv, state = kv if has_kv else "float32", state if has_state else "float32"
            m = compare(ref, teacher_forced_logits(model, batch.inputs, kv, state), batch)
            acc.append({"model": name, "kv": kv, "state": state, **m, "mqar_ref_%": base,
                        "mqar_loss_pts": round(base - m["mqar_acc_%"], 2)})
        if has_kv:
            scale += scale_dtype_rows(name, model, batch, ref)
        if has_state:
            for state in ("int8", "bfloat16"):
                for stochastic in (False, True):
                    m = compare(ref, teacher_forced_logits(model, batch.inputs, "float32", state,
                                                           stochastic=stochastic), batch)
                    rounding.append({"model": name, "state": state,
                                     "rounding": "stochastic" if stochastic else "nearest", **m})
    return acc, scale, rounding


def long_decode_accuracy_rows(models_dir: Path, sequences: int = 64, pairs: int = 64) -> tuple[list[dict], list[dict]]:
    """The accuracy table on models that learned the task: the MQAR family of :data:`DRIFT_FAMILY` (``MMM*``,
    ``M***`` and the 1:7 hybrid; the tradeoff report's training: pair curriculum to 64 pairs,
    ``mamba_lr_scale``; 97-99.5% held-out accuracy at 64 pairs), ``sequences`` MQAR sequences of ``pairs``
    pairs (256 tokens), every token a decode step through the real cache at each dtype pair, against the
    fp32 cache; and the per-token K/V scales in fp16 against fp32 (the ``kv_scale`` rows)."""

    g = torch.Generator().manual_seed(12345)
    batch = mqar.make_batch(sequences, pairs, 256, generator=g)
    rows, scale = [], []
    for name, model in train_drift_models(models_dir).items():
        ref = teacher_forced_logits(model, batch.inputs, "float32", "float32")
        base = compare(ref, ref, batch)["mqar_acc_%"]
        label = f"{name} (trained)"
        for kv, state in tqdm(PAIRS + EXTRA_PAIRS, desc=f"long-decode accuracy {name}", unit="pair"):
            m = compare(ref, teacher_forced_logits(model, batch.inputs, kv, state), batch)
            rows.append({"model": label, "kv": kv, "state": state, **m, "mqar_ref_%": base,
                         "mqar_loss_pts": round(base - m["mqar_acc_%"], 2)})
        scale += scale_dtype_rows(label, model, batch, ref)
    return rows, scale


# ---- long-context recall under KV pruning ----------------------------------------------------

RECALL_FAMILY = [("attention ****", 1.0), ("hybrid MMM*", 0.25)]
RECALL_TRAIN = dict(steps=300, seed=0)  # the rest: mqar.TrainConfig's defaults (hybrid tradeoff's recipe)
# then on filler: trained on it from the start, both members stayed at chance (0.01 after 300 steps)
RECALL_FINETUNE = dict(steps=150, lr=1e-3, seed=1)
RECALL_PAIRS, FILLER, PROMPT_QUERIES = 16, 176, 8  # 32 + 176 + 16 prompt tokens, then 16 decoded
BUDGETS = (32, 64, 128)
BLOCK_SIZE = 16


def recall_batch(batch_size: int, pairs: int, filler: int, vocab_size: int, *,
                 generator: torch.Generator) -> mqar.MQARBatch:
    """MQAR with ``filler`` tokens between the key-value pairs and the queries (every key asked once, in
    random order); filler tokens come from the value range, which never holds a key."""
    base = mqar.make_batch(batch_size, pairs, vocab_size, generator=generator)
    _, values = mqar.key_value_ranges(vocab_size)
    noise = torch.randint(values.start, values.stop, (batch_size, filler), generator=generator)
    cut = 2 * pairs
    inputs = torch.cat([base.inputs[:, :cut], noise, base.inputs[:, cut:]], 1)
    labels = torch.cat([base.labels[:, :cut], torch.full_like(noise, mqar.IGNORE), base.labels[:, cut:]], 1)
    return mqar.MQARBatch(inputs, labels, pairs)


def filler_batches(cfg: mqar.TrainConfig, max_filler: int):
    """``mqar.train``'s ``batch_fn``: each step's sequences get one filler length drawn from 0..``max_filler``,
    and as many sequences as fit in ``cfg.tokens_per_step``."""
    def draw(pairs: int, g: torch.Generator) -> mqar.MQARBatch:
        filler = int(torch.randint(max_filler + 1, (1,), generator=g))
        return recall_batch(max(1, cfg.tokens_per_step // (4 * pairs + filler)), pairs, filler, cfg.vocab_size,
                            generator=g)
    return draw


def train_recall_models(directory: Path, progress: bool = True) -> dict[str, HybridLM]:
    """The members of :data:`RECALL_FAMILY`, trained once and kept in ``directory``: plain MQAR
    (:data:`RECALL_TRAIN`), then MQAR with filler of up to :data:`FILLER` tokens between the pairs and the queries
    (:data:`RECALL_FINETUNE`)."""
    from hybrid.pretrained import from_pretrained, save_pretrained

    cfg, tune = mqar.TrainConfig(**RECALL_TRAIN), mqar.TrainConfig(**RECALL_FINETUNE)
    models = {}
    for name, share in RECALL_FAMILY:
        path = directory / name.split()[0]
        if not (path / "config.json").exists():
            torch.manual_seed(cfg.seed)
            model = mqar.build_model("tiny", share, 4, cfg)
            mqar.train(model, cfg, desc=f"train {name}", progress=progress)
            mqar.train(model, tune, desc=f"filler {name}", progress=progress, batch_fn=filler_batches(tune, FILLER))
            save_pretrained(model, path)
        models[name] = from_pretrained(path).float().eval()
    return models


@torch.inference_mode()
def pruned_logits(model: HybridLM, inputs: torch.Tensor, prompt_len: int, policy,
                  watch: int = 0) -> tuple[torch.Tensor, float, list[float]]:
    """Logits [B, L - prompt_len, V] predicting tokens ``prompt_len..L-1`` of ``inputs [B, L]``: the prompts in
    one packed prefill (SnapKV compresses them after it), then every further token a decode step of all B
    sequences, through an :class:`~hybrid.engine.Engine`'s cache manager with ``policy`` (None: unpruned).
    Also the KV blocks a sequence holds at the end and, for SnapKV, per (sequence, layer, KV head) the share
    of the first ``watch`` positions it kept."""
    B, L = inputs.shape
    engine = Engine(model, EngineConfig(num_blocks=B * -(-L // BLOCK_SIZE) + 1, block_size=BLOCK_SIZE, max_seqs=B,
                                        max_batch_tokens=B * L, kv_pruning=policy))
    m, cache, rows = engine.cache_manager, engine.cache, inputs.tolist()
    for b in range(B):
        m.admit(b, prompt_len, m.plan(rows[b], prompt_len, 0))
    out = [model.forward_packed(build_batch(m, [SeqChunk(b, rows[b][:prompt_len], 0) for b in range(B)]), cache)]
    for b in range(B):
        m.trim(b, prompt_len)  # what Scheduler.advance does after every step: SnapKV compresses here
    kept = [float(s) for b in range(B) if m.seqs[b].kept for k in m.seqs[b].kept.values()
            for s in (k < watch).float().sum(-1) / max(1, watch)]
    for t in range(prompt_len, L - 1):
        for b in range(B):
            m.grow(b, t + 1)
        out.append(model.forward_packed(build_batch(m, [SeqChunk(b, [rows[b][t]], t) for b in range(B)]), cache))
        for b in range(B):
            m.trim(b, t + 1)
    blocks = sum(len([x for x in m.block_table(b) if x]) for b in range(B)) / B
    return torch.stack(out, 1).float(), blocks, kept


def recall_compare(ref: torch.Tensor, out: torch.Tensor, labels: torch.Tensor) -> dict:
    """``ref``/``out`` [B, n, V] logits predicting tokens whose labels are ``labels [B, n]``."""
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    asked = labels != mqar.IGNORE
    agree = ref.argmax(-1) == out.argmax(-1)
    return {"mqar_acc_%": round(100 * float((out.argmax(-1)[asked] == labels[asked]).float().mean()), 2),
            "top1_agree_%": round(100 * float(agree.float().mean()), 2),
            "top1_agree_queries_%": round(100 * float(agree[asked].float().mean()), 2),
            "kl_mean": round(float(kl.mean()), 5), "kl_max": round(float(kl.max()), 4)}


def policies(budgets=BUDGETS) -> list:
    out = []
    for budget in budgets:
        out.append(StreamingLLM(sinks=4, window=budget - 4))
        out.append(SnapKV(budget=budget, window=2 * PROMPT_QUERIES, kernel=7, pooling="max"))
    return out


def recall_rows(models: dict[str, HybridLM], sequences: int, *, budgets=BUDGETS, progress: bool = True) -> list[dict]:
    g = torch.Generator().manual_seed(4321)
    vocab = mqar.TrainConfig().vocab_size
    batch = recall_batch(sequences, RECALL_PAIRS, FILLER, vocab, generator=g)
    prompt_len = 2 * RECALL_PAIRS + FILLER + 2 * PROMPT_QUERIES
    labels = batch.labels[:, prompt_len:]  # what the logits after tokens prompt_len - 1 .. L - 2 predict
    rows = []
    for name, model in tqdm(models.items(), desc="pruning recall", unit="model", disable=not progress):
        ref, ref_blocks, _ = pruned_logits(model, batch.inputs, prompt_len, None)
        base = recall_compare(ref, ref, labels)
        rows.append({"model": name, "policy": "none (unpruned)", "budget": f"all {batch.inputs.shape[1]}",
                     "blocks/seq": ref_blocks, **base, "mqar_loss_pts": 0.0})
        for policy in policies(budgets):
            out, blocks, kept = pruned_logits(model, batch.inputs, prompt_len, policy, watch=2 * RECALL_PAIRS)
            m = recall_compare(ref, out, labels)
            label = (f"StreamingLLM sinks={policy.sinks} window={policy.window}" if isinstance(policy, StreamingLLM)
                     else f"SnapKV window={policy.window} kernel={policy.kernel}")
            budget = policy.budget if isinstance(policy, SnapKV) else policy.sinks + policy.window
            loss = round(base["mqar_acc_%"] - m["mqar_acc_%"], 2)
            # SnapKV: the share of the pair tokens each KV head kept (mean and lowest over sequences, layers, heads)
            pairs_kept = (f"{100 * sum(kept) / len(kept):.0f} (min {100 * min(kept):.0f})" if kept else "")
            rows.append({"model": name, "policy": label, "budget": budget, "blocks/seq": blocks, **m,
                         "mqar_loss_pts": loss, "pair_tokens_kept_%": pairs_kept,
                         "verdict": "loses accuracy" if loss > 1.0 else "keeps accuracy"})
    return rows
