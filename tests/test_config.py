import dataclasses
import math

import pytest

from hybrid import (
    AttentionConfig,
    ConfigError,
    HybridConfig,
    Mamba2Config,
    MLPConfig,
    PatternError,
    attention_share,
    blocks_pattern,
    parse_pattern,
    ratio_pattern,
    recipes,
)


def test_pattern_parse_and_bad_symbol_position():
    assert parse_pattern("M-m*") == ("mamba2", "mlp", "mamba1", "attention")
    with pytest.raises(PatternError, match=r"invalid symbol 'X' at position 3"):
        parse_pattern("M-MX-")
    with pytest.raises(PatternError, match="non-empty"):
        parse_pattern("")


def test_pattern_helpers():
    assert blocks_pattern(8, "M", attn_every=4) == "M-M-M-*-M-M-M-*-"
    assert blocks_pattern(8, "m", attn_every=8, attn_offset=4) == "m-m-m-m-*-m-m-m-"
    assert blocks_pattern(3, "M", mlp=False) == "MMM"
    for share in (0, 0.125, 0.25, 0.5, 1.0):
        p = ratio_pattern(8, share)
        assert attention_share(p) == share and len(p) == 16
    with pytest.raises(PatternError, match="attn_offset"):
        blocks_pattern(4, "M", attn_every=2, attn_offset=2)


def test_derived_sizes_are_resolved():
    cfg = HybridConfig(vocab_size=100, d_model=64, pattern="M*-",
                       attention=AttentionConfig(n_heads=4), mamba2=Mamba2Config(head_dim=16, d_state=8))
    assert cfg.attention.n_kv_heads == 4 and cfg.attention.head_dim == 16
    assert cfg.mamba2.d_inner == 128 and cfg.mamba2.n_heads == 8 and cfg.mamba2.norm_groups == 1
    assert cfg.mlp.d_ff == 192  # 8/3 * 64 rounded up to 64


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention=AttentionConfig(n_heads=6, n_kv_heads=4)),
     r"n_heads \(6\) must be a multiple of .*n_kv_heads \(4\)"),
    (dict(attention=AttentionConfig(n_heads=4, head_dim=10, rotary_fraction=0.5)), "rotary dim .* must be even"),
    (dict(attention=AttentionConfig(sliding_window=0)), "sliding_window"),
    (dict(mamba2=Mamba2Config(head_dim=48)), r"d_inner \(128\) must be a multiple of mamba2.head_dim \(48\)"),
    (dict(mamba2=Mamba2Config(head_dim=16, n_groups=3)), r"must be a multiple of mamba2.n_groups \(3\)"),
    (dict(mamba2=Mamba2Config(head_dim=16, dt_limit=(0.5, 0.1))), "dt_limit"),
    (dict(mlp=MLPConfig(activation="swish2")), "activation 'swish2' is not supported"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(d_model=-3), "d_model must be a positive int"),
    (dict(pattern="M-Q"), r"invalid symbol 'Q' at position 2"),
])
def test_validation_errors(kwargs, match):
    base = dict(vocab_size=100, d_model=64, pattern="M*-", mamba2=Mamba2Config(head_dim=16))
    base.update(kwargs)
    with pytest.raises((ConfigError, PatternError), match=match):
        HybridConfig(**base)


def test_unused_subconfig_is_not_validated():
    # head_dim 48 does not divide d_inner 128, but no Mamba-2 layer uses it
    HybridConfig(vocab_size=10, d_model=64, pattern="*-", mamba2=Mamba2Config(head_dim=48))


def test_config_is_frozen_and_keyword_only():
    cfg = recipes.get("llama-tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3
    with pytest.raises(TypeError):
        HybridConfig(100, 64, "M")


@pytest.mark.parametrize("name", recipes.names())
def test_json_round_trip(name, tmp_path):
    cfg = recipes.get(name)
    again = HybridConfig.from_json(cfg.to_json())
    assert again == cfg
    cfg.to_json(tmp_path / "c.json")
    assert HybridConfig.from_json(tmp_path / "c.json") == cfg


def test_json_round_trip_keeps_dt_limit_and_infinity():
    cfg = HybridConfig(vocab_size=10, d_model=32, pattern="M",
                       mamba2=Mamba2Config(head_dim=16, dt_limit=(0.001, math.inf)))
    assert HybridConfig.from_json(cfg.to_json()).mamba2.dt_limit == (0.001, math.inf)


def test_from_dict_rejects_unknown_fields():
    d = recipes.get("mamba2-tiny").to_dict()
    d["mamba2"]["d_sate"] = 3
    with pytest.raises(ConfigError, match=r"unknown mamba2 fields \['d_sate'\]"):
        HybridConfig.from_dict(d)


def test_recipes_unknown_name_lists_known():
    with pytest.raises(KeyError, match="known recipes: llama-tiny"):
        recipes.get("gpt5-huge")
    assert {"llama-small", "mamba2-small", "mamba1-small", "hybrid-1to7-small", "jamba-small",
            "nemotronh-small", "samba-small"} <= set(recipes.names())


def test_kinds_come_from_the_sub_config_registry():
    """Every pattern symbol is declared by a sub-config class, whose section is a HybridConfig field and a layer
    kind of the layer registry; a second class for a section, or a taken symbol, is refused by name."""
    import dataclasses

    import pytest

    from hybrid.config import SUBCONFIGS, HybridConfig, SubConfig
    from hybrid.layers.registry import LAYER_CLASSES
    from hybrid.pattern import SYMBOLS, register_symbol

    assert set(SYMBOLS.values()) == set(SUBCONFIGS) == set(LAYER_CLASSES)
    assert {SUBCONFIGS[k].symbol for k in SUBCONFIGS} == set(SYMBOLS)
    assert set(SUBCONFIGS) <= {f.name for f in dataclasses.fields(HybridConfig)}
    with pytest.raises(ValueError, match="'mamba2' is declared twice"):
        type("Again", (SubConfig,), {"section": "mamba2", "symbol": "Q", "mixer": True})
    with pytest.raises(ValueError, match="symbol 'M' is taken by 'mamba2'"):
        register_symbol("M", "other", mixer=True)
    assert "Q" not in SYMBOLS and SYMBOLS["M"] == "mamba2"  # the refusals changed nothing
