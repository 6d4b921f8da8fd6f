"""The CPU conversions of gathered K/V pages: every fp8 (e4m3) code -> its value bit for bit, and the decode
walk's reused-buffer gather equal to the plain tensor ops it replaces."""

import pytest
import torch
from hybrid.kernels import kv_quant, paged_attention
from hybrid.kernels.packing import with_host_values

ALL_CODES = torch.arange(256, dtype=torch.uint8).view(kv_quant.FP8)
FINITE = ~ALL_CODES.float().isnan()  # 0x7F and 0xFF: NaN, never written (quantize saturates)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32)


def test_fp8_codes_as_fp16_is_every_codes_value_exactly():
    values = kv_quant.fp8_codes_as_fp16(ALL_CODES).float() * kv_quant.FP8_AS_FP16_FACTOR
    assert torch.equal(_bits(values)[FINITE], _bits(ALL_CODES.float())[FINITE])  # -0, subnormals, 448 included


@pytest.mark.parametrize("repeat", [1, 4099])  # one of each code; and a length that leaves vector-loop tails
def test_fp8_codes_to_float_into_a_buffer_is_every_codes_value_exactly(repeat):
    codes = ALL_CODES.repeat(repeat)
    out = torch.full((codes.numel(),), float("nan"))
    kv_quant.fp8_codes_to_float_into(codes, out)
    ref = codes.float()
    finite = ~ref.isnan()
    assert torch.equal(_bits(out * kv_quant.FP8_AS_FP16_FACTOR)[finite], _bits(ref)[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, kv_quant.FP8])
def test_gather_pages_as_float_equals_index_select_then_convert(dtype):
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(9, 4, 2, 8, generator=g) * 50).clamp(-127, 127)
    pool = pool.round().to(dtype) if dtype == torch.int8 else pool.to(dtype)
    blocks = torch.tensor([3, 1, 8, 3, 0])
    want, want_factor = kv_quant.codes_to_float(pool.index_select(0, blocks))
    got, factor = kv_quant.gather_pages_as_float(pool, blocks, "k")
    assert factor == want_factor and torch.equal(got, want)
    again, _ = kv_quant.gather_pages_as_float(pool, blocks[:2], "k")  # the buffer is reused, smaller views fine
    assert torch.equal(again, want[:2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, kv_quant.FP8])
def test_decode_walk_through_buffers_equals_plain_tensor_ops(dtype, monkeypatch):
    """The eager CPU walk (pages into reused buffers) gives the same bits as the walk on fresh tensors (the
    path torch.compile and other devices take), over several column groups."""
    B, Hq, Hkv, D, BS, n = 6, 4, 2, 16, 4, 37
    g = torch.Generator().manual_seed(1)
    kf, vf = (torch.randn(B * 10 + 1, BS, Hkv, D, generator=g) for _ in "kv")
    if dtype in kv_quant.QUANTIZED:
        (kc, ks), (vc, vs) = (kv_quant.quantize_tokens(t.flatten(0, 1), dtype) for t in (kf, vf))
        k, v, ks, vs = kc.view(kf.shape), vc.view(vf.shape), ks.view(kf.shape[:3]), vs.view(vf.shape[:3])
    else:
        k, v, ks, vs = kf.to(dtype), vf.to(dtype), None, None
    tables = (torch.randperm(B * 10, generator=g) + 1).int().view(B, 10)
    lens = with_host_values(torch.tensor([n, 5, 40, 1, 22, 31], dtype=torch.int32), (n, 5, 40, 1, 22, 31))
    q = torch.randn(B, Hq, D, generator=g)
    monkeypatch.setattr(paged_attention, "DECODE_GROUP_BYTES", 3 * B * Hkv * D * 4 * BS)  # 3 blocks a group
    buffered = paged_attention._paged_decode_attention_torch(q, k, v, lens, tables, k_scale=ks, v_scale=vs)
    monkeypatch.setattr(paged_attention.kv_quant, "gather_pages_as_float",
                        lambda pool, flat, role: kv_quant.codes_to_float(pool.index_select(0, flat)))
    plain = paged_attention._paged_decode_attention_torch(q, k, v, lens, tables, k_scale=ks, v_scale=vs)
    assert torch.equal(buffered, plain)
    ref = paged_attention.paged_decode_attention_ref(q, k, v, lens, tables, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(buffered, ref, rtol=1e-5, atol=1e-5)
