"""Optimizers over torch.optim's own kernels: ``sgd``, ``adam``, ``adamw``, ``adagrad``, ``rmsprop``.

A factory returns an ``Optimizer``: ``init(params) -> state`` and ``update(grads, state,
params) -> (new_params, new_state)``. The state is a NamedTuple of a step counter and trees
like params whose fields are the ones torch.optim keeps per parameter, so it checkpoints
with ``fdp.save`` and the count survives a resume. (torch.optim has no Lion: none here.)

Each update is the tree layer over the leaf-list kernels of ``fdp.optim._kernels``: flatten
and check the trees (no Python per leaf), split the leaves into groups that share
hyper-parameters (the weight-decay ``mask``: torch's "decay" and "no decay" param groups),
and call the kernel once per group. Pure by default: params and state are cloned, then the
clones are updated. With ``donate=True`` the params and state passed in are updated in place
and returned, like JAX's ``donate_argnums`` (keep only the returned trees); a tensor that
appears twice in params is refused there, since it would be updated twice. Grads are never
modified. Updates run under ``no_grad``.

``lr`` and ``weight_decay`` may be floats or schedules of the step count (0 for the first
update). Eagerly a schedule is called with a Python int (one CPU ``.item()``, no device
sync). Under ``torch.compile`` it is called with the step counter tensor and its result, a
tensor, is the kernel's lr: the count is a graph input, so the step never recompiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _tree
from . import _kernels
from ._base import (
    KnownLeaves,
    LeafKernel,
    Optimizer,
    ParamLeaves,
    check_state,
    clone,
    leaf_options,
    param_leaves,
    take,
    zeros_like,
)
from ._hyperparams import Hyperparams

__all__ = ["AdagradState", "AdamState", "AdamWState", "RMSpropState", "SGDState",
           "adagrad", "adam", "adamw", "rmsprop", "sgd"]

Hyper = float | Callable[[Any], Any]
Mask = Any  # a tree of bools like params, or a callable (path, leaf) -> bool


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


class _Spec(NamedTuple):
    """What differs between the optimizers; ``_build`` does the rest."""

    name: str
    state: type
    needed: dict[str, bool]       # state tree fields, in kernel order: used or None
    init_value: float             # the state trees' initial value (Adagrad's accumulator)
    int_step: bool                # SGD keeps an int64 count, the others a float
    # kernel(p, g, [state lists], step tensor, first, lr, weight_decay)
    kernel: Callable[..., None]
    exact_first_step: bool = False
    torch_class: type | None = None  # the torch.optim class with these numbers
    fixed: dict[str, Any] = {}        # its other param-group entries (betas, eps, ...)


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps `step` on the CPU in this dtype (its _get_scalar_dtype()).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _value_at(value: Hyper, step: int | None, counter: Tensor) -> Any:
    if not callable(value):
        return value
    if step is None:  # under torch.compile: tensor math on the counter, no recompiles;
        return value(counter.to(torch.float64))  # in float64, as Python floats are
    return float(value(step))


def _check_hyper(name: str, **values: Hyper) -> None:
    for what, v in values.items():
        if not callable(v) and not float(v) >= 0.0:
            label = "learning rate" if what == "lr" else what
            raise ValueError(f"{name}: invalid {label} {v} (must be >= 0)")


def _build(spec: _Spec, lr: Hyper, weight_decay: Hyper, mask: Mask | None, donate: bool) -> Optimizer:
    name, fields = spec.name, list(spec.needed)
    used = [f for f in fields if spec.needed[f]]
    groups_by_tree: dict[Any, list[tuple[Callable | None, bool]]] = {}
    known = KnownLeaves() if donate else None

    def groups(ps: ParamLeaves) -> list[tuple[Callable | None, bool]]:
        """(picker of the group's leaves or None for all, decays) per kernel call."""
        if mask is None:
            return [(None, True)]
        # Under torch.compile the split is made while tracing (dynamo cannot hash a treedef).
        cached = None if _tree.compiling() else groups_by_tree.get(ps.treedef)
        if cached is None:
            flags = leaf_options(mask, ps.treedef, ps.leaves, name, "mask")
            for path, flag in zip(_tree.paths(ps.treedef), flags):
                if not isinstance(flag, bool):
                    raise TypeError(f"{name}: mask{path} is {flag!r}, not a bool")
            on = [i for i, f in enumerate(flags) if f]
            off = [i for i, f in enumerate(flags) if not f]
            cached = [(take(idx), decay) for idx, decay in ((on, True), (off, False)) if idx]
            if not _tree.compiling():
                groups_by_tree[ps.treedef] = cached
        return cached

    def leaf_groups(params: Any) -> list[int]:
        ps = ParamLeaves(params, name)
        if mask is None:
            return [0] * len(ps.leaves)
        flags = leaf_options(mask, ps.treedef, ps.leaves, name, "mask")
        return [0 if flag else 1 for flag in flags]

    @torch.no_grad()
    def leaf_step(group: int, p: list[Tensor], g: list[Tensor], state_lists: list[list[Tensor]],
                  count: Tensor) -> None:
        by_field = dict(zip(used, state_lists))
        step = _host_step(count, name, spec.exact_first_step)
        wd_now = _value_at(weight_decay, step, count) if group == 0 else 0.0
        spec.kernel(p, g, [by_field.get(f, []) for f in fields], count, step == 0,
                    _value_at(lr, step, count), wd_now)

    def init(params: Any) -> Any:
        leaves, treedef = param_leaves(params, name)
        trees = {f: _tree.unflatten(treedef, zeros_like(leaves, spec.init_value)) if need else None
                 for f, need in spec.needed.items()}
        count = torch.zeros((), dtype=torch.int64 if spec.int_step else _scalar_dtype())
        return spec.state(count, **trees)

    @torch.no_grad()
    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        check_state(state, spec.state, name, **spec.needed)
        ps = ParamLeaves(params, name, known)
        if donate and not ps.known:
            ps.check_no_aliases()
        # (A chain hands over its reused scratch grads: the same tensors every step.)
        p, g = ps.leaves, ps.like_known(grads, "grads")
        lists = [ps.like_known(getattr(state, f), f"state.{f}") for f in used]
        ps.checked()
        step = _host_step(state.step, name, spec.exact_first_step)
        lr_now = _value_at(lr, step, state.step)
        wd_now = _value_at(weight_decay, step, state.step)
        if not donate:
            p, lists = clone(p), [clone(x) for x in lists]
        by_field = dict(zip(used, lists))
        state_lists = [by_field.get(f, []) for f in fields]
        for pick, decays in groups(ps):
            sel = (lambda xs: xs) if pick is None else pick
            spec.kernel(sel(p), sel(g), [sel(x) if x else x for x in state_lists], state.step,
                        step == 0, lr_now, wd_now if decays else 0.0)
        if donate:
            state.step.add_(1)
            return params, state
        trees = {f: _tree.unflatten(ps.treedef, x) for f, x in by_field.items()}
        new_state = spec.state(state.step + 1, **{f: trees.get(f) for f in fields})
        return _tree.unflatten(ps.treedef, p), new_state

    hyper = Hyperparams(spec.torch_class, lr, weight_decay, dict(spec.fixed), mask)
    return Optimizer(init, update, LeafKernel(tuple(used), spec.init_value, leaf_groups, leaf_step),
                     hyper=hyper)


def _host_step(count: Tensor, name: str, exact_first_step: bool) -> int | None:
    """The step count as a Python int (a CPU scalar: no device sync); None under torch.compile,
    where the count stays a tensor in the graph (schedules then do tensor math on it)."""
    if not _tree.compiling():
        return int(count)
    if exact_first_step:
        raise RuntimeError(f"{name}: momentum with dampening != 0 needs the step count on the host "
                           "(torch's first step differs); it is not supported under torch.compile")
    return None


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
    _check_hyper(name, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{name}: nesterov momentum needs momentum > 0 and dampening == 0")

    def kernel(p, g, state, step, first, lr_now, wd_now):
        _kernels.sgd_group(p, g, state[0], first=first, lr=lr_now, momentum=momentum,
                           dampening=dampening, nesterov=nesterov, weight_decay=wd_now,
                           maximize=maximize)

    spec = _Spec(name, SGDState, {"momentum_buffer": momentum != 0}, 0.0, True, kernel,
                 exact_first_step=momentum != 0 and dampening != 0, torch_class=torch.optim.SGD,
                 fixed={"momentum": momentum, "dampening": dampening, "nesterov": nesterov,
                        "maximize": maximize})
    return _build(spec, lr, weight_decay, mask, donate)


def _check_adam(name: str, lr: Hyper, betas: tuple[float, float], eps: float, weight_decay: Hyper) -> None:
    _check_hyper(name, lr=lr, eps=eps, weight_decay=weight_decay)
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}: invalid betas[{i}] {beta} (must be in [0, 1))")


def _adam_like(name: str, state_cls: type, torch_class: type, group: Callable[..., None], lr: Hyper,
               betas: tuple[float, float], eps: float, weight_decay: Hyper, amsgrad: bool,
               maximize: bool, mask: Mask | None, donate: bool) -> Optimizer:
    _check_adam(name, lr, betas, eps, weight_decay)
    beta1, beta2 = betas

    def kernel(p, g, state, step, first, lr_now, wd_now):
        m, v, vmax = state
        group(p, g, m, v, vmax, step, lr=lr_now, beta1=beta1, beta2=beta2, eps=eps,
              weight_decay=wd_now, amsgrad=amsgrad, maximize=maximize)

    needed = {"exp_avg": True, "exp_avg_sq": True, "max_exp_avg_sq": amsgrad}
    fixed = {"betas": (beta1, beta2), "eps": eps, "amsgrad": amsgrad, "maximize": maximize}
    spec = _Spec(name, state_cls, needed, 0.0, False, kernel, torch_class=torch_class, fixed=fixed)
    return _build(spec, lr, weight_decay, mask, donate)


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
                      weight_decay, amsgrad, maximize, mask, donate)


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
    _check_hyper(name, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                 initial_accumulator_value=initial_accumulator_value)

    def kernel(p, g, state, step, first, lr_now, wd_now):
        _kernels.adagrad_group(p, g, state[0], step, lr=lr_now, lr_decay=lr_decay,
                               weight_decay=wd_now, eps=eps, maximize=maximize)

    spec = _Spec(name, AdagradState, {"sum": True}, initial_accumulator_value, False, kernel,
                 torch_class=torch.optim.Adagrad,
                 fixed={"lr_decay": lr_decay, "eps": eps, "maximize": maximize,
                        "initial_accumulator_value": initial_accumulator_value})
    return _build(spec, lr, weight_decay, mask, donate)


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
    _check_hyper(name, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)

    def kernel(p, g, state, step, first, lr_now, wd_now):
        square_avg, grad_avg, buf = state
        _kernels.rmsprop_group(p, g, square_avg, grad_avg, buf, step, lr=lr_now, alpha=alpha,
                               eps=eps, weight_decay=wd_now, momentum=momentum,
                               centered=centered, maximize=maximize)

    needed = {"square_avg": True, "grad_avg": centered, "momentum_buffer": momentum > 0}
    fixed = {"alpha": alpha, "eps": eps, "momentum": momentum, "centered": centered, "maximize": maximize}
    spec = _Spec(name, RMSpropState, needed, 0.0, False, kernel, torch_class=torch.optim.RMSprop,
                 fixed=fixed)
    return _build(spec, lr, weight_decay, mask, donate)
