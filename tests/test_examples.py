"""The examples run: each to completion at a tiny size, as a user would launch it.

train_mlp, uneven_inputs, grad_accumulation, resnet_bf16 and char_gpt run under
``torchrun --standalone --nproc-per-node 2`` (two gloo ranks); dp_sgd runs as plain
``python`` (a world of one: its all-reduce is the same call either way). Each run happens in
a temporary folder so checkpoints and plots do not litter the repository.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from procs import clean_env, run, torchrun

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 180  # per run; each takes a few seconds
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


def run_example(name: str, args: list[str], cwd: Path, *, ranks: int | None) -> str:
    """Run examples/<name> (under torchrun with ``ranks`` ranks, or plain python); return stdout."""
    script = str(EXAMPLES / name)
    cmd = [sys.executable, script, *args] if ranks is None else torchrun(ranks, script, *args)
    proc = run(cmd, cwd=cwd, env=clean_env(), timeout=TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{' '.join(cmd[1:])} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc.stdout


def accuracy(stdout: str) -> float:
    found = re.findall(r"held-out accuracy (\d\.\d+)", stdout)
    assert found, f"no 'held-out accuracy' line in:\n{stdout[-2000:]}"
    return float(found[-1])


def test_every_example_is_run_by_this_file():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(TORCHRUN) | set(PLAIN), "add new examples to TORCHRUN or PLAIN"


@pytest.mark.parametrize("name", sorted(set(TORCHRUN) | set(PLAIN)))
def test_docstring_gives_the_torchrun_command(name):
    doc = (EXAMPLES / name).read_text()
    assert f"torchrun --standalone --nproc-per-node 2 examples/{name}" in doc
    assert f"python examples/{name}" in doc


def test_train_mlp_on_two_ranks_beats_its_accuracy_bar_and_plots_a_png(tmp_path):
    out = run_example("train_mlp.py", TORCHRUN["train_mlp.py"], tmp_path, ranks=2)
    assert "world 2:" in out
    assert accuracy(out) >= 0.6  # the script exits 1 below --min-accuracy as well; chance is 0.1

    png = tmp_path / "timeline.png"
    assert png.exists(), "--plot did not write timeline.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE, "timeline.png is not a PNG"
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, image.shape


def test_uneven_inputs_ranks_take_the_same_number_of_steps(tmp_path):
    out = run_example("uneven_inputs.py", TORCHRUN["uneven_inputs.py"], tmp_path, ranks=2)
    # Rank 0 has 3 batches per epoch, rank 1 has 6: both take 2 x 6 steps, rank 0 idles in 6.
    assert "rank 0: 3 batches per epoch; 12 steps, idle (active=False) in 6" in out, out
    assert "rank 1: 6 batches per epoch; 12 steps, idle (active=False) in 0" in out, out
    assert "every rank took 12 steps" in out and "replicas are identical" in out
    accuracy(out)


def test_grad_accumulation_equals_the_big_batch_on_two_ranks(tmp_path):
    out = run_example("grad_accumulation.py", TORCHRUN["grad_accumulation.py"], tmp_path, ranks=2)
    assert "world 2:" in out and "accumulated == big-batch gradients" in out, out
    checks = re.findall(r"max \|diff\| ([0-9.e+-]+)", out)
    assert checks and all(float(d) < 1e-5 for d in checks), checks
    accuracy(out)


def test_resnet_bf16_trains_on_two_ranks(tmp_path):
    out = run_example("resnet_bf16.py", TORCHRUN["resnet_bf16.py"], tmp_path, ranks=2)
    assert "world 2:" in out and "bf16" in out, out
    accuracy(out)


def test_dp_sgd_runs_in_a_world_of_one(tmp_path):
    out = run_example("dp_sgd.py", PLAIN["dp_sgd.py"], tmp_path, ranks=None)
    assert "world 1:" in out and "DP-SGD" in out, out
    accuracy(out)


def test_char_gpt_resumes_bit_for_bit_on_two_ranks_and_runs_in_a_world_of_one(tmp_path):
    args = TORCHRUN["char_gpt.py"]
    out = run_example("char_gpt.py", [*args, "--out", "straight.pt"], tmp_path, ranks=2)
    assert "world 2:" in out and "mean over 2 ranks" in out, out
    first, last = (float(v) for v in re.search(r"val loss ([0-9.]+) -> ([0-9.]+)", out).groups())
    assert last < first, f"8 steps did not lower the validation loss: {first} -> {last}"

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    out = run_example("char_gpt.py", [*args, "--stop-at", "4"], resumed, ranks=2)
    assert "stopped after step 4" in out, out
    import shutil

    shutil.copytree(resumed, tmp_path / "sharded")  # the step-4 checkpoint, for sharded resumes below
    shutil.copytree(resumed, tmp_path / "fully")
    out = run_example("char_gpt.py", [*args, "--resume", "--out", "resumed.pt"], resumed, ranks=2)
    assert "resumed from ckpt/gpt.pt at step 4" in out, out
    import torch

    a, b = torch.load(tmp_path / "straight.pt", weights_only=True), torch.load(resumed / "resumed.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), f"params[{k!r}] after resume differs from the straight run"

    plain = tmp_path / "plain"
    plain.mkdir()
    out = run_example("char_gpt.py", ["--steps", "3", "--batch-size", "4", "--ckpt", "c.pt"], plain, ranks=None)
    assert "world 1:" in out, out

    # Fully sharded (--shard params): the unsharded run's checkpoint at step 4 resumes with each
    # rank holding its slices only; on two ranks the same numbers bit for bit (the sums of a
    # reduce-scatter of two are the all-reduce's, and the clip's norm is each leaf's, whole).
    out = run_example("char_gpt.py", [*args, "--resume", "--shard", "params", "--out", "fully.pt"],
                      tmp_path / "fully", ranks=2)
    assert "resumed from ckpt/gpt.pt at step 4" in out and "sample:" in out, out
    d = torch.load(tmp_path / "fully" / "fully.pt", weights_only=True)
    for k in a:
        assert torch.equal(d[k], a[k]), f"params[{k!r}] fully sharded differs from the straight run"

    # Sharded (--shard): the unsharded run's checkpoint at step 4 resumes sharded. On two
    # ranks the sharded sums are the all-reduce's; only the global-norm clip's summation
    # order differs (per slice), so the params agree to rounding.
    out = run_example("char_gpt.py", [*args, "--resume", "--shard", "--out", "sharded.pt"], tmp_path / "sharded",
                      ranks=2)
    assert "resumed from ckpt/gpt.pt at step 4" in out, out
    c = torch.load(tmp_path / "sharded" / "sharded.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=1e-5, atol=1e-6, msg=f"params[{k!r}] sharded")
