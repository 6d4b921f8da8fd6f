"""The decode program's op fields (kernels/native/program_ops.py) agree between the C reader (program.c's run_op) and
the Python writers (hybrid/decode/builder.py and each layer's lower_decode): both name fields from the one table,
run_op reads every field of every op once, and an op packed with a missing or unknown field is refused."""

from __future__ import annotations

import re

import pytest
from hybrid.kernels.native import program_ops, variants

RUN_OP = re.compile(r"static int run_op\(.*?\n}\n", re.S)
CASE = re.compile(r"case OP_(\w+):(.*?)(?=case OP_|default:)", re.S)
FIELD = re.compile(r"\b(PF|IF|FF)\((\w+), (\w+)\)")


def _reads() -> dict[str, list[tuple[str, str]]]:
    """Per op name, the (kind, field) reads of its case in run_op, in order."""
    body = RUN_OP.search((variants.HERE / "program.c").read_text()).group(0)
    out = {}
    for name, case in CASE.findall(body):
        reads = FIELD.findall(case)
        assert all(op == name for _, op, _ in reads), f"case OP_{name} reads another op's fields: {reads}"
        out[name] = [(kind, field) for kind, _, field in reads]
    return out


def test_run_op_reads_every_field_of_the_table_once():
    reads = _reads()
    assert set(reads) == set(program_ops.BY_NAME), "an op run_op has no case for, or a case the table lacks"
    for op in program_ops.OPS:
        got = reads[op.name]
        want = [("PF", f) for f in op.ptrs] + [("IF", f) for f in op.ints] + [("FF", f) for f in op.floats]
        assert sorted(got) == sorted(want), f"OP_{op.name}: run_op reads {got}, the table has {want}"


def test_the_library_is_compiled_with_the_tables_header():
    """The build writes the table's header (variants.generated: into the build directory, never a file in the source
    tree to edit by hand) and program.c includes it."""
    header = program_ops.header()
    assert variants.generated() == {variants.GENERATED: header}
    assert not (variants.HERE / variants.GENERATED).exists()
    assert f'#include "{variants.GENERATED}"' in (variants.HERE / "program.c").read_text()
    for op in program_ops.OPS:
        assert f"OP_{op.name} = {op.code}," in header
        for k, f in enumerate(op.ptrs):
            assert f"P_{op.name}_{f} = {k}" in header


def test_an_op_with_a_missing_or_unknown_field_is_refused():
    op = program_ops.BY_NAME["RMSNORM"]
    ptrs, ints, floats = program_ops.pack_slots(op, dict(x=1, w=2, y=3, xdt=0, wdt=1, d=64, eps=1e-5))
    assert (ptrs, ints, floats) == ([1, 2, 3], [0, 1, 64], [1e-5])
    with pytest.raises(ValueError, match="RMSNORM: missing fields eps"):
        program_ops.pack_slots(op, dict(x=1, w=2, y=3, xdt=0, wdt=1, d=64))
    with pytest.raises(ValueError, match="unknown fields width"):
        program_ops.pack_slots(op, dict(x=1, w=2, y=3, xdt=0, wdt=1, d=64, eps=1e-5, width=3))


def test_the_builder_names_only_the_tables_fields():
    """Every b.op(...) / self.op(...) call of the program's writers (the builder, the program and each layer's
    lower_decode) names an op of the table, and each keyword it passes is one of that op's fields (the rest come
    from a dict the call spreads, checked when it runs)."""
    from pathlib import Path

    import hybrid

    root = Path(hybrid.__file__).parent
    files = [*sorted((root / "decode").glob("*.py")), *sorted((root / "layers").glob("*.py"))]
    src = "\n".join(f.read_text() for f in files)
    calls = re.findall(r'\.op\(\s*"(\w+)",(.*?)\)\n', src, re.S)
    assert len(calls) >= 15
    for name, args in calls:
        assert name in program_ops.BY_NAME, name
        op = program_ops.BY_NAME[name]
        for kw in re.findall(r"\b(\w+)=", args):
            assert kw in (*op.ptrs, *op.ints, *op.floats), f"{name}: {kw}"
