"""Our checkpoint format for a model quantised by :func:`hybrid.quantize`: safetensors (never pickle) plus a
``"quantization"`` section in ``config.json``.

Each torchao weight is stored as its inner plain tensors under ``<name>.<inner>`` (e.g.
``layers.0.mixer.q_proj.weight.qdata``, ``...weight.scale``, ``...weight.zero_point``; int4:
``...weight.scale_and_zero``), exactly the bytes the quantised model holds, and ``config.json`` records the
method and, for every quantised weight, its torchao type, which inner tensors it has, its non-tensor
attributes (block size, shape, dtype) and its group size (int4 on a CPU chooses one per layer). Loading wraps
the stored tensors back into the same torchao type: bit-identical inner tensors, the same logits, and no
fp32 copy of a quantised weight is ever made (the model is built on the meta device and the stored int8 /
packed int4 tensors are the weights). A model with tied embeddings stores its quantised head as
``lm_head.weight.*`` beside the embedding (kept in its dtype for the lookup); loading gives it that head again.

Why not torchao's own ``torchao.prototype.safetensors`` (what transformers uses): in torchao 0.18 its
allow-list has ``Int8Tensor`` and ``Int4TilePackedTo4dTensor`` but not ``Int4OpaqueTensor``, the only int4
format that runs on a CPU (what ``hybrid.quantize(model, "int4wo")`` makes there), so it cannot save our CPU
int4 models. This module follows the same protocol (torchao's ``tensor_data_names`` /
``tensor_attribute_names``, rebuilt with the class's keyword constructor) for the three types
:func:`hybrid.quantize` produces, with its own allow-list.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint import CONFIG_FILE, FORMAT_TAG, WEIGHTS_FILE, CheckpointError, empty_model, load_state_strict
from .checkpoint_files import check_safetensors, load_safetensors, read_json, write_manifest

CONFIG_KEY = "quantization"
METHODS = ("int8wo", "int4wo", "int8dq", "8da4w")  # as hybrid.quantize.METHODS (checked by a test)

# torchao type name -> (module, device type the layout runs on, or None for any)
TENSOR_TYPES = {
    "Int8Tensor": ("torchao.quantization", None),
    "Int4OpaqueTensor": ("torchao.prototype.quantization.int4", "cpu"),  # aten's CPU int4 kernel only
    "Int4TilePackedTo4dTensor": ("torchao.quantization", "cuda"),  # tinygemm, CUDA only
    "IntxUnpackedToInt8Tensor": ("torchao.quantization", None),  # 8da4w
}
HEAD = "lm_head.weight"
_FIX = "re-save the model with save_pretrained, or load the unquantised checkpoint and quantise it again"


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _names(t, field: str) -> list[str]:
    return list(getattr(type(t), field, None) or []) + list(getattr(type(t), f"optional_{field}", None) or [])


def _encode(value, where: str):
    """A torchao tensor attribute as JSON: None, bools, numbers, strings, int lists (block sizes, shapes),
    dtypes, and the two activation quantisations :func:`hybrid.quantize` makes (int8dq's per-row int8 kwargs,
    8da4w's per-token enum) as named records; anything else is refused, never pickled."""
    kind = type(value).__name__
    if kind == "IntxUnpackedToInt8TensorActivationQuantization":  # (a str enum: before the str case)
        return {"intx_activation": value.value}
    if kind == "QuantizeTensorToInt8Kwargs":
        if type(value.granularity).__name__ != "PerRow":
            raise CheckpointError(f"cannot save {where}: int8 activations per {type(value.granularity).__name__}; "
                                  "our checkpoints hold hybrid.quantize's int8dq (per-row activations)")
        return {"int8_activation": {"granularity": "PerRow", "dim": int(value.granularity.dim),
                                    "mapping_type": value.mapping_type.name, "reduce_range": bool(value.reduce_range)}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple, torch.Size)) and all(type(v) is int for v in value):
        return list(value)
    raise CheckpointError(f"cannot save {where}: a {type(value).__name__} attribute; our checkpoints hold the "
                          f"formats of hybrid.quantize ({', '.join(METHODS)})")


def _decode_activation(value: dict, where: str):
    """An activation-quantisation record of :func:`_encode` as torchao's object."""
    try:
        if "intx_activation" in value and len(value) == 1:
            from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
                IntxUnpackedToInt8TensorActivationQuantization,
            )

            return IntxUnpackedToInt8TensorActivationQuantization(value["intx_activation"])
        spec = value["int8_activation"]
        if len(value) != 1 or spec.get("granularity") != "PerRow":
            raise ValueError(f"granularity {spec.get('granularity')!r}")
        from torchao.quantization import MappingType, PerRow
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import QuantizeTensorToInt8Kwargs

        return QuantizeTensorToInt8Kwargs(granularity=PerRow(dim=int(spec["dim"])),
                                          mapping_type=MappingType[spec["mapping_type"]],
                                          reduce_range=bool(spec["reduce_range"]))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: unreadable activation quantisation {value!r} ({e}); {_FIX}") from None


def _decode(value, where: str):
    if isinstance(value, dict) and ("intx_activation" in value or "int8_activation" in value):
        return _decode_activation(value, where)
    if isinstance(value, dict):
        name = value.get("dtype")
        dtype = getattr(torch, name, None) if isinstance(name, str) and len(value) == 1 else None
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{where}: {value!r} is not a dtype; {_FIX}")
        return dtype
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    raise CheckpointError(f"{where}: unreadable attribute {value!r}; {_FIX}")


def flatten(model) -> tuple[dict[str, torch.Tensor], dict]:
    """(the plain tensors to write, the config.json section) of a quantised ``model``; raises before
    anything is written if a weight is not one of the torchao types we store."""
    method = getattr(model, "quantization", None)
    if method not in METHODS:
        raise CheckpointError(f"model.quantization is {method!r}, not one of {', '.join(METHODS)}")
    import torchao

    state, weights = {}, {}
    for name, t in model.state_dict().items():
        if _is_plain(t):
            # safetensors refuses aliased tensors; a tied model's quantised head is its own tensor, not a view.
            state[name] = t.detach().contiguous()
            continue
        kind = type(t).__name__
        if kind not in TENSOR_TYPES or type(t).__module__.split(".")[0] != "torchao":
            raise CheckpointError(f"cannot save {name}: a {type(t).__module__}.{type(t).__qualname__}; our "
                                  f"quantised checkpoints hold torchao's {', '.join(TENSOR_TYPES)}")
        inner = [n for n in _names(t, "tensor_data_names") if getattr(t, n, None) is not None]
        for n in inner:
            key = f"{name}.{n}"
            if key in state or key in weights:
                raise CheckpointError(f"cannot save {name}: its inner tensor {key} collides with a model tensor")
            # a clone: the inner tensors may be views of one buffer, which safetensors refuses
            state[key] = getattr(t, n).detach().contiguous().clone()
        attrs = {n: _encode(getattr(t, n, None), f"{name}.{n}") for n in _names(t, "tensor_attribute_names")}
        block = attrs.get("block_size")
        weights[name] = {"type": kind, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                         "group_size": block[-1] if isinstance(block, list) and block else None,
                         "tensors": inner, "attributes": attrs}
    if not weights:
        raise CheckpointError(f"model.quantization is {method!r} but none of its weights is quantised")
    return state, {"method": method, "library": "torchao", "torchao_version": torchao.__version__,
                   "weights": weights}


def method_of(section, source: str) -> str:
    """The method a config.json quantization section names, or a CheckpointError saying what is wrong."""
    if not isinstance(section, dict) or not isinstance(section.get("weights"), dict) or not section["weights"]:
        raise CheckpointError(f"{source}: the {CONFIG_KEY!r} section of config.json is corrupt (no 'weights' "
                              f"table of quantised tensors); {_FIX}")
    method = section.get("method")
    if method not in METHODS:
        raise CheckpointError(f"{source}: config.json names quantisation {method!r}, not one of "
                              f"{', '.join(METHODS)}; {_FIX}")
    return method


def _tensor_class(kind: str, method: str, source: str):
    module = TENSOR_TYPES[kind][0]
    try:
        return getattr(importlib.import_module(module), kind)
    except ImportError as e:
        raise CheckpointError(f"{source} is {method}-quantised with torchao, which is not installed: "
                              f"pip install 'hybrid-lm[quant]' ({e})") from None
    except AttributeError:
        import torchao

        raise CheckpointError(f"{source} holds torchao {kind} weights, which torchao {torchao.__version__} does "
                              f"not have; install the torchao that wrote it ({module}.{kind})") from None


def check(section, source: str, device: torch.device) -> tuple[str, dict]:
    """Before any tensor is read: the method, and each quantised weight's torchao class, or one error saying
    what is wrong (corrupt metadata, torchao missing, a layout that cannot run on ``device``)."""
    method = method_of(section, source)
    classes = {}
    for name, entry in section["weights"].items():
        if not isinstance(entry, dict) or entry.get("type") not in TENSOR_TYPES \
                or not isinstance(entry.get("tensors"), list) or not entry["tensors"] \
                or not isinstance(entry.get("attributes"), dict):
            raise CheckpointError(f"{source}: {name}: corrupt quantisation entry in config.json (needs 'type', "
                                  f"one of {', '.join(TENSOR_TYPES)}, 'tensors' and 'attributes'); {_FIX}")
        kind = entry["type"]
        runs_on = TENSOR_TYPES[kind][1]
        if runs_on is not None and device.type != runs_on:
            raise CheckpointError(
                f"{source} holds {method} weights in torchao's {kind} layout, which runs on {runs_on} only, not "
                f"{device.type}: load it with device={runs_on!r} (--device {runs_on}), or load the unquantised "
                f"checkpoint on {device.type} and quantise it there (hybrid.quantize(model, {method!r}) or "
                f"--quantize {method})")
        classes[name] = _tensor_class(kind, method, source)
    return method, classes


def unflatten(section, classes: dict, state: dict[str, torch.Tensor], source: str, *,
              dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` as read from the safetensors file with every quantised weight's inner tensors wrapped back
    into its torchao type (``classes``, from :func:`check`); the plain tensors cast to ``dtype`` if given."""
    method = section["method"]
    state = dict(state)
    out = {}
    for name, entry in section["weights"].items():
        where = f"{source}: {name}"
        kwargs = {}
        for inner in entry["tensors"]:
            key = f"{name}.{inner}"
            if key not in state:
                raise CheckpointError(f"{where}: the weights file has no {key} (config.json lists it); {_FIX}")
            kwargs[inner] = state.pop(key)
        for attr, value in entry["attributes"].items():
            kwargs[attr] = _decode(value, f"{where}.{attr}")
        try:
            tensor = classes[name](**kwargs)
        except Exception as e:  # torchao's constructor: wrong or missing fields
            raise CheckpointError(f"{where}: cannot rebuild torchao {entry['type']} from the stored fields "
                                  f"({type(e).__name__}: {e}); {_FIX}") from None
        if dtype is not None and tensor.dtype != dtype:
            have = str(tensor.dtype).removeprefix("torch.")
            raise CheckpointError(
                f"{source} is {method}-quantised in {have}, and a quantised weight keeps the dtype it was "
                f"quantised in: load it with dtype=None (the checkpoint's) or {have!r} (--dtype {have}), or load "
                f"the unquantised checkpoint in {str(dtype).removeprefix('torch.')} and quantise it after")
        out[name] = tensor
    leftover = sorted(k for k in state if any(k.startswith(f"{n}.") for n in out))
    if leftover:
        raise CheckpointError(f"{source}: the weights file has inner tensors config.json does not list: "
                              f"{', '.join(leftover)}; {_FIX}")
    for k, v in state.items():  # the unquantised tensors, cast as from_pretrained(dtype=) casts a model
        out[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
    return out


def is_quantized(directory: Path) -> bool:
    """Whether a native checkpoint folder holds a quantised model: its config.json has our section, or its
    safetensors header says so (the config's section lost: :func:`load` names that)."""
    if CONFIG_KEY in read_json(directory / CONFIG_FILE):
        return True
    if not (directory / WEIGHTS_FILE).is_file():
        return False
    try:
        with safe_open(str(directory / WEIGHTS_FILE), "pt") as f:
            return CONFIG_KEY in (f.metadata() or {})
    except Exception:  # an unreadable file: the plain loader names what is wrong (config first, then weights)
        return False


def save(model, directory: str | Path) -> Path:
    """Write a quantised ``model`` to ``directory`` in our format (config.json + model.safetensors, as
    :func:`hybrid.checkpoint.save_native`), with its quantisation; everything is checked before writing."""
    state, section = flatten(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"format": FORMAT_TAG, **model.config.to_dict(), CONFIG_KEY: section}
    (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(directory / WEIGHTS_FILE),
              metadata={"format": "pt", "library": FORMAT_TAG, CONFIG_KEY: section["method"]})
    write_manifest(directory, [WEIGHTS_FILE])
    return directory


def load(directory: str | Path, *, dtype: torch.dtype | None = None, device=None,
         verify: bool = True) -> torch.nn.Module:
    """Load a quantised checkpoint folder: the model is built on the meta device and the stored int8 / packed
    int4 tensors become its weights as they are (no fp32 copy is made, nothing is quantised again)."""
    directory = Path(directory)
    model = empty_model(directory, verify=verify)  # checksums (where saved) before the file is opened
    source, path = str(directory), directory / WEIGHTS_FILE
    section = read_json(directory / CONFIG_FILE).get(CONFIG_KEY)
    check_safetensors(path)  # a damaged file is named before safetensors opens it
    with safe_open(str(path), "pt") as f:
        written = (f.metadata() or {}).get(CONFIG_KEY)
    if section is None:
        raise CheckpointError(f"{source}: its weights file is {written}-quantised but config.json has no "
                              f"{CONFIG_KEY!r} section (the torchao type and attributes of each weight); {_FIX}")
    device = torch.device(device if device is not None else "cpu")
    method, classes = check(section, source, device)
    if written is not None and written != method:
        raise CheckpointError(f"{source}: config.json says {method} but its weights file says {written}; {_FIX}")
    state = unflatten(section, classes, load_safetensors(path, device=str(device), verify=verify), source, dtype=dtype)
    if HEAD in state and model.lm_head is None:  # a tied model's quantised head (hybrid.quantize.quantized_head)
        from .quantize import quantized_head

        quantized_head(model, device="meta")
    load_state_strict(model, state, str(path))
    finish(model, list(section["weights"]), method)
    return model.eval()


def finish(model, quantized: list[str], method: str) -> None:
    """After ``load_state_dict(assign=True)``: the quantised weights do not require grad (as
    ``torchao.quantize_`` leaves them) and ``model.quantization`` says how the model was quantised."""
    for name in quantized:
        model.get_parameter(name).requires_grad_(False)
    model.quantization = method
