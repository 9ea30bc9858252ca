"""Dynamic loss scaling: ``torch.amp.GradScaler`` as a gradient transform.

GradScaler's loop (torch/amp/grad_scaler.py) and fdp's::

    scaler.scale(loss).backward()   # grads of loss * scale        loss_fn returns loss * current_loss_scale(state)
    scaler.step(opt)                # grads * (1 / scale), or skip  chain(loss_scale(), ..., adamw(...))
    scaler.update()                 # backoff / growth of the scale    (the same transform's state)

``loss_scale`` is a global scale (``fdp.optim.global_scale``), so the plain path
(``opt.update``), the fused step and the sharded step run the same two functions: ``stats``
is each gradient leaf's inf-norm (non-finite exactly when the leaf holds an inf or a NaN:
the max of ``|x|`` never overflows and propagates NaN), and ``scale`` turns every leaf's
statistic into GradScaler's verdict: the factor ``1 / scale`` (``inv_scale``, computed as
``GradScaler.unscale_`` computes it) or ``None`` when any leaf is non-finite, which skips
the step, and the next scale and growth tracker from torch's own ``torch._amp_update_scale_``
(the kernel ``GradScaler.update`` calls; checked on torch 2.13), applied to copies:
the state is a value, never changed in place.

Under ``reducer.grad`` every rank holds the same averaged gradients, and in the sharded step
the per-leaf statistics are gathered over the ranks, so a non-finite gradient on one rank
skips the step on every rank, as under DDP (where the all-reduce spreads the inf).
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _internals, _tree
from ._base import GradientTransform, global_scale
from ._transforms import tensor_norms

__all__ = ["LossScaleState", "current_loss_scale", "loss_scale"]

_device = operator.attrgetter("device")
_to_double = operator.methodcaller("double")  # every float dtype's values, exactly


class LossScaleState(NamedTuple):
    """State of ``loss_scale``: GradScaler's two tensors.

    Attributes:
      scale: the scale the next loss is multiplied by (float32, 0-d, on the params' first
        leaf's device): ``GradScaler._scale`` (``get_scale()`` is ``float(state.scale)``).
      growth_tracker: finite steps in a row since the last growth or backoff (int32, 0-d):
        ``GradScaler._growth_tracker``.
    """

    scale: Tensor
    growth_tracker: Tensor


def loss_scale(init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
               growth_interval: int = 2000) -> GradientTransform:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s numbers, as the first part of a ``chain``.

    The loss function multiplies its loss by ``current_loss_scale(opt_state)`` (what
    ``scaler.scale(loss)`` does), so the gradients arrive scaled; this transform divides
    them by the scale again (``scaler.unscale_``: times ``1 / scale`` computed in float64
    and rounded to float32), or, when any gradient holds an inf or a NaN, skips the step:
    params and the optimizer's state stay as they were, and the transforms after it do not
    run. Then the scale is updated as ``scaler.update()`` does: multiplied by
    ``backoff_factor`` on a skipped step, by ``growth_factor`` after ``growth_interval``
    finite steps in a row (unless that would make it inf). Bit for bit GradScaler's scale,
    growth tracker, skipped steps and params (``tests/test_loss_scale.py`` runs both side
    by side), in ``opt.update``, the fused step (``reducer.grad_and_update``) and the
    sharded step, where one rank's inf skips the step on every rank.

    Place it first in the chain, as ``scaler.unscale_`` comes before ``clip_grad_norm_``:
    ``chain(loss_scale(), clip_by_global_norm(1.0), adamw(...))``. Its state (a
    ``LossScaleState`` in the chain's state) is saved and resumed with the optimizer's
    (``fdp.save``, ``step.state_to_tree``). Whether the last step was skipped:
    ``step.last_step.finite`` in the fused step (``reducer.nonfinite_steps`` counts the
    skipped steps); on the plain path the optimizer's ``step`` count did not move. Call
    ``opt.update`` on every step, also where ``reducer.finite`` is False (a step you skip
    yourself never reaches the loss scale, which then never backs off); the fused step
    hands a step its own ``skip_nonfinite`` check rejected to the loss scale too. ``opt.update``
    reads the inf/nan verdict on the host, as ``scaler.step`` does (under ``torch.compile``,
    a graph break); the fused step compiled (``step.compile()``) keeps it in the graph: the
    update is computed either way and kept only where the gradients were finite, with the
    eager step's numbers.

    Args:
      init_scale, growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.

    Returns:
      A ``GradientTransform`` (a ``global_scale``) whose state is a ``LossScaleState``.

    Raises:
      ValueError: a factor outside GradScaler's ranges; at ``init``, a float16 param
        (GradScaler refuses to unscale float16 gradients: keep float32 params and let
        ``torch.autocast`` compute in float16).

    Example:
      >>> opt = fdp.optim.chain(fdp.optim.loss_scale(init_scale=4.0), fdp.optim.sgd(lr=1.0))
      >>> params = {"w": torch.zeros(2)}
      >>> state = opt.init(params)
      >>> fdp.optim.current_loss_scale(state)        # multiply the loss by this
      tensor(4.)
      >>> params, state = opt.update({"w": torch.full((2,), 8.0)}, state, params)
      >>> params["w"]                                # the grad 8 was 4 x the loss's grad
      tensor([-2., -2.])
      >>> params, state = opt.update({"w": torch.tensor([1.0, float("inf")])}, state, params)
      >>> params["w"], fdp.optim.current_loss_scale(state)   # skipped, scale backed off
      (tensor([-2., -2.]), tensor(2.))
    """
    name = "fdp.optim.loss_scale"
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"{name}: init_scale must be a positive finite number, got {init_scale}")
    if not growth_factor > 1.0:  # GradScaler's own checks
        raise ValueError(f"{name}: growth_factor must be > 1.0, got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"{name}: backoff_factor must be in (0, 1), got {backoff_factor}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"{name}: growth_interval must be an int >= 1, got {growth_interval!r}")
    growth_factor, backoff_factor = float(growth_factor), float(backoff_factor)

    def init(params: Any) -> LossScaleState:
        leaves, treedef = _tree.flatten(params)
        if torch.float16 in {getattr(t, "dtype", None) for t in leaves}:
            for path, t in zip(_tree.paths(treedef), leaves):
                if getattr(t, "dtype", None) == torch.float16:
                    raise ValueError(
                        f"{name}: params{path} is float16; GradScaler refuses to unscale float16 gradients "
                        "(\"Attempting to unscale FP16 gradients\"): 1 / scale underflows them. Keep float32 "
                        "params and compute in float16 under torch.autocast")
        device = leaves[0].device if leaves else torch.device("cpu")
        # GradScaler's own tensors: torch.full((), init_scale, float32) and torch.full((), 0, int32).
        return LossScaleState(torch.full((), init_scale, dtype=torch.float32, device=device),
                              torch.full((), 0, dtype=torch.int32, device=device))

    def stats(leaves: list[Tensor]) -> list[Tensor]:
        return tensor_norms(leaves, math.inf)

    def verdict(norms: list[Tensor], state: LossScaleState) -> tuple[Tensor, Tensor, LossScaleState]:
        if not isinstance(state, LossScaleState):
            raise TypeError(f"{name}: state must be a LossScaleState, got {type(state).__name__}")
        found_inf = nonfinite(norms, state.scale.device)
        inv_scale = state.scale.double().reciprocal().float()  # GradScaler.unscale_'s
        new_scale, tracker = state.scale.clone(), state.growth_tracker.clone()
        _internals.amp_update_scale(new_scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        return inv_scale, found_inf == 0, LossScaleState(new_scale, tracker)

    def scale(norms: list[Tensor], state: LossScaleState) -> tuple[Tensor | None, LossScaleState]:
        inv_scale, go, new = verdict(norms, state)
        return (inv_scale if bool(go) else None), new

    # A traced fused step (fdp/_fused/traced.py) takes the verdict as a tensor: the update is
    # computed either way and kept where it holds, nothing read on the host
    scale.traced = verdict
    return global_scale(init, stats, scale)


def nonfinite(stats: list[Tensor], device: torch.device) -> Tensor:
    """GradScaler's ``found_inf``: a float32 0-d tensor on ``device``, 1.0 when any of
    ``stats`` is inf or NaN, else 0.0 (C-level maps: no Python per leaf)."""
    if not stats:
        return torch.zeros((), dtype=torch.float32, device=device)
    if _tree.compiling():  # (dynamo traces no operator.attrgetter: a comprehension there)
        finite = torch.isfinite(torch.stack([s.to(device).double() for s in stats])).all()
        return torch.logical_not(finite).to(torch.float32)
    if set(map(_device, stats)) != {device}:
        stats = list(map(operator.methodcaller("to", device), stats))
    finite = torch.isfinite(torch.stack(list(map(_to_double, stats)))).all()
    return torch.logical_not(finite).to(torch.float32)


def current_loss_scale(opt_state: Any) -> Tensor:
    """The scale to multiply this step's loss by: ``scaler.scale(loss)`` is ``loss *
    current_loss_scale(opt_state)``.

    Args:
      opt_state: the state of a ``chain`` that holds one ``loss_scale`` (its ``ChainState``,
        or the fused step's ``FusedState``), or a ``LossScaleState``.

    Returns:
      The state's scale: a float32 0-d tensor (read it, do not change it in place). Call
      this for every step with the state of the step before: the scale changes when a step
      is skipped and after ``growth_interval`` finite ones.

    Raises:
      TypeError: the state holds no ``loss_scale`` state, or more than one.

    Example:
      >>> opt = fdp.optim.chain(fdp.optim.loss_scale(), fdp.optim.adamw(lr=1e-3))
      >>> fdp.optim.current_loss_scale(opt.init({"w": torch.zeros(2)}))
      tensor(65536.)
    """
    if isinstance(opt_state, LossScaleState):
        return opt_state.scale
    transforms = getattr(opt_state, "transforms", None)  # a ChainState, a FusedState
    found = [s for s in transforms if isinstance(s, LossScaleState)] if isinstance(transforms, tuple) else []
    if len(found) != 1:
        what = (f"{len(found)} loss_scale states" if found else "no loss_scale state") if isinstance(
            transforms, tuple) else f"a {type(opt_state).__name__}, not a chain's state"
        raise TypeError(
            "fdp.optim.current_loss_scale: opt_state must be the state of a chain with one "
            f"fdp.optim.loss_scale() (its ChainState, or the fused step's FusedState); got {what}")
    return found[0].scale
