"""torch.optim state dicts to and from fdp optimizer states: move a DDP + torch.optim run to
fdp, or back, and continue it bit for bit.

A ``torch.optim.X.state_dict()`` is ``{"state": {id: {field: tensor, "step": tensor}},
"param_groups": [{"params": [id, ...], "lr": ..., ...}]}``: ids count the parameters in the
order the optimizer was given them, group after group. fdp's state is ``opt.init(params)``'s
NamedTuple: one count and, per field, a tree like params. The fields have torch's names
(``exp_avg``, ``momentum_buffer``, ...) and hold torch's numbers, so the conversion is a
matter of order: which id is which leaf. By default the ids follow the optimizer's groups
(``mask=``: the decayed leaves in params order, then the others), which is what
``torch.optim.AdamW(model.parameters())`` or the usual two-group split gives; ``names=``
(or the state dict's own ``param_names``) says it otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _internals, _tree
from ._base import ChainState, Optimizer, ParamLeaves, param_leaves
from ._hyperparams import Hyperparams

__all__ = ["state_from_torch", "state_to_torch"]

# Prefixes torch's wrappers add to parameter names: DDP (and DataParallel), torch.compile.
_WRAPPER_PREFIXES = ("module.", *(f"{s}." for s in _internals.WRAPPER_SEGMENTS))  # (DDP's, and the wrappers')


def _parts(opt: Any, name: str) -> tuple[tuple, Optimizer]:
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{name}: opt must be an fdp.optim optimizer, got {type(opt).__name__}")
    transforms, inner = (tuple(opt.form.parts[:-1]), opt.form.parts[-1]) if opt.form.parts else ((), opt)
    if inner.form.hyper is None or inner.form.leaf_kernel is None or inner.form.hyper.torch_class is None:
        raise TypeError(f"{name}: only sgd, adam, adamw, adagrad and rmsprop (alone or at the end of a "
                        "chain) have a torch.optim counterpart; convert a partition's states per label")
    cls = inner.form.hyper.torch_class
    if cls not in _CONVERTED:
        raise TypeError(f"{name}: converting a torch.optim.{cls.__name__} state is not supported (its "
                        f"per-parameter state differs from fdp's); state_from_torch and state_to_torch "
                        f"convert {', '.join(c.__name__ for c in _CONVERTED)} states. Start "
                        f"fdp.optim.{cls.__name__.lower()}'s state fresh (opt.init), or save and resume with fdp's "
                        "own checkpoints")
    return transforms, inner


# The torch.optim classes whose states convert, and every per-parameter field each may keep
# with any of its hyper-parameters (a field outside these is another optimizer's state).
_FIELDS = {torch.optim.SGD: {"momentum_buffer"},
           torch.optim.Adam: {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
           torch.optim.AdamW: {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
           torch.optim.Adagrad: {"step", "sum"},
           torch.optim.RMSprop: {"step", "square_avg", "momentum_buffer", "grad_avg"}}
_CONVERTED = tuple(_FIELDS)


def _describe(keys: list[Any], idx: Sequence[int]) -> str:
    shown = ", ".join(repr(keys[i]) for i in idx[:4])
    return shown + (f" and {len(idx) - 4} more" if len(idx) > 4 else "")


def _order(keys: list[Any], groups: list[int], names: Sequence[Any] | None, name: str) -> list[int]:
    """Leaf indices in torch's id order: by ``names``, else by group then params order."""
    if names is None:
        return [i for g in sorted(set(groups)) for i in range(len(keys)) if groups[i] == g]
    where = {k: i for i, k in enumerate(keys)}
    order, unknown = [], []
    for n in names:
        i = where.get(n)
        if i is None and isinstance(n, str):
            stripped = n
            while i is None and stripped.startswith(_WRAPPER_PREFIXES):
                stripped = stripped.split(".", 1)[1]
                i = where.get(stripped)
        if i is None:
            unknown.append(n)
        order.append(i)
    if unknown:
        raise ValueError(f"{name}: names {unknown[:4]} are not keys of params (its keys: {_describe(keys, range(len(keys)))})")
    missing = sorted(set(range(len(keys))) - set(order))
    if missing or len(order) != len(set(order)):
        dup = [keys[i] for i in set(order) if order.count(i) > 1]
        raise ValueError(f"{name}: names must list every key of params once; "
                         + (f"missing: {_describe(keys, missing)}" if missing else f"repeated: {dup[:4]}"))
    return order


def _torch_group(hyper: Hyperparams, values: dict[str, Any], decays: bool) -> dict[str, Any]:
    """A param group of ``hyper.torch_class`` with ``values``: every key torch's constructor
    sets on this torch version (AdamW's ``decoupled_weight_decay`` among them)."""
    kwargs = {**values, "weight_decay": values["weight_decay"] if decays else 0.0}
    probe = hyper.torch_class([torch.zeros(1, requires_grad=True)], **kwargs)
    group = dict(probe.param_groups[0])
    del group["params"]
    return group


def _same(a: Any, b: Any) -> bool:
    a, b = (x.item() if isinstance(x, Tensor) and x.numel() == 1 else x for x in (a, b))  # lr=tensor(...)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def state_from_torch(opt: Optimizer, state_dict: dict[str, Any], params: Any, *,
                     names: Sequence[Any] | None = None, step: int | None = None,
                     strict: bool = True) -> Any:
    """The state of ``opt`` (``opt.init(params)``'s layout) holding a torch.optim state dict.

    Continue a DDP + ``torch.optim`` run with fdp: ``torch.optim.X.state_dict()`` (with its
    param groups) and the params at that point give the state from which ``opt.update``
    (or, through ``step.state_from_tree``, the fused step) takes the next steps with the
    numbers torch.optim would have produced, bit for bit.

    Args:
      opt: ``sgd``, ``adam``, ``adamw``, ``adagrad`` or ``rmsprop`` (``mask=`` for the usual
        decay / no-decay groups), or a ``chain`` ending in one: the state is then a
        ``ChainState`` whose transforms start fresh (``clip_grad_norm_`` keeps no state).
      state_dict: ``torch_optimizer.state_dict()`` of the matching class (``SGD``,
        ``Adam``, ``AdamW``, ``Adagrad``, ``RMSprop``).
      params: the params tree (e.g. ``fdp.functionalize(ddp.module)[1]``).
      names: the key of each torch parameter id, in id order (groups in order): parameter
        names for a flat dict of params (``"module."`` and ``"_orig_mod."`` prefixes are
        ignored), key tuples for other trees. Default: the state dict's ``param_names``
        (an optimizer built from ``named_parameters()``), else the leaves group by group
        (``mask=``'s decayed leaves first), each group in params order.
      step: the number of updates applied. torch's Adam, AdamW, Adagrad and RMSprop keep it
        per parameter (then it is read, and checked if given); ``SGD`` keeps none, so it is
        required there (0 for a fresh optimizer; your scheduler's ``last_epoch``).
      strict: check that each torch param group's hyper-parameters (``lr`` against ``opt``'s
        lr at ``step``, weight decay, betas, momentum, ...) are ``opt``'s for its leaves;
        ``False`` continues with ``opt``'s own.

    Returns:
      A state for ``opt.update`` (a ``ChainState`` for a chain).

    Raises:
      TypeError: ``opt`` has no torch.optim counterpart (``partition``, your own).
      ValueError: the ids cannot be matched to the leaves (counts, names), a tensor's shape
        differs from its leaf's, a field is missing or not used by ``opt``, the per-parameter
        step counts differ, ``step`` is missing for SGD, or (``strict``) a hyper-parameter
        differs; each names the leaf or group.

    Example:
      >>> model = nn.Linear(3, 2)
      >>> torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
      >>> model(torch.ones(1, 3)).sum().backward(); torch_opt.step()
      >>> apply, params, buffers = fdp.functionalize(model)
      >>> opt = fdp.optim.adamw(lr=1e-3)
      >>> state = fdp.optim.state_from_torch(opt, torch_opt.state_dict(), params)
      >>> int(state.step), torch.equal(state.exp_avg["weight"], torch_opt.state[model.weight]["exp_avg"])
      (1, True)
    """
    name = "fdp.optim.state_from_torch"
    transforms, inner = _parts(opt, name)
    hyper, kernel = inner.form.hyper, inner.form.leaf_kernel
    leaves, treedef = param_leaves(params, name)
    keys = _tree.keys(treedef)
    groups = kernel.groups(params)
    torch_groups = state_dict.get("param_groups")
    torch_state = state_dict.get("state")
    if not isinstance(torch_groups, list) or not isinstance(torch_state, dict):
        raise ValueError(f"{name}: state_dict must be a torch.optim state dict ({{'state': ..., "
                         f"'param_groups': [...]}}), got keys {sorted(state_dict)}")
    ids = [i for g in torch_groups for i in g["params"]]
    group_of_id = {i: gi for gi, g in enumerate(torch_groups) for i in g["params"]}
    if len(ids) != len(leaves):
        raise ValueError(f"{name}: torch's param groups hold {len(ids)} parameters, params has "
                         f"{len(leaves)} leaves")
    if names is None and all("param_names" in g for g in torch_groups):
        names = [n for g in torch_groups for n in g["param_names"]]
    if names is None and len(torch_groups) > 1:
        sizes = [len(g["params"]) for g in torch_groups]
        ours = [groups.count(g) for g in sorted(set(groups))]
        if sizes != ours:
            raise ValueError(f"{name}: torch's {len(sizes)} param groups hold {sizes} parameters, this "
                             f"optimizer's groups (mask=: decay, no decay) {ours}: pass names= (each "
                             "torch parameter's key, in torch's order)")
    # One torch group lists the params in params order whatever opt's groups are.
    order = list(range(len(leaves))) if names is None and len(torch_groups) == 1 else \
        _order(keys, groups, names, name)
    leaf_of_id = dict(zip(ids, order))

    # The count: torch's per-parameter steps (all equal), or `step` (SGD keeps none).
    counts = {float(entry["step"]) for entry in torch_state.values() if "step" in entry}
    if len(counts) > 1:
        per = {repr(keys[leaf_of_id[i]]): float(e["step"]) for i, e in torch_state.items() if "step" in e}
        raise ValueError(f"{name}: torch's parameters have different step counts {per}; an fdp "
                         "optimizer keeps one count")
    if step is not None:
        if counts and counts != {float(step)}:
            raise ValueError(f"{name}: step={step}, but torch's state counts {counts.pop():g} updates")
        count = int(step)
    elif counts:
        count = int(counts.pop())
    elif hyper.torch_class is torch.optim.SGD:
        raise ValueError(f"{name}: torch.optim.SGD keeps no step count; pass step= (the number of "
                         "updates applied: 0 for a fresh optimizer, else e.g. your scheduler's last_epoch)")
    else:
        count = 0
    if count < 0:
        raise ValueError(f"{name}: step must be >= 0, got {count}")

    if strict:
        want = hyper.at(count)
        for gi, g in enumerate(torch_groups):
            members = [leaf_of_id[i] for i in g["params"]]
            for decays in sorted({groups[i] == 0 for i in members}):
                expected = {**want, "weight_decay": want["weight_decay"] if decays else 0.0}
                for key, value in expected.items():
                    if key in g and not _same(g[key], value):
                        which = [i for i in members if (groups[i] == 0) == decays]
                        raise ValueError(
                            f"{name}: torch's param group {gi} has {key}={g[key]!r}, but opt uses "
                            f"{key}={value!r} at step {count} for its leaves ({_describe(keys, which)}): "
                            "build opt with torch's hyper-parameters (and mask= for a no-decay group), "
                            "or pass strict=False to continue with opt's")

    fields = kernel.fields
    values: dict[str, list[Tensor]] = {f: [None] * len(leaves) for f in fields}  # type: ignore[misc]
    for tid in ids:
        leaf = leaf_of_id[tid]
        where = f"params{_tree.paths(treedef)[leaf]} (torch parameter {tid}, group {group_of_id[tid]})"
        entry = {k: v for k, v in torch_state.get(tid, {}).items() if k != "step"}
        if not entry:
            if count > 0 and fields and hyper.torch_class is not torch.optim.Adagrad:
                raise ValueError(f"{name}: torch's state has no {'/'.join(fields)} for {where} after "
                                 f"{count} updates (it never had a gradient?); fdp keeps state for every leaf")
            continue
        extra = sorted(set(entry) - set(fields))
        foreign = [f for f in extra if f not in _FIELDS[hyper.torch_class]]
        if foreign:
            raise ValueError(f"{name}: torch's state holds {foreign} for {where}, which "
                             f"torch.optim.{hyper.torch_class.__name__} never keeps: it is another torch "
                             "optimizer's state; pass the fdp.optim optimizer that matches it (state_from_torch "
                             f"converts {', '.join(c.__name__ for c in _CONVERTED)} states)")
        if extra:
            raise ValueError(f"{name}: torch's state holds {extra} for {where}, which opt does not use "
                             f"(its fields: {list(fields)}): was torch's optimizer built with other "
                             "hyper-parameters (momentum, amsgrad, centered)?")
        for f in fields:
            t = entry.get(f)
            if not isinstance(t, Tensor):
                raise ValueError(f"{name}: torch's state has no tensor {f!r} for {where}")
            p = leaves[leaf]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: torch's {f} for {where} has shape {tuple(t.shape)}, the leaf "
                                 f"{tuple(p.shape)}: names= does not match torch's order?")
            values[f][leaf] = t.detach().to(device=p.device, dtype=p.dtype, copy=True)

    fresh = inner.init(params)
    trees = {}
    for f in fields:
        init_leaves = _tree.leaves(getattr(fresh, f))
        trees[f] = _tree.unflatten(treedef, [v if v is not None else z for v, z in zip(values[f], init_leaves)])
    state = fresh._replace(step=torch.tensor(count, dtype=fresh.step.dtype), **trees)
    if opt.form.parts:
        return ChainState(tuple(t.init(params) for t in transforms), state)
    return state


def state_to_torch(opt: Optimizer, state: Any, params: Any, *,
                   names: Sequence[Any] | None = None) -> dict[str, Any]:
    """A ``torch.optim`` state dict holding an fdp optimizer state: what the matching torch
    optimizer's ``load_state_dict`` takes to continue the run bit for bit.

    Build the torch optimizer over the same parameters in the same order and groups (by
    default: one group, or with ``mask=`` the decayed parameters then the others, each in
    params order), load the params into the model (``model.load_state_dict(
    apply.state_dict(params, buffers))``), then ``torch_opt.load_state_dict(sd)``. Each
    group's ``lr`` and ``weight_decay`` are the values the next update uses (schedules at
    the state's count); a torch lr scheduler keeps its own count: set ``sched.last_epoch``
    to ``int(state.step)`` after loading.

    Args:
      opt: as for ``state_from_torch``.
      state: ``opt``'s state (a chain's ``ChainState``; for the fused step pass
        ``step.state_to_tree(opt_state, params)``).
      params: the params tree the state belongs to.
      names: the keys in the order the torch optimizer holds its parameters (groups are
        ordered by their first key); default: group by group, each in params order.

    Returns:
      ``{"state": {id: {...}}, "param_groups": [...]}`` with every param-group entry the
      torch class sets on this torch version; tensors are copies.

    Raises:
      TypeError: ``opt`` has no torch.optim counterpart, or ``state`` is not its state.
      ValueError: ``state`` does not match ``params`` (names the leaf) or ``names`` does not
        list every key once.

    Example:
      >>> model = nn.Linear(3, 2)
      >>> apply, params, buffers = fdp.functionalize(model)
      >>> opt = fdp.optim.sgd(lr=0.1, momentum=0.9)
      >>> params, state = opt.update({k: torch.ones_like(v) for k, v in params.items()},
      ...                            opt.init(params), params)
      >>> torch_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
      >>> torch_opt.load_state_dict(fdp.optim.state_to_torch(opt, state, params))
      >>> torch_opt.state[model.bias]["momentum_buffer"]
      tensor([1., 1.])
    """
    name = "fdp.optim.state_to_torch"
    _, inner = _parts(opt, name)
    hyper, kernel = inner.form.hyper, inner.form.leaf_kernel
    if opt.form.parts:
        if not isinstance(state, ChainState):
            raise TypeError(f"{name}: state must be the chain's ChainState, got {type(state).__name__}"
                            + (" (for the fused step pass step.state_to_tree(opt_state, params))"
                               if hasattr(state, "buffers") else ""))
        state = state.optimizer
    if hasattr(state, "buffers") and hasattr(state, "transforms"):
        raise TypeError(f"{name}: a fused step's state is flat per bucket: pass "
                        "step.state_to_tree(opt_state, params)")
    step = getattr(state, "step", None)
    if not isinstance(step, Tensor) or step.dim() != 0:
        raise TypeError(f"{name}: state must be the state of opt (with a scalar step), got {type(state).__name__}")
    ps = ParamLeaves(params, name)
    keys = _tree.keys(ps.treedef)
    groups = kernel.groups(params)
    fields = {f: ps.like(getattr(state, f), f"state.{f}") for f in kernel.fields}
    order = _order(keys, groups, names, name)
    group_order: list[int] = []
    for i in order:
        if groups[i] not in group_order:
            group_order.append(groups[i])
    count = int(step)
    values = hyper.at(count)
    torch_state: dict[int, dict[str, Any]] = {}
    param_groups = []
    keeps_step = hyper.torch_class is not torch.optim.SGD
    emit = count > 0 or hyper.torch_class is torch.optim.Adagrad  # Adagrad makes its state at construction
    tid = 0
    for g in group_order:
        members = [i for i in order if groups[i] == g]
        ids = list(range(tid, tid + len(members)))
        tid += len(members)
        param_groups.append({**_torch_group(hyper, values, decays=g == 0), "params": ids})
        if not emit:
            continue
        for i, leaf in zip(ids, members):
            entry: dict[str, Any] = {f: fields[f][leaf].detach().clone() for f in kernel.fields}
            if keeps_step:  # fdp's count has torch's dtype for a per-parameter step
                entry["step"] = step.detach().clone()
            torch_state[i] = entry
    return {"state": torch_state, "param_groups": param_groups}
