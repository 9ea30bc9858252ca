"""Gradient transforms: clipping by global norm and by value, and labelled partitions.

``clip_by_global_norm`` computes the norm and the clip coefficient exactly as
``torch.nn.utils.clip_grad_norm_`` does (torch/nn/utils/clip_grad.py): per-tensor norms
grouped by (device, dtype), their norm, ``coef = max_norm / (total + 1e-6)`` clamped at 1,
and every grad multiplied by it. Where torch has ``torch.nn.utils.get_total_norm`` (2.6 and
later) fdp calls it, so the summation order is torch's own; before that the same steps are
written out here. The grads are multiplied out of place (``torch._foreach_mul``, the same
elementwise product as torch's in-place ``_foreach_mul_``), so the input tree is never modified.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from itertools import repeat
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _tree
from ._base import GradientTransform, Optimizer, leaf_options

__all__ = ["PartitionState", "clip_by_global_norm", "clip_by_value", "frozen", "global_norm",
           "partition"]

from torch.utils import _foreach_utils

_get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
_device = operator.attrgetter("device")
_dtype = operator.attrgetter("dtype")


def _devices(leaves: list[Tensor]) -> set[torch.device]:
    # map() over a C getter: no Python per leaf; dynamo cannot trace attrgetter, so a loop there.
    return {t.device for t in leaves} if _tree.compiling() else set(map(_device, leaves))


def _dtypes(leaves: list[Tensor]) -> list[torch.dtype]:
    return [t.dtype for t in leaves] if _tree.compiling() else list(map(_dtype, leaves))


def global_norm(grads: Any, norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> Tensor:
    """The norm of all leaves of ``grads`` as one vector, as ``clip_grad_norm_`` computes it.

    Args:
      grads: a pytree of tensors.
      norm_type: the p of the p-norm (``inf`` for the max norm).
      error_if_nonfinite: raise if the norm is nan or inf (reads it on the host).

    Returns:
      A scalar tensor on the first leaf's device.

    Raises:
      RuntimeError: ``error_if_nonfinite`` and the norm is not finite.

    Example:
      >>> fdp.optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
      tensor(5.)
    """
    leaves = _tree.leaves(grads)
    if _get_total_norm is not None:
        return _get_total_norm(leaves, norm_type, error_if_nonfinite)
    # torch < 2.6: torch.nn.utils.clip_grad_norm_'s own steps (per-tensor norms grouped by
    # (device, dtype) in first-seen order, then the norm of their stack), with no Python per
    # leaf: the grouping is one C++ call, the norms one _foreach_norm per group.
    if not leaves:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    first = leaves[0].device
    stacks = []
    for (device, _), ([group], _) in _foreach_utils._group_tensors_by_device_and_dtype([leaves]).items():
        if _foreach_utils._has_foreach_support(group, device):
            norms = torch._foreach_norm(group, norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in group]
        stacks.append(torch.stack(norms).to(first))
    total = torch.linalg.vector_norm(torch.cat(stacks), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(  # torch 2.4's clip_grad_norm_ message, word for word
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def tensor_norms(tensors: list[Tensor], norm_type: float = 2.0) -> list[Tensor]:
    """The per-tensor norms ``global_norm`` combines, computed as it computes them
    (``torch._foreach_norm`` where the device has it, else one ``linalg.vector_norm`` each)."""
    out: list[Tensor] = []
    for t in tensors:
        if _foreach_utils._has_foreach_support([t], t.device):
            out.extend(torch._foreach_norm([t], norm_type))
        else:
            out.append(torch.linalg.vector_norm(t, norm_type))
    return out


def norm_of_norms(norms: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """``global_norm`` of the tensors whose ``tensor_norms`` are ``norms``: their p-norm,
    stacked in torch's order (grouped by device and dtype, each group in first-seen order)."""
    if not norms:
        return torch.tensor(0.0)
    groups: dict[tuple, list[Tensor]] = {}
    for n in norms:
        groups.setdefault((n.device, n.dtype), []).append(n)
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for g in groups.values() for n in g]), norm_type)


class ClipState(NamedTuple):
    """State of ``clip_by_global_norm``: the last norm seen (before clipping), for logging."""

    norm: Tensor


def clip_by_global_norm(max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> GradientTransform:
    """Scale all grads by ``min(1, max_norm / (norm + 1e-6))``: ``clip_grad_norm_``.

    Args:
      max_norm: the largest norm the grads keep.
      norm_type, error_if_nonfinite: as ``torch.nn.utils.clip_grad_norm_``.

    Returns:
      A ``GradientTransform`` whose state is a ``ClipState`` holding the norm before
      clipping (what ``clip_grad_norm_`` returns).

    Example:
      >>> clip = fdp.optim.clip_by_global_norm(1.0)
      >>> grads = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
      >>> clipped, state = clip.update(grads, clip.init(grads), grads)
      >>> clipped["a"], state.norm
      (tensor([0.6000]), tensor(5.))
    """
    if not max_norm >= 0:
        raise ValueError(f"fdp.optim.clip_by_global_norm: max_norm must be >= 0, got {max_norm}")

    def init(params: Any) -> ClipState:
        # The norm's dtype is the promotion of the grads' (torch stacks the per-leaf norms).
        leaves = _tree.leaves(params)
        if not leaves:
            return ClipState(torch.zeros(()))
        dtype = functools.reduce(torch.promote_types, map(_dtype, leaves))
        return ClipState(torch.zeros((), dtype=dtype, device=leaves[0].device))

    def update(grads: Any, state: ClipState, params: Any) -> tuple[Any, ClipState]:
        leaves, treedef = _tree.flatten(grads)
        if not leaves:
            return grads, state
        total = global_norm(leaves, norm_type, error_if_nonfinite=error_if_nonfinite)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        devices = _devices(leaves)
        if len(devices) == 1:
            # One multi-tensor call (torch's clip_grad_norm_ uses its in-place twin); the
            # Tensor-scalar overload exists from torch 2.1.
            clipped = list(torch._foreach_mul(leaves, coef.to(devices.pop())))
        else:
            on = {d: coef.to(d) for d in devices}
            clipped = [torch.mul(t, on[t.device]) for t in leaves]
        # torch multiplies in place, which keeps each grad's dtype; out of place a 0-d grad
        # is promoted to the norm's dtype (0-d times 0-d), so cast those back: the product
        # is computed in the promoted dtype either way, then rounded on store.
        if _dtypes(clipped) != _dtypes(leaves):
            clipped = [c.to(t.dtype) for c, t in zip(clipped, leaves)]
        return _tree.unflatten(treedef, clipped), ClipState(total.detach())

    def clip_with(grads: list[Tensor], total: Tensor) -> ClipState:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        devices = set(map(_device, grads))  # torch's _clip_grads_with_norm_, per device
        if len(devices) == 1:
            torch._foreach_mul_(grads, coef.to(devices.pop()))
        else:
            for device in devices:
                torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))
        return ClipState(total.detach())

    def update_in_place(grads: list[Tensor], state: ClipState) -> ClipState:
        if not grads:
            return state
        return clip_with(grads, global_norm(grads, norm_type, error_if_nonfinite=error_if_nonfinite))

    def update_sharded(grads: list[Tensor], state: ClipState, reduce: Callable[[Tensor, str], Tensor]) -> ClipState:
        local = global_norm(grads, norm_type) if grads else state.norm.new_zeros(())
        total = combine_slices(local, state, reduce)
        return clip_with(grads, total) if grads else ClipState(total.detach())

    def combine_slices(local: Tensor, state: ClipState, reduce: Callable[[Tensor, str], Tensor]) -> Tensor:
        # The norm of the whole is the p-norm of the parts' norms: sum their p-th powers over
        # the ranks (max for the inf-norm). Every rank then clips its part by the same coefficient.
        p = float(norm_type)
        local = local.to(state.norm.dtype).reshape(1)
        if p == float("inf"):
            total = reduce(local, "max")[0]
        else:
            total = reduce(local.pow(p), "sum")[0].pow(1.0 / p)
        return checked(total)

    def checked(total: Tensor) -> Tensor:
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            global_norm([total.reshape(1)], norm_type, error_if_nonfinite=True)  # torch's own message
        return total

    def partial(grads: list[Tensor]) -> list[Tensor]:
        return tensor_norms(grads, norm_type)

    def coefficient(norms: list[Tensor], state: ClipState, reduce: Callable[[Tensor, str], Tensor] | None
                    ) -> tuple[Tensor, ClipState]:
        if reduce is not None:
            total = combine_slices(norm_of_norms(norms, norm_type) if norms else state.norm.new_zeros(()),
                                   state, reduce)
        else:
            total = checked(norm_of_norms(norms, norm_type))
        return torch.clamp(max_norm / (total + 1e-6), max=1.0), ClipState(total.detach())

    return GradientTransform(init, update, elementwise=False, update_in_place=update_in_place,
                             update_sharded=update_sharded, partial=partial, coefficient=coefficient)


def clip_by_value(min_value: float, max_value: float) -> GradientTransform:
    """Clamp every grad element to ``[min_value, max_value]``: ``clip_grad_value_``
    (``clip_by_value(-v, v)`` is torch's ``clip_value=v``).

    Args:
      min_value, max_value: the bounds.

    Returns:
      A stateless, elementwise ``GradientTransform``.

    Example:
      >>> clip = fdp.optim.clip_by_value(-1.0, 1.0)
      >>> clip.update({"a": torch.tensor([-3.0, 0.5])}, (), None)[0]["a"]
      tensor([-1.0000,  0.5000])
    """
    if min_value > max_value:
        raise ValueError(f"fdp.optim.clip_by_value: min_value {min_value} > max_value {max_value}")

    def init(params: Any) -> tuple:
        return ()

    def update(grads: Any, state: tuple, params: Any) -> tuple[Any, tuple]:
        leaves, treedef = _tree.flatten(grads)
        out = list(map(torch.clamp, leaves, repeat(min_value), repeat(max_value)))
        return _tree.unflatten(treedef, out), state

    def update_in_place(grads: list[Tensor], state: tuple) -> tuple:
        torch._foreach_clamp_min_(grads, min_value)
        torch._foreach_clamp_max_(grads, max_value)
        return state

    return GradientTransform(init, update, elementwise=True, update_in_place=update_in_place)


# ------------------------------------------------------------------------- partition


class PartitionState(NamedTuple):
    """State of ``partition``: one optimizer state per label (``None`` for frozen labels)."""

    states: dict[str, Any]


def frozen() -> Optimizer:
    """An optimizer that never changes its params (a frozen label of ``partition``).

    Returns:
      An ``Optimizer`` whose state is ``()``.

    Example:
      >>> opt = fdp.optim.frozen()
      >>> opt.update({"w": torch.ones(1)}, (), {"w": torch.zeros(1)})[0]["w"]
      tensor([0.])
    """
    return Optimizer(lambda params: (), lambda grads, state, params: (params, state))


def partition(labels: Any, optimizers: dict[str, Optimizer]) -> Optimizer:
    """Different optimizers for different leaves: torch's param groups, optax's
    ``multi_transform``.

    Each label's optimizer sees a dict of its leaves keyed by their keys (the params dict's
    keys for a flat dict of params; key tuples such as ``("enc", "w")`` for other trees), so
    a ``mask=`` callable of that optimizer gets the same keys as ``labels``; each label keeps
    its own state (its own step count).

    Args:
      labels: a label per leaf: a tree of strings like params, or a callable
        ``(path, leaf) -> str`` whose ``path`` is the leaf's key: the parameter name for a
        flat dict of params (``"fc.bias"``), else the tuple of keys from the root (dict
        keys, list indices, NamedTuple fields: ``("layers", 0, "w")``).
      optimizers: an ``Optimizer`` per label (``fdp.optim.frozen()`` for no update).

    Returns:
      An ``Optimizer`` whose state is a ``PartitionState``.

    Raises:
      ValueError: a leaf's label has no optimizer (names the leaf).

    Example:
      >>> params = {"w": torch.ones(2), "b": torch.ones(2)}
      >>> opt = fdp.optim.partition(lambda path, p: "body" if p.dim() > 0 and path != "b"
      ...                           else "frozen", {"body": fdp.optim.sgd(0.5),
      ...                                          "frozen": fdp.optim.frozen()})
      >>> new, state = opt.update({"w": torch.ones(2), "b": torch.ones(2)}, opt.init(params), params)
      >>> new["w"], new["b"]
      (tensor([0.5000, 0.5000]), tensor([1., 1.]))
    """
    name = "fdp.optim.partition"
    plans: dict[Any, tuple[list[Any], dict[str, list[int]]]] = {}

    def plan(tree: Any) -> tuple[list[Tensor], Any, list[Any], dict[str, list[int]]]:
        leaves, treedef = _tree.flatten(tree)
        cached = plans.get(treedef)
        if cached is None:
            paths = _tree.paths(treedef)
            per_leaf = leaf_options(labels, treedef, leaves, name, "labels")
            by_label: dict[str, list[int]] = {}
            for i, (path, label) in enumerate(zip(paths, per_leaf)):
                if label not in optimizers:
                    raise ValueError(f"{name}: params{path} has label {label!r}, which has no "
                                     f"optimizer (labels with one: {sorted(optimizers)})")
                by_label.setdefault(label, []).append(i)
            keys = _tree.keys(treedef)
            cached = plans[treedef] = (keys, by_label)
        keys, by_label = cached
        return leaves, treedef, keys, by_label

    def sub(leaves: list[Any], keys: list[Any], idx: list[int]) -> dict[Any, Any]:
        return {keys[i]: leaves[i] for i in idx}

    def init(params: Any) -> PartitionState:
        leaves, _, keys, by_label = plan(params)
        return PartitionState({label: optimizers[label].init(sub(leaves, keys, idx))
                               for label, idx in by_label.items()})

    def update(grads: Any, state: PartitionState, params: Any) -> tuple[Any, PartitionState]:
        if not isinstance(state, PartitionState):
            raise TypeError(f"{name}: state must be a PartitionState, got {type(state).__name__}")
        leaves, treedef, keys, by_label = plan(params)
        grad_leaves, got = _tree.flatten(grads)
        if got != treedef:
            raise ValueError(f"{name}: grads does not have the structure of params: "
                             f"{_tree.first_difference(treedef, got)}")
        out, states = list(leaves), {}
        for label, idx in by_label.items():
            new, states[label] = optimizers[label].update(
                sub(grad_leaves, keys, idx), state.states[label], sub(leaves, keys, idx))
            for i in idx:
                out[i] = new[keys[i]]
        return _tree.unflatten(treedef, out), PartitionState(states)

    return Optimizer(init, update)


