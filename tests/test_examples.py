"""The examples run: each to completion at a tiny size, as a user would launch it.

train_mlp, uneven_inputs, grad_accumulation, resnet_bf16 and char_gpt run under
``torchrun --standalone --nproc-per-node 2`` (two gloo ranks); dp_sgd and one char_gpt run
are plain ``python`` (a world of one: the all-reduce is the same call either way). The runs
of the selected tests share one torchrun launch (and the world-of-one runs one ``python``):
``tests/run_examples.py`` runs each script as ``__main__`` on every rank, one after another,
so the tests pay the launch and the ranks' imports (3-4 s) once, not per run. Each run
happens in its own temporary folder so checkpoints and plots do not litter the repository.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import clean_env, run, torchrun

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RUNNER = Path(__file__).resolve().parent / "run_examples.py"
TIMEOUT_S = 480  # all the runs of one world together; they take seconds (the tests allow 600)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Tiny sizes: enough steps to exercise the loop, few enough to take seconds.
TORCHRUN = {
    "train_mlp.py": ["--steps", "100", "--min-accuracy", "0.6", "--plot", "--ckpt", "ckpt/mlp.pt"],
    "uneven_inputs.py": ["--epochs", "2", "--batches", "3", "--batch-size", "16"],
    "grad_accumulation.py": ["--steps", "4", "--micro-batches", "3", "--check-every", "2"],
    "resnet_bf16.py": ["--steps", "4", "--batch-size", "8"],
    "char_gpt.py": ["--steps", "8", "--micro-batches", "2", "--batch-size", "4", "--eval-every", "4",
                    "--ckpt-every", "4", "--ckpt", "ckpt/gpt.pt"],
}
PLAIN = {
    "dp_sgd.py": ["--steps", "20"],
}
GPT = TORCHRUN["char_gpt.py"]


@dataclass(frozen=True)
class Job:
    """One run of an example: ``script args`` in the folder ``cwd`` (under the test's
    temporary folder) on ``ranks`` ranks (2: torchrun; 1: plain python)."""

    label: str
    script: str
    args: tuple[str, ...]
    cwd: str
    ranks: int


# The runs each test needs, in the order they run (a later run may read what an earlier one
# wrote in the same folder: a checkpoint).
JOBS = {
    "test_train_mlp_on_two_ranks_beats_its_accuracy_bar_and_plots_a_png": [
        Job("train_mlp", "train_mlp.py", (*TORCHRUN["train_mlp.py"],), "train_mlp", 2)],
    "test_uneven_inputs_ranks_take_the_same_number_of_steps": [
        Job("uneven", "uneven_inputs.py", (*TORCHRUN["uneven_inputs.py"],), "uneven", 2)],
    "test_grad_accumulation_equals_the_big_batch_on_two_ranks": [
        Job("accumulation", "grad_accumulation.py", (*TORCHRUN["grad_accumulation.py"],), "accumulation", 2)],
    "test_resnet_bf16_trains_on_two_ranks": [
        Job("resnet", "resnet_bf16.py", (*TORCHRUN["resnet_bf16.py"],), "resnet", 2)],
    "test_dp_sgd_runs_in_a_world_of_one": [
        Job("dp_sgd", "dp_sgd.py", (*PLAIN["dp_sgd.py"],), "dp_sgd", 1)],
    "test_char_gpt_resumes_bit_for_bit_on_two_ranks_and_runs_in_a_world_of_one": [
        Job("gpt_straight", "char_gpt.py", (*GPT, "--out", "straight.pt"), "gpt", 2),
        # stopped after step 4, then resumed from its checkpoint to step 8
        Job("gpt_stop", "char_gpt.py", (*GPT, "--stop-at", "4"), "gpt/resumed", 2),
        Job("gpt_resume", "char_gpt.py", (*GPT, "--resume", "--out", "resumed.pt"), "gpt/resumed", 2),
        # the same step-4 checkpoint (of the unsharded step), resumed sharded
        Job("gpt_stop_for_shard", "char_gpt.py", (*GPT, "--stop-at", "4"), "gpt/sharded", 2),
        Job("gpt_shard", "char_gpt.py", (*GPT, "--resume", "--shard", "--out", "sharded.pt"), "gpt/sharded", 2),
        # and resumed fully sharded (--shard params: each rank keeps its slices only)
        Job("gpt_stop_for_fully", "char_gpt.py", (*GPT, "--stop-at", "4"), "gpt/fully", 2),
        Job("gpt_fully", "char_gpt.py", (*GPT, "--resume", "--shard", "params", "--out", "fully.pt"), "gpt/fully", 2),
        Job("gpt_plain", "char_gpt.py", ("--steps", "3", "--batch-size", "4", "--ckpt", "c.pt"), "gpt/plain", 1),
    ],
}


@dataclass
class World:
    """One launch of tests/run_examples.py: its folder and how the process ended."""

    folder: Path
    ranks: int
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def worlds(request, tmp_path_factory):
    """Run the jobs of this module's selected tests: one torchrun launch for the 2-rank
    jobs, one python for the world-of-one jobs. Returns {label: (World, Job)}."""
    selected = [item.originalname for item in request.session.items
                if item.module is request.module and item.originalname in JOBS]
    base = tmp_path_factory.mktemp("examples")
    by_label = {}
    for ranks in (2, 1):
        jobs = [job for name in JOBS if name in selected for job in JOBS[name] if job.ranks == ranks]
        if not jobs:
            continue
        for job in jobs:
            (base / job.cwd).mkdir(parents=True, exist_ok=True)
        plan = base / f"plan-{ranks}.json"
        plan.write_text(json.dumps([{"label": j.label, "script": str(EXAMPLES / j.script), "args": list(j.args),
                                     "cwd": str(base / j.cwd)} for j in jobs]))
        cmd = torchrun(2, str(RUNNER), str(plan)) if ranks == 2 else [sys.executable, str(RUNNER), str(plan)]
        proc = run(cmd, cwd=base, env=clean_env(), timeout=TIMEOUT_S)
        world = World(base, ranks, cmd, proc.returncode, proc.stdout, proc.stderr)
        by_label.update({job.label: (world, job) for job in jobs})
    return by_label


def output(worlds: dict, label: str) -> str:
    """What the run ``label`` printed (rank 0's lines, then rank 1's); fails the test if the
    run failed on any rank or did not run, or if its world did not exit with 0."""
    world, job = worlds[label]
    folder = world.folder / job.cwd
    where = (f"{' '.join(world.cmd[1:])} exited with {world.returncode}\n--- stdout\n{world.stdout[-3000:]}"
             f"\n--- stderr\n{world.stderr[-6000:]}")
    command = f"{job.script} {' '.join(job.args)}"
    status = {rank: folder / f"{label}.rank{rank}.exit" for rank in range(job.ranks)}
    for rank, path in status.items():
        failure = path.read_text() if path.exists() else "0"
        assert failure == "0", f"{command} failed on rank {rank}:\n{failure}\n{where}"
    for rank, path in status.items():  # stopped when another rank failed (this job or an earlier one)
        assert path.exists(), f"{command} did not finish on rank {rank}: {where}"
    assert world.returncode == 0, where
    return "".join((folder / f"{label}.rank{rank}.out").read_text() for rank in range(job.ranks))


def accuracy(stdout: str) -> float:
    found = re.findall(r"held-out accuracy (\d\.\d+)", stdout)
    assert found, f"no 'held-out accuracy' line in:\n{stdout[-2000:]}"
    return float(found[-1])


def test_every_example_is_run_by_this_file():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(TORCHRUN) | set(PLAIN), "add new examples to TORCHRUN or PLAIN"
    assert {job.script for jobs in JOBS.values() for job in jobs} == scripts
    tests = {name for name in globals() if name.startswith("test_")}
    assert set(JOBS) <= tests, f"JOBS names tests that do not exist: {set(JOBS) - tests}"


@pytest.mark.parametrize("name", sorted(set(TORCHRUN) | set(PLAIN)))
def test_docstring_gives_the_torchrun_command(name):
    doc = (EXAMPLES / name).read_text()
    assert f"torchrun --standalone --nproc-per-node 2 examples/{name}" in doc
    assert f"python examples/{name}" in doc


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # (the first one selected runs the worlds)
def test_train_mlp_on_two_ranks_beats_its_accuracy_bar_and_plots_a_png(worlds):
    out = output(worlds, "train_mlp")
    assert "world 2:" in out
    assert accuracy(out) >= 0.6  # the script exits 1 below --min-accuracy as well; chance is 0.1

    png = worlds["train_mlp"][0].folder / "train_mlp" / "timeline.png"
    assert png.exists(), "--plot did not write timeline.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE, "timeline.png is not a PNG"
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, image.shape


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # (the first one selected runs the worlds)
def test_uneven_inputs_ranks_take_the_same_number_of_steps(worlds):
    out = output(worlds, "uneven")
    # Rank 0 has 3 batches per epoch, rank 1 has 6: both take 2 x 6 steps, rank 0 idles in 6.
    assert "rank 0: 3 batches per epoch; 12 steps, idle (active=False) in 6" in out, out
    assert "rank 1: 6 batches per epoch; 12 steps, idle (active=False) in 0" in out, out
    assert "every rank took 12 steps" in out and "replicas are identical" in out
    accuracy(out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # (the first one selected runs the worlds)
def test_grad_accumulation_equals_the_big_batch_on_two_ranks(worlds):
    out = output(worlds, "accumulation")
    assert "world 2:" in out and "accumulated == big-batch gradients" in out, out
    checks = re.findall(r"max \|diff\| ([0-9.e+-]+)", out)
    assert checks and all(float(d) < 1e-5 for d in checks), checks
    accuracy(out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # (the first one selected runs the worlds)
def test_resnet_bf16_trains_on_two_ranks(worlds):
    out = output(worlds, "resnet")
    assert "world 2:" in out and "bf16" in out, out
    accuracy(out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # (the first one selected runs the worlds)
def test_dp_sgd_runs_in_a_world_of_one(worlds):
    out = output(worlds, "dp_sgd")
    assert "world 1:" in out and "DP-SGD" in out, out
    accuracy(out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # (the first one selected runs the worlds)
def test_char_gpt_resumes_bit_for_bit_on_two_ranks_and_runs_in_a_world_of_one(worlds):
    import torch

    out = output(worlds, "gpt_straight")
    assert "world 2:" in out and "mean over 2 ranks" in out, out
    first, last = (float(v) for v in re.search(r"val loss ([0-9.]+) -> ([0-9.]+)", out).groups())
    assert last < first, f"8 steps did not lower the validation loss: {first} -> {last}"

    out = output(worlds, "gpt_stop")
    assert "stopped after step 4" in out, out
    out = output(worlds, "gpt_resume")
    assert "resumed from ckpt/gpt.pt at step 4" in out, out
    gpt = worlds["gpt_straight"][0].folder / "gpt"
    a = torch.load(gpt / "straight.pt", weights_only=True)
    b = torch.load(gpt / "resumed" / "resumed.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"params[{k!r}] after resume differs from the straight run"

    out = output(worlds, "gpt_plain")
    assert "world 1:" in out, out

    # Fully sharded (--shard params): the unsharded run's checkpoint at step 4 resumes with each
    # rank holding its slices only; on two ranks the same numbers bit for bit (the sums of a
    # reduce-scatter of two are the all-reduce's, and the clip's norm is each leaf's, whole).
    assert "stopped after step 4" in output(worlds, "gpt_stop_for_fully")
    out = output(worlds, "gpt_fully")
    assert "resumed from ckpt/gpt.pt at step 4" in out and "sample:" in out, out
    d = torch.load(gpt / "fully" / "fully.pt", weights_only=True)
    for k in a:
        assert torch.equal(d[k], a[k]), f"params[{k!r}] fully sharded differs from the straight run"

    # Sharded (--shard): the unsharded run's checkpoint at step 4 resumes sharded. On two
    # ranks the sharded sums are the all-reduce's; only the global-norm clip's summation
    # order differs (per slice), so the params agree to rounding.
    assert "stopped after step 4" in output(worlds, "gpt_stop_for_shard")
    out = output(worlds, "gpt_shard")
    assert "resumed from ckpt/gpt.pt at step 4" in out, out
    c = torch.load(gpt / "sharded" / "sharded.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=1e-5, atol=1e-6, msg=f"params[{k!r}] sharded")
