"""This rank's gradients: how a Reducer step runs the user's function and its backward.

Two engines compute the same numbers:

* ``"autograd"`` (what ``engine="auto"`` picks): at the top level, ``torch.func.grad``
  computes exactly what ``torch.autograd.grad`` on fresh leaves computes, but wraps every op
  of the forward and backward on the way; plain autograd skips that wrapping
  (docs/measurements.md, "fdp beside DDP": fdp against func-ar). Leaf hooks are set through ``fdp._internals``.
* ``"functorch"``: ``torch.func.grad_and_value`` itself, with hooks registered on its wrapped
  leaves inside the transform (the private functorch APIs are in ``fdp._internals``).

Gradients travel as lists in the plan's leaf order; trees are built once, for the caller.
"""

from __future__ import annotations

import contextlib
import operator
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import _internals, _tree
from .._functional import BINDINGS as bindings
from .._functional import bindings_released
from .._protocols import Engine, GathersUnits

ENGINES = ("auto", *typing.get_args(Engine))  # ("auto", "autograd", "functorch")


def resolve_engine(engine: str) -> Engine:
    if engine not in ENGINES:
        raise ValueError(f"fdp.Reducer: engine must be one of {ENGINES}, got {engine!r}")
    return "autograd" if engine == "auto" else engine


def loss_of(out: Any, has_aux: bool) -> torch.Tensor:
    """The scalar loss in ``fn``'s output, or a ``ValueError`` saying what came back instead."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError("fdp: with has_aux=True the function must return a (loss, aux) tuple, "
                             f"got {type(out).__name__}")
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"fdp: the function passed to reducer.grad must return a scalar loss tensor, got {shape}; "
            "reduce it (e.g. .mean()) or use has_aux=True to return extra outputs"
        )
    return out


def select(args: tuple, argnums: int | tuple[int, ...]) -> Any:
    """The differentiated argument(s), as ``torch.func.grad``'s ``argnums`` picks them."""
    return args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in argnums)


def refuse_sharded(diff: Any, what: str) -> None:
    """A differentiated argument that is ``fdp.ShardedParams`` (this rank's slices, gathered
    only inside a fully sharded step) is refused, saying what to use instead."""
    for x in diff if isinstance(diff, tuple) else (diff,):
        if type(x) is not dict and isinstance(x, GathersUnits):
            raise TypeError(
                f"{what} got fdp.ShardedParams, the slices a fully sharded step (Reducer(shard='params')) "
                "keeps; only that step gathers their units and reduce-scatters their gradients: train with "
                "step(params, opt_state, ...) from reducer.grad_and_update (any fdp.optim optimizer, Muon "
                "included, a chain that clips or masks, step.accumulate for micro-batches), or differentiate "
                "params.full() (every leaf whole on every rank) with a Reducer that does not shard params")


def replace(args: tuple, argnums: int | tuple[int, ...], new: Any) -> tuple:
    args = list(args)
    if isinstance(argnums, int):
        args[argnums] = new
    else:
        for i, v in zip(argnums, new):
            args[i] = v
    return tuple(args)


def detach_tree(tree: Any) -> Any:
    return _tree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def autograd_on() -> contextlib.AbstractContextManager:
    """Autograd recording, also inside ``torch.inference_mode()`` (where it records nothing,
    and a step would average zeros): a step's own tensors are ordinary tensors, as
    ``torch.func.grad``'s are there. Outside inference mode, nothing to do."""
    return _recording() if torch.is_inference_mode_enabled() else _NOTHING


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    with torch.inference_mode(False), torch.enable_grad():
        yield


_NOTHING = contextlib.nullcontext()


def reentrant_refused(e: RuntimeError) -> RuntimeError:
    """The error to raise for ``e`` from fdp's backward, which differentiates its own leaves only
    (``torch.autograd.grad``, or ``backward(inputs=...)``), as ``torch.func.grad`` does:
    reentrant activation checkpointing (``use_reentrant=True``) cannot run inside it, and
    torch's own error suggests a plain ``.backward()``, which fdp's steps do not offer, so say
    what does work (``e`` itself for any other error)."""
    if "use_reentrant=True" not in str(e):
        return e
    return RuntimeError(
            "fdp: reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) cannot run "
            "in fdp's gradient: its backward runs a nested backward into .grad, which torch allows only in a plain "
            "loss.backward(). Pass use_reentrant=False (HF: model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})): it gives the same numbers as the run "
            "without checkpointing, in every fdp step (docs/concepts.md, activation checkpointing)")


def autograd_leaves(leaves: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """Fresh autograd leaves viewing ``leaves`` (detached, requiring grad), and whether some
    were made under ``torch.inference_mode`` (those are cloned: autograd cannot record on an
    inference tensor)."""
    inference = any(map(torch.Tensor.is_inference, leaves))
    if inference:
        leaves = [t.clone() if t.is_inference() else t for t in leaves]
    return list(map(torch.Tensor.requires_grad_, map(torch.Tensor.detach, leaves))), inference


def _tracked(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor made in ``torch.inference_mode()`` (a batch from
    an inference-mode data pipeline) copied to an ordinary one: autograd cannot save an
    inference tensor for the backward, where ``torch.func.grad`` takes it. Nothing is copied
    otherwise."""
    if not any(isinstance(t, torch.Tensor) and t.is_inference() for t in _tree.leaves((args, kwargs))):
        return args, kwargs

    def ordinary(t: Any) -> Any:
        return t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t

    with torch.inference_mode(False):
        return _tree.tree_map(ordinary, (args, kwargs))


def local_grads(engine: Engine, fn: Callable, argnums: Any, has_aux: bool, args: tuple, kwargs: dict,
                leaves: list[torch.Tensor], treedef: _tree.TreeDef,
                hooks: Sequence[Callable | None] | None,
                on_backward_start: Callable[[torch.Tensor], None] | None,
                wrap: Callable[[list[torch.Tensor]], Any] | None = None) -> tuple[list[Any], Any]:
    """This rank's gradients (a list in leaf order) and value, as ``grad_and_value`` gives them.

    With ``hooks``, each hooked leaf's hook sees its gradient as the backward produces it,
    ``on_backward_start`` runs when the outer backward begins, and only the entries of
    leaves without a hook are meaningful (None for a leaf the loss does not use). Without
    hooks, unused leaves get zeros, as ``torch.func.grad`` returns. ``wrap`` (autograd
    engine): makes ``fn``'s differentiated argument from the autograd leaves instead of the
    tree (fully sharded params: a ``Gathering``).
    """
    if engine == "functorch":
        # The differentiated tree is handed over in the plan's order (a dict given in another
        # key order is matched by key), so the gradients come back in it too.
        args = replace(args, argnums, _tree.unflatten(treedef, leaves))
        instrumented = _instrument(fn, argnums, has_aux, treedef, hooks, on_backward_start)
        grads, value = torch.func.grad_and_value(instrumented, argnums, has_aux)(*args, **kwargs)
        return _tree.leaves(grads), value
    args, kwargs = _tracked(args, kwargs)
    inputs, _ = autograd_leaves(leaves)
    if hooks is not None:
        for leaf, hook in zip(inputs, hooks):
            if hook is not None:
                _internals.set_leaf_hook(leaf, hook)
    args = replace(args, argnums, _tree.unflatten(treedef, inputs) if wrap is None else wrap(inputs))
    bindings.depth += 1  # (apply keeps a call's tensors bound until this backward is done: bindings_released)
    try:
        with torch.enable_grad():
            out = fn(*args, **kwargs)
            loss = loss_of(out, has_aux)
            grads: Sequence[torch.Tensor | None] = [None] * len(inputs)
            if loss.requires_grad and inputs:  # nothing to differentiate: torch.func.grad returns {}
                if on_backward_start is not None:
                    loss.register_hook(on_backward_start)
                try:
                    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
                except RuntimeError as e:
                    raise reentrant_refused(e) from e
    finally:
        bindings.depth -= 1
        if bindings.homes and not bindings.depth:
            bindings_released()
    value = (loss.detach(), detach_tree(out[1])) if has_aux else loss.detach()
    if hooks is not None:
        return list(grads), value
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)], value


class Reused:
    """The autograd leaves ``local_grads_into`` differentiates: made for a list of tensors and
    reused while the same tensors (by identity, over the same memory) come back with the same
    ``into``, as a module's own parameters are across backward passes (each leaf's ``.grad``
    stays its buffer in ``into``; no detach, ``requires_grad_`` and ``.grad`` assignment per
    leaf per call). Its values are always the tensors' own (a detached view shares them)."""

    __slots__ = ("src", "ptrs", "into", "inputs")

    def __init__(self) -> None:
        self.src: list[torch.Tensor] | None = None
        self.ptrs: list[int] | None = None
        self.into: list[torch.Tensor] | None = None
        self.inputs: list[torch.Tensor] = []

    def of(self, leaves: list[torch.Tensor], into: list[torch.Tensor]) -> list[torch.Tensor]:
        """Leaves that require grad, viewing ``leaves``, whose ``.grad`` are ``into``'s tensors."""
        src = self.src
        if (src is not None and self.into is into and len(src) == len(leaves) and all(map(operator.is_, leaves, src))
                and list(map(torch.Tensor.data_ptr, leaves)) == self.ptrs):
            return self.inputs
        inputs, inference = autograd_leaves(leaves)
        for leaf, acc in zip(inputs, into):
            leaf.grad = acc
        if not inference:  # (a clone of an inference tensor is made again each call)
            self.src, self.ptrs, self.into, self.inputs = list(leaves), list(map(torch.Tensor.data_ptr, leaves)), \
                into, inputs
        return inputs


def local_grads_into(fn: Callable, has_aux: bool, args: tuple, kwargs: dict, leaves: list[torch.Tensor],
                     treedef: _tree.TreeDef, into: list[torch.Tensor],
                     on_backward_start: Callable[[torch.Tensor], None] | None = None,
                     reused: Reused | None = None) -> Any:
    """``fn``'s gradients (the differentiated argument is ``args[0]``) *added* into ``into`` (one
    tensor per leaf, its shape and dtype), in place, by autograd's own accumulation (as
    ``.grad`` accumulates over DDP's ``no_sync`` micro-batches: no gradient tensor allocated,
    no separate pass); a leaf the loss does not use adds nothing. Returns the value (the
    loss, or ``(loss, aux)``), detached. ``on_backward_start`` runs when the backward begins;
    ``reused`` keeps the autograd leaves from one call to the next. Autograd engine only."""
    args, kwargs = _tracked(args, kwargs)
    inputs = (reused or Reused()).of(leaves, into)
    args = replace(args, 0, _tree.unflatten(treedef, inputs))
    bindings.depth += 1  # (as in local_grads)
    try:
        with torch.enable_grad():
            out = fn(*args, **kwargs)
            loss = loss_of(out, has_aux)
            if loss.requires_grad and inputs:
                if on_backward_start is not None:
                    loss.register_hook(on_backward_start)
                try:
                    torch.autograd.backward(loss, inputs=inputs)
                except RuntimeError as e:
                    raise reentrant_refused(e) from e
    finally:
        bindings.depth -= 1
        if bindings.homes and not bindings.depth:
            bindings_released()
    return (loss.detach(), detach_tree(out[1])) if has_aux else loss.detach()


def _instrument(fn: Callable, argnums: Any, has_aux: bool, treedef: _tree.TreeDef,
                hooks: Sequence[Callable | None] | None,
                on_backward_start: Callable[[torch.Tensor], None] | None) -> Callable:
    def instrumented(*args: Any, **kwargs: Any) -> Any:
        if hooks is not None:
            for leaf, hook in zip(_tree.leaves(select(args, argnums)), hooks):
                if hook is not None:
                    leaf.register_hook(hook)
        out = fn(*args, **kwargs)
        loss = loss_of(out, has_aux)
        if on_backward_start is not None and loss.requires_grad:
            loss.register_hook(on_backward_start)
        return out

    return instrumented


def local_grad_and_value(fn: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable:
    """``torch.func.grad_and_value``, on this rank only (no communication), computed the way
    a Reducer computes its local gradients: plain autograd on fresh leaves, which gives the
    same numbers as ``torch.func.grad`` without wrapping every op of the forward and backward
    (docs/measurements.md, "fdp beside DDP": fdp against func-ar). Unused leaves get zeros, as ``torch.func`` gives them.
    Inside another ``torch.func`` transform or under ``torch.compile``, it is
    ``torch.func.grad_and_value`` itself.

    Returns a function with ``torch.func.grad_and_value``'s signature and result:
    ``(grads, value)``, ``value`` the loss or ``(loss, aux)``, detached.

    Example:
      >>> g, v = fdp.local_grad_and_value(lambda p: (p["w"] ** 2).sum())({"w": torch.tensor([1.0, 2.0])})
      >>> g["w"], v
      (tensor([2., 4.]), tensor(5.))
    """
    def grad_and_value_fn(*args: Any, **kwargs: Any) -> Any:
        refuse_sharded(select(args, argnums), "fdp.local_grad")
        if _tree.compiling() or _internals.in_functorch_transform():
            return torch.func.grad_and_value(fn, argnums, has_aux)(*args, **kwargs)
        with autograd_on():
            leaves, treedef = _tree.flatten(select(args, argnums))
            grads, value = local_grads("autograd", fn, argnums, has_aux, args, kwargs, leaves, treedef, None, None)
        return _tree.unflatten(treedef, grads), value

    return grad_and_value_fn


def local_grad(fn: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable:
    """``torch.func.grad``, on this rank only, computed as ``local_grad_and_value`` does:
    returns the gradients, or ``(gradients, aux)`` with ``has_aux=True``.

    Example:
      >>> fdp.local_grad(lambda p: (p["w"] ** 2).sum())({"w": torch.tensor([1.0, 2.0])})["w"]
      tensor([2., 4.])
    """
    gv = local_grad_and_value(fn, argnums, has_aux)

    def grad_fn(*args: Any, **kwargs: Any) -> Any:
        grads, value = gv(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return grad_fn
