"""``fdp.cost``: a cost model of the data-parallel step, and the bucket caps chosen from it.

``Link`` (alpha-beta collectives: ring and tree all-reduce, reduce-scatter, all-gather),
``measure_link`` (timed all-reduces on a group), ``StepProfile`` (when this rank's gradients
arrive, from step timelines), ``predict`` (a step's time and exposed communication for any
caps and world size), ``choose_caps`` and ``AutoCaps`` (``fdp.Reducer(...,
bucket_cap_mb="auto")``), ``calibrate`` (run an ``"auto"`` reducer's calibration steps
before the fused step). The model itself: docs/performance.md, "A cost model of the step".
"""

from collections.abc import Callable
from typing import Any

from ..optim._flat import split_chain
from ._autocaps import AutoCaps as AutoCaps
from ._link import Link as Link
from ._link import measure_link as measure_link
from ._predict import CANDIDATE_CAPS_MB as CANDIDATE_CAPS_MB
from ._predict import DDP_CAPS as DDP_CAPS
from ._predict import MIN_GAIN as MIN_GAIN
from ._predict import Choice as Choice
from ._predict import Prediction as Prediction
from ._predict import choose_caps as choose_caps
from ._predict import predict as predict
from ._profile import StepProfile as StepProfile

# What users call and what it returns. The constants (CANDIDATE_CAPS_MB, DDP_CAPS, MIN_GAIN)
# are importable; the reference describes them in ``choose_caps``. The model's pieces
# (``_contention``, ``_profile``, ``_predict``) are private modules, tested on their own.
__all__ = ["AutoCaps", "Choice", "Link", "Prediction", "StepProfile", "calibrate", "choose_caps",
           "measure_link", "predict"]


def calibrate(reducer: Any, fn: Callable, *args: Any, has_aux: bool = False, max_steps: int = 16,
              optimizer: Any = None, **kwargs: Any) -> Choice:
    """Run ``reducer.grad(fn, has_aux=has_aux)(*args, **kwargs)`` until an ``"auto"`` reducer
    has frozen its caps (results discarded); return the choice. For the fused step, whose
    plan is built from the frozen caps: call this before ``reducer.grad_and_update``, with
    its ``optimizer`` (an ``fdp.optim`` optimizer or chain) so that the choice prices each
    bucket's update too (``AutoCaps.optimizer``)."""
    tuning = reducer.tuning
    if tuning is None:
        raise ValueError("fdp.cost.calibrate: the reducer was not built with bucket_cap_mb='auto'")
    if optimizer is not None:
        split_chain(optimizer, "fdp.cost.calibrate", sharded=tuning.shard)  # one the fused step can run
        tuning.optimizer = optimizer
    grad_fn = reducer.grad(fn, has_aux=has_aux)
    for _ in range(max_steps):
        if tuning.frozen:
            break
        grad_fn(*args, **kwargs)
    if tuning.choice is None:
        raise RuntimeError(f"fdp.cost.calibrate: caps not chosen after {max_steps} steps")
    return tuning.choice
