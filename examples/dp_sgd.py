"""Differentially private SGD (DP-SGD), data-parallel with fdp.

Two ranks on this machine (CPU, gloo over 127.0.0.1):

    torchrun --standalone --nproc-per-node 2 examples/dp_sgd.py

or a world of one (same file, no changes):

    python examples/dp_sgd.py

DP-SGD (Abadi et al., 2016) needs every *sample's* gradient: each is clipped to norm C, the
clipped gradients are summed, Gaussian noise of standard deviation sigma * C is added to the
sum, and the result is divided by the batch size. With a module API that takes a hook per
layer or a second library; here it is three lines of function transforms:

    per_sample = vmap(grad(loss_of_one_sample), in_dims=(None, 0, 0))(params, x, y)

and the result is an ordinary gradient pytree that `reducer.all_reduce` averages over ranks.
Because the model is a pure function, per-sample gradients of a data-parallel model need
nothing from the data-parallel library, and the data-parallel step needs nothing from the
DP code. (DDP cannot take part at all: it only averages gradients accumulated into `.grad`.)

Where the noise goes. The global batch is split over W ranks, and the noise must be added
to the *global* sum exactly once, with standard deviation sigma * C. Two correct choices:

* add N(0, (sigma C)^2) on rank 0 only; or
* (used here) every rank adds N(0, (sigma C)^2 / W) from its own generator (a different
  seed per rank, so the draws are independent). The variances add: W * (sigma C)^2 / W =
  (sigma C)^2, the same total noise, and no rank is special (the same code runs on all
  ranks, and the noise costs every rank the same).

Either way the all-reduced gradient is identical on every rank, so the replicas stay
bit-identical. Two easy mistakes: every rank adding the full sigma * C (W times the intended
variance: a needlessly noisy model), or every rank drawing the *same* noise from a shared
seed (the sum is then W times one draw, again W times the intended variance). Per-rank seeds
and the 1/sqrt(W) scale avoid both.

Privacy accounting (turning sigma, the sampling rate and the step count into an (epsilon,
delta) guarantee, e.g. with Opacus' RDP accountant) is out of scope here, and a real DP run
samples batches with Poisson sampling; this example uses shuffled fixed-size batches.

The model is an MLP without BatchNorm: BatchNorm mixes samples within a batch, so per-sample
gradients (and the DP guarantee) would not be per sample. The data are Gaussian clusters,
one per class, generated from --seed; nothing is downloaded. --plot writes timeline.png: the
last step's bucket all-reduces.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

import fdp

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, default=64, help="per rank")
p.add_argument("--lr", type=float, default=0.5)
p.add_argument("--clip", type=float, default=1.0, help="C: per-sample gradient norm bound")
p.add_argument("--noise", type=float, default=1.0, help="sigma: noise multiplier")
p.add_argument("--width", type=int, default=128)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--plot", action="store_true", help="write timeline.png (needs matplotlib)")
args = p.parse_args()

# --------------------------------------------------------------------------- the world
group = fdp.init()  # torchrun's env -> gloo (nccl on GPUs); plain python -> world of one
device = group.device
torch.manual_seed(args.seed)
# The DP noise generator: a different seed on every rank, so the ranks' draws are independent.
noise_gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + 7 + group.rank)

# --------------------------------------------------------------------------- data
FEATURES, CLASSES = 32, 10


def make_dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy Gaussian clusters: class c is centred on a fixed random point."""
    g = torch.Generator().manual_seed(args.seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    g.manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return centres[y] + torch.randn(n, FEATURES, generator=g), y


train_x, train_y = make_dataset(16384, seed=args.seed + 1)
test_x, test_y = make_dataset(4096, seed=args.seed + 2)
per_step = args.batch_size * group.size
steps_per_epoch = len(train_x) // per_step


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the global batch `step` of a per-epoch shuffle."""
    epoch, i = divmod(step, steps_per_epoch)
    order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
    idx = order[i * per_step : (i + 1) * per_step][group.rank :: group.size]
    return train_x[idx].to(device), train_y[idx].to(device)


# --------------------------------------------------------------------------- the model
model = nn.Sequential(
    nn.Linear(FEATURES, args.width), nn.Tanh(),
    nn.Linear(args.width, args.width), nn.Tanh(),
    nn.Linear(args.width, CLASSES),
).to(device)
apply, params, buffers = fdp.functionalize(model)  # no BatchNorm: `buffers` is empty
params = fdp.broadcast(params, src=0)  # replicas start identical
reducer = fdp.Reducer(params)
opt = fdp.optim.sgd(lr=args.lr)
opt_state = opt.init(params)


def loss_of_one(params, x, y):
    """The loss of ONE sample (x: [FEATURES], y: []): vmap adds the batch dimension."""
    logits, _ = apply(params, buffers, x.unsqueeze(0))
    return F.cross_entropy(logits, y.unsqueeze(0))


per_sample_grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0))  # leaves: [B, *param.shape]


def private_grad(params, x, y):
    """This rank's share of the DP-SGD gradient: (clipped sum + its share of the noise) / B."""
    g = per_sample_grads(params, x, y)
    # Each sample's norm over ALL its parameters, then scale it down to at most C.
    norms = torch.sqrt(sum(t.flatten(1).pow(2).sum(1) for t in g.values()))
    factor = (args.clip / (norms + 1e-6)).clamp(max=1.0)  # [B]
    std = args.noise * args.clip / math.sqrt(group.size)  # W ranks: variances add to (sigma C)^2
    out = {}
    for n, t in g.items():
        clipped_sum = torch.einsum("b,b...->...", factor, t)
        noise = torch.randn(t.shape[1:], generator=noise_gen, device=device) * std
        # Divide by the local batch: the mean over W ranks then divides the global sum by
        # W * B, the global batch size.
        out[n] = (clipped_sum + noise) / len(x)
    return out, norms


# --------------------------------------------------------------------------- train
t0 = time.perf_counter()
for step in range(args.steps):
    x, y = batch_at(step)
    grads, norms = private_grad(params, x, y)
    grads = reducer.all_reduce(grads)  # the mean over ranks: (global clipped sum + noise) / (W B)
    params, opt_state = opt.update(grads, opt_state, params)
    if group.is_main and step % 50 == 0:
        clipped = (norms > args.clip).float().mean().item()
        print(f"step {step:5d}  median per-sample grad norm {norms.median().item():.3f}  "
              f"clipped {clipped:.0%}", flush=True)
elapsed = time.perf_counter() - t0

# --------------------------------------------------------------------------- evaluate
fdp.assert_replicas_equal(params)  # different noise on every rank, identical replicas
with torch.no_grad():
    logits, _ = apply.eval()(params, buffers, test_x.to(device))
accuracy = (logits.argmax(1).cpu() == test_y).float().mean().item()
if group.is_main:
    print(f"world {group.size}: {args.steps} DP-SGD steps (C={args.clip}, sigma={args.noise}, "
          f"global batch {per_step}) in {elapsed:.1f}s; held-out accuracy {accuracy:.3f} "
          f"(chance {1 / CLASSES:.2f})", flush=True)
    if args.plot:
        import fdp.viz

        fdp.viz.plot_timeline(reducer.last_step.timeline, "timeline.png")
        print("wrote timeline.png", flush=True)
