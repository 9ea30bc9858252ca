"""Optimizers over torch.optim's own kernels: ``sgd``, ``adam``, ``adamw``, ``adagrad``, ``rmsprop``
(``nadam``, ``radam``, ``adamax``, ``adadelta`` are in ``_adaptive``, ``adafactor`` in
``_adafactor``, optax's ``lion`` in ``_lion``).

A factory returns an ``Optimizer``: ``init(params) -> state`` and ``update(grads, state,
params) -> (new_params, new_state)``. The state is a NamedTuple of a step counter and trees
like params whose fields are the ones torch.optim keeps per parameter, so it checkpoints
with ``fdp.save`` and the count survives a resume.

Each update is ``_build.build``'s tree layer over the leaf-list kernels of
``fdp.optim._kernels``: flatten and check the trees (no Python per leaf), split the leaves
into groups that share hyper-parameters (the weight-decay ``mask``: torch's "decay" and "no
decay" param groups), and call the kernel once per group. Pure by default: params and state
are cloned, then the clones are updated. With ``donate=True`` the params and state passed in
are updated in place and returned, like JAX's ``donate_argnums`` (keep only the returned
trees); a tensor that appears twice in params is refused there, since it would be updated
twice. Grads are never modified. Updates run under ``no_grad``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _kernels
from ._base import Optimizer
from ._build import Hyper, Mask, Spec, build, check_betas, check_hyper

__all__ = ["AdagradState", "AdamState", "AdamWState", "RMSpropState", "SGDState",
           "adagrad", "adam", "adamw", "rmsprop", "sgd"]

class SGDState(NamedTuple):
    """State of ``sgd``: ``step`` (int64 CPU scalar: updates applied) and ``momentum_buffer``
    (a tree like params, or ``None`` when ``momentum == 0``)."""

    step: Tensor
    momentum_buffer: Any


class AdamState(NamedTuple):
    """State of ``adam``: ``step`` (a float CPU scalar, torch.optim's dtype for its
    per-parameter ``step``), ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``,
    ``max_exp_avg_sq`` (trees like params; else ``None``)."""

    step: Tensor
    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any


class AdamWState(NamedTuple):
    """State of ``adamw``: the fields of ``AdamState``."""

    step: Tensor
    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any


class AdagradState(NamedTuple):
    """State of ``adagrad``: ``step`` and ``sum`` (a tree like params, torch's ``sum``)."""

    step: Tensor
    sum: Any


class RMSpropState(NamedTuple):
    """State of ``rmsprop``: ``step``, ``square_avg``, ``grad_avg`` (``centered`` only, else
    ``None``) and ``momentum_buffer`` (``momentum > 0`` only, else ``None``)."""

    step: Tensor
    square_avg: Any
    grad_avg: Any
    momentum_buffer: Any


def sgd(lr: Hyper, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
        weight_decay: Hyper = 0.0, *, maximize: bool = False, mask: Mask | None = None,
        donate: bool = False) -> Optimizer:
    """Stochastic gradient descent with ``torch.optim.SGD``'s arguments and numbers.

    Args:
      lr: learning rate, or a schedule of the number of updates applied (0 for the first).
      momentum, dampening, nesterov, maximize: as in ``torch.optim.SGD``.
      weight_decay: as in ``torch.optim.SGD`` (L2 added to the grad), or a schedule.
      mask: which leaves get weight decay: a tree of bools like params or a callable
        ``(path, leaf) -> bool`` (``path``: the parameter name for a flat dict of params,
        else a tuple of keys; see ``adamw``); the others are a torch param group with
        ``weight_decay=0``.
      donate: update params and state in place and return them (the inputs are consumed).

    Returns:
      An ``Optimizer`` with ``SGDState`` as its state.

    Raises:
      ValueError: a negative lr, momentum or weight decay, or nesterov without momentum or
        with dampening (torch.optim.SGD's checks).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.sgd(lr=0.1, momentum=0.9)
      >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> params["w"], int(state.step)
      (tensor([0.9000, 0.9000]), 1)
    """
    name = "fdp.optim.sgd"
    check_hyper(name, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{name}: nesterov momentum needs momentum > 0 and dampening == 0")

    kernel = functools.partial(_kernels.sgd_kernel, momentum=momentum, dampening=dampening, nesterov=nesterov,
                               maximize=maximize)

    spec = Spec(name, SGDState, {"momentum_buffer": momentum != 0}, 0.0, True, kernel,
                torch_class=torch.optim.SGD,
                fixed={"momentum": momentum, "dampening": dampening, "nesterov": nesterov, "maximize": maximize},
                 host_step="momentum with dampening != 0 (torch's first step differs)"
                 if momentum != 0 and dampening != 0 else None)
    return build(spec, lr, weight_decay, mask, donate)


def _check_adam(name: str, lr: Hyper, betas: tuple[float, float], eps: float, weight_decay: Hyper) -> None:
    check_hyper(name, lr=lr, eps=eps, weight_decay=weight_decay)
    check_betas(name, betas)


def _adam_like(name: str, state_cls: type, torch_class: type, group: Callable[..., None], lr: Hyper,
               betas: tuple[float, float], eps: float, weight_decay: Hyper, amsgrad: bool,
               maximize: bool, mask: Mask | None, donate: bool, decoupled: bool = False) -> Optimizer:
    _check_adam(name, lr, betas, eps, weight_decay)
    beta1, beta2 = betas

    kernel = functools.partial(_kernels.adam_kernel, group=group, beta1=beta1, beta2=beta2, eps=eps, amsgrad=amsgrad,
                               maximize=maximize)

    needed = {"exp_avg": True, "exp_avg_sq": True, "max_exp_avg_sq": amsgrad}
    fixed = {"betas": tuple(betas), "eps": eps, "amsgrad": amsgrad, "maximize": maximize}
    spec = Spec(name, state_cls, needed, 0.0, False, kernel, torch_class=torch_class, fixed=fixed,
                decoupled=decoupled)
    return build(spec, lr, weight_decay, mask, donate)


def adam(lr: Hyper = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: Hyper = 0.0, amsgrad: bool = False, *, maximize: bool = False,
         mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """Adam with ``torch.optim.Adam``'s arguments and numbers (L2 weight decay in the grad).

    Args:
      lr, weight_decay: floats or schedules of the step count.
      betas, eps, amsgrad, maximize: as in ``torch.optim.Adam``.
      mask: which leaves get weight decay (a tree of bools or ``(path, leaf) -> bool``).
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``AdamState`` as its state.

    Raises:
      ValueError: an lr, eps or weight decay below 0, or a beta outside [0, 1).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.adam(lr=0.1)
      >>> opt.update({"w": torch.ones(2)}, opt.init(params), params)[0]["w"]
      tensor([0.9000, 0.9000])
    """
    return _adam_like("fdp.optim.adam", AdamState, torch.optim.Adam, _kernels.adam_group, lr, betas, eps,
                      weight_decay, amsgrad, maximize, mask, donate)


def adamw(lr: Hyper = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: Hyper = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
          mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """Adam with decoupled weight decay, with ``torch.optim.AdamW``'s arguments and numbers.

    The weight-decay default is torch's ``1e-2`` (optax's ``adamw`` defaults to ``1e-4``).

    Args:
      lr, weight_decay: floats or schedules of the step count.
      betas, eps, amsgrad, maximize: as in ``torch.optim.AdamW``.
      mask: which leaves get weight decay: a tree of bools like params or a callable
        ``(path, leaf) -> bool`` (e.g. ``lambda path, p: p.dim() >= 2``: no decay on biases
        and norms); the others form a param group with ``weight_decay=0``. ``path`` is the
        leaf's key: the parameter name for a flat dict of params (``"fc.bias"``), else the
        tuple of keys from the root (``("enc", "layers", 0, "w")``).
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``AdamWState`` as its state.

    Raises:
      ValueError: an lr, eps or weight decay below 0, or a beta outside [0, 1).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.adamw(lr=0.1)
      >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> params["w"]  # decayed by lr * weight_decay, then moved by lr * m_hat / sqrt(v_hat)
      tensor([0.8990, 0.8990])
    """
    return _adam_like("fdp.optim.adamw", AdamWState, torch.optim.AdamW, _kernels.adamw_group, lr, betas, eps,
                      weight_decay, amsgrad, maximize, mask, donate, decoupled=True)


def adagrad(lr: Hyper = 1e-2, lr_decay: float = 0.0, weight_decay: Hyper = 0.0,
            initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, maximize: bool = False,
            mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """Adagrad with ``torch.optim.Adagrad``'s arguments and numbers.

    Args:
      lr, weight_decay: floats or schedules of the step count.
      lr_decay, initial_accumulator_value, eps, maximize: as in ``torch.optim.Adagrad``.
      mask: which leaves get weight decay.
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``AdagradState`` as its state.

    Raises:
      ValueError: an lr, lr_decay, weight decay, eps or initial accumulator value below 0.

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.adagrad(lr=0.1)
      >>> opt.update({"w": torch.ones(2)}, opt.init(params), params)[0]["w"]
      tensor([0.9000, 0.9000])
    """
    name = "fdp.optim.adagrad"
    check_hyper(name, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                 initial_accumulator_value=initial_accumulator_value)

    kernel = functools.partial(_kernels.adagrad_kernel, lr_decay=lr_decay, eps=eps, maximize=maximize)

    spec = Spec(name, AdagradState, {"sum": True}, initial_accumulator_value, False, kernel,
                torch_class=torch.optim.Adagrad,
                fixed={"lr_decay": lr_decay, "eps": eps, "maximize": maximize,
                       "initial_accumulator_value": initial_accumulator_value})
    return build(spec, lr, weight_decay, mask, donate)


def rmsprop(lr: Hyper = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: Hyper = 0.0,
            momentum: float = 0.0, centered: bool = False, *, maximize: bool = False,
            mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """RMSprop with ``torch.optim.RMSprop``'s arguments and numbers.

    Args:
      lr, weight_decay: floats or schedules of the step count.
      alpha, eps, momentum, centered, maximize: as in ``torch.optim.RMSprop``.
      mask: which leaves get weight decay.
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``RMSpropState`` as its state.

    Raises:
      ValueError: an lr, alpha, eps, weight decay or momentum below 0.

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.rmsprop(lr=0.01)
      >>> opt.update({"w": torch.ones(2)}, opt.init(params), params)[0]["w"]
      tensor([0.9000, 0.9000])
    """
    name = "fdp.optim.rmsprop"
    check_hyper(name, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)

    kernel = functools.partial(_kernels.rmsprop_kernel, alpha=alpha, eps=eps, momentum=momentum, centered=centered,
                               maximize=maximize)

    needed = {"square_avg": True, "grad_avg": centered, "momentum_buffer": momentum > 0}
    fixed = {"alpha": alpha, "eps": eps, "momentum": momentum, "centered": centered, "maximize": maximize}
    spec = Spec(name, RMSpropState, needed, 0.0, False, kernel, torch_class=torch.optim.RMSprop, fixed=fixed)
    return build(spec, lr, weight_decay, mask, donate)
