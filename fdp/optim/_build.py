"""The tree layer every element-wise optimizer shares: ``build(Spec(...), ...)``.

An optimizer over a leaf-list kernel (torch.optim's functional kernels, or lion's) differs
from the others only in its state fields and its kernel; ``build`` does the rest: ``init``
(state trees like params, a step count), ``update`` (flatten and check the trees without
Python per leaf, split the leaves into hyper-parameter groups by the weight-decay ``mask``,
call the kernel once per group, pure or donated) and the ``LeafKernel`` that the fused step
runs per bucket.

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
from ._base import (
    Form,
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

__all__ = ["Hyper", "Mask", "MaskGroups", "Spec", "build", "check_betas", "check_hyper", "host_step", "scalar_dtype",
           "value_at"]

Hyper = float | Callable[[Any], Any]
Mask = Any  # a tree of bools like params, or a callable (path, leaf) -> bool


class Spec(NamedTuple):
    """What differs between the element-wise optimizers; ``build`` does the rest.

    ``kernel(p, g, state_lists, count, step, lr, weight_decay)`` updates lists of tensors of
    one group in place: ``state_lists`` has one list per field of ``needed`` (empty for a
    field not used), ``count`` is the step counter tensor (updates applied), ``step`` the
    same as a Python int (``None`` under torch.compile, unless ``host_step`` is set, which
    then refuses to compile), ``lr`` and ``weight_decay`` the values at this update.
    """

    name: str
    state: type
    needed: dict[str, bool]       # state tree fields, in kernel order: used or None
    init_value: float             # the state trees' initial value (Adagrad's accumulator)
    int_step: bool                # SGD keeps an int64 count, the others a float
    kernel: Callable[..., None]
    host_step: str | None = None  # why the kernel needs the count on the host (refused under compile)
    check_params: Callable[[list[Tensor], Any], None] | None = None  # extra checks at init
    torch_class: type | None = None  # the torch.optim class with these numbers (fdp.optim.hyperparams)
    fixed: dict[str, Any] = {}        # its other param-group entries (betas, eps, ...)
    whole_leaves: bool = False        # the kernel needs each leaf whole, in its shape (Muon)
    decoupled: bool = False           # its weight decay is ``p.mul_(1 - lr * wd)`` first, alone (LeafKernel.decay)


def scalar_dtype() -> torch.dtype:
    """torch.optim's dtype for its per-parameter ``step`` (its ``_get_scalar_dtype()``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def value_at(value: Hyper, step: int | None, counter: Tensor) -> Any:
    """A hyper-parameter at update ``step``: the float itself, or the schedule's value."""
    if not callable(value):
        return value
    if step is None:  # under torch.compile: tensor math on the counter, no recompiles;
        return value(counter.to(torch.float64))  # in float64, as Python floats are
    return float(value(step))


def check_hyper(name: str, **values: Hyper) -> None:
    """Each value (a float; schedules are not checked) is >= 0, or a ``ValueError``."""
    for what, v in values.items():
        if not callable(v) and not float(v) >= 0.0:
            label = "learning rate" if what == "lr" else what
            raise ValueError(f"{name}: invalid {label} {v} (must be >= 0)")


def check_betas(name: str, betas: tuple[float, ...], what: str = "betas") -> None:
    """Each beta is in [0, 1) (torch.optim's check), or a ``ValueError``."""
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name}: invalid {what}[{i}] {beta} (must be in [0, 1))")


def host_step(count: Tensor, name: str, why: str | None) -> int | None:
    """The step count as a Python int (a CPU scalar: no device sync); None under torch.compile,
    where the count stays a tensor in the graph (schedules then do tensor math on it)."""
    if not _tree.compiling():
        return int(count)
    if why is not None:
        raise RuntimeError(f"{name}: {why} needs the step count on the host; it is not supported "
                           "under torch.compile")
    return None


class MaskGroups:
    """The weight-decay ``mask`` as hyper-parameter groups: torch's "decay" and "no decay"
    param groups, each updated by its own kernel call (leaves in tree order within each)."""

    def __init__(self, mask: Mask | None, name: str) -> None:
        self.mask, self.name = mask, name
        self._by_tree: dict[Any, list[tuple[Callable | None, bool]]] = {}

    def _flags(self, treedef: Any, leaves: list[Tensor]) -> list[bool]:
        flags = leaf_options(self.mask, treedef, leaves, self.name, "mask")
        for path, flag in zip(_tree.paths(treedef), flags):
            if not isinstance(flag, bool):
                raise TypeError(f"{self.name}: mask{path} is {flag!r}, not a bool")
        return flags

    def of(self, ps: ParamLeaves) -> list[tuple[Callable | None, bool]]:
        """(picker of the group's leaves or None for all, decays) per kernel call."""
        if self.mask is None:
            return [(None, True)]
        # Under torch.compile the split is made while tracing (dynamo cannot hash a treedef).
        cached = None if _tree.compiling() else self._by_tree.get(ps.treedef)
        if cached is None:
            flags = self._flags(ps.treedef, ps.leaves)
            on = [i for i, f in enumerate(flags) if f]
            off = [i for i, f in enumerate(flags) if not f]
            cached = [(take(idx), decay) for idx, decay in ((on, True), (off, False)) if idx]
            if not _tree.compiling():
                self._by_tree[ps.treedef] = cached
        return cached

    def per_leaf(self, params: Any) -> list[int]:
        """``LeafKernel.groups``: per leaf, 0 (weight decay on) or 1 (off)."""
        ps = ParamLeaves(params, self.name)
        if self.mask is None:
            return [0] * len(ps.leaves)
        return [0 if flag else 1 for flag in self._flags(ps.treedef, ps.leaves)]


def build(spec: Spec, lr: Hyper, weight_decay: Hyper, mask: Mask | None, donate: bool) -> Optimizer:
    """The ``Optimizer`` (with its ``LeafKernel``) of ``spec``'s kernel and state fields."""
    name, fields = spec.name, list(spec.needed)
    used = [f for f in fields if spec.needed[f]]
    groups = MaskGroups(mask, name)
    known = KnownLeaves() if donate else None

    @torch.no_grad()
    def leaf_step(group: int, p: list[Tensor], g: list[Tensor], state_lists: list[list[Tensor]],
                  count: Tensor) -> None:
        by_field = dict(zip(used, state_lists))
        step = host_step(count, name, spec.host_step)
        wd_now = value_at(weight_decay, step, count) if group == 0 else 0.0
        spec.kernel(p, g, [by_field.get(f, []) for f in fields], count, step,
                    value_at(lr, step, count), wd_now)

    @torch.no_grad()
    def leaf_decay(p: list[Tensor], count: Tensor) -> None:
        step = host_step(count, name, spec.host_step)
        wd_now = value_at(weight_decay, step, count)
        if wd_now != 0:  # (torch.optim's own test: a decay of 0 multiplies nothing)
            torch._foreach_mul_(p, 1 - value_at(lr, step, count) * wd_now)

    def init(params: Any) -> Any:
        leaves, treedef = param_leaves(params, name)
        if spec.check_params is not None:
            spec.check_params(leaves, treedef)
        trees = {f: _tree.unflatten(treedef, zeros_like(leaves, spec.init_value)) if need else None
                 for f, need in spec.needed.items()}
        count = torch.zeros((), dtype=torch.int64 if spec.int_step else scalar_dtype())
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
        step = host_step(state.step, name, spec.host_step)
        lr_now = value_at(lr, step, state.step)
        wd_now = value_at(weight_decay, step, state.step)
        if not donate:
            p, lists = clone(p), [clone(x) for x in lists]
        by_field = dict(zip(used, lists))
        state_lists = [by_field.get(f, []) for f in fields]
        for pick, decays in groups.of(ps):
            sel = (lambda xs: xs) if pick is None else pick
            spec.kernel(sel(p), sel(g), [sel(x) if x else x for x in state_lists], state.step,
                        step, lr_now, wd_now if decays else 0.0)
        if donate:
            state.step.add_(1)
            return params, state
        trees = {f: _tree.unflatten(ps.treedef, x) for f, x in by_field.items()}
        new_state = spec.state(state.step + 1, **{f: trees.get(f) for f in fields})
        return _tree.unflatten(ps.treedef, p), new_state

    hyper = Hyperparams(spec.torch_class, lr, weight_decay, dict(spec.fixed), mask)
    return Optimizer(init, update, Form(LeafKernel(tuple(used), spec.init_value, groups.per_leaf, leaf_step,
                                                   spec.whole_leaves, leaf_decay if spec.decoupled else None),
                                        hyper=hyper))
