"""Damaged checkpoints are refused with the file named, never loaded: truncated or random weights, bytes
overwritten inside the weights with the header intact, a broken config.json, in our format (checksums written by
save_pretrained, finite values) and in foreign ones (safetensors structure, finite values); ``verify=False`` and
``--no-verify`` skip the value checks, and the command line reports each as one line."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybrid
from hybrid import CheckpointError
from hybrid.checkpoint_files import MANIFEST_FILE, file_sha256
from hybrid.cli import main as cli_main

WEIGHTS = "model.safetensors"


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = hybrid.HybridLM(hybrid.recipes.get("llama-tiny"))
    return model, hybrid.save_pretrained(model, tmp_path / "ckpt")


def data_start(path) -> int:
    """Where the tensor data of a safetensors file begins (after the 8-byte length and the header)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def refused(folder, *fragments, **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        hybrid.from_pretrained(folder, **kw)
    msg = str(e.value)
    assert all(f in msg for f in fragments), msg
    return msg


def test_save_writes_a_sha256_manifest_and_a_clean_load_passes(saved):
    model, folder = saved
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    entry = manifest["files"][WEIGHTS]
    assert entry == {"bytes": (folder / WEIGHTS).stat().st_size, "sha256": file_sha256(folder / WEIGHTS)}
    assert len(entry["sha256"]) == 64
    again = hybrid.from_pretrained(folder)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(again(ids), model(ids))


def test_truncated_weights_are_named(saved):
    _, folder = saved
    size = (folder / WEIGHTS).stat().st_size
    os.truncate(folder / WEIGHTS, size - 1000)
    refused(folder, str(folder / WEIGHTS), "truncated")  # the manifest's size check
    refused(folder, str(folder / WEIGHTS), "truncated", verify=False)  # the structure, always checked
    os.truncate(folder / WEIGHTS, 5)
    refused(folder, str(folder / WEIGHTS), "too short", verify=False)


def test_random_bytes_are_not_a_safetensors_file(saved):
    _, folder = saved
    (folder / WEIGHTS).write_bytes(os.urandom(4096))
    refused(folder, str(folder / WEIGHTS), verify=False)
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", 20) + b"not json at all here" + b"\0" * 64)
    refused(folder, str(folder / WEIGHTS), "not a safetensors file", verify=False)


def test_overwritten_bytes_with_the_header_intact(saved):
    _, folder = saved
    start = data_start(folder / WEIGHTS)
    # finite garbage: only the checksum can see it
    overwrite(folder / WEIGHTS, start + 64, struct.pack("<4f", 1.5, -2.0, 3.0, 0.25))
    refused(folder, str(folder / WEIGHTS), "SHA-256", "--no-verify")
    # NaNs: the checksum, and without a manifest (an older save, a copy) the finite check
    overwrite(folder / WEIGHTS, start + 64, struct.pack("<4f", *[float("nan")] * 4))
    (folder / MANIFEST_FILE).unlink()
    refused(folder, str(folder / WEIGHTS), "NaN/inf", "4 NaN/inf value(s)")
    loaded = hybrid.from_pretrained(folder, verify=False)  # asked for: loads, NaNs and all
    assert not all(torch.isfinite(p).all() for p in loaded.parameters())


def test_a_broken_config_json_is_named(saved):
    _, folder = saved
    (folder / "config.json").write_text('{"format": "hybrid-lm",\n  "pattern": \n}')
    refused(folder, str(folder / "config.json"), "not valid JSON", "line 3")
    (folder / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    refused(folder, str(folder / "config.json"), "not text")
    (folder / "config.json").write_text("[1, 2]")
    refused(folder, str(folder / "config.json"), "list")


def test_a_quantised_checkpoint_is_verified_too(tmp_path):
    pytest.importorskip("torchao")
    model = hybrid.quantize(hybrid.HybridLM(hybrid.recipes.get("llama-tiny")), "int8wo")
    folder = hybrid.save_pretrained(model, tmp_path / "q")
    assert (folder / MANIFEST_FILE).is_file()
    overwrite(folder / WEIGHTS, data_start(folder / WEIGHTS) + 8, b"\x7f" * 8)
    refused(folder, str(folder / WEIGHTS), "SHA-256")
    os.truncate(folder / WEIGHTS, 100)
    refused(folder, str(folder / WEIGHTS), verify=False)


def test_foreign_formats_are_checked_as_far_as_they_allow(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    weights = folder / WEIGHTS
    hybrid.from_pretrained(folder)  # a clean foreign folder loads (no manifest: nothing to compare)
    state = load_file(str(weights))
    name = sorted(state)[0]
    state[name][0, 0] = float("inf")
    save_file(state, str(weights), metadata={"format": "pt"})
    refused(folder, str(weights), repr(name), "NaN/inf")
    hybrid.from_pretrained(folder, verify=False)
    with open(weights, "ab") as f:
        f.write(b"\0" * 16)
    refused(folder, str(weights), "16 bytes past its last tensor", verify=False)
    os.truncate(weights, weights.stat().st_size - 400)
    refused(folder, str(weights), "truncated", verify=False)
    # sharded: the index's JSON, then each shard
    weights.unlink()
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    refused(folder, "model.safetensors.index.json", "not valid JSON")
    torch.save({"x": torch.ones(2)}, folder / "pytorch_model.bin")
    (folder / "model.safetensors.index.json").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated zip")
    refused(folder, str(folder / "pytorch_model.bin"), "cannot be read as PyTorch weights")


def test_the_command_line_gives_one_line_and_no_verify_skips(saved, capsys):
    _, folder = saved
    overwrite(folder / WEIGHTS, data_start(folder / WEIGHTS) + 64, struct.pack("<2f", *[float("nan")] * 2))
    for argv in (["info", "--model", str(folder)], ["generate", "--model", str(folder), "--prompt", "x"],
                 ["convert", str(folder), str(folder.parent / "out")]):
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert str(folder / WEIGHTS) in err and "--no-verify" in err, err
    cli_main(["info", "--model", str(folder), "--no-verify"])  # asked for: loads
    assert str(folder) in capsys.readouterr().out
