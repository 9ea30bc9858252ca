"""``inspect``: one place to read what the last update did, for logging: the step count, the
lr and the other hyper-parameters per label as torch's param groups show them, the norm the
clip saw, the loss scale, the EMA's decay and averages taken, ``multi_steps``' micro-steps.

Read from the optimizer and its state, whatever wraps what (``chain``, ``partition``,
``ema``, ``inject_hyperparams``, ``multi_steps``, ``loss_scale``, Muon), on the plain path's
per-leaf state and on the fused step's ``FusedState`` (sharded or not) alike: everything it
reads is a scalar every rank holds (the count, the transforms' states, the injected values),
so nothing is gathered and nothing communicates. The fused step's ``step.inspect(opt_state)``
adds what only the step knows: the last step's finite verdict and the skipped steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor

from .._protocols import FlatOptState
from ._base import NO_FORM, ChainState, Optimizer
from ._ema import EmaState
from ._inject import InjectHyperparamsState
from ._loss_scale import LossScaleState
from ._multi_steps import MultiStepsState
from ._transforms import ClipState, PartitionState

__all__ = ["Inspection", "inspect"]


class Inspection(NamedTuple):
    """What an update did, as ``fdp.optim.inspect`` (or the fused step's ``step.inspect``)
    reads it. ``None``: the optimizer has no such part (no clip, no loss scale, ...).

    Attributes:
      step: updates applied (the optimizer's own count; a ``partition``'s largest).
      hyperparams: per label (``None`` for an optimizer without labels), the values the last
        update used, as torch's param group holds them during that ``opt.step()``: ``lr``,
        ``weight_decay`` and the optimizer's others (``betas``, ``eps``, ``momentum``, ...);
        schedules evaluated at the count that update saw, injected values as the state holds
        them. ``{}`` for a label whose optimizer declares none (``frozen()``, your own) and
        before the first update (unless ``next_update=True``).
      clip_norm: the global norm ``clip_by_global_norm`` measured before clipping, as
        ``clip_grad_norm_`` returns it (inf or nan on a step ``skip_nonfinite`` skipped;
        ``None`` before the first update).
      loss_scale: the scale the next loss is multiplied by (``GradScaler.get_scale()``).
      ema_decay: ``ema``'s decay. averages: the averages it has taken.
      micro_steps: ``multi_steps``: gradients accumulated toward the next update.
      finite: the last step's verdict (False: it updated nothing); ``step.inspect`` only.
      skipped: steps skipped as non-finite so far (``reducer.nonfinite_steps``); ``step.inspect`` only.
    """

    step: int
    hyperparams: dict[Any, dict[str, Any]]
    clip_norm: float | None = None
    loss_scale: float | None = None
    ema_decay: float | None = None
    averages: int | None = None
    micro_steps: int | None = None
    finite: bool | None = None
    skipped: int | None = None

    @property
    def lr(self) -> Any:
        """The last update's lr: a float, or per label ``{label: lr}`` (labels without one left out)."""
        if list(self.hyperparams) == [None]:
            return self.hyperparams[None].get("lr")
        return {label: hp["lr"] for label, hp in self.hyperparams.items() if "lr" in hp}

    def scalars(self) -> dict[str, float]:
        """A flat ``{name: number}`` for a logger (``wandb.log(info.scalars(), step=info.step)``):
        ``step``, each numeric hyper-parameter (``lr``; per label ``lr/<label>``; a tuple's
        items as ``betas.0``, ``betas.1``), and each of the other fields that is known (counts
        as ints, the rest as floats; ``finite`` as 1.0 or 0.0)."""
        out: dict[str, float] = {"step": self.step}
        for label, hp in self.hyperparams.items():
            suffix = "" if label is None else f"/{label}"
            for key, value in hp.items():
                if isinstance(value, tuple):
                    for i, v in enumerate(value):
                        out[f"{key}.{i}{suffix}"] = float(v)
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    out[f"{key}{suffix}"] = float(value)
        for key in ("clip_norm", "loss_scale", "ema_decay", "averages", "micro_steps", "finite", "skipped"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value if isinstance(value, int) and not isinstance(value, bool) else float(value)
        return out


@dataclass
class _Found:
    next_update: bool
    steps: list[int] = field(default_factory=list)
    hyperparams: dict[Any, dict[str, Any]] = field(default_factory=dict)
    clip_norm: float | None = None
    loss_scale: float | None = None
    ema_decay: float | None = None
    averages: int | None = None
    micro_steps: int | None = None

    def label(self, label: Any, opt: Optimizer, count: int) -> None:
        """``label``'s optimizer ``opt`` (a kernel's, wrappers taken off), after ``count`` updates."""
        self.steps.append(count)
        about = dict(opt.form.about)
        if "ema_decay" in about:
            self.ema_decay = about["ema_decay"]
        hyper = opt.form.hyper
        if hyper is None or (count == 0 and not self.next_update):
            self.hyperparams.setdefault(label, {})
        else:
            self.hyperparams[label] = hyper.at(count if self.next_update else count - 1)

    def transform(self, state: Any) -> None:
        if isinstance(state, ClipState) and self.clip_norm is None:
            self.clip_norm = float(state.norm)
        elif isinstance(state, LossScaleState):
            self.loss_scale = float(state.scale)


def inspect(opt: Optimizer, state: Any, *, next_update: bool = False) -> Inspection:
    """What the last update of ``opt`` did, read from its ``state`` (see ``Inspection``).

    Works on the state ``opt.init``/``opt.update`` make (any nesting of ``chain``,
    ``partition``, ``ema``, ``inject_hyperparams``, ``multi_steps``) and on the fused step's
    ``FusedState``, sharded included, without gathering it: every value it reads is a scalar
    each rank holds. Call it outside a compiled step, on the state it returned.

    Args:
      opt: the optimizer the state belongs to (for the fused step, the one given to
        ``grad_and_update``).
      state: its state.
      next_update: report the hyper-parameters the next update will use instead (torch's
        ``group["lr"]`` after ``scheduler.step()``).

    Returns:
      An ``Inspection``; ``.scalars()`` flattens it for a logger.

    Raises:
      TypeError: ``opt`` is not an fdp.optim optimizer, or ``state`` is not its state.

    Example:
      >>> opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0),
      ...                       fdp.optim.adamw(lr=lambda t: 0.1 / (t + 1), weight_decay=0.0))
      >>> params = {"w": torch.ones(2)}
      >>> state = opt.init(params)
      >>> for _ in range(2):
      ...     params, state = opt.update({"w": torch.full((2,), 3.0)}, state, params)
      >>> info = fdp.optim.inspect(opt, state)
      >>> info.step, info.lr, round(info.clip_norm, 4)  # the second update used lr(1)
      (2, 0.05, 4.2426)
      >>> sorted(info.scalars())[:4]
      ['betas.0', 'betas.1', 'clip_norm', 'eps']
    """
    name = "fdp.optim.inspect"
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{name}: opt must be an fdp.optim optimizer, got {type(opt).__name__}")
    found = _Found(next_update)
    if isinstance(state, FlatOptState):
        _flat(opt, state, found)
    else:
        _walk(opt, state, None, found, name)
    if not found.steps:
        raise TypeError(f"{name}: found no step count in a {type(state).__name__}: pass the state that this "
                        "optimizer's init or update (or the fused step) made")
    step = max(found.steps)
    clip_norm = found.clip_norm
    if step == 0 and clip_norm is not None and math.isfinite(clip_norm):
        clip_norm = None  # (no clip has run: the state's 0; a first step skipped as non-finite keeps its inf/nan)
    return Inspection(step, found.hyperparams, clip_norm, found.loss_scale, found.ema_decay,
                      found.averages, found.micro_steps)


def _walk(opt: Any, state: Any, label: Any, found: _Found, name: str) -> None:
    """``opt``'s part of a per-leaf state: wrappers taken off down to each label's kernel."""
    form = opt.form if isinstance(opt, Optimizer) else NO_FORM
    if form.parts and isinstance(state, ChainState):
        for s in state.transforms:
            found.transform(s)
        _walk(form.parts[-1], state.optimizer, label, found, name)
    elif form.partition is not None and isinstance(state, PartitionState):
        for lab, s in state.states.items():
            _walk(form.partition.optimizers[lab], s, lab, found, name)
    elif form.bind is not None and isinstance(state, InjectHyperparamsState):
        _walk(form.bind(state.hyperparams), state.inner_state, label, found, name)
    elif form.wraps is not None and isinstance(state, MultiStepsState):
        found.micro_steps = int(state.mini_step)
        _walk(form.wraps, state.inner_opt_state, label, found, name)
    elif isinstance(state, EmaState):  # (an optimizer of your own inside ema: nothing more to read)
        found.ema_decay = dict(form.about).get("ema_decay")
        found.averages = int(state.count)
        found.steps.append(int(state.count))
    elif (count := _count(state)) is not None:
        found.label(label, opt, count)
        if "ema" in state._fields:
            found.averages = count
    elif state == ():  # a label that keeps no state (frozen())
        found.hyperparams.setdefault(label, {})
    else:
        raise TypeError(f"{name}: a {type(state).__name__} is not the state of this optimizer "
                        f"({'label ' + repr(label) + ': ' if label is not None else ''}no step count in it): pass the "
                        "state that this optimizer's init or update made")


def _flat(opt: Optimizer, state: Any, found: _Found) -> None:
    """The fused step's state: its count, its transforms' states, its injected values."""
    for s in state.transforms:
        found.transform(s)
    outer = opt.form.parts[-1] if opt.form.parts else opt
    if outer.form.bind is not None:
        outer = outer.form.bind(state.hyperparams)
    count = int(state.step)
    partition = outer.form.partition
    for label, o in (partition.optimizers.items() if partition is not None else [(None, outer)]):
        found.label(label, o, count)
    if found.ema_decay is not None:
        found.averages = count  # (the fused step averages once per update)


def _count(state: Any) -> int | None:
    step = getattr(state, "step", None) if "step" in getattr(type(state), "_fields", ()) else None
    if isinstance(step, Tensor) and step.dim() == 0:
        return int(step)
    return step if isinstance(step, int) else None
