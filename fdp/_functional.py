"""``functionalize``: an ``nn.Module`` as a pure function over (params, buffers)."""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.parameter import is_lazy

Tree = dict[str, torch.Tensor]
_shape = operator.attrgetter("shape")


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` is what torch.compile(module) returns: a wrapper holding the module as
    ``_orig_mod`` (its names get that prefix). Public as ``torch._dynamo.eval_frame.OptimizedModule``
    only, which is not imported here: importing torch._dynamo costs about a second, and a
    process that never imported it holds no compiled module."""
    frame = sys.modules.get("torch._dynamo.eval_frame")
    return frame is not None and isinstance(module, frame.OptimizedModule)


class Apply:
    """The pure forward of a module: ``apply(params, buffers, *args, **kwargs) -> (out, new_buffers)``.

    * Never mutates ``params`` or ``buffers``. Buffers the forward updates in place
      (BatchNorm's running statistics, ``num_batches_tracked``) are updated in fresh copies,
      which are returned as ``new_buffers``.
    * The model's **constants** (frozen parameters and non-persistent buffers, such as a
      causal mask) are in neither tree: ``apply`` holds them (``apply.constants``) and passes
      them to every call. They are not differentiated, synced or checkpointed with the state;
      ``apply.state_dict(params, buffers)`` gives the module's full state dict back.
    * Train/eval is part of the function, not hidden module state: ``apply`` runs in the mode
      the module was in when it was functionalized (``nn.Module`` starts in training mode);
      ``apply.eval()`` and ``apply.train()`` return the same function in the other mode.
    * ``params`` and ``buffers`` must have exactly the keys and shapes that
      ``functionalize`` returned (in any order); anything else raises ``ValueError`` naming
      the key.
    * Safe under ``torch.func.grad``, ``vmap`` and ``fdp.Reducer.grad``: pass the buffers as
      an argument of the transformed function, never capture them.

    Raises:
      ValueError: ``params`` or ``buffers`` lack a key, have an extra key, or a leaf has
        another shape than ``functionalize`` returned (names the key).
      TypeError: ``params`` or ``buffers`` is not a dict, or a value is not a tensor.

    Example:
      >>> net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
      >>> apply, params, buffers = fdp.functionalize(net)
      >>> out, new_buffers = apply(params, buffers, torch.randn(32, 8))
      >>> int(new_buffers["1.num_batches_tracked"]), int(buffers["1.num_batches_tracked"])
      (1, 0)
      >>> out, same = apply.eval()(params, buffers, torch.randn(32, 8))  # statistics used, not updated
      >>> torch.equal(same["1.running_mean"], buffers["1.running_mean"])
      True
    """

    def __init__(
        self,
        module: nn.Module,
        param_shapes: dict[str, torch.Size],
        buffer_shapes: dict[str, torch.Size],
        constants: Tree,
        training: bool,
        forward: nn.Module | None = None,
    ) -> None:
        self.module = module
        # What a call runs: the module, or the torch.compile wrapper it came in (whose
        # compiled forward reads the same parameter dicts the swap below fills).
        self._forward = module if forward is None else forward
        self.training = training
        self._param_shapes = param_shapes
        self._buffer_shapes = buffer_shapes
        self._constants = constants
        self._slots, self._first = _slots(module)

    def train(self, mode: bool = True) -> Apply:
        """The same function in training (``mode=True``) or evaluation mode."""
        return Apply(self.module, self._param_shapes, self._buffer_shapes, self._constants, bool(mode),
                     self._forward)

    def eval(self) -> Apply:
        """The same function in evaluation mode (BatchNorm uses its running statistics)."""
        return self.train(False)

    @property
    def constants(self) -> Tree:
        """The model's constants, by first name: frozen parameters, then non-persistent buffers.

        A new dict each time (the tensors are shared with the module, not copied).
        """
        return dict(self._constants)

    def with_constants(self, constants: Tree) -> Apply:
        """The same function with other values for its constants (same keys and shapes).

        Constants are not sent with ``params`` and ``buffers``. When ranks may have built
        different frozen weights (a random init without a common seed), make them agree once,
        as DDP's constructor does for every parameter (see the example).

        Raises:
          ValueError: ``constants`` lacks a key, has an extra key, or a leaf has another
            shape (names the key).
          TypeError: ``constants`` is not a dict of tensors.

        Example:
          >>> apply, params, buffers = fdp.functionalize(nn.Linear(2, 2), frozen=["bias"])
          >>> list(params), list(apply.constants)
          (['weight'], ['bias'])
          >>> apply = apply.with_constants(fdp.broadcast(apply.constants, src=0))
        """
        _check("constants", constants, {k: v.shape for k, v in self._constants.items()})
        return Apply(self.module, self._param_shapes, self._buffer_shapes,
                     {k: constants[k] for k in self._constants}, self.training, self._forward)

    def state_dict(self, params: Tree, buffers: Tree) -> dict[str, torch.Tensor]:
        """The module's ``state_dict`` for these params and buffers (and the constants).

        Every key ``module.state_dict()`` has, in its order: tied parameters under each of
        their names, frozen parameters, persistent buffers (non-persistent ones are not part
        of a module's state dict). So ``model.load_state_dict(apply.state_dict(params,
        buffers))`` loads the trained state into a module of the same class, strictly. The
        tensors are shared, not copied.

        Args:
          params: the trained parameters (the keys ``functionalize`` returned, any order).
          buffers: the buffers (likewise).

        Returns:
          ``dict[str, Tensor]`` keyed like ``module.state_dict()``.

        Example:
          >>> apply, params, buffers = fdp.functionalize(nn.Linear(2, 2))
          >>> model = nn.Linear(2, 2)
          >>> model.load_state_dict(apply.state_dict(params, buffers))
          <All keys matched successfully>
          >>> torch.equal(model.weight, params["weight"])
          True
        """
        _check("params", params, self._param_shapes)
        _check("buffers", buffers, self._buffer_shapes)
        values = {**self._constants, **params, **buffers}
        out = {}
        for key, v in self.module.state_dict(keep_vars=True).items():
            first = self._first.get(key)
            out[key] = values[first] if first in values else v  # extra state: the module's own
        return out

    def __call__(self, params: Tree, buffers: Tree, *args: Any, **kwargs: Any) -> tuple[Any, Tree]:
        units = getattr(params, "__fdp_units__", None)
        if units is not None:  # fully sharded params: gathered unit by unit (fdp/_fused/units.py)
            return self._call_units(units(), buffers, args, kwargs)
        _check("params", params, self._param_shapes)
        _check("buffers", buffers, self._buffer_shapes)
        new_buffers = {k: v.clone() for k, v in buffers.items()}
        if self._forward.training != self.training or self.module.training != self.training:
            self._forward.train(self.training)
        if torch.compiler.is_compiling():  # dynamo knows functional_call; keep to it there
            out = functional_call(
                self._forward, (params, new_buffers, self._constants), args, kwargs,
                tie_weights=True, strict=False,
            )
            return out, new_buffers
        # The same swap functional_call does, minus its per-call bookkeeping: each tensor is
        # put straight into the dicts that hold the module's own (tied names included) and
        # the originals are put back afterwards: a small fraction of functional_call's cost
        # on many small leaves (docs/performance.md, "functionalize's swap").
        saved = []
        try:
            for tree in (params, new_buffers, self._constants):
                for name, t in tree.items():
                    for owner, key in self._slots[name]:
                        saved.append((owner, key, owner[key]))
                        owner[key] = t
            out = self._forward(*args, **kwargs)
        finally:
            for owner, key, old in reversed(saved):
                owner[key] = old
        return out, new_buffers

    def _call_units(self, view: Any, buffers: Tree, args: tuple, kwargs: dict) -> tuple[Any, Tree]:
        """The forward over fully sharded params (``view``: their ``UnitsView``): every unit
        leaf's place holds a meta placeholder except while its unit's module runs, when the
        real leaf (its unit just gathered) is there; the root's leaves are there throughout."""
        try:
            _check("buffers", buffers, self._buffer_shapes)
            if torch.compiler.is_compiling():
                raise RuntimeError("fdp: fully sharded params cannot run under torch.compile (each unit is gathered "
                                   "by a hook around its module's forward)")
            by_unit, modules = self._unit_slots(view)
            new_buffers = {k: v.clone() for k, v in buffers.items()}
            if self._forward.training != self.training or self.module.training != self.training:
                self._forward.train(self.training)
            saved: list[tuple[dict, str, Any]] = []
            handles = []
            tensors, placeholders = view.tensors, view.placeholders
            try:
                for tree in (new_buffers, self._constants):
                    for name, t in tree.items():
                        for owner, key in self._slots[name]:
                            saved.append((owner, key, owner[key]))
                            owner[key] = t
                for slots in by_unit:
                    for owner, key, i in slots:
                        saved.append((owner, key, owner[key]))
                        owner[key] = placeholders[i]
                for u, module in modules:
                    handles.append(module.register_forward_pre_hook(_enter_unit(view, u, by_unit[u], tensors)))
                    handles.append(module.register_forward_hook(_exit_unit(view, u, by_unit[u], placeholders)))
                if view.root is not None:
                    view.enter(view.root)
                    for owner, key, i in by_unit[view.root]:
                        owner[key] = tensors[i]
                out = self._forward(*args, **kwargs)
            finally:
                for h in handles:
                    h.remove()
                for owner, key, old in reversed(saved):
                    owner[key] = old
            return out, new_buffers
        finally:
            view.done()

    def _unit_slots(self, view: Any) -> tuple[list[list[tuple[dict, str, int]]], list[tuple[int, nn.Module]]]:
        """Per unit, every (owner dict, key, leaf) its leaves are held in; and each unit's
        module (not the root's). Checked once per layout: the keys and shapes are the ones
        functionalize returned, and a tied param's names are all inside its unit."""
        cached = getattr(self, "_units_cache", None)
        if cached is not None and cached[0] is view.layout:
            return cached[1]
        want = {k: tuple(s) for k, s in self._param_shapes.items()}
        got = {k: tuple(p.shape) for k, p in zip(view.keys, view.placeholders)}
        if want != got:
            _check("params", dict(zip(view.keys, view.placeholders)), self._param_shapes)
        by_unit: list[list[tuple[dict, str, int]]] = [[] for _ in view.names]
        for i, (k, u) in enumerate(zip(view.keys, view.unit_of)):
            prefix = view.names[u]
            for alias, first in self._first.items():
                if first == k and prefix and not (alias == prefix or alias.startswith(prefix + ".")):
                    raise ValueError(
                        f"fdp: param {k!r} of unit {prefix!r} is also the module's {alias!r}, outside that unit: a unit "
                        "is gathered only while its module runs, so a tied param must lie inside one unit (or in "
                        "the root: leave it out of units)")
            for owner, key in self._slots[k]:
                by_unit[u].append((owner, key, i))
        modules = []
        for u, prefix in enumerate(view.names):
            if prefix:
                try:
                    modules.append((u, self.module.get_submodule(prefix)))
                except AttributeError as e:
                    raise ValueError(f"fdp: unit {prefix!r} is not a module of {type(self.module).__name__}") from e
        self._units_cache = (view.layout, (by_unit, modules))
        return by_unit, modules

    def __repr__(self) -> str:
        mode = "train" if self.training else "eval"
        return f"fdp.Apply({type(self.module).__name__}, {mode}, {len(self._param_shapes)} params)"


def _enter_unit(view: Any, u: int, slots: list[tuple[dict, str, int]], tensors: list[torch.Tensor]) -> Any:
    def pre_hook(module: nn.Module, args: Any) -> None:
        view.enter(u)
        for owner, key, i in slots:
            owner[key] = tensors[i]
    return pre_hook


def _exit_unit(view: Any, u: int, slots: list[tuple[dict, str, int]], placeholders: list[torch.Tensor]) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for owner, key, i in slots:
            owner[key] = placeholders[i]
        view.exit(u, output)
    return hook


def _slots(module: nn.Module) -> tuple[dict[str, list[tuple[dict, str]]], dict[str, str]]:
    """For each parameter/buffer (first name), every (owner dict, key) that holds it: a tied
    tensor is held under several names, and all of them must see the replacement. Also every
    name's first name (the key it has in params, buffers or the constants)."""
    slots: dict[int, list[tuple[dict, str]]] = {}
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for kind in ("_parameters", "_buffers"):
        named = (module.named_parameters(remove_duplicate=False) if kind == "_parameters"
                 else module.named_buffers(remove_duplicate=False))
        for name, t in named:
            owner, _, key = name.rpartition(".")
            alias[name] = first.setdefault(id(t), name)
            slots.setdefault(id(t), []).append((getattr(module.get_submodule(owner), kind), key))
    return {first[i]: s for i, s in slots.items()}, alias


def _check(what: str, tree: Any, shapes: dict[str, torch.Size]) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(f"fdp: apply expects `{what}` to be a dict of tensors, got {type(tree).__name__}")
    if tree.keys() != shapes.keys():
        missing = [k for k in shapes if k not in tree]
        extra = [k for k in tree if k not in shapes]
        if missing:
            raise ValueError(f"fdp: apply: `{what}` is missing key {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        raise ValueError(f"fdp: apply: `{what}` has unexpected key {extra[0]!r}; "
                         f"expected only the keys functionalize returned")
    if not torch.compiler.is_compiling():  # dynamo cannot call attrgetter objects
        try:  # the per-call case: one C-level pass over the values (same key order as shapes)
            if list(map(_shape, tree.values())) == list(shapes.values()) and list(tree) == list(shapes):
                return
        except AttributeError:  # a value that is not a tensor: named below
            pass
    for k, shape in shapes.items():
        t = tree[k]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fdp: apply: `{what}[{k!r}]` is a {type(t).__name__}, expected a Tensor")
        if t.shape != shape:
            raise ValueError(
                f"fdp: apply: `{what}[{k!r}]` has shape {tuple(t.shape)}, expected {tuple(shape)}"
            )


def _matches(name: str, patterns: Iterable[str]) -> str | None:
    for p in patterns:
        if name == p or name.startswith(p + "."):
            return p
    return None


def _non_persistent(module: nn.Module) -> set[str]:
    """Full names of the buffers registered with ``persistent=False`` (not in a state dict)."""
    return {f"{prefix}.{b}" if prefix else b
            for prefix, m in module.named_modules(remove_duplicate=False)
            for b in m._non_persistent_buffers_set}


def functionalize(module: nn.Module, *, frozen: Iterable[str] = ()) -> tuple[Apply, Tree, Tree]:
    """Split a module into a pure function and its state.

    Args:
      module: the model. It becomes a stateless template: fdp never reads its parameters
        again, and ``params`` initially share storage with them (no copy).
      frozen: parameter names (or module prefixes such as ``"encoder"``) that are not
        trained. They become **constants** of ``apply`` (``apply.constants``): not
        differentiated, bucketed, all-reduced or synced, and not in ``buffers``. Parameters
        with ``requires_grad=False`` are frozen too (DDP likewise leaves them out of the
        reduction). A tied parameter is one tensor: any of its names freezes it (``"head"``
        freezes ``wte.weight`` when ``head.weight`` is ``wte.weight``).

    Returns:
      ``(apply, params, buffers)``: ``params`` is a ``dict[str, Tensor]`` of trainable
      parameters in registration order; tied (shared) parameters appear once, under their
      first name, and stay tied. ``buffers`` holds the module's persistent buffers (the
      state its forward may update, such as BatchNorm statistics), in registration order.
      Frozen parameters and non-persistent buffers (``register_buffer(...,
      persistent=False)``, e.g. a causal mask) are constants the model reads but never
      changes: ``apply`` holds them, so they cost nothing per step and are not saved with
      ``params``/``buffers``; they come back with the module (they are its own tensors) or
      from ``apply.state_dict(params, buffers)``. If ranks may have built different frozen
      weights, make them agree once: ``apply = apply.with_constants(fdp.broadcast(apply.constants))``.
      ``apply(params, buffers, *args, **kwargs)`` returns ``(out, new_buffers)``; see
      ``fdp.Apply``.

    A ``torch.compile``-d module (``torch.compile(model)``) is unwrapped for its names: the
    keys are the model's own (``"0.weight"``, not ``"_orig_mod.0.weight"``), and
    ``apply.state_dict`` loads into the uncompiled model. ``apply`` still calls the compiled
    module, so its forward stays compiled.

    Raises:
      ValueError: the module has uninitialised (lazy) parameters, no trainable parameters,
        or a ``frozen`` name matches no parameter.
      TypeError: ``module`` is not an ``nn.Module``.

    Example:
      >>> net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
      >>> apply, params, buffers = fdp.functionalize(net, frozen=["3"])
      >>> list(params), list(buffers)
      (['0.weight', '0.bias', '1.weight', '1.bias'], ['1.running_mean', '1.running_var', '1.num_batches_tracked'])
      >>> list(apply.constants)
      ['3.weight', '3.bias']
      >>> out, buffers = apply(params, buffers, torch.randn(32, 8))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fdp.functionalize expects an nn.Module, got {type(module).__name__}")
    forward = None
    if _compiled(module):  # torch.compile(model): name and swap in the model itself
        forward, module = module, module._orig_mod
    frozen = tuple(frozen) if not isinstance(frozen, str) else (frozen,)
    named = list(module.named_parameters())  # tied parameters appear once (first name)
    for name, p in named:
        if is_lazy(p):
            raise ValueError(
                f"fdp.functionalize: parameter {name!r} of {type(module).__name__} is "
                "uninitialised (a lazy module); run one forward pass on example input first"
            )
    # Match `frozen` against every name of a parameter, tied aliases included.
    first_of: dict[int, str] = {}
    used, frozen_ids = set(), set()
    for name, p in module.named_parameters(remove_duplicate=False):
        first_of.setdefault(id(p), name)
        hit = _matches(name, frozen)
        if hit is not None:
            used.add(hit)
            frozen_ids.add(id(p))
    unused = [f for f in frozen if f not in used]
    if unused:
        raise ValueError(
            f"fdp.functionalize: frozen name {unused[0]!r} matches no parameter of "
            f"{type(module).__name__} (parameters: {[n for n, _ in named][:8]}...)"
        )
    params: Tree = {}
    constants: Tree = {}
    for name, p in named:
        if id(p) in frozen_ids or not p.requires_grad:
            constants[name] = p.detach()
        else:
            params[name] = p.detach()
    if not params:
        what = "no parameters" if not named else "no trainable parameters (all are frozen)"
        raise ValueError(f"fdp.functionalize: {type(module).__name__} has {what}; there is nothing to train")
    skip = _non_persistent(module)
    buffers: Tree = {}
    for name, b in module.named_buffers():
        (constants if name in skip else buffers)[name] = b.detach()
    apply = Apply(
        module,
        {k: v.shape for k, v in params.items()},
        {k: v.shape for k, v in buffers.items()},
        constants,
        module.training,
        forward,
    )
    return apply, params, buffers


def units(module: nn.Module, *types: type) -> list[str]:
    """The names of ``module``'s submodules that are instances of ``types``, in registration
    order: the ``units=`` of ``fdp.Reducer(params, shard="params", units=...)`` (as FSDP2 users
    call ``fully_shard`` on each block).

    Raises:
      ValueError: no submodule is an instance of ``types`` (or no type is given).

    Example:
      >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
      >>> fdp.units(net, nn.Linear)
      ['0', '2']
    """
    if not types or not all(isinstance(t, type) for t in types):
        raise ValueError(f"fdp.units: give one or more module classes (e.g. fdp.units(model, Block)), got {types!r}")
    if _compiled(module):
        module = module._orig_mod
    names = [name for name, m in module.named_modules() if name and isinstance(m, types)]
    if not names:
        raise ValueError(f"fdp.units: {type(module).__name__} has no submodule of type "
                         f"{', '.join(t.__name__ for t in types)}")
    return names
