import os
import sys
from pathlib import Path

import torch

# The repo's top-level benchmarks/ is not installed (vLLM's layout): tests import it from the repo root, put
# LAST on sys.path — in front, the root's kernels/ (installed as hybrid.kernels) would shadow the Hugging Face
# `kernels` package that transformers 5 imports.
sys.path.append(str(Path(__file__).resolve().parents[1]))

# Triton reads TRITON_INTERPRET when kernels are defined (at `import hybrid`): without a GPU, the
# Triton kernels can only be tested in the interpreter, so switch it on before anything imports hybrid.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The distillation stages compile their trained mixers by default (hybrid.distill.compiled): seconds per stage,
# paid back over a real budget, not over a test's few steps. The suite trains eagerly; test_distill_compiled.py
# compiles on purpose and checks the compiled stages against these eager ones.
os.environ.setdefault("HYBRID_DISTILL_COMPILE", "0")

import pytest  # noqa: E402

# Every test model is tiny: a second OpenMP thread only adds hand-off and spin-waiting (tens of times
# slower per op when the 2 cores are busy), so the suite runs single-threaded. Benchmarks set their own.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the reference's scale (so tolerances do not depend on magnitudes)."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def gpu_only(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))
