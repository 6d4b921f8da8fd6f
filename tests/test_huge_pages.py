"""Decode weights on 2 MiB pages (kernels/host_memory.huge_page_weights, moved by the decode program on first
build): the values, shapes and sharing unchanged, the new memory madvised for huge pages (the kernel's
THPeligible flag on the mapping), nothing moved where it is switched off, and a model trained after it decoded."""

from __future__ import annotations

import pytest
import torch
from hybrid.kernels import host_memory, native

from hybrid import HybridLM, recipes

needs_thp = pytest.mark.skipif(host_memory.transparent_huge_pages() not in ("always", "madvise")
                               or host_memory._madvise() is None,
                               reason="no transparent huge pages on request here")


def thp_eligible(t: torch.Tensor) -> bool:
    """Whether the kernel may back the mapping holding t's first byte with huge pages (/proc/self/smaps)."""
    addr, vma = t.data_ptr(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                vma = lo <= addr < hi
            elif vma and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    raise AssertionError("no mapping holds the tensor")


@needs_thp
def test_moved_weights_keep_values_and_sharing_and_are_madvised(monkeypatch):
    monkeypatch.delenv(host_memory.HUGE_ENV, raising=False)
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(1030, 1021))  # 4 MiB and some: the mapping holds whole huge pages
    b = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False)
    whole = torch.randn(10, 10)
    view = torch.nn.Parameter(whole[2:])  # a view into a larger storage: stays where it is
    shared = torch.randn(8, 8)
    s1, s2 = torch.nn.Parameter(shared), torch.nn.Parameter(shared)  # one storage, two parameters: stays
    before = {n: (p.data.clone(), p.data_ptr()) for n, p in dict(a=a, b=b, view=view, s1=s1).items()}
    moved = host_memory.huge_page_weights([a, b, a, view, s1, s2])  # `a` twice: moved once
    assert moved == -(-1030 * 1021 * 4 // 4096) * 4096 + 64 * 64 * 2  # each at a 4 KiB boundary
    for name, p in dict(a=a, b=b).items():
        assert torch.equal(p.data, before[name][0]) and p.data_ptr() != before[name][1]
        assert p.data_ptr() % 4096 == 0 and p.is_contiguous()
        assert thp_eligible(p.data)
    assert a.requires_grad and not b.requires_grad
    assert view.data_ptr() == before["view"][1] and s1.data_ptr() == s2.data_ptr() == before["s1"][1]


@needs_thp
def test_a_buffer_born_on_huge_pages(monkeypatch):
    """huge_page_empty (the read-bandwidth probes' buffers): a writable tensor at a 2 MiB boundary in a madvised
    mapping that lives as long as the tensor; switched off, a plain tensor."""
    monkeypatch.delenv(host_memory.HUGE_ENV, raising=False)
    buf = host_memory.huge_page_empty(3 * 2**20 + 5, torch.int64).fill_(7)
    assert buf.shape == (3 * 2**20 + 5,) and buf.dtype == torch.int64 and int(buf.sum()) == 7 * buf.numel()
    assert buf.data_ptr() % (2 * 2**20) == 0 and thp_eligible(buf)
    monkeypatch.setenv(host_memory.HUGE_ENV, "0")
    plain = host_memory.huge_page_empty(1000, torch.float32)
    assert plain.shape == (1000,) and plain.dtype == torch.float32


def test_switched_off_moves_nothing(monkeypatch):
    monkeypatch.setenv(host_memory.HUGE_ENV, "0")
    p = torch.nn.Parameter(torch.randn(256, 256))
    ptr = p.data_ptr()
    assert host_memory.huge_page_weights([p]) == 0 and p.data_ptr() == ptr
    assert "off" in host_memory.huge_pages_note() or "0" in host_memory.huge_pages_note()


@needs_thp
@pytest.mark.skipif(native.available() is not None, reason="needs the native CPU decode kernels")
def test_decode_program_moves_the_streamed_weights_once_and_training_still_works(monkeypatch):
    """The first decode program moves every matrix the step streams (the tied LM head included, an untied
    embedding not); the tokens are the naive full-forward loop's; a second engine moves nothing again; and the
    moved weights are normal tensors: the model trains afterwards (inference tensors, made under the engine's
    inference mode, would refuse to be saved for backward)."""
    monkeypatch.delenv(host_memory.HUGE_ENV, raising=False)
    from test_engine import greedy_reference

    from hybrid.decode import program as decode_program

    torch.manual_seed(0)
    model = HybridLM(recipes.get("hybrid-1to7-tiny")).eval()
    prompt = [5, 9, 2, 7, 11, 3]
    ref, _ = greedy_reference(model, prompt, 12)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert greedy_tokens(model, prompt, 12) == ref
    assert getattr(model, decode_program._MOVED_ATTR) > 0
    big = {n for n, p in model.named_parameters() if p.dim() >= 2 and p.numel() * p.element_size() >= 65536
           and not (n == "embed.weight" and model.lm_head is not None)}
    assert big and all(model.get_parameter(n).data_ptr() != ptrs[n] for n in big)
    assert all(thp_eligible(model.get_parameter(n)) for n in big)
    again = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert greedy_tokens(model, prompt, 12) == ref  # a second engine: nothing moves again
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == again
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    model(ids).float().square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in big)


def greedy_tokens(model, prompt, n):
    from hybrid import Engine, SamplingParams

    engine = Engine(model, max_seqs=2, multi_step=4)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=n))
    return list(engine.run()[rid].output)


@needs_thp
def test_an_inference_tensor_stays_one_and_decodes_on(monkeypatch):
    """A model copied under inference mode has inference-tensor weights: the moved ones stay inference tensors, and
    the model decodes on under inference mode (a normal tensor swapped in under one broke its version counter at
    the next embedding lookup)."""
    import copy

    import hybrid

    monkeypatch.delenv(host_memory.HUGE_ENV, raising=False)
    torch.manual_seed(0)
    model = HybridLM(recipes.get("llama-tiny")).eval()
    with torch.inference_mode():
        copied = copy.deepcopy(model)
        p = torch.nn.Parameter(torch.randn(1030, 1021))
        assert host_memory.huge_page_weights([p]) > 0 and p.is_inference() and p.data.is_inference()
        assert torch.nn.functional.embedding(torch.tensor([1]), p).shape == (1, 1021)  # (the broken counter's error)
        big = [n for n, t in copied.named_parameters() if t.dim() >= 2 and t.numel() * t.element_size() >= 65536]
        first = hybrid.generate(copied, [[1, 2, 3]] * 2, max_new_tokens=4, ignore_eos=True, max_seqs=2)
        assert not big or copied._hybrid_huge_page_bytes > 0
        assert all(copied.get_parameter(n).is_inference() for n in big)
        assert hybrid.generate(copied, [[1, 2, 3]] * 2, max_new_tokens=4, ignore_eos=True, max_seqs=2) == first
