"""Uneven inputs with fdp: ranks with different numbers of batches finish together.

Two ranks on this machine (CPU, gloo over 127.0.0.1):

    torchrun --standalone --nproc-per-node 2 examples/uneven_inputs.py

or a world of one (same file, no changes; nothing is uneven then):

    python examples/uneven_inputs.py

Rank r holds --batches + 3r batches per epoch. If every rank simply looped over its own
data, the ranks with fewer batches would leave the loop early and the others would wait
forever in an all-reduce nobody else joins (DDP's `join()` context manager exists for this).
In fdp the loop condition is itself a collective,

    while fdp.any_rank(batch is not None):

so every rank takes the same number of steps. A rank without a batch still takes part in
the step: it passes `grads=None, active=False` to `reducer.all_reduce`, contributes zeros,
and the mean is taken over the active ranks only. Every rank, active or not, receives that
mean and applies it, so the replicas stay bit-identical (checked with
`fdp.assert_replicas_equal` at the end of every epoch).

The data are Gaussian clusters, one per class, generated from --seed; nothing is downloaded.
--plot writes timeline.png: the last step's bucket all-reduces (there is no overlapped
backward here: the gradients come from a plain `torch.func.grad`).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import fdp

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--epochs", type=int, default=5)
p.add_argument("--batches", type=int, default=10, help="batches per epoch on rank 0; rank r has 3r more")
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--width", type=int, default=128)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--plot", action="store_true", help="write timeline.png (needs matplotlib)")
args = p.parse_args()

# --------------------------------------------------------------------------- the world
group = fdp.init()  # torchrun's env -> gloo (nccl on GPUs); plain python -> world of one
device = group.device
torch.manual_seed(args.seed)

# --------------------------------------------------------------------------- data
FEATURES, CLASSES = 32, 10
my_batches = args.batches + 3 * group.rank  # uneven on purpose


def make_dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy Gaussian clusters: class c is centred on a fixed random point."""
    g = torch.Generator().manual_seed(args.seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    g.manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return centres[y] + torch.randn(n, FEATURES, generator=g), y


# This rank's shard: its own samples, a different amount on every rank.
train_x, train_y = make_dataset(my_batches * args.batch_size, seed=args.seed * 1000 + 10 + group.rank)
test_x, test_y = make_dataset(4096, seed=args.seed + 2)


def batches(epoch: int):
    """This rank's batches for one epoch, then the end (a loader of uneven length)."""
    order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(epoch))
    for i in range(my_batches):
        idx = order[i * args.batch_size : (i + 1) * args.batch_size]
        yield train_x[idx].to(device), train_y[idx].to(device)


# --------------------------------------------------------------------------- the model
model = nn.Sequential(
    nn.Linear(FEATURES, args.width), nn.ReLU(),
    nn.Linear(args.width, args.width), nn.ReLU(),
    nn.Linear(args.width, CLASSES),
).to(device)
apply, params, buffers = fdp.functionalize(model)
params = fdp.broadcast(params, src=0)  # replicas start identical
reducer = fdp.Reducer(params)
opt = fdp.optim.sgd(lr=args.lr, momentum=0.9)
opt_state = opt.init(params)


def loss_fn(params, x, y):
    logits, _ = apply(params, buffers, x)
    return F.cross_entropy(logits, y)


local_grad = torch.func.grad(loss_fn)

# --------------------------------------------------------------------------- train
steps = idle = 0  # steps taken by this rank; steps in which it had no batch
t0 = time.perf_counter()
for epoch in range(args.epochs):
    loader = batches(epoch)
    batch = next(loader, None)
    while fdp.any_rank(batch is not None):  # one tiny all-reduce: the same answer everywhere
        active = batch is not None
        grads = local_grad(params, *batch) if active else None
        # Inactive ranks contribute zeros; the mean is over the active ranks.
        grads = reducer.all_reduce(grads, active=active)
        params, opt_state = opt.update(grads, opt_state, params)  # every rank applies it
        steps, idle = steps + 1, idle + (not active)
        batch = next(loader, None)
    fdp.assert_replicas_equal(params)  # raises, naming the leaf and ranks, if they drifted
elapsed = time.perf_counter() - t0

# Every rank took the same number of steps, whatever its data: check that too.
fdp.assert_replicas_equal({"steps": torch.tensor(steps)})

# --------------------------------------------------------------------------- evaluate
with torch.no_grad():
    logits, _ = apply.eval()(params, buffers, test_x.to(device))
accuracy = (logits.argmax(1).cpu() == test_y).float().mean().item()
print(f"rank {group.rank}: {my_batches} batches per epoch; {steps} steps, idle (active=False) in {idle}",
      flush=True)
if group.is_main:
    print(f"world {group.size}: every rank took {steps} steps in {elapsed:.1f}s and the replicas are "
          f"identical; held-out accuracy {accuracy:.3f} (chance {1 / CLASSES:.2f})", flush=True)
    if args.plot:
        import fdp.viz

        fdp.viz.plot_timeline(reducer.last_step.timeline, "timeline.png")
        print("wrote timeline.png", flush=True)
