"""``StepProfile``: what a step costs on this rank, measured from step timelines.

Independent of the bucket plan: when each leaf's gradient arrived, when the backward's own
work ended, the fill and update costs, and the contention of communication beside the
backward (``_contention.py``). ``predict`` replays a step from it for any caps.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._plan.bucket import BucketPlan, MiB, itemsize
from .._step.machine import HOOK_MEAN_BYTES, hooked_count
from .._step.record import Timeline
from ._contention import lost, on_the_wire, share
from ._link import Link, linear_fit


@dataclass(frozen=True)
class StepProfile:
    """What a step costs on this rank, independent of the bucket plan.

    Attributes:
      leaf_bytes: per leaf in tree order, its gradient's bytes.
      leaf_group: per leaf, its (device, dtype) group (leaves of two groups never share a bucket).
      leaf_ready: per leaf, seconds from the step's start until its gradient arrived (None:
        not observed; taken as the backward's end).
      backward_end: when the backward's own work ended: the measured end less the plan's
        launch overheads, the fused updates and the contention inside it.
      tail: seconds from the later of backward end and last collective to the step's end.
      fill_per_leaf, fill_per_byte: the main thread's cost to fill a bucket (the
        multi-tensor copy with the scale fused in) per leaf and per byte.
      update_fixed, update_per_byte: the fused step's per-bucket update cost (0: no update).
      overlapped_bytes: bytes on the wire during the backward in the timelines it came from.
      contention: seconds of backward lost per byte communicated beside it (0: the backward
        and the transport do not share cores; ``with_contention`` measures it).
    """

    leaf_bytes: tuple[int, ...]
    leaf_group: tuple[int, ...]
    leaf_ready: tuple[float | None, ...]
    backward_end: float
    tail: float
    fill_per_leaf: float = 0.0
    fill_per_byte: float = 0.0
    update_fixed: float = 0.0
    update_per_byte: float = 0.0
    overlapped_bytes: float = 0.0
    contention: float = 0.0

    @classmethod
    def from_timelines(cls, plan: BucketPlan, timelines: Sequence[Timeline], link: Link,
                       hook_threshold_bytes: int = HOOK_MEAN_BYTES, update_fraction: float = 1.0,
                       contention: float = 0.0) -> StepProfile:
        """The median profile of ``timelines`` (steps of ``reducer.grad`` with ``plan``, or of
        its fused step: then the per-bucket update cost is fitted too, over ``update_fraction``
        of each bucket's bytes: ``1/world`` for a sharded step, which updates a slice).

        A leaf's arrival is interpolated by bytes between its bucket's ready time and the
        previous bucket's, so a fine plan (``AutoCaps.CALIBRATION_CAPS_MB``) gives it closely.
        Steps whose launches were deferred past the backward (``AutoCaps``' calibration) give
        the backward with no communication beside it; with ``contention``, what the
        communication beside it took is taken out of the arrivals and the backward's end.
        """
        keys: dict[tuple, int] = {}
        leaf_group = tuple(keys.setdefault((s.device.type, s.dtype), len(keys)) for s in plan.slots)
        leaf_bytes = tuple(s.numel * itemsize(s.dtype) for s in plan.slots)
        per_leaf: list[list[float]] = [[] for _ in plan.slots]
        ends, tails, upd, fills, overlapped = [], [], [], [], []
        hooked = hooked_count([(b.nbytes, len(b.leaves)) for b in plan.buckets], hook_threshold_bytes)
        per_byte = copy_seconds_per_byte(plan.slots[0].device) if plan.slots else 0.0
        for tl in timelines:
            wire = on_the_wire(tl, contention)
            pairs = list(zip(plan.buckets, tl.buckets))
            prev = tl.backward_start or 0.0
            for b, bt in pairs:
                if bt.update_start is not None and bt.update_end is not None:
                    upd.append((b.nbytes * update_fraction, bt.update_end - bt.update_start))
                if bt.ready is None:  # (a bucket without leaf hooks: filled after the backward)
                    continue
                sizes = [leaf_bytes[i] for i in b.leaves]
                total, acc = max(1, sum(sizes)), 0
                for i, nb in zip(b.leaves, sizes):
                    acc += nb
                    t = prev + (bt.ready - prev) * acc / total
                    per_leaf[i].append(t - lost(wire, t))
                prev = max(prev, bt.ready)
            end = tl.backward_end if tl.backward_end is not None else 0.0
            overlapped.append(sum(n * share(s, d, end) for s, d, _, n in wire))
            # buckets without hooks are filled and launched one by one after the backward (and,
            # deferred, after the hooked ones)
            prev = max([end] + [bt.launch for bt in tl.buckets[:hooked] if bt.launch is not None])
            for b, bt in pairs[hooked:]:
                if bt.launch is not None and tl.backward_end is not None:
                    fills.append((bt.launch - prev - link.overhead - b.nbytes * per_byte) / len(b.leaves))
                    prev = bt.launch
            # The hooked buckets' issue overheads ran inside the backward (``predict`` adds the
            # plan's own); a deferred step filled them after it (as if inside, as predicted).
            inside = [b for b, bt in pairs[:hooked] if bt.launch is not None and bt.launch <= end]
            # A fused step's updates that ran inside the backward are the update term's
            # (``predict`` adds each plan's own).
            updating = sum(bt.update_end - bt.update_start for bt in tl.buckets if bt.update_start is not None
                           and bt.update_end is not None and bt.update_end <= end)
            ends.append(end - lost(wire, end) - len(inside) * link.overhead - updating
                        + (sum(b.nbytes for b in plan.buckets[:hooked]) - sum(b.nbytes for b in inside)) * per_byte)
            last = max([end, tl.comm_done] + [t for bt in tl.buckets for t in (bt.update_end, bt.gathered)
                                                if t is not None])  # (the fused step's updates and gathers)
            tails.append(max(0.0, tl.end - last))
        fixed = upd_byte = 0.0
        xs = [n for n, _ in upd]
        if upd and max(xs) >= 2 * min(xs):
            fixed, upd_byte = linear_fit(xs, [t for _, t in upd])
        elif upd:  # buckets all about one size: a line through them is ill-posed; cost per byte
            upd_byte = statistics.median(t / max(n, 1) for n, t in upd)
        return cls(leaf_bytes, leaf_group, tuple(statistics.median(v) if v else None for v in per_leaf),
                   statistics.median(ends), statistics.median(tails),
                   max(0.0, statistics.median(fills)) if fills else 0.0, per_byte, fixed, upd_byte,
                   statistics.median(overlapped), contention)

    @classmethod
    def with_contention(cls, free: StepProfile, overlapped: StepProfile) -> StepProfile:
        """``free`` (from steps with no communication during the backward) with the contention
        that ``overlapped`` (the same plan, its buckets launched during the backward) shows:
        its longer backward per byte it had on the wire meanwhile."""
        c = 0.0
        if overlapped.overlapped_bytes > 0:
            c = max(0.0, overlapped.backward_end - free.backward_end) / overlapped.overlapped_bytes
        return replace(free, contention=c)

    @classmethod
    def combine(cls, profiles: Sequence[StepProfile], how: Any = max) -> StepProfile:
        """One profile from several, per leaf and per cost: ``how=max`` for one step over
        ranks (a collective starts when its last rank issues it), ``statistics.median`` over
        steps. A leaf unobserved in any profile stays unobserved."""
        ready = zip(*(p.leaf_ready for p in profiles))
        return replace(profiles[0], leaf_ready=tuple(None if None in r else how(r) for r in ready),
                       **{f: how([getattr(p, f) for p in profiles]) for f in
                          ("backward_end", "tail", "fill_per_leaf", "fill_per_byte", "update_fixed", "update_per_byte",
                           "overlapped_bytes", "contention")})

    @classmethod
    def over_ranks(cls, per_rank: Sequence[Sequence[StepProfile]]) -> StepProfile:
        """From each rank's per-step profiles: the slowest rank of each step, then the
        median step (ranks that take turns being slow make every step as slow as its
        slowest rank, which the slowest median would miss)."""
        return cls.combine([cls.combine(step) for step in zip(*per_rank)], statistics.median)


@functools.cache
def copy_seconds_per_byte(device: torch.device, nbytes: int = 4 * MiB) -> float:
    """Seconds per byte of a scaled copy on ``device`` (what a bucket fill does per byte),
    measured once per process (every profile of every calibration step uses it)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mul(src, 0.5, out=dst)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times) / nbytes
