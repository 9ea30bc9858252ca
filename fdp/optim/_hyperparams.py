"""``hyperparams``: the step count and the lr, weight decay, ... an update used, read from an
optimizer and its state (torch.optim's ``group["lr"]``, for a state that is a value).

The count is the state's own (``state.step``; a chain's is ``state.optimizer.step``; the fused
step's ``FusedState`` has ``.step`` too), so the answer is right after a resume and needs no
counter of the caller's. Schedules are evaluated as the update evaluates them: at the number
of updates applied before it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

from ._base import ChainState, Optimizer
from ._transforms import PartitionState

__all__ = ["Hyperparams", "hyperparams"]


class Hyperparams(NamedTuple):
    """An optimizer's hyper-parameters as torch.optim names them in a param group.

    Attributes:
      torch_class: the torch.optim class with the same numbers (``torch.optim.AdamW``).
      lr: a float or a schedule of the number of updates applied (0 for the first).
      weight_decay: likewise; leaves that ``mask`` leaves out get 0.
      fixed: the other param-group entries that change the numbers, by torch's key
        (``{"betas": (0.9, 0.999), "eps": 1e-08, "amsgrad": False, "maximize": False}``).
      mask: the optimizer's ``mask=`` (``None``: every leaf decays).
    """

    torch_class: type
    lr: Any
    weight_decay: Any
    fixed: dict[str, Any]
    mask: Any = None

    def at(self, count: int) -> dict[str, Any]:
        """The values an update that finds ``count`` updates applied uses (schedules
        evaluated at ``count``): ``{"lr": ..., "weight_decay": ..., **fixed}``."""
        if count < 0:
            raise ValueError(f"fdp.optim: a step count must be >= 0, got {count}")
        return {"lr": _value(self.lr, count), "weight_decay": _value(self.weight_decay, count),
                **self.fixed}


def _value(v: Any, count: int) -> float:
    return float(v(count)) if callable(v) else float(v)


def hyperparams(opt: Optimizer, state: Any, *, next_update: bool = False) -> dict[str, Any]:
    """The step count and the hyper-parameters the last update used, as torch.optim's param
    group shows them.

    Works on the state of ``opt.update`` (a chain's ``ChainState`` included) and on the
    fused step's ``FusedState`` (``reducer.grad_and_update(loss_fn, opt)``: pass that
    ``opt``). Schedules are evaluated at the count the update saw (``count - 1`` for the last
    update), so ``lr`` equals torch's ``group["lr"]`` during that ``opt.step()`` under a
    ``LambdaLR`` with the same function.

    Args:
      opt: an optimizer over a torch.optim kernel (``sgd``, ``adam``, ``adamw``, ``adagrad``,
        ``rmsprop``) or a ``chain`` ending in one. For a ``partition``, ask per label:
        ``hyperparams(optimizers[label], state.states[label])``.
      state: its state (after at least one update, unless ``next_update``).
      next_update: report what the next update will use instead (schedules at ``count``:
        torch's ``group["lr"]`` after ``scheduler.step()``, ``get_last_lr()``).

    Returns:
      ``{"step": count, "lr": ..., "weight_decay": ..., **fixed}``: ``step`` is the number
      of updates applied; ``weight_decay`` is the decayed leaves' (``mask=`` gives the others
      0); the rest are the optimizer's other torch param-group entries (``betas``, ``eps``,
      ``momentum``, ...).

    Raises:
      TypeError: ``opt`` has no torch.optim hyper-parameters (a ``partition``, your own) or
        ``state`` has no step count.
      ValueError: no update was applied yet and ``next_update`` is False.

    Example:
      >>> opt = fdp.optim.adamw(lr=lambda t: 0.1 * 0.5 ** t, weight_decay=0.0)
      >>> params = {"w": torch.ones(2)}
      >>> state = opt.init(params)
      >>> for _ in range(3):
      ...     params, state = opt.update({"w": torch.ones(2)}, state, params)
      >>> info = fdp.optim.hyperparams(opt, state)
      >>> info["step"], info["lr"]  # the third update used lr(2)
      (3, 0.025)
      >>> fdp.optim.hyperparams(opt, state, next_update=True)["lr"]
      0.0125
    """
    name = "fdp.optim.hyperparams"
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{name}: opt must be an fdp.optim optimizer, got {type(opt).__name__}")
    inner = opt.form.parts[-1] if opt.form.parts else opt
    if opt.form.parts and isinstance(state, ChainState):
        state = state.optimizer
    if isinstance(state, PartitionState):
        raise TypeError(f"{name}: a partition has a state and hyper-parameters per label; ask per "
                        "label: hyperparams(optimizers[label], state.states[label])")
    if inner.form.hyper is None:
        if getattr(state, "hyperparams", None) is not None:  # InjectHyperparamsState, a FusedState of one
            raise TypeError(f"{name}: an inject_hyperparams state holds its values itself: read "
                            "opt_state.hyperparams (what set_hyperparams last set)")
        raise TypeError(f"{name}: this optimizer declares no torch.optim hyper-parameters (the kernel "
                        "optimizers do: sgd, adam, adamw, nadam, radam, adamax, adadelta, adagrad, rmsprop, "
                        "lion, muon; alone or at the end of a chain)")
    step = getattr(state, "step", None)
    if not isinstance(step, Tensor | int) or (isinstance(step, Tensor) and step.dim() != 0):
        raise TypeError(f"{name}: state has no step count (state.step), got a {type(state).__name__}: "
                        "pass the state opt.init, opt.update or the fused step made")
    count = int(step)
    if count == 0 and not next_update:
        raise ValueError(f"{name}: no update has been applied yet; next_update=True gives the values "
                         "the first update will use")
    return {"step": count, **inner.form.hyper.at(count if next_update else count - 1)}
