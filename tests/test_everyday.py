"""Small things a new user trips over (issue 30, item 9): a compiled module's names, reading a
checkpoint without ``like``, a schedule at a negative step, the kernel benchmark's verdict on
targets below torch's floor, a script run beside a clone named ``fdp/``, and what ``import fdp``
costs a process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from procs import ROOT, clean_env

import fdp
from fdp.bench import kernels as kernels_bench


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_functionalize_of_a_compiled_module_has_the_models_names_and_stays_compiled():
    graphs = []

    def backend(gm, example_inputs):  # counts what dynamo compiles
        graphs.append(gm)
        return gm.forward

    model = net()
    apply, params, buffers = fdp.functionalize(torch.compile(model, backend=backend))
    plain_apply, plain_params, plain_buffers = fdp.functionalize(net())
    assert list(params) == list(plain_params) == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert list(buffers) == list(plain_buffers)
    x = torch.randn(5, 4)
    out, new = apply(params, buffers, x)
    want, want_new = plain_apply(params, buffers, x)
    assert graphs, "apply did not run the compiled module"
    assert torch.allclose(out, want) and torch.equal(new["1.running_mean"], want_new["1.running_mean"])
    eval_out, _ = apply.eval()(params, buffers, x)
    assert torch.allclose(eval_out, plain_apply.eval()(params, buffers, x)[0])
    fresh = net()
    fresh.load_state_dict(apply.state_dict(params, buffers))  # no "_orig_mod." prefix: strict load
    grads = fdp.Reducer(params).grad(lambda p, b: apply(p, b, x)[0].sum())(params, buffers)
    assert list(grads) == list(params)


def test_load_without_like_reads_the_checkpoint_for_inspection(tmp_path):
    params = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(1e-3))
    path = tmp_path / "ckpt.pt"
    fdp.save(path, {"params": params, "opt": opt.init(params), "step": 7, "layers": [torch.ones(1)],
                    "rng": fdp.rng_state()})
    ckpt = fdp.load(path)
    assert ckpt["step"] == 7 and torch.equal(ckpt["params"]["fc.weight"], params["fc.weight"])
    assert set(ckpt["opt"]["optimizer"]) == {"step", "exp_avg", "exp_avg_sq"}  # NamedTuple fields as keys
    assert torch.equal(ckpt["opt"]["optimizer"]["exp_avg"]["fc.bias"], torch.zeros(2))
    assert torch.equal(ckpt["layers"][0], torch.ones(1)) and "cpu" in ckpt["rng"]
    fdp.save(tmp_path / "one.pt", torch.arange(3.0))
    assert torch.equal(fdp.load(tmp_path / "one.pt"), torch.arange(3.0))
    (tmp_path / "bad.pt").write_bytes(path.read_bytes()[:-100])
    with pytest.raises(fdp.CheckpointError, match="truncated, corrupt"):  # the same checks as with like
        fdp.load(tmp_path / "bad.pt")


@pytest.mark.parametrize("schedule", [
    fdp.optim.schedules.constant(0.1), fdp.optim.schedules.warmup_cosine(0.1, 2, 10),
    fdp.optim.schedules.join([fdp.optim.schedules.constant(0.1), fdp.optim.schedules.cosine(0.1, 5)], [3]),
], ids=repr)
def test_a_schedule_at_a_negative_step_raises_a_value_error_saying_what_the_step_is(schedule):
    with pytest.raises(ValueError, match=r"called with step -1; a schedule's step is the number of updates"):
        schedule(-1)
    assert schedule(0) >= 0.0


def kernel_rows(ratio: float, floors: tuple[float, float], target: float = 1.10) -> list[dict]:
    rows = [{"case": "c", "row": "flatten", "ms": 1.0, "copy_ms": 1.0, "ratio": ratio, "target": target,
             "ok": ratio <= target}]
    rows += [{"case": "c", "row": row, "ms": 1.0, "copy_ms": 1.0, "ratio": f, "target": None, "ok": True}
             for row, f in zip(kernels_bench.FLOORS, floors)]
    return kernels_bench.judge(rows)


def test_kernel_targets_below_torchs_own_floor_are_not_applicable_and_do_not_fail():
    """docs/performance.md: on CPU torch's cat over ready views is a floor for every flatten;
    a target under it is unreachable for any implementation from torch ops."""
    (row, *_) = kernel_rows(ratio=1.76, floors=(1.24, 1.28))  # 2,000 leaves on one CPU thread
    assert row["na"] and row["ok"] and row["floor"] == 1.24
    assert "N/A: torch's floor here is 1.24x" in kernels_bench.format_rows([row])
    (row, *_) = kernel_rows(ratio=1.30, floors=(0.88, 0.05))  # reachable and missed: a failure
    assert not row["na"] and not row["ok"] and "FAIL" in kernels_bench.format_rows([row])


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


def sampled(group) -> list[int]:
    """The documented form: the group's numbers, no process group needed."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    ds = TensorDataset(torch.arange(20))
    sampler = DistributedSampler(ds, num_replicas=group.size, rank=group.rank, seed=0)
    sampler.set_epoch(1)
    return [int(i) for (batch,) in DataLoader(ds, batch_size=4, sampler=sampler) for i in batch]


def test_distributed_sampler_with_the_groups_numbers_runs_in_a_world_of_one_and_on_two_ranks(monkeypatch):
    from torch.utils.data.distributed import DistributedSampler

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    group = fdp.init()
    assert group.size == 1
    with pytest.raises(ValueError, match="process group"):  # what the docs warn about
        DistributedSampler(list(range(20)))
    assert sorted(sampled(group)) == list(range(20))
    for backend in ("threads", "gloo"):
        ranks = fdp.testing.run(sampled, 2, backend=backend, timeout=120)
        assert len(ranks[0]) == len(ranks[1]) == 10 and not set(ranks[0]) & set(ranks[1]), backend
        assert sorted(ranks[0] + ranks[1]) == list(range(20))
        assert ranks[0] != sorted(ranks[0]), "set_epoch's shuffle did not reach the ranks"
