"""How a fused step runs, decided once per program and engine (``StepMode``), and what a step
tells its engine when it ends (``Verdict``).

The mode is what used to be read from a handful of flags spread over objects:

* ``timing``: each bucket is updated as its collective lands, while the backward goes on
  (``ON_ARRIVAL``), or once every bucket has landed (``AFTER_ALL``): when a transform needs
  every bucket first (clipping by the global norm, a loss scale), with ``skip_nonfinite``, with
  whole leaves owned by one rank each (Muon, sharded), or when no bucket can land before the
  backward returns (unsharded with no hooked bucket).
* ``status``: when the step's status is exchanged (``fdp._step.machine.StatusMode``): after
  the updates always; with updates that wait for every bucket a rank whose backward failed
  must stop every rank before them, told by NaN buckets where every rank sees the whole sum
  of each bucket from an elementwise in-place sum (unsharded), else by a status with the
  buckets every step.
* ``verdict``: a rank learns the step's verdict in the step itself (``IN_STEP``), or,
  unsharded with the updates waiting for every bucket, at the start of its next call
  (``NEXT_CALL``): a rank whose update fails raises at once, and the next call restores its
  params and state from a healthy rank (``Engine.repair``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._step.machine import StatusMode

__all__ = ["StepMode", "UpdateTiming", "Verdict", "VerdictTiming", "refused"]


class UpdateTiming(enum.Enum):
    """When a bucket is updated (see the module docstring)."""

    ON_ARRIVAL = "on arrival, while the backward goes on"
    AFTER_ALL = "after every bucket has landed"


class VerdictTiming(enum.Enum):
    """When a rank learns the step's verdict (see the module docstring)."""

    IN_STEP = "in the step"
    NEXT_CALL = "at the start of the next call"


@dataclass(frozen=True)
class StepMode:
    """How one program's steps run on one engine (see the module docstring)."""

    timing: UpdateTiming
    status: StatusMode
    verdict: VerdictTiming
    on_arrival: bool = False  # (timing is ON_ARRIVAL: read by a run at every bucket)

    @classmethod
    def of(cls, *, needs_all: bool, sharded: bool, lands_early: bool, has_status: bool,
           sums_in_place: bool) -> StepMode:
        """The mode of a step. ``needs_all``: something needs every bucket before any update
        (a whole-tree transform, ``skip_nonfinite``, whole leaves owned by one rank);
        ``sharded``: the buckets are cut into slices over ranks; ``lands_early``: some bucket
        can land while the backward goes on; ``has_status``: the step exchanges a status
        (more than one rank); ``sums_in_place``: the comm hook sums elementwise in place."""
        if not needs_all and (sharded or lands_early):
            return cls(UpdateTiming.ON_ARRIVAL, StatusMode.AFTER, VerdictTiming.IN_STEP, True)
        on_nan = not sharded and sums_in_place
        status = StatusMode.AFTER_AND_ON_NAN if on_nan else StatusMode.AFTER_AND_WITH_BUCKETS
        verdict = VerdictTiming.NEXT_CALL if not sharded and has_status else VerdictTiming.IN_STEP
        return cls(UpdateTiming.AFTER_ALL, status, verdict)


@dataclass(frozen=True)
class Verdict:
    """What one step tells its engine when it ends: whether it updated (False: a non-finite
    step, or a global scale that skipped it), why the state must be refused from now on
    (None: it need not be), and the error to raise (this rank's own, or a
    ``CollectiveError`` naming another rank's failure; None: the step succeeded here)."""

    updated: bool
    refusal: str | None = None
    error: BaseException | None = None


def refused(why: str) -> str:
    """The message of a state the step refuses from now on: ``why``, and the way out."""
    return (f"{why}; load a saved state (step.state_from_tree, fdp.load) or make a new one (step.init) on every "
            "rank to go on")
