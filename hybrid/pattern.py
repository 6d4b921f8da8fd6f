"""The layer pattern language: one symbol per residual sub-layer.

``M`` Mamba-2 mixer, ``m`` Mamba-1 mixer, ``G`` Gated DeltaNet mixer (gated delta rule, as Qwen3-Next),
``L`` GLA mixer (gated linear attention, as flash-linear-attention), ``*`` GQA attention, ``-`` MLP,
``E`` mixture-of-experts MLP (top-k routed, as in Jamba). Each symbol is one pre-norm
residual sub-layer (``x = x + f(norm(x))``), after Megatron-LM's hybrid models.
"""

from __future__ import annotations

# symbol -> layer kind, and the symbols that are sequence mixers (the ones blocks_pattern may place). Filled
# by the sub-config classes of hybrid.config as they are defined (each declares its symbol): adding a layer kind
# edits no table here.
SYMBOLS: dict[str, str] = {}
MIXER_SYMBOLS: set[str] = set()


def register_symbol(symbol: str, kind: str, *, mixer: bool) -> None:
    """Declare that pattern ``symbol`` is a sub-layer of ``kind`` (a sequence mixer when ``mixer``)."""
    if len(symbol) != 1 or symbol.isspace():
        raise ValueError(f"a pattern symbol is one visible character, got {symbol!r}")
    if SYMBOLS.get(symbol, kind) != kind:
        raise ValueError(f"pattern symbol {symbol!r} is taken by {SYMBOLS[symbol]!r}; pick another for {kind!r}")
    SYMBOLS[symbol] = kind
    if mixer:
        MIXER_SYMBOLS.add(symbol)


def unregister_symbol(symbol: str) -> None:
    """Forget ``symbol`` (a layer kind registered for a while, e.g. by a test: :func:`hybrid.layers.registry.
    register_layer`'s undo)."""
    SYMBOLS.pop(symbol, None)
    MIXER_SYMBOLS.discard(symbol)


class PatternError(ValueError):
    """A layer pattern string that cannot be parsed."""


def parse_pattern(pattern: str) -> tuple[str, ...]:
    """Return the layer kinds of ``pattern`` ("mamba2", "attention", ...), validating every symbol."""
    if not isinstance(pattern, str) or not pattern:
        raise PatternError(f"the layer pattern must be a non-empty string, got {pattern!r}")
    kinds = []
    for pos, sym in enumerate(pattern):
        if sym not in SYMBOLS:
            known = ", ".join(f"{s!r} ({k})" for s, k in SYMBOLS.items())
            raise PatternError(
                f"invalid symbol {sym!r} at position {pos} of pattern {pattern!r}; known symbols: {known}"
            )
        kinds.append(SYMBOLS[sym])
    return tuple(kinds)


def blocks_pattern(n_blocks: int, mixer: str, *, attn_every: int = 0, attn_offset: int | None = None,
                   mlp: bool = True) -> str:
    """Pattern of ``n_blocks`` blocks of (mixer, MLP), with attention replacing the mixer every
    ``attn_every``-th block.

    ``mixer`` is ``"M"``, ``"m"`` or ``"G"`` (or ``"*"`` for an attention-only model). ``attn_offset`` is the
    index within each group of ``attn_every`` blocks that gets attention (default: the last one,
    as in Bamba; Jamba uses ``attn_every=8, attn_offset=4``).

    >>> blocks_pattern(8, "M", attn_every=4)
    'M-M-M-*-M-M-M-*-'
    """
    if mixer not in MIXER_SYMBOLS:
        raise PatternError(f"mixer must be one of {sorted(MIXER_SYMBOLS)}, got {mixer!r}")
    if n_blocks < 1:
        raise PatternError(f"n_blocks must be >= 1, got {n_blocks}")
    if attn_every < 0:
        raise PatternError(f"attn_every must be >= 0 (0 = no attention), got {attn_every}")
    offset = attn_every - 1 if attn_offset is None else attn_offset
    if attn_every and not 0 <= offset < attn_every:
        raise PatternError(f"attn_offset must be in [0, {attn_every}), got {offset}")
    out = []
    for i in range(n_blocks):
        sym = "*" if attn_every and i % attn_every == offset else mixer
        out.append(sym + ("-" if mlp else ""))
    return "".join(out)


def ratio_pattern(n_mixers: int, attn_fraction: float, mixer: str = "M", *, mlp: bool = True) -> str:
    """Pattern with ``n_mixers`` mixer blocks of which ``round(attn_fraction * n_mixers)`` are
    attention, spread evenly (the last of each group is attention).

    >>> ratio_pattern(8, 0.25)
    'M-M-M-*-M-M-M-*-'
    """
    if not 0.0 <= attn_fraction <= 1.0:
        raise PatternError(f"attn_fraction must be in [0, 1], got {attn_fraction}")
    if n_mixers < 1:
        raise PatternError(f"n_mixers must be >= 1, got {n_mixers}")
    n_attn = round(attn_fraction * n_mixers)
    # Bresenham-style spreading: block i is attention when the running count crosses an integer.
    out = []
    for i in range(n_mixers):
        is_attn = (i + 1) * n_attn // n_mixers > i * n_attn // n_mixers
        out.append(("*" if is_attn else mixer) + ("-" if mlp else ""))
    return "".join(out)


def attention_share(pattern: str) -> float:
    """Fraction of the mixer sub-layers that are attention."""
    mixers = [s for s in pattern if s in MIXER_SYMBOLS]
    return sum(s == "*" for s in mixers) / max(len(mixers), 1)
