"""benchmarks/llamacpp_gguf.py without llama.cpp: the GGUF type that matches a run, the commands it runs (the
converter, then llama-quantize for Q4_0), the cache, and its refusals."""

import pytest
import torch

from benchmarks import llamacpp_gguf as g
from hybrid import recipes
from hybrid.model import HybridLM


@pytest.mark.parametrize("dtype, quantize, want", [("float32", None, "f32"), ("bfloat16", None, "bf16"),
                                                   ("float32", "int8wo", "q8_0"), ("bfloat16", "int4wo", "q4_0"),
                                                   ("float32", "int8dq", "q8_0"), ("float32", "8da4w", "q4_0")])
def test_type_matches_the_run(dtype, quantize, want):
    assert g.gguf_type(dtype, quantize) == want


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def fake_run(cmd, log):
        calls.append(cmd)
        out = cmd[4] if "gguf_convert.py" in cmd[1] else cmd[2]
        open(out, "w").close()

    monkeypatch.setattr(g, "_run", fake_run)
    monkeypatch.setitem(g.FORMATS, "llama-tiny", "llama")
    return calls


def _model():
    torch.manual_seed(0)
    return HybridLM(recipes.get("llama-tiny")).eval()


def test_q4_0_converts_f32_then_quantizes_once(tmp_path, recorded):
    out = g.make_gguf("llama-tiny", _model(), tmp_path / "tree", tmp_path, "q4_0", tmp_path / "llama-quantize")
    assert out == tmp_path / "llama-tiny" / "model-q4_0.gguf" and out.is_file()
    assert (tmp_path / "llama-tiny" / "export-llama" / "config.json").is_file()
    assert [c[-1] for c in recorded] == ["f32", "Q4_0"]
    assert recorded[1][1:] == [str(tmp_path / "llama-tiny" / "model-f32.gguf"), str(out), "Q4_0"]
    g.make_gguf("llama-tiny", _model(), tmp_path / "tree", tmp_path, "q4_0", tmp_path / "llama-quantize")
    assert len(recorded) == 2  # cached: nothing converted again


def test_q8_0_is_the_converters_own_type(tmp_path, recorded):
    g.make_gguf("llama-tiny", _model(), tmp_path / "tree", tmp_path, "q8_0", None)
    assert [c[-2:] for c in recorded] == [["--outtype", "q8_0"]]


def test_refusals(tmp_path, recorded):
    with pytest.raises(SystemExit, match="no llama.cpp format known for recipe 'mamba1-tiny'"):
        g.make_gguf("mamba1-tiny", _model(), tmp_path, tmp_path, "f32", None)
    with pytest.raises(ValueError, match="fp32 model"):
        g.make_gguf("llama-tiny", _model().to(torch.bfloat16), tmp_path, tmp_path, "bf16", None)
    with pytest.raises(SystemExit, match="llama-quantize"):
        g.make_gguf("llama-tiny", _model(), tmp_path, tmp_path, "q4_0", None)


def test_the_converter_offers_every_type_asked_of_it():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gguf_convert", g.SERVING / "gguf_convert.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    assert set(g.CONVERTER_TYPES) <= set(conv.OUTTYPES)
