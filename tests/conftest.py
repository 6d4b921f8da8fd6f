import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the reference's scale (so tolerances do not depend on magnitudes)."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def gpu_only(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))
