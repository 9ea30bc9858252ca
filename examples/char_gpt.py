"""A character-level GPT trained with the nanoGPT recipe, data-parallel with fdp.

Two ranks on this machine (CPU, gloo over 127.0.0.1):

    torchrun --standalone --nproc-per-node 2 examples/char_gpt.py

or a world of one (same file, no changes):

    python examples/char_gpt.py

The recipe is nanoGPT's train.py (karpathy/nanoGPT), written with fdp:

* AdamW with betas (0.9, 0.95) and weight decay 0.1 on the 2-D weights only (matrices and
  embeddings decay; biases and LayerNorm gains do not): ``fdp.optim.adamw(mask=...)``, the
  same as nanoGPT's two param groups;
* gradient clipping at global norm 1.0 in front of it: ``fdp.optim.chain(clip_by_global_norm)``;
* a linear warm-up, then cosine decay to lr / 10: ``fdp.optim.schedules.warmup_cosine``, a
  function of the optimizer's own step count (so it resumes with the state);
* gradient accumulation over --micro-batches: ``step.accumulate`` for all but the last
  micro-batch (DDP's ``no_sync()``: this rank's gradients added, in place, into the fused
  step's own flat buffers, no communication), then the fused step, whose all-reduce overlaps
  the last backward and whose AdamW runs on the flat buckets (after the last one: clipping
  needs the global norm); the same numbers as DDP's loop, bit for bit;
* an evaluation every --eval-every steps: the validation loss averaged over ranks
  (``fdp.pmean``);
* a checkpoint of the whole train state every --ckpt-every steps; --resume continues from it
  bit for bit (the batches are a function of the step, the schedule of the saved count);
* --shard keeps 1/world of AdamW's state per rank (ZeRO-1/2: ``fdp.Reducer(..., shard=True)``);
  --shard params keeps 1/world of the params, gradients and state too (ZeRO-3, FSDP:
  ``fdp.Reducer(..., shard="params", units=fdp.units(model, Block))``; each block is gathered
  just before it runs and freed after). The checkpoint is the same per-leaf state either way
  (``state_to_tree`` and ``params.full()`` gather it), so a run may resume sharded or not, on
  any world size.

The text is generated here from --seed (a small made-up language of short sentences):
nothing is downloaded. The model is tiny (two blocks, 64 wide); the point is the loop.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

import fdp

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=300, help="optimizer steps (the schedule's length)")
p.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation steps")
p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per rank")
p.add_argument("--block", type=int, default=32, help="context length")
p.add_argument("--width", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps // 10)")
p.add_argument("--eval-every", type=int, default=100)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--ckpt", default="runs/char_gpt/ckpt.pt")
p.add_argument("--ckpt-every", type=int, default=100)
p.add_argument("--resume", action="store_true", help="continue from --ckpt if it exists")
p.add_argument("--stop-at", type=int, default=None, help="save and stop after this step (to test resuming)")
p.add_argument("--out", default=None, help="save the final params here (for comparisons)")
p.add_argument("--shard", nargs="?", const="state", default=None, choices=["state", "params"],
               help="shard the optimizer state over the ranks (ZeRO-1/2); 'params': the params too (ZeRO-3)")
args = p.parse_args()

# --------------------------------------------------------------------------- the world
group = fdp.init()  # torchrun's env -> gloo (nccl on GPUs); plain python -> world of one
device = group.device
torch.manual_seed(args.seed)  # same model init everywhere (and broadcast below anyway)


# --------------------------------------------------------------------------- data
def make_text(n_sentences: int, seed: int) -> str:
    """Short sentences of a made-up language: learnable structure, nothing downloaded."""
    rng = random.Random(seed)
    names = ["ada", "bo", "cyd", "dot", "eve", "fitz", "gus", "hal"]
    verbs = ["sees", "likes", "finds", "paints", "hides", "greets"]
    things = ["a red box", "the old map", "two small cats", "a blue kite", "the last pie"]
    places = ["at home", "by the sea", "in the park", "under a tree"]
    out = []
    for _ in range(n_sentences):
        s = f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(things)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(places)}"
        out.append(s + ".\n")
    return "".join(out)


train_text, val_text = make_text(20000, args.seed + 1), make_text(2000, args.seed + 2)
chars = sorted(set(train_text + val_text))
vocab = len(chars)
encode = {c: i for i, c in enumerate(chars)}
train_data = torch.tensor([encode[c] for c in train_text])
val_data = torch.tensor([encode[c] for c in val_text])


def get_batch(data: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `data`, a function of `seed` only (so a resumed run sees the same)."""
    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(data) - args.block - 1, (args.batch_size,), generator=g)
    x = torch.stack([data[i : i + args.block] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + args.block] for i in ix])
    return x.to(device), y.to(device)


def batch_seed(step: int, micro: int) -> int:
    return ((args.seed * 1_000_003 + step) * 64 + micro) * 1024 + group.rank


# --------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, args.width)
        self.wpe = nn.Embedding(args.block, args.width)
        self.blocks = nn.ModuleList(Block(args.width, args.heads) for _ in range(args.layers))
        self.ln_f = nn.LayerNorm(args.width)
        self.head = nn.Linear(args.width, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying; functionalize keeps it once
        for name, prm in self.named_parameters():  # nanoGPT's init
            if prm.dim() >= 2:
                std = 0.02 / math.sqrt(2 * args.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(prm, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


model = GPT().to(device)
apply, params, buffers = fdp.functionalize(model)
params, buffers = fdp.broadcast((params, buffers), src=0)  # replicas start identical
fully_sharded = args.shard == "params"
units = fdp.units(model, Block) if fully_sharded else None  # one unit per block; the rest is the root
reducer = fdp.Reducer(params, shard=args.shard or False, units=units)

# nanoGPT's optimizer: decay the 2-D weights only, clip at 1.0, warm-up + cosine to lr / 10.
warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
opt = fdp.optim.chain(
    fdp.optim.clip_by_global_norm(1.0),
    fdp.optim.adamw(
        lr=fdp.optim.schedules.warmup_cosine(args.lr, warmup, args.steps, final=args.lr / 10),
        betas=(0.9, 0.95), weight_decay=0.1, mask=lambda path, prm: prm.dim() >= 2,
    ),
)
k = args.micro_batches


def loss_fn(params, buffers, x, y):
    """One micro-batch's share of the step's loss (mean over its tokens, divided by k)."""
    logits, buffers = apply(params, buffers, x)
    return F.cross_entropy(logits.view(-1, vocab), y.view(-1)) / k, buffers


@torch.no_grad()
def evaluate(params, buffers, batches: int = 4) -> float:
    """Validation loss: the same windows on every run, a different share on each rank."""
    losses = [F.cross_entropy(apply(params, buffers, x)[0].view(-1, vocab), y.view(-1)).item()
              for x, y in (get_batch(val_data, 10_000 + 97 * i + group.rank) for i in range(batches))]
    return fdp.pmean(sum(losses) / len(losses))  # the same number on every rank


# --------------------------------------------------------------------------- train state
state = {"params": params, "buffers": buffers, "opt": opt.init(params), "step": 0,
         "meta": {"width": args.width, "layers": args.layers, "seed": args.seed}}
if args.resume and os.path.exists(args.ckpt):
    state = fdp.load(args.ckpt, like=state)
    if group.is_main:
        print(f"resumed from {args.ckpt} at step {state['step']}", flush=True)
params, buffers, start = state["params"], state["buffers"], state["step"]
# The fused step: params, grads and AdamW's state in flat buckets, one kernel call per bucket.
# Its state is flat; checkpoints hold opt.init's per-leaf layout (loads into any plan or world).
fused = reducer.grad_and_update(loss_fn, opt, has_aux=True)
opt_state = fused.state_from_tree(state["opt"], params)
n_params = sum(v.numel() for v in params.values())
if fully_sharded:  # this rank keeps its slices of the params; the whole copies go
    params = fused.shard(params)
    model.to("meta")
    del state["params"]
first_val = evaluate(params, buffers)
if group.is_main:
    print(f"world {group.size}: vocab {vocab}, {n_params:,} params; "
          f"step {start} val loss {first_val:.4f} (uniform: {math.log(vocab):.4f})", flush=True)

t0 = time.perf_counter()
for step in range(start, args.steps):
    # Micro-batches 1..k-1: this rank's gradients, added into the step's buffers; no collective.
    for micro in range(k - 1):
        _, buffers = fused.accumulate(params, buffers, *get_batch(train_data, batch_seed(step, micro)))
    # Micro-batch k: its backward adds its gradients to the sum and all-reduces them as it runs.
    x, y = get_batch(train_data, batch_seed(step, k - 1))
    params, opt_state, (loss, buffers) = fused(params, opt_state, buffers, x, y)

    done = step + 1
    if group.is_main and (step % 25 == 0 or done == args.steps):
        info = fused.inspect(opt_state)  # the lr, the clip's norm, ... of this step (no collective)
        print(f"step {done:5d}  loss {loss.item() * k:.4f}  grad norm {info.clip_norm:.3f}  lr {info.lr:.2e}",
              flush=True)
    if done % args.eval_every == 0 or done == args.steps:
        val = evaluate(params, buffers)
        if group.is_main:
            print(f"step {done:5d}  val loss {val:.4f} (mean over {group.size} ranks)", flush=True)
    if done % args.ckpt_every == 0 or done == args.steps or done == args.stop_at:
        os.makedirs(os.path.dirname(os.path.abspath(args.ckpt)), exist_ok=True)
        whole = params.full() if fully_sharded else params  # (gathered: fine for a small model)
        state = {"params": whole, "buffers": buffers, "opt": fused.state_to_tree(opt_state, params),
                 "step": done, "meta": state["meta"]}
        fdp.save(args.ckpt, state)
    if done == args.stop_at:
        if group.is_main:
            print(f"stopped after step {done} (--stop-at); continue with --resume", flush=True)
        raise SystemExit(0)
elapsed = time.perf_counter() - t0

# --------------------------------------------------------------------------- report
whole = params.full() if fully_sharded else params
fdp.assert_replicas_equal(whole)  # cheap: one checksum per leaf
final_val = evaluate(params, buffers)
ctx = torch.tensor([[encode["a"]]], device=device)
with torch.no_grad():  # on every rank: fully sharded params are gathered unit by unit (a collective)
    for _ in range(60):  # greedy sample: the language's structure should show
        logits, _ = apply(params, buffers, ctx[:, -args.block :])
        ctx = torch.cat([ctx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
if group.is_main:
    sample = "".join(chars[i] for i in ctx[0].tolist()).replace("\n", " | ")
    print(f"sample: {sample}", flush=True)
    print(f"world {group.size}: {args.steps - start} steps of {k} x {args.batch_size} sequences per "
          f"rank in {elapsed:.1f}s; val loss {first_val:.4f} -> {final_val:.4f}", flush=True)
    if args.out:
        torch.save({n: v.cpu() for n, v in whole.items()}, args.out)
