"""Test setup, before anything imports torch or fdp: the Triton interpreter runs kernels on
CPU tensors (switched on before fdp.kernels is imported: the variable is read when @triton.jit
decorates); one thread per process; nothing passes or fails on time, nothing is written into
the checkout. Markers (pyproject.toml): slow, multiprocess, compile, perf."""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in the process that asks (a forked rank), not in a pool of worker
# processes that would each import torch first (its default: one per core).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Hypothesis keeps its caches out of the checkout (its default is ./.hypothesis).
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "fdp-tests-hypothesis"))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Hypothesis: no pass/fail on time (no deadline; a slow draw on a busy machine is not a
# failure) and no example database.
settings.register_profile("fdp", deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("fdp")

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The perf tests run only when the -m expression names them (``make perf``: -m perf):
    they pass or fail on measured speed, which a busy machine cannot give (CI runs beside
    other work). Every other selection (plain pytest, -m "not slow", -k ...) leaves them out.
    """
    if "perf" not in (config.getoption("markexpr") or ""):
        perf = [item for item in items if item.get_closest_marker("perf")]
        if perf:
            config.hook.pytest_deselected(items=perf)
            items[:] = [item for item in items if not item.get_closest_marker("perf")]
    # The compile tests run last (a stable sort: in their order among themselves). They import
    # torch._dynamo and Inductor into this process (tests/compiling.py), which then is a third
    # bigger, and every fork of it afterwards (each gloo rank, each forked doc test) costs more.
    items.sort(key=lambda item: item.get_closest_marker("compile") is not None)


@pytest.fixture(scope="session", autouse=True)
def _dynamo_imported():
    """torch._dynamo, imported once here before any test forks ranks. torch.func.grad's first
    call and DDP's constructor import it (about a second of CPU); a forked gloo rank inherits
    this process's modules, so without this every rank of every DDP or torch.func test that
    ran before anything imported it here would import it afresh (tests/test_hooks.py alone:
    about 30 s instead of 3)."""
    import torch._dynamo  # noqa: F401


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
