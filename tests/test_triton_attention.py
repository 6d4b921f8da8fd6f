"""Triton flash attention (packed, paged, batched) and split paged decode against the references."""

import pytest
import torch
from conftest import rel_err
from hybrid.kernels import use_backend
from hybrid.kernels.paged_attention import paged_decode_attention_triton
from triton_cases import DEVICE, TOL, needs_triton

from hybrid import kernels

pytestmark = needs_triton


def _qkv(T, Hq, Hkv, D, dtype, Tk=None):
    Tk = T if Tk is None else Tk
    return (torch.randn(T, Hq, D, device=DEVICE).to(dtype), torch.randn(Tk, Hkv, D, device=DEVICE).to(dtype),
            torch.randn(Tk, Hkv, D, device=DEVICE).to(dtype))


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _pool(lens, block_size, Hkv, D, dtype):
    """Random pools and block tables with each sequence's blocks scattered (a shuffled free list)."""
    per_seq = [-(-n // block_size) for n in lens]
    nblocks = sum(per_seq) + 3
    order = torch.randperm(nblocks, device=DEVICE).int()
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    k_pool = torch.randn(nblocks, block_size, Hkv, D, device=DEVICE).to(dtype)
    v_pool = torch.randn(nblocks, block_size, Hkv, D, device=DEVICE).to(dtype)
    return k_pool, v_pool, tables


# Odd lengths, the three head dims, GQA 1/4/8, window on/off and both dtypes, without the full cross product.
@pytest.mark.parametrize("lens,Hq,Hkv,D,window,dtype", [
    ([63], 4, 4, 64, None, torch.float32),
    ([65, 63, 1], 4, 1, 80, None, torch.float32),
    ([257], 8, 1, 128, 64, torch.float32),
    ([63, 65], 8, 2, 80, 16, torch.float16),
    ([257, 3], 4, 1, 64, None, torch.float16),
])
def test_varlen_matches_reference(lens, Hq, Hkv, D, window, dtype):
    q, k, v = _qkv(sum(lens), Hq, Hkv, D, dtype)
    cu = _cu(lens)
    ref = kernels.varlen_attention_ref(q, k, v, cu, window=window)
    with use_backend("triton"):
        out = kernels.varlen_attention(q, k, v, cu, window=window)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_packed_equals_each_sequence_alone():
    lens = [65, 7, 63]
    q, k, v = _qkv(sum(lens), 4, 2, 64, torch.float32)
    cu = _cu(lens)
    with use_backend("triton"):
        packed = kernels.varlen_attention(q, k, v, cu, window=32)
        for b in range(len(lens)):
            s = slice(int(cu[b]), int(cu[b + 1]))
            alone = kernels.varlen_attention(q[s], k[s], v[s], _cu([lens[b]]), window=32)
            assert torch.equal(packed[s], alone)  # the same programs, the same arithmetic


@pytest.mark.parametrize("Lq,Lk,window,dtype", [(63, 63, None, torch.float32), (65, 100, 17, torch.float16)])
def test_batched_causal_attention(Lq, Lk, window, dtype):
    """The batched op (training/scoring layout) flattened onto the packed kernel; Lq < Lk is prefill on a cache."""
    q = torch.randn(2, Lq, 8, 80, device=DEVICE).to(dtype)
    k, v = (torch.randn(2, Lk, 2, 80, device=DEVICE).to(dtype) for _ in range(2))
    ref = kernels.causal_attention_ref(q, k, v, window=window)
    with use_backend("triton"):
        out = kernels.causal_attention(q, k, v, window=window)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("block_size,window,dtype", [(16, None, torch.float32), (5, 24, torch.float32),
                                                     (32, None, torch.float16)])
def test_paged_prefill_equals_contiguous(block_size, window, dtype):
    """Whole prompts read from a scattered paged pool give what the contiguous kernel gives."""
    lens, Hq, Hkv, D = [63, 65, 2], 4, 1, 64
    q, k, v = _qkv(sum(lens), Hq, Hkv, D, dtype)
    cu = _cu(lens)
    k_pool, v_pool, tables = _pool(lens, block_size, Hkv, D, dtype)
    slots = torch.cat([tables[b, torch.arange(n, device=DEVICE) // block_size].long() * block_size
                       + torch.arange(n, device=DEVICE) % block_size for b, n in enumerate(lens)])
    kernels.write_kv(k_pool, v_pool, k, v, slots)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with use_backend("triton"):
        paged = kernels.paged_prefill_attention(q, k_pool, v_pool, cu, seq_lens, tables, window=window)
        contiguous = kernels.varlen_attention(q, k, v, cu, window=window)
    assert rel_err(paged, contiguous) < TOL[dtype]


@pytest.mark.parametrize("window", [None, 20])
def test_chunked_prefill_equals_whole(window):
    """A prompt prefilled in chunks on top of its own cache equals one whole prefill, and both match the reference."""
    L, Hq, Hkv, D, bs = 65, 8, 1, 80, 16
    q, k, v = _qkv(L, Hq, Hkv, D, torch.float32)
    k_pool, v_pool, tables = _pool([L], bs, Hkv, D, torch.float32)
    slots = tables[0, torch.arange(L, device=DEVICE) // bs].long() * bs + torch.arange(L, device=DEVICE) % bs
    kernels.write_kv(k_pool, v_pool, k, v, slots)
    with use_backend("triton"):
        whole = kernels.varlen_attention(q, k, v, _cu([L]), window=window)
        chunks, done = [], 0
        for n in (30, 1, 34):  # the pool holds the whole prompt; seq_lens says how much is visible
            seen = torch.tensor([done + n], dtype=torch.int32, device=DEVICE)
            chunks.append(kernels.paged_prefill_attention(q[done:done + n], k_pool, v_pool, _cu([n]), seen, tables,
                                                          window=window))
            done += n
    assert rel_err(torch.cat(chunks), whole) < TOL[torch.float32]
    assert rel_err(whole, kernels.varlen_attention_ref(q, k, v, _cu([L]), window=window)) < TOL[torch.float32]


@pytest.mark.parametrize("lens,Hq,Hkv,D,window,splits,dtype", [
    ([257, 1, 63], 8, 1, 128, None, None, torch.float32),
    ([65, 300], 4, 4, 80, 40, 3, torch.float32),
    ([257, 65], 8, 2, 64, None, 7, torch.float16),
])
def test_decode_matches_reference(lens, Hq, Hkv, D, window, splits, dtype):
    k_pool, v_pool, tables = _pool(lens, 16, Hkv, D, dtype)
    q = torch.randn(len(lens), Hq, D, device=DEVICE).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ref = kernels.paged_decode_attention_ref(q, k_pool, v_pool, seq_lens, tables, window=window)
    out = paged_decode_attention_triton(q, k_pool, v_pool, seq_lens, tables, window=window, num_splits=splits)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_equals_prefill_last_token():
    """Split decode (several splits merged) equals the flash kernel's answer for the same last token."""
    lens, Hq, Hkv, D = [257, 65], 8, 2, 64
    k_pool, v_pool, tables = _pool(lens, 16, Hkv, D, torch.float32)
    q = torch.randn(2, Hq, D, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with use_backend("triton"):
        decode = kernels.paged_decode_attention(q, k_pool, v_pool, seq_lens, tables)
        prefill = kernels.paged_prefill_attention(q, k_pool, v_pool, _cu([1, 1]), seq_lens, tables)
    assert rel_err(decode, prefill) < TOL[torch.float32]


def test_training_falls_back_to_torch_under_autograd():
    """The kernels are forward-only: with requires_grad inputs the op runs the torch path and has gradients."""
    q = torch.randn(1, 9, 2, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 9, 1, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    with use_backend("triton"):
        out = kernels.causal_attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None and rel_err(out.detach(), kernels.causal_attention_ref(q, k, v).detach()) < 1e-5
