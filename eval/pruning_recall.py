"""Long-context recall under KV pruning: the ``pruning`` scenario of :mod:`.compression_bench` (issue 15 item 4).

Models that have learned recall: MQAR members of the tradeoff family (``mqar.build_model("tiny", share, 4)``:
``recipes.attention_family("tiny", share, 4, mlp=False)``, the residual outputs zeroed, trained with
``mqar.train`` and :data:`TRAIN`: the pair curriculum up to 64 pairs, ``mamba_lr_scale`` 0.1, then
:data:`FINETUNE` steps on sequences with filler), all-attention and one hybrid (``MMM*``), kept in
``--models``/recall (safetensors).

The sequences put the keys far from their queries (:func:`recall_batch`): ``PAIRS`` key-value pairs, then
``FILLER`` random filler tokens (drawn from the value half of the vocabulary, so no filler token is ever a key),
then the queries. The prompt ends after the first ``PROMPT_QUERIES`` queries; SnapKV's observation window is
their ``2 * PROMPT_QUERIES`` tokens, the rest of the queries are decoded teacher-forced one token per step
through the engine's cache manager and model forward (exactly the engine's path: prefill, SnapKV compression
when the prompt is done, StreamingLLM trims after every step) and scored there. Per model and policy: MQAR
accuracy on the decoded queries, top-1 agreement and KL(unpruned || pruned) over every decoded position
(and at the query positions alone), and the KV blocks a sequence holds at the end.

StreamingLLM at the same budget keeps ``sinks=4`` and ``window=budget - 4``; SnapKV ``window=2 *
PROMPT_QUERIES``, kernel 7, max pooling.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from ..engine import Engine
from ..kv_pruning import SnapKV, StreamingLLM
from ..model import HybridLM
from ..packed_batch import SeqChunk, build_batch
from . import mqar

FAMILY = [("attention ****", 1.0), ("hybrid MMM*", 0.25)]
TRAIN = dict(steps=300, seed=0)  # the rest: mqar.TrainConfig's defaults (hybrid tradeoff's recipe)
# then on filler: trained on it from the start, both members stayed at chance (0.01 after 300 steps)
FINETUNE = dict(steps=150, lr=1e-3, seed=1)
PAIRS, FILLER, PROMPT_QUERIES = 16, 176, 8  # 32 + 176 + 16 prompt tokens, then 16 decoded
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


def train_models(directory: Path, progress: bool = True) -> dict[str, HybridLM]:
    """The members of :data:`FAMILY`, trained once and kept in ``directory``: plain MQAR (:data:`TRAIN`), then
    MQAR with filler of up to :data:`FILLER` tokens between the pairs and the queries (:data:`FINETUNE`)."""
    from ..pretrained import from_pretrained, save_pretrained

    cfg, tune = mqar.TrainConfig(**TRAIN), mqar.TrainConfig(**FINETUNE)
    models = {}
    for name, share in FAMILY:
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
    engine = Engine(model, num_blocks=B * -(-L // BLOCK_SIZE) + 1, block_size=BLOCK_SIZE, max_seqs=B,
                    max_batch_tokens=B * L, kv_pruning=policy)
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


def compare(ref: torch.Tensor, out: torch.Tensor, labels: torch.Tensor) -> dict:
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
    batch = recall_batch(sequences, PAIRS, FILLER, vocab, generator=g)
    prompt_len = 2 * PAIRS + FILLER + 2 * PROMPT_QUERIES
    labels = batch.labels[:, prompt_len:]  # what the logits after tokens prompt_len - 1 .. L - 2 predict
    rows = []
    for name, model in tqdm(models.items(), desc="pruning recall", unit="model", disable=not progress):
        ref, ref_blocks, _ = pruned_logits(model, batch.inputs, prompt_len, None)
        base = compare(ref, ref, labels)
        rows.append({"model": name, "policy": "none (unpruned)", "budget": f"all {batch.inputs.shape[1]}",
                     "blocks/seq": ref_blocks, **base, "mqar_loss_pts": 0.0})
        for policy in policies(budgets):
            out, blocks, kept = pruned_logits(model, batch.inputs, prompt_len, policy, watch=2 * PAIRS)
            m = compare(ref, out, labels)
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
