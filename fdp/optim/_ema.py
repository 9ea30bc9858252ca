"""``ema``: an exponential moving average of the params, kept in the optimizer's state.

The numbers are torch's ``AveragedModel(model,
multi_avg_fn=get_ema_multi_avg_fn(decay))`` with ``update_parameters(model)`` called after
every ``optimizer.step()`` (``torch/optim/swa_utils.py``, torch 2.13):

* ``n_averaged == 0`` (the first call): each averaged param is a copy of the model's;
* then, per group of tensors of one device and dtype, ``torch._foreach_lerp_(averaged,
  current, 1 - decay)`` for floating and complex tensors, and ``averaged.copy_(averaged *
  decay + current * (1 - decay))`` for the others (integer buffers);
* ``n_averaged += 1``.

With ``use_buffers=False`` (torch's default) the averaged model's buffers are copies of the
model's, so its forward uses ``ema_params(state, params)`` with the current buffers; with
``use_buffers=True`` the buffers are averaged as the params are: ``ema_update`` applied to
them. A lerp of one element depends on nothing else (each element is
``averaged + w * (current - averaged)``, or ``current - (current - averaged) * (1 - w)``
when ``w >= 0.5``), so the average runs on any piece of the params with the same numbers:
the fused step's flat buckets, and a rank's slice of them under ``shard=True``.

The average counts *updates*: the state's own count of them (``state.step`` of the wrapped
optimizer), so an update skipped by a global scale (a chain whose loss scale found a
non-finite gradient, the fused step's ``skip_nonfinite``) leaves the average as it was, as
it leaves the params.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _tree
from .._protocols import HasTemplate
from ._base import ChainState, Form, Optimizer, ParamLeaves, clone
from ._transforms import Partitioned, PartitionState

__all__ = ["EmaState", "ema", "ema_params", "ema_update"]


class EmaState(NamedTuple):
    """State of ``ema(opt)`` when ``opt``'s state has no step count of its own (a
    ``partition``, your own optimizer): ``inner`` (``opt``'s state), ``ema`` (a tree like
    params: the average) and ``count`` (an int64 CPU scalar: the averages taken, torch's
    ``n_averaged``).

    For an optimizer whose state has a ``step`` (every fdp.optim optimizer), the state of
    ``ema(opt)`` is instead that state's own fields and then ``ema``, as a NamedTuple named
    after it (``ema(adamw())`` keeps an ``EmaAdamWState(step, exp_avg, exp_avg_sq,
    max_exp_avg_sq, ema)``): the fused step keeps each field flat per bucket.
    """

    inner: Any
    ema: Any
    count: Tensor


# ---------------------------------------------------------------- the states with an ema field

_WITH_EMA: dict[type, type] = {}  # the inner state's type -> its type with an ``ema`` field
_INNER: dict[type, type] = {}     # ... and back
_TYPES_LOCK = threading.Lock()    # simulated ranks are threads that may build optimizers at once


def _with_ema_type(cls: type) -> type:
    """The NamedTuple of ``cls``'s fields then ``ema``, made once per ``cls``. It pickles as
    ``(cls, its values)`` (``_extended``): pickle needs no module-level name for it."""
    with _TYPES_LOCK:
        extended = _WITH_EMA.get(cls)
        if extended is None:
            name = f"Ema{cls.__name__}"
            extended = NamedTuple(name, [(f, Any) for f in cls._fields] + [("ema", Any)])
            extended.__module__ = __name__
            extended.__doc__ = (f"State of ``fdp.optim.ema(opt)`` for an ``opt`` whose state is a "
                                f"``{cls.__name__}``: its fields, then ``ema`` (a tree like params).")
            extended.__reduce__ = _reduce_extended
            _WITH_EMA[cls], _INNER[extended] = extended, cls
        return extended


def _reduce_extended(state: tuple) -> tuple:
    return _extended, (_INNER[type(state)], tuple(state))


def _extended(cls: type, values: tuple) -> Any:
    """An ``ema`` state of ``cls``'s fields then ``ema``, from its values (unpickling)."""
    return _with_ema_type(cls)._make(values)


def _has_step(state: Any) -> bool:
    fields = getattr(type(state), "_fields", None)
    return (isinstance(state, tuple) and fields is not None and "step" in fields and "ema" not in fields
            and isinstance(state.step, Tensor) and state.step.dim() == 0)


class _Form:
    """How one optimizer's state carries its average: appended as a field (``extended``,
    counted by the inner ``step``) or wrapped in an ``EmaState`` (with its own count)."""

    @staticmethod
    def wrap_init(inner: Any, params: Any) -> Any:
        avg = _tree.tree_map(torch.zeros_like, params)
        if _has_step(inner):
            return _with_ema_type(type(inner))._make((*inner, avg))
        return EmaState(inner, avg, torch.zeros((), dtype=torch.int64))

    @staticmethod
    def split(state: Any, name: str) -> tuple[Any, Any, Tensor]:
        """(the inner state, the average, the count of averages taken)."""
        cls = _INNER.get(type(state))
        if cls is not None:
            inner = cls._make(state[:-1])
            return inner, state.ema, inner.step
        if isinstance(state, EmaState):
            return state.inner, state.ema, state.count
        raise TypeError(f"{name}: state must be the state of fdp.optim.ema(opt) (from its init), got "
                        f"{type(state).__name__}")

    @staticmethod
    def join(old: Any, inner: Any, avg: Any) -> Any:
        if isinstance(old, EmaState):
            return EmaState(inner, avg, old.count + 1)
        return type(old)._make((*inner, avg))


# ---------------------------------------------------------------- the average itself

def _lerp_(averaged: list[Tensor], current: list[Tensor], weight: float, first: bool) -> None:
    """One EMA update of lists of floating (or complex) tensors, in place: a copy on the first."""
    if first:
        torch._foreach_copy_(averaged, current)
    else:
        torch._foreach_lerp_(averaged, current, weight)


def _check_decay(decay: float, name: str) -> None:
    if not 0.0 <= decay <= 1.0:  # torch's get_ema_multi_avg_fn check
        raise ValueError(f"{name}: invalid decay {decay} (must be in [0, 1])")


@torch.no_grad()
def ema_update(average: Any, current: Any, count: int | Tensor, decay: float) -> Any:
    """One ``AveragedModel.update_parameters`` with ``get_ema_multi_avg_fn(decay)``, on trees.

    The optimizer wrapper ``ema`` does this to the params after every update; call it
    yourself for trees it does not see, e.g. the buffers, for torch's ``use_buffers=True``.

    Args:
      average: the average so far (a tree of tensors; ignored when ``count`` is 0).
      current: the values to average in (a tree of the same structure).
      count: averages taken before this one (torch's ``n_averaged``): 0 copies ``current``.
      decay: in [0, 1]; the weight of ``average`` (``1 - decay`` is lerp's weight).

    Returns:
      The new average, a new tree (the inputs are not modified): floating and complex
      tensors by ``torch._foreach_lerp_`` per group of one device and dtype, others (integer
      buffers such as BatchNorm's ``num_batches_tracked``) by ``average * decay + current *
      (1 - decay)`` copied into the average's dtype, as torch does.

    Raises:
      ValueError: ``decay`` outside [0, 1], or trees of different structures.

    Example:
      >>> avg = fdp.optim.ema_update({"w": torch.zeros(2)}, {"w": torch.ones(2)}, 0, decay=0.9)
      >>> avg["w"]  # the first average copies
      tensor([1., 1.])
      >>> fdp.optim.ema_update(avg, {"w": torch.zeros(2)}, 1, decay=0.9)["w"]
      tensor([0.9000, 0.9000])
    """
    name = "fdp.optim.ema_update"
    _check_decay(decay, name)
    avg_leaves, treedef = _tree.flatten(average)
    cur_leaves, got = _tree.flatten(current)
    if got != treedef:
        raise ValueError(f"{name}: current does not have the structure of average: "
                         f"{_tree.first_difference(treedef, got)}")
    out = clone(avg_leaves)  # AveragedModel updates its own tensors in place: a copy of ours
    cur_leaves = [c.detach().to(o.device) for o, c in zip(out, cur_leaves)]
    if int(count) == 0:
        for o, c in zip(out, cur_leaves):
            o.copy_(c)
        return _tree.unflatten(treedef, out)
    groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
    for o, c in zip(out, cur_leaves):  # torch's _group_tensors_by_device_and_dtype, in order
        mine, theirs = groups.setdefault((o.device, o.dtype), ([], []))
        mine.append(o)
        theirs.append(c)
    for mine, theirs in groups.values():
        if torch.is_floating_point(mine[0]) or torch.is_complex(mine[0]):
            torch._foreach_lerp_(mine, theirs, 1 - decay)
        else:
            for o, c in zip(mine, theirs):
                o.copy_(o * decay + c * (1 - decay))
    return _tree.unflatten(treedef, out)


# ---------------------------------------------------------------- the optimizer wrapper

def _keeps_state(opt: Optimizer) -> bool:
    """Whether a partition label's optimizer keeps any state (``frozen()`` keeps ``()``: its
    params never move, so they are their own average and get none)."""
    try:
        return opt.init({}) != ()
    except Exception:  # noqa: BLE001 - an optimizer that cannot init nothing: assume it keeps state
        return True


def _by_label(partition: Partitioned, params: Any) -> dict[Any, dict[Any, Any]]:
    """Each label's sub-tree of ``params``, as ``partition`` hands it to the label's optimizer."""
    leaves = _tree.leaves(params)
    out: dict[Any, dict[Any, Any]] = {}
    for label, key, leaf in zip(partition.labels(params), partition.keys(params), leaves):
        out.setdefault(label, {})[key] = leaf
    return out


def ema(opt: Optimizer, decay: float = 0.999, *, donate: bool = False) -> Optimizer:
    """``opt`` that also keeps an exponential moving average of the params in its state.

    After every update the average moves as torch's ``AveragedModel(model,
    multi_avg_fn=get_ema_multi_avg_fn(decay))`` does when ``update_parameters(model)`` follows
    each ``optimizer.step()``: the first update's params are copied, then each update
    lerps the average toward the new params by ``1 - decay``. Read it with ``ema_params``.

    Runs in the fused step (``reducer.grad_and_update``) and the sharded fused step when
    ``opt`` does (an element-wise optimizer, Muon, or a ``partition`` of them, alone or at
    the end of a chain): the average is one more state field, updated right after the params
    of each bucket (slice, sharded); ``step.state_to_tree`` gives it per leaf. A global scale
    that skips an update (a chain's, or ``skip_nonfinite``) skips the average's too.

    Args:
      opt: an fdp.optim optimizer or chain.
      decay: in [0, 1] (torch's default 0.999).
      donate: update the average in place (build ``opt`` with ``donate=True`` too: then the
        whole update works in place). Default: a new average tree each update.

    Returns:
      An ``Optimizer``. Its state is ``opt``'s with an ``ema`` field appended (a NamedTuple
      named ``Ema`` + the state's type name, e.g. ``EmaAdamWState``; a chain's ``ChainState``
      holds it as its ``optimizer``; a ``partition``'s ``PartitionState`` holds one per label,
      a ``frozen()`` label none), or an ``EmaState`` for optimizers whose state has no step
      count (your own). ``fdp.save``/``fdp.load`` keep it with the rest.

    Raises:
      ValueError: ``decay`` outside [0, 1].

    Example:
      >>> opt = fdp.optim.ema(fdp.optim.sgd(lr=0.5), decay=0.9)
      >>> params = {"w": torch.ones(2)}
      >>> state = opt.init(params)
      >>> for _ in range(2):
      ...     params, state = opt.update({"w": torch.ones(2)}, state, params)
      >>> params["w"], fdp.optim.ema_params(state, params)["w"]  # 0.5 copied, then 0.9*0.5 + 0.1*0
      (tensor([0., 0.]), tensor([0.4500, 0.4500]))
    """
    name = "fdp.optim.ema"
    _check_decay(decay, name)
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{name}: opt must be an fdp.optim optimizer or chain, got {type(opt).__name__}")
    weight = 1 - decay  # get_ema_multi_avg_fn's lerp weight, a Python float as torch passes it
    last = opt.form.parts[-1] if opt.form.parts else opt
    part = last.form.partition
    averaged = {label: _keeps_state(o) for label, o in part.optimizers.items()} if part is not None else {}

    def average(avg: Any, params: Any, first: bool) -> Any:
        ps = ParamLeaves(params, name)
        avg_leaves = ps.like(avg, "state.ema")
        if donate:
            _lerp_(avg_leaves, ps.leaves, weight, first)
            return avg
        new = clone(ps.leaves) if first else list(torch._foreach_lerp(avg_leaves, ps.leaves, weight))
        return _tree.unflatten(ps.treedef, new)

    # The last optimizer's state, with its average(s) taken out and put back. ``info`` is
    # (average, count before the update) per averaged state: one, or one per label.
    def wrap(inner: Any, params: Any) -> Any:
        if part is None:
            return _Form.wrap_init(inner, params)
        subs = _by_label(part, params)
        return PartitionState({label: _Form.wrap_init(s, subs[label]) if averaged[label] else s
                               for label, s in inner.states.items()})

    def split(state: Any) -> tuple[Any, dict]:
        if part is None:
            inner, avg, count = _Form.split(state, name)
            return inner, {None: (avg, int(count))}
        if not isinstance(state, PartitionState):
            raise TypeError(f"{name}: state must be the PartitionState of this partition's init, got "
                            f"{type(state).__name__}")
        inners, info = {}, {}
        for label, s in state.states.items():
            if averaged[label]:
                inners[label], avg, count = _Form.split(s, name)
                info[label] = (avg, int(count))  # (before the update: a donating optimizer advances it in place)
            else:
                inners[label] = s
        return PartitionState(inners), info

    def skipped(inner: Any, new: Any, info: dict) -> bool:
        """A global scale skipped the update: the chain handed the optimizer's state back."""
        if part is None and _has_step(inner):  # (a donating optimizer returns its own state object)
            return int(new.step) == info[None][1]
        return new is inner  # (a partition's update always makes a new PartitionState)

    def join(old: Any, new: Any, info: dict, params: Any) -> Any:
        if part is None:
            avg, n = info[None]
            return _Form.join(old, new, average(avg, params, n == 0))
        subs = _by_label(part, params)
        states = {}
        for label, s in new.states.items():
            if label in info:
                avg, n = info[label]
                s = _Form.join(old.states[label], s, average(avg, subs[label], n == 0))
            states[label] = s
        return PartitionState(states)

    if opt.form.parts:  # a chain: its transforms, then ``ema`` of its optimizer (what the fused step runs)
        ema_last = ema(last, decay, donate=donate)

        def init(params: Any) -> ChainState:
            state = opt.init(params)
            return ChainState(state.transforms, wrap(state.optimizer, params))

        @torch.no_grad()
        def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
            if not isinstance(state, ChainState):
                raise TypeError(f"{name}: state must be the ChainState of this chain's init, got "
                                f"{type(state).__name__}")
            inner, info = split(state.optimizer)
            params, new = opt.update(grads, ChainState(state.transforms, inner), params)
            if skipped(inner, new.optimizer, info):  # so is the average
                return params, ChainState(new.transforms, state.optimizer)
            return params, ChainState(new.transforms, join(state.optimizer, new.optimizer, info, params))

        return Optimizer(init, update, Form(parts=(*opt.form.parts[:-1], ema_last), about=(('ema_decay', decay),)))

    def init(params: Any) -> Any:
        return wrap(opt.init(params), params)

    @torch.no_grad()
    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        inner, info = split(state)
        params, new = opt.update(grads, inner, params)
        return params, join(state, new, info, params)

    kernel = None
    if opt.form.leaf_kernel is not None:
        inner_kernel = opt.form.leaf_kernel

        @torch.no_grad()
        def leaf_step(group: int, p: list[Tensor], g: list[Tensor], state_lists: list[list[Tensor]],
                      count: Tensor) -> None:
            first = int(count) == 0
            inner_kernel.step(group, p, g, state_lists[:-1], count)
            _lerp_(state_lists[-1], p, weight, first)

        kernel = inner_kernel._replace(fields=(*inner_kernel.fields, "ema"), step=leaf_step)
    partitioned = None
    if part is not None:  # the fused step runs each label's optimizer: each label averages its own
        partitioned = part._replace(optimizers={label: ema(o, decay, donate=donate) if averaged[label] else o
                                                for label, o in part.optimizers.items()})
    return Optimizer(init, update, Form(kernel, hyper=opt.form.hyper, partition=partitioned, about=(('ema_decay', decay),)))


def ema_params(state: Any, params: Any) -> Any:
    """The average of the params that ``ema(opt)`` keeps, as a tree like params.

    Args:
      state: the state of ``ema(opt)`` (``opt.update``'s, a chain's ``ChainState`` around
        it, or the fused step's in per-leaf form: ``step.state_to_tree(opt_state, params)``;
        a fused step's own ``step.ema_params(opt_state, params)`` does this, and with fully
        sharded params returns ``ShardedParams`` without gathering anything).
      params: the current params: before the first update the average is the params
        themselves (torch's ``AveragedModel`` starts as a copy of the model), and so are a
        ``frozen()`` label's leaves.

    Returns:
      The state's average (its own tensors, not a copy), or ``params`` before any update.

    Raises:
      TypeError: ``state`` is not such a state (a ``FusedState``: convert it first), or
        ``params`` are ``fdp.ShardedParams`` (use ``step.ema_params``).

    Example:
      >>> opt = fdp.optim.ema(fdp.optim.adamw(lr=0.1), decay=0.99)
      >>> params = {"w": torch.ones(2)}
      >>> state = opt.init(params)
      >>> fdp.optim.ema_params(state, params) is params
      True
      >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
      >>> torch.equal(fdp.optim.ema_params(state, params)["w"], params["w"])  # the first copies
      True
    """
    name = "fdp.optim.ema_params"
    if type(params) is not dict and isinstance(params, HasTemplate):
        raise TypeError(f"{name}: params are fdp.ShardedParams (this rank's slices); the average of a fully "
                        "sharded step is step.ema_params(opt_state, params), ShardedParams too (no gather)")
    inner = state.optimizer if isinstance(state, ChainState) else state
    buffers = getattr(inner, "buffers", None)
    if isinstance(buffers, dict) and any(key.split(":")[-1] == "ema" for key in buffers):
        raise TypeError(f"{name}: this is the fused step's flat state; pass its per-leaf form, "
                        "step.state_to_tree(opt_state, params)")
    if isinstance(inner, PartitionState):  # each label's average, by the leaves' keys
        found: dict[Any, Tensor] = {}
        for s in inner.states.values():
            if type(s) in _INNER or isinstance(s, EmaState):
                _, avg, count = _Form.split(s, name)
                if int(count) > 0:
                    found.update(avg)
        if not found:
            return params
        leaves, treedef = _tree.flatten(params)
        return _tree.unflatten(treedef, [found.get(k, leaf) for k, leaf in zip(_tree.keys(treedef), leaves)])
    _, avg, count = _Form.split(inner, name)
    return params if int(count) == 0 else avg
