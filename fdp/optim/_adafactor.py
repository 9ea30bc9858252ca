"""Adafactor over ``torch.optim.Adafactor``'s kernel (torch >= 2.5).

Adafactor is not element-wise. A leaf of two or more dims keeps its second moment factored
into a row factor (``row_var``, the shape of the leaf with its last dim 1) and a column
factor (``col_var``, its second-to-last dim 1); a leaf of fewer dims keeps a ``variance``
like itself. Each leaf's update also reads the norm of the whole leaf and of its whole
update (torch's relative step size and update clipping). So there is no ``LeafKernel``:
flat buckets (a bucket holds many leaves; a sharded step a slice of one) cannot hold the
factors, and the norms need whole leaves. The fused step (``reducer.grad_and_update``)
refuses it; use ``reducer.grad`` and ``opt.update``.

The state trees have the params' structure with ``None`` where torch keeps no such field
for that param (torch's per-param state has only the keys it uses); ``None`` is structure,
not a leaf, so ``fdp.save`` / ``fdp.load`` round-trip it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _tree
from . import _kernels
from ._base import Form, KnownLeaves, Optimizer, ParamLeaves, check_state, clone, param_leaves
from ._build import Hyper, Mask, MaskGroups, check_hyper, host_step, scalar_dtype, value_at

__all__ = ["AdafactorState", "adafactor"]


class AdafactorState(NamedTuple):
    """State of ``adafactor``: ``step`` (a float CPU scalar), and trees like params:
    ``row_var`` and ``col_var`` (at leaves of two or more dims, else ``None``) and
    ``variance`` (at leaves of fewer dims, else ``None``), torch's per-param fields."""

    step: Tensor
    row_var: Any
    col_var: Any
    variance: Any


def _factor_shapes(shape: torch.Size) -> tuple[tuple[int, ...], tuple[int, ...]]:
    row, col = list(shape), list(shape)
    row[-1], col[-2] = 1, 1
    return tuple(row), tuple(col)


def adafactor(lr: Hyper = 1e-2, beta2_decay: float = -0.8, eps: tuple[float | None, float] = (None, 1e-3),
              d: float = 1.0, weight_decay: Hyper = 0.0, *, maximize: bool = False,
              mask: Mask | None = None, donate: bool = False) -> Optimizer:
    """Adafactor with ``torch.optim.Adafactor``'s arguments and numbers (torch >= 2.5).

    Not element-wise (factored second moments of each leaf of two or more dims, norms of
    whole leaves), so the fused step refuses it: use ``reducer.grad`` and ``opt.update``.

    Args:
      lr: as in ``torch.optim.Adafactor`` (the cap of the relative step size and the factor
        of the decoupled weight decay), or a schedule of the step count.
      beta2_decay, eps, d, maximize: as in ``torch.optim.Adafactor`` (``eps[0] = None``: the
        machine epsilon of the group's first leaf's dtype, as torch).
      weight_decay: as in ``torch.optim.Adafactor`` (decoupled: params times
        ``1 - lr * weight_decay``), or a schedule.
      mask: which leaves get weight decay (a tree of bools or ``(path, leaf) -> bool``).
      donate: update params and state in place and return them.

    Returns:
      An ``Optimizer`` with ``AdafactorState`` as its state (no ``leaf_kernel``).

    Raises:
      ValueError: an lr, eps or weight decay below 0, a beta2_decay above 0 or a d below 1.
      RuntimeError: torch older than 2.5 (no Adafactor kernel).
      TypeError: at ``init``, a complex leaf (named): torch's Adafactor refuses them.

    Example:
      >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
      >>> opt = fdp.optim.adafactor(lr=0.01)
      >>> state = opt.init(params)
      >>> state.row_var["w"].shape, state.col_var["w"].shape, state.variance["b"].shape
      (torch.Size([2, 1]), torch.Size([1, 2]), torch.Size([2]))
      >>> opt.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, state, params)[0]["w"]
      tensor([[0.9900, 0.9900],
              [0.9900, 0.9900]])
    """
    name = "fdp.optim.adafactor"
    if not _kernels.has_adafactor():
        raise RuntimeError(f"{name} needs torch >= 2.5 (torch.optim.Adafactor); this is torch {torch.__version__}")
    eps1, eps2 = eps
    check_hyper(name, lr=lr, eps2=eps2, weight_decay=weight_decay)
    if eps1 is not None:
        check_hyper(name, eps1=eps1)
    if not beta2_decay <= 0.0:
        raise ValueError(f"{name}: invalid beta2_decay {beta2_decay} (must be <= 0)")
    if not d >= 1.0:
        raise ValueError(f"{name}: invalid clipping threshold d {d} (must be >= 1)")
    groups = MaskGroups(mask, name)
    known = KnownLeaves() if donate else None
    layouts: dict[Any, tuple[Any, Any]] = {}

    def layout(ps: ParamLeaves) -> tuple[Any, Any]:
        """(structure of the factored fields, of ``variance``) for these params' structure."""
        cached = None if _tree.compiling() else layouts.get(ps.treedef)
        if cached is None:
            factored = [t.dim() > 1 for t in ps.leaves]
            cached = (_tree.structure(_tree.unflatten(ps.treedef, [0 if f else None for f in factored])),
                      _tree.structure(_tree.unflatten(ps.treedef, [None if f else 0 for f in factored])))
            if not _tree.compiling():
                layouts[ps.treedef] = cached
        return cached

    def init(params: Any) -> AdafactorState:
        leaves, treedef = param_leaves(params, name)
        for path, t in zip(_tree.paths(treedef), leaves):
            if t.is_complex():
                raise TypeError(f"{name}: params{path} is complex ({t.dtype}); torch's Adafactor "
                                "does not support complex parameters")
        rows, cols, variances = [], [], []
        for t in leaves:
            if t.dim() > 1:
                row, col = _factor_shapes(t.shape)
                rows.append(t.new_zeros(row))
                cols.append(t.new_zeros(col))
                variances.append(None)
            else:
                rows.append(None)
                cols.append(None)
                variances.append(torch.zeros_like(t, memory_format=torch.preserve_format))
        trees = [_tree.unflatten(treedef, x) for x in (rows, cols, variances)]
        return AdafactorState(torch.zeros((), dtype=scalar_dtype()), *trees)

    def fields(ps: ParamLeaves, state: AdafactorState) -> list[list[Tensor | None]]:
        """Per leaf of params, its (row_var, col_var, variance), checked (None where unused)."""
        factored, flat = layout(ps)
        out = []
        for field, want in (("row_var", factored), ("col_var", factored), ("variance", flat)):
            leaves, got = _tree.flatten(getattr(state, field))
            if got != want:
                raise ValueError(f"{name}: state.{field} does not have the layout of params' "
                                 f"{'>= 2-D' if want is factored else '< 2-D'} leaves: "
                                 f"{_tree.first_difference(want, got)}")
            out.append(leaves)
        per_leaf: list[list[Tensor | None]] = [[], [], []]
        it = [iter(x) for x in out]
        for path, p in zip(_tree.paths(ps.treedef), ps.leaves):
            if p.dim() > 1:
                row, col = _factor_shapes(p.shape)
                entries = ((next(it[0]), row, "row_var"), (next(it[1]), col, "col_var"), (None, None, ""))
            else:
                entries = ((None, None, ""), (None, None, ""), (next(it[2]), tuple(p.shape), "variance"))
            for k, (t, shape, field) in enumerate(entries):
                if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != shape
                                      or t.dtype != p.dtype or t.device != p.device):
                    what = (f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"
                            if isinstance(t, Tensor) else f"a {type(t).__name__}")
                    raise ValueError(f"{name}: state.{field}{path} is {what}; params{path} needs shape "
                                     f"{shape}, dtype {p.dtype}, device {p.device}")
                per_leaf[k].append(t)
        return per_leaf

    @torch.no_grad()
    def update(grads: Any, state: AdafactorState, params: Any) -> tuple[Any, AdafactorState]:
        check_state(state, AdafactorState, name)
        ps = ParamLeaves(params, name, known)
        if donate and not ps.known:
            ps.check_no_aliases()
        p, g = ps.leaves, ps.like_known(grads, "grads")
        rows, cols, variances = fields(ps, state)
        ps.checked()
        step = host_step(state.step, name, "Adafactor (its step size is read on the host)")
        lr_now = value_at(lr, step, state.step)
        wd_now = value_at(weight_decay, step, state.step)
        if not donate:
            p = clone(p)
            rows, cols, variances = ([None if t is None else t.clone() for t in x] for x in (rows, cols, variances))
        for pick, decays in groups.of(ps):
            sel = (lambda xs: xs) if pick is None else pick
            _kernels.adafactor_group(sel(p), sel(g), sel(rows), sel(cols), sel(variances), state.step,
                                     lr=lr_now, beta2_decay=beta2_decay, eps1=eps1, eps2=eps2, d=d,
                                     weight_decay=wd_now if decays else 0.0, maximize=maximize)
        if donate:
            state.step.add_(1)
            return params, state
        trees = [_tree.unflatten(ps.treedef, x) for x in (rows, cols, variances)]
        return _tree.unflatten(ps.treedef, p), AdafactorState(state.step + 1, *trees)

    return Optimizer(init, update, Form(unfused=(
        "fdp.optim.adafactor's update is not element-wise (it factors each matrix's second moment over its rows "
        "and columns), so it cannot run per bucket: use reducer.grad and opt.update")))
