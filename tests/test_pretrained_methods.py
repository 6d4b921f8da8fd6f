"""transformers' conventions: ``model.save_pretrained(dir)`` / ``HybridLM.from_pretrained(dir)`` and string dtypes."""

import pytest
import torch

import hybrid
from hybrid import HybridLM, recipes


def test_methods_round_trip_and_string_dtypes(tmp_path):
    torch.manual_seed(0)
    model = HybridLM(recipes.get("hybrid-1to7-tiny")).eval()
    assert model.save_pretrained(tmp_path / "m") == tmp_path / "m"
    again = HybridLM.from_pretrained(tmp_path / "m")
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), again(ids))
    for given in ("bfloat16", "torch.bfloat16", "bf16", torch.bfloat16):
        assert hybrid.from_pretrained(tmp_path / "m", dtype=given).embed.weight.dtype == torch.bfloat16
    assert HybridLM.from_pretrained(tmp_path / "m", torch_dtype="float16").embed.weight.dtype == torch.float16
    assert hybrid.from_pretrained(tmp_path / "m", dtype="auto").embed.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="not a floating-point torch dtype"):
        hybrid.from_pretrained(tmp_path / "m", dtype="int8")
    with pytest.raises(ValueError, match="not both"):
        hybrid.from_pretrained(tmp_path / "m", dtype="float16", torch_dtype="float16")
