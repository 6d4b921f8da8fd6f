"""The torch decode-attention paths over long, uneven histories: the batched block walk (several
column groups of 1024 tokens) and the per-sequence path for a few sequences."""

import pytest
import torch
from conftest import rel_err
from hybrid.kernels import paged_attention

from hybrid import kernels


@pytest.mark.parametrize("group_bytes", [4 << 20, 1], ids=["default-groups", "one-block-groups"])
@pytest.mark.parametrize("lens", [[1500, 3, 1030, 17, 700, 1], [1500, 3]], ids=["batched-walk", "few-sequences"])
@pytest.mark.parametrize("window", [None, 700])
def test_decode_attention_over_many_block_groups_equals_reference(window, lens, group_bytes, monkeypatch):
    monkeypatch.setattr(paged_attention, "DECODE_GROUP_BYTES", group_bytes)  # 1: every block its own group
    bs, Hq, Hkv, D = 16, 4, 2, 8
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    k_pool, v_pool = torch.randn(num_blocks, bs, Hkv, D), torch.randn(num_blocks, bs, Hkv, D)
    order = torch.randperm(num_blocks).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        tables[b, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(len(lens), Hq, D)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = kernels.paged_decode_attention(q, k_pool, v_pool, seq_lens, tables, window=window)
    ref = kernels.paged_decode_attention_ref(q, k_pool, v_pool, seq_lens, tables, window=window)
    assert rel_err(out, ref) < 1e-5
