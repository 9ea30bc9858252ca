"""The nanoGPT-style optimizer recipe equals DDP + torch.optim bit for bit on 2 gloo ranks.

DDP + ``torch.optim.AdamW`` with two param groups (decay / no decay), ``clip_grad_norm_`` and
a ``LambdaLR`` warm-up + cosine, against ``reducer.grad`` + ``fdp.optim.chain(
clip_by_global_norm, adamw(warmup_cosine, mask=...))``, 50 steps. The math is the same
(DDP's bucketed mean equals fdp's, clip_by_global_norm calls torch's norm, AdamW the same
kernel per group, the schedule the same expression), so the params are compared with
``torch.equal``; the max abs difference is reported in the message if they ever differ.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from models import batch, ce_loss, init_
from torch import nn

import fdp

STEPS, PEAK, WARMUP, WD, MAX_NORM = 50, 3e-3, 10, 0.1, 0.5


def model() -> nn.Module:
    return init_(nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32),
                               nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 4)), seed=7)


def multiplier(t: int) -> float:
    """LambdaLR's warm-up + cosine, as a user writes it (nanoGPT's shape, no floor)."""
    if t < WARMUP:
        return t / WARMUP
    return (1 + math.cos(math.pi * (t - WARMUP) / (STEPS - WARMUP))) / 2


def decays(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2  # weights decay; biases and LayerNorm gains do not (nanoGPT's rule)


def both(group):
    ddp = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.004)
    named = list(ddp.module.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": WD},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ], lr=PEAK)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier)

    apply, params, buffers = fdp.functionalize(model())
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.004)
    grad_fn = reducer.grad(ce_loss(apply), has_aux=True)
    fopt = fdp.optim.chain(
        fdp.optim.clip_by_global_norm(MAX_NORM),
        fdp.optim.adamw(fdp.optim.schedules.warmup_cosine(PEAK, WARMUP, STEPS), weight_decay=WD,
                        mask=lambda path, p: p.dim() >= 2))
    state = fopt.init(params)
    norms = []
    for step in range(STEPS):
        x, y = batch(group.rank, step, n=8)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        grads, buffers = grad_fn(params, buffers, x, y)
        params, state = fopt.update(grads, state, params)
        norms.append((float(torch_norm), float(state.transforms[0].norm)))
    theirs = {k: v.detach().clone() for k, v in ddp.module.named_parameters()}
    return params, theirs, norms, int(state.optimizer.step)


def test_adamw_two_groups_clip_and_warmup_cosine_equal_ddp_bitwise_over_50_steps():
    res = fdp.testing.run(both, 2, backend="gloo", timeout=240)
    for rank, (mine, theirs, norms, count) in enumerate(res):
        assert count == STEPS
        assert any(t > MAX_NORM for t, _ in norms), "clipping never engaged: the test is too weak"
        for step, (t, f) in enumerate(norms):
            assert t == f, f"rank {rank}, step {step + 1}: grad norm {f} vs torch {t}"
        diffs = {k: (mine[k] - theirs[k]).abs().max().item() for k in theirs}
        for k in theirs:
            assert torch.equal(mine[k], theirs[k]), (
                f"rank {rank}, params[{k!r}] differs from DDP + torch.optim after {STEPS} steps; "
                f"max abs diff per leaf: {diffs}")
