"""``muon``: torch.optim.Muon's update (Keller Jordan's Muon), over torch's own kernel.

Muon is not element-wise: each 2-D matrix's momentum is orthogonalised as a whole by
Newton-Schulz iterations, so its ``LeafKernel`` declares ``whole_leaves``: the fused step
hands it each matrix whole, in its shape (a bucket's Muon leaves are views of the bucket).
The usual pairing is Muon for the hidden matrices and AdamW for the rest (embeddings, head,
norms, biases), in one ``partition``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _internals, _tree
from ._base import Optimizer
from ._build import Hyper, Mask, Spec, build, check_hyper

__all__ = ["MuonState", "muon"]

# torch.optim.Muon's defaults (torch/optim/_muon.py, after Keller Jordan's muon.py).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


class MuonState(NamedTuple):
    """State of ``muon``: ``step`` (int64 CPU scalar: updates applied; torch.optim.Muon keeps
    none, fdp's schedules read it) and ``momentum_buffer`` (a tree like params)."""

    step: Tensor
    momentum_buffer: Any


def _matrices_only(leaves: list[Tensor], treedef: Any) -> None:
    for path, t in zip(_tree.paths(treedef), leaves):
        if t.dim() != 2:
            raise ValueError(f"fdp.optim.muon: params{path} has shape {tuple(t.shape)}; Muon updates 2-D "
                             "matrices only (pair it with adamw for the others: fdp.optim.partition)")
        if t.is_complex():
            raise TypeError(f"fdp.optim.muon: params{path} is complex ({t.dtype}); Muon supports real matrices")


def muon(lr: Hyper = 1e-3, weight_decay: Hyper = 0.1, momentum: float = 0.95, nesterov: bool = True, *,
         ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = EPS, ns_steps: int = NS_STEPS,
         adjust_lr_fn: str | None = None, mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """Muon, with ``torch.optim.Muon``'s numbers bit for bit: momentum (or Nesterov), each
    matrix orthogonalised by ``ns_steps`` Newton-Schulz iterations in bf16, decoupled weight
    decay, and the lr scaled per matrix shape (``adjust_lr_fn``).

    Args:
      lr, weight_decay: as ``torch.optim.Muon`` (floats, or schedules of the step count).
      momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as ``torch.optim.Muon``
        (``adjust_lr_fn``: None or ``"original"``, ``sqrt(max(1, A / B))``; ``"match_rms_adamw"``,
        ``0.2 * sqrt(max(A, B))``).
      mask: which matrices get weight decay (as ``adamw``'s ``mask``).
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``MuonState`` as its state; its ``LeafKernel`` takes whole leaves.

    Raises:
      ValueError: a leaf that is not a 2-D matrix (at ``init``, named), a negative lr,
        momentum or weight decay, an unknown ``adjust_lr_fn``, or ``ns_steps >= 100``.

    Example:
      >>> params = {"w": torch.eye(2)}
      >>> opt = fdp.optim.muon(lr=0.1, weight_decay=0.0)
      >>> new, state = opt.update({"w": torch.ones(2, 2)}, opt.init(params), params)
      >>> new["w"].shape, int(state.step)
      (torch.Size([2, 2]), 1)
    """
    name = "fdp.optim.muon"
    check_hyper(name, lr=lr, weight_decay=weight_decay, momentum=momentum)
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"{name}: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
    if ns_steps >= 100:
        raise ValueError(f"{name}: ns_steps must be < 100, got {ns_steps}")
    torch_muon = _internals.torch_muon()  # torch >= 2.9

    def kernel(p: list[Tensor], g: list[Tensor], state: list[list[Tensor]], count: Tensor, step: int | None,
               lr_now: Any, wd_now: Any) -> None:
        torch_muon(p, g, state[0], lr=lr_now, weight_decay=wd_now, momentum=momentum, nesterov=nesterov,
                   ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                   has_complex=False)

    spec = Spec(name, MuonState, {"momentum_buffer": True}, 0.0, True, kernel, check_params=_matrices_only,
                torch_class=getattr(torch.optim, "Muon", None), whole_leaves=True,
                fixed={"momentum": momentum, "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients),
                       "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn})
    return build(spec, lr, weight_decay, mask, donate)
