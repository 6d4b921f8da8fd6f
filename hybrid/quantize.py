"""Quantisation of a model's linear layers through torchao (the PyTorch library for it). Weight-only:
``hybrid.quantize(model, "int8wo")`` — int8 codes with one fp32 scale per output row (torchao's
``Int8WeightOnlyConfig``), ``"int4wo"`` — int4 in groups of 128 (torchao's ``Int4WeightOnlyConfig`` in its
tinygemm layout on CUDA; on a CPU torchao's ``PrototypeInt4WeightOnlyConfig``, the ``Int4OpaqueTensor``
packed for aten's ``_weight_int4pack_mm_for_cpu``: torchao 0.18's stable int4 formats do not run on a CPU —
``plain`` needs mslk, ``plain_int32`` refuses the device). The CPU kernel takes groups of 32, 64 or 128 only,
so a layer whose input width no group divides (or whose output width is not a multiple of 16) keeps its dtype.
Decode is the bytes of the weights: int8 reads a quarter of fp32's.

With int8 *activations* too (another numerics, so other methods: each computes the same in prefill and decode):
``"int8dq"`` — torchao's ``Int8DynamicActivationInt8WeightConfig`` (an ``Int8Tensor``: int8 codes per output row,
symmetric, and each input row quantised to int8 symmetrically on the fly; the product is an integer matmul),
``"8da4w"`` — torchao's ``Int8DynamicActivationIntxWeightConfig`` with int4 weights in symmetric groups of 32
(an ``IntxUnpackedToInt8Tensor``: the int4 values unpacked in int8 [N, K], a scale per group) and each input row
quantised to int8 asymmetrically per token. A layer whose input width 32 does not divide keeps its dtype
(8da4w). The decode products of both are ours (integer dot products, kernels/native/int8_activation.c, llama.cpp's
Q8_0 / Q4_0 arithmetic on torchao's quantisation); prefill keeps torchao's computation.

torchao's int8 tensor computes through its own ``__torch_dispatch__`` (tens of microseconds of Python per call at
batch 1); :class:`hybrid.layers.linear.Linear` hands its codes and row scales to the native matrix-vector
product instead (``kernels.linear(..., scale=)``), which reads the codes once at the memory bandwidth. Prefill
(many rows) keeps torchao's kernels.

The LM head is quantised too. An untied head is one of the linear layers; a head tied to the embedding gets a
quantised copy of the embedding's matrix as its own ``lm_head`` (:func:`quantized_head`), and the embedding keeps
its dtype for the lookup (a step reads one row of it per token, while the head reads all of it: for SmolLM2-135M
the fp32 tied head was 113 MB of a quantised step's 178-220 MB). The copy is quantised in 8 bits
(:data:`TIED_HEAD_METHOD`: int8wo's / int8dq's own, int8wo for int4wo, int8dq for 8da4w).
``config.tie_embeddings`` stays true (both are the same matrix, the head at 8 bits); the quantised checkpoint
stores the head with the other quantised weights (:mod:`hybrid.quantized_checkpoint`).
"""

from __future__ import annotations

import torch

METHODS = ("int8wo", "int4wo", "int8dq", "8da4w")


def quantize(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """Quantise ``model``'s linear layers in place with torchao's weight-only ``method`` (see :data:`METHODS`);
    returns the model. A model already quantised with ``method`` is returned as it is; with another method,
    refused. ``save_pretrained`` keeps the quantisation (:mod:`hybrid.quantized_checkpoint`)."""
    if method not in METHODS:
        raise ValueError(f"unknown quantisation {method!r}; choose one of {', '.join(METHODS)}")
    done = getattr(model, "quantization", None)
    if done == method:  # e.g. loaded from a quantised checkpoint: quantising again would change nothing
        return model
    if done is not None:
        raise ValueError(f"the model is already {done}-quantised; quantise the unquantised model as {method} "
                         "instead")
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        raise ImportError(f"quantize({method!r}) needs torchao: pip install torchao ({e})") from None
    device = next(model.parameters()).device
    if method == "int4wo" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantize('int4wo') on {device.type}: torchao's int4 weight-only formats run on "
                         "CUDA and CPU only")
    head_method = TIED_HEAD_METHOD[method]
    untied = head_method == method and quantized_head(model)  # an 8-bit method: the head goes with the layers
    if method in ("int8dq", "8da4w"):
        _dynamic_activation(model, method, quantize_)
    elif method == "int4wo" and device.type == "cpu":
        _int4_cpu(model, quantize_)
    else:
        config = Int8WeightOnlyConfig() if method == "int8wo" else \
            Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
        with torch.no_grad():
            quantize_(model, config)
    if head_method != method and quantized_head(model):  # a 4-bit method: the tied head alone, in 8 bits
        untied = True
        head = torch.nn.Sequential(model.lm_head)  # (quantize_ swaps the weight of the same Linear)
        if head_method == "int8dq":
            _dynamic_activation(head, head_method, quantize_)
        else:
            with torch.no_grad():
                quantize_(head, Int8WeightOnlyConfig())
    if untied and _is_plain(model.lm_head.weight):  # the head's method did not take it: tied again, no copy
        model.lm_head = None
    model.quantization = method
    return model


# The quantisation of a tied head's copy (quantized_head) per method: the 8-bit methods' own; 8 bits for the 4-bit
# ones, as llama.cpp keeps output.weight above 4 bits (Q6_K) for its 4-bit types. Measured on SmolLM2-135M
# (54 tokens of prose, against the fp32 model): int4 heads took the next-token agreement from 0.648 to 0.556
# (int4wo) and 0.611 to 0.537 (8da4w); an int8 head costs int8wo / int8dq 0.000 of it. An untied head keeps the
# method's quantisation (it is one of the model's linear layers, as before).
TIED_HEAD_METHOD = {"int8wo": "int8wo", "int8dq": "int8dq", "int4wo": "int8wo", "8da4w": "int8dq"}


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def quantized_head(model: torch.nn.Module, *, device: torch.device | str | None = None) -> bool:
    """Give a model whose LM head is its embedding (``lm_head`` None, ``config.tie_embeddings``) a head of its own,
    a copy of the embedding's matrix (on the meta device with ``device="meta"``: a quantised checkpoint's loader
    then assigns the stored head), for the quantisation to quantise; the embedding is left as it is. Returns
    whether a head was added (False: the model has one)."""
    if getattr(model, "lm_head", False) is not None:
        return False
    return model.untie_head(meta=str(device) == "meta")


def _int4_cpu(model: torch.nn.Module, quantize_) -> None:
    """int4 weight-only on a CPU through torchao's prototype opaque format: each linear layer in the largest
    group (128, 64, 32) that divides its input width; a layer none divides keeps its dtype. The CPU kernel
    computes in bfloat16, so the quantised layers' activations are cast there and back."""
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    def fits(group):
        def check(module, _fqn):
            w = getattr(module, "weight", None)
            return (isinstance(module, torch.nn.Linear) and w is not None and w.dim() == 2
                    and type(w) in (torch.Tensor, torch.nn.Parameter) and w.shape[1] % group == 0
                    and w.shape[0] % 16 == 0)
        return check

    with torch.no_grad():
        for group in (128, 64, 32):
            quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False),
                      filter_fn=fits(group))


def _dynamic_activation(model: torch.nn.Module, method: str, quantize_) -> None:
    """int8dq / 8da4w through torchao's configs (see the module's docstring). No Inductor settings are changed
    (``set_inductor_config=False``: a library call must not reconfigure the process's compiler)."""
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig,
        MappingType,
        PerGroup,
    )

    def plain_linear(module, _fqn, group=1):
        w = getattr(module, "weight", None)
        return (isinstance(module, torch.nn.Linear) and w is not None and w.dim() == 2
                and type(w) in (torch.Tensor, torch.nn.Parameter) and w.shape[1] % group == 0)

    with torch.no_grad():
        if method == "int8dq":
            quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False), filter_fn=plain_linear)
        else:
            quantize_(model, Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_mapping_type=MappingType.SYMMETRIC),
                filter_fn=lambda m, f: plain_linear(m, f, 32))


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes [N, K], fp32 row scales [N]) of a torchao int8 weight-only tensor, or None for any other
    weight (an int8dq one among them: its activations are quantised too, :func:`int8dq_rows`)."""
    if getattr(weight, "act_quant_kwargs", None) is not None or getattr(weight, "act_pre_scale", None) is not None:
        return None
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if qdata is None or scale is None or qdata.dtype != torch.int8 or qdata.dim() != 2 \
            or scale.numel() != qdata.shape[0] or getattr(weight, "block_size", None) not in ([1, qdata.shape[1]],
                                                                                             (1, qdata.shape[1])):
        return None
    if getattr(weight, "zero_point", None) is not None and bool(weight.zero_point.any()):
        return None
    return qdata, scale.reshape(-1).float()


def int4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(uint8 codes [N, K/2] in aten's int4pack layout, scale_and_zero [K/group, N, 2], group) of torchao's CPU
    int4 weight-only tensor (``Int4OpaqueTensor``, its tinygemm path: w = (q - 8) * scale + zero, see
    docs/notes/int4-cpu-layout.md), or None for any other weight (its int8-activation variant among them)."""
    if type(weight).__name__ != "Int4OpaqueTensor":
        return None
    qdata, sz, block = getattr(weight, "qdata", None), getattr(weight, "scale_and_zero", None), \
        getattr(weight, "block_size", None)
    if qdata is None or sz is None or block is None or getattr(weight, "act_mapping_type", None) is not None \
            or getattr(weight, "act_pre_scale", None) is not None or len(block) != 2 or block[0] != 1:
        return None
    N, K, group = weight.shape[0], weight.shape[1], int(block[1])
    if qdata.dtype != torch.uint8 or tuple(qdata.shape) != (N, K // 2) or sz.dim() != 3 \
            or tuple(sz.shape) != (K // group, N, 2) or K % group:
        return None
    return qdata, sz, group


def int8dq_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes [N, K], fp32 row scales [N]) of torchao's int8dq tensor (``Int8Tensor`` with per-row symmetric
    weights and per-row symmetric dynamic int8 activations, no static activation scale, no pre-scale), or None
    for any other weight."""
    kw = getattr(weight, "act_quant_kwargs", None)
    if type(weight).__name__ != "Int8Tensor" or kw is None or getattr(weight, "act_pre_scale", None) is not None \
            or getattr(weight, "act_quant_scale", None) is not None or getattr(kw, "reduce_range", False) \
            or getattr(weight, "reduce_range", False) or type(kw.granularity).__name__ != "PerRow" \
            or getattr(kw.mapping_type, "name", None) != "SYMMETRIC":
        return None
    qdata, scale = weight.qdata, weight.scale
    if qdata.dtype != torch.int8 or qdata.dim() != 2 or scale.numel() != qdata.shape[0] \
            or list(weight.block_size) != [1, qdata.shape[1]] or scale.dtype != torch.float32:
        return None
    if weight.zero_point is not None and bool(weight.zero_point.any()):
        return None
    return qdata, scale.reshape(-1)


GROUP_8DA4W = 32  # the group of 8da4w's int4 weights (the native kernel's nibble blocks)


def w4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int4 values unpacked in int8 [N, K] in -8..7, per-group scales [N, K/32] fp32/bf16) of torchao's 8da4w
    tensor (``IntxUnpackedToInt8Tensor``: int4, symmetric groups of 32, zero points 0, int8 asymmetric per-token
    activations), or None for any other weight."""
    if type(weight).__name__ != "IntxUnpackedToInt8Tensor" or weight.target_dtype != torch.int4 \
            or str(getattr(weight.activation_quantization, "value", weight.activation_quantization)) \
            != "int8_asym_per_token" or tuple(weight.block_size) != (1, GROUP_8DA4W):
        return None
    qdata, scale, zp = weight.qdata, weight.scale, weight.zero_point
    N, K = weight.shape
    if qdata.dtype != torch.int8 or tuple(qdata.shape) != (N, K) or tuple(scale.shape) != (N, K // GROUP_8DA4W) \
            or scale.dtype not in (torch.float32, torch.bfloat16) or (zp is not None and bool(zp.any())):
        return None
    return qdata, scale


def decode_bytes(weight: torch.Tensor) -> int:
    """Bytes a decode product reads of ``weight``: a torchao int8 / int4 / int8-activation weight's codes and scales
    (such a tensor reports its dtype's element size, not theirs), else the tensor's own bytes."""
    rows = int8_rows(weight)
    parts = rows if rows is not None else (int4_blocks(weight) or (None, None))[:2]
    if parts[0] is None:
        q = q_operands(weight)
        parts = q[1:3] if q is not None else (weight,)
    return sum(t.numel() * t.element_size() for t in parts)


def q_operands(weight: torch.Tensor) -> tuple | None:
    """(kind, w, ws, values) for :func:`hybrid.kernels.projection.linear_q` of an int8dq or 8da4w weight,
    or None for any other. Worked out once and kept on the weight (a decode step asks for every layer's; 8da4w's
    nibbles are packed then), again when its codes or scales change."""
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if qdata is None or scale is None:
        return None
    key = (qdata.data_ptr(), qdata._version, scale.data_ptr(), scale._version)
    cached = weight.__dict__.get("_hybrid_q")
    if cached is not None and cached[0] == key:
        return cached[1]
    from .kernels import projection

    rows = int8dq_rows(weight)
    groups = w4_groups(weight) if rows is None else None
    if rows is not None:
        ops = (projection.QK_I8DQ, rows[0].contiguous(), rows[1].float().contiguous(), None)
    elif groups is not None:
        ops = (projection.QK_8DA4W, *projection.pack_8da4w(*groups), groups[0])
    else:
        ops = None
    weight._hybrid_q = (key, ops)
    return ops
