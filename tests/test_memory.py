"""No fresh memory per step in steady state: the plain and the fused step take (almost) no
minor page faults once warm, as DDP's reused buckets do. Counted with getrusage in
a fresh process, since the allocator setting is per process (``fdp.init(malloc=)``,
fdp/_comm/lifetime.py). The plain step
is timed with an update that allocates nothing itself (torch.optim's per-leaf kernels make
temporaries of each leaf's size: those are torch.optim's, and DDP + torch.optim has them too);
the fused step with AdamW, whose update is fdp's."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, resource, sys, torch, torch.nn as nn, torch.nn.functional as F, fdp
torch.set_num_threads(1)
torch.manual_seed(0)
fdp.init()  # malloc: FDP_MALLOC, else 'keep'
net = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
apply, params, buffers = fdp.functionalize(net)
reducer = fdp.Reducer(params)
x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
loss = lambda p, x, y: F.cross_entropy(apply(p, buffers, x)[0], y)

def faults(run, steps=11, warm=5):  # the median step, as python -m fdp.bench reports it
    for _ in range(warm):
        run()
    counts = []
    for _ in range(steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return sorted(counts)[steps // 2]

plain = {"params": {k: v.clone() for k, v in params.items()}}
def plain_step():  # reducer.grad and an update that allocates nothing itself
    g = reducer.grad(loss)(plain["params"], x, y)
    torch._foreach_add_(list(plain["params"].values()), list(g.values()), alpha=-1e-3)

fused_opt = fdp.optim.adamw(lr=1e-3)
step = reducer.grad_and_update(loss, fused_opt)
fused = {"params": {k: v.clone() for k, v in params.items()}}
fused["state"] = step.init(fused["params"])
def fused_step():
    fused["params"], fused["state"], _ = step(fused["params"], fused["state"], x, y)

print(json.dumps({"plain": faults(plain_step), "fused": faults(fused_step)}))
"""


def faults_per_step(env_malloc: str) -> dict:
    env = {"FDP_MALLOC": env_malloc, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_steady_state_steps_take_no_page_faults():
    kept = faults_per_step("keep")
    # 34 MiB of params: a step that faulted its gradients in afresh would take ~8,700 faults.
    # (The median step: now and then the heap still grows by one gradient-sized block.)
    assert kept["plain"] < 100 and kept["fused"] < 100, kept
