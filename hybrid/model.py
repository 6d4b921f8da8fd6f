"""``HybridLM``: embeddings, one pre-norm residual sub-layer per pattern symbol, final norm, LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .cache.specs import CacheDtypes
from .config import HybridConfig
from .layers.linear import Linear
from .layers.norm import RMSNorm
from .layers.registry import cache_specs, layer_class


class Block(nn.Module):
    """One pattern symbol: ``x + mixer(norm(x))``, the one definition of the residual sub-layer for both the
    full forward (``x`` [B, L, d]) and the packed inference forward (``x`` [T, d] of a
    :class:`~hybrid.engine.packed_batch.PackedBatch`, with the layer's view of the cache, ``cache.view(index)``:
    :mod:`hybrid.cache.views`). Token-wise sub-layers (MLP, experts) run the same forward either way; caching
    mixers take their packed path."""

    def __init__(self, kind: str, cfg: HybridConfig, index: int):
        super().__init__()
        self.kind, self.index = kind, index
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        cls = layer_class(kind)
        self.mixer = cls.from_config(cfg)
        self.caches = cls.cache_spec(cfg, CacheDtypes(kv=torch.float32, conv=torch.float32)) is not None

    def forward(self, x: torch.Tensor, batch=None, cache=None) -> torch.Tensor:
        h = self.norm(x)
        if batch is None or not self.caches:
            return x + self.mixer(h)
        return x + self.mixer.forward_packed(h, batch, cache.view(self.index))


def _kept_positions(logits_to_keep, length: int) -> slice | torch.Tensor:
    """``HybridLM.forward``'s ``logits_to_keep`` -> the index of the kept positions along the sequence."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() != 1 or logits_to_keep.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"logits_to_keep as a tensor must be 1-D integer positions, got shape "
                             f"{tuple(logits_to_keep.shape)} of {logits_to_keep.dtype}")
        if logits_to_keep.numel() and not bool(((logits_to_keep >= -length) & (logits_to_keep < length)).all()):
            raise ValueError(f"logits_to_keep has positions outside the {length} input positions "
                             f"(valid: -{length}..{length - 1})")
        return logits_to_keep
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise TypeError(f"logits_to_keep must be an int (the last N positions; 0 for all) or a 1-D tensor of "
                        f"positions, got {type(logits_to_keep).__name__}")
    if not 0 <= logits_to_keep <= length:
        raise ValueError(f"logits_to_keep={logits_to_keep} for a {length}-token input: give 0 (every position) "
                         f"or 1..{length} (that many last positions)")
    return slice(length - logits_to_keep if logits_to_keep else 0, None)


class HybridLM(nn.Module):
    def __init__(self, config: HybridConfig):
        super().__init__()
        if not isinstance(config, HybridConfig):
            raise TypeError(f"HybridLM needs a HybridConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(kind, config, i) for i, kind in enumerate(config.layer_kinds))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps, config.norm_offset)
        self.lm_head = None if config.tie_embeddings else Linear(config.d_model, config.vocab_size, bias=False)
        self.tokenizer = None  # set by hybrid.from_pretrained when the checkpoint folder has one
        # every attention layer shares one RoPE config: the packed forward computes cos/sin once per step
        attn = [b.mixer for b in self.layers if b.kind == "attention"]
        self.rope = attn[0].rope if attn and attn[0].rope.rotary_dim else None
        self.init_weights()

    # ---- init ----------------------------------------------------------------------------------
    def init_weights(self) -> None:
        std = self.config.initializer_range
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, std=std)
        # layers whose parameters need more than the normal draw above (Mamba's dt/A/D, stacked experts)
        for mod in self.modules():
            if mod is not self and hasattr(mod, "reset_special_parameters"):
                mod.reset_special_parameters(std=std)

    def untie_head(self, *, meta: bool = False) -> bool:
        """Give a model whose LM head is its embedding (``lm_head`` None) a head of its own: a copy of the
        embedding's matrix, or an empty one on the meta device with ``meta=True`` (for a loader to assign), the
        embedding left as it is (:func:`hybrid.quantize.quantized_head` quantises the copy). Returns whether a head
        was added (False: the model has one)."""
        if self.lm_head is not None:
            return False
        emb = self.embed.weight
        with torch.device("meta"):
            head = Linear(emb.shape[1], emb.shape[0], bias=False, dtype=emb.dtype)
        if not meta:
            head.weight = nn.Parameter(emb.detach().clone(), requires_grad=False)
        self.lm_head = head
        return True

    # ---- forward -------------------------------------------------------------------------------
    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty: give at least one token")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is out of range for vocab_size {self.config.vocab_size} "
                             f"(valid ids are 0..{self.config.vocab_size - 1}); check the tokenizer matches the model")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.norm_f(hidden)
        return kernels.linear(h, self.embed.weight) if self.lm_head is None else self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """input_ids [B, L] -> logits [B, L, vocab] (no cache; training and scoring).

        ``logits_to_keep`` (transformers' name and meaning): an int N > 0 computes the logits of the last N
        positions only, [B, N, vocab] — a prompt needs just the last one, and at 8K tokens with a 32K vocab
        the full [L, vocab] fp32 output is 1 GB and the LM head a sixth of the prefill; 0 (the default)
        keeps every position; a 1-D integer tensor keeps those positions (in that order).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        self.check_token_ids(input_ids)
        keep = _kept_positions(logits_to_keep, input_ids.shape[1])
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.logits(x[:, keep])

    def forward_packed(self, batch, cache, *, all_logits: bool = False, block_step=None) -> torch.Tensor:
        """Inference over a packed batch of many sequences (a :class:`hybrid.engine.packed_batch.PackedBatch`)
        with their K/V and Mamba states in ``cache`` (a :class:`hybrid.cache.HybridCache`), updated
        in place. Returns each sequence's last-token logits [B, vocab] (every new token's, [T, vocab], with
        ``all_logits``). ``block_step(block, x, batch, cache)``: a decode backend's own run of a block (its
        output, or None for the block's forward; :mod:`hybrid.decode` chooses how a decode step runs, the model
        does not)."""
        if batch.rope is None and self.rope is not None:
            batch = batch.with_rope(self.rope.cos_sin(batch.positions, self.embed.weight.dtype))
        x = self.embed(batch.tokens)
        for block in self.layers:
            y = None if block_step is None else block_step(block, x, batch, cache)
            x = block(x, batch, cache) if y is None else y
        if not all_logits:
            x = x[batch.last_token_index]
        return self.logits(x)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross-entropy: position t predicts ``labels[:, t + 1]`` (``labels``
        defaults to ``input_ids``; entries equal to ``ignore_index`` are skipped)."""
        labels = input_ids if labels is None else labels
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
        logits = self(input_ids)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                               ignore_index=ignore_index)

    # ---- persistence (transformers' names; the loading and saving live in hybrid.pretrained) -------
    def save_pretrained(self, directory, format: str = "hybrid"):
        """Write this model to ``directory`` (see :func:`hybrid.save_pretrained`); returns the folder."""
        from .pretrained import save_pretrained  # lazy: the model does not depend on its persistence

        return save_pretrained(self, directory, format=format)

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> HybridLM:
        """Load a checkpoint folder, ours or a foreign one (see :func:`hybrid.from_pretrained`)."""
        from .pretrained import from_pretrained  # lazy: the model does not depend on its persistence

        return from_pretrained(path, **kwargs)

    # ---- accounting ----------------------------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embeddings else n

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token, averaged over a causal prefill of ``seq_len`` tokens.

        Counts 2 FLOPs per multiply-add: every matmul weight (LM head included, embedding lookup
        not), attention scores and values over the average visible context (sliding window
        respected), the depthwise convs, and the SSM recurrence (about 6 per state element per
        token: decay, input outer product, add, and the output contraction). A mixture-of-experts
        layer counts its router and only the ``top_k`` experts a token runs through. Norms and
        element-wise ops are left out.
        """
        cfg = self.config
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        if self.lm_head is None:
            matmul += self.embed.weight.numel()
        total = 2.0 * matmul
        # what each layer adds beyond its weights' matmuls, as its class declares (no switch on kinds here)
        for kind in sorted(set(cfg.layer_kinds)):
            total += cfg.count(kind) * layer_class(kind).flops_per_token(cfg, seq_len)
        return total

    def cache_spec(self, *, kv_dtype: torch.dtype | None = None, conv_dtype: torch.dtype | None = None,
                   ssm_dtype: torch.dtype = torch.float32):
        """The inference cache of this model (:class:`hybrid.cache.specs.ModelCacheSpec`), with K/V and conv
        state in the model's dtype and the SSM state in fp32 unless told otherwise: what the engine's
        cache allocates."""
        dtypes = CacheDtypes.for_dtype(self.embed.weight.dtype, kv=kv_dtype, conv=conv_dtype, ssm=ssm_dtype)
        return cache_specs(self.config, dtypes)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """KV-cache bytes one token costs across all attention layers (grows with context); K/V in
        ``dtype`` (default: the model's dtype, as the engine stores them)."""
        return self.cache_spec(kv_dtype=dtype).kv_bytes_per_token

    def state_bytes_per_sequence(self, ssm_dtype: torch.dtype = torch.float32,
                                 conv_dtype: torch.dtype | None = None) -> int:
        """Mamba conv + SSM state bytes one sequence holds, whatever its length (SSM state fp32 and conv
        state in the model's dtype by default, as the engine stores them)."""
        return self.cache_spec(ssm_dtype=ssm_dtype, conv_dtype=conv_dtype).state_bytes_per_sequence
