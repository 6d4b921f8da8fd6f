"""Shared checks for the interop tests: our logits and greedy tokens against a transformers model."""

from __future__ import annotations

import torch
from conftest import rel_err

import hybrid

LOGIT_TOL = 1e-4  # max abs diff relative to the logit scale, fp32
N_GREEDY = 16


def randomize_(model: torch.nn.Module, scale: float = 0.5) -> torch.nn.Module:
    """Give every parameter non-trivial random values (HF inits norms to 1 and biases to 0, which would
    hide a norm or bias that is mapped to the wrong place). Mamba's A_log/dt stay in a sane range."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 8.0)))
            elif name.endswith(("dt_bias", "dt_proj.bias")):
                p.copy_(torch.empty_like(p).uniform_(-4.0, -1.0))
            elif "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p) / max(p.shape[-1], 1) ** 0.5)
    return model


def forward_greedy(logits_fn, ids: torch.Tensor, n: int = N_GREEDY) -> torch.Tensor:
    """Greedy continuation by re-running a full forward (``ids -> logits``) for each new token."""
    out = ids
    with torch.no_grad():
        for _ in range(n):
            nxt = logits_fn(out)[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
    return out[:, ids.shape[1]:]


def ours_greedy(model, ids: torch.Tensor, n: int = N_GREEDY) -> torch.Tensor:
    """Greedy continuation of each row of ``ids`` through our inference engine (paged KV cache and
    Mamba state slots, chunked prefill, one-token decode steps)."""
    out = hybrid.generate(model, ids.tolist(), max_new_tokens=n, ignore_eos=True)
    return torch.tensor(out, dtype=ids.dtype)


def hf_greedy(hf_model, ids: torch.Tensor, n: int = N_GREEDY) -> torch.Tensor:
    with torch.no_grad():
        # eos_token_id=None: run all n steps without masking EOS out of the argmax (min_new_tokens would)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:]


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits


def assert_matches_hf(ours, hf_model, vocab: int, length: int = 20, batch: int = 2,
                      greedy: str = "generate") -> None:
    """Logits within LOGIT_TOL, and 16 greedy tokens from our engine equal to transformers' ``generate``
    (``greedy="generate"``) or to its full forward re-run per token (``greedy="forward"``, where its
    cached path is wrong)."""
    ids = torch.randint(0, vocab, (batch, length))
    with torch.no_grad():
        got = ours(ids)
    ref = hf_logits(hf_model, ids)
    err = rel_err(got, ref)
    assert err < LOGIT_TOL, f"logits differ: max abs diff / scale = {err:.2e}"
    prompt = ids[:1, :8]
    if greedy == "generate":
        expected = hf_greedy(hf_model, prompt)
    else:
        expected = forward_greedy(lambda x: hf_logits(hf_model, x), prompt)
    got = ours_greedy(ours, prompt)
    assert torch.equal(got, expected), f"greedy tokens differ:\n ours {got.tolist()}\n ref  {expected.tolist()}"


def write_word_tokenizer(directory, words: list[str]) -> None:
    """A tiny whitespace word-level ``tokenizer.json`` (ids in ``words`` order, "<unk>" for the rest)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
