"""Model layers: norms, RoPE, attention, the Mamba-2, Mamba-1, Gated DeltaNet and GLA mixers, MLP, MoE."""
