"""A tied LM head under hybrid.quantize: the head becomes a quantised copy of the embedding's matrix (the embedding
itself unchanged, for the lookup), its logits stay within the quantisation's worst-case error of the unquantised
head's, the whole-step native decode program runs it (cached decode = the quantised model's full forward), and a
quantised checkpoint keeps it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from decode_hooks import whole_step_logits
from hybrid.kernels import native

import hybrid
from hybrid import Engine, HybridLM, recipes
from hybrid.layers import fused_decode
from hybrid.quantize import METHODS
from hybrid.sampling import SamplingParams

torchao = pytest.importorskip("torchao")
pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")

TYPES = {"int8wo": "Int8Tensor", "int8dq": "Int8Tensor", "int4wo": "Int4OpaqueTensor",
         "8da4w": "IntxUnpackedToInt8Tensor"}


def _tied(recipe="llama-tiny", dtype=torch.float32, d_model=None):
    torch.manual_seed(0)
    cfg = dataclasses.replace(recipes.get(recipe), tie_embeddings=True)
    if d_model is not None:
        cfg = dataclasses.replace(cfg, d_model=d_model)
    model = HybridLM(cfg).to(dtype).eval()
    with torch.no_grad():  # sharp logits, as a trained model's: greedy ties would measure nothing
        model.embed.weight.mul_(20)
    return model


def _group_range(w: torch.Tensor, group: int, fn) -> torch.Tensor:
    """fn over each group of ``group`` consecutive columns of w [N, K], broadcast back to [N, K]."""
    N, K = w.shape
    return fn(w.reshape(N, K // group, group)).repeat_interleave(group, dim=1)


def worst_case_error(method: str, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The largest |logit error| [n, N] of ``method``'s head on hidden rows h [n, K] for the unquantised matrix
    w [N, K] (fp32 maths): sum_k |h_k| dw_jk + |w_jk| dh_k + dw_jk dh_k, where dw / dh bound the per-element
    rounding of the weight / activation codes (half a quantisation step; a clamped extreme of an asymmetric code, a
    whole step), plus the arithmetic's own rounding (int4wo's CPU kernel computes in bfloat16: 2^-7 of sum |h||w|,
    its scales and zero points bf16 too; the others fp32 sums: 1e-5)."""
    h, w = h.float(), w.float()
    absw = w.abs()
    dh = torch.zeros_like(h)
    slack = 1e-5
    if method in ("int8wo", "int8dq"):  # symmetric per row: step max|w| / 127.5
        dw = (absw.amax(1, keepdim=True) / 255).expand_as(w)
        if method == "int8dq":  # activations symmetric per row, the same step
            dh = (h.abs().amax(1, keepdim=True) / 255).expand_as(h)
    elif method == "int4wo":  # asymmetric groups of 64 here (K = 64): step (max - min) / 15
        group = 128 if w.shape[1] % 128 == 0 else 64 if w.shape[1] % 64 == 0 else 32
        dw = (_group_range(w, group, lambda g: g.amax(-1) - g.amin(-1)) / 30
              + _group_range(w, group, lambda g: g.abs().amax(-1)) * 2.0 ** -7)
        dh = h.abs() * 2.0 ** -8  # the activations cast to bf16
        slack = 2.0 ** -7
    else:  # 8da4w: symmetric int4 groups of 32 (step max|w| / 7.5); activations asymmetric per row (a whole step)
        dw = _group_range(w, 32, lambda g: g.abs().amax(-1)) / 15
        dh = ((h.amax(1, keepdim=True).clamp(min=0) - h.amin(1, keepdim=True).clamp(max=0)) / 255).expand_as(h)
    return (h.abs() @ dw.t() + dh @ absw.t() + dh @ dw.t()) + slack * (h.abs() @ absw.t())


@pytest.mark.parametrize("method", METHODS)
def test_tied_head_is_a_quantised_copy_and_the_embedding_is_kept(method):
    model = _tied()
    emb = model.embed.weight.detach().clone()
    before = fused_decode._decode_weight_bytes(model)
    hybrid.quantize(model, method)
    assert type(model.lm_head.weight).__name__ == TYPES[method]
    assert type(model.embed.weight) is torch.nn.Parameter and torch.equal(model.embed.weight, emb)
    assert model.config.tie_embeddings  # the same matrix, the head at the quantisation's precision
    # a decode step reads the quantised head, not the fp32 embedding (int8: a quarter plus row scales)
    after = fused_decode._decode_weight_bytes(model)
    head_fp32 = emb.numel() * 4
    assert after < before - head_fp32 * 0.6, (before, after)


@pytest.mark.parametrize("rows", [3, 40])  # a decode step's rows (the native products), a prefill's (torchao's)
@pytest.mark.parametrize("method", METHODS)
def test_quantised_head_logits_within_the_quantisations_worst_case(method, rows):
    model = _tied()
    w = model.embed.weight.detach().clone()
    h = torch.randn(rows, model.config.d_model, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        ref = model.logits(h)
    hybrid.quantize(model, method)
    with torch.inference_mode():
        got = model.logits(h)
        hn = model.norm_f(h)
    err, bound = (got.float() - ref.float()).abs(), worst_case_error(method, hn, w)
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # quantised: not the fp32 head's numbers (the check above could not fail otherwise)
    print(f"{method} rows={rows}: error / worst case at most {(err / bound).max():.3f}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
def test_cached_decode_equals_the_quantised_full_forward(recipe, method, monkeypatch):
    """Each decode step of the whole-step native program (the quantised head inside it) against the quantised
    model's full forward over the same tokens (its many rows take torchao's kernels, or our int8dq GEMM): the
    greedy tokens equal, the logits within fp32 noise for int8wo, bf16 noise for int4wo (aten's kernel and ours
    both compute in bf16, in other orders), and for int8dq / 8da4w the code-flip bound of
    tests/test_native_int8dq.py (fp32 noise upstream moves an activation code by one step now and then)."""
    model = _tied(recipe)
    hybrid.quantize(model, method)
    prompts = [list(range(1, 12)), [7] * 20]
    steps = whole_step_logits(monkeypatch)
    with torch.inference_mode():
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts]
        engine.run()
    monkeypatch.undo()
    outs = [engine.requests[i].output for i in ids]
    assert len(steps) == 5 and all(s.shape == (len(prompts), model.config.vocab_size) for s in steps)
    for r, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        seq = p + out
        with torch.inference_mode():
            full = model(torch.tensor([seq]))[0]
        assert out == [int(t) for t in full[len(p) - 1:-1].argmax(-1)]  # greedy = full forward
        for s, logits in enumerate(steps):  # step s fed token out[s] at position len(p) + s
            a, b = logits[r].float(), full[len(p) + s].float()
            d, top = (a - b).abs(), b.abs().max()
            if method == "int8wo":
                assert d.max() <= 1e-4 * top
            elif method == "int4wo":
                assert d.max() <= 2.0 ** -6 * top
            else:
                assert d.max() <= 0.03 * top and d.mean() <= 0.005 * top


@pytest.mark.parametrize("method", METHODS)
def test_quantised_checkpoint_keeps_the_quantised_tied_head(method, tmp_path):
    model = _tied()
    hybrid.quantize(model, method)
    loaded = hybrid.from_pretrained(hybrid.save_pretrained(model, tmp_path / method))
    assert loaded.quantization == method and loaded.config.tie_embeddings
    assert type(loaded.lm_head.weight).__name__ == TYPES[method]
    assert torch.equal(loaded.embed.weight, model.embed.weight)
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.equal(loaded(x), model(x))
        assert torch.equal(loaded.logits(torch.ones(2, model.config.d_model)),
                           model.logits(torch.ones(2, model.config.d_model)))


def test_a_head_no_group_fits_stays_tied():
    """int4wo on a CPU takes groups of 128, 64 or 32: a 48-wide head fits none, so no copy is kept."""
    model = _tied(d_model=48)
    hybrid.quantize(model, "int4wo")
    assert model.lm_head is None and model.quantization == "int4wo"
