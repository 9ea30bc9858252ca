"""``python -m fdp.bench replicas``: what ``fdp.assert_replicas_equal`` costs per step.

Two gloo ranks run the step of ``examples/train_mlp.py`` (MLP with BatchNorm, width 256,
batch 64 per rank, AdamW, the buffer step) three ways, interleaved: without a check, with a
blocking ``assert_replicas_equal((params, buffers))`` after every step, and with the check
launched after every step (``wait=False``) and waited for after the next; medians, warm-up
excluded. Target: the check adds <= 5% to the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fdp


def _measure(group: fdp.Group, cfg: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = cfg.width
    model = nn.Sequential(nn.Linear(32, w), nn.BatchNorm1d(w), nn.ReLU(), nn.Linear(w, w),
                          nn.BatchNorm1d(w), nn.ReLU(), nn.Linear(w, 10))
    apply, params, buffers = fdp.functionalize(model)
    params, buffers = fdp.broadcast((params, buffers), group=group)
    reducer = fdp.Reducer(params, group)
    opt = fdp.optim.adamw(lr=1e-3, weight_decay=1e-4)
    opt_state = opt.init(params)

    def loss_fn(p, b, x, y):
        out, b = apply(p, b, x)
        return F.cross_entropy(out, y), b

    grad_fn = reducer.grad(loss_fn, has_aux=True)
    g = torch.Generator().manual_seed(group.rank)
    x, y = torch.randn(cfg.batch_size, 32, generator=g), torch.randint(0, 10, (cfg.batch_size,), generator=g)
    def step() -> None:
        nonlocal params, buffers, opt_state
        grads, buffers = grad_fn(params, buffers, x, y)
        buffers = fdp.sync_buffers(buffers, group=group)
        params, opt_state = opt.update(grads, opt_state, params)

    # Three loops of the same steps, interleaved: no check; a blocking check after every
    # step; a check launched after every step and waited for after the next one.
    times: dict[str, list[float]] = {"plain": [], "blocking": [], "async": []}
    pending = None
    for i in range(cfg.warmup + cfg.steps):
        for kind in times:
            dist.barrier(group=group.process_group)
            t = time.perf_counter()
            step()
            if kind == "blocking":
                fdp.assert_replicas_equal((params, buffers), group)
            elif kind == "async":
                if pending is not None:
                    pending.wait()
                pending = fdp.assert_replicas_equal((params, buffers), group, wait=False)
            if i >= cfg.warmup:
                times[kind].append(time.perf_counter() - t)
    pending.wait()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()} | {"leaves": len(params) + len(buffers)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--no-targets", action="store_true",
                   help="report the costs but exit 0 whatever they are (a run on a busy machine)")
    cfg = p.parse_args(argv)
    r = fdp.testing.run(_measure, cfg.world_size, backend="gloo", timeout=600, args=(cfg,))[0]
    base = r["plain"]
    print(f"train_mlp step (world {cfg.world_size}, width {cfg.width}, {r['leaves']} leaves checked): "
          f"{base:.2f} ms median without a check")
    ok = True
    for kind, label in (("blocking", "assert_replicas_equal(state) every step"),
                        ("async", "assert_replicas_equal(state, wait=False) every step, waited next step")):
        extra = (r[kind] - base) / base
        ok &= extra <= 0.05
        print(f"  {label}: {r[kind]:.2f} ms, {extra:+.1%} (target <= 5%): {'PASS' if extra <= 0.05 else 'FAIL'}")
    return 0 if ok or cfg.no_targets else 1


if __name__ == "__main__":
    sys.exit(main())
