"""``AutoCaps``: the tuner behind ``fdp.Reducer(..., bucket_cap_mb="auto")`` (the model it
chooses with: ``fdp/cost/_predict.py``)."""

from __future__ import annotations

import math
import time
from dataclasses import astuple, replace
from typing import Any

import torch

from .._comm import collectives as comm
from .._comm.group import Group
from .._errors import CollectiveError
from .._log import log
from .._plan.bucket import BucketPlan, MiB, itemsize
from .._step.record import Timeline
from ..optim._flat import chunks, split_chain
from ._link import Link, linear_fit, measure_link
from ._predict import Choice, Prediction, choose_caps
from ._profile import StepProfile

__all__ = ["AutoCaps", "update_cost"]


class AutoCaps:
    """The tuner behind ``fdp.Reducer(..., bucket_cap_mb="auto")``.

    The Reducer starts on a fine calibration plan (``CALIBRATION_CAPS_MB``: a bucket per
    64 KiB, so each bucket's ready time says when its leaves arrived). After ``WARMUP``
    steps of ``reducer.grad`` it records ``STEPS + DEFERRED`` more, the first ``DEFERRED``
    of every other one with its launches deferred past the backward (``deferring``: the
    arrivals and the backward with no communication beside it) and the rest overlapped as
    usual (what the communication beside the backward costs it, where the transport shares
    the backward's cores: ``StepProfile.with_contention``). Then every rank times a few
    all-reduces (``measure_link``) and builds its ``StepProfile``s; rank 0 takes the slowest
    rank's per step (``StepProfile.over_ranks``), picks the caps (``choose_caps``) and
    broadcasts them with the predictions, and the Reducer freezes the plan built from them
    (fingerprint checked on every rank). The calibration steps are ordinary steps with
    correct averages; only their bucket layout (and, deferred, their overlap) differs.

    Attributes:
      frozen: whether the caps are chosen (the plan never changes afterwards).
      choice: the ``fdp.cost.Choice`` (None before the freeze), the same on every rank.
      link: the measured ``fdp.cost.Link`` (None before the freeze).
      profile: the ``fdp.cost.StepProfile`` rank 0 chose with (its arrivals, contention and
        update cost; None before the freeze, and on other ranks).
      optimizer: the ``fdp.optim`` optimizer (or chain) of the fused step the caps are for
        (``fdp.cost.calibrate(..., optimizer=)``), or None. Set, every rank also times its
        kernel on flat buffers of two sizes at the freeze (``update_cost``), and the model
        prices each bucket's update (``StepProfile.update_fixed``/``update_per_byte``).
    """

    CALIBRATION_CAPS_MB = (1 / 16,)
    WARMUP = 1
    STEPS = 3
    DEFERRED = 2

    def __init__(self, shard: bool = False) -> None:
        self.shard = shard  # choose for the sharded fused step (reduce-scatter + all-gather)
        self.frozen = False
        self.choice: Choice | None = None
        self.link: Link | None = None
        self.profile: StepProfile | None = None
        self.optimizer: Any = None
        self._seen = 0
        self._timelines: list[Timeline] = []
        self._deferred: list[Timeline] = []

    def deferring(self) -> bool:
        """Whether the next ``grad`` step launches nothing until its backward returns."""
        k = self._seen - self.WARMUP
        return not self.frozen and 0 <= k < 2 * self.DEFERRED and k % 2 == 0

    def observe(self, plan: BucketPlan, kind: str, timeline: Timeline, group: Group, *,
                wire_dtype: torch.dtype | None, hook_threshold_bytes: int) -> tuple[int, ...] | None:
        """Record a completed step; return the chosen caps (bytes) on the step that freezes
        (a collective on that step: every rank calls it after the same steps)."""
        if self.frozen or kind != "grad":
            return None
        wire_ratio = 1.0
        if wire_dtype is not None and plan.buckets:
            wire_ratio = itemsize(wire_dtype) / itemsize(plan.buckets[0].dtype)
        deferred = self.deferring()
        self._seen += 1
        if self._seen > self.WARMUP:
            (self._deferred if deferred else self._timelines).append(timeline)
        if len(self._timelines) < self.STEPS or len(self._deferred) < self.DEFERRED:
            return None
        self.link = measure_link(group)
        # What may fail on one rank (its update's timing, its profiles; rank 0's choice) is
        # caught and sent through the freeze's own collectives, so every rank raises at once,
        # naming the rank and the cause, instead of waiting in the next collective.
        error: BaseException | None = None
        try:
            fixed, per_byte = update_cost(self.optimizer, plan) if self.optimizer is not None else (0.0, 0.0)
            mine: Any = [[replace(StepProfile.from_timelines(plan, [tl], self.link, hook_threshold_bytes),
                                  update_fixed=fixed, update_per_byte=per_byte) for tl in tls]
                         for tls in (self._deferred, self._timelines)]
        except Exception as e:  # noqa: BLE001 - raised below, after the others know
            error, mine = e, _Failed(f"{type(e).__name__}: {e}")
        profiles = comm.all_gather_object(mine, group, "fdp.Reducer auto caps (profiles)")
        self._raise_failed(profiles, error, group, "measuring its step profile")
        choice: Any = None
        if group.rank == 0:
            try:
                profile = StepProfile.with_contention(StepProfile.over_ranks([p[0] for p in profiles]),
                                                      StepProfile.over_ranks([p[1] for p in profiles]))
                self.profile = profile
                c = choose_caps(profile, self.link, group.size, wire_ratio=wire_ratio,
                                hook_threshold_bytes=hook_threshold_bytes, shard=self.shard)
                choice = [c.caps[0], c.caps[-1], *astuple(c.predicted), *astuple(c.baseline)]
            except Exception as e:  # noqa: BLE001 - raised below, after the others know
                error, choice = e, _Failed(f"{type(e).__name__}: {e}")
        v = comm.all_gather_object(choice, group, "fdp.Reducer auto caps (rank 0's choice)")[0]
        self._raise_failed([v], error, group, "choosing the caps")
        self.choice = Choice((int(v[0]), int(v[1])), Prediction(*v[2:6], int(v[6])), Prediction(*v[7:11], int(v[11])))
        self.frozen, self._timelines, self._deferred = True, [], []
        log.info("bucket_cap_mb='auto' (world %d, link alpha %.1f us, %.3g GB/s%s): %s", group.size,
                 self.link.alpha * 1e6, 1e-9 / self.link.beta if self.link.beta else math.inf,
                 "" if self.profile is None else f", backward loses {self.profile.contention * 2**20 * 1e3:.2f} ms "
                 "per MiB communicated beside it", self.choice.describe())
        return self.choice.caps

    @staticmethod
    def _raise_failed(parts: list[Any], error: BaseException | None, group: Group, doing: str) -> None:
        """Raise on every rank if any rank's part is a ``_Failed``: this rank's own error, or a
        ``CollectiveError`` naming the failed ranks and their errors. The caps stay unchosen
        (the next ``grad`` step tries the freeze again, on every rank)."""
        failed = {r: str(p) for r, p in enumerate(parts) if isinstance(p, _Failed)}
        if not failed:
            return
        if error is not None:
            raise error
        ranks = sorted(failed)  # (parts[r] is rank r's; rank 0's choice alone is parts[0])
        causes = "; ".join(f"rank {r}: {failed[r]}" for r in ranks)
        raise CollectiveError(
            f"fdp.Reducer bucket_cap_mb='auto': freezing the caps failed on rank(s) {ranks} of {group.size} "
            f"while {doing} ({causes}); this is rank {group.rank}. The caps are not chosen yet: the next "
            "grad step tries again on every rank")


class _Failed(str):
    """What a rank sends in place of its part of the freeze when it failed: its error."""


def update_cost(opt: Any, plan: BucketPlan, sizes: tuple[int, ...] = (256 * 1024, 4 * MiB),
                repeats: int = 3) -> tuple[float, float]:
    """``(fixed seconds, seconds per byte)`` of ``opt``'s fused per-bucket update on this rank:
    its kernel timed on flat buffers of ``sizes`` bytes in the plan's dtype and device, in the
    fused step's chunks (the fastest of ``repeats``), fitted to a line. A ``partition`` is
    priced at its costliest label's kernel."""
    optimizer = split_chain(opt, "fdp.cost.calibrate", sharded=False)[1]
    if optimizer.form.partition is None:
        kernel = optimizer.form.leaf_kernel
    else:  # a partition: priced at its costliest label's kernel (the one with most state fields)
        kernel = max((o.form.leaf_kernel for o in optimizer.form.partition.optimizers.values()), key=lambda k: len(k.fields))
    dtype, device = (plan.buckets[0].dtype, plan.buckets[0].device) if plan.buckets else (
        torch.float32, torch.device("cpu"))
    count = torch.ones((), dtype=torch.float32)  # (not the first step, which SGD takes apart)
    xs, ys = [], []
    for nbytes in sizes:
        n = max(1, nbytes // itemsize(dtype))
        p, g = torch.zeros(n, dtype=dtype, device=device), torch.full((n,), 1e-3, dtype=dtype, device=device)
        states = [torch.full((n,), kernel.init_value, dtype=dtype, device=device) for _ in kernel.fields]
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            kernel.step(0, chunks(p), chunks(g), [chunks(x) for x in states], count)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        xs.append(n * itemsize(dtype))
        ys.append(best)
    return linear_fit(xs, ys)
