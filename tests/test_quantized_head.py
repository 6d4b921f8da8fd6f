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
from hybrid.decode import program as decode_program
from hybrid.quantize import METHODS, TIED_HEAD_METHOD, int8_rows, int8dq_rows
from hybrid.sampling import SamplingParams

torchao = pytest.importorskip("torchao")
pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")

HEAD = TIED_HEAD_METHOD  # a 4-bit method's tied head is int8 (int8wo for int4wo, int8dq for 8da4w)


def _tied(recipe="llama-tiny", dtype=torch.float32, d_model=None):
    torch.manual_seed(0)
    cfg = dataclasses.replace(recipes.get(recipe), tie_embeddings=True)
    if d_model is not None:
        cfg = dataclasses.replace(cfg, d_model=d_model)
    model = HybridLM(cfg).to(dtype).eval()
    with torch.no_grad():  # sharp logits, as a trained model's: greedy ties would measure nothing
        model.embed.weight.mul_(20)
    return model


def worst_case_error(head_method: str, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The largest |logit error| [n, N] of an int8wo / int8dq head on hidden rows h [n, K] for the unquantised
    matrix w [N, K] (fp32 maths): sum_k |h_k| dw_jk + |w_jk| dh_k + dw_jk dh_k, where dw / dh bound the per-element
    rounding of the weight / activation codes (half a quantisation step: symmetric per row, step max|row| / 127.5),
    plus the fp32 sums' own rounding (1e-5 of sum |h||w|)."""
    h, w = h.float(), w.float()
    absw = w.abs()
    dw = (absw.amax(1, keepdim=True) / 255).expand_as(w)
    dh = torch.zeros_like(h)
    if head_method == "int8dq":  # activations symmetric per row, the same step
        dh = (h.abs().amax(1, keepdim=True) / 255).expand_as(h)
    return (h.abs() @ dw.t() + dh @ absw.t() + dh @ dw.t()) + 1e-5 * (h.abs() @ absw.t())


@pytest.mark.parametrize("method", METHODS)
def test_tied_head_is_a_quantised_copy_and_the_embedding_is_kept(method):
    model = _tied()
    emb = model.embed.weight.detach().clone()
    before = decode_program._decode_weight_bytes(model)
    hybrid.quantize(model, method)
    _assert_head_is(model.lm_head.weight, HEAD[method])
    assert type(model.embed.weight) is torch.nn.Parameter and torch.equal(model.embed.weight, emb)
    assert model.config.tie_embeddings  # the same matrix, the head at 8 bits
    # a decode step reads the int8 head, not the fp32 embedding (a quarter plus row scales)
    after = decode_program._decode_weight_bytes(model)
    head_fp32 = emb.numel() * 4
    assert after < before - head_fp32 * 0.6, (before, after)


def _assert_head_is(w, head_method):
    """An int8wo head: int8 codes with row scales and no activation quantisation; int8dq: int8 activations too."""
    assert (int8_rows(w) if head_method == "int8wo" else int8dq_rows(w)) is not None, (head_method, type(w))


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
    err, bound = (got.float() - ref.float()).abs(), worst_case_error(HEAD[method], hn, w)
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # quantised: not the fp32 head's numbers (the check above could not fail otherwise)
    print(f"{method} rows={rows}: error / worst case at most {(err / bound).max():.3f}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
def test_cached_decode_equals_the_quantised_full_forward(recipe, method, monkeypatch):
    """Each decode step of the whole-step native program (the quantised head inside it) against the quantised
    model's full forward over the same tokens (its many rows take torchao's kernels, or our int8dq GEMM): the
    greedy tokens equal, the logits within fp32 noise for int8wo, bf16 noise for int4wo (aten's int4 kernel and
    ours both compute in bf16, in other orders), and for int8dq / 8da4w the code-flip bound of
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
    _assert_head_is(loaded.lm_head.weight, HEAD[method])
    assert torch.equal(loaded.embed.weight, model.embed.weight)
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.equal(loaded(x), model(x))
        assert torch.equal(loaded.logits(torch.ones(2, model.config.d_model)),
                           model.logits(torch.ones(2, model.config.d_model)))


def test_a_4bit_methods_head_is_int8_where_its_groups_fit_no_layer():
    """int4wo on a CPU takes groups of 128, 64 or 32: at width 48 no layer is int4, and the head is int8 anyway."""
    model = _tied(d_model=48)
    hybrid.quantize(model, "int4wo")
    _assert_head_is(model.lm_head.weight, "int8wo")
    assert model.quantization == "int4wo"


def test_an_untied_head_keeps_the_methods_quantisation():
    torch.manual_seed(0)
    model = HybridLM(recipes.get("llama-tiny")).eval()
    hybrid.quantize(model, "int4wo")
    assert type(model.lm_head.weight).__name__ == "Int4OpaqueTensor"
