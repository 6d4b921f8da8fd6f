"""Model layers: norms, RoPE, attention, Mamba-2 and Mamba-1 mixers, MLP."""
