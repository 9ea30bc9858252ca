"""Faults: dead ranks, restarts that resume bit-exactly, non-finite gradients."""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import batch, mlp
from procs import clean_env, run, torchrun

import fdp

ROOT = Path(__file__).resolve().parents[1]


def dies_mid_step(group, die_at):
    apply, params, buffers = fdp.functionalize(mlp(width=64, seed=1))
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.005, first_bucket_cap_mb=0.005)

    def loss_fn(p, x, y):
        out = apply(p, buffers, x)[0]
        if group.rank == 1 and reducer.steps == die_at:
            os._exit(3)  # dies between its forward and its backward, no cleanup
        return F.cross_entropy(out, y)

    grad_fn = reducer.grad(loss_fn)
    for step in range(10):
        grad_fn(params, *batch(group.rank, step))


def test_a_dead_rank_makes_the_others_raise_naming_step_and_bucket():
    with pytest.raises(RuntimeError) as info:
        fdp.testing.run(dies_mid_step, 2, backend="gloo", timeout=20, args=(4,))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "[rank 1]" in str(info.value) and "exited with code 3" in str(info.value)
    # rank 0 did not hang: it raised a CollectiveError naming the step and the bucket, because
    # gloo saw rank 1's connection close (not at the collective's timeout, which it names too)
    assert "rank 0 also raised CollectiveError" in notes, notes
    assert "(step 4)" in notes and "bucket 0 of" in notes, notes
    assert any(f in notes for f in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")), notes
    assert "Timed out" not in notes, notes


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_torchrun_restart_resumes_from_checkpoint_bit_exactly(tmp_path):
    """Rank 1 dies at step 5; torchrun (--max-restarts=1) restarts both ranks, which resume
    from the step-4 checkpoint; the final params equal an uninterrupted run's."""
    script = [str(ROOT / "examples" / "train_mlp.py"), "--steps", "12", "--ckpt-every", "2", "--width", "32"]

    def train(name, extra, restarts=0):
        cmd = torchrun(2, *script, "--ckpt", str(tmp_path / f"{name}.pt"),
                       "--out", str(tmp_path / f"{name}-final.pt"), *extra, max_restarts=restarts)
        return run(cmd, timeout=180, env=clean_env(), cwd=tmp_path)

    clean = train("clean", [])
    assert clean.returncode == 0, clean.stderr[-3000:]
    crashed = train("crash", ["--resume", "--crash-at-step", "5", "--crash-rank", "1"], restarts=1)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "resumed from" in crashed.stdout and "at step 4" in crashed.stdout, crashed.stdout[-2000:]
    assert "exitcode: 17" in crashed.stderr  # the injected death really happened
    a = torch.load(tmp_path / "clean-final.pt", weights_only=True)
    b = torch.load(tmp_path / "crash-final.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"leaf {k!r} differs after the restart"


def nonfinite(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=2))
    reducer = fdp.Reducer(params, group, skip_nonfinite=True)
    opt = fdp.optim.sgd(lr=0.1)
    state = opt.init(params)
    verdicts = []
    for step in range(4):
        x, y = batch(group.rank, step)
        if step == 2 and group.rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")  # only rank 1 sees a bad batch
        grads = reducer.grad(lambda p, x=x, y=y: F.cross_entropy(apply(p, buffers, x)[0], y))(params)
        verdicts.append(reducer.last_step.finite)
        if reducer.last_step.finite:
            params, state = opt.update(grads, state, params)
    return verdicts, reducer.nonfinite_steps, params


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_nonfinite_gradients_skip_the_step_on_every_rank(backend):
    res = fdp.testing.run(nonfinite, 2, backend=backend)
    for rank, (verdicts, count, params) in enumerate(res):
        assert verdicts == [True, True, False, True], f"rank {rank}"
        assert count == 1
        assert all(torch.isfinite(v).all() for v in params.values()), f"rank {rank}"
    for k in res[0][2]:
        assert torch.equal(res[0][2][k], res[1][2][k]), "replicas diverged"


def test_without_the_option_the_check_costs_nothing_and_verdict_stays_true():
    params = {"w": torch.tensor([float("nan")])}
    reducer = fdp.Reducer(params)
    reducer.all_reduce(params)
    assert reducer.last_step.finite and reducer.nonfinite_steps == 0


CATCHES_A_TIMEOUT = """
import dataclasses, sys
from datetime import timedelta
import torch, torch.distributed as dist, fdp
print("imported", flush=True)
sys.stdin.readline()  # the test lets both ranks meet at once: the rendezvous has only 2 s
group = fdp.init(timeout=2)
fdp.broadcast({"x": torch.ones(2)}, group=group)  # a healthy collective first
store = dist.distributed_c10d._get_default_store()  # torchrun's rendezvous store (TCP, not gloo)
if group.rank == 1:  # skips the collective below until rank 0 has given up on it, then finishes normally
    store.wait(["caught"], timedelta(seconds=60))
    sys.exit(0)
try:  # waits 0.5 s; gloo's own operation runs on until its 2 s timeout
    fdp.broadcast({"x": torch.ones(3)}, group=dataclasses.replace(group, timeout=timedelta(seconds=0.5)))
except fdp.CollectiveError:
    print("caught", flush=True)
    store.set("caught", "1")
sys.exit(3)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_that_caught_a_timeout_exits_with_the_status_it_chose():
    """Before the fix, gloo's worker thread could free the timed-out collective during
    interpreter teardown and kill the rank with SIGABRT ("terminate called without an active
    exception"), in about half of the runs: two runs (two worlds at once: most of a run is
    waiting for gloo's timeout) make a pass by luck unlikely."""
    import socket
    import subprocess
    import sys

    sockets = [socket.socket() for _ in range(2)]  # two free ports (both held while choosing)
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    worlds = [[subprocess.Popen([sys.executable, "-c", CATCHES_A_TIMEOUT], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
               for r in range(2)] for port in ports]
    procs = [p for world in worlds for p in world]
    try:
        before = {}
        for p in procs:  # every rank has imported torch and fdp ...
            lines = [p.stdout.readline()]
            while lines[-1] not in ("imported\n", ""):
                lines.append(p.stdout.readline())
            before[p] = "".join(lines)
        for p in procs:  # ... then all go to the rendezvous at once
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [[before[p] + p.communicate(timeout=60)[0] for p in world] for world in worlds]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for attempt, (world, (out0, _)) in enumerate(zip(worlds, outs)):
        codes = [p.returncode for p in world]
        assert codes == [3, 0], f"attempt {attempt}: exit codes {codes}\n{out0[-2000:]}"
        assert "caught" in out0 and "terminate called" not in out0, out0[-2000:]
