"""What happened when in a step: ``BucketTimes``, ``Timeline`` and the ``StepRecord``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .._protocols import StepKind


class Gather(NamedTuple):
    """One all-gather of a unit's params (fully sharded), in seconds since the step started:
    when it was issued, when the compute started waiting for it, when it was complete, and
    when its memory was freed (None: still held when the record was made)."""

    issued: float
    waited: float
    done: float
    freed: float | None = None


@dataclass
class BucketTimes:
    """One bucket's life in a step, in seconds since the step started.

    Attributes:
      index: the bucket's index in the plan.
      nbytes: its size in bytes (``Bucket.nbytes``: in the gradients' dtype, not the wire dtype).
      ready: when its last gradient arrived through a leaf hook (None for ``all_reduce``
        steps, and for buckets without leaf hooks, which launch when the backward returns).
      launch: when its collective was issued.
      done: when fdp first saw its collective complete (completion is polled, so this is
        at most one poll after the true completion).
    """

    index: int
    nbytes: int
    ready: float | None = None  # its last gradient arrived
    launch: float | None = None  # its collective was issued
    # When fdp first saw its collective complete: looked at on every later bucket launch,
    # when the backward returns, and as each wait returns, so at most the gap between two
    # of those after the true completion. Completion is polled rather than signalled by a
    # callback, because a Python callback on the communication thread contends for the GIL
    # with the backward (docs/measurements.md, "fdp beside DDP").
    done: float | None = None
    # The fused step (``reducer.grad_and_update``): when this bucket's optimizer update ran.
    update_start: float | None = None
    update_end: float | None = None
    # The sharded fused step: when this bucket's params all-gather was seen complete.
    gathered: float | None = None
    # Fully sharded params: each all-gather of this bucket's (its unit's) params in the step
    # (``Gather``: issued, waited for from, complete, freed; the wait is what the compute did
    # not hide), and the bytes one gather holds (the unit's params in ``param_dtype``).
    gathers: list[Gather] = field(default_factory=list)
    gather_nbytes: int = 0


@dataclass
class Timeline:
    """What happened when in one step (seconds since the call started).

    ``backward_start``/``backward_end`` are None for ``all_reduce`` steps (no backward).
    ``exposed_comm`` is the communication not hidden behind the backward: the time from the
    backward's end (or the launch of the first bucket, for ``all_reduce``) to the last
    bucket's completion. Draw one with ``fdp.viz.plot_timeline``.

    Attributes:
      step: the step's number (0 for the reducer's first).
      kind: ``"grad"``, ``"all_reduce"`` or ``"accumulate"`` (a micro-batch reduced by
        ``step.accumulate``: ``Reducer(..., reduce_micro_batches=True)``).
      backward_start, backward_end: when the backward started and returned (None for
        ``all_reduce``).
      end: when the step returned.
      buckets: one ``fdp.BucketTimes`` per bucket, in plan order.

    Example:
      >>> reducer = fdp.Reducer({"w": torch.zeros(2)})
      >>> _ = reducer.all_reduce({"w": torch.ones(2)})
      >>> tl = reducer.last_step.timeline
      >>> tl.kind, len(tl.buckets), tl.backward_end, tl.exposed_comm >= 0
      ('all_reduce', 1, None, True)
    """

    step: int
    kind: StepKind
    backward_start: float | None
    backward_end: float | None
    end: float
    buckets: list[BucketTimes] = field(default_factory=list)

    @property
    def comm_done(self) -> float:
        """When the last bucket's collective was seen complete (0.0 without buckets)."""
        return max((b.done or 0.0) for b in self.buckets) if self.buckets else 0.0

    @property
    def exposed_comm(self) -> float:
        """Seconds of communication not hidden behind the backward (>= 0)."""
        start = self.backward_end
        if start is None:
            start = min((b.launch or 0.0) for b in self.buckets) if self.buckets else 0.0
        return max(0.0, self.comm_done - start)

    @property
    def exposed_gather(self) -> float:
        """Fully sharded params: seconds the step waited for its units' params all-gathers
        (what the compute and the prefetch did not hide; 0 otherwise)."""
        return sum(g.done - g.waited for b in self.buckets for g in b.gathers)

    @property
    def peak_gathered(self) -> int:
        """Fully sharded params: the most bytes of gathered unit params held at once in the step
        (from each gather's issue to its free; 0 otherwise)."""
        events = sorted((t, sign * b.gather_nbytes) for b in self.buckets for g in b.gathers
                        for t, sign in ((g.issued, 1), (self.end if g.freed is None else g.freed, -1)))
        peak = now = 0
        for _, delta in events:  # (at one instant a free sorts before an issue: -n < +n)
            now += delta
            peak = max(peak, now)
        return peak

    @property
    def exposed_update(self) -> float:
        """Optimizer-update time (fused step) that ran after the backward ended: what the
        backward could not hide (0 when no bucket was updated)."""
        end = self.backward_end if self.backward_end is not None else 0.0
        return sum(max(0.0, b.update_end - max(b.update_start, end)) for b in self.buckets
                   if b.update_start is not None and b.update_end is not None)


@dataclass(frozen=True)
class StepRecord:
    """What one completed Reducer step reports: ``reducer.last_step`` after each call.

    Attributes:
      step: the step's number (0 for the reducer's first).
      kind: ``"grad"`` (``reducer.grad``/``grad_and_value``, a fused step), ``"all_reduce"``, or
        ``"accumulate"`` (a micro-batch reduced by ``step.accumulate``:
        ``Reducer(..., reduce_micro_batches=True)``).
      finite: whether every averaged gradient was finite; the same verdict on every rank.
        Always True unless the Reducer was built with ``skip_nonfinite=True``.
      timeline: when each bucket was ready, launched and done.

    Example:
      >>> reducer = fdp.Reducer({"w": torch.zeros(2)})
      >>> _ = reducer.all_reduce({"w": torch.ones(2)})
      >>> reducer.last_step.step, reducer.last_step.kind, reducer.last_step.finite
      (0, 'all_reduce', True)
    """

    step: int
    kind: StepKind
    finite: bool
    timeline: Timeline
