"""Keeping freed host memory (kernels/host_memory.py): a large block freed and allocated again is reused,
already mapped, instead of being page-faulted in anew."""

import subprocess
import sys
import textwrap

import pytest
from hybrid.kernels import host_memory

pytestmark = pytest.mark.skipif(host_memory.available() is not None, reason="needs glibc's mallopt")

# Run in a fresh interpreter: the heap that earlier tests leave behind is fragmented, and the
# ``malloc_trim(0)`` of ``keep_freed_memory(False)`` hands the free chunks in its middle back to the kernel
# (MADV_DONTNEED), so a block allocated in this process may land on such a chunk and fault in whatever
# glibc's policy is. A fresh heap measures the policy alone.
_MEASURE = textwrap.dedent("""
    import resource, torch
    from hybrid.kernels import host_memory
    MB64 = 64 * 2**20 // 4  # fp32 elements: above glibc's largest mmap threshold (32 MiB)

    def faults_of_fresh_block():
        x = torch.empty(MB64)
        x.fill_(1.0)
        del x
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        y = torch.empty(MB64)
        y.fill_(2.0)
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        del y
        return f1 - f0

    assert host_memory.keep_freed_memory(False, respect_env=False) is False
    fresh = faults_of_fresh_block()  # glibc: a fresh mmap, faulted in page by page (or huge page)
    assert host_memory.keep_freed_memory(True, respect_env=False) is True
    assert host_memory.keeping()
    faults_of_fresh_block()  # the heap grows once
    # then the freed block is reused as it is: the steady state, read as the best of three reuses (in one suite
    # run of about six, on 2 busy cores, the one reuse measured then faulted every page in anew)
    kept = [faults_of_fresh_block() for _ in range(3)]
    host_memory.keep_freed_memory(False, respect_env=False)
    assert not host_memory.keeping()
    print(fresh, *kept)
""")


def test_kept_memory_is_reused_without_page_faults():
    run = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    fresh, *kept = map(int, run.stdout.split())
    assert fresh > 0
    assert min(kept) * 10 < fresh, (fresh, kept)


def test_environment_turns_it_off(monkeypatch):
    host_memory.keep_freed_memory(False, respect_env=False)  # whatever earlier tests in this process left
    monkeypatch.setenv(host_memory.ENV, "0")
    try:
        assert host_memory.disabled_by_env()
        assert host_memory.keep_freed_memory() is False
        assert not host_memory.keeping()
    finally:
        host_memory.keep_freed_memory(False, respect_env=False)
