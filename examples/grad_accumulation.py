"""Gradient accumulation with fdp: k micro-batches per step, one all-reduce per step.

Two ranks on this machine (CPU, gloo over 127.0.0.1):

    torchrun --standalone --nproc-per-node 2 examples/grad_accumulation.py

or a world of one (same file, no changes):

    python examples/grad_accumulation.py

DDP does this with a context manager (`no_sync()`) that must wrap the *forward* of every
micro-batch but the last. In fdp it is a call-site choice: the first k-1 micro-batches use a
plain local `torch.func.grad` (no communication at all) and their gradients are summed; the
last one uses `reducer.grad(loss_fn, accumulate=acc)`, which adds `acc` into the last
micro-batch's gradients as they are bucketed, so that bucket's all-reduce still overlaps the
last backward.

Each micro-batch's loss is divided by k, so the accumulated gradient is the gradient of the
mean loss over the concatenated batch. Every --check-every steps (and on the last step) the
script also computes that big-batch gradient directly and prints the largest difference:
equal within float tolerance. (This holds for models without BatchNorm: BatchNorm's batch
statistics depend on how the batch is split. The model here uses LayerNorm.)

The data are Gaussian clusters, one per class, generated from --seed; nothing is downloaded.
--plot writes timeline.png: the last step's backward and bucket all-reduces.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import fdp

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=100)
p.add_argument("--micro-batches", type=int, default=4, help="k: micro-batches per step")
p.add_argument("--micro-batch-size", type=int, default=16, help="per rank")
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--width", type=int, default=256)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--check-every", type=int, default=25, help="compare with the big-batch gradient")
p.add_argument("--plot", action="store_true", help="write timeline.png (needs matplotlib)")
args = p.parse_args()

# --------------------------------------------------------------------------- the world
group = fdp.init()  # torchrun's env -> gloo (nccl on GPUs); plain python -> world of one
device = group.device
torch.manual_seed(args.seed)

# --------------------------------------------------------------------------- data
FEATURES, CLASSES = 32, 10
k, mb = args.micro_batches, args.micro_batch_size


def make_dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy Gaussian clusters: class c is centred on a fixed random point."""
    g = torch.Generator().manual_seed(args.seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    g.manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return centres[y] + torch.randn(n, FEATURES, generator=g), y


test_x, test_y = make_dataset(4096, seed=args.seed + 2)
# Each rank draws its own stream of samples (a different seed per rank).
stream = torch.Generator().manual_seed(args.seed * 1000 + 100 + group.rank)


def next_micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = make_dataset(k * mb, seed=int(torch.randint(0, 2**31, (), generator=stream)))
    return [(x[i * mb : (i + 1) * mb].to(device), y[i * mb : (i + 1) * mb].to(device)) for i in range(k)]


# --------------------------------------------------------------------------- the model
model = nn.Sequential(
    nn.Linear(FEATURES, args.width), nn.LayerNorm(args.width), nn.GELU(),
    nn.Linear(args.width, args.width), nn.LayerNorm(args.width), nn.GELU(),
    nn.Linear(args.width, CLASSES),
).to(device)
apply, params, buffers = fdp.functionalize(model)  # no BatchNorm: `buffers` is empty
params = fdp.broadcast(params, src=0)  # replicas start identical
reducer = fdp.Reducer(params)
opt = fdp.optim.adamw(lr=args.lr, weight_decay=1e-4)
opt_state = opt.init(params)


def micro_loss(params, x, y):
    """One micro-batch's share of the step's loss: its mean loss divided by k."""
    logits, _ = apply(params, buffers, x)
    return F.cross_entropy(logits, y) / k


def big_loss(params, x, y):
    """The loss of the same samples as one batch (for the check)."""
    logits, _ = apply(params, buffers, x)
    return F.cross_entropy(logits, y)


local_grad = torch.func.grad(micro_loss)  # no communication: just this rank's gradients

# --------------------------------------------------------------------------- train
worst, checks = 0.0, 0
t0 = time.perf_counter()
for step in range(args.steps):
    micro = next_micro_batches()

    if step % args.check_every == 0 or step == args.steps - 1:
        # The reference: one all-reduced step on the concatenated batch (not applied).
        big = reducer.grad(big_loss)(params, torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))

    # Micro-batches 1..k-1: local gradients, summed. No collective is issued here.
    acc = None
    for x, y in micro[:-1]:
        g = local_grad(params, x, y)
        acc = g if acc is None else {n: acc[n] + g[n] for n in g}
    # Micro-batch k: its backward fills the buckets with (its grads + acc) and all-reduces
    # them while it still runs. `accumulate=None` (k == 1) is an ordinary step.
    x, y = micro[-1]
    grads = reducer.grad(micro_loss, accumulate=acc)(params, x, y)

    if step % args.check_every == 0 or step == args.steps - 1:
        diff = max((grads[n] - big[n]).abs().max().item() for n in grads)
        scale = max(big[n].abs().max().item() for n in big)
        if diff > 1e-5 * max(1.0, scale):
            raise SystemExit(f"step {step}: accumulated gradients differ from the big batch's by {diff:.3g}")
        worst, checks = max(worst, diff), checks + 1
        if group.is_main:
            print(f"step {step:4d}  accumulated vs big-batch gradients: max |diff| {diff:.2e}", flush=True)

    params, opt_state = opt.update(grads, opt_state, params)
elapsed = time.perf_counter() - t0

# --------------------------------------------------------------------------- evaluate
fdp.assert_replicas_equal(params)  # cheap: one hash per leaf, one small all-gather
with torch.no_grad():
    logits, _ = apply.eval()(params, buffers, test_x.to(device))
accuracy = (logits.argmax(1).cpu() == test_y).float().mean().item()
if group.is_main:
    print(f"world {group.size}: {args.steps} steps of {k} x {mb} samples per rank in {elapsed:.1f}s; "
          f"accumulated == big-batch gradients (max |diff| {worst:.1e} over {checks} checks); "
          f"held-out accuracy {accuracy:.3f} (chance {1 / CLASSES:.2f})", flush=True)
    if args.plot:
        import fdp.viz

        fdp.viz.plot_timeline(reducer.last_step.timeline, "timeline.png",
                              title=f"last step: micro-batch {k} of {k} (accumulate=)")
        print("wrote timeline.png", flush=True)
