"""Tiny GQA teachers and token streams for the distillation tests (built in the test, nothing downloaded)."""

from __future__ import annotations

import torch

from hybrid import AttentionConfig, HybridConfig, HybridLM, MLPConfig


def tiny_teacher(n_layers: int = 4, seed: int = 0, vocab: int = 97) -> HybridLM:
    """A Llama-style GQA transformer: 4 query heads of 8 over 2 kv heads, d_model 32, tied embeddings."""
    torch.manual_seed(seed)
    # initializer_range 0.2: peaked next-token distributions (the default 0.02 gives near-uniform ones, whose
    # KL to anything is too small to show learning)
    cfg = HybridConfig(vocab_size=vocab, d_model=32, pattern="*-" * n_layers, tie_embeddings=True,
                       initializer_range=0.2, attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=8),
                       mlp=MLPConfig(d_ff=64))
    return HybridLM(cfg).eval()


def token_stream(vocab: int = 97, batch: int = 4, seq_len: int = 24, seed: int = 1):
    """``batches(start)``: a fixed, endless stream of [batch, seq_len] token batches, the same for every call
    (batch ``i`` depends on i alone), so resumed and sharded runs see the data a single run sees. The tokens
    follow a simple Markov rule (next = 3 * prev + noise mod vocab) so a model has something to learn."""
    def batches(start: int = 0):
        i = start
        while True:
            g = torch.Generator().manual_seed(seed * 100_003 + i)
            first = torch.randint(0, vocab, (batch, 1), generator=g)
            noise = torch.randint(0, 3, (batch, seq_len - 1), generator=g)
            toks = [first]
            for t in range(seq_len - 1):
                toks.append((3 * toks[-1] + noise[:, t:t + 1]) % vocab)
            yield torch.cat(toks, 1)
            i += 1
    return batches
