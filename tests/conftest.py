import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import torch

# The repo's top-level benchmarks/ is not installed (vLLM's layout): tests import it from the repo root, put
# LAST on sys.path — in front, the root's kernels/ (installed as hybrid.kernels) would shadow the Hugging Face
# `kernels` package that transformers 5 imports. `python -P` keeps the root out of the front for the main
# process; a pytest-xdist worker starts as `python -c` in the repo root, so '' (the root) is dropped here.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if p not in ("", ".", str(ROOT))] + [str(ROOT)]

# Triton reads TRITON_INTERPRET when kernels are defined (at `import hybrid`): without a GPU, the
# Triton kernels can only be tested in the interpreter, so switch it on before anything imports hybrid.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The distillation stages compile their trained mixers by default (hybrid.distill.compiled): tens of seconds a
# mixer class, paid back over a real budget, not over a test's few steps. The suite trains eagerly;
# test_distill_compiled.py compiles on purpose and checks the compiled stages against these eager ones.
os.environ.setdefault("HYBRID_DISTILL_COMPILE", "0")

import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402

# Every test model is tiny: a second OpenMP thread only adds hand-off and spin-waiting (tens of times
# slower per op when the 2 cores are busy), so the suite runs single-threaded, and so do the commands it starts
# (torch reads OMP_NUM_THREADS at start-up; the native kernels' pool follows torch). Benchmarks set their own.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _single_threaded_after_each_test():
    """Put torch back on one thread after a test that moved it: an API or CLI call run in-process may set its own
    count (``--threads``; a benchmark's or the tradeoff's ``set_threads(None)``, one per core), and every later
    test on that worker would then spin a second thread against the other worker's core (7x slower files)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (scripts/test.sh) a test file runs on one worker, so its module
    fixtures (converted checkpoints, trained tiny models) are built once, unless its tests name their own
    ``xdist_group`` (test_docs.py: one per page, minutes each, spread over the workers)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the reference's scale (so tolerances do not depend on magnitudes)."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def gpu_only(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))


# ---- the package as a user installs it (test_wheel.py, test_docs.py, test_lm_eval_routes.py) ----------------------
WHEEL_SOURCES = ("pyproject.toml", "setup.py", "LICENSE", "README.md", "hybrid", "kernels", "eval", "recipes")


def _build_and_install(tmp: Path) -> Path:
    """Build the wheel from a clean copy of the sources under ``tmp`` and install it into a fresh venv there."""
    src = tmp / "src"
    for name in WHEEL_SOURCES:  # a clean copy: no build/ or egg-info left over from another build
        from_, to = ROOT / name, src / name
        if from_.is_dir():
            shutil.copytree(from_, to, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(from_, to)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp / "dist")], check=True, capture_output=True, text=True)
    (wheel,) = (tmp / "dist").glob("hybrid_lm-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # this venv's dependencies (torch, transformers, ...), appended after the fresh venv's own site-packages; the
    # editable install's .pth hook is not run for a directory added this way, so the repository stays invisible
    (site / "test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True)
    return env_dir


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> Path:
    """One wheel and venv for the whole run (three modules use it; the build compiles the native variants). Under
    pytest-xdist the workers share it: the first one to take the lock in the run's common temp folder builds it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder every worker's basetemp lives in
    done = root / "wheel" / "installed"
    with FileLock(str(root / "wheel.lock")):
        if not done.exists():
            shutil.rmtree(root / "wheel", ignore_errors=True)  # a build that failed part way
            (root / "wheel").mkdir()
            env_dir = _build_and_install(root / "wheel")
            done.write_text(str(env_dir))
    return Path(done.read_text())


@pytest.fixture(scope="module")
def installed(wheel_venv, tmp_path_factory):
    """(venv folder, environment, an empty working folder outside the repository) for this module."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return wheel_venv, env, tmp_path_factory.mktemp("elsewhere")


