"""``python -m fdp.bench kernels``: fdp.kernels flatten/unflatten against a plain copy.

Two layouts of fp32 leaves, each checked against one ``dst.copy_(src)`` of the same source
bytes measured in the same run:

  100-leaves     25 MiB in 100 leaves of 6.7 K..129 K elements (a DDP-sized bucket);
  2000-leaves    2,000 small leaves of 1..4096 elements (15.8 MiB: biases, norms).

Rows, with the target each must meet (ratio of medians to the copy):

  flatten              ``kernels.flatten(leaves, out)``                        <= 1.10
  flatten+scale        ``kernels.flatten(leaves, out, scale=1/3)``             <= 1.50
  flatten+scale+bf16   the same into a bf16 ``out`` (one rounding)             <= 1.50
  unflatten (fresh)    ``BucketPlan.unflatten(flats)``: one copy + views       <= 1.10
  unflatten (out=)     ``kernels.unflatten(flat, leaves)`` into existing leaves <= 1.10

Two more rows per case have no target; they measure what no implementation built from torch
ops can go below, in the same run (the tensor objects and the per-tensor work of torch's own
multi-tensor copy):

  floor: cat of 1-D views   ``torch.cat(views, out=)`` with every leaf's 1-D view made beforehand
                            (outside the timing): torch's tightest multi-tensor copy loop
  floor: leaf views         ``unflatten_dense_tensors(flat, leaves)``: the returned leaves' tensor
                            objects alone, no copy (what a fresh unflatten must make)

Every repetition times each row and the copy once, in a freshly shuffled order (so drift
and cache state hit all of them alike); warm-up repetitions are excluded; medians are
reported. Leaves are 2-D where their size allows. On CUDA, times come from CUDA events
around each call, and a bandwidth section reports the Triton flatten as a percentage of
device-to-device copy bandwidth and against ``torch.cat(out=)`` on the same bytes
(targets: >= 85 % and not slower than cat).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .table import Table

MiB = 1 << 20
SCALE = 1 / 3
TARGETS = {
    "flatten": 1.10,
    "flatten+scale": 1.50,
    "flatten+scale+bf16": 1.50,
    "unflatten (fresh)": 1.10,
    "unflatten (out=)": 1.10,
}
FLOORS = ("floor: cat of 1-D views", "floor: leaf views")
# The least any implementation built from torch ops needs for a row, from the floors of the
# same run (docs/measurements.md, "Flatten and unflatten kernels"): a multi-tensor copy costs
# at least torch's cat over ready views; a fresh unflatten also makes the leaves' tensors.
ROW_FLOOR = {
    "flatten": lambda f: f[FLOORS[0]],
    "flatten+scale": lambda f: f[FLOORS[0]],
    "flatten+scale+bf16": lambda f: f[FLOORS[0]],
    "unflatten (fresh)": lambda f: 1.0 + f[FLOORS[1]],
    "unflatten (out=)": lambda f: f[FLOORS[0]],
}
BANDWIDTH_TARGET = 0.85  # of device-to-device copy bandwidth


def case_sizes(name: str) -> list[int]:
    """Element counts of the leaves of case ``name`` (fixed seeds: every run the same).

    Args:
      name: "100-leaves" or "2000-leaves".

    Returns:
      The sizes, in order.
    """
    g = torch.Generator().manual_seed(0)
    if name == "100-leaves":
        total = 25 * MiB // 4
        w = torch.rand(100, generator=g, dtype=torch.float64) + 0.05
        sizes = (w / w.sum() * total).long()
        sizes[-1] += total - int(sizes.sum())
        return sizes.tolist()
    if name == "2000-leaves":
        return torch.randint(1, 4097, (2000,), generator=g).tolist()
    raise ValueError(f"unknown case {name!r}")


CASES = ("100-leaves", "2000-leaves")


def _leaves(sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    # Give the leaves the shapes of real parameters: 2-D where the size allows it.
    out = []
    for n in sizes:
        t = torch.randn(n, device=device)
        out.append(t.view(-1, 2) if n % 2 == 0 and n > 2 else t)
    return out


class _Timer:
    """Wall-clock timing of one call: host time on CPU, CUDA events on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], inner: int = 1) -> float:
        """Seconds per call of ``fn``, timed over ``inner`` back-to-back calls."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner


def measure(fns: dict[str, Callable[[], Any]], reps: int, warmup: int, timer: _Timer, inner: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, interleaved in a shuffled order.

    Args:
      fns: name -> zero-argument callable.
      reps: repetitions counted (each times every function once).
      warmup: repetitions run first and discarded.
      timer: how one call is timed.
      inner: back-to-back calls per timing (for calls too short to time alone).

    Returns:
      name -> median seconds.
    """
    names = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in names}
    order = random.Random(0)
    for r in range(warmup + reps):
        # A fresh order every repetition: what ran just before (and so what is still in
        # cache) varies, instead of always favouring the same neighbour.
        order.shuffle(names)
        for k in names:
            t = timer(fns[k], inner)
            if r >= warmup:
                samples[k].append(t)
    return {k: statistics.median(v) for k, v in samples.items()}


class _BackgroundLoad:
    """CPU time other processes used while the benchmark ran, in cores (Linux; else None).

    The ratios are only as good as the machine is quiet: this says how quiet it was.
    """

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(ticks) - ticks[3] - ticks[4]) / hz  # all but idle and iowait
        mine = resource.getrusage(resource.RUSAGE_SELF)
        return time.monotonic(), busy, mine.ru_utime + mine.ru_stime

    def cores(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        wall = end[0] - self.start[0]
        return max(0.0, (end[1] - self.start[1]) - (end[2] - self.start[2])) / wall if wall > 0 else None


def run_case(name: str, device: torch.device, impl: str | None, reps: int, warmup: int) -> list[dict[str, Any]]:
    """Time the five rows and the reference copy for one case.

    Returns:
      One dict per row: case, row, ms, ratio (to the copy), target, ok (floor rows: target None).
    """
    import fdp
    from fdp import _internals, kernels

    sizes = case_sizes(name)
    n = sum(sizes)
    leaves = _leaves(sizes, device)
    tree = {f"p{i}": t for i, t in enumerate(leaves)}
    plan = fdp.BucketPlan.build(tree, bucket_caps_mb=[1 << 20])  # one bucket holding everything
    (bucket,) = plan.buckets
    in_bucket = [leaves[i] for i in bucket.leaves]
    # Few buffers (the working set decides what stays in cache): the copy reads the flat
    # bucket and writes the fp32 out; unflatten(out=) writes the leaves' own values back
    # into them.
    out32, out16 = torch.empty(n, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    flat = kernels.flatten(in_bucket, torch.empty(n, device=device), impl=impl)
    fns = {
        "copy": lambda: out32.copy_(flat),
        "flatten": lambda: kernels.flatten(in_bucket, out32, impl=impl),
        "flatten+scale": lambda: kernels.flatten(in_bucket, out32, scale=SCALE, impl=impl),
        "flatten+scale+bf16": lambda: kernels.flatten(in_bucket, out16, scale=SCALE, impl=impl),
        "unflatten (fresh)": lambda: plan.unflatten([flat], impl=impl),
        "unflatten (out=)": lambda: kernels.unflatten(flat, in_bucket, impl=impl),
    }
    if device.type == "cpu":
        ready = [t.reshape(-1) for t in in_bucket]  # made once, outside the timing
        fns[FLOORS[0]] = lambda: torch.cat(ready, out=out32)
        fns[FLOORS[1]] = lambda: _internals.unflatten_dense_tensors(flat, in_bucket)
    med = measure(fns, reps, warmup, _Timer(device))
    rows = []
    for row, target in TARGETS.items():
        ratio = med[row] / med["copy"]
        rows.append({"case": name, "row": row, "ms": med[row] * 1e3, "copy_ms": med["copy"] * 1e3,
                     "ratio": ratio, "target": target, "ok": ratio <= target})
    for row in FLOORS:
        if row in med:  # measured, no target: "ok" stays True so it never fails the run
            rows.append({"case": name, "row": row, "ms": med[row] * 1e3, "copy_ms": med["copy"] * 1e3,
                         "ratio": med[row] / med["copy"], "target": None, "ok": True})
    return judge(rows)


def judge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark the rows whose target lies below torch's own floor in the same run (measured on
    CPU) as not applicable: ``na`` True, ``floor`` the bound, and ``ok`` True, so a target no
    implementation from torch ops can reach does not fail the run. Others keep their verdict."""
    floors = {(r["case"], r["row"]): r["ratio"] for r in rows if r["row"] in FLOORS}
    out = []
    for r in rows:
        r = {**r, "na": False}
        have = {row: floors[(r["case"], row)] for row in FLOORS if (r["case"], row) in floors}
        if r["target"] is not None and len(have) == len(FLOORS):
            r["floor"] = ROW_FLOOR[r["row"]](have)
            if r["floor"] > r["target"]:
                r["na"], r["ok"] = True, True
        out.append(r)
    return out


def run_bandwidth(device: torch.device, reps: int, warmup: int, sizes_mib: tuple[int, ...] = (25, 256)) -> list[dict[str, Any]]:
    """CUDA only: Triton flatten vs a device-to-device copy and ``torch.cat(out=)``.

    100 fp32 leaves totalling each of ``sizes_mib``; every timing covers 10 back-to-back
    calls between two CUDA events, so host launch overhead shows only where the GPU
    would otherwise wait for it.

    Returns:
      One dict per size: bytes moved, GB/s of copy, cat and triton flatten, the fraction
      of copy bandwidth the flatten reaches, and whether it meets the targets.
    """
    from fdp import kernels

    def calls(total: int, sizes: list[int]) -> dict[str, Callable[[], Any]]:
        leaves = [torch.randn(k, device=device) for k in sizes]
        src, dst, out = torch.randn(total, device=device), torch.empty(total, device=device), torch.empty(total, device=device)
        return {
            "copy": lambda: dst.copy_(src),
            "cat": lambda: torch.cat(leaves, out=out),
            "triton": lambda: kernels.flatten(leaves, out, impl="triton"),
        }

    rows = []
    for mib in sizes_mib:
        g = torch.Generator().manual_seed(mib)
        w = torch.rand(100, generator=g, dtype=torch.float64) + 0.05
        total = mib * MiB // 4
        sizes = (w / w.sum() * total).long()
        sizes[-1] += total - int(sizes.sum())
        med = measure(calls(total, sizes.tolist()), reps, warmup, _Timer(device), inner=10)
        moved = 2 * total * 4  # read + write
        gbs = {k: moved / v / 1e9 for k, v in med.items()}
        frac = med["copy"] / med["triton"]
        rows.append({"mib": mib, "bytes": moved, **{f"{k}_gbs": v for k, v in gbs.items()},
                     "of_copy": frac, "vs_cat": med["cat"] / med["triton"],
                     "ok": frac >= BANDWIDTH_TARGET and med["triton"] <= med["cat"]})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The case table as text (``fdp.bench.table``'s shape)."""
    table = Table("kernels: each row's median time beside a copy of the same bytes",
                  ["case", "row", "ms", "copy ms", "x copy", "target", "result"], keys=2, text=["result"])
    for r in rows:
        if r["target"] is None:
            target, result = "-", "(floor, no target)"
        elif r.get("na"):
            target = f"{r['target']:.2f}"
            result = f"N/A: torch's floor here is {r['floor']:.2f}x (no torch-op implementation can meet it)"
        else:
            target, result = f"{r['target']:.2f}", "PASS" if r["ok"] else "FAIL"
        table.row(r["case"], r["row"], f"{r['ms']:.3f}", f"{r['copy_ms']:.3f}", f"{r['ratio']:.2f}", target, result)
    return table.render()


def format_bandwidth(rows: list[dict[str, Any]]) -> str:
    """The bandwidth table as text (``fdp.bench.table``'s shape)."""
    table = Table("Triton flatten bandwidth (read + write bytes; 100 fp32 leaves)",
                  ["MiB", "copy GB/s", "cat GB/s", "triton GB/s", "% of copy", "x cat", "result"], text=["result"])
    for r in rows:
        table.row(f"{r['mib']}", f"{r['copy_gbs']:.0f}", f"{r['cat_gbs']:.0f}", f"{r['triton_gbs']:.0f}",
                  f"{100 * r['of_copy']:.1f}%", f"{r['vs_cat']:.2f}", "PASS" if r["ok"] else "FAIL")
    return table.render()


def main(argv: list[str] | None = None) -> int:
    """Run the kernel benchmark; print the tables (and write JSON if asked).

    Args:
      argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
      0 if every row met its target (or ``--no-targets``), or its target is below torch's floor
      in this run (shown as N/A: on CPU, e.g. 2,000 small leaves), 1 otherwise, 2 if the device
      or impl cannot run here.
    """
    p = argparse.ArgumentParser(prog="python -m fdp.bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--impl", choices=("auto", "torch", "triton"), default="auto",
                   help="fdp.kernels implementation (default auto: triton on CUDA, torch on CPU)")
    p.add_argument("--reps", type=int, default=30, help="repetitions counted per row (default 30, at least 20)")
    p.add_argument("--warmup", type=int, default=3, help="repetitions discarded first (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="which layouts to run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--no-targets", action="store_true",
                   help="report the ratios but exit 0 whatever they are (a run on a busy machine)")
    args = p.parse_args(argv)
    if args.reps < 20:
        p.error("--reps must be at least 20")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fdp.bench kernels: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    impl = None if args.impl == "auto" else args.impl
    from fdp import kernels

    try:
        chosen = kernels.select(device, impl)
    except RuntimeError as e:  # e.g. impl=triton on CPU without the interpreter
        print(f"fdp.bench kernels: {e}", file=sys.stderr)
        return 2
    print(f"fdp.kernels on {device} with impl={chosen}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads; {args.reps} reps (+{args.warmup} warm-up), medians")
    load = _BackgroundLoad()
    rows = []
    for name in args.cases:
        rows += run_case(name, device, impl, args.reps, args.warmup)
    print(format_rows(rows))
    background = load.cores()
    if background is not None:
        print(f"other processes used {background:.2f} CPU cores meanwhile (ratios assume a quiet machine)")
    bandwidth = []
    if device.type == "cuda" and chosen == "triton":
        bandwidth = run_bandwidth(device, args.reps, args.warmup)
        print(format_bandwidth(bandwidth))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "impl": chosen, "threads": torch.get_num_threads(),
                       "reps": args.reps, "background_cores": background, "cases": rows, "bandwidth": bandwidth,
                       "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "FDP_KERNELS", "TRITON_INTERPRET")}},
                      f, indent=2)
    failed = [r for r in rows + bandwidth if not r["ok"]]
    return 1 if failed and not args.no_targets else 0


if __name__ == "__main__":
    sys.exit(main())
