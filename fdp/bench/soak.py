"""``python -m fdp.bench soak``: a long run that must not drift or leak.

Two gloo ranks train an MLP (BatchNorm, AdamW, the explicit buffer step) for ``--steps``
steps. Every ``--check-every`` steps the replicas are compared bit for bit
(``fdp.assert_replicas_equal`` on params, buffers and optimizer state) and each rank's
resident memory is sampled. After the warm-up, resident memory must stay within
``--rss-tolerance`` (5%) of its first sample. Exits non-zero on drift or growth.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import fdp

from .rss import rss_mib


def soak(group: fdp.Group, cfg: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, cfg.width), nn.BatchNorm1d(cfg.width), nn.ReLU(),
                          nn.Linear(cfg.width, cfg.width), nn.BatchNorm1d(cfg.width), nn.ReLU(),
                          nn.Linear(cfg.width, 10))
    apply, params, buffers = fdp.functionalize(model)
    params, buffers = fdp.broadcast((params, buffers), group=group)
    reducer = fdp.Reducer(params, group, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_cap_mb=cfg.bucket_cap_mb)
    opt = fdp.optim.adamw(lr=1e-3, donate=True)
    opt_state = opt.init(params)

    def loss_fn(p, b, x, y):
        out, b = apply(p, b, x)
        return F.cross_entropy(out, y), b

    grad_fn = reducer.grad(loss_fn, has_aux=True)
    g = torch.Generator().manual_seed(group.rank)
    samples, checks = [], 0
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        x, y = torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        grads, buffers = grad_fn(params, buffers, x, y)
        buffers = fdp.sync_buffers(buffers, group=group)
        params, opt_state = opt.update(grads, opt_state, params)
        if (step + 1) % cfg.check_every == 0:
            fdp.assert_replicas_equal((params, buffers, opt_state), group)
            checks += 1
            samples.append((step + 1, rss_mib()))
    return {"samples": samples, "checks": checks, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--check-every", type=int, default=100)
    p.add_argument("--warmup-checks", type=int, default=2, help="samples before the RSS baseline")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--bucket-cap-mb", type=float, default=0.25, help="small: many buckets per step")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    cfg = p.parse_args(argv)
    results = fdp.testing.run(soak, cfg.world_size, backend="gloo", timeout=3600, args=(cfg,))
    ok = True
    for rank, r in enumerate(results):
        base = r["samples"][min(cfg.warmup_checks, len(r["samples"]) - 1)][1]
        worst = max(rss for _, rss in r["samples"][cfg.warmup_checks:]) if len(r["samples"]) > cfg.warmup_checks else base
        growth = (worst - base) / base
        flat = growth <= cfg.rss_tolerance
        ok &= flat
        print(f"rank {rank}: {cfg.steps} steps in {r['seconds']:.1f}s, {r['checks']} replica checks passed, "
              f"RSS {base:.1f} -> max {worst:.1f} MiB after warm-up ({growth:+.1%}): "
              f"{'flat' if flat else 'GROWING'}")
        print("  samples (step, MiB): " + ", ".join(f"({s}, {m:.1f})" for s, m in r["samples"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
