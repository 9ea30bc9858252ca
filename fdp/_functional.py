"""``functionalize``: an ``nn.Module`` as a pure function over (params, buffers)."""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.parameter import is_lazy

from . import _internals, _tree
from ._protocols import GathersUnits, UnitsView, units_of

Tree = dict[str, torch.Tensor]
_shape = operator.attrgetter("shape")


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
        home: _Home | None = None,
        probe: tuple[str, torch.dtype] | None = None,
        cast_inputs: bool = True,
    ) -> None:
        self.module = module
        # Mixed precision: (the first param's key, its own dtype); params given in another
        # floating dtype make the call cast its floating inputs to it (``cast_inputs``).
        self._probe, self._cast = probe, bool(cast_inputs)
        # What a call runs: the module, or the torch.compile wrapper it came in (whose
        # compiled forward reads the same parameter dicts the swap below fills).
        self._forward = module if forward is None else forward
        self.training = training
        self._param_shapes = param_shapes
        self._buffer_shapes = buffer_shapes
        self._constants = constants
        # A constant on the meta device (a model built there) cannot run: named at the call.
        self._on_meta = next((k for k, v in constants.items() if isinstance(v, torch.Tensor) and v.is_meta), None)
        # Where each tensor is held, found once (when functionalize ran): a module changed
        # later (``model.to("meta")`` unties shared parameters) is still filled right.
        self._home = _Home(module) if home is None else home

    def train(self, mode: bool = True) -> Apply:
        """The same function in training (``mode=True``) or evaluation mode."""
        return Apply(self.module, self._param_shapes, self._buffer_shapes, self._constants, bool(mode),
                     self._forward, self._home, self._probe, self._cast)

    def cast_inputs(self, enabled: bool = True) -> Apply:
        """The same function, casting (``True``, the default) or not (``False``) its floating-point
        tensor inputs to the params' dtype when it is given params in another dtype than the
        module's own: the bf16 params of a step with ``param_dtype=torch.bfloat16`` (FSDP2's
        ``MixedPrecisionPolicy(cast_forward_inputs=True)``). Integer inputs (token ids) are
        never cast; nor is anything the module makes itself."""
        return Apply(self.module, self._param_shapes, self._buffer_shapes, self._constants, self.training,
                     self._forward, self._home, self._probe, enabled)

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
                     {k: constants[k] for k in self._constants}, self.training, self._forward, self._home,
                     self._probe, self._cast)

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
        first = self._home.first
        out = {}
        for key, v in self.module.state_dict(keep_vars=True).items():
            name = first.get(clean_name(key))
            out[key] = values[name] if name in values else v  # extra state: the module's own
        return out

    def __call__(self, params: Tree, buffers: Tree, *args: Any, **kwargs: Any) -> tuple[Any, Tree]:
        if self._on_meta is not None:
            self._refuse_meta()
        if type(params) is not dict:
            view = units_of(params)
            if view is not None:  # fully sharded params: gathered unit by unit (fdp/_units)
                return self._call_units(view, buffers, args, kwargs)
        compiling = torch.compiler.is_compiling()
        if compiling:  # (checked at trace time against this Apply's shapes taken as constants)
            _traced_check(self, "params", params)
            _traced_check(self, "buffers", buffers)
        else:
            _check("params", params, self._param_shapes)
            _check("buffers", buffers, self._buffer_shapes)
        if self._cast and self._probe is not None:
            dtype = params[self._probe[0]].dtype
            if dtype != self._probe[1]:
                args, kwargs = _floating_to(dtype, args, kwargs)
        new_buffers = {k: v.clone() for k, v in buffers.items()}
        if self._forward.training != self.training or self.module.training != self.training:
            self._forward.train(self.training)
        if compiling:  # dynamo knows functional_call; keep to it there
            # Every other name of a tied tensor given too: functional_call ties only what the
            # module still ties, and ``model.to("meta")`` unties (the head would be its meta copy).
            ties = {name: params[f] if f in params else new_buffers[f]
                    for name, f in _ties(self._home) if f in params or f in new_buffers}
            out = functional_call(
                self._forward, (params, ties, new_buffers, self._constants), args, kwargs,
                tie_weights=True, strict=False,
            )
            return out, new_buffers
        # The same swap functional_call does, minus its per-call bookkeeping: each tensor is
        # put straight into the dicts that hold the module's own (tied names included) and
        # the originals are put back afterwards: a small fraction of functional_call's cost
        # on many small leaves (docs/measurements.md, "Per-leaf costs behind design choices").
        call = _Call(self._home, (params, new_buffers, self._constants))
        return self._home.run(call, self._forward, args, kwargs), new_buffers

    @contextlib.contextmanager
    def bound(self, params: Tree, buffers: Tree) -> Iterator[nn.Module]:
        """The module itself with ``params`` and ``buffers`` in its places, for code that calls
        the module rather than ``apply`` (HF's ``generate``, an exporter, a metrics library)::

            with torch.no_grad(), apply.eval().bound(params, buffers) as model:
                ids = model.generate(prompt, max_new_tokens=20)

        With ``fdp.ShardedParams`` every unit is gathered just before its module runs and
        freed after, as in ``apply``, so every rank must run the same calls (the same inputs;
        for sampling, the same seed), and the block runs under ``torch.no_grad()``. The module's own tensors are back when the block ends;
        buffers are bound as copies (the caller's are not written).

        Raises:
          ValueError: ``params`` or ``buffers`` do not match (names the leaf).
          RuntimeError: a constant is still on the meta device.
        """
        if self._on_meta is not None:
            self._refuse_meta()
        _check("buffers", buffers, self._buffer_shapes)
        sharded = type(params) is not dict and isinstance(params, GathersUnits)
        # (gathered units are for inference only: the block runs without autograd)
        with torch.no_grad() if sharded else contextlib.nullcontext():
            view = units_of(params) if sharded else None
            new_buffers = {k: v.clone() for k, v in buffers.items()}
            if view is not None:
                by_unit, modules = self._unit_slots(view)
                call: _Call = _UnitsCall(self._home, (new_buffers, self._constants), view, by_unit, modules)
            else:
                _check("params", params, self._param_shapes)
                call = _Call(self._home, (params, new_buffers, self._constants))
            if self._home.active is not None:
                self._home.settle()
            if self._forward.training != self.training or self.module.training != self.training:
                self._forward.train(self.training)
            saved = call.bind()
            try:
                yield self._forward
            finally:
                _put_back(call, saved)
                if view is not None:
                    view.done()

    def _refuse_meta(self) -> None:
        raise RuntimeError(
            f"fdp.Apply: its constant {self._on_meta!r} (a frozen parameter or non-persistent buffer) is on the "
            "meta device (the model was built there); give the constants their values first: "
            "apply = apply.with_constants(init.materialize(apply.constants)) with init = fdp.deferred_init(model)")

    def _call_units(self, view: UnitsView, buffers: Tree, args: tuple, kwargs: dict) -> tuple[Any, Tree]:
        """The forward over fully sharded params (``view``: their ``UnitsView``): every unit
        leaf's place holds a meta placeholder except while its unit's module runs, when the
        real leaf (its unit just gathered) is there; the root's leaves are there throughout."""
        try:
            _check("buffers", buffers, self._buffer_shapes)
            if torch.compiler.is_compiling():
                raise RuntimeError("fdp: fully sharded params cannot run under torch.compile (each unit is gathered "
                                   "by a hook around its module's forward)")
            by_unit, modules = self._unit_slots(view)
            if self._cast and self._probe is not None and view.placeholders:
                dtype = view.placeholders[0].dtype  # (the first param's, gathered in param_dtype)
                if dtype != self._probe[1]:
                    args, kwargs = _floating_to(dtype, args, kwargs)
            new_buffers = {k: v.clone() for k, v in buffers.items()}
            if self._forward.training != self.training or self.module.training != self.training:
                self._forward.train(self.training)
            call = _UnitsCall(self._home, (new_buffers, self._constants), view, by_unit, modules)
            return self._home.run(call, self._forward, args, kwargs), new_buffers
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
        slots, first = self._home.slots, self._home.first
        by_unit: list[list[tuple[dict, str, int]]] = [[] for _ in view.names]
        for i, (k, u) in enumerate(zip(view.keys, view.unit_of)):
            prefix = view.names[u]
            for alias, name in first.items():
                if name == k and prefix and not (alias == prefix or alias.startswith(prefix + ".")):
                    raise ValueError(
                        f"fdp: param {k!r} of unit {prefix!r} is also the module's {alias!r}, outside that unit: a unit "
                        "is gathered only while its module runs, so a tied param must lie inside one unit (or in "
                        "the root: leave it out of units)")
            for owner, key in slots[k]:
                by_unit[u].append((owner, key, i))
        modules = []
        by_name = named_modules(self.module)
        for u, prefix in enumerate(view.names):
            if prefix:
                if prefix not in by_name:
                    raise ValueError(f"fdp: unit {prefix!r} is not a module of {type(self.module).__name__}")
                modules.append((u, by_name[prefix]))
        self._units_cache = (view.layout, (by_unit, modules))
        return by_unit, modules

    def __repr__(self) -> str:
        mode = "train" if self.training else "eval"
        return f"fdp.Apply({type(self.module).__name__}, {mode}, {len(self._param_shapes)} params)"


# [Note: bindings outlive the call]
# ``apply`` puts a call's tensors into the module's own dicts for its forward. torch may run
# part of that forward again later, inside the backward: ``torch.utils.checkpoint``
# (non-reentrant; at a call site, inside a module, through ``checkpoint_wrapper``, composable
# ``checkpoint``, ``context_fn`` or HF's ``activation_checkpointing_enable``) recomputes a
# region from its saved inputs and reads the module's dicts *then*. So:
# * inside an fdp gradient (``BINDINGS.depth``: its forward and backward), a forward leaves the
#   call's tensors bound (``_Home.active``) until the gradient is done or another call that
#   records a graph starts: a recompute reads what its forward read whenever one call's graph
#   is differentiated at a time, whatever form of checkpointing ran (HF's ``offload=True``
#   wraps checkpoint in ``save_on_cpu``, so fdp's hooks never see its inputs). A call without
#   a graph (an EMA teacher's, an evaluation's) puts back what was there. Outside fdp's
#   gradients (a user's own backward) every call puts the module's own tensors back at once.
# * where the module may checkpoint (``_may_checkpoint``: its classes' code names checkpoint,
#   a checkpoint wrapper or composable checkpoint is in it), the forward also runs under
#   saved-tensor hooks whose unpack, when checkpoint unpacks a region's inputs to run it
#   again, binds that call's tensors once more (``_Home.rebind``) until the backward ends
#   (autograd's end-of-graph callback) or the next call: exact even when several calls with
#   other params precede one backward (a loss that runs the model on perturbed params), and
#   in a user's own backward. The hooks cost a Python call per saved tensor, so a model that cannot
#   checkpoint runs without them; fdp's hooks call a user's own (``save_on_cpu`` around
#   ``apply``), which keep working.
# With fully sharded params a rebinding puts the gathered units' leaves (in ``param_dtype``)
# in place and the unit hooks back, so a unit the recompute enters is gathered again.
# Reentrant checkpointing cannot run in fdp's backward (``autodiff.reentrant_refused``).


class _Home:
    """What every variant of one ``Apply`` (train/eval, other constants) shares about its
    module: where each tensor is held, and the call bound outside its forward (see the note)."""

    __slots__ = ("module", "slots", "first", "active", "displaced", "queued", "hooked", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots, self.first = _slots(module)
        self.active: _Call | None = None  # the call still bound after its forward, or again
        self.displaced: list[tuple[dict, str, Any]] = []  # what it replaced: the module's own
        self.queued = False  # ``settle`` waits for the end of the running backward
        self.hooked: bool | None = None  # forwards under saved-tensor hooks (found at the first graph)

    def run(self, call: _Call, forward: nn.Module, args: tuple, kwargs: dict) -> Any:
        """``forward(*args, **kwargs)`` with ``call``'s tensors bound; they stay bound after it
        when it recorded a graph (see the note)."""
        graph = _internals.records_plain_graph()
        if graph:
            if self.active is not None:
                self.settle()
            if self.hooked is None:
                self.hooked = _may_checkpoint(self.module)
        paused = None if graph else self.active  # (its unit hooks must not fire in this forward)
        if paused is not None:
            paused.unhook()
        saved = call.bind()
        try:
            hooks = call.saving() if graph and self.hooked else None
            if hooks is None:
                out = forward(*args, **kwargs)
            else:
                with hooks:
                    out = forward(*args, **kwargs)
        except BaseException:
            _put_back(call, saved)
            if paused is not None:
                paused.hook()
            raise
        if graph and BINDINGS.depth:
            self.active, self.displaced = call, saved
            BINDINGS.homes.add(self)
        else:
            _put_back(call, saved)
            if paused is not None:
                paused.hook()
        return out

    def rebind(self, call: _Call) -> None:
        """Bind ``call``'s tensors again: torch is about to recompute part of its forward."""
        active = self.active
        if active is None:
            self.displaced = [(owner, key, owner[key]) for owner, key, _ in call.entries]
        elif active is not call:
            active.unhook()
        elif not call.refresh:
            return
        self.active = call
        call.rebind()

    def unpacked(self) -> None:
        """A tensor saved in a call's forward is being used by its backward: settle when it
        ends."""
        self.queued = _internals.at_backward_end(self.settle)

    def settle(self) -> None:
        """Put the module's own tensors back (a backward is over, or a new call starts)."""
        self.queued = False
        active, self.active = self.active, None
        if active is not None:
            displaced, self.displaced = self.displaced, []
            if active.hooks:
                active.unhook()
            for owner, key, old in reversed(displaced):
                owner[key] = old


class _Bound(threading.local):
    """On this thread (a simulated rank's thread settles only its own): how many fdp gradients
    are running (their forwards leave the call's tensors bound), and the homes whose module
    holds a call's tensors after its forward."""

    def __init__(self) -> None:
        self.depth = 0
        self.homes: weakref.WeakSet[_Home] = weakref.WeakSet()


# The forward and backward of an fdp gradient raise ``BINDINGS.depth`` while they run: a
# forward in it leaves its call's tensors bound in the module for the backward's
# recomputations, and ``bindings_released`` puts every module's own tensors back when the
# outermost ends (see the note "bindings outlive the call"). (A counter, not a context
# manager: it is on every step's path.)
BINDINGS = _Bound()


def bindings_released() -> None:
    """Put back every module's own tensors that a forward on this thread left bound."""
    homes = BINDINGS.homes
    for home in list(homes):
        home.settle()
    homes.clear()


_CHECKPOINT_NAMES: dict[type, bool] = {}


def _names_checkpoint(code: Any) -> bool:
    return (any("checkpoint" in n for n in code.co_names)
            or any(_names_checkpoint(c) for c in code.co_consts if hasattr(c, "co_names")))


def _class_may_checkpoint(cls: type) -> bool:
    """Whether any function defined on ``cls`` or its bases (nn.Module's own left out) names
    something with "checkpoint" in it: ``checkpoint(...)``, ``checkpoint_sequential``, timm's
    ``checkpoint_seq``, HF's ``_gradient_checkpointing_func``, a wrapper's ``checkpoint_fn``."""
    got = _CHECKPOINT_NAMES.get(cls)
    if got is None:
        got = False
        for base in cls.__mro__:
            if base is nn.Module or base is object:
                continue
            for value in vars(base).values():
                fn = getattr(value, "__func__", value)
                code = getattr(fn, "__code__", None)
                if code is not None and _names_checkpoint(code):
                    got = True
        _CHECKPOINT_NAMES[cls] = got
    return got


def _may_checkpoint(module: nn.Module) -> bool:
    """Whether some forward of ``module`` may run a checkpointed region: a class whose code
    names checkpoint, or a module with a hook from torch's composable ``checkpoint``."""
    for m in module.modules():
        if _class_may_checkpoint(type(m)):
            return True
        for hook in _internals.module_hooks(m):
            if "checkpoint" in getattr(hook, "__module__", ""):
                return True
    return False


def _floating_to(dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every floating-point tensor in them cast to ``dtype``."""
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    return _tree.tree_map(cast, (args, kwargs))


def _put_back(call: _Call, saved: list[tuple[dict, str, Any]]) -> None:
    if call.hooks:
        call.unhook()
    for owner, key, old in reversed(saved):
        owner[key] = old


class _Call:
    """One call's tensors in the module's slots: bound for its forward, and again for each
    recomputation of part of it inside the backward."""

    __slots__ = ("home", "trees", "_entries")
    refresh = False  # whether a rebinding must be redone when this call is bound already
    hooks = False  # whether it puts hooks on modules (``hook``, ``unhook``)

    def __init__(self, home: _Home, trees: tuple[Tree, ...]) -> None:
        self.home, self.trees, self._entries = home, trees, None

    @property
    def entries(self) -> list[tuple[dict, str, Any]]:
        """Every (owner dict, key, tensor) this call binds (made when a rebinding needs it)."""
        if self._entries is None:
            slots = self.home.slots
            self._entries = [(owner, key, t) for tree in self.trees for name, t in tree.items()
                             for owner, key in slots[name]]
        return self._entries

    def bind(self) -> list[tuple[dict, str, Any]]:
        """Bind for the forward; returns what was there, to put back."""
        saved = []
        slots = self.home.slots
        for tree in self.trees:
            for name, t in tree.items():
                for owner, key in slots[name]:
                    saved.append((owner, key, owner[key]))
                    owner[key] = t
        return saved

    def rebind(self) -> None:
        for owner, key, t in self.entries:
            owner[key] = t

    def hook(self) -> None:
        pass

    def unhook(self) -> None:
        pass

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks of this call's forward, which records a plain graph (see the
        note). Their unpack runs once per saved tensor in the backward: it is kept to two tests."""
        home, outer = self.home, _internals.saved_tensors_hooks_top()
        recompute = _internals.unpacked_for_recompute
        if outer is None:
            def unpack(packed: torch.Tensor) -> torch.Tensor:
                if not home.queued:
                    home.unpacked()
                if recompute():
                    home.rebind(self)
                return packed
            # (detach: what is kept must not hold the tensor itself, which may hold the graph)
            return torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, unpack)
        outer_pack, outer_unpack = outer

        def unpack_outer(packed: Any) -> torch.Tensor:
            if not home.queued:
                home.unpacked()
            if recompute():
                home.rebind(self)
            return outer_unpack(packed)
        return torch.autograd.graph.saved_tensors_hooks(outer_pack, unpack_outer)


class _UnitsCall(_Call):
    """A call over fully sharded params: the unit leaves' places hold placeholders except
    while their unit's module runs (hooks on those modules); the root's are real throughout.
    Bound again for a recomputation: the units gathered then are real, the others
    placeholders, and the unit hooks are there (a unit the recompute enters is gathered)."""

    __slots__ = ("view", "by_unit", "modules", "handles")
    refresh = True  # (which units are gathered changes as the backward goes)
    hooks = True

    def __init__(self, home: _Home, trees: tuple[Tree, ...], view: Any,
                 by_unit: list[list[tuple[dict, str, int]]], modules: list[tuple[int, nn.Module]]) -> None:
        super().__init__(home, trees)
        self.view, self.by_unit, self.modules = view, by_unit, modules
        self.handles: list[Any] = []

    @property
    def entries(self) -> list[tuple[dict, str, Any]]:
        if self._entries is None:
            placeholders = self.view.placeholders
            self._entries = super().entries + [(owner, key, placeholders[i]) for slots in self.by_unit
                                               for owner, key, i in slots]
        return self._entries

    def bind(self) -> list[tuple[dict, str, Any]]:
        saved = super().bind()
        placeholders = self.view.placeholders
        for slots in self.by_unit:
            for owner, key, i in slots:
                saved.append((owner, key, owner[key]))
                owner[key] = placeholders[i]
        self.hook()
        view = self.view
        if view.root is not None:
            view.enter(view.root)
            for owner, key, i in self.by_unit[view.root]:
                owner[key] = view.tensors[i]
        return saved

    def rebind(self) -> None:
        view = self.view
        view.recomputing()
        super().rebind()
        tensors = view.tensors
        for u, slots in enumerate(self.by_unit):
            if u == view.root or view.gathered(u):
                for owner, key, i in slots:
                    owner[key] = tensors[i]
        self.hook()

    def hook(self) -> None:
        if self.handles:
            return
        view, by_unit = self.view, self.by_unit
        for u, module in self.modules:
            self.handles.append(module.register_forward_pre_hook(_enter_unit(view, u, by_unit[u], view.tensors)))
            self.handles.append(module.register_forward_hook(_exit_unit(view, u, by_unit[u], view.placeholders)))

    def unhook(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()


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


def clean_name(name: str) -> str:
    """A parameter's, buffer's or module's name without the wrappers' own segments: a block
    wrapped by ``checkpoint_wrapper`` or ``torch.compile`` keeps the names it has unwrapped
    (``blocks.0.fc.weight``, not ``blocks.0._checkpoint_wrapped_module.fc.weight``), as the
    wrappers' own state-dict hooks name it, so keys match checkpoints and the unwrapped model."""
    if "_" not in name:
        return name
    for wrapper in _internals.WRAPPER_SEGMENTS:
        name = name.replace(wrapper + ".", "")
        if name == wrapper or name.endswith("." + wrapper):
            name = name[: -len(wrapper)].rstrip(".")
    return name


def named_modules(module: nn.Module) -> dict[str, nn.Module]:
    """Every submodule by its clean name (a wrapper, which comes first, stands for the
    module it wraps)."""
    out: dict[str, nn.Module] = {}
    for name, m in module.named_modules():
        out.setdefault(clean_name(name), m)
    return out


def _slots(module: nn.Module) -> tuple[dict[str, list[tuple[dict, str]]], dict[str, str]]:
    """For each parameter/buffer (first name), every (owner dict, key) that holds it: a tied
    tensor is held under several names, and all of them must see the replacement. Also every
    name's first name (the key it has in params, buffers or the constants). Names are clean."""
    slots: dict[int, list[tuple[dict, str]]] = {}
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for buffers, named in enumerate((module.named_parameters(remove_duplicate=False),
                                     module.named_buffers(remove_duplicate=False))):
        for name, t in named:
            owner, _, key = name.rpartition(".")
            name = clean_name(name)
            alias[name] = first.setdefault(id(t), name)
            held = _internals.tensor_dicts(module.get_submodule(owner))[buffers]  # (params', or buffers')
            slots.setdefault(id(t), []).append((held, key))
    return {first[i]: s for i, s in slots.items()}, alias


def _traced_check(apply: Apply, what: str, tree: Any) -> None:
    """``_check`` inside a trace, against ``apply``'s shapes taken as constants (``_shape_table``):
    dynamo guards on the tree, not on each of the shapes."""
    _check(what, tree, dict(_shape_table(apply, what)))


@_internals.trace_constant
def _shape_table(apply: Apply, what: str) -> tuple[tuple[str, torch.Size], ...]:
    """``apply``'s ``(key, shape)`` of its params (``what="params"``) or buffers; in a trace, a constant."""
    return tuple((apply._param_shapes if what == "params" else apply._buffer_shapes).items())


@_internals.trace_constant
def _ties(home: _Home) -> tuple[tuple[str, str], ...]:
    """Every other name of a tied tensor with the name it is given under: at trace time, a
    constant of the graph."""
    return tuple((name, f) for name, f in home.first.items() if name != f)


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
    return {clean_name(f"{prefix}.{b}" if prefix else b)
            for prefix, m in module.named_modules(remove_duplicate=False)
            for b in _internals.non_persistent_buffers(m)}


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
    inner = _internals.compiled_inner(module)
    if inner is not None:  # torch.compile(model): name and swap in the model itself
        forward, module = module, inner
    frozen = tuple(frozen) if not isinstance(frozen, str) else (frozen,)
    # tied parameters appear once (first name); wrappers' segments left out of the names
    named = [(clean_name(n), p) for n, p in module.named_parameters()]
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
        name = clean_name(name)
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
        name = clean_name(name)
        (constants if name in skip else buffers)[name] = b.detach()
    first = next(iter(params))
    apply = Apply(
        module,
        {k: v.shape for k, v in params.items()},
        {k: v.shape for k, v in buffers.items()},
        constants,
        module.training,
        forward,
        probe=(first, params[first].dtype) if params[first].is_floating_point() else None,
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
    module = _internals.compiled_inner(module) or module
    names = [clean_name(name) for name, m in module.named_modules() if name and isinstance(m, types)]
    if not names:
        raise ValueError(f"fdp.units: {type(module).__name__} has no submodule of type "
                         f"{', '.join(t.__name__ for t in types)}")
    return names
