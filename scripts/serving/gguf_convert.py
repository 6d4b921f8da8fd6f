"""Convert an exported Hugging Face folder to GGUF with llama.cpp's own converter (``convert_hf_to_gguf``'s
model classes, so its tensor names and hyper-parameters are llama.cpp's), fp32.

One thing differs from ``convert_hf_to_gguf.py``: the vocabulary. Our exports carry no tokenizer (the
checks feed token ids), and llama.cpp's converters want one to hash and copy; so the GGUF gets
llama.cpp's token-free vocabulary (``tokenizer.ggml.model = "none"`` with ``vocab_size`` dummy tokens),
which its loader supports, and the ids pass through unchanged.

And for NemotronH the hyper-parameters come from the folder's ``config.json`` as written, not from
transformers' re-serialisation of it (``AutoConfig.from_pretrained(dir).to_dict()``, what the converter reads
first): transformers 5 adds MoE defaults (``num_experts_per_tok``, ``n_routed_experts``) to every NemotronH
config and drops ``hybrid_override_pattern``, and llama.cpp's NemotronH converter then takes a dense model
for ``nemotron_h_moe`` and finds no MLP layers in ``layers_block_type`` (it knows ``"moe"``, not ``"mlp"``),
so the GGUF's layer kinds are wrong and the loader stops at the first MLP layer ("tensor
'blk.1.ssm_in.weight' not found"). The converter falls back to ``config.json`` itself when AutoConfig
fails; this takes that path on purpose.

    python gguf_convert.py LLAMA_CPP_DIR HF_DIR OUT.gguf [--tokenizer] [--outtype f32|f16|bf16|q8_0]

``--tokenizer`` keeps llama.cpp's own vocabulary conversion (the folder's ``tokenizer.json``), for a GGUF
that takes text: the way to convert a NemotronH export for use, until llama.cpp reads transformers 5's
NemotronH configs right.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def load_converter(llama_cpp: Path):
    """llama.cpp's conversion package (and its gguf-py), importable from its source tree."""
    for p in (llama_cpp / "gguf-py", llama_cpp):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    import conversion
    import gguf  # noqa: F401  (the tree's own gguf-py, not a pip one)
    return conversion


def tokenless_vocab(model) -> None:
    """set_vocab for a model class: n dummy tokens, ids used as they are."""
    model.gguf_writer.add_tokenizer_model("none")
    model.gguf_writer.add_vocab_size(int(model.hparams["vocab_size"]))


OUTTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def convert(llama_cpp: Path, hf_dir: Path, out: Path, *, tokenizer: bool = False, outtype: str = "f32") -> Path:
    conversion = load_converter(llama_cpp)
    import gguf
    import torch

    with torch.inference_mode():
        hparams = conversion.ModelBase.load_hparams(hf_dir, False)
        kw = {}
        if hparams.get("model_type") == "nemotron_h":
            kw["hparams"] = hparams = json.loads((hf_dir / "config.json").read_text())
        arch = conversion.get_model_architecture(hparams, conversion.ModelType.TEXT)
        cls = conversion.get_model_class(arch, mmproj=False)  # NotImplementedError: llama.cpp lacks it
        # our exports carry no multi-token-prediction heads: without no_mtp the Qwen3-Next converter asserts it
        # finds some (llama.cpp's --no-mtp)
        extra = {"no_mtp": True} if hasattr(cls, "no_mtp") else {}
        if not tokenizer:
            extra["set_vocab"] = tokenless_vocab
        if extra:
            cls = type(cls.__name__, (cls,), {**extra, "model_arch": cls.model_arch})
        model = cls(hf_dir, getattr(gguf.LlamaFileType, OUTTYPES[outtype]), out, eager=True, **kw)
        model.write()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_cpp", type=Path)
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", action="store_true",
                    help="convert the folder's tokenizer too (default: a token-free vocabulary, ids as they are)")
    ap.add_argument("--outtype", choices=sorted(OUTTYPES), default="f32")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(convert(args.llama_cpp, args.hf_dir, args.out, tokenizer=args.tokenizer, outtype=args.outtype))


if __name__ == "__main__":
    main()
