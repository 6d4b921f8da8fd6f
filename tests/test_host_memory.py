"""Keeping freed host memory (kernels/host_memory.py): a large block freed and allocated again is reused,
already mapped, instead of being page-faulted in anew."""

import resource

import pytest
import torch
from hybrid.kernels import host_memory

pytestmark = pytest.mark.skipif(host_memory.available() is not None, reason="needs glibc's mallopt")

MB64 = 64 * 2**20 // 4  # fp32 elements: above glibc's largest mmap threshold (32 MiB)


def _faults_of_fresh_block() -> int:
    """Minor page faults of allocating and filling a 64 MiB block right after one was freed."""
    x = torch.empty(MB64)
    x.fill_(1.0)
    del x
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = torch.empty(MB64)
    y.fill_(2.0)
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del y
    return f1 - f0


def test_kept_memory_is_reused_without_page_faults():
    try:
        assert host_memory.keep_freed_memory(False, respect_env=False) is False
        fresh = _faults_of_fresh_block()  # glibc: a fresh mmap, faulted in page by page (or huge page)
        assert fresh > 0
        assert host_memory.keep_freed_memory(True, respect_env=False) is True
        assert host_memory.keeping()
        _faults_of_fresh_block()  # the heap grows once
        assert _faults_of_fresh_block() * 10 < fresh  # then the freed block is reused as it is
    finally:
        host_memory.keep_freed_memory(False, respect_env=False)
    assert not host_memory.keeping()


def test_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "0")
    try:
        assert host_memory.disabled_by_env()
        assert host_memory.keep_freed_memory() is False
        assert not host_memory.keeping()
    finally:
        host_memory.keep_freed_memory(False, respect_env=False)
