"""``python -m fdp.bench predict``: predicted steps on worlds and links this machine cannot hold.

For each bench model, this rank's backward is measured in a world of one on the calibration
plan of ``bucket_cap_mb="auto"`` (when each gradient arrives: ``fdp.cost.StepProfile``);
then ``fdp.cost.predict`` gives, per world size and link, the step time, the exposed
communication and the scaling efficiency (the world-of-one step over the world's step, the
same per-rank batch), with DDP's fixed caps (1 MiB first bucket, then 25 MiB) and with the
caps ``fdp.cost.choose_caps`` picks. The links are ring all-reduces (``--algorithm``) with the
given bandwidth and ``--alpha`` per message (not measured here: a world of one has no link).

    python -m fdp.bench predict --world 8,64,512 --link 25Gbit,100Gbit,400Gbit --plot predict.png
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

import fdp
from fdp._plan.bucket import NO_CAP
from fdp.cost import DDP_CAPS, AutoCaps, Link, StepProfile, choose_caps, predict

from .table import Table, ratio
from .zoo import MODELS, loss


def setup(name: str, group: fdp.Group) -> tuple[dict, dict, Any, list]:
    """(params, buffers, loss_fn, batches) of bench model ``name`` on ``group``'s device."""
    make, data = MODELS[name]
    torch.manual_seed(0)
    module = make().to(group.device)
    apply, params, buffers = fdp.functionalize(module)
    params, buffers = fdp.broadcast((params, buffers), group=group)
    g = torch.Generator().manual_seed(100 + group.rank)
    batches = [tuple(t.to(group.device) for t in data(g)) for _ in range(4)]

    def loss_fn(params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        out, new_buffers = apply(params, buffers, x)
        return loss(name, out, y), new_buffers

    return params, buffers, loss_fn, batches


def profile(name: str, group: fdp.Group, steps: int = 6, warmup: int = 2) -> tuple[StepProfile, Link, Any]:
    """This rank's ``StepProfile`` of model ``name`` (calibration plan), the measured link, the plan."""
    params, buffers, loss_fn, batches = setup(name, group)
    reducer = fdp.Reducer(params, group, bucket_caps_mb=AutoCaps.CALIBRATION_CAPS_MB)
    grad_fn = reducer.grad(loss_fn, has_aux=True)
    timelines = []
    for i in range(warmup + steps):
        grad_fn(params, buffers, *batches[i % len(batches)])
        if i >= warmup:
            timelines.append(reducer.last_step.timeline)
    link = fdp.cost.measure_link(group)
    return StepProfile.from_timelines(reducer.plan, timelines, link), link, reducer.plan


def caps_text(caps: tuple[int, ...]) -> str:
    return "/".join("inf" if c >= NO_CAP else f"{c / 2**20:g}" for c in caps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn,tiny1000,transformer")
    p.add_argument("--world", default="8,64,512")
    p.add_argument("--link", default="25Gbit,100Gbit,400Gbit")
    p.add_argument("--alpha", type=float, default=10e-6, help="seconds per message (default 10 us)")
    p.add_argument("--algorithm", default="ring", choices=["ring", "tree", "best"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    cfg = p.parse_args(argv)
    torch.set_num_threads(1)
    worlds = [int(w) for w in cfg.world.split(",")]
    try:
        links = {t: Link.parse(t, cfg.alpha) for t in cfg.link.split(",")}
    except ValueError as e:
        p.error(f"--link: {e}")
    group = fdp.init()
    rows = []
    for name in cfg.models.split(","):
        prof, _, _ = profile(name, group, cfg.steps)
        alone = predict(prof, DDP_CAPS, Link(0, 0), 1).step
        for ltext, link in links.items():
            for w in worlds:
                ddp = predict(prof, DDP_CAPS, link, w, algorithm=cfg.algorithm)
                ch = choose_caps(prof, link, w, algorithm=cfg.algorithm)
                rows.append(dict(model=name, link=ltext, world=w, alone_ms=alone * 1e3,
                                 ddp_ms=ddp.step * 1e3, ddp_exposed_ms=ddp.exposed_comm * 1e3,
                                 ddp_eff=alone / ddp.step, fdp_ms=ch.predicted.step * 1e3,
                                 fdp_exposed_ms=ch.predicted.exposed_comm * 1e3,
                                 fdp_eff=alone / ch.predicted.step, caps=caps_text(ch.caps)))
    table = Table(f"predicted step: this machine's measured backward + predicted communication (alpha "
                  f"{cfg.alpha * 1e6:g} us per message, {cfg.algorithm} all-reduce)",
                  ["model", "link", "world", "ddp ms", "ddp exposed", "ddp eff", "fdp ms", "fdp exposed", "fdp eff",
                   "fdp caps MiB", "x ddp"], keys=2, text=["fdp caps MiB"])
    for r in rows:
        table.row(r["model"], r["link"], f"{r['world']}", f"{r['ddp_ms']:.1f}", f"{r['ddp_exposed_ms']:.1f}",
                  f"{r['ddp_eff']:.2f}", f"{r['fdp_ms']:.1f}", f"{r['fdp_exposed_ms']:.1f}", f"{r['fdp_eff']:.2f}",
                  r["caps"], ratio(r["fdp_ms"], r["ddp_ms"]))
    table.note("(ddp: DDP's caps, 1 MiB first and 25 MiB; fdp: the caps fdp.cost chose; eff: backward alone / step)")
    print(table.render())
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({"alpha": cfg.alpha, "algorithm": cfg.algorithm, "rows": rows}, f, indent=1)
    if cfg.plot:
        plot(rows, cfg.plot)
    return 0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.4), dpi=110, squeeze=False)
    for ax, m in zip(axes[0], models):
        for j, ltext in enumerate(links):
            rs = [r for r in rows if r["model"] == m and r["link"] == ltext]
            ws = [r["world"] for r in rs]
            ax.plot(ws, [r["ddp_eff"] for r in rs], "--", color=f"C{j}", marker="o", label=f"{ltext} DDP caps")
            ax.plot(ws, [r["fdp_eff"] for r in rs], "-", color=f"C{j}", marker="s", label=f"{ltext} fdp auto")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(m)
        ax.set_xlabel("world size")
    axes[0][0].set_ylabel("predicted scaling efficiency")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
