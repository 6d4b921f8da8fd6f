"""A quantised model (hybrid.quantize) saved by save_pretrained and loaded by from_pretrained: the same torchao
tensor types with bit-identical inner tensors, the same logits and greedy decode; safetensors only, the
quantisation in config.json; and every way such a folder can be wrong is one clear error."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hybrid
from hybrid import Engine, HybridLM, recipes
from hybrid.checkpoint import CheckpointError
from hybrid.cli import main
from hybrid.sampling import SamplingParams

torchao = pytest.importorskip("torchao")

PROMPTS = [list(range(1, 12)), list(range(40, 60)), [3] * 9]


def _model(recipe, method, seed=0):
    torch.manual_seed(seed)
    model = HybridLM(recipes.get(recipe)).eval()
    with torch.no_grad():  # sharp logits, so greedy decode has no near-ties that could hide a difference
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    return hybrid.quantize(model, method)


def _greedy(model, n=12):
    with torch.inference_mode():
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in PROMPTS]
        engine.run()
        return [engine.requests[i].output for i in ids]


def _inner(t):
    names = list(type(t).tensor_data_names) + list(getattr(type(t), "optional_tensor_data_names", []))
    return {n: getattr(t, n) for n in names if getattr(t, n) is not None}


def _quantised(model):
    return {k: v for k, v in model.state_dict().items() if type(v) is not torch.Tensor}


@pytest.mark.parametrize(("recipe", "method"), [
    ("llama-tiny", "int8wo"), ("hybrid-1to7-tiny", "int8wo"),
    ("llama-tiny", "int4wo"),
    # int4 on a CPU takes groups of 32/64/128 and output widths in 16s: Mamba-2's in_proj (296 rows) stays fp32
    # and the MLP's down projection (input 128) gets group 128 where the rest get 64
    ("hybrid-1to7-tiny", "int4wo"),
    # int8 activations: their torchao tensors carry the activation quantisation (int8dq's kwargs, 8da4w's enum)
    ("llama-tiny", "int8dq"), ("hybrid-1to7-tiny", "int8dq"), ("llama-tiny", "8da4w"), ("hybrid-1to7-tiny", "8da4w")])
def test_round_trip_is_exact(tmp_path, recipe, method):
    model = _model(recipe, method)
    q = _quantised(model)
    assert q
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    plain = [m for m in linears if type(m.weight) is torch.nn.Parameter]
    if (recipe, method) == ("hybrid-1to7-tiny", "int4wo"):
        assert plain, "this case is meant to keep some linear layers unquantised"
    out = model.save_pretrained(tmp_path / "q")

    assert sorted(p.name for p in out.iterdir()) == ["checksums.json", "config.json", "model.safetensors"]  # no pickle
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    assert cfg["method"] == method and cfg["library"] == "torchao"
    assert set(cfg["weights"]) == set(q)
    for name, t in q.items():  # the group each layer was quantised in, as int4 on a CPU chose it
        assert cfg["weights"][name]["group_size"] == t.block_size[-1]
        assert cfg["weights"][name]["type"] == type(t).__name__
    if method == "int4wo":
        assert len({e["group_size"] for e in cfg["weights"].values()}) == 2  # 64 and 128, chosen per layer
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["quantization"] == method
    for name, t in q.items():  # the inner tensors, under <name>.<inner>; never the full-precision weight
        assert name not in keys and {f"{name}.{n}" for n in _inner(t)} <= keys

    loaded = hybrid.from_pretrained(out)
    also = HybridLM.from_pretrained(out)
    for other in (loaded, also):
        assert other.quantization == method
        got = other.state_dict()
        assert set(got) == set(model.state_dict())
        for name, ref in model.state_dict().items():
            assert type(got[name]) is type(ref), name
            if name in q:
                a, b = _inner(ref), _inner(got[name])
                assert a.keys() == b.keys(), name
                for n in a:  # bit-identical: same dtype, shape and bytes
                    assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), f"{name}.{n}"
                assert list(got[name].block_size) == list(ref.block_size) and got[name].shape == ref.shape
                assert got[name].dtype == ref.dtype
                for attr in ("act_quant_kwargs", "activation_quantization"):  # int8dq / 8da4w's activations
                    assert getattr(got[name], attr, None) == getattr(ref, attr, None), f"{name}.{attr}"
                    assert type(getattr(got[name], attr, None)) is type(getattr(ref, attr, None)), f"{name}.{attr}"
                assert not other.get_parameter(name).requires_grad  # as torchao.quantize_ leaves it
            else:
                assert got[name].dtype == ref.dtype and torch.equal(got[name], ref), name
    x = torch.tensor([PROMPTS[0], PROMPTS[2] + [7, 8]])
    with torch.inference_mode():
        assert torch.equal(loaded(x), model(x))  # exactly, not approximately
    assert _greedy(loaded) == _greedy(model)


def test_loading_rebuilds_the_stored_codes_and_never_requantises(tmp_path, monkeypatch):
    """Loading wraps the stored int8 codes: torchao's quantisation entry points are never called (no fp32
    weight is made to quantise), and the file is about a quarter of the fp32 one."""
    model = _model("llama-tiny", "int8wo")
    hybrid.save_pretrained(model, tmp_path / "q")
    torch.manual_seed(0)
    hybrid.save_pretrained(HybridLM(recipes.get("llama-tiny")), tmp_path / "fp32")
    from torchao.quantization import Int8Tensor

    def refuse(*a, **k):
        raise AssertionError("loading a quantised checkpoint must not quantise")

    monkeypatch.setattr(Int8Tensor, "from_hp", classmethod(refuse))
    monkeypatch.setattr(torchao.quantization, "quantize_", refuse)
    loaded = hybrid.from_pretrained(tmp_path / "q")
    assert type(loaded.layers[0].mixer.q_proj.weight) is Int8Tensor
    file_q = (tmp_path / "q" / "model.safetensors").stat().st_size
    file_fp32 = (tmp_path / "fp32" / "model.safetensors").stat().st_size
    quantised = sum(v.numel() * 4 for v in _quantised(model).values())
    assert file_fp32 - file_q > 0.7 * quantised  # three quarters of each quantised weight's bytes are gone


def test_exporting_a_quantised_model_to_a_foreign_format_is_refused(tmp_path):
    model = _model("llama-tiny", "int8wo")
    for fmt in ("llama", "hf"):
        with pytest.raises(ValueError, match=f"format='{fmt}'.*int8wo-quantised.*format='hybrid'"):
            hybrid.save_pretrained(model, tmp_path / fmt, format=fmt)
        assert not (tmp_path / fmt).exists()


def _saved(tmp_path, method="int8wo"):
    return hybrid.save_pretrained(_model("llama-tiny", method), tmp_path / method)


def _edit_config(folder, edit):
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_corrupt_or_missing_quantisation_metadata_is_named(tmp_path):
    folder = _saved(tmp_path)
    good = (folder / "config.json").read_text()
    q = "layers.0.mixer.q_proj.weight"
    cases = [
        (lambda c: c.pop("quantization"), "config.json has no 'quantization' section"),
        (lambda c: c["quantization"].update(method="int3"), "names quantisation 'int3'"),
        (lambda c: c["quantization"].pop("weights"), "'quantization' section of config.json is corrupt"),
        (lambda c: c["quantization"]["weights"][q].update(type="Pickle"), f"{q}: corrupt quantisation entry"),
        (lambda c: c["quantization"]["weights"][q].update(tensors=["qdata", "scale", "zero_point", "extra"]),
         f"the weights file has no {q}.extra"),
        (lambda c: c["quantization"]["weights"][q].update(tensors=["qdata", "scale"]),
         f"inner tensors config.json does not list: {q}.zero_point"),
        (lambda c: c["quantization"]["weights"][q]["attributes"].update(dtype={"dtype": "nonsense"}),
         "is not a dtype"),
        (lambda c: c["quantization"]["weights"][q]["attributes"].pop("block_size"), "cannot rebuild torchao"),
        (lambda c: c["quantization"].update(method="int4wo"), "config.json says int4wo but its weights file says "
                                                              "int8wo"),
    ]
    for edit, says in cases:
        (folder / "config.json").write_text(good)
        _edit_config(folder, edit)
        with pytest.raises(CheckpointError, match=says.replace("(", r"\(").replace(")", r"\)")) as e:
            hybrid.from_pretrained(folder)
        assert "re-save the model" in str(e.value) or "weights file says" in str(e.value), str(e.value)
    # a weights file missing an inner tensor config.json lists
    (folder / "config.json").write_text(good)
    state = load_file(str(folder / "model.safetensors"))
    del state[f"{q}.scale"]
    save_file(state, str(folder / "model.safetensors"), metadata={"quantization": "int8wo"})
    with pytest.raises(CheckpointError, match=f"the weights file has no {q}.scale"):
        hybrid.from_pretrained(folder, verify=False)  # the checksums would refuse the rewritten file first


def test_int4_cpu_layout_where_it_cannot_run_and_missing_torchao_are_one_line(tmp_path, monkeypatch):
    folder = _saved(tmp_path, "int4wo")
    # the device check comes before any tensor is read, so it needs no GPU to be tested
    with pytest.raises(CheckpointError, match="Int4OpaqueTensor layout, which runs on cpu only, not cuda: load "
                                              "it with device='cpu'") as e:
        hybrid.from_pretrained(folder, device="cuda")
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "torchao.prototype.quantization.int4", None)  # as if not installed
    with pytest.raises(CheckpointError, match=r"int4wo-quantised with torchao, which is not installed: pip "
                                              r"install 'hybrid-lm\[quant\]'") as e:
        hybrid.from_pretrained(folder)
    assert "\n" not in str(e.value)


def test_a_quantised_weight_keeps_its_dtype(tmp_path):
    folder = _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"int8wo-quantised in float32.*dtype=None.*--dtype float32"):
        hybrid.from_pretrained(folder, dtype="bfloat16")
    assert hybrid.from_pretrained(folder, dtype="float32").quantization == "int8wo"


def test_quantize_again(tmp_path):
    loaded = hybrid.from_pretrained(_saved(tmp_path))
    assert hybrid.quantize(loaded, "int8wo") is loaded  # the same method: nothing to do
    with pytest.raises(ValueError, match="already int8wo-quantised"):
        hybrid.quantize(loaded, "int4wo")


def _cli_generate(capsys, monkeypatch, argv):
    """``hybrid generate`` in-process, greedy: its stdout, the model it handed the engine and the tokens the
    engine generated."""
    import hybrid.engine

    seen = []

    class Spy(hybrid.engine.Engine):
        def __init__(self, model, *a, **k):
            super().__init__(model, *a, **k)
            seen.append(self)

    monkeypatch.setattr(hybrid.engine, "Engine", Spy)
    n = torch.get_num_threads()
    try:
        main(["generate", *argv, "--max-new-tokens", "5", "--threads", "1"])
    finally:
        torch.set_num_threads(n)
    (engine,) = seen
    (request,) = engine.requests.values()
    return capsys.readouterr().out, engine.model, list(request.output)


def test_cli_generate_loads_a_quantised_folder_quantised(tmp_path, capsys, monkeypatch):
    model = _model("llama-tiny", "int8wo")
    folder = hybrid.save_pretrained(model, tmp_path / "q")
    out, used, ids = _cli_generate(capsys, monkeypatch, ["--model", str(folder), "--prompt", "ab"])
    assert used.quantization == "int8wo" and type(used.layers[0].mixer.q_proj.weight).__name__ == "Int8Tensor"
    assert out.startswith("ab")
    prompt = hybrid.tokenizer.load_tokenizer(None).encode("ab")  # no tokenizer.json: bytes, as the CLI uses
    with torch.inference_mode():
        engine = Engine(model, num_blocks=4, block_size=16, max_seqs=1)
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=5))
        engine.run()
    assert ids == list(engine.requests[rid].output)  # what the saved model generates
    same, used, again = _cli_generate(capsys, monkeypatch, ["--model", str(folder), "--prompt", "ab",
                                                            "--quantize", "int8wo"])  # the flag it already has
    assert same == out and again == ids and used.quantization == "int8wo"
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(folder), "--prompt", "ab", "--quantize", "int4wo"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--model {folder} is already int8wo-quantised, so --quantize int4wo cannot apply" in err, err


def test_cli_quantize_still_quantises_an_unquantised_folder(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    folder = hybrid.save_pretrained(HybridLM(recipes.get("llama-tiny")), tmp_path / "fp32")
    _, used, _ = _cli_generate(capsys, monkeypatch, ["--model", str(folder), "--prompt", "ab",
                                                     "--quantize", "int4wo"])
    assert used.quantization == "int4wo" and type(used.layers[0].mixer.q_proj.weight).__name__ == "Int4OpaqueTensor"


def test_methods_are_hybrid_quantizes():
    """The loader's list of methods (kept in this module so loading imports no torchao early) is
    hybrid.quantize's."""
    import importlib

    from hybrid import quantized_checkpoint

    assert quantized_checkpoint.METHODS == importlib.import_module("hybrid.quantize").METHODS
