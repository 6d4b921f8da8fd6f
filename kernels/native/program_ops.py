"""The decode program's ops (kernels/native/program.c's HlOp), defined once for both sides: each op kind's code and
the names of its pointer, integer and float fields, in slot order. The C side gets a generated header (:func:`header`,
compiled at the top of the library's translation unit: ``enum { OP_GEMV = 1, ... }`` and one index constant per
field, ``P_GEMV_w``, ``I_GEMV_N``, ``F_PAGED_scale``), which program.c's ``run_op`` reads fields by (``OPP(GEMV, w)``);
the Python side packs an op by field name (:func:`pack_slots`, hybrid/decode/builder.py and each layer's
lower_decode). A field one side
names that the table lacks fails to compile (C) or is refused (Python); tests/test_native_program_ops.py checks that
run_op reads every field of the table and only those. Standard library only (setup.py compiles the library before
torch can be imported).

Field names follow the C kernels' parameter names (``wdt``: a weight's dtype code, ``res``: the residual added in
the same pass, ``act1``: the activation code plus one, 0 for none; ``qkind``: int8dq or 8da4w).
"""

from __future__ import annotations

from dataclasses import dataclass

PTRS, INTS, FLOATS = 14, 14, 2  # HlOp's slots: p[PTRS], i[INTS], f[FLOATS]


@dataclass(frozen=True)
class Op:
    name: str
    code: int
    ptrs: tuple[str, ...]
    ints: tuple[str, ...]
    floats: tuple[str, ...] = ()


OPS = (
    Op("RMSNORM", 0, ("x", "w", "y"), ("xdt", "wdt", "d"), ("eps",)),
    Op("GEMV", 1, ("w", "scale", "bias", "x", "res", "y"), ("wdt", "bdt", "xdt", "ydt", "N", "K", "act1")),
    Op("GATED_UP", 2, ("wg", "sg", "bg", "wu", "su", "bu", "x", "y"), ("wdt", "bdt", "xdt", "act", "N", "K")),
    Op("QKV_ROPE", 3, ("wq", "bq", "wk", "bk", "wv", "bv", "sq", "sk", "sv", "x", "q_out", "kpool", "vpool"),
       ("wdt", "bdt", "xdt", "pdt", "rot", "Hq", "Hkv", "D", "K")),
    Op("PAGED", 4, ("q", "k", "v", "out"), ("qdt", "kvdt", "Hq", "Hkv", "D", "BS", "window"), ("scale",)),
    Op("CONV", 5, ("state", "x", "w", "bias", "y"), ("sdt", "xdt", "xs", "wdt", "bdt", "silu", "C", "K")),
    Op("DT", 6, ("dt_raw", "dt_bias", "A_log", "dt_out", "A_out"), ("xdt", "dts", "bdt", "adt", "clamp", "H"),
       ("lo", "hi")),
    Op("SSD", 7, ("state", "x", "dt", "A", "B", "C", "Dp", "y"),
       ("sdt", "xdt", "xs", "dts", "bs", "cs", "ddt", "H", "P", "N", "G")),
    Op("GATED_RMSNORM", 8, ("y", "z", "w", "out"), ("zs", "dt", "wdt", "groups", "norm_before_gate", "d"), ("eps",)),
    Op("GEMV_INT4", 9, ("q", "sz", "bias", "x", "res", "y"), ("sdt", "G", "bdt", "xdt", "ydt", "N", "K", "act1", "bn")),
    Op("GATED_UP_INT4", 10, ("qg", "szg", "bg", "qu", "szu", "bu", "x", "y"),
       ("sdt", "G", "bdt", "xdt", "act", "N", "K", "bn")),
    Op("QKV_ROPE_INT4", 11, ("qq", "szq", "bq", "qk", "szk", "bk", "qv", "szv", "bv", "x", "q_out", "kpool", "vpool"),
       ("sdt", "G", "bdt", "xdt", "pdt", "rot", "Hq", "Hkv", "D", "K", "bn")),
    # int8 activations (int8dq / 8da4w weights, int8_activation.c's products); 15 is free
    Op("GEMV_Q", 12, ("w", "ws", "bias", "x", "res", "y"), ("qkind", "bdt", "xdt", "ydt", "N", "K", "act1")),
    Op("QKV_ROPE_Q", 13, ("wq", "sq", "bq", "wk", "sk", "bk", "wv", "sv", "bv", "x", "q_out", "kpool", "vpool"),
       ("qkind", "bdt", "xdt", "pdt", "rot", "Hq", "Hkv", "D", "K")),
    Op("GATED_UP_Q", 14, ("wg", "sg", "bg", "wu", "su", "bu", "x", "y"), ("qkind", "bdt", "xdt", "act", "N", "K")),
    # linear-attention mixers (linear_attention.c)
    Op("GDN", 16, ("state", "qkv", "ba", "A_log", "dt_bias", "qk", "g", "beta", "y"),
       ("sdt", "xdt", "qkv_s", "ba_s", "adt", "bdt", "H", "Hk", "K", "V"), ("eps", "scale")),
    Op("HEAD_NORM", 17, ("y", "z", "w", "out"), ("ys", "zs", "dt", "wdt", "gated", "H", "V"), ("eps",)),
    Op("GLA", 18, ("state", "qkv", "low", "low_buf", "w", "wscale", "bias", "gk", "g", "y"),
       ("sdt", "xdt", "qkv_s", "low_s", "wdt", "bdt", "R", "H", "Hkv", "K", "V", "clamp"),
       ("normalizer", "clamp_min")),
)
BY_NAME = {op.name: op for op in OPS}
BY_CODE = {op.code: op for op in OPS}


def header() -> str:
    """The C side of the table: the op codes and every field's slot index, for program.c."""
    lines = ["/* generated from kernels/native/program_ops.py: the decode program's op kinds and their fields */",
             f"#define HL_OP_PTRS {PTRS}", f"#define HL_OP_INTS {INTS}", f"#define HL_OP_FLOATS {FLOATS}",
             "enum {"]
    lines += [f"    OP_{op.name} = {op.code}," for op in OPS]
    lines.append("};")
    for op in OPS:
        fields = [f"P_{op.name}_{f} = {k}" for k, f in enumerate(op.ptrs)]
        fields += [f"I_{op.name}_{f} = {k}" for k, f in enumerate(op.ints)]
        fields += [f"F_{op.name}_{f} = {k}" for k, f in enumerate(op.floats)]
        lines.append(f"enum {{ {', '.join(fields)} }};")
    return "\n".join(lines) + "\n"


def pack_slots(op: Op, fields: dict) -> tuple[list, list, list]:
    """(pointer values, integer values, float values) of ``fields`` in ``op``'s slot order: every field of the op
    named exactly once (a pointer field may be None); ValueError naming what is missing or unknown."""
    want = (*op.ptrs, *op.ints, *op.floats)
    missing, unknown = [f for f in want if f not in fields], [f for f in fields if f not in want]
    if missing or unknown:
        raise ValueError(f"decode program op {op.name}: " + "; ".join(
            part for part in (f"missing fields {', '.join(missing)}" if missing else "",
                              f"unknown fields {', '.join(unknown)}" if unknown else "") if part)
            + f" (its fields: {', '.join(want)}; kernels/native/program_ops.py)")
    return [fields[f] for f in op.ptrs], [fields[f] for f in op.ints], [fields[f] for f in op.floats]


def _check_table() -> None:
    codes = [op.code for op in OPS]
    assert len(set(codes)) == len(codes), "two ops share a code"
    for op in OPS:
        assert len(op.ptrs) <= PTRS and len(op.ints) <= INTS and len(op.floats) <= FLOATS, op.name
        names = (*op.ptrs, *op.ints, *op.floats)
        assert len(set(names)) == len(names), f"{op.name}: a field named twice"


_check_table()
