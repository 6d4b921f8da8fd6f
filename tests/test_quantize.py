"""hybrid.quantize (torchao weight-only): the native int8 decode product equals torchao's own computation, and
the quantised model decodes what the fp32 model decodes (greedy agreement over a stated bound)."""

from __future__ import annotations

import pytest
import torch

import hybrid
from hybrid import Engine, HybridLM, recipes
from hybrid.sampling import SamplingParams

torchao = pytest.importorskip("torchao")


def test_int8_native_product_equals_torchao():
    from hybrid.layers.linear import Linear

    torch.manual_seed(0)
    layer = Linear(133, 301, bias=True)
    hybrid.quantize(torch.nn.Sequential(layer), "int8wo")
    x = torch.randn(3, 133)
    with torch.inference_mode():
        ours = layer(x)  # codes and row scales through kernels.linear (native on a CPU)
        theirs = torch.nn.functional.linear(x, layer.weight, layer.bias)  # torchao's dispatch
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _greedy(model, prompts, n):
    with torch.inference_mode():
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
        engine.run()
        return [engine.requests[i].output for i in ids]


@pytest.mark.parametrize(("recipe", "method", "bound"), [
    ("llama-tiny", "int8wo", 0.9), ("hybrid-1to7-tiny", "int8wo", 0.9),
    # int4 in groups of 32 (the tiny models' widths): 16 levels over a group's range of a random Gaussian
    # weight, ~8% noise per layer (logits ~17% off): 39/48 and 34/48 measured. This is a sanity bound (a wrong
    # layout agrees ~1/vocab); the exact check is the dequantised-weights test below.
    ("llama-tiny", "int4wo", 0.6), ("hybrid-1to7-tiny", "int4wo", 0.6)])
def test_weight_only_greedy_agrees_with_fp32(recipe, method, bound):
    """Next-token agreement along the fp32 model's greedy continuations (teacher forced, so one early
    divergence does not count every later token): at least ``bound``."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).eval()
    with torch.no_grad():  # sharp logits, as a trained model's: greedy ties would measure nothing
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    prompts = [list(range(1, 12)), list(range(40, 60)), [3] * 9]
    ref = _greedy(model, prompts, 16)
    hybrid.quantize(model, method)
    agree = total = 0
    for p, r in zip(prompts, ref, strict=True):
        for t in range(len(r)):  # the quantised model's greedy token after the fp32 prefix
            agree += _greedy(model, [p + r[:t]], 1)[0][0] == r[t]
            total += 1
    print(f"{recipe} {method}: {agree}/{total} agree")
    assert agree / total >= bound, agree / total


def test_bad_method_is_refused():
    model = HybridLM(recipes.get("llama-tiny"))
    with pytest.raises(ValueError, match="unknown quantisation 'int3'"):
        hybrid.quantize(model, "int3")


def test_int4wo_on_cpu_is_torchaos_int4_tensor_and_computes_its_quantised_weights():
    """Every linear layer whose widths the CPU kernel takes becomes torchao's CPU int4 tensor, and the layer
    computes what the int4 codes mean: the weight quantised and dequantised by torchao's own tinygemm
    primitives (the kernel is aten's; this checks we hand it the layer as torchao expects)."""
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_affine_tinygemm,
        _dequantize_affine_tinygemm,
        _quantize_affine_tinygemm,
    )

    torch.manual_seed(0)
    model = HybridLM(recipes.get("llama-tiny")).eval()
    before = {id(m): m.weight.detach().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    hybrid.quantize(model, "int4wo")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m.weight, Int4OpaqueTensor) for m in linears)
    layer = linears[0]
    w = before[id(layer)]
    block = [1, 128 if w.shape[1] % 128 == 0 else 64 if w.shape[1] % 64 == 0 else 32]
    scale, zero = _choose_qparams_affine_tinygemm(w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6,
                                                  None, w.dtype)
    codes = _quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
    dq = _dequantize_affine_tinygemm(codes, block, scale, zero, torch.int32, 0, 15, output_dtype=torch.float32)
    x = torch.randn(5, layer.in_features)
    with torch.inference_mode():
        ours = layer(x)
    ref = x @ dq.t() + (0 if layer.bias is None else layer.bias.float())
    torch.testing.assert_close(ours.float(), ref, rtol=2e-2, atol=2e-2)  # the kernel computes in bfloat16
    far = x @ w.t()  # and it is not the unquantised weight's product (the check could not fail otherwise)
    assert (ours.float() - far).abs().max() > (ours.float() - ref).abs().max()


def test_cli_quantize_flag():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hybrid.cli", "generate", "--recipe", "llama-tiny", "--prompt", "hi",
           "--max-new-tokens", "3"]
    ok = subprocess.run(cmd + ["--quantize", "int8wo"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "decode:" in ok.stdout + ok.stderr, ok.stderr[-2000:]
    ok4 = subprocess.run(cmd + ["--quantize", "int4wo"], capture_output=True, text=True, timeout=300)
    assert ok4.returncode == 0 and "decode:" in ok4.stdout + ok4.stderr, ok4.stderr[-2000:]
    bad = subprocess.run(cmd + ["--quantize", "int3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "int3" in bad.stderr


def test_lm_eval_model_scores_the_quantised_model():
    """``quantize=`` in the lm-eval model (``hybrid eval --quantize``) scores the quantised model: its
    log-likelihood equals that model's own logits, and differs from the unquantised model's."""
    import torch.nn.functional as F
    from hybrid.eval.lm_eval_model import HybridEvalLM
    from lm_eval.api.instance import Instance

    torch.manual_seed(0)
    plain = HybridEvalLM(recipe="llama-tiny")
    torch.manual_seed(0)
    lm = HybridEvalLM(recipe="llama-tiny", quantize="int8wo")
    assert type(lm.model.lm_head.weight).__name__ == "Int8Tensor"
    ctx, cont = "The answer is", " four"
    (got, _), = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)], disable_tqdm=True)
    (ref, _), = plain.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)], disable_tqdm=True)
    a = lm.tokenizer.encode(ctx, add_special_tokens=False)
    whole = lm.tokenizer.encode(ctx + cont, add_special_tokens=False)
    with torch.inference_mode():
        logp = F.log_softmax(lm.model(torch.tensor([whole]))[0].float(), dim=-1)
    direct = float(sum(logp[i - 1, whole[i]] for i in range(len(a), len(whole))))
    assert got == pytest.approx(direct, abs=1e-3)
    assert got != pytest.approx(ref, abs=1e-6)
    with pytest.raises(ValueError, match="unknown quantisation 'int2'"):
        HybridEvalLM(recipe="llama-tiny", quantize="int2")


def test_a_quantised_model_saves_and_loads_quantised(tmp_path):
    """save_pretrained keeps the quantisation (the full round trip is tests/test_quantized_checkpoint.py)."""
    model = HybridLM(recipes.get("llama-tiny")).eval()
    hybrid.quantize(model, "int8wo")
    loaded = hybrid.from_pretrained(hybrid.save_pretrained(model, tmp_path / "q"))
    assert loaded.quantization == "int8wo" and type(loaded.lm_head.weight).__name__ == "Int8Tensor"
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.equal(loaded(x), model(x))
