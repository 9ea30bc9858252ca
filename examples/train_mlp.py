"""Train an MLP with BatchNorm on synthetic data, data-parallel with fdp.

Two ranks on this machine (CPU, gloo over 127.0.0.1):

    torchrun --standalone --nproc-per-node 2 examples/train_mlp.py

or a world of one (same file, no changes):

    python examples/train_mlp.py

Every --ckpt-every steps the whole train state (params, buffers, optimizer state, step,
per-rank RNG states) is saved atomically to --ckpt; --resume continues from it, bit for bit.
Under `torchrun --max-restarts=1 ... --resume` a crashed run restarts from its last
checkpoint by itself. --plot writes timeline.png: one step's backward and bucket all-reduces.

The data are Gaussian clusters, one per class, generated from --seed (nothing is
downloaded); each rank trains on its own shard of a per-epoch shuffle, as
DistributedSampler(ds, num_replicas=group.size, rank=group.rank) would give it (pass the
group's numbers: without them DistributedSampler asks for a process group, which a world
of one does not have).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import fdp

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=400)
p.add_argument("--batch-size", type=int, default=64, help="per rank")
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--width", type=int, default=256)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--ckpt", default="runs/train_mlp/ckpt.pt")
p.add_argument("--ckpt-every", type=int, default=100)
p.add_argument("--resume", action="store_true", help="continue from --ckpt if it exists")
p.add_argument("--out", default=None, help="save the final params here (for comparisons)")
p.add_argument("--plot", action="store_true", help="write timeline.png (needs matplotlib)")
p.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this held-out accuracy")
p.add_argument("--crash-at-step", type=int, default=None,
               help="fault injection for tests: --crash-rank dies here on the first attempt")
p.add_argument("--crash-rank", type=int, default=1)
args = p.parse_args()

# --------------------------------------------------------------------------- the world
group = fdp.init()  # torchrun's env -> gloo (nccl on GPUs); plain python -> world of one
device = group.device
torch.manual_seed(args.seed)  # same model init everywhere (and broadcast below anyway)

# --------------------------------------------------------------------------- data
FEATURES, CLASSES = 32, 10


def make_dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy Gaussian clusters: class c is centred on a fixed random point."""
    g = torch.Generator().manual_seed(args.seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    g.manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[y] + torch.randn(n, FEATURES, generator=g)
    return x, y


train_x, train_y = make_dataset(16384, seed=args.seed + 1)
test_x, test_y = make_dataset(4096, seed=args.seed + 2)
per_step = args.batch_size * group.size
steps_per_epoch = len(train_x) // per_step


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for global step `step`: a function of (seed, epoch, rank) only,
    so a resumed run sees exactly the batches the uninterrupted run would have."""
    epoch, i = divmod(step, steps_per_epoch)
    order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
    idx = order[i * per_step : (i + 1) * per_step][group.rank :: group.size]
    return train_x[idx].to(device), train_y[idx].to(device)


# --------------------------------------------------------------------------- the model
model = nn.Sequential(
    nn.Linear(FEATURES, args.width), nn.BatchNorm1d(args.width), nn.ReLU(),
    nn.Linear(args.width, args.width), nn.BatchNorm1d(args.width), nn.ReLU(),
    nn.Linear(args.width, CLASSES),
).to(device)
apply, params, buffers = fdp.functionalize(model)  # pure function + two dicts of tensors
params, buffers = fdp.broadcast((params, buffers), src=0)  # replicas start identical

reducer = fdp.Reducer(params)  # 25 MiB buckets, 1 MiB first bucket (DDP's defaults)
opt = fdp.optim.adamw(lr=args.lr, weight_decay=1e-4)


def loss_fn(params, buffers, x, y):
    logits, buffers = apply(params, buffers, x)  # pure: returns the updated BN statistics
    return F.cross_entropy(logits, y), buffers


# Averaged gradients, with the all-reduce overlapping the backward; the returned buffers
# are this rank's new BatchNorm statistics.
grad_and_loss = reducer.grad_and_value(loss_fn, has_aux=True)

# --------------------------------------------------------------------------- train state
state = {
    "params": params,
    "buffers": buffers,
    "opt": opt.init(params),
    "step": 0,
    "rng": fdp.rng_state(),  # every rank's RNG, gathered (a collective)
    "meta": {"width": args.width, "seed": args.seed},
}
if args.resume and os.path.exists(args.ckpt):
    state = fdp.load(args.ckpt, like=state)
    fdp.set_rng_state(state["rng"])
    if group.is_main:
        print(f"resumed from {args.ckpt} at step {state['step']}", flush=True)
params, buffers, opt_state = state["params"], state["buffers"], state["opt"]
start = state["step"]

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
progress = None
if group.is_main:
    try:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    except ImportError:  # tqdm is in the `examples` extra; plain prints otherwise
        pass

t0 = time.perf_counter()
for step in range(start, args.steps):
    if step == args.crash_at_step and group.rank == args.crash_rank and attempt == 0:
        os._exit(17)  # fault injection: die mid-run without any cleanup

    x, y = batch_at(step)
    (grads, (loss, buffers)) = grad_and_loss(params, buffers, x, y)
    buffers = fdp.sync_buffers(buffers)  # the explicit buffer step: rank 0's statistics win
    params, opt_state = opt.update(grads, opt_state, params)

    if progress is not None:
        progress.update(1)
        if step % 10 == 0:
            progress.set_postfix(loss=f"{loss.item():.3f}")
    elif group.is_main and step % 50 == 0:
        print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)

    if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
        os.makedirs(os.path.dirname(os.path.abspath(args.ckpt)), exist_ok=True)
        state = {"params": params, "buffers": buffers, "opt": opt_state, "step": step + 1,
                 "rng": fdp.rng_state(), "meta": state["meta"]}
        fdp.save(args.ckpt, state)
if progress is not None:
    progress.close()
elapsed = time.perf_counter() - t0

# --------------------------------------------------------------------------- evaluate
fdp.assert_replicas_equal((params, buffers))  # cheap: one hash per leaf, one small all-gather
with torch.no_grad():
    logits, _ = apply.eval()(params, buffers, test_x.to(device))
accuracy = (logits.argmax(1).cpu() == test_y).float().mean().item()
if group.is_main:
    print(f"world {group.size}: {args.steps - start} steps in {elapsed:.1f}s; held-out accuracy "
          f"{accuracy:.3f} (chance {1 / CLASSES:.2f})", flush=True)
    if args.out:
        torch.save({k: v.cpu() for k, v in params.items()}, args.out)
if args.plot:
    import fdp.viz  # (matplotlib) on every rank, and then a barrier: no rank starts late

    fdp.any_rank(False)
    grad_and_loss(params, buffers, *batch_at(0))  # one more step, to draw (not applied)
    if group.is_main:
        fdp.viz.plot_timeline(reducer.last_step.timeline, "timeline.png")
        print("wrote timeline.png", flush=True)
if accuracy < args.min_accuracy:
    raise SystemExit(f"held-out accuracy {accuracy:.3f} is below --min-accuracy {args.min_accuracy}")
