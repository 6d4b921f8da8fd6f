"""Convert an exported Hugging Face folder to GGUF with llama.cpp's own converter (``convert_hf_to_gguf``'s
model classes, so its tensor names and hyper-parameters are llama.cpp's), fp32.

One thing differs from ``convert_hf_to_gguf.py``: the vocabulary. Our exports carry no tokenizer (the
checks feed token ids), and llama.cpp's converters want one to hash and copy; so the GGUF gets
llama.cpp's token-free vocabulary (``tokenizer.ggml.model = "none"`` with ``vocab_size`` dummy tokens),
which its loader supports, and the ids pass through unchanged.

    python gguf_convert.py LLAMA_CPP_DIR HF_DIR OUT.gguf
"""

from __future__ import annotations

import argparse
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


def convert(llama_cpp: Path, hf_dir: Path, out: Path) -> Path:
    conversion = load_converter(llama_cpp)
    import gguf
    import torch

    with torch.inference_mode():
        hparams = conversion.ModelBase.load_hparams(hf_dir, False)
        arch = conversion.get_model_architecture(hparams, conversion.ModelType.TEXT)
        cls = conversion.get_model_class(arch, mmproj=False)  # NotImplementedError: llama.cpp lacks it
        patched = type(cls.__name__, (cls,), {"set_vocab": tokenless_vocab, "model_arch": cls.model_arch})
        model = patched(hf_dir, gguf.LlamaFileType.ALL_F32, out, eager=True)
        model.write()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_cpp", type=Path)
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(convert(args.llama_cpp, args.hf_dir, args.out))


if __name__ == "__main__":
    main()
