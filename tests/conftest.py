import os
import random
import sys
from pathlib import Path


def _pin_gpus() -> None:
    """Each pytest-xdist worker of a GPU record (``benchmarks/gpu_tests_record.py run``) sees its own
    card (or pair): ``MHE_GPU_SETS`` lists the sets, ``;`` apart, and worker ``gwK`` takes set
    ``K mod len``. Set before torch reads ``CUDA_VISIBLE_DEVICES`` (before CUDA starts)."""
    sets, worker = os.environ.get("MHE_GPU_SETS"), os.environ.get("PYTEST_XDIST_WORKER", "")
    if sets and worker.startswith("gw"):
        choices = sets.split(";")
        os.environ["CUDA_VISIBLE_DEVICES"] = choices[int(worker[2:]) % len(choices)]


_pin_gpus()

import pytest  # noqa: E402
import torch  # noqa: E402

# The helpers (reference.py, processes.py, tiny_runs.py, ...) live in tests/, the tests in folders that
# mirror src/mhe; every folder is importable by module name (a test names another as "test_x::name").
TESTS = Path(__file__).parent
sys.path[:0] = [str(TESTS)] + [str(d) for d in sorted(TESTS.iterdir()) if d.is_dir() and d.name[0] not in "._"]

# One CPU thread per test process, and the same for the processes tests start (mhe.runtime):
# with torch's default of one thread per core the suite slows several-fold under any load.
os.environ["MHE_THREADS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
# Runs keep trained tokenizers and compiled kernels in MHE_CACHE_DIR (mhe.runtime); tests train their
# own, so what a test prints never depends on which test ran before it (test_run_report turns it on).
os.environ["MHE_CACHE_DIR"] = "off"
torch.set_num_threads(1)
# Without a GPU, Triton's kernels run in its interpreter on CPU tensors (tests/attention/test_split_k_decode.py);
# Triton reads the switch when it is imported, which no test has done yet.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def seed_everything():
    """Every test starts from the same seeds."""
    random.seed(0)
    torch.manual_seed(0)
    yield


B, T, D_MODEL, N_HEADS, VOCAB = 2, 7, 32, 4, 99  # tiny shapes (HF tester sizes)


def data_dir() -> Path:
    """Where the benchmark data lives (env MHE_DATA, default ../shared/data)."""
    from mhe.data.paths import data_root

    return data_root()


def require_data(*relpaths: str) -> Path:
    """Skip when benchmark files are missing locally; fail under CI (env CI set). The folder is
    returned absolute: tests that change directory still find it (the default is relative)."""
    root = Path(data_dir()).resolve()
    missing = [p for p in relpaths if not (root / p).exists()]
    if missing:
        msg = f"benchmark data missing under {root}: {', '.join(missing)} (set MHE_DATA)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return root


from tiny_runs import lm_run, mt_run  # noqa: E402,F401  (session-scoped tiny runs, shared)


@pytest.fixture
def kind_lookups(monkeypatch):
    """Counts, by name, every lookup of an attention kind's spec in the registry
    (:func:`mhe.attention.spec.attention_spec` reads ``SPECS[name]``): a name parsed again
    below the boundary that parsed it shows up as a second lookup."""
    import collections

    import mhe.attention.spec as spec_module

    counts = collections.Counter()

    class Counting(dict):
        def __getitem__(self, name):
            counts[name] += 1
            return super().__getitem__(name)

    monkeypatch.setattr(spec_module, "SPECS", Counting(spec_module.SPECS))
    return counts
