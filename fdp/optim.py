"""Functional optimizers over torch.optim's own kernels: ``sgd`` and ``adamw``.

Optax-shaped: a factory returns a ``GradientTransformation`` of two functions,
``init(params) -> state`` and ``update(grads, state, params) -> (new_params, new_state)``.
Params and grads are any pytree of tensors (usually ``dict[str, Tensor]`` from
``fdp.functionalize``); the state is a NamedTuple of tensors whose fields are the ones
torch.optim keeps per parameter, so it checkpoints with ``fdp.save`` like any other tree.

The numbers are torch.optim's: ``update`` calls the functional kernels that
``torch.optim.SGD.step`` and ``torch.optim.AdamW.step`` call (``torch.optim.sgd.sgd``,
``torch.optim.adamw.adamw``; both exist with these signatures from torch 2.4 to 2.13), with
``foreach=None`` and ``fused=None`` so the kernel picks the same single-tensor / foreach
implementation torch.optim picks by default. Only the bookkeeping around the kernels lives
here: lazy state (SGD's first momentum buffer is a clone of the grad, Adam's per-parameter
``step`` tensors), copies for the pure path, and tree checks.

Pure by default: the inputs are never modified (params and state are copied, then the copies
are updated). With ``donate=True`` the params and state passed to ``update`` are updated in
place and returned, like JAX's ``donate_argnums``: they are consumed, so keep only the
returned trees. Grads are never modified in either mode. Updates run under ``no_grad``:
the params the pure path returns do not require grad (``torch.func.grad`` does not need it).
Grads must be dense, as ``torch.func`` produces them.

Cost per update beyond the kernel: a flatten and a (shape, dtype, device) check per tree,
done by C-level ``map`` calls (no Python bytecode per leaf), one CPU ``.item()`` for the step
and, on the pure path, one clone per params and state leaf. The checks cost about 0.5 us
per leaf and tree (measured on a CPU with 1,000 leaves, torch 2.13).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

# torch.optim's functional kernels. `torch.optim` deletes its submodule attributes, so they
# are imported by module path (same names and signatures in torch 2.4 and 2.13).
from torch.optim.adamw import adamw as _torch_adamw
from torch.optim.sgd import sgd as _torch_sgd

from . import _tree

__all__ = ["AdamWState", "GradientTransformation", "SGDState", "adamw", "sgd"]

LR = float | Callable[[int], float]

# (shape, dtype, device) of a tensor in one C-level call: building and comparing these lists
# for two trees of a thousand leaves takes about half a millisecond, cheap enough to run on
# every update.
_meta = operator.attrgetter("shape", "dtype", "device")


def _traced_meta(t: Tensor) -> tuple:
    return (t.shape, t.dtype, t.device)


class GradientTransformation(NamedTuple):
    """An optimizer as a pair of pure functions (the shape of ``optax.GradientTransformation``).

    Attributes:
      init: ``init(params) -> state``.
      update: ``update(grads, state, params) -> (new_params, new_state)``.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


class SGDState(NamedTuple):
    """State of ``sgd``.

    Attributes:
      step: number of updates applied so far (int64 scalar on the CPU).
      momentum_buffer: a tree like params (zeros until the first update, which sets it to a
        clone of the grad, as torch.optim does), or ``None`` when ``momentum == 0``.
    """

    step: Tensor
    momentum_buffer: Any


class AdamWState(NamedTuple):
    """State of ``adamw``.

    Attributes:
      step: number of updates applied so far: a float scalar on the CPU, the dtype
        torch.optim uses for its per-parameter ``step`` (every parameter shares one count).
      exp_avg: first moment, a tree like params.
      exp_avg_sq: second moment, a tree like params.
      max_exp_avg_sq: running maximum of ``exp_avg_sq`` (a tree like params) with
        ``amsgrad=True``, else ``None``.
    """

    step: Tensor
    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any


def sgd(
    lr: LR,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
    donate: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent with ``torch.optim.SGD``'s arguments and numbers.

    Args:
      lr: learning rate, or a schedule ``lr(step) -> float`` called with the number of
        updates already applied (0 for the first).
      momentum, dampening, nesterov, weight_decay, maximize: as in ``torch.optim.SGD``.
      donate: update params and state in place and return them (the inputs are consumed).

    Returns:
      ``GradientTransformation(init, update)`` with ``SGDState`` as its state.

    Raises:
      ValueError: a negative lr, momentum or weight decay, or nesterov without momentum or
        with dampening (the checks torch.optim.SGD makes).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.sgd(lr=0.1, momentum=0.9)
      >>> state = opt.init(params)
      >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
      >>> params["w"], int(state.step)
      (tensor([0.9000, 0.9000]), 1)
    """
    _check_lr(lr)
    if momentum < 0.0:
        raise ValueError(f"fdp.optim.sgd: invalid momentum {momentum} (must be >= 0)")
    if weight_decay < 0.0:
        raise ValueError(f"fdp.optim.sgd: invalid weight_decay {weight_decay} (must be >= 0)")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("fdp.optim.sgd: nesterov momentum needs momentum > 0 and dampening == 0")
    name = "fdp.optim.sgd"
    # The foreach kernel adds the momentum into the grads list in place when nesterov is on
    # and neither maximize nor weight decay made a fresh copy first: copy the grads then.
    copy_grads = nesterov and not maximize and weight_decay == 0

    def init(params: Any) -> SGDState:
        leaves, treedef = _param_leaves(params, name)
        buf = None
        if momentum != 0:
            buf = _tree.unflatten(treedef, _zeros_like(leaves))
        return SGDState(torch.zeros((), dtype=torch.int64), buf)

    @torch.no_grad()
    def update(grads: Any, state: SGDState, params: Any) -> tuple[Any, SGDState]:
        _check_state(state, SGDState, name, momentum_buffer=momentum != 0)
        ps = _Params(params, name)
        p, g = ps.leaves, ps.like(grads, "grads")
        step = _host_step(state, lr, name, exact_first_step=dampening != 0)
        bufs: list[Tensor | None] = []
        if momentum != 0:
            old = ps.like(state.momentum_buffer, "state.momentum_buffer")
            # torch.optim's first step sets the buffer to a clone of the grad (not
            # momentum * 0 + (1 - dampening) * grad); the kernel does that when handed None.
            bufs = [None] * len(p) if step == 0 else (old if donate else _clone(old))
        if not donate:
            p = _clone(p)
        if copy_grads:
            g = _clone(g)
        _torch_sgd(
            p, g, bufs, has_sparse_grad=False,
            weight_decay=weight_decay, momentum=momentum, lr=_lr_at(lr, step),
            dampening=dampening, nesterov=nesterov, maximize=maximize,
        )
        if donate:
            if momentum != 0 and step == 0:  # move the kernel's fresh buffers into ours
                for dst, src in zip(old, bufs):
                    dst.copy_(src)
            state.step.add_(1)
            return params, state
        new_buf = _tree.unflatten(ps.treedef, bufs) if momentum != 0 else None
        return _tree.unflatten(ps.treedef, p), SGDState(state.step + 1, new_buf)

    return GradientTransformation(init, update)


def adamw(
    lr: LR,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    donate: bool = False,
) -> GradientTransformation:
    """Adam with decoupled weight decay, with ``torch.optim.AdamW``'s arguments and numbers.

    The weight-decay default is torch's ``1e-2`` (optax's ``adamw`` defaults to ``1e-4``).

    Args:
      lr: learning rate, or a schedule ``lr(step) -> float`` called with the number of
        updates already applied (0 for the first).
      betas, eps, weight_decay, amsgrad, maximize: as in ``torch.optim.AdamW``.
      donate: update params and state in place and return them (the inputs are consumed).

    Returns:
      ``GradientTransformation(init, update)`` with ``AdamWState`` as its state.

    Raises:
      ValueError: an lr, eps or weight decay below 0, or a beta outside [0, 1).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.adamw(lr=0.1)
      >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
      >>> params["w"]  # decayed by lr * weight_decay, then moved by lr * m_hat / sqrt(v_hat)
      tensor([0.8990, 0.8990])
    """
    _check_lr(lr)
    if eps < 0.0:
        raise ValueError(f"fdp.optim.adamw: invalid eps {eps} (must be >= 0)")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"fdp.optim.adamw: invalid betas[{i}] {beta} (must be in [0, 1))")
    if weight_decay < 0.0:
        raise ValueError(f"fdp.optim.adamw: invalid weight_decay {weight_decay} (must be >= 0)")
    beta1, beta2 = betas
    name = "fdp.optim.adamw"

    def init(params: Any) -> AdamWState:
        leaves, treedef = _param_leaves(params, name)

        def zeros() -> Any:
            return _tree.unflatten(treedef, _zeros_like(leaves))

        # torch.optim keeps `step` on the CPU in this dtype (its _get_scalar_dtype()).
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return AdamWState(
            torch.zeros((), dtype=dtype), zeros(), zeros(), zeros() if amsgrad else None
        )

    @torch.no_grad()
    def update(grads: Any, state: AdamWState, params: Any) -> tuple[Any, AdamWState]:
        _check_state(state, AdamWState, name, max_exp_avg_sq=amsgrad)
        ps = _Params(params, name)
        p, g = ps.leaves, ps.like(grads, "grads")
        m = ps.like(state.exp_avg, "state.exp_avg")
        v = ps.like(state.exp_avg_sq, "state.exp_avg_sq")
        vmax = ps.like(state.max_exp_avg_sq, "state.max_exp_avg_sq") if amsgrad else []
        step = _host_step(state, lr, name)
        if not donate:
            p, m, v, vmax = _clone(p), _clone(m), _clone(v), _clone(vmax)
        # The kernel increments one step tensor per parameter (torch.optim keeps one each):
        # hand it n scalar views of one fresh buffer, made by three C++ calls rather than n.
        steps = list(state.step.expand(len(p)).clone().unbind())
        _torch_adamw(
            p, g, m, v, vmax, steps, has_complex=any(map(torch.is_complex, p)),
            amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=_lr_at(lr, step),
            weight_decay=weight_decay, eps=eps, maximize=maximize,
        )
        if donate:
            state.step.add_(1)
            return params, state
        unflat = _tree.unflatten
        return unflat(ps.treedef, p), AdamWState(
            state.step + 1, unflat(ps.treedef, m), unflat(ps.treedef, v),
            unflat(ps.treedef, vmax) if amsgrad else None,
        )

    return GradientTransformation(init, update)


# ------------------------------------------------------------------------------- helpers


def _check_lr(lr: LR) -> None:
    if not callable(lr) and not float(lr) >= 0.0:
        raise ValueError(f"fdp.optim: invalid learning rate {lr} (must be >= 0)")


def _check_state(state: Any, kind: type, name: str, **needed: bool) -> None:
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


def _host_step(state: Any, lr: LR, name: str, exact_first_step: bool = False) -> int | None:
    """The step count as a Python int (a CPU scalar: no device sync); None under torch.compile.

    Under torch.compile the count stays a tensor in the graph: a schedule, which needs it on
    the host, is not supported there, and SGD's momentum buffers start from their zero
    initial values instead of a clone of the first gradient. With ``dampening == 0`` that is
    the same update (up to the sign of exact zeros); with dampening it is not, so refuse.
    """
    if not _tree.compiling():
        return int(state.step)
    if callable(lr):
        raise RuntimeError(f"{name}: an lr schedule reads the step count on the host; under "
                           "torch.compile pass a float lr (or call the schedule outside the graph)")
    if exact_first_step:
        raise RuntimeError(f"{name}: momentum with dampening != 0 needs the step count on the host "
                           "(torch's first step differs); it is not supported under torch.compile")
    return None


def _lr_at(lr: LR, step: int | None) -> float:
    return float(lr(step)) if callable(lr) else lr


def _clone(leaves: list[Tensor]) -> list[Tensor]:
    # map() over the bound C function: no Python bytecode per leaf.
    return list(map(Tensor.clone, leaves))


def _zeros_like(leaves: list[Tensor]) -> list[Tensor]:
    return [torch.zeros_like(t, memory_format=torch.preserve_format) for t in leaves]


def _param_leaves(params: Any, name: str) -> tuple[list[Tensor], Any]:
    """Leaves and structure of ``params``, each leaf checked to be a floating tensor (init)."""
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


class _Params:
    """The params of one ``update`` call, and checks of other trees against them.

    The checks run on every update, so the common case costs no Python bytecode per leaf:
    one flatten (C++), one structure comparison, and one list of (shape, dtype, device)
    per tree built by ``map`` over a C getter. Only a mismatch walks the leaves in Python,
    to name the first bad one.
    """

    def __init__(self, params: Any, name: str) -> None:
        self.name = name
        self.leaves, self.treedef = _tree.flatten(params)
        self._meta: list[Any] | None = None

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
