"""Gradient transforms: clipping by global norm and by value, and labelled partitions.

``clip_by_global_norm`` computes the norm and the clip coefficient exactly as
``torch.nn.utils.clip_grad_norm_`` does (torch/nn/utils/clip_grad.py): per-tensor norms
(``torch._foreach_norm`` where torch uses it), their norm grouped by (device, dtype) in
first-seen order, ``coef = max_norm / (total + 1e-6)`` clamped at 1, and every grad
multiplied by it. It is a ``global_scale``: the per-leaf norms are its ``stats`` and the
coefficient its ``scale``, so the plain path, the fused step and the sharded step compute
the same numbers from the same two functions. ``global_norm`` calls torch's own
``get_total_norm`` where it exists (2.6 and later).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable
from itertools import repeat
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _internals, _tree
from ._base import Form, GradientTransform, LeafKernel, Optimizer, global_scale, leaf_options

__all__ = ["PartitionState", "clip_by_global_norm", "clip_by_value", "frozen", "global_norm",
           "partition"]


_get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
_device = operator.attrgetter("device")
_dtype = operator.attrgetter("dtype")


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
    if _get_total_norm is not None and not torch.compiler.is_compiling():
        return _get_total_norm(leaves, norm_type, error_if_nonfinite)
    # torch < 2.6, or traced: torch.nn.utils.clip_grad_norm_'s own steps (per-tensor norms
    # grouped by (device, dtype) in first-seen order, then the norm of their stack), with no
    # Python per leaf: the grouping is one C++ call, the norms one _foreach_norm per group.
    # (Traced, torch's get_total_norm would call a one-tensor _foreach_norm for a group of one
    # leaf, which Inductor's C++ wrapper reads back wrong: see _foreach_norm.)
    if not leaves:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    first = leaves[0].device
    stacks = []
    for (device, _), ([group], _) in _internals.group_by_device_and_dtype([leaves]).items():
        if _internals.has_foreach_support(group, device):
            norms = _foreach_norm(group, norm_type)
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


def _foreach_norm(group: list[Tensor], norm_type: float) -> Any:
    """``torch._foreach_norm(group, norm_type)``. Traced with one tensor, the norms of it and a
    one-element zero tensor (an empty one has no inf norm), the first kept: Inductor's C++
    wrapper (``options={"cpp_wrapper": True}``, torch 2.13) reads the result of a one-tensor
    ``_foreach_norm`` it calls back into Python as one tensor, not a list, and the compiled
    step crashes (SIGSEGV in ``assert_size_stride``). Each tensor's norm is computed alone, so
    the first is the same."""
    if len(group) == 1 and torch.compiler.is_compiling():
        return torch._foreach_norm([group[0], group[0].new_zeros(1)], norm_type)[:1]
    return torch._foreach_norm(group, norm_type)


def tensor_norms(tensors: list[Tensor], norm_type: float = 2.0) -> list[Tensor]:
    """The per-tensor norms ``global_norm`` combines, in the tensors' order, computed as it
    computes them: grouped by (device, dtype), ``torch._foreach_norm`` per group where the
    group has foreach support, else one ``linalg.vector_norm`` each. No Python per tensor
    when the device has foreach (one C++ grouping, a multi-tensor norm per group, and a
    C-level reordering)."""
    if not tensors:
        return []
    grouped = _internals.group_by_device_and_dtype([list(tensors)], with_indices=True)
    if len(grouped) == 1:
        ((device, _), ([group], _)), = grouped.items()
        if _internals.has_foreach_support(group, device):
            return list(_foreach_norm(group, norm_type))
        return list(map(functools.partial(torch.linalg.vector_norm, ord=norm_type), group))
    norms: list[Tensor] = []
    order: list[int] = []
    for (device, _), ([group], indices) in grouped.items():
        if _internals.has_foreach_support(group, device):
            norms.extend(_foreach_norm(group, norm_type))
        else:  # (map over a C partial: no Python per tensor)
            norms.extend(map(functools.partial(torch.linalg.vector_norm, ord=norm_type), group))
        order.extend(indices)
    # norms[k] is tensor order[k]'s: put them back in the tensors' order.
    back = sorted(range(len(order)), key=order.__getitem__)
    return list(operator.itemgetter(*back)(norms)) if len(back) > 1 else norms


def norm_of_norms(norms: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """``global_norm`` of the tensors whose ``tensor_norms`` are ``norms`` (in the tensors'
    order): their p-norm, stacked in torch's order. torch groups the tensors with
    ``_group_tensors_by_device_and_dtype``, whose group order is its own (not first-seen),
    each group in the tensors' order. Its order depends only on the sequence of (device,
    dtype) keys it meets (a hash map filled in first-seen order), and a tensor's norm has its
    tensor's device and dtype, so grouping the norms, in the tensors' order, with the same
    function gives the same order."""
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    grouped = _internals.group_by_device_and_dtype([list(norms)])
    groups = [group for ([group], _) in grouped.values()]  # (C-level maps below: no Python per norm)
    ordered = list(map(operator.methodcaller("to", first), itertools.chain.from_iterable(groups)))
    return torch.linalg.vector_norm(torch.stack(ordered), norm_type)


class ClipState(NamedTuple):
    """State of ``clip_by_global_norm``: the last norm seen (before clipping), for logging. In the
    fused step with ``skip_nonfinite``, a skipped step's norm too (inf or nan: why it was
    skipped), while nothing else changes."""

    norm: Tensor


def clip_by_global_norm(max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> GradientTransform:
    """Scale all grads by ``min(1, max_norm / (norm + 1e-6))``: ``clip_grad_norm_``.

    The norm is torch's, bit for bit, for every ``norm_type`` (``inf``, ``-inf``, ``0``,
    any p): each leaf's norm, then the norm of those in leaf order grouped by (device,
    dtype), as ``torch.nn.utils.get_total_norm``. The fused step computes the same: each
    leaf's norm from its view in the reduced bucket as the bucket lands (sharded: on the
    rank that holds the leaf whole, after the ranks exchange the parts of leaves that cross
    a slice boundary), then the same norm of norms.

    Args:
      max_norm: the largest norm the grads keep.
      norm_type, error_if_nonfinite: as ``torch.nn.utils.clip_grad_norm_``.

    Returns:
      A ``GradientTransform`` (a ``global_scale``) whose state is a ``ClipState`` holding
      the norm before clipping (what ``clip_grad_norm_`` returns).

    Example:
      >>> clip = fdp.optim.clip_by_global_norm(1.0)
      >>> grads = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
      >>> clipped, state = clip.update(grads, clip.init(grads), grads)
      >>> clipped["a"], state.norm
      (tensor([0.6000]), tensor(5.))
    """
    if not max_norm >= 0:
        raise ValueError(f"fdp.optim.clip_by_global_norm: max_norm must be >= 0, got {max_norm}")
    norm_type = float(norm_type)

    def init(params: Any) -> ClipState:
        # The norm's dtype is the promotion of the grads' (torch stacks the per-leaf norms).
        leaves = _tree.leaves(params)
        if not leaves:
            return ClipState(torch.zeros(()))
        dtype = functools.reduce(torch.promote_types, map(_dtype, leaves))
        return ClipState(torch.zeros((), dtype=dtype, device=leaves[0].device))

    def stats(leaves: list[Tensor]) -> list[Tensor]:
        return tensor_norms(leaves, norm_type)

    def scale(norms: list[Tensor], state: ClipState) -> tuple[Tensor, ClipState]:
        total = norm_of_norms(norms, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            global_norm([total.reshape(1)], norm_type, error_if_nonfinite=True)  # torch's own message
        return torch.clamp(max_norm / (total + 1e-6), max=1.0), ClipState(total.detach())

    if error_if_nonfinite:  # (what a traced fused step refuses by name: fdp/_fused/traced.py)
        scale.host_decision = "clip_by_global_norm(error_if_nonfinite=True) reads the norm on the host"
    return global_scale(init, stats, scale)


def clip_by_value(min_value: float, max_value: float) -> GradientTransform:
    """Clamp every grad element to ``[min_value, max_value]``: ``clip_grad_value_``
    (``clip_by_value(-v, v)`` is torch's ``clip_value=v``).

    Args:
      min_value, max_value: the bounds.

    Returns:
      A stateless ``GradientTransform`` of reach ``"element"``.

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

    def apply(grads: list[Tensor], state: tuple) -> tuple:
        torch._foreach_clamp_min_(grads, min_value)
        torch._foreach_clamp_max_(grads, max_value)
        return state

    return GradientTransform(init, update, "element", apply)


# ------------------------------------------------------------------------- partition


class Partitioned(NamedTuple):
    """What a ``partition`` is made of, for callers that run it their own way (the fused step).

    Attributes:
      labels: ``labels(params) -> list`` of each leaf's label, in leaf order (checked: every
        label has an optimizer).
      optimizers: the optimizer of each label.
      keys: ``keys(params) -> list``: each leaf's key in its label's sub-tree (the keys the
        label's optimizer sees, as ``partition`` hands them over).
    """

    labels: Callable[[Any], list[Any]]
    optimizers: dict[str, Optimizer]
    keys: Callable[[Any], list[Any]]


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
    def no_groups(params: Any) -> list[int]:
        return [0] * len(_tree.leaves(params))

    def no_step(group: int, params: list[Tensor], grads: list[Tensor], states: list, count: Tensor) -> None:
        return None

    # (a kernel that changes nothing: a frozen label of a partition runs in the fused step too)
    return Optimizer(lambda params: (), lambda grads, state, params: (params, state),
                     Form(LeafKernel((), 0.0, no_groups, no_step)))


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

    def labels_of(params: Any) -> list[Any]:
        leaves, _, _, by_label = plan(params)
        out: list[Any] = [None] * len(leaves)
        for label, idx in by_label.items():
            for i in idx:
                out[i] = label
        return out

    def keys_of(params: Any) -> list[Any]:
        return plan(params)[2]

    return Optimizer(init, update, Form(partition=Partitioned(labels_of, dict(optimizers), keys_of)))


