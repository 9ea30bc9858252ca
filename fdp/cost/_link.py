"""An alpha-beta link (``Link``): what a collective costs, fitted from timed all-reduces
(``measure_link``). The cost model of the step (``fdp/cost/_predict.py``) prices its buckets with it."""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._comm import collectives as comm
from .._comm.group import Group
from .._plan.bucket import MiB

__all__ = ["Link", "linear_fit", "measure_link"]


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: ``alpha`` seconds per message, ``beta`` seconds per byte, and
    ``overhead`` seconds of the caller's thread to issue one collective.

    Example:
      >>> link = fdp.cost.Link(alpha=1e-5, beta=1e-9)
      >>> round(link.all_reduce(1e6, world=4), 9)   # 2*3*1e-5 + 2*3/4*1e6*1e-9
      0.00156
      >>> round(link.all_reduce(1e6, world=4, algorithm="tree"), 9)   # 2*2*1e-5 + 2*1e6*1e-9
      0.00204
      >>> fdp.cost.Link.parse("25Gbit", alpha=5e-6).beta == 8 / 25e9
      True
    """

    alpha: float
    beta: float
    overhead: float = 0.0

    def all_reduce(self, nbytes: float, world: int, algorithm: str = "ring") -> float:
        """Seconds for an all-reduce of ``nbytes`` over ``world`` ranks (``"ring"``, ``"tree"``,
        or ``"best"``: the cheaper, as NCCL chooses)."""
        p = world
        if p <= 1:
            return 0.0
        ring = 2 * (p - 1) * self.alpha + 2 * (p - 1) / p * nbytes * self.beta
        tree = 2 * math.ceil(math.log2(p)) * self.alpha + 2 * nbytes * self.beta
        if algorithm not in ("ring", "tree", "best"):
            raise ValueError(f"fdp.cost: algorithm must be 'ring', 'tree' or 'best', got {algorithm!r}")
        return ring if algorithm == "ring" else tree if algorithm == "tree" else min(ring, tree)

    def reduce_scatter(self, nbytes: float, world: int) -> float:
        """Seconds for a ring reduce-scatter of a ``nbytes`` buffer (each rank keeps 1/world)."""
        return 0.0 if world <= 1 else (world - 1) * (self.alpha + nbytes / world * self.beta)

    def all_gather(self, nbytes: float, world: int) -> float:
        """Seconds for a ring all-gather into a ``nbytes`` buffer (each rank gives 1/world)."""
        return self.reduce_scatter(nbytes, world)

    @classmethod
    def parse(cls, text: str, alpha: float) -> Link:
        """A link from a rate such as ``"25Gbit"``, ``"400Mbit"`` or ``"12.5GB"`` (bytes)."""
        m = re.fullmatch(r"\s*([0-9.]+)\s*([kMGT]?)(bit|b|B)(/s)?\s*", text)
        if not m:
            raise ValueError(f"fdp.cost: cannot read a link rate from {text!r} (e.g. '25Gbit', '10GB')")
        rate = float(m.group(1)) * {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[m.group(2)]
        if not rate > 0:
            raise ValueError(f"fdp.cost: a link rate must be > 0, got {text!r}")
        bytes_per_s = rate if m.group(3) == "B" else rate / 8
        return cls(alpha=alpha, beta=1 / bytes_per_s)

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float], world: int, overhead: float = 0.0) -> Link:
        """The ring all-reduce link that fits measured ``(bytes, seconds)`` pairs: beta from
        the sizes above the smallest (least squares, so the largest sizes set the slope),
        alpha from the smallest size less its bytes' share. A slow small collective (a
        rank late to the call on a loaded machine) then raises alpha only: fitted jointly, it
        tilted the line and made an 8 MiB all-reduce on a 0.5 Gbit/s link look 23% faster.

        Example:
          >>> true = fdp.cost.Link(alpha=1e-4, beta=1.6e-8)
          >>> sizes = [4096, 512 * 1024, 8 * 2**20]
          >>> fit = fdp.cost.Link.fit(sizes, [0.003, *(true.all_reduce(n, 2) for n in sizes[1:])], 2)
          >>> round(fit.beta / true.beta, 6), fit.alpha > true.alpha   # a late 4 KiB point
          (1.0, True)
        """
        if world <= 1:
            return cls(0.0, 0.0, overhead)
        pts = sorted(zip(sizes, seconds))
        slope = ols_slope([n for n, _ in pts[1:]], [t for _, t in pts[1:]]) if len(pts) >= 3 else 0.0
        if slope <= 0 and len(pts) >= 2:  # two sizes, or noise inverted the larger ones: end to end
            slope = max(0.0, (pts[-1][1] - pts[0][1]) / max(pts[-1][0] - pts[0][0], 1e-30))
        intercept = max(0.0, pts[0][1] - slope * pts[0][0]) if pts else 0.0
        p = world
        return cls(alpha=intercept / (2 * (p - 1)), beta=slope / (2 * (p - 1) / p), overhead=overhead)


def ols_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The slope of ``y = a + b x`` by ordinary least squares (0 if the xs do not vary)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(intercept, slope)``, both >= 0, of ``y = a + b x`` by least squares on relative error
    (weights ``1/y**2``), so the small sizes set the intercept and the large ones the slope."""
    w = [1 / max(y, 1e-9) ** 2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = max(0.0, (sw * sxy - sx * sy) / max(sw * sxx - sx * sx, 1e-30))
    return max(0.0, (sy - slope * sx) / sw), slope


def measure_link(group: Group, sizes: Sequence[int] = (4096, 512 * 1024, 8 * MiB), repeats: int = 5) -> Link:
    """Time all-reduces of ``sizes`` bytes on ``group`` and fit a ``Link`` (a collective).

    Every rank runs the same collectives; per size the slowest rank's median is used (the
    smallest size: its fastest repeat, the latency floor), so the result is the same
    ``Link`` on every rank. A world of one returns a free link. (A 4 KiB all-reduce on a
    ``tbf``-shaped loopback took either 0.3 or 3.6-4 ms, about half of the repeats each,
    while 512 KiB and 8 MiB ones never showed the extra 4 ms: a median there gave the
    transformer's 18 buckets 66 ms of latency they did not pay.)
    """
    if group.process_group is None:
        return Link(0.0, 0.0, 0.0)
    medians, issue = [], []
    for n in sizes:
        t = torch.zeros(max(1, n // 4), dtype=torch.float32, device=group.device)
        comm.all_reduce(t, group, "fdp.cost.measure_link (warm-up)")
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            work = comm.all_reduce(t, group, "fdp.cost.measure_link", async_op=True)
            issue.append(time.perf_counter() - t0)
            comm.wait(work, group, "fdp.cost.measure_link")
            times.append(time.perf_counter() - t0)
        medians.append(min(times) if n == min(sizes) else statistics.median(times))
    mine = torch.tensor([*medians, statistics.median(issue)], dtype=torch.float64, device=group.device)
    slowest = comm.all_gather(mine, group, "fdp.cost.measure_link (results)").amax(0).tolist()
    return Link.fit([max(1, n // 4) * 4 for n in sizes], slowest[:-1], group.size, overhead=slowest[-1])
