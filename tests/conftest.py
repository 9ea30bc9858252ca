"""Test setup: the Triton interpreter runs kernels on CPU tensors; it must be switched on
before fdp.kernels is imported (the variable is read when @triton.jit decorates)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in the process that asks (a forked rank), not in a pool of worker
# processes that would each import torch first (its default: one per core).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
