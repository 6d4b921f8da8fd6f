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


@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
def test_int8wo_greedy_agrees_with_fp32(recipe):
    """Next-token agreement along the fp32 model's greedy continuations (teacher forced, so one early
    divergence does not count every later token): at least 90%."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).eval()
    with torch.no_grad():  # sharp logits, as a trained model's: greedy ties would measure nothing
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    prompts = [list(range(1, 12)), list(range(40, 60)), [3] * 9]
    ref = _greedy(model, prompts, 16)
    hybrid.quantize(model, "int8wo")
    agree = total = 0
    for p, r in zip(prompts, ref, strict=True):
        for t in range(len(r)):  # the quantised model's greedy token after the fp32 prefix
            agree += _greedy(model, [p + r[:t]], 1)[0][0] == r[t]
            total += 1
    assert agree / total >= 0.9, agree / total


def test_bad_method_and_int4_on_cpu_are_refused():
    model = HybridLM(recipes.get("llama-tiny"))
    with pytest.raises(ValueError, match="unknown quantisation 'int3'"):
        hybrid.quantize(model, "int3")
    with pytest.raises(ValueError, match="CUDA only"):
        hybrid.quantize(model, "int4wo")


def test_cli_quantize_flag():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hybrid.cli", "generate", "--recipe", "llama-tiny", "--prompt", "hi",
           "--max-new-tokens", "3"]
    ok = subprocess.run(cmd + ["--quantize", "int8wo"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "decode:" in ok.stdout + ok.stderr, ok.stderr[-2000:]
    bad = subprocess.run(cmd + ["--quantize", "int4wo"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "CUDA only" in bad.stderr
