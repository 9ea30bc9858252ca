"""The two types of fdp.optim, ``chain``, and the leaf-list helpers every optimizer shares.

An ``Optimizer`` applies an update: ``update(grads, state, params) -> (params, state)``.
A ``GradientTransform`` rewrites gradients: ``update(grads, state, params) -> (grads, state)``.
``chain(*transforms, optimizer)`` runs the transforms in order, then the optimizer.

How this maps to optax (``optax/_src/base.py``): optax has one type, whose ``update``
returns *updates* that ``optax.apply_updates(params, updates)`` adds to the params. fdp's
optimizers return the new params instead, because torch.optim's kernels update params in
place with their own formula (AdamW multiplies by ``1 - lr * wd`` first, then ``addcdiv_``);
computing ``updates`` and adding them would round differently from torch.optim, and fdp's
numbers are torch.optim's bit for bit. A ``GradientTransform`` is exactly optax's contract
restricted to gradients (its output is new gradients), so optax-style transforms port as-is.

The core works on *leaf lists* (the tree's leaves in order); the pytree API is a thin layer
on top. The helpers here check a tree against the params without Python per leaf in the
common case (C-level ``map`` calls), and walk the leaves only to name a bad one.
"""

from __future__ import annotations

import operator
import sys
import threading
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _tree
from .._protocols import Reach

__all__ = ["ChainState", "GradientTransform", "LeafKernel", "Optimizer", "chain", "global_scale", "stateless"]

# (shape, dtype, device) of a tensor in one C-level call; and each alone.
_meta = operator.attrgetter("shape", "dtype", "device")
_device = operator.attrgetter("device")
_dtype = operator.attrgetter("dtype")


def _devices_of(leaves: list[Tensor]) -> set[torch.device]:
    # map() over a C getter: no Python per leaf; dynamo cannot trace attrgetter, so a loop there.
    return {t.device for t in leaves} if _tree.compiling() else set(map(_device, leaves))


def _traced_meta(t: Tensor) -> tuple:
    return (t.shape, t.dtype, t.device)


class Form(NamedTuple):
    """How fdp can run and describe an optimizer beyond its ``init`` and ``update``: what the
    fused step (``reducer.grad_and_update``) runs per bucket, and what ``fdp.optim.hyperparams``
    and ``state_from_torch`` read. fdp's own optimizers fill it in; an optimizer of yours
    need not (``Form()``), and then runs through ``reducer.grad`` + ``opt.update``.

    Attributes:
      leaf_kernel: for element-wise optimizers (those over a torch.optim kernel, and
        ``lion``), the same update on lists of tensors (a ``LeafKernel``); ``None`` for
        others (``chain``, ``partition``, ``adafactor``, yours).
      parts: for a ``chain``, its gradient transforms and then its optimizer (what the fused
        step runs per bucket); ``()`` otherwise.
      hyper: a ``Hyperparams`` (torch.optim's param-group terms: what ``fdp.optim.hyperparams``
        reports) for optimizers over a torch.optim kernel; ``None`` for others.
      partition: for ``partition``, its ``Partitioned`` (the label of each leaf and the
        optimizer of each label: what the fused step runs per label); ``None`` otherwise.
      bind: for ``inject_hyperparams``, ``bind(values) -> Optimizer``: the inner optimizer
        with the hyper-parameters ``values`` (``{name: value}`` as ``state.hyperparams``
        holds them; ``None``: the values it was made with) fixed in it, its ``leaf_kernel``
        included (what the fused step runs with the values of each step's state);
        ``None`` otherwise.
      unfused: for fdp's optimizers the fused step cannot run, why, and what to use instead
        (the fused step's refusal says it); ``None`` otherwise.
      wraps: for a wrapper that keeps another optimizer's state inside its own
        (``multi_steps``), that optimizer (what ``fdp.optim.inspect`` reads on); ``None`` otherwise.
      about: ``(name, value)`` pairs ``fdp.optim.inspect`` reports as they are (``ema``'s
        ``("ema_decay", decay)``).
    """

    leaf_kernel: LeafKernel | None = None
    parts: tuple = ()
    hyper: Any = None  # a Hyperparams (fdp/optim/_hyperparams.py imports this module)
    partition: Any = None  # a Partitioned (fdp/optim/_transforms.py)
    bind: Callable[[Any], Optimizer] | None = None  # inject_hyperparams (fdp/optim/_inject.py)
    unfused: str | None = None
    wraps: Any = None  # an Optimizer (multi_steps)
    about: tuple = ()


NO_FORM = Form()


class Optimizer(NamedTuple):
    """An optimizer as a pair of pure functions: it returns new params, not optax's updates.

    Attributes:
      init: ``init(params) -> state``; the state is a pytree of tensors.
      update: ``update(grads, state, params) -> (new_params, new_state)``.
      form: how fdp can run it beyond these two (``fdp.optim.Form``: its leaf kernel, a
        chain's parts, its torch.optim hyper-parameters, a partition, an injected one's
        ``bind``); ``Form()`` for an optimizer of your own.

    Example:
      >>> opt = fdp.optim.sgd(lr=0.1)
      >>> params = {"w": torch.ones(2)}
      >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> params["w"]
      tensor([0.9000, 0.9000])
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]
    form: Form = NO_FORM


class LeafKernel(NamedTuple):
    """The leaf-list form of an element-wise optimizer (``sgd``, ``adam``, ``adamw``,
    ``adagrad``, ``rmsprop``, ``nadam``, ``radam``, ``adamax``, ``adadelta`` over torch.optim's
    kernels, and ``lion``): what a caller that keeps params, grads and state in its own layout
    (e.g. flat per-bucket tensors, or slices) needs to run the same update. Each state field
    is like its param and each per-step scalar a function of the count (NAdam's
    ``mu_product`` too), so any split into lists gives the same numbers per element.

    Attributes:
      fields: the state fields the kernel takes, in order (e.g. ``("exp_avg",
        "exp_avg_sq")``); each is a tree like params in the optimizer's state.
      init_value: the value those state tensors start at (Adagrad's accumulator; else 0).
      groups: ``groups(params) -> list[int]``: per leaf, the index of its hyper-parameter
        group (0: weight decay on, 1: off under ``mask=``); leaves of one group may share a
        kernel call, leaves of different groups may not.
      step: ``step(group, params, grads, state_lists, count)`` updates lists of tensors of
        one group in place with the hyper-parameters at update ``count`` (a scalar CPU
        tensor: updates already applied; not incremented here). ``state_lists`` holds one
        list per field.
      whole_leaves: the update of a leaf depends on all of it (Muon orthogonalises each
        matrix): the lists must hold each leaf whole, in its own shape, never flat pieces.
      decay: ``decay(params, count)``: group 0's decoupled weight decay alone, in place
        (``p.mul_(1 - lr * weight_decay)``, AdamW's first operation on a decayed leaf, which
        reads the weight decay nowhere else), or None when the kernel has no such form.
        With it, ``decay`` on group 0's leaves and then ``step(1, ...)`` (group 1: no decay)
        over the leaves of both groups at once gives the same numbers as a ``step`` per
        group, in one kernel call (the fused step runs a masked AdamW so: a mask splits a
        bucket into many short runs of alternating groups).
    """

    fields: tuple[str, ...]
    init_value: float
    groups: Callable[[Any], list[int]]
    step: Callable[..., None]
    whole_leaves: bool = False
    decay: Callable[..., None] | None = None


class GradientTransform(NamedTuple):
    """A gradient transformation: optax's contract, on gradients only, with its reach declared.

    Attributes:
      init: ``init(params) -> state`` (``()`` for a stateless transform).
      update: ``update(grads, state, params) -> (new_grads, new_state)`` on trees; must not
        modify its inputs.
      reach: what one output element depends on, which decides where the fused step
        (``reducer.grad_and_update``) may run it:

        * ``"element"``: only the same element of the input (``clip_by_value``). It may run
          on any piece of the gradients: flat buckets, a rank's slice, chunks.
        * ``"leaf"``: only the same leaf (a per-leaf norm clip). It runs on whole leaves:
          the fused step hands it each bucket's leaves as views (and refuses it sharded,
          where a rank's slice cuts leaves).
        * ``"tree"`` (default): any of the gradients. The fused step runs it only as a
          global scale (``stats`` and ``scale``), else refuses it.
      apply: ``apply(tensors, state) -> new_state``, the same transform on a list of tensors
        that it overwrites (with ``reach="leaf"`` each tensor is a leaf; with ``"tree"``
        the list is every leaf). Optional; the fused step needs it for ``"element"`` and
        ``"leaf"``, and ``chain`` uses it to transform the gradients in reused buffers.
      stats, scale: a whole-tree transform that multiplies every gradient by one factor
        computed from per-leaf statistics (``clip_by_global_norm``, loss scaling).
        ``stats(leaves) -> [one 0-d tensor per leaf]``; ``scale(stats, state) -> (factor,
        new_state)`` takes every leaf's statistic in leaf (tree) order, and returns the
        factor (a 0-d tensor), or ``None`` to skip the step: then no param and no optimizer
        state changes, only the transforms' states. The fused step computes each bucket's
        statistics as soon as it lands (sharded: each leaf's on one rank, then gathered), so
        only ``scale`` and the multiply are left after the last bucket. ``global_scale``
        builds ``update`` and ``apply`` from the pair, so the pair is the transform's one
        definition.

    Example:
      >>> halve = fdp.optim.GradientTransform(
      ...     init=lambda params: (),
      ...     update=lambda grads, state, params: ({k: g / 2 for k, g in grads.items()}, state),
      ...     reach="element", apply=lambda grads, state: (torch._foreach_mul_(grads, 0.5), state)[1])
      >>> opt = fdp.optim.chain(halve, fdp.optim.sgd(lr=1.0))
      >>> params = {"w": torch.ones(2)}
      >>> opt.update({"w": torch.ones(2)}, opt.init(params), params)[0]["w"]
      tensor([0.5000, 0.5000])
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]
    reach: Reach = "tree"
    apply: Callable[[list[Tensor], Any], Any] | None = None
    stats: Callable[[list[Tensor]], list[Tensor]] | None = None
    scale: Callable[[list[Tensor], Any], tuple[Tensor | None, Any]] | None = None

    @property
    def is_global_scale(self) -> bool:
        """A whole-tree transform given as ``stats`` and ``scale``."""
        return self.reach == "tree" and self.stats is not None and self.scale is not None


REACHES: tuple[Reach, ...] = typing.get_args(Reach)  # ("element", "leaf", "tree")


def check_transform(t: Any, name: str, i: int) -> None:
    """``t`` is a well-formed ``GradientTransform`` (part ``i`` of a chain), or a ``TypeError``."""
    if not isinstance(t, GradientTransform):
        raise TypeError(f"{name}: part {i} must be a GradientTransform, got {type(t).__name__} "
                        "(only the last part may be an Optimizer)")
    if t.reach not in REACHES:
        raise TypeError(f"{name}: part {i} declares reach={t.reach!r}; one of {REACHES}")
    if (t.stats is None) != (t.scale is None):
        raise TypeError(f"{name}: part {i} declares only one of stats/scale; a global scale needs both")


def mul_all(tensors: list[Tensor], factor: Tensor) -> None:
    """``tensors[i] *= factor`` for every tensor, as torch's ``_clip_grads_with_norm_`` does it
    (one multi-tensor call per device)."""
    devices = {t.device for t in tensors} if _tree.compiling() else set(map(_device, tensors))
    if len(devices) == 1:
        torch._foreach_mul_(tensors, factor.to(devices.pop()))
        return
    for device in devices:
        torch._foreach_mul_([t for t in tensors if t.device == device], factor.to(device))


def global_scale(init: Callable[[Any], Any], stats: Callable[[list[Tensor]], list[Tensor]],
                 scale: Callable[[list[Tensor], Any], tuple[Tensor | None, Any]]) -> GradientTransform:
    """A whole-tree ``GradientTransform`` that multiplies every gradient by
    ``scale(stats(leaves), state)``'s factor: its ``update`` (on trees, out of place) and
    ``apply`` (on a list of tensors, in place) both come from the pair, so the transform is
    written once (``clip_by_global_norm`` is one).

    A factor of ``None`` skips the step (see ``GradientTransform``): ``update`` then returns
    the gradients unchanged and ``chain`` leaves params and optimizer state as they were.
    A ``scale`` that can skip gives the fused step compiled its verdict as a tensor through
    an attribute ``scale.traced(stats, state) -> (factor, go, new_state)`` (``go``: a 0-d
    bool tensor, False where ``scale`` returns ``None``); one that decides on the host
    without such a form names why in ``scale.host_decision``, and ``step.compile()`` refuses
    it with that reason.
    """
    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        leaves, treedef = _tree.flatten(grads)
        if not leaves:
            return grads, state
        factor, state = scale(stats(leaves), state)
        if factor is None:
            return grads, SkipState(state)
        devices = _devices_of(leaves)
        if len(devices) == 1:
            out = list(torch._foreach_mul(leaves, factor.to(devices.pop())))
        else:
            on = {d: factor.to(d) for d in devices}
            out = [torch.mul(t, on[t.device]) for t in leaves]
        # torch multiplies in place, which keeps each grad's dtype; out of place a 0-d grad
        # is promoted to the factor's dtype (0-d times 0-d), so cast those back: the product
        # is computed in the promoted dtype either way, then rounded on store.
        dtypes = [t.dtype for t in leaves] if _tree.compiling() else list(map(_dtype, leaves))
        if [t.dtype for t in out] != dtypes:
            out = [c.to(d) for c, d in zip(out, dtypes)]
        return _tree.unflatten(treedef, out), state

    def apply(tensors: list[Tensor], state: Any) -> Any:
        if not tensors:
            return state
        factor, state = scale(stats(tensors), state)
        if factor is None:
            return SkipState(state)
        mul_all(tensors, factor)
        return state

    return GradientTransform(init, update, "tree", apply, stats, scale)


class SkipState(NamedTuple):
    """What a global scale's ``update``/``apply`` returns, wrapped around its new state, when
    its factor was ``None``: the step is skipped (``chain`` unwraps it)."""

    state: Any


class ChainState(NamedTuple):
    """State of ``chain``: one state per gradient transform, then the optimizer's."""

    transforms: tuple
    optimizer: Any


def stateless(fn: Callable[[Any, Any], Any], *, reach: Reach = "tree") -> GradientTransform:
    """A ``GradientTransform`` from a pure function ``fn(grads, params) -> new_grads``.

    Args:
      fn: maps the gradient tree (and the params, for transforms that read them) to a new
        gradient tree of the same structure; must not modify its inputs.
      reach: what an output element depends on (``GradientTransform.reach``). Without an
        ``apply`` the fused step cannot run it; give one (``GradientTransform(...,
        apply=...)``) or use ``reducer.grad`` + ``opt.update``.

    Returns:
      A ``GradientTransform`` whose state is ``()``.

    Example:
      >>> negate = fdp.optim.stateless(lambda grads, params: {k: -g for k, g in grads.items()})
      >>> opt = fdp.optim.chain(negate, fdp.optim.sgd(lr=1.0))
      >>> params = {"w": torch.zeros(1)}
      >>> opt.update({"w": torch.ones(1)}, opt.init(params), params)[0]["w"]
      tensor([1.])
    """
    if reach not in REACHES:
        raise ValueError(f"fdp.optim.stateless: reach must be one of {REACHES}, got {reach!r}")

    def init(params: Any) -> tuple:
        return ()

    def update(grads: Any, state: tuple, params: Any) -> tuple[Any, tuple]:
        return fn(grads, params), state

    return GradientTransform(init, update, reach)


def chain(*parts: GradientTransform | Optimizer, donate_grads: bool = False) -> Optimizer:
    """Gradient transforms applied in order, then one optimizer (torch's clip-then-step).

    Args:
      *parts: zero or more ``GradientTransform`` s followed by exactly one ``Optimizer``.
      donate_grads: when every transform works in place (``apply``: fdp's clipping
        transforms do), let them overwrite the gradients passed in, as
        ``clip_grad_norm_`` scales ``.grad``, instead of a copy the chain keeps (one pass
        over the gradients less per step). The caller's gradients are then consumed:
        after ``update`` they hold the transformed values. Default False: inputs are never
        modified.

    Returns:
      An ``Optimizer`` whose state is a ``ChainState``. A global-scale transform whose
      factor is ``None`` (a non-finite loss-scaled step) skips the step: params and the
      optimizer's state come back unchanged, the transforms' states updated.

    Raises:
      TypeError: the last part is not an ``Optimizer`` or an earlier one is not a
        ``GradientTransform`` (or declares an unknown reach, or half of stats/scale).

    Example:
      >>> opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.sgd(lr=0.1))
      >>> params = {"w": torch.zeros(2)}
      >>> params, state = opt.update({"w": torch.full((2,), 10.0)}, opt.init(params), params)
      >>> params["w"]  # the grad (norm 14.1) was scaled to norm 1 first
      tensor([-0.0707, -0.0707])
    """
    if not parts or not isinstance(parts[-1], Optimizer):
        got = type(parts[-1]).__name__ if parts else "nothing"
        raise TypeError(f"fdp.optim.chain: the last part must be an Optimizer (sgd, adamw, ...), got {got}")
    transforms, optimizer = parts[:-1], parts[-1]
    for i, t in enumerate(transforms):
        check_transform(t, "fdp.optim.chain", i)

    def init(params: Any) -> ChainState:
        return ChainState(tuple(t.init(params) for t in transforms), optimizer.init(params))

    in_place = bool(transforms) and all(t.apply is not None for t in transforms)
    scratch = ScratchLeaves()

    def update(grads: Any, state: ChainState, params: Any) -> tuple[Any, ChainState]:
        if not isinstance(state, ChainState) or len(state.transforms) != len(transforms):
            raise TypeError(f"fdp.optim.chain: state must be the ChainState of a chain of "
                            f"{len(transforms)} transforms and an optimizer, got {type(state).__name__}")
        new_states = []
        skip = False
        if in_place and not _tree.compiling():
            # The transforms' output never leaves the chain (the optimizer returns params),
            # so it can live in one reused buffer: no fresh memory per step.
            leaves, treedef = _tree.flatten(grads)
            work = leaves if donate_grads else scratch.copy_of(leaves)
            for t, s in zip(transforms, state.transforms):
                if skip:
                    new_states.append(s)
                    continue
                s = t.apply(work, s)
                if isinstance(s, SkipState):
                    skip, s = True, s.state
                new_states.append(s)
            grads = _tree.unflatten(treedef, work)
        else:
            for t, s in zip(transforms, state.transforms):
                if skip:
                    new_states.append(s)
                    continue
                grads, s = t.update(grads, s, params)
                if isinstance(s, SkipState):
                    skip, s = True, s.state
                new_states.append(s)
        if skip:
            return params, ChainState(tuple(new_states), state.optimizer)
        params, opt_state = optimizer.update(grads, state.optimizer, params)
        return params, ChainState(tuple(new_states), opt_state)

    return Optimizer(init, update, Form(parts=(*transforms, optimizer)))


# ------------------------------------------------------------------- leaf-list helpers


def clone(leaves: Sequence[Tensor]) -> list[Tensor]:
    """Clones of ``leaves`` (``map`` over the bound C function: no Python per leaf)."""
    return list(map(Tensor.clone, leaves))


def zeros_like(leaves: Sequence[Tensor], value: float = 0.0) -> list[Tensor]:
    """State tensors like ``leaves``, filled with ``value``; a complex leaf's with ``value +
    value * 1j``, as torch.optim starts Adagrad's ``sum`` (its kernels view complex tensors as
    pairs of reals, so both parts are accumulators)."""
    return [torch.full_like(t, complex(value, value) if value and t.is_complex() else value,
                            memory_format=torch.preserve_format) for t in leaves]


class ScratchLeaves:
    """A copy of a list of tensors in buffers reused from call to call (one set per thread:
    simulated ranks are threads and may share an optimizer).

    A buffer is reused only when the tensors have the same (shape, dtype, device) as last
    time and nothing outside this object still holds one (reference counts back at their
    baseline), so a transform or optimizer that kept a gradient sees it unchanged. All
    checks are C-level ``map`` calls: no Python per leaf.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def copy_of(self, leaves: Sequence[Tensor]) -> list[Tensor]:
        local = self._local
        bufs: list[Tensor] | None = getattr(local, "bufs", None)
        meta = list(map(_meta, leaves))
        if bufs is None or meta != local.meta or list(map(sys.getrefcount, bufs)) != local.refs:
            bufs = [torch.empty_like(t, memory_format=torch.preserve_format) for t in leaves]
            local.bufs, local.meta = bufs, meta
            local.refs = list(map(sys.getrefcount, bufs))
        torch._foreach_copy_(bufs, list(leaves))
        return list(bufs)


def param_leaves(params: Any, name: str) -> tuple[list[Tensor], Any]:
    """Leaves and structure of ``params``, each checked to be a floating tensor (for init)."""
    leaves, treedef = _tree.flatten(params)
    for path, t in zip(_tree.paths(treedef), leaves):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: params{path} is a {type(t).__name__}, not a tensor")
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(
                f"{name}: params{path} has dtype {t.dtype}; optimizers update floating or "
                "complex tensors only (keep integer state in buffers)"
            )
    return leaves, treedef


class ParamLeaves:
    """The params of one ``update`` call, and checks of other trees against them.

    The common case costs no Python bytecode per leaf: one flatten (C++), one structure
    comparison, and one list of (shape, dtype, device) per tree built by ``map`` over a C
    getter. Only a mismatch walks the leaves in Python, to name the first bad one.
    """

    def __init__(self, params: Any, name: str, known: KnownLeaves | None = None) -> None:
        self.name = name
        self.leaves, self.treedef = _tree.flatten(params)
        self._meta: list[Any] | None = None
        self._known = known
        # With donate=True the same params and state tensors come back every step: once
        # checked, they are recognised by identity (one C-level pass) instead of re-checked.
        entry = known.lookup("params", self.leaves, self.treedef) if known is not None else None
        self.known = entry is not None
        if entry is not None:
            self._meta = entry[2]

    def like_known(self, tree: Any, what: str) -> list[Tensor]:
        """``like``, skipped for a tree whose leaves are the tensors checked last time."""
        if self.known:
            leaves, got = _tree.flatten(tree)
            if self._known.lookup(what, leaves, got) is not None:
                return leaves
        leaves = self.like(tree, what)
        if self._known is not None:
            self._known.remember(what, leaves, self.treedef)
        return leaves

    def checked(self) -> None:
        """Every tree of this update passed its checks: remember the params (donate=True)."""
        if self._known is not None and not self.known:
            if self._meta is None:
                self._meta = list(map(_meta, self.leaves))
            self._known.remember("params", self.leaves, self.treedef, self._meta)

    def like(self, tree: Any, what: str) -> list[Tensor]:
        """Leaves of ``tree``, checked to have the params' structure, shapes, dtypes, devices."""
        leaves, got = _tree.flatten(tree)
        if got != self.treedef:
            raise ValueError(
                f"{self.name}: {what} does not have the structure of params: "
                f"{_tree.first_difference(self.treedef, got)}"
            )
        try:
            meta = _traced_meta if _tree.compiling() else _meta  # dynamo can't call attrgetter
            if self._meta is None:
                self._meta = list(map(meta, self.leaves))
            if list(map(meta, leaves)) == self._meta:
                return leaves
        except AttributeError:  # a leaf that is not a tensor: find it below
            pass
        for path, t, p in zip(_tree.paths(self.treedef), leaves, self.leaves):
            for tree_name, leaf in (("params", p), (what, t)):
                if not isinstance(leaf, Tensor):
                    raise TypeError(
                        f"{self.name}: {tree_name}{path} is a {type(leaf).__name__}, not a tensor"
                    )
            if _meta(t) != _meta(p):
                raise ValueError(
                    f"{self.name}: {what}{path} has shape {tuple(t.shape)}, dtype {t.dtype}, "
                    f"device {t.device}; params{path} has shape {tuple(p.shape)}, "
                    f"dtype {p.dtype}, device {p.device}"
                )
        raise AssertionError("unreachable: metadata differed but no leaf did")  # pragma: no cover

    def check_no_aliases(self) -> None:
        """Refuse params in which one tensor appears twice (an in-place update would apply
        twice to it). One C-level pass; the paths are found only on a hit."""
        if _tree.compiling():
            return
        ptrs = list(map(Tensor.data_ptr, self.leaves))
        if len(set(ptrs)) == len(ptrs):
            return
        seen: dict[int, str] = {}
        for path, t, ptr in zip(_tree.paths(self.treedef), self.leaves, ptrs):
            if t.numel() == 0:  # empty tensors may all report data_ptr 0
                continue
            if ptr in seen:
                raise ValueError(
                    f"{self.name}: params{seen[ptr]} and params{path} are the same memory; "
                    "with donate=True the update would be applied to it twice. Pass each "
                    "tensor once (fdp.functionalize keeps tied weights once) or use donate=False"
                )
            seen[ptr] = path


class KnownLeaves:
    """Leaves an optimizer has already checked, recognised by identity (``donate=True``).

    It keeps weak references, so it holds no memory alive and a tensor that died is never
    mistaken for a new one at the same address. Per thread, since simulated ranks are threads
    that may share an optimizer. A tensor changed in place to another shape (``.data =``,
    ``resize_``) is not noticed; torch's kernel then raises.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def lookup(self, key: str, leaves: list[Any], treedef: Any) -> tuple | None:
        """The remembered ``(refs, treedef, meta)`` if ``leaves`` are those very tensors."""
        if _tree.compiling():
            return None
        entry = getattr(self._local, "entries", {}).get(key)
        if entry is None or entry[1] != treedef or len(entry[0]) != len(leaves):
            return None
        return entry if all(map(operator.is_, map(_deref, entry[0]), leaves)) else None

    def remember(self, key: str, leaves: list[Any], treedef: Any, meta: list[Any] | None = None) -> None:
        if _tree.compiling():
            return
        if not hasattr(self._local, "entries"):
            self._local.entries = {}
        self._local.entries[key] = (list(map(weakref.ref, leaves)), treedef, meta)


_deref = weakref.ref.__call__


def leaf_options(spec: Any, treedef: Any, leaves: Sequence[Tensor], name: str, what: str) -> list[Any]:
    """Per-leaf values of an option given as a tree like params or a callable of
    ``(path, leaf)``: a list in leaf order (e.g. a weight-decay mask or a label per leaf);
    the callable's ``path`` is the leaf's key (``_tree.keys``: a name or a key tuple)."""
    if callable(spec):
        return [spec(key, t) for key, t in zip(_tree.keys(treedef), leaves)]
    values, got = _tree.flatten(spec)
    if got != treedef:
        raise ValueError(f"{name}: {what} does not have the structure of params: "
                         f"{_tree.first_difference(treedef, got)}")
    return values


def take(indices: Sequence[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """A function picking ``indices`` from a list, without Python per leaf (itemgetter)."""
    if len(indices) == 1:
        i = indices[0]
        return lambda xs: [xs[i]]
    getter = operator.itemgetter(*indices)
    return lambda xs: list(getter(xs))


def check_state(state: Any, kind: type, name: str, **needed: bool) -> None:
    """``state`` is a ``kind`` whose optional fields are set exactly when ``needed``."""
    if not isinstance(state, kind):
        raise TypeError(f"{name}: state must be a {kind.__name__}, got {type(state).__name__}")
    if not isinstance(state.step, Tensor) or state.step.dim() != 0 or state.step.device.type != "cpu":
        raise TypeError(f"{name}: state.step must be a scalar CPU tensor, got {state.step!r}")
    for field, need in needed.items():
        if (getattr(state, field) is not None) != need:
            raise ValueError(
                f"{name}: state.{field} is {'None' if need else 'set'}, but this optimizer "
                f"{'needs' if need else 'does not use'} it (a state made by another optimizer?)"
            )
