"""Our exports against what the serving engines' loaders expect, without serving anything.

- vLLM (when ``import vllm`` works, e.g. in scripts/check_serving.sh's venv): vLLM parses the export's
  config, resolves its architecture, builds its model class on the CPU and runs that class's own
  ``load_weights`` on the exported tensors: every parameter must be loaded, no tensor name unknown.
- llama.cpp (when ``$LLAMA_CPP_DIR`` names a llama.cpp source tree): its ``convert_hf_to_gguf`` model
  class converts the export (it raises on a tensor it cannot map); every GGUF tensor must be one of the
  names gguf-py defines for that architecture, every layer must carry its kind's tensors, and the
  hyper-parameters must be ours.

Skipped where the engines are not installed (as in .ci/run); scripts/check_serving.sh runs it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hybrid
from hybrid import AttentionConfig, HybridConfig, Mamba1Config, Mamba2Config, MLPConfig, MoEConfig

REPO = Path(__file__).resolve().parent.parent
BASE = dict(vocab_size=512, d_model=128, tie_embeddings=False,
            attention=AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=64),
            mamba2=Mamba2Config(d_state=32, head_dim=64, chunk_size=64),
            mamba1=Mamba1Config(d_state=16), mlp=MLPConfig(d_ff=256))
NOPE = AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=64, rotary_fraction=0.0)
EXPORTS = {  # name -> (config, export format)
    "llama": (HybridConfig(pattern="*-*-", **BASE), "llama"),
    "mistral-swa": (HybridConfig(pattern="*-*-", **{**BASE, "attention": dataclasses.replace(
        BASE["attention"], sliding_window=32)}), "mistral"),
    "mamba2": (HybridConfig(pattern="MMMM", **BASE), "mamba2"),
    "granite-rope": (HybridConfig(pattern="M-*-M-", **BASE), "granitemoehybrid"),
    "granite-nope": (HybridConfig(pattern="M-*-M-", **{**BASE, "attention": NOPE}), "granitemoehybrid"),
    "granite-moe": (HybridConfig(pattern="ME*E", **{**BASE, "attention": NOPE, "moe": MoEConfig(
        n_experts=4, top_k=2, d_ff=128, normalize_top_k=True)}), "granitemoehybrid"),
    "bamba": (HybridConfig(pattern="M-*-M-", **BASE), "bamba"),
    "nemotronh-tied": (HybridConfig(pattern="M-M*-", **{**BASE, "attention": NOPE, "tie_embeddings": True,
                                                          "mlp": MLPConfig(d_ff=256, activation="relu2",
                                                                           gated=False)}), "nemotron_h"),
    "mamba1": (HybridConfig(pattern="mmmm", **BASE), "mamba"),
    "jamba": (HybridConfig(pattern="m-mE*-mE", **{**BASE, "attention": NOPE, "mamba1": Mamba1Config(
        d_state=16, inner_norms=True), "moe": MoEConfig(n_experts=4, top_k=2, d_ff=256)}), "jamba"),
}
VLLM_EXPORTS = [n for n in EXPORTS if n != "bamba"]  # vLLM 0.32 has no Bamba model (checked below)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serving-exports")
    out = {}
    for name, (cfg, fmt) in EXPORTS.items():
        torch.manual_seed(0)
        out[name] = hybrid.save_pretrained(hybrid.HybridLM(cfg), root / name, format=fmt)
    return out


# ---------------------------------------------------------------------------------------------- vLLM

@pytest.fixture(scope="module")
def vllm_builder():
    """A function: export folder -> (vLLM's parsed config, vLLM's model for it, built on the CPU)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/check_serving.sh installs it)")
    try:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader.utils import initialize_model
    except ImportError as e:  # a vLLM without these internals: nothing to hold the names against
        pytest.skip(f"this vLLM lacks the loader internals the check uses: {e}")
    state = {"init": False}

    def build(folder: Path):
        vc = EngineArgs(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                        enforce_eager=True).create_engine_config()
        with set_current_vllm_config(vc):
            if not state["init"]:  # one single-process "distributed" group for the whole module
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method="tcp://127.0.0.1:29517")
                initialize_model_parallel(1, 1)
                state["init"] = True
            with torch.device("cpu"):
                model = initialize_model(vc)
        return vc.model_config, model
    return build


def test_vllm_has_no_bamba_model():
    """Why format="hf" writes Mamba-2 hybrids as GraniteMoeHybrid: the vLLM we target cannot load Bamba."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.registry import ModelRegistry
    archs = ModelRegistry.get_supported_archs()
    assert "GraniteMoeHybridForCausalLM" in archs
    if "BambaForCausalLM" in archs:
        pytest.skip("this vLLM serves Bamba; format='hf' could prefer bamba again")


@pytest.mark.parametrize("name", VLLM_EXPORTS)
def test_vllm_loads_every_tensor(vllm_builder, exported, name):
    cfg, fmt = EXPORTS[name]
    model_config, model = vllm_builder(exported[name])
    hf = model_config.hf_config
    assert model_config.architectures[0] == hybrid.interop.FORMATS[fmt].architectures[0]
    assert hf.hidden_size == cfg.d_model and hf.vocab_size == cfg.vocab_size
    params = set(dict(model.named_parameters()))
    loaded = model.load_weights(iter(load_file(str(exported[name] / "model.safetensors")).items()))
    assert params - set(loaded) == set(), f"vLLM left these parameters unloaded: {sorted(params - set(loaded))}"
    if fmt == "granitemoehybrid":  # the layer kinds vLLM builds are our mixers, in order
        kinds = ["M" if t == "linear_attention" else "*" for t in hf.layer_types]
        assert "".join(kinds) == cfg.pattern[::2]
        assert hf.attention_multiplier == cfg.attention.head_dim ** -0.5
        assert (hf.position_embedding_type == "rope") == (cfg.attention.rotary_fraction == 1.0)
    if fmt == "nemotron_h":
        assert hf.hybrid_override_pattern == cfg.pattern


# ----------------------------------------------------------------------------------------- llama.cpp

@pytest.fixture(scope="module")
def llama_cpp():
    root = os.environ.get("LLAMA_CPP_DIR")
    if not root or not (Path(root) / "convert_hf_to_gguf.py").is_file():
        pytest.skip("set LLAMA_CPP_DIR to a llama.cpp source tree (scripts/check_serving.sh builds one)")
    sys.path.insert(0, str(REPO / "scripts" / "serving"))
    import gguf_convert
    gguf_convert.load_converter(Path(root))
    return Path(root), gguf_convert


# which GGUF tensors each of our mixer kinds must have in its block (gguf.MODEL_TENSOR members)
MIXER_TENSORS = {"*": ("ATTN_Q", "ATTN_K", "ATTN_V", "ATTN_OUT"),
                 "M": ("SSM_IN", "SSM_CONV1D", "SSM_A", "SSM_D", "SSM_DT", "SSM_NORM", "SSM_OUT"),
                 "m": ("SSM_IN", "SSM_CONV1D", "SSM_X", "SSM_DT", "SSM_A", "SSM_D", "SSM_OUT"),
                 "-": ("FFN_UP", "FFN_DOWN")}  # NemotronH's MLP-only blocks


def engine_blocks(cfg: HybridConfig, fmt: str) -> list[str]:
    """Our mixer symbols per llama.cpp block: one block per sub-layer for NemotronH and pure Mamba, one
    per (mixer, feed-forward) pair otherwise. NemotronH's MLP-only blocks have no mixer ("-")."""
    if fmt in ("nemotron_h", "mamba", "mamba2"):
        return list(cfg.pattern)
    return list(cfg.pattern[::2])


@pytest.mark.parametrize("name", list(EXPORTS))
def test_llama_cpp_converts_with_its_own_names(llama_cpp, exported, tmp_path, name):
    root, gguf_convert = llama_cpp
    import gguf
    cfg, fmt = EXPORTS[name]
    out = gguf_convert.convert(root, exported[name], tmp_path / f"{name}.gguf")
    reader = gguf.GGUFReader(out)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    blocks = engine_blocks(cfg, fmt)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) + suffix for t in gguf.MODEL_TENSORS[arch_enum]
               for i in range(len(blocks)) for suffix in ("", ".weight", ".bias")}
    names = {t.name for t in reader.tensors}
    assert names <= allowed, f"names llama.cpp's {arch} does not define: {sorted(names - allowed)}"
    for i, kind in enumerate(blocks):
        for t in MIXER_TENSORS[kind]:
            stem = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[t]].format(bid=i)
            assert any(n == stem or n.startswith(stem + ".") for n in names), f"block {i} ({kind}) has no {stem}"

    def field(key):
        return reader.fields[f"{arch}.{key}"].parts[-1][0]
    assert field("block_count") == len(blocks)
    assert field("embedding_length") == cfg.d_model
    assert int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]) == cfg.vocab_size
    keys = {f"{arch}.{k}" for k in ("expert_count", "expert_used_count")}
    n_expert, n_used = (int(reader.fields[k].parts[-1][0]) if k in reader.fields else 0 for k in sorted(keys))
    assert n_used <= n_expert, f"llama.cpp's loader asserts experts used ({n_used}) <= experts ({n_expert})"
    # the loader gives each block its kind from the per-layer arrays: a feed-forward width where a block has an
    # MLP, KV heads where it has attention (a dense NemotronH converted as nemotron_h_moe had no MLP blocks)
    if fmt == "nemotron_h":
        assert arch == "nemotron_h", f"a dense NemotronH export converts as {arch}"
        n_ff = reader.fields[f"{arch}.feed_forward_length"].contents()
        n_kv = reader.fields[f"{arch}.attention.head_count_kv"].contents()
        assert [f > 0 for f in n_ff] == [k == "-" for k in blocks], f"MLP blocks {n_ff} vs pattern {cfg.pattern}"
        assert [h > 0 for h in n_kv] == [k == "*" for k in blocks], f"attention blocks {n_kv} vs {cfg.pattern}"
    if "M" in cfg.pattern:
        assert field("ssm.inner_size") == cfg.mamba2.d_inner and field("ssm.state_size") == cfg.mamba2.d_state
    if arch == "granitehybrid":
        # llama.cpp rotates GraniteMoeHybrid attention only for Bamba checkpoints: a RoPE model must go to
        # it as bamba (scripts/serving/families.py does), a RoPE-free one as granitemoehybrid
        rotates = bool(field("rope.scaling.finetuned"))
        assert rotates == (fmt == "bamba")
