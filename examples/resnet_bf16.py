"""A small ResNet with BatchNorm, data-parallel with fdp, gradients all-reduced in bfloat16.

Two ranks on this machine (CPU, gloo over 127.0.0.1):

    torchrun --standalone --nproc-per-node 2 examples/resnet_bf16.py

or a world of one (same file, no changes):

    python examples/resnet_bf16.py

What it shows:

* `fdp.Reducer(params, comm_hook=fdp.hooks.bf16_compress)`: every bucket is filled in
  bfloat16 (the 1/world scale and the cast fused into one copy, rounded once), summed in
  bfloat16 and decompressed into fp32 gradients. Half the bytes on the wire; bf16 keeps
  fp32's exponent range, so the sum cannot overflow (DDP's `bf16_compress_hook`).
* BatchNorm's running statistics are state, threaded through the pure function:
  `apply(params, buffers, x)` returns the new buffers, and `fdp.sync_buffers` makes the
  ranks agree once per step (rank 0's statistics win, as DDP's `broadcast_buffers=True`).
* `fdp.optim.sgd(momentum=0.9)` with a cosine learning-rate schedule (`lr` may be a function
  of the step), the optax-shaped `init` / `update` pair.
* Evaluation with `apply.eval()`: the same function with BatchNorm in eval mode.

The images are synthetic (nothing is downloaded): 16x16 RGB stripes whose *orientation* is
the class (0, 45, 90 or 135 degrees), with a random frequency, phase and colour per image
plus Gaussian noise. --plot writes timeline.png: the last step's backward and bucket
all-reduces.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import fdp

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=150)
p.add_argument("--batch-size", type=int, default=32, help="per rank")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--width", type=int, default=16, help="channels of the first stage")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--plot", action="store_true", help="write timeline.png (needs matplotlib)")
args = p.parse_args()

# --------------------------------------------------------------------------- the world
group = fdp.init()  # torchrun's env -> gloo (nccl on GPUs); plain python -> world of one
device = group.device
torch.manual_seed(args.seed)

# --------------------------------------------------------------------------- data
SIZE, CLASSES = 16, 4


def make_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy coloured stripes; the label is their orientation."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    angle = y.float() * (math.pi / CLASSES)
    freq = 0.6 + 0.6 * torch.rand(n, generator=g)  # radians per pixel
    phase = 2 * math.pi * torch.rand(n, generator=g)
    colour = 0.2 + 0.4 * torch.rand(n, 3, generator=g)
    r = torch.arange(SIZE, dtype=torch.float32)
    yy, xx = torch.meshgrid(r, r, indexing="ij")
    proj = xx * torch.cos(angle)[:, None, None] + yy * torch.sin(angle)[:, None, None]
    wave = torch.sin(freq[:, None, None] * proj + phase[:, None, None])  # [n, H, W]
    x = colour[:, :, None, None] * wave[:, None] + 1.0 * torch.randn(n, 3, SIZE, SIZE, generator=g)
    return x, y


test_x, test_y = make_images(2048, seed=args.seed * 1000 + 999)


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for `step`: fresh samples, different on every rank."""
    x, y = make_images(args.batch_size, seed=(args.seed * 1000 + step) * 64 + group.rank)
    return x.to(device), y.to(device)


# --------------------------------------------------------------------------- the model
class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convs with BatchNorm, plus the (projected) input."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.layer3 = BasicBlock(2 * width, 4 * width, stride=2)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(x.mean((2, 3)))


model = ResNet(args.width, CLASSES).to(device)
apply, params, buffers = fdp.functionalize(model)  # buffers: BatchNorm running statistics
params, buffers = fdp.broadcast((params, buffers), src=0)  # replicas start identical
reducer = fdp.Reducer(params, comm_hook=fdp.hooks.bf16_compress)  # bf16 on the wire


def lr_at(step: int) -> float:
    return args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine decay


opt = fdp.optim.sgd(lr=lr_at, momentum=0.9, weight_decay=5e-4)
opt_state = opt.init(params)


def loss_fn(params, buffers, x, y):
    logits, buffers = apply(params, buffers, x)  # pure: returns the updated BN statistics
    return F.cross_entropy(logits, y), buffers


grad_and_loss = reducer.grad_and_value(loss_fn, has_aux=True)

# --------------------------------------------------------------------------- train
t0 = time.perf_counter()
for step in range(args.steps):
    x, y = batch_at(step)
    grads, (loss, buffers) = grad_and_loss(params, buffers, x, y)
    buffers = fdp.sync_buffers(buffers)  # the explicit buffer step: rank 0's statistics win
    params, opt_state = opt.update(grads, opt_state, params)
    if group.is_main and step % 25 == 0:
        print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
elapsed = time.perf_counter() - t0

# --------------------------------------------------------------------------- evaluate
fdp.assert_replicas_equal((params, buffers))  # params and BN statistics identical everywhere
with torch.no_grad():
    logits, _ = apply.eval()(params, buffers, test_x.to(device))
accuracy = (logits.argmax(1).cpu() == test_y).float().mean().item()
if group.is_main:
    wire = sum(b.numel for b in reducer.plan.buckets) * 2  # bf16: 2 bytes per gradient element
    print(f"world {group.size}: {args.steps} steps in {elapsed:.1f}s, {wire / 1024:.0f} KiB of bf16 "
          f"gradients per step on the wire (fp32: {2 * wire / 1024:.0f} KiB); held-out accuracy "
          f"{accuracy:.3f} (chance {1 / CLASSES:.2f})", flush=True)
    if args.plot:
        import fdp.viz

        fdp.viz.plot_timeline(reducer.last_step.timeline, "timeline.png")
        print("wrote timeline.png", flush=True)
