"""Lion with optax's formula (torch.optim has no Lion).

``optax.lion(learning_rate, b1, b2, weight_decay, mask)`` is the chain
``scale_by_lion(b1, b2)``, ``add_decayed_weights(weight_decay, mask)``,
``scale_by_learning_rate(learning_rate)``, and ``optax.apply_updates`` adds the result:

    u  = sign((1 - b1) * g + b1 * mu)       # scale_by_lion, with the old mu
    mu = (1 - b2) * g + b2 * mu
    u  = u + weight_decay * p               # add_decayed_weights (masked leaves: skipped)
    u  = u * -lr                            # scale_by_learning_rate
    p  = p + u                              # apply_updates

``lion_group`` computes exactly these expressions, in this order, on lists of tensors
(``torch._foreach_*``: the same element-wise products and sums, each rounded once), so the
fused and sharded steps can run it per bucket. tests/test_optim_torch_kernels.py checks it against
those lines written out per leaf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _tree
from ._base import Optimizer
from ._build import Hyper, Mask, Spec, build, check_betas, check_hyper

__all__ = ["LionState", "lion", "lion_group"]

Scalar = float | Tensor


class LionState(NamedTuple):
    """State of ``lion``: ``step`` (int64 CPU scalar: updates applied, optax's ``count``) and
    ``mu`` (a tree like params: optax's ``ScaleByLionState.mu``)."""

    step: Tensor
    mu: Any


def _sign_(tensors: list[Tensor]) -> None:
    if hasattr(torch, "_foreach_sign_"):
        torch._foreach_sign_(tensors)
    else:  # pragma: no cover - a torch without the foreach op
        for t in tensors:
            t.sign_()


@torch.no_grad()
def lion_group(params: list[Tensor], grads: list[Tensor], mus: list[Tensor], *, lr: Scalar,
               b1: float, b2: float, weight_decay: Scalar) -> None:
    """optax's Lion update of one group, in place (the module docstring has the formula).

    Args:
      params, grads, mus: lists of tensors of equal shapes; grads are never modified.
      lr, b1, b2, weight_decay: as ``optax.lion`` (``weight_decay=0``: no decay term).
    """
    if not params:
        return
    # Products by a scalar are out of place: torch's in-place ``_foreach_mul_`` by a Python
    # scalar rounds the scalar to a bf16 tensor's dtype first on the CPU (torch 2.13), where
    # ``x * s`` (what the formula says) computes in float; in-place sums of two tensors are exact
    # replacements of ``a + b``.
    u = torch._foreach_mul(grads, 1.0 - b1)
    torch._foreach_add_(u, torch._foreach_mul(mus, b1))
    _sign_(u)
    if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
        torch._foreach_add_(u, torch._foreach_mul(params, weight_decay))
    torch._foreach_add_(params, torch._foreach_mul(u, -lr))
    del u
    new_mus = torch._foreach_mul(grads, 1.0 - b2)
    torch._foreach_add_(new_mus, torch._foreach_mul(mus, b2))
    torch._foreach_copy_(mus, new_mus)


def _real_only(leaves: list[Tensor], treedef: Any) -> None:
    for path, t in zip(_tree.paths(treedef), leaves):
        if t.is_complex():
            raise TypeError(f"fdp.optim.lion: params{path} is complex ({t.dtype}); Lion's sign() "
                            "is defined for real tensors only")


def lion(lr: Hyper, b1: float = 0.9, b2: float = 0.99, weight_decay: Hyper = 1e-3, *,
         mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """Lion (evolved sign momentum) with ``optax.lion``'s arguments, defaults and formula.

    The update is the sign of an interpolation of the grad and the momentum ``mu``, plus
    decoupled weight decay, times ``-lr``; ``mu`` then moves toward the grad by ``1 - b2``.
    torch.optim has no Lion, so the reference is optax's (written out in the tests).

    Args:
      lr: learning rate, or a schedule of the number of updates applied (0 for the first).
      b1: the interpolation factor of the update's sign (optax's ``b1``).
      b2: the decay of ``mu`` (optax's ``b2``).
      weight_decay: optax's ``add_decayed_weights`` factor (default ``1e-3``, optax's), or
        a schedule; multiplied by the lr with the rest of the update.
      mask: which leaves get weight decay (a tree of bools or ``(path, leaf) -> bool``),
        optax's ``mask``.
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``LionState`` as its state.

    Raises:
      ValueError: an lr or weight decay below 0, or b1 or b2 outside [0, 1).
      TypeError: at ``init``, a complex leaf (named).

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.lion(lr=0.1, weight_decay=0.0)
      >>> opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)[0]["w"]
      tensor([0.9000, 1.1000])
    """
    name = "fdp.optim.lion"
    check_hyper(name, lr=lr, weight_decay=weight_decay)
    check_betas(name, (b1, b2), "(b1, b2)")

    def kernel(p, g, state, count, step, lr_now, wd_now):
        lion_group(p, g, state[0], lr=lr_now, b1=b1, b2=b2, weight_decay=wd_now)

    spec = Spec(name, LionState, {"mu": True}, 0.0, True, kernel, check_params=_real_only)
    return build(spec, lr, weight_decay, mask, donate)
