"""``predict`` a data-parallel step for any bucket caps, and ``choose_caps`` from it (``bucket_cap_mb="auto"``).

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

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._plan.bucket import NO_CAP, MiB, assign
from .._step.machine import HOOK_MEAN_BYTES, hooked_count
from ._contention import reached, span
from ._link import Link
from ._profile import StepProfile

# DDP's defaults, the baseline every choice is compared with: 1 MiB first bucket, then 25 MiB.
DDP_CAPS = (1 * MiB, 25 * MiB)
# The caps "auto" considers, in MiB: every (first, rest) pair of these (rest >= first).
CANDIDATE_CAPS_MB = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100, math.inf)


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
