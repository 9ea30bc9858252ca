"""``python -m fdp.bench validate``: the cost model's predicted step against the measured one.

For each world size (``--worlds``, gloo ranks forked on 127.0.0.1) and bench model: the
``reducer.grad`` steps are timed for each cap of the sweep (first bucket ``min(1, cap)`` MiB,
then ``cap``; 25 is DDP's default), for an ``"auto"`` Reducer after its calibration, and on
the ``"auto"`` calibration plan, overlapped and deferred (no launch before the backward
returns), interleaved step by step (the order rotates); the profile takes the arrivals
from the deferred steps and the contention from the overlapped ones, and the link is
measured after them, as ``bucket_cap_mb="auto"`` does, so the prediction sees the same
machine load as the timings.
Reported per cap: the measured median step (the Reducer's own clock, ``timeline.end``: the
call from the forward to the last bucket's wait, rank 0), the predicted step, and the error.

``--step fused`` times the fused AdamW step (``reducer.grad_and_update``, donated) instead,
and ``--step sharded`` that of ``Reducer(shard=True)``: the profile then also holds the
per-bucket update cost fitted from the calibration plan's fused timelines, which checks the
model's update term (and, sharded, its reduce-scatter and all-gather pricing).

Run it under a shaped link by starting it in a network namespace whose loopback has a
``tbf`` qdisc (docs/measurements.md, "The cost model, measured").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

import fdp
from fdp.cost import DDP_CAPS, MIN_GAIN, AutoCaps, StepProfile, calibrate, measure_link, predict

from .predict import caps_text, setup
from .table import Table, ratio, render

SWEEP = (0.25, 1, 4, 25, 100)
OPTIMIZER = fdp.optim.adamw(lr=1e-4)  # the fused and sharded steps' (auto calibrates with it)


def _barrier(group: fdp.Group) -> None:
    if group.process_group is not None:
        dist.barrier(group=group.process_group)


def _all_gather_object(obj: Any, group: fdp.Group) -> list:
    out: list = [None] * group.size
    dist.all_gather_object(out, obj, group=group.process_group)
    return out


class _Deferred(AutoCaps):
    """The calibration plan with every launch deferred past the backward, never frozen: the
    steps ``"auto"`` takes its arrivals from (``AutoCaps.deferring``)."""

    def deferring(self) -> bool:
        return True

    def observe(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Fused:
    """A fused AdamW step of one reducer, called like ``reducer.grad(loss_fn)``."""

    def __init__(self, reducer: fdp.Reducer, loss_fn: Any, params: dict) -> None:
        self.step = reducer.grad_and_update(loss_fn, OPTIMIZER, has_aux=True, donate=True)
        self.params = {k: v.clone() for k, v in params.items()}
        self.state = self.step.init(self.params)

    def __call__(self, params: dict, buffers: dict, *batch: Any) -> None:
        self.params, self.state, _ = self.step(self.params, self.state, buffers, *batch)

    def last_timeline(self) -> Any:
        return self.step.last_step.timeline


def validate_model(name: str, group: fdp.Group, cfg: argparse.Namespace) -> dict:
    params, buffers, loss_fn, batches = setup(name, group)
    shard = cfg.step == "sharded"
    caps = {f"{c:g}": (DDP_CAPS if c == 25 else (int(min(1, c) * 2**20), int(c * 2**20))) for c in SWEEP}
    reducers = {k: fdp.Reducer(params, group, bucket_caps_mb=[c / 2**20 for c in v], shard=shard)
                for k, v in caps.items()}
    auto = fdp.Reducer(params, group, bucket_cap_mb="auto", shard=shard)
    choice = calibrate(auto, loss_fn, params, buffers, *batches[0], has_aux=True,
                       optimizer=None if cfg.step == "grad" else OPTIMIZER)
    reducers["auto"], caps["auto"] = auto, auto.tuning.choice.caps
    reducers["calibration"] = fdp.Reducer(params, group, bucket_caps_mb=AutoCaps.CALIBRATION_CAPS_MB, shard=shard)
    # The calibration plan's reducer.grad steps with no communication beside the backward.
    deferred = fdp.Reducer(params, group, bucket_cap_mb="auto")
    deferred.tuning = _Deferred()
    if cfg.step == "grad":
        fns = {k: r.grad(loss_fn, has_aux=True) for k, r in reducers.items()}
        clock = {k: (lambda r=r: r.last_step.timeline) for k, r in reducers.items()}
    else:
        fns = {k: _Fused(r, loss_fn, params) for k, r in reducers.items()}
        clock = {k: f.last_timeline for k, f in fns.items()}
    fns["deferred"], clock["deferred"] = deferred.grad(loss_fn, has_aux=True), (lambda: deferred.last_step.timeline)
    kinds = list(fns)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    timelines: dict[str, list] = {}
    for i in range(cfg.warmup + cfg.steps):
        for kind in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
            _barrier(group)
            fns[kind](params, buffers, *batches[i % len(batches)])
            if i >= cfg.warmup:
                times[kind].append(clock[kind]().end)
                timelines.setdefault(kind, []).append(clock[kind]())
    # The profile comes from the calibration plan's steps, interleaved with the timed ones.
    link = measure_link(group)
    frac = 1 / group.size if shard else 1.0
    # As "auto" does: the arrivals from the deferred steps, the contention (and, fused, the
    # update's cost) from the calibration plan's overlapped steps.
    mine = [[StepProfile.from_timelines(reducers["calibration"].plan, [tl], link, update_fraction=frac)
             for tl in timelines[k]] for k in ("deferred", "calibration")]
    ranks = [mine] if group.size == 1 else _all_gather_object(mine, group)
    free, overlapped = (StepProfile.over_ranks([r[i] for r in ranks]) for i in range(2))
    prof = replace(StepProfile.with_contention(free, overlapped), update_fixed=overlapped.update_fixed,
                   update_per_byte=overlapped.update_per_byte)
    rows = {}
    caps["calibration"] = reducers["calibration"].plan.caps
    for k in (k for k in kinds if k != "deferred"):  # (a source of the profile, not a plan)
        pr = predict(prof, caps[k], link, group.size, shard=shard)
        ms = statistics.median(times[k]) * 1e3
        bwd = statistics.median(t.backward_end for t in timelines[k]) * 1e3
        rows[k] = dict(caps=caps_text(caps[k]), buckets=len(reducers[k].plan.buckets), measured_ms=ms,
                       predicted_ms=pr.step * 1e3, predicted_exposed_ms=pr.exposed_comm * 1e3,
                       measured_backward_ms=bwd, predicted_backward_ms=pr.backward_end * 1e3,
                       error=pr.step * 1e3 / ms - 1)
    return dict(rows=rows, alpha_us=link.alpha * 1e6, gbit_s=(8e-9 / link.beta) if link.beta else None,
                contention_ms_per_mib=prof.contention * 2**20 * 1e3,
                auto_gain=choice.gain, backward_ms=prof.backward_end * 1e3,
                update_us_per_mib=prof.update_per_byte * 2**20 * 1e6, update_fixed_us=prof.update_fixed * 1e6)


def _rank(group: fdp.Group, cfg: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    return {name: validate_model(name, group, cfg) for name in cfg.models}


def table(results: dict) -> str:
    tables = []
    summary = Table(f"summary (auto keeps DDP's caps below a {MIN_GAIN:.0%} predicted gain)",
                    ["world", "model", "median |error|", "auto ms", "x best of sweep", "x 25 MiB"], keys=2)
    for world, models in results.items():
        for name, r in models.items():
            upd = (f"; update {r['update_fixed_us']:.0f} us + {r['update_us_per_mib']:.0f} us/MiB"
                   if "update_us_per_mib" in r and (r["update_us_per_mib"] or r["update_fixed_us"]) else "")
            t = Table(f"world {world}, {name} (link: alpha {r['alpha_us']:.0f} us, {r['gbit_s'] or 0:.2f} Gbit/s per "
                      f"rank; backward {r['backward_ms']:.1f} ms, {r.get('contention_ms_per_mib', 0):.2f} ms lost per "
                      f"MiB beside it{upd})",
                      ["cap", "caps MiB", "bkts", "measured ms", "predicted ms", "error", "bwd meas", "bwd pred"])
            for k, row in r["rows"].items():
                t.row(k[:5], row["caps"], f"{row['buckets']}", f"{row['measured_ms']:.1f}", f"{row['predicted_ms']:.1f}",
                      f"{row['error']:+.1%}", f"{row['measured_backward_ms']:.1f}", f"{row['predicted_backward_ms']:.1f}")
            tables.append(t)
            sweep = [row for k, row in r["rows"].items() if k not in ("auto", "calibration", "deferred")]
            med = statistics.median(abs(row["error"]) for row in sweep)
            best = min(row["measured_ms"] for row in sweep)
            auto, ddp = r["rows"]["auto"]["measured_ms"], r["rows"]["25"]["measured_ms"]
            summary.row(f"{world}", name, f"{med:.1%}", f"{auto:.1f}", ratio(auto, best), ratio(auto, ddp))
    return render([*tables, summary])


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = list(results)
    models = list(next(iter(results.values())))
    fig, axes = plt.subplots(len(worlds), len(models), figsize=(3.6 * len(models), 2.8 * len(worlds)), dpi=100,
                             squeeze=False)
    for i, w in enumerate(worlds):
        for j, m in enumerate(models):
            ax, rows = axes[i][j], results[w][m]["rows"]
            sweep = [k for k in rows if k not in ("auto", "calibration", "deferred")]
            xs = [float(k) for k in sweep]
            ax.plot(xs, [rows[k]["measured_ms"] for k in sweep], "o-", label="measured")
            ax.plot(xs, [rows[k]["predicted_ms"] for k in sweep], "s--", label="predicted")
            ax.axhline(rows["auto"]["measured_ms"], color="C2", linewidth=1, label="auto (measured)")
            ax.set_xscale("log")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{m}, {w} ranks", fontsize=9)
            if i == len(worlds) - 1:
                ax.set_xlabel("bucket cap (MiB)")
            if j == 0:
                ax.set_ylabel("step (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn,tiny1000,transformer")
    p.add_argument("--worlds", default="2,3,4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--step", default="grad", choices=("grad", "fused", "sharded"),
                   help="the step timed: reducer.grad, the fused AdamW step, or the sharded one")
    p.add_argument("--label", default="loopback", help="the link's name in the plot's title")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--timeout", type=float, default=1800)
    cfg = p.parse_args(argv)
    cfg.models = cfg.models.split(",")
    results: dict[int, Any] = {}
    for w in (int(x) for x in cfg.worlds.split(",")):
        results[w] = fdp.testing.run(_rank, w, backend="gloo", timeout=cfg.timeout, args=(cfg,))[0]
    print(table(results))
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({"label": cfg.label, "results": results}, f, indent=1)
    if cfg.plot:
        plot(results, cfg.plot, f"measured vs predicted step, {cfg.label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
