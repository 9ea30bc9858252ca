"""The package as a user installs and imports it: pyproject's metadata, a script run beside a
clone named ``fdp/``, and what ``import fdp`` costs a process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ROOT, clean_env


def test_pyproject_uses_the_spdx_license_string_with_a_setuptools_that_reads_it():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; fdp supports 3.10)
    assert '\nlicense = "BSD-3-Clause"\n' in text
    assert 'requires = ["setuptools>=77"]' in text  # PEP 639 strings from setuptools 77.0


def run_beside_a_clone(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """``python [flags] train.py`` from a folder that holds the checkout as ``fdp/``."""
    (tmp_path / "fdp").symlink_to(ROOT, target_is_directory=True)
    (tmp_path / "train.py").write_text(
        "import fdp\nimport fdp.optim\nfrom fdp import functionalize\n"
        "print(fdp.__file__, fdp.init().size, functionalize is fdp.functionalize, fdp.optim.adamw.__name__)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, *flags, "train.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow  # (a python launch)
def test_a_script_beside_a_clone_named_fdp_imports_the_package(tmp_path):
    """The clone's folder is found first on sys.path; its root __init__.py hands over to the
    installed package (before, the folder was an empty namespace package)."""
    res = run_beside_a_clone(tmp_path)
    assert res.returncode == 0, res.stderr
    file, size, same, name = res.stdout.split()
    package = Path(file).resolve()
    assert package.name == "__init__.py" and package.parent.name == "fdp"
    assert package != (ROOT / "__init__.py").resolve(), "the checkout's root was imported as fdp"
    assert (size, same, name) == ("1", "True", "adamw")


def test_without_an_installed_fdp_the_clone_says_what_to_do(tmp_path):
    res = run_beside_a_clone(tmp_path, "-S")  # -S: no site-packages, so no installed fdp
    assert res.returncode != 0
    assert "fdp's source checkout" in res.stderr and "pip install -e" in res.stderr, res.stderr


STARTS_WITHOUT_DYNAMO = """
import sys, torch, torch.nn as nn, fdp
print("torch._dynamo" in sys.modules)
apply, params, buffers = fdp.functionalize(nn.Linear(3, 2))
reducer = fdp.Reducer(params)
loss = lambda p, x: apply(p, buffers, x)[0].square().sum()
step = reducer.grad_and_update(loss, fdp.optim.adamw(1e-3))
p, s, _ = step(params, step.init(params), torch.ones(4, 3))
reducer.grad(loss)(p, torch.ones(4, 3))
print("torch._dynamo" in sys.modules)
"""


@pytest.mark.slow  # (a python launch)
def test_import_fdp_and_its_steps_do_not_import_torch_dynamo():
    """torch._dynamo costs about a second of CPU per process (each rank torchrun starts):
    ``import fdp``, the fused step and ``reducer.grad`` leave it out (the fused step's
    ``torch.compiler.disable`` is made on its first call in a process that has it)."""
    res = subprocess.run([sys.executable, "-c", STARTS_WITHOUT_DYNAMO], env=clean_env(), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False", "False"], res.stdout
