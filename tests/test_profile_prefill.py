"""The prefill profile charges time to layer kinds and their named parts, forward and engine alike."""

import pytest
import torch

from benchmarks.profile import format_report, profile_one
from hybrid import HybridLM, recipes


def test_profile_splits_time_by_layer_kind_and_part():
    model = HybridLM(recipes.get("hybrid-1to7-tiny")).eval()
    for chunk in (None, 16):
        row = profile_one(model, 40, engine_chunk=chunk)
        parts = row["parts_ms"]
        for key in ("mamba2 / ssd.intra_chunk", "mamba2 / ssd.state_passing", "mamba2 / conv1d",
                    "mamba2 / gated_rmsnorm", "mamba2 / linear.in_proj", "mlp / linear.down_proj",
                    "attention / linear.q_proj", "pre-norms / rmsnorm"):
            assert parts.get(key, 0.0) > 0.0, (chunk, key, sorted(parts))
        assert abs(sum(parts.values()) - row["profiled_ms"]) < 0.5
        assert f"{row['tokens_per_s']} tok/s" in format_report("hybrid-1to7-tiny", "float32", row)
    # the hooks are gone afterwards: the model runs as before
    assert not model.layers[0].mixer._forward_hooks and "forward_packed" not in vars(model.layers[0].mixer)
    with torch.inference_mode():
        assert model(torch.randint(0, 256, (1, 5))).shape == (1, 5, 256)


def test_family_members_are_named_like_recipes():
    from benchmarks.profile import _config

    assert _config("family:tiny:0:4").pattern == recipes.attention_family("tiny", 0.0, 4).pattern
    assert _config("family:tiny:1:2").pattern == "*-*-"
    assert _config("mamba2-tiny") == recipes.get("mamba2-tiny")
    with pytest.raises(ValueError, match="family:SIZE:SHARE:BLOCKS"):
        _config("family:tiny:0")
    with pytest.raises(ValueError, match="SHARE must be a number"):
        _config("family:tiny:half:4")
