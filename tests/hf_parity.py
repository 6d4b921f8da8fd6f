"""Checks shared by the Hugging Face interop tests: build a tiny random ``transformers`` model, save it,
load it with ``hybrid.from_pretrained``, and compare logits and greedy tokens."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch
from conftest import rel_err
from interop_helpers import LOGIT_TOL, hf_greedy, hf_logits, ours_greedy

import hybrid


def build_hf(model_cls, hf_config, path: Path, seed: int = 0):
    """A random fp32 ``transformers`` model saved to ``path``; eval mode, eager attention."""
    torch.manual_seed(seed)
    hf_config._attn_implementation = "eager"
    model = model_cls(hf_config).float().eval()
    randomize_norms(model)
    model.save_pretrained(path)
    return model


def randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights start at 1 and would hide a norm mapped to the wrong place; perturb them (and
    the 1-initialised Mamba ``D``) so every tensor carries information. The projections are scaled
    up so the layers, not the token's own embedding, decide the next token: a tied random model
    would otherwise just repeat its input token, and greedy decoding would check little."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or name.endswith(".D")):
                p.add_(0.2 * torch.randn_like(p))
            elif p.dim() >= 2 and "embed" not in name and "lm_head" not in name and "conv1d" not in name:
                p.mul_(4.0)


def assert_parity(hf_model, ours: hybrid.HybridLM, vocab: int, seq: int = 24, greedy: bool = True) -> float:
    """Logits within fp32 tolerance and identical greedy continuations; returns the relative error."""
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_logits = ours(ids)
    ref = hf_logits(hf_model, ids)
    err = rel_err(ours_logits, ref)
    assert err < LOGIT_TOL, f"logits differ: max abs diff / logit scale = {err:.2e}"
    if greedy:  # 16 tokens through our engine against transformers' generate
        prompt = ids[:, :8]
        assert torch.equal(ours_greedy(ours, prompt), hf_greedy(hf_model, prompt))
    return err


def used_part(cfg: hybrid.HybridConfig) -> hybrid.HybridConfig:
    """``cfg`` with the sub-configs its pattern does not use reset to defaults: a foreign format
    stores only the layers a model has, so those sections cannot survive an export."""
    from hybrid.config import SUBCONFIGS  # every section a pattern may leave unused

    unused = {name: type(getattr(cfg, name))() for name in SUBCONFIGS
              if name not in cfg.layer_kinds}
    return dataclasses.replace(cfg, **unused)


def assert_export_round_trip(ours: hybrid.HybridLM, fmt: str, hf_cls, tmp_path: Path, vocab: int) -> None:
    """Export -> transformers loads it with matching logits; export -> we load it bit-identically."""
    out = tmp_path / f"export-{fmt}"
    hybrid.save_pretrained(ours, out, format=fmt)
    hf_back = hf_cls.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    assert_parity(hf_back, ours, vocab, greedy=False)
    again = hybrid.from_pretrained(out)
    assert again.config == used_part(ours.config)
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def edited_checkpoint(path: Path, tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    """``tmp_path`` as a checkpoint with ``path``'s weights (linked) and its config.json changed by ``edit``."""
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    return tmp_path
