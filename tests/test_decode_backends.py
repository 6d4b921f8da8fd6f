"""The decode-backend choice (hybrid/decode/): each backend's supports() verdict, the model runner's choice once per
shape, the env switches routed through supports() with their names in the reason, and what `hybrid doctor --model`
and repr(engine) print."""

from __future__ import annotations

import pytest
import torch
from hybrid.kernels import native, use_backend

from hybrid import Engine, HybridLM, recipes
from hybrid.cli import main
from hybrid.decode.native_program import NativeProgramBackend
from hybrid.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")


def _engine(recipe: str, **kw) -> Engine:
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).eval()
    with torch.inference_mode():
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4, **kw)
        engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=3, ignore_eos=True))
        engine.run()
    return engine


def _verdicts(engine, rows: int) -> dict[str, str | None]:
    runner = engine.runner
    with torch.inference_mode():
        shape = runner.decode_shape(rows)
        return {b.name: b.supports(engine.model, engine.cache, shape) for b in runner.decode_backends}


def test_a_covered_model_decodes_on_the_whole_program_and_the_choice_is_made_once_per_shape(monkeypatch):
    engine = _engine("hybrid-1to7-tiny")
    why = _verdicts(engine, 1)
    assert list(why) == ["compiled", "native_program", "native_sublayers", "eager"]  # the order they are asked in
    assert "compile=True" in why["compiled"]
    assert why["native_program"] is why["native_sublayers"] is why["eager"] is None
    asked = []
    real = NativeProgramBackend.supports
    monkeypatch.setattr(NativeProgramBackend, "supports", lambda self, *a: asked.append(a[2].rows) or real(self, *a))
    engine.runner._chosen.clear()
    with torch.inference_mode():
        for _ in range(3):
            assert engine.runner.decode_backend(2).name == "native_program"
        assert engine.runner.decode_backend(3).name == "native_program"
        assert engine.runner.can_run_steps()  # greedy steps several at a time: the whole program's
    assert asked == [2, 3, 1]  # asked once per shape, then looked up


def test_switches_and_limits_are_reasons_that_name_them(monkeypatch):
    engine = _engine("llama-tiny")
    with use_backend("torch"):
        why = _verdicts(engine, 1)
        assert engine.runner.decode_report(1).startswith("eager")
    assert "use_backend" in why["native_program"] and "torch" in why["native_program"]
    monkeypatch.setenv("HYBRID_BACKEND", "torch")
    why = _verdicts(engine, 1)
    assert "HYBRID_BACKEND=torch" in why["native_program"] and "HYBRID_BACKEND=torch" in why["native_sublayers"]
    with torch.inference_mode():
        assert not engine.runner.can_run_steps()
    monkeypatch.delenv("HYBRID_BACKEND")
    too_many = _verdicts(engine, native.MAX_ROWS + 1)["native_program"]
    assert f"{native.MAX_ROWS + 1} rows" in too_many and f"1..{native.MAX_ROWS}" in too_many
    shape = engine.runner.decode_shape(1)  # outside inference mode: autograd on
    assert "autograd" in NativeProgramBackend().supports(engine.model, engine.cache, shape)


def test_an_uncovered_cache_names_the_layers_and_the_sublayers_run():
    engine = _engine("llama-tiny", kv_dtype=torch.int8)
    why = _verdicts(engine, 1)
    assert "layers 0, 2, 4, 6 (attention): quantised K/V pages" in why["native_program"], why
    assert why["native_sublayers"] is None
    with torch.inference_mode():
        assert engine.runner.decode_backend(1).name == "native_sublayers"
    assert "native_sublayers: chosen" in repr(engine) and "layers 0, 2, 4, 6 (attention)" in repr(engine)


def test_doctor_prints_each_decode_backends_verdict_for_a_model(capsys):
    main(["doctor", "--recipe", "mamba1-tiny", "llama-tiny", "--rows", "1", "3"])
    out = capsys.readouterr().out
    assert "# ops on cpu" in out  # the kernel report still comes first
    mamba1 = out[out.index("# decode backends for mamba1-tiny"):out.index("# decode backends for llama-tiny")]
    assert "1 row: eager" in mamba1 and "3 rows: eager" in mamba1
    assert "layers 0, 1, 2, 3 (mamba1): Mamba1 has no lower_decode" in mamba1
    llama = out[out.index("# decode backends for llama-tiny"):]
    assert "1 row: native_program" in llama and "  native_program    chosen" in llama
    assert "  compiled          no: off" in llama
