"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): the recall test that
separates attention from fixed-size recurrent state.

A sequence lists ``n`` key-value pairs, then asks for ``q`` of the keys again, each followed by its
value: ``k1 v1 k2 v2 ... kn vn | ka va kb vb ...``. The model is scored (and trained) only on
predicting each queried value from its key, so it must have kept every pair it has seen. Keys
are unique within a sequence and every query is one of its keys. Keys come from the low half of
the vocabulary, values from the high half (token 0 is never used).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..config import HybridConfig
from ..model import HybridLM

IGNORE = -100


@dataclass(frozen=True)
class MQARBatch:
    """``inputs``/``labels`` [B, L]; ``labels`` hold the value at each position whose next token is a
    queried value (next-token convention of ``HybridLM.loss``: position t predicts labels[t + 1])."""

    inputs: torch.Tensor
    labels: torch.Tensor
    num_kv_pairs: int


def key_value_ranges(vocab_size: int) -> tuple[range, range]:
    """Token ids used for keys and for values: two halves of 1..vocab_size-1."""
    half = (vocab_size - 1) // 2
    if half < 2:
        raise ValueError(f"vocab_size {vocab_size} is too small for MQAR; need at least 5 tokens")
    return range(1, 1 + half), range(1 + half, 1 + 2 * half)


def make_batch(batch_size: int, num_kv_pairs: int, vocab_size: int, *, num_queries: int | None = None,
               generator: torch.Generator | None = None) -> MQARBatch:
    """``batch_size`` MQAR sequences of ``num_kv_pairs`` pairs and ``num_queries`` queries (default:
    every key once, in random order); length ``2 * (num_kv_pairs + num_queries)``."""
    keys, values = key_value_ranges(vocab_size)
    q = num_kv_pairs if num_queries is None else num_queries
    if not 1 <= num_kv_pairs <= len(keys):
        raise ValueError(f"num_kv_pairs must be in 1..{len(keys)} (distinct keys in vocab {vocab_size}), "
                         f"got {num_kv_pairs}")
    if not 1 <= q <= num_kv_pairs:
        raise ValueError(f"num_queries must be in 1..num_kv_pairs ({num_kv_pairs}), got {q}")
    B, n = batch_size, num_kv_pairs
    # distinct keys per row: the first n of a random permutation of the key range
    k = torch.rand(B, len(keys), generator=generator).argsort(dim=1)[:, :n] + keys.start
    v = torch.randint(values.start, values.stop, (B, n), generator=generator)
    asked = torch.rand(B, n, generator=generator).argsort(dim=1)[:, :q]
    qk, qv = k.gather(1, asked), v.gather(1, asked)
    context = torch.stack([k, v], dim=2).reshape(B, 2 * n)
    queries = torch.stack([qk, qv], dim=2).reshape(B, 2 * q)
    inputs = torch.cat([context, queries], dim=1)
    labels = torch.full_like(inputs, IGNORE)
    labels[:, 2 * n + 1::2] = qv
    return MQARBatch(inputs, labels, n)


@dataclass
class TrainConfig:
    """Defaults: ``hybrid tradeoff``'s. Each step draws one pair count and as many sequences of it as
    fit in ``tokens_per_step`` (a step of 2-pair sequences holds 32 times more of them than one of 64
    pairs; on a CPU a step costs about its tokens), unless ``batch_size`` fixes the sequences.

    ``curriculum``: over the first ``curriculum`` share of the steps the pair counts a step may draw
    from grow one at a time from the smallest of ``train_kv_pairs`` to all of them (0: all from the
    start). A lookup is learned first where it is easy to see (2 pairs: a value's key is one of two),
    then carries over to more pairs; drawn from all counts at once, the models sit for hundreds of
    steps on the plateau of copying some value from the context (README, Evaluate)."""

    steps: int = 300
    tokens_per_step: int = 2048
    batch_size: int | None = None  # sequences per step; None: tokens_per_step // sequence length
    vocab_size: int = 256  # MQAR tokens = the accuracy models' vocabulary: keys 1..127, values 128..254
    lr: float = 3e-3
    # lr of the Mamba mixers' parameters relative to ``lr``. Their out_proj reads the gated RMSNorm's
    # unit-RMS output (attention's o_proj reads averaged values, 0.19 RMS at init, of half the width), so under
    # Adam a Mamba-2 branch grows several times faster than an attention branch: at the full lr it added 0.25 RMS to
    # a 0.07-RMS embedding by step 150 and every hybrid stayed on the copy plateau (M*** 0.12 at 8 pairs
    # after 150 steps, 0.88 with its Mamba branch frozen at zero, 0.95 with this at 0.1; README, Evaluate).
    # Only in models that have attention: a pure Mamba-2 stack has no branch to balance against and
    # trains at the full lr (it learned less at 0.1: 0.02 against 0.05 in the same 150 steps)
    mamba_lr_scale: float = 0.1
    # the same for the other constant-state mixers (Gated DeltaNet, GLA: layers whose spec is a plain StateSpec).
    # Not Mamba's 0.1: beside one attention mixer the delta rule trains at the full lr (GGG* 0.97 / 0.90 at 64
    # pairs, seeds 0 / 1, in the default 300 steps) and stays on the copy plateau at 0.1 (0.02 / 0.03) or learns
    # half of it at 0.3 (0.20 / 0.26); docs/results/tradeoff.md, "Mamba-2 against Gated DeltaNet"
    state_lr_scale: float = 1.0
    weight_decay: float = 0.1
    warmup: int = 20
    init_std: float = 0.06  # weight init of the accuracy models (the library's 0.02 leaves attention flat for long)
    train_kv_pairs: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    eval_kv_pairs: tuple[int, ...] = (16, 32, 64)
    curriculum: float = 0.5
    eval_sequences: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        keys, _ = key_value_ranges(self.vocab_size)
        for name in ("train_kv_pairs", "eval_kv_pairs"):
            pairs = tuple(getattr(self, name))
            object.__setattr__(self, name, pairs)
            if not pairs or any(not 1 <= n <= len(keys) for n in pairs):
                raise ValueError(f"{name} {pairs} must be non-empty, each in 1..{len(keys)} (the distinct keys "
                                 f"of MQAR vocab {self.vocab_size}); raise vocab_size for more pairs")
        for name in ("steps", "tokens_per_step", "eval_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (or None), got {self.batch_size}")
        for name in ("lr", "init_std", "mamba_lr_scale", "state_lr_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.curriculum <= 1.0:
            raise ValueError(f"curriculum must be in [0, 1] (share of the steps over which the pair counts "
                             f"grow; 0 is off), got {self.curriculum}")

    def batch_for(self, num_kv_pairs: int) -> int:
        """Sequences in a step of ``num_kv_pairs``-pair sequences (each ``4 * num_kv_pairs`` tokens)."""
        return self.batch_size or max(1, self.tokens_per_step // (4 * num_kv_pairs))

    def pairs_at(self, step: int) -> tuple[int, ...]:
        """The pair counts step ``step`` draws from: the smallest first, one more every
        ``curriculum * steps / len(train_kv_pairs)`` steps, all of them from ``curriculum * steps`` on."""
        pairs = tuple(sorted(self.train_kv_pairs))
        ramp = int(self.curriculum * self.steps)
        if ramp < 1:
            return pairs
        return pairs[:min(len(pairs), 1 + step * len(pairs) // ramp)]


def family_config(size: str, share: float, n_mixers: int, vocab_size: int,
                  init_std: float | None = None, mixer: str = "mamba2") -> HybridConfig:
    """The accuracy model of one family member: ``recipes.attention_family(size, share, n_mixers,
    mlp=False)`` -- ``n_mixers`` Mamba-2/attention mixers with no MLPs between them, as Zoology
    compares sequence mixers -- with its vocabulary cut to the MQAR tokens (an MQAR model never sees
    any other id) and, if given, ``init_std`` as its initializer range. ``mixer``: the constant-state mixer
    (``recipes.FAMILY_MIXERS``: ``mamba2``, ``gdn`` or ``gla``)."""
    from ..recipes import attention_family

    cfg = dataclasses.replace(attention_family(size, share, n_mixers, mlp=False, mixer=mixer), vocab_size=vocab_size)
    return cfg if init_std is None else dataclasses.replace(cfg, initializer_range=init_std)


def zero_residual_outputs(model: HybridLM) -> HybridLM:
    """Start every residual branch at zero: the last projection of each block (attention ``o_proj``,
    Mamba ``out_proj``, MLP ``down_proj``) is zeroed, so at step 0 each block is the identity and the
    token embedding reaches every layer unmixed (as in Fixup/T-Fixup and many GPT training recipes).
    With normal-drawn outputs the random sums of 4 layers swamp the embedding: a 4-mixer attention
    stack then stayed on the copy plateau for 400+ steps where this one learns the lookup in ~100."""
    for block in model.layers:
        for name in ("o_proj", "out_proj", "down_proj"):
            proj = getattr(block.mixer, name, None)
            if isinstance(proj, torch.nn.Linear):
                torch.nn.init.zeros_(proj.weight)
    return model


def build_model(size: str, share: float, n_mixers: int, cfg: TrainConfig, mixer: str = "mamba2") -> HybridLM:
    """A freshly initialised accuracy model of one member (seed it first with ``torch.manual_seed``)."""
    return zero_residual_outputs(HybridLM(family_config(size, share, n_mixers, cfg.vocab_size, cfg.init_std,
                                                        mixer)))


def accuracy(model: HybridLM, batch: MQARBatch) -> float:
    """Share of queried values the model predicts exactly (argmax) from their key."""
    with torch.inference_mode():
        logits = model(batch.inputs)[:, :-1]
    target = batch.labels[:, 1:]
    asked = target != IGNORE
    return float((logits.argmax(-1)[asked] == target[asked]).float().mean())


def evaluate(model: HybridLM, cfg: TrainConfig) -> dict[int, float]:
    """Accuracy at each number of key-value pairs, on fixed held-out sequences (seeded apart from training)."""
    model.eval()
    out = {}
    for n in cfg.eval_kv_pairs:
        g = torch.Generator().manual_seed(10_000 + cfg.seed * 1000 + n)
        out[n] = accuracy(model, make_batch(cfg.eval_sequences, n, cfg.vocab_size, generator=g))
    return out


def param_groups(model: HybridLM, cfg: TrainConfig) -> list[dict]:
    """AdamW groups: weight decay on matrices only (never on A_log, dt_bias, D, norms, biases), and, if the model
    also has a mixer with a KV cache (attention; see ``TrainConfig``), the constant-state mixers' parameters at their
    own lr: ``cfg.mamba_lr_scale`` times the lr for the layers whose class declares a Mamba state (conv + SSM:
    Mamba-1/2), ``cfg.state_lr_scale`` times it for every other constant-state layer (Gated DeltaNet, GLA, ...).
    The kinds are told apart by what their layer classes declare (``hybrid.layers.registry``), not by name, so a
    new mixer kind needs no edit here."""
    from ..cache.specs import AttentionSpec, CacheDtypes, ConstantStateSpec, MambaStateSpec
    from ..layers.registry import layer_class

    dtypes = CacheDtypes(torch.float32, torch.float32, torch.float32)
    specs = [layer_class(block.kind).cache_spec(model.config, dtypes) for block in model.layers]
    scale = {}  # id(parameter) -> lr scale, for the constant-state mixers of a model with attention
    if any(isinstance(spec, AttentionSpec) for spec in specs):
        for block, spec in zip(model.layers, specs, strict=True):
            if isinstance(spec, ConstantStateSpec):
                s = cfg.mamba_lr_scale if isinstance(spec, MambaStateSpec) else cfg.state_lr_scale
                scale.update({id(p): s for p in block.mixer.parameters()})
    groups = []
    for s in [1.0, *sorted(set(scale.values()) - {1.0})]:  # the full-lr groups first, as AdamW's groups always were
        for decays in (True, False):
            params = [p for p in model.parameters() if scale.get(id(p), 1.0) == s and (p.dim() >= 2) == decays]
            if params:
                groups.append({"params": params, "weight_decay": cfg.weight_decay if decays else 0.0,
                               "lr": cfg.lr * s})
    return groups


def train(model: HybridLM, cfg: TrainConfig, *, desc: str = "mqar", progress: bool = True,
          on_steps: Callable[[int], None] | None = None,
          batch_fn: Callable[[int, torch.Generator], MQARBatch] | None = None) -> list[float]:
    """AdamW with linear warm-up and cosine decay on freshly drawn MQAR batches (pair counts from
    ``cfg.pairs_at(step)``: the curriculum); returns the losses.
    ``on_steps(k)`` is told every few steps that ``k`` more are done (a parent's progress bar).
    ``batch_fn(num_kv_pairs, generator)`` draws a step's batch in place of plain MQAR (e.g. with filler)."""
    if cfg.vocab_size > model.config.vocab_size:
        raise ValueError(f"MQAR vocab_size {cfg.vocab_size} exceeds the model's vocab_size {model.config.vocab_size}")
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress, leave=False)
    for step in bar:
        pairs = cfg.pairs_at(step)
        n = pairs[int(torch.randint(len(pairs), (1,), generator=g))]
        batch = make_batch(cfg.batch_for(n), n, cfg.vocab_size, generator=g) if batch_fn is None else batch_fn(n, g)
        loss = model.loss(batch.inputs, batch.labels, ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 10 == 9 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if on_steps is not None:
                on_steps(step % 10 + 1)
    model.eval()
    return losses


def check_batch(batch: MQARBatch) -> None:
    """Raise if a batch breaks MQAR's rules (keys distinct, each query asks a key and is labelled
    with that key's value). Used by tests and cheap enough to run on any batch."""
    n = batch.num_kv_pairs
    for row, lab in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        keys, vals = row[0:2 * n:2], row[1:2 * n:2]
        if len(set(keys)) != n:
            raise AssertionError(f"repeated key in {keys}")
        pairs = dict(zip(keys, vals, strict=True))
        for t in range(2 * n, len(row), 2):
            if row[t] not in pairs:
                raise AssertionError(f"query key {row[t]} at position {t} is not in the context")
            if lab[t + 1] != pairs[row[t]] or row[t + 1] != pairs[row[t]]:
                raise AssertionError(f"query at {t} is labelled {lab[t + 1]}, its value is {pairs[row[t]]}")
        if any(x != IGNORE for x in lab[:2 * n + 1] + lab[2 * n + 2::2]):
            raise AssertionError("labels set outside the queried values")
