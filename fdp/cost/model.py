"""A cost model of a data-parallel step, and bucket caps chosen from it (``bucket_cap_mb="auto"``).

``predict`` replays a ``reducer.grad`` step for any caps and world size: each leaf's
gradient arrives when this rank's backward produced it (``StepProfile``); a bucket is filled
and issued when its last leaf arrives (without leaf hooks: after the backward, one by one),
strictly in order, and goes on the wire after the previous one for its alpha-beta cost
(``Link``, after Thakur, Rabenseifner and Gropp, IJHPCA 2005: ring all-reduce
``2(p-1) alpha + 2(p-1)/p n beta``; ring reduce-scatter and all-gather half that; tree
all-reduce ``2 ceil(log2 p) alpha + 2 n beta``). The step is ``max(backward end, last
collective done) + tail``; what runs past the backward is the exposed communication. gloo
on CPU runs ``gloo::allreduce``'s default algorithm, the ring. docs/performance.md, "A cost
model of the step", gives the inputs and the validation.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._plan.bucket import NO_CAP, BucketPlan, MiB, itemsize
from .._step.machine import HOOK_MEAN_BYTES
from .._step.record import Timeline
from .link import Link, linear_fit

__all__ = ["Choice", "Prediction", "StepProfile", "assign", "choose_caps",
           "hooked_count", "lost", "on_the_wire", "predict", "reached", "share", "span", "DDP_CAPS", "CANDIDATE_CAPS_MB", "MIN_GAIN"]

# DDP's defaults, the baseline every choice is compared with: 1 MiB first bucket, then 25 MiB.
DDP_CAPS = (1 * MiB, 25 * MiB)
# The caps "auto" considers, in MiB: every (first, rest) pair of these (rest >= first).
CANDIDATE_CAPS_MB = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100, math.inf)


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


def span(start: float, seconds: float, nbytes: int, contention: float) -> tuple[float, float, float, int]:
    """A collective on the wire: ``(start, seconds, backward lost, bytes)``, the backward
    losing ``contention`` per byte (at most the collective's whole time)."""
    return start, seconds, min(contention * nbytes, seconds), nbytes


def on_the_wire(tl: Timeline, contention: float) -> list[tuple[float, float, float, int]]:
    """A measured step's collectives as ``span``s: each starts on the wire when issued and the
    one before it is done (they go one at a time)."""
    out, free = [], 0.0
    for bt in tl.buckets:
        if bt.launch is None or bt.done is None:
            continue
        start = max(bt.launch, free)
        free = max(start, bt.done)
        out.append(span(start, free - start, bt.nbytes, contention))
    return out


def share(start: float, seconds: float, t: float) -> float:
    """The fraction of a collective over ``[start, start + seconds]`` done by ``t``."""
    if t <= start:
        return 0.0
    return 1.0 if seconds <= 0 or t >= start + seconds else (t - start) / seconds


def lost(wire: Sequence[tuple[float, float, float, Any]], t: float) -> float:
    """Backward time the collectives of ``wire`` took by wall time ``t``."""
    return sum(stolen * share(s, d, t) for s, d, stolen, _ in wire)


def reached(wire: Sequence[tuple[float, float, float, Any]], f: float) -> float:
    """The wall time at which a backward that loses ``lost(wire, t)`` by ``t`` has done ``f``
    seconds of its own work (``wire`` in start order, one collective at a time)."""
    behind = 0.0
    for s, d, stolen, _ in wire:
        t = f + behind
        if t <= s:
            return t
        r = stolen / d if d > 0 else 0.0
        if r < 1:  # inside: t - behind - r (t - s) = f
            t = (f + behind - r * s) / (1 - r)
            if t <= s + d:
                return t
        behind += stolen
    return f + behind


def assign(leaf_bytes: Sequence[int], leaf_group: Sequence[int], caps: Sequence[int]) -> list[list[int]]:
    """The buckets (leaf indices in buffer order) ``BucketPlan.from_caps`` makes for leaves of
    these sizes and groups: the same greedy rule, without building a plan."""
    open_: dict[int, list] = {}
    level: dict[int, int] = {}
    closed = []
    for i in reversed(range(len(leaf_bytes))):
        g = leaf_group[i]
        b = open_.get(g)
        if b is None:
            b = open_[g] = [[], 0, caps[min(level.get(g, 0), len(caps) - 1)]]
        b[0].append(i)
        b[1] += leaf_bytes[i]
        if b[1] >= b[2]:
            closed.append(open_.pop(g)[0])
            level[g] = level.get(g, 0) + 1
    closed.extend(b[0] for b in open_.values())
    closed.sort(key=lambda leaves: -leaves[0])
    return closed


def hooked_count(buckets: Sequence[tuple[int, int]], hook_threshold_bytes: int) -> int:
    """How many leading buckets get leaf hooks (``(nbytes, leaf count)`` per bucket): up to
    the last whose leaves average at least ``hook_threshold_bytes`` (``fdp.Reducer``'s rule)."""
    worth = [i for i, (n, k) in enumerate(buckets) if n >= hook_threshold_bytes * k]
    return worth[-1] + 1 if worth else 0


@dataclass(frozen=True)
class Prediction:
    """A predicted step: ``step`` seconds in all, ``exposed_comm`` of it communication past
    the backward, ``backward_end``, ``comm_done``, and the plan's ``buckets`` count."""

    step: float
    exposed_comm: float
    backward_end: float
    comm_done: float
    buckets: int


def predict(profile: StepProfile, caps: Sequence[int], link: Link, world: int, *, algorithm: str = "ring",
            wire_ratio: float = 1.0, hook_threshold_bytes: int = HOOK_MEAN_BYTES, shard: bool = False) -> Prediction:
    """Predict a step with bucket ``caps`` (bytes: first, second, ...; the last repeats) on
    ``world`` ranks over ``link``. ``wire_ratio``: wire bytes per gradient byte (0.5 for
    ``bf16_compress`` of fp32 gradients).

    ``shard``: the sharded fused step (``Reducer(shard=True)``): each bucket is
    reduce-scattered instead of all-reduced, each rank updates its 1/world slice, and after
    the last reduce-scatter the params are all-gathered bucket by bucket, one at a time, each
    once its bucket is updated (``exposed_comm`` then adds the gathers' time past the updates).

    Example:
      >>> prof = fdp.cost.StepProfile(leaf_bytes=(4000, 4000), leaf_group=(0, 0),
      ...                             leaf_ready=(0.020, 0.010), backward_end=0.021, tail=0.0)
      >>> link = fdp.cost.Link(alpha=0.001, beta=1e-6)      # 2(p-1) alpha + 2(p-1)/p n beta = 2 + 4 ms
      >>> p = fdp.cost.predict(prof, (4000,), link, world=2, hook_threshold_bytes=0)  # a bucket per leaf
      >>> round(p.comm_done, 6), round(p.exposed_comm, 6)   # 0.010+0.006, then 0.020+0.006
      (0.026, 0.005)
    """
    leaves = assign(profile.leaf_bytes, profile.leaf_group, caps)
    sizes = [(sum(profile.leaf_bytes[i] for i in b), len(b)) for b in leaves]
    hooked = hooked_count(sizes, hook_threshold_bytes)
    free_bwd = profile.backward_end + hooked * link.overhead  # its own work, with no communication beside it
    launched = wire_free = 0.0
    wire: list[tuple[float, float, float, int]] = []  # (start, seconds, backward lost, bytes)
    after = None  # the main thread, once the backward has returned
    done = []
    for k, (b, (nbytes, count)) in enumerate(zip(leaves, sizes)):
        fill = profile.fill_per_leaf * count + profile.fill_per_byte * nbytes
        if k < hooked:  # its last leaf's arrival (an unobserved leaf: the backward's end), late by
            # what the collectives on the wire took from the backward (``contention``)
            arrival = max(free_bwd if profile.leaf_ready[i] is None else profile.leaf_ready[i] for i in b)
            ready = reached(wire, min(free_bwd, arrival)) + fill
        else:  # filled and issued one by one after the backward
            after = ready = max(reached(wire, free_bwd) if after is None else after, launched) + link.overhead + fill
        launched = max(launched, ready)
        nwire = nbytes * wire_ratio
        cost = link.reduce_scatter(nwire, world) if shard else link.all_reduce(nwire, world, algorithm)
        start = max(launched, wire_free)
        wire_free = start + cost
        # (contention is per gradient byte: its calibration ran with the same wire dtype)
        wire.append(span(start, cost, nbytes, profile.contention))
        done.append(wire_free)
    bwd = reached(wire, free_bwd)
    comm_done = done[-1] if done else 0.0
    end = max(bwd, comm_done)
    updated = [0.0] * len(sizes)  # when each bucket's update ends (0: no update cost)
    if profile.update_per_byte or profile.update_fixed:
        upd_end = 0.0
        part = 1 / world if shard and world > 1 else 1.0  # sharded: this rank's slice
        for k, (d, (nbytes, _)) in enumerate(zip(done, sizes)):
            cost = profile.update_fixed + nbytes * part * profile.update_per_byte
            if d < bwd:
                bwd += cost  # run between backward ops on the main thread
                updated[k] = bwd
            else:
                upd_end = updated[k] = max(d, upd_end, bwd) + cost
        end = max(bwd, comm_done, upd_end)
    exposed = max(0.0, comm_done - bwd)
    if shard and world > 1:
        gathered = max(bwd, comm_done)  # the gathers start after the last reduce-scatter
        for (nbytes, _), u in zip(sizes, updated):
            gathered = max(gathered, u) + link.all_gather(nbytes, world)
        exposed += max(0.0, gathered - end)
        end = max(end, gathered)
    return Prediction(end + profile.tail, exposed, bwd, comm_done, len(leaves))


@dataclass(frozen=True)
class Choice:
    """What ``choose_caps`` picked: ``caps`` (bytes), its ``predicted`` step, and DDP's
    ``baseline`` (1 MiB, then 25 MiB) on the same profile and link."""

    caps: tuple[int, ...]
    predicted: Prediction
    baseline: Prediction

    @property
    def gain(self) -> float:
        """Predicted fraction of the baseline step saved (0.1: 10% faster than DDP's caps)."""
        return 1 - self.predicted.step / self.baseline.step if self.baseline.step > 0 else 0.0

    def describe(self) -> str:
        """One line: the caps, the predicted step and exposed communication, and the gain over DDP's."""
        caps = ", ".join("inf" if c >= NO_CAP else f"{c / MiB:g}" for c in self.caps)
        return (f"caps [{caps}] MiB ({self.predicted.buckets} buckets): predicted step "
                f"{self.predicted.step * 1e3:.2f} ms (exposed comm {self.predicted.exposed_comm * 1e3:.2f} ms) "
                f"vs {self.baseline.step * 1e3:.2f} ms with DDP's 25 MiB ({self.gain:+.1%})")


# Keep DDP's default unless the model predicts at least this gain: a choice within the
# model's error of the default is not worth a plan that differs from DDP's.
MIN_GAIN = 0.02


def choose_caps(profile: StepProfile, link: Link, world: int, *, algorithm: str = "ring", wire_ratio: float = 1.0,
                hook_threshold_bytes: int = HOOK_MEAN_BYTES,
                candidates_mb: Sequence[float] = CANDIDATE_CAPS_MB, shard: bool = False) -> Choice:
    """The (first, rest) caps among ``candidates_mb`` pairs with the lowest predicted step
    (``shard``: of the sharded fused step, as ``predict`` prices it).

    ``candidates_mb`` defaults to ``fdp.cost.CANDIDATE_CAPS_MB`` (0.125 MiB to 100 MiB and
    no cap). Ties go to the larger caps (fewer collectives); DDP's caps
    (``fdp.cost.DDP_CAPS``: 1 MiB, then 25 MiB) are kept unless another pair is predicted
    at least ``fdp.cost.MIN_GAIN`` (2%) faster.

    Example:
      >>> ready = tuple(0.002 * (32 - i) for i in range(32))  # 32 x 1 MiB, one every 2 ms
      >>> prof = fdp.cost.StepProfile((2**20,) * 32, (0,) * 32, ready, backward_end=0.065, tail=0.0)
      >>> c = fdp.cost.choose_caps(prof, fdp.cost.Link(alpha=1e-5, beta=1.5e-9), world=2)
      >>> c.caps[-1] < 25 * 2**20, c.gain > 0.2   # smaller buckets hide behind the backward
      (True, True)
    """
    def run(caps: tuple[int, ...]) -> Prediction:
        return predict(profile, caps, link, world, algorithm=algorithm, wire_ratio=wire_ratio,
                       hook_threshold_bytes=hook_threshold_bytes, shard=shard)

    to_bytes = [NO_CAP if math.isinf(c) else int(c * MiB) for c in candidates_mb]
    baseline = run(DDP_CAPS)
    best, best_caps = baseline, DDP_CAPS
    for rest in reversed(to_bytes):
        for first in reversed([c for c in to_bytes if c <= rest]):
            p = run((first, rest))
            if p.step < best.step * (1 - 1e-9):
                best, best_caps = p, (first, rest)
    if best.step > baseline.step * (1 - MIN_GAIN):
        best, best_caps = baseline, DDP_CAPS
    return Choice(best_caps, best, baseline)
