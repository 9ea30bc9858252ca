"""One call of a torch.optim kernel on a group of leaves that share hyper-parameters.

Each function takes lists of tensors (params, grads, state tensors, in one order) and the
group's hyper-parameters, and updates params and state *in place* by calling the functional
kernel that the torch.optim class calls in its ``step`` (``torch.optim.sgd.sgd``,
``torch.optim.adam.adam``, ``torch.optim.adamw.adamw``, ``torch.optim.adagrad.adagrad``,
``torch.optim.rmsprop.rmsprop``, ``torch.optim.nadam.nadam``, ``torch.optim.radam.radam``,
``torch.optim.adamax.adamax``, ``torch.optim.adadelta.adadelta`` and, from torch 2.5,
``torch.optim._adafactor.adafactor`` (``fdp._internals.torch_adafactor``); the lists are passed by position, everything else by
keyword. ``sgd``'s and ``adamw``'s signatures were checked on torch 2.4 and 2.13, the
others on 2.13 only; the later kernels' optional arguments go through ``_call``, which
passes only those the installed torch accepts). ``foreach`` and ``fused`` are left at ``None``
so the kernel picks the implementation torch.optim picks by default. The lists may be a
tree's leaves (``fdp.optim``'s pytree optimizers) or flat per-bucket tensors (one element
each): the numbers are the same per element either way.

``step`` is the number of updates already applied (a scalar tensor). Kernels that keep a
per-parameter step count (Adam, Adagrad, RMSprop) are handed views of one fresh copy of it,
so the caller's counter is never advanced here: the caller adds 1 once per update.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

# torch.optim deletes its submodule attributes, so the kernels are imported by module path.
from torch.optim.adadelta import adadelta as _torch_adadelta
from torch.optim.adagrad import adagrad as _torch_adagrad
from torch.optim.adam import adam as _torch_adam
from torch.optim.adamax import adamax as _torch_adamax
from torch.optim.adamw import adamw as _torch_adamw
from torch.optim.nadam import nadam as _torch_nadam
from torch.optim.radam import radam as _torch_radam
from torch.optim.rmsprop import rmsprop as _torch_rmsprop
from torch.optim.sgd import sgd as _torch_sgd

from .. import _internals

_torch_adafactor = _internals.torch_adafactor()  # (None before torch 2.5)

__all__ = ["adadelta_group", "adafactor_group", "adagrad_group", "adam_group", "adamax_group",
           "adamw_group", "has_adafactor", "nadam_group", "radam_group", "rmsprop_group",
           "sgd_group", "supports"]

Scalar = float | Tensor
_FIRST_STEP_SLICE = 8  # tensors per kernel call on SGD's first step (see sgd_group)


def _steps(step: Tensor, n: int) -> list[Tensor]:
    # n scalar views of one fresh buffer, made by three C++ calls rather than n.
    return list(step.expand(n).clone().unbind())


def _has_complex(params: Sequence[Tensor]) -> bool:
    return any(map(torch.is_complex, params))


def sgd_group(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], *,
              first: bool, lr: Scalar, momentum: float, dampening: float, nesterov: bool,
              weight_decay: Scalar, maximize: bool) -> None:
    """``torch.optim.SGD``'s update of one group, in place.

    Args:
      params, grads: lists of tensors of equal shapes; grads are never modified.
      momentum_buffers: one per param (empty when ``momentum == 0``).
      first: this is the first update: torch.optim sets the buffer to a clone of the
        (decayed) grad instead of ``momentum * 0 + (1 - dampening) * grad``; the kernel does
        that when handed ``None``, and the result is copied into ``momentum_buffers``.
      lr, momentum, dampening, nesterov, weight_decay, maximize: as ``torch.optim.SGD``.
    """
    if first and momentum != 0 and len(params) > _FIRST_STEP_SLICE:
        # The first step makes each buffer as a fresh clone before it is copied into place:
        # a slice at a time keeps those clones small (a fused bucket arrives as many chunks).
        for lo in range(0, len(params), _FIRST_STEP_SLICE):
            hi = lo + _FIRST_STEP_SLICE
            sgd_group(params[lo:hi], grads[lo:hi], momentum_buffers[lo:hi], first=True, lr=lr,
                      momentum=momentum, dampening=dampening, nesterov=nesterov,
                      weight_decay=weight_decay, maximize=maximize)
        return
    bufs: list[Tensor | None] = [None] * len(params) if first and momentum != 0 else list(momentum_buffers)
    # The foreach kernel adds the momentum into the grads list in place when nesterov is on
    # and neither maximize nor weight decay made a fresh copy first: copy the grads then.
    if nesterov and not maximize and not weight_decay:
        grads = list(map(Tensor.clone, grads))
    _torch_sgd(params, grads, bufs, has_sparse_grad=False, weight_decay=weight_decay,
               momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov, maximize=maximize)
    if first and momentum != 0:
        torch._foreach_copy_(momentum_buffers, bufs)


def adam_group(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], step: Tensor, *,
               lr: Scalar, beta1: float, beta2: float, eps: float, weight_decay: Scalar,
               amsgrad: bool, maximize: bool) -> None:
    """``torch.optim.Adam``'s update of one group (L2 weight decay added to the grad), in place.

    Args:
      params, grads, exp_avgs, exp_avg_sqs: lists of tensors of equal shapes.
      max_exp_avg_sqs: one per param with ``amsgrad``, else empty.
      step: updates applied so far (scalar tensor; not modified).
      lr, beta1, beta2, eps, weight_decay, amsgrad, maximize: as ``torch.optim.Adam``.
    """
    _torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, _steps(step, len(params)),
                has_complex=_has_complex(params), amsgrad=amsgrad, beta1=beta1, beta2=beta2,
                lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)


def adamw_group(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], step: Tensor, *,
                lr: Scalar, beta1: float, beta2: float, eps: float, weight_decay: Scalar,
                amsgrad: bool, maximize: bool) -> None:
    """``torch.optim.AdamW``'s update of one group (decoupled weight decay), in place.

    Args: as ``adam_group``.
    """
    _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, _steps(step, len(params)),
                 has_complex=_has_complex(params), amsgrad=amsgrad, beta1=beta1, beta2=beta2,
                 lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)


def adagrad_group(params: list[Tensor], grads: list[Tensor], sums: list[Tensor], step: Tensor, *,
                  lr: Scalar, lr_decay: float, weight_decay: Scalar, eps: float,
                  maximize: bool) -> None:
    """``torch.optim.Adagrad``'s update of one group, in place.

    Args:
      params, grads, sums: lists of tensors of equal shapes (``sums`` is torch's ``sum``).
      step: updates applied so far (scalar tensor; not modified).
      lr, lr_decay, weight_decay, eps, maximize: as ``torch.optim.Adagrad``.
    """
    _torch_adagrad(params, grads, sums, _steps(step, len(params)), has_sparse_grad=False,
                   has_complex=_has_complex(params), lr=lr, weight_decay=weight_decay,
                   lr_decay=lr_decay, eps=eps, maximize=maximize)


def rmsprop_group(params: list[Tensor], grads: list[Tensor], square_avgs: list[Tensor],
                  grad_avgs: list[Tensor], momentum_buffers: list[Tensor], step: Tensor, *,
                  lr: Scalar, alpha: float, eps: float, weight_decay: Scalar, momentum: float,
                  centered: bool, maximize: bool) -> None:
    """``torch.optim.RMSprop``'s update of one group, in place.

    Args:
      params, grads, square_avgs: lists of tensors of equal shapes.
      grad_avgs: one per param when ``centered``, else empty.
      momentum_buffers: one per param when ``momentum > 0``, else empty.
      step: updates applied so far (scalar tensor; not modified).
      lr, alpha, eps, weight_decay, momentum, centered, maximize: as ``torch.optim.RMSprop``.
    """
    _torch_rmsprop(params, grads, square_avgs, grad_avgs, momentum_buffers,
                   _steps(step, len(params)), maximize=maximize, has_complex=_has_complex(params),
                   lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                   centered=centered)


# ------------------------------------------------- NAdam, RAdam, Adamax, Adadelta, Adafactor

_KERNELS: dict[str, Callable[..., None] | None] = {
    "nadam": _torch_nadam, "radam": _torch_radam, "adamax": _torch_adamax,
    "adadelta": _torch_adadelta, "adafactor": _torch_adafactor}
_ARGUMENTS = {name: frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()
              for name, fn in _KERNELS.items()}


def has_adafactor() -> bool:
    """Whether the installed torch has Adafactor's kernel (torch >= 2.5)."""
    return _torch_adafactor is not None


def supports(kernel: str, option: str) -> bool:
    """Whether the installed torch's ``kernel`` (``"nadam"``, ...) takes the argument ``option``."""
    return option in _ARGUMENTS[kernel]


def _call(kernel: str, *lists: list, maximize: bool, **options) -> None:
    """torch's ``kernel`` on ``lists`` (params, grads, state lists), with the ``options`` the
    installed torch accepts. ``has_complex`` is dropped where the kernel does not take it
    (it then finds complex params itself); ``maximize`` where it does not becomes negated
    grads, which is the kernel's own first step (``grad = -grad``, exact)."""
    fn, accepted = _KERNELS[kernel], _ARGUMENTS[kernel]
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no {kernel} kernel")
    if maximize and "maximize" not in accepted:
        lists = (lists[0], torch._foreach_neg(lists[1]), *lists[2:])
    elif "maximize" in accepted:
        options["maximize"] = maximize
    # An option this torch lacks is dropped only where leaving it out means the same (the
    # factories refuse the others with a message first: see ``supports``).
    missing = [k for k, v in options.items() if k not in accepted and k != "has_complex" and v is not False]
    if missing:
        raise TypeError(f"torch {torch.__version__}'s {kernel} kernel has no {missing}")
    fn(*lists, **{k: v for k, v in options.items() if k in accepted})


def nadam_group(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                exp_avg_sqs: list[Tensor], mu_product: Tensor, step: Tensor, *, lr: Scalar,
                beta1: float, beta2: float, eps: float, weight_decay: Scalar,
                momentum_decay: float, decoupled_weight_decay: bool, maximize: bool) -> None:
    """``torch.optim.NAdam``'s update of one group, in place.

    Args:
      params, grads, exp_avgs, exp_avg_sqs: lists of tensors of equal shapes.
      mu_product: the product of the momentum coefficients of the updates applied so far
        (torch's per-parameter ``mu_product``, the same for every param of the group: a
        scalar CPU tensor; not modified, each param's kernel copy is a view of one clone).
      step: updates applied so far (scalar tensor; not modified).
      lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize:
        as ``torch.optim.NAdam``.
    """
    n = len(params)
    _call("nadam", params, grads, exp_avgs, exp_avg_sqs, _steps(mu_product, n), _steps(step, n),
          maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
          has_complex=_has_complex(params), beta1=beta1, beta2=beta2, lr=lr,
          weight_decay=weight_decay, momentum_decay=momentum_decay, eps=eps)


def radam_group(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                exp_avg_sqs: list[Tensor], step: Tensor, *, lr: Scalar, beta1: float, beta2: float,
                eps: float, weight_decay: Scalar, decoupled_weight_decay: bool, maximize: bool) -> None:
    """``torch.optim.RAdam``'s update of one group, in place.

    Args:
      params, grads, exp_avgs, exp_avg_sqs: lists of tensors of equal shapes.
      step: updates applied so far (scalar tensor; not modified).
      lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize: as ``torch.optim.RAdam``.
    """
    # Eagerly torch branches on the rectification term in Python floats; under torch.compile
    # that branch would be on a tensor, so the kernel's capturable form (a torch.where) is
    # traced instead, with the count in float64 as the eager Python floats are (the term
    # subtracts two numbers near 2 / (1 - beta2): in float32 it is off by ~1e-4 near 5).
    compiling = torch.compiler.is_compiling()
    _call("radam", params, grads, exp_avgs, exp_avg_sqs,
          _steps(step.to(torch.float64) if compiling else step, len(params)),
          maximize=maximize, decoupled_weight_decay=decoupled_weight_decay, capturable=compiling,
          has_complex=_has_complex(params), beta1=beta1, beta2=beta2, lr=lr,
          weight_decay=weight_decay, eps=eps)


def adamax_group(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                 exp_infs: list[Tensor], step: Tensor, *, lr: Scalar, beta1: float, beta2: float,
                 eps: float, weight_decay: Scalar, maximize: bool) -> None:
    """``torch.optim.Adamax``'s update of one group, in place.

    Args:
      params, grads, exp_avgs, exp_infs: lists of tensors of equal shapes.
      step: updates applied so far (scalar tensor; not modified).
      lr, beta1, beta2, eps, weight_decay, maximize: as ``torch.optim.Adamax``.
    """
    _call("adamax", params, grads, exp_avgs, exp_infs, _steps(step, len(params)),
          maximize=maximize, has_complex=_has_complex(params), eps=eps, beta1=beta1,
          beta2=beta2, lr=lr, weight_decay=weight_decay)


def adadelta_group(params: list[Tensor], grads: list[Tensor], square_avgs: list[Tensor],
                   acc_deltas: list[Tensor], step: Tensor, *, lr: Scalar, rho: float, eps: float,
                   weight_decay: Scalar, maximize: bool) -> None:
    """``torch.optim.Adadelta``'s update of one group, in place.

    Args:
      params, grads, square_avgs, acc_deltas: lists of tensors of equal shapes.
      step: updates applied so far (scalar tensor; not modified).
      lr, rho, eps, weight_decay, maximize: as ``torch.optim.Adadelta``.
    """
    _call("adadelta", params, grads, square_avgs, acc_deltas, _steps(step, len(params)),
          maximize=maximize, has_complex=_has_complex(params), lr=lr, rho=rho, eps=eps,
          weight_decay=weight_decay)


def adafactor_group(params: list[Tensor], grads: list[Tensor], row_vars: list[Tensor | None],
                    col_vars: list[Tensor | None], variances: list[Tensor | None], step: Tensor, *,
                    lr: Scalar, beta2_decay: float, eps1: float | None, eps2: float, d: float,
                    weight_decay: Scalar, maximize: bool) -> None:
    """``torch.optim.Adafactor``'s update of one group (torch >= 2.5), in place.

    Not element-wise: each param of two or more dims keeps row and column factors of its
    second moment (``row_vars``, ``col_vars``; ``None`` in ``variances``), the others a
    ``variance`` like themselves (``None`` in ``row_vars`` and ``col_vars``), and the update
    of each param reads norms of the whole param and of its whole update.

    Args:
      params, grads: lists of whole leaves.
      row_vars, col_vars, variances: one entry per param, ``None`` where not used.
      step: updates applied so far (scalar tensor; not modified).
      lr, beta2_decay, eps1, eps2, d, weight_decay, maximize: as ``torch.optim.Adafactor``
        (``eps1=None``: the machine epsilon of the group's first param's dtype, as torch).
    """
    _call("adafactor", params, grads, row_vars, col_vars, variances, _steps(step, len(params)),
          maximize=maximize, d=d, lr=lr, beta2_decay=beta2_decay, weight_decay=weight_decay,
          eps1=eps1, eps2=eps2)


# ---------------------------------------------------------------------------- the Spec form
# ``Spec.kernel(p, g, state_lists, count, step, lr, weight_decay)`` for the optimizers of
# ``_optimizers.py``, their fixed options bound with ``functools.partial`` there: a step calls
# these directly (one frame here, none in the factory's module).

def sgd_kernel(p: list[Tensor], g: list[Tensor], state: list, count: Tensor, step: int, lr: Scalar,
               wd: Scalar, *, momentum: float, dampening: float, nesterov: bool, maximize: bool) -> None:
    sgd_group(p, g, state[0], first=step == 0, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
              weight_decay=wd, maximize=maximize)


def adam_kernel(p: list[Tensor], g: list[Tensor], state: list, count: Tensor, step: int, lr: Scalar, wd: Scalar, *,
                group: Any, beta1: float, beta2: float, eps: float, amsgrad: bool, maximize: bool) -> None:
    m, v, vmax = state
    group(p, g, m, v, vmax, count, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, amsgrad=amsgrad,
          maximize=maximize)


def adagrad_kernel(p: list[Tensor], g: list[Tensor], state: list, count: Tensor, step: int, lr: Scalar,
                   wd: Scalar, *, lr_decay: float, eps: float, maximize: bool) -> None:
    adagrad_group(p, g, state[0], count, lr=lr, lr_decay=lr_decay, weight_decay=wd, eps=eps, maximize=maximize)


def rmsprop_kernel(p: list[Tensor], g: list[Tensor], state: list, count: Tensor, step: int, lr: Scalar,
                   wd: Scalar, *, alpha: float, eps: float, momentum: float, centered: bool, maximize: bool) -> None:
    square_avg, grad_avg, buf = state
    rmsprop_group(p, g, square_avg, grad_avg, buf, count, lr=lr, alpha=alpha, eps=eps, weight_decay=wd,
                  momentum=momentum, centered=centered, maximize=maximize)
