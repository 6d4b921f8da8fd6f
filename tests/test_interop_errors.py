"""Bad checkpoints fail with a message that says what is wrong; `hybrid convert` works end to end."""

import json

import pytest
import torch
from interop_helpers import randomize_, write_word_tokenizer
from safetensors.torch import load_file, save_file

import hybrid
from hybrid import CheckpointError
from hybrid.cli import main as cli_main

transformers = pytest.importorskip("transformers")


@pytest.fixture
def llama_dir(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    randomize_(transformers.LlamaForCausalLM(cfg)).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_state(path, fn):
    state = load_file(str(path / "model.safetensors"))
    fn(state)
    save_file(state, str(path / "model.safetensors"))


def test_unknown_architecture(llama_dir):
    _edit_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="architecture 'GPT2LMHeadModel' is not supported; supported: .*"
                                              "LlamaForCausalLM"):
        hybrid.from_pretrained(llama_dir)


def test_no_architecture(llama_dir):
    _edit_config(llama_dir, architectures=None)
    with pytest.raises(CheckpointError, match="names no architecture"):
        hybrid.from_pretrained(llama_dir)


def test_missing_tensor(llama_dir):
    _edit_state(llama_dir, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): layers\.3\.mixer\.up_proj\.weight"):
        hybrid.from_pretrained(llama_dir)


def test_wrong_shape_and_unexpected_tensor(llama_dir):
    def edit(s):
        s["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
        s["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    _edit_state(llama_dir, edit)
    with pytest.raises(CheckpointError) as e:
        hybrid.from_pretrained(llama_dir)
    msg = str(e.value)
    assert "layers.0.mixer.k_proj.weight: checkpoint (8, 32) vs model (16, 32)" in msg
    assert "unexpected tensors (1): layers.0.mixer.q_norm.weight" in msg


@pytest.mark.parametrize("changes, fragment", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"hidden_act": "tanh"}, "hidden_act='tanh'"),
    ({"sliding_window": 16}, "sliding_window"),
])
def test_unsupported_llama_option(llama_dir, changes, fragment):
    _edit_config(llama_dir, **changes)
    with pytest.raises(CheckpointError, match="LlamaForCausalLM: .*is not supported.*refusing to load") as e:
        hybrid.from_pretrained(llama_dir)
    assert fragment in str(e.value)


def test_qwen2_window_on_some_layers_is_refused(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=4, max_window_layers=1)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="sliding window on only some layers"):
        hybrid.from_pretrained(tmp_path)


@pytest.mark.parametrize("changes, fragment", [
    ({"rms_norm": False}, "rms_norm=False"),
    ({"ssm_cfg": {"layer": "Mamba3"}}, "layer='Mamba3'"),
    ({"ssm_cfg": {"layer": "Mamba2", "D_has_hdim": True}}, "D_has_hdim"),
    ({"ssm_cfg": {"layer": "Mamba2", "d_ssm": 32}}, "d_ssm=32"),
    ({"ssm_cfg": {"layer": "Mamba2", "frobnicate": 1}}, "['frobnicate']"),
    ({"attn_layer_idx": [1], "attn_cfg": {"num_heads": 4}}, "causal=False"),
    ({"attn_layer_idx": [1], "attn_cfg": {"num_heads": 4, "causal": True, "d_conv": 4}}, "d_conv=4"),
    ({"d_intermediate": 64, "fused_add_norm": False}, "fused_add_norm=False"),
])
def test_unsupported_mamba_ssm_option(tmp_path, changes, fragment):
    raw = {"d_model": 32, "n_layer": 2, "vocab_size": 64, "ssm_cfg": {}, **changes}
    tmp_path.joinpath("config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="mamba_ssm MambaLMHeadModel: .*is not supported") as e:
        hybrid.from_pretrained(tmp_path)
    assert fragment in str(e.value)


def test_not_a_folder_incomplete_config_and_no_weights(llama_dir, tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        hybrid.from_pretrained(tmp_path / "nope")
    bare = tmp_path / "bare"
    bare.mkdir()
    bare.joinpath("config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="lacks the required key 'num_attention_heads'"):
        hybrid.from_pretrained(bare)
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no weights"):
        hybrid.from_pretrained(llama_dir)


def test_cli_convert(llama_dir, tmp_path, capsys):
    write_word_tokenizer(llama_dir, ["<unk>", "hello", "world"])  # copied along, byte for byte
    cli_main(["convert", str(llama_dir), str(tmp_path / "ours")])
    cli_main(["convert", str(tmp_path / "ours"), str(tmp_path / "back"), "--format", "hf"])
    assert "format hf" in capsys.readouterr().out
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (llama_dir / "tokenizer.json").read_bytes()
    assert hybrid.from_pretrained(tmp_path / "ours").tokenizer.encode("hello world") == [1, 2]
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, 64, (1, 11))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, again(ids).logits)
    cli_main(["convert", str(llama_dir), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    assert hybrid.from_pretrained(tmp_path / "bf16").embed.weight.dtype == torch.bfloat16
    with pytest.raises(SystemExit, match="hybrid convert: cannot export this model as 'mamba'"):
        cli_main(["convert", str(llama_dir), str(tmp_path / "x"), "--format", "mamba"])


def test_mistral_per_layer_types_are_refused(llama_dir):
    # the Llama weights have Mistral's names; only the config decides
    _edit_config(llama_dir, architectures=["MistralForCausalLM"], sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(CheckpointError, match="MistralForCausalLM: layer_types .* disagree with sliding_window=4"):
        hybrid.from_pretrained(llama_dir)
    _edit_config(llama_dir, layer_types=["sliding_attention", "sliding_attention"])
    assert hybrid.from_pretrained(llama_dir).config.attention.sliding_window == 4


def test_tied_config_with_a_different_head(llama_dir):
    _edit_config(llama_dir, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="ties the embeddings, but lm_head.weight differs"):
        hybrid.from_pretrained(llama_dir)


# the decoder-pair formats (one name mapping, hybrid.interop.hf_hybrid.DecoderPairNames): a tied config with a
# stored head is loaded only when the head is the embedding, for each of them
PAIR_FORMATS = {
    "bamba": hybrid.HybridConfig(vocab_size=64, d_model=32, pattern="M-*-", mamba2=hybrid.Mamba2Config(
        d_state=8, head_dim=8, chunk_size=8), attention=hybrid.AttentionConfig(n_heads=4, rotary_fraction=0.5),
        mlp=hybrid.MLPConfig(d_ff=40)),
    "jamba": hybrid.HybridConfig(vocab_size=64, d_model=32, pattern="m-*E", mamba1=hybrid.Mamba1Config(
        d_state=8, inner_norms=True), attention=hybrid.AttentionConfig(n_heads=4, rotary_fraction=0.0),
        mlp=hybrid.MLPConfig(d_ff=40), moe=hybrid.MoEConfig(n_experts=4, top_k=2, d_ff=40)),
    "granitemoehybrid": hybrid.HybridConfig(vocab_size=64, d_model=32, pattern="M-*-", mamba2=hybrid.Mamba2Config(
        d_state=8, head_dim=8, chunk_size=8), attention=hybrid.AttentionConfig(n_heads=4),
        mlp=hybrid.MLPConfig(d_ff=40)),
}


@pytest.mark.parametrize("fmt", sorted(PAIR_FORMATS))
def test_pair_formats_tied_head_must_equal_the_embedding(fmt, tmp_path):
    torch.manual_seed(0)
    model = hybrid.HybridLM(PAIR_FORMATS[fmt]).eval()
    path = hybrid.save_pretrained(model, tmp_path / fmt, format=fmt)
    path = path if path.is_dir() else path.parent
    _edit_config(path, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="ties the embeddings, but lm_head.weight differs"):
        hybrid.from_pretrained(path)
    _edit_state(path, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    tied = hybrid.from_pretrained(path).eval()
    assert tied.config.tie_embeddings and tied.lm_head is None
    model.lm_head = None  # the original with its head replaced by the embedding: what the tied folder holds
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():  # every other weight came through under the shared names
        assert torch.equal(tied(ids), model(ids))
