"""``multi_steps``: gradient accumulation inside the optimizer state, optax's ``MultiSteps``.

optax (``optax/transforms/_accumulation.py``, ``MultiSteps``) keeps the gradients of the
calls since the last update in its state and updates only on every k-th call:

    k        = every_k_schedule(gradient_step)
    acc      = acc + (g - acc) / (mini_step + 1)    # use_grad_mean: Welford's running mean
             = acc + g                              # otherwise: the sum
    emit     = mini_step == k - 1
    if emit:   params, inner = inner.update(acc cast like g, inner, params); acc = 0
    mini_step     = (mini_step + 1) % k
    gradient_step = gradient_step + emit

optax returns zero *updates* on the other calls; fdp's optimizers return params, so those
calls return the params unchanged. Each expression is evaluated as written, element-wise,
in the accumulator's dtype (tests/test_optim_multi_steps.py checks it against these lines
written out per leaf).

How it relates to fdp's own accumulation (``reducer.grad(..., accumulate=)``,
``step.accumulate``): those add the local gradients of the micro-batches and average the sum
over the ranks once, with one all-reduce per k micro-batches; ``multi_steps`` is fed
gradients already averaged over the ranks, one all-reduce per micro-batch. With
``use_grad_mean=False`` on one rank the two give the same numbers bit for bit (the same sum,
in the same order); on more ranks the sums associate differently (within rounding).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _tree
from ._base import Form, Optimizer, ParamLeaves, param_leaves

__all__ = ["MultiStepsState", "multi_steps"]

_dtype = operator.attrgetter("dtype")


class MultiStepsState(NamedTuple):
    """State of ``multi_steps``: optax's ``MultiStepsState`` fields.

    Attributes:
      mini_step: int64 CPU scalar: gradients accumulated since the last update (0 to k-1).
      gradient_step: int64 CPU scalar: updates the inner optimizer has applied.
      inner_opt_state: the wrapped optimizer's state.
      acc_grads: a tree like params in the accumulator's dtype: the mean (or sum) of the
        gradients since the last update; zeros right after one.
    """

    mini_step: Tensor
    gradient_step: Tensor
    inner_opt_state: Any
    acc_grads: Any


def multi_steps(opt: Optimizer, every_k_schedule: int | Callable[[int], int], use_grad_mean: bool = True, *,
                accumulator_dtype: torch.dtype | None = None) -> Optimizer:
    """``opt`` applied once every k calls, to the mean of their gradients (optax's ``MultiSteps``).

    The other calls only add their gradients into the state and return the params
    unchanged. Plain path only (``reducer.grad`` + ``opt.update``): the fused step refuses it;
    its own accumulation, ``step.accumulate`` (or ``accumulate=`` on the step), sums the
    micro-batches' local gradients and all-reduces once per k, which ``multi_steps``, fed
    averaged gradients each call, cannot.

    Args:
      opt: any fdp.optim optimizer or chain (its transforms see the accumulated gradients,
        as optax's inner transformation does).
      every_k_schedule: k, the calls per update; or a function of ``gradient_step`` (the
        updates applied so far) returning k, to vary the batch size during training.
      use_grad_mean: average the k gradients (optax's Welford running mean, ``acc + (g -
        acc) / (mini_step + 1)``); ``False`` sums them (what ``accumulate=`` does).
      accumulator_dtype: the dtype of ``acc_grads`` (e.g. ``torch.float32`` for bf16
        params). Default: the params' own (optax defaults to float32, which is JAX's
        default precision; fdp's fp64 runs stay in fp64).

    Returns:
      An ``Optimizer`` with ``MultiStepsState`` as its state. ``gradient_step`` counts the
      inner updates (the inner optimizer's schedules see its own count, as in optax).

    Raises:
      ValueError: k below 1 (an int, or what the schedule returned).

    Example:
      >>> opt = fdp.optim.multi_steps(fdp.optim.sgd(lr=1.0), 2)
      >>> params = {"w": torch.zeros(1)}
      >>> state = opt.init(params)
      >>> params, state = opt.update({"w": torch.ones(1)}, state, params)
      >>> params["w"], int(state.mini_step)  # accumulated only
      (tensor([0.]), 1)
      >>> params, state = opt.update({"w": torch.full((1,), 3.0)}, state, params)
      >>> params["w"], int(state.gradient_step)  # one step with the mean, 2
      (tensor([-2.]), 1)
    """
    name = "fdp.optim.multi_steps"
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{name}: opt must be an fdp.optim optimizer or chain, got {type(opt).__name__}")
    if not callable(every_k_schedule):
        _check_k(every_k_schedule, name)

    def every_k(gradient_step: int) -> int:
        if not callable(every_k_schedule):
            return every_k_schedule
        return _check_k(every_k_schedule(gradient_step), name)

    def init(params: Any) -> MultiStepsState:
        leaves, treedef = param_leaves(params, name)
        acc = [torch.zeros_like(t, dtype=accumulator_dtype) for t in leaves]
        zero = torch.zeros((), dtype=torch.int64)
        return MultiStepsState(zero, zero.clone(), opt.init(params), _tree.unflatten(treedef, acc))

    @torch.no_grad()
    def update(grads: Any, state: MultiStepsState, params: Any) -> tuple[Any, MultiStepsState]:
        if not isinstance(state, MultiStepsState):
            raise TypeError(f"{name}: state must be the MultiStepsState of its init, got {type(state).__name__}")
        k = every_k(int(state.gradient_step))
        n = int(state.mini_step)
        ps = ParamLeaves(params, name)
        g = ps.like(grads, "grads")
        old, got = _tree.flatten(state.acc_grads)
        if got != ps.treedef:
            raise ValueError(f"{name}: state.acc_grads does not have the structure of params: "
                             f"{_tree.first_difference(ps.treedef, got)}")
        if use_grad_mean:
            delta = torch._foreach_sub(g, old)          # g - acc
            torch._foreach_div_(delta, n + 1)           # ... / (mini_step + 1)
            acc = torch._foreach_add(old, delta)        # acc + ...
        else:
            acc = torch._foreach_add(g, old)            # g + acc
        # (C-level maps over the leaves' dtypes: a Python loop only where a cast is needed)
        if accumulator_dtype is not None and list(map(_dtype, acc)) != [accumulator_dtype] * len(acc):
            acc = [a.to(accumulator_dtype) for a in acc]
        mini = torch.tensor((n + 1) % k, dtype=torch.int64)
        if n != k - 1:
            return params, MultiStepsState(mini, state.gradient_step, state.inner_opt_state,
                                           _tree.unflatten(ps.treedef, acc))
        mean = acc  # cast like the grads (optax's cast_like)
        if list(map(_dtype, acc)) != list(map(_dtype, g)):
            mean = [a if a.dtype == t.dtype else a.to(t.dtype) for a, t in zip(acc, g)]
        params, inner = opt.update(_tree.unflatten(ps.treedef, mean), state.inner_opt_state, params)
        zeros = list(map(torch.zeros_like, acc))
        return params, MultiStepsState(mini, state.gradient_step + 1, inner, _tree.unflatten(ps.treedef, zeros))

    return Optimizer(init, update, Form(unfused=(
        "fdp.optim.multi_steps accumulates the micro-batches' gradients in its state, whole per leaf; the fused "
        "step accumulates them itself, in its flat buffers: call step.accumulate(params, *batch) for each "
        "micro-batch but the last and the step for the last, with the optimizer multi_steps wraps (it sums "
        "the micro-batches' gradients, as use_grad_mean=False does, and averages them over the ranks); or use "
        "reducer.grad and opt.update"), wraps=opt))


def _check_k(k: Any, name: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{name}: every_k_schedule must be (or return) an int >= 1, got {k!r}")
    return k
