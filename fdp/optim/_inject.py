"""``inject_hyperparams``: hyper-parameters held in the optimizer state, changed between steps.

optax's ``inject_hyperparams(factory)(**kwargs)`` (``optax/schedules/_inject.py``) keeps
every numeric argument of the factory in the state (``state.hyperparams``) and builds the
inner transformation from the state's values at each update, so a user changes the lr by
replacing a value in the state. torch users do the same with ``group["lr"] = ...``. Here the
values are 0-d CPU tensors (float64 for floats, as the Python floats torch's param groups
hold, so every value round-trips exactly; int64 for ints; a tuple of them for ``betas``),
read on the host at each update: the kernel gets the same Python float torch.optim's does,
and the numbers are torch's after ``group["lr"] = value``, bit for bit.

What an update costs: the inner optimizer is built once per distinct set of values and
kept (the last ``CACHED``), except for the arguments fdp.optim's factories take as schedules
(``lr`` and ``weight_decay``, annotated ``Hyper``): those are passed to the factory as a
schedule that reads the state's value at each update, so changing them every step builds
nothing. Changing ``betas``, ``momentum``, ``eps``... builds the inner optimizer anew when
the value is new (as optax does at every update), and its factory checks the value.

In the fused step the kernels run inside autograd's hooks (on CUDA, on autograd's device
threads), where a per-thread value is not the caller's: there the step reads the state's
values once, before it starts, and runs the kernel of ``opt.bind(values)``, the inner
optimizer with every value fixed in it (no schedule slots), built once per distinct set of
values (the last ``CACHED`` kept). A compiled fused step (``fdp.CompiledStep``) runs the
optimizer of ``_Binder.traced``: the ``lr`` read in the graph, the other values fixed.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._lru import LRU
from ._base import ChainState, Form, Optimizer
from ._ema import EmaState
from ._multi_steps import MultiStepsState
from ._transforms import PartitionState

__all__ = ["InjectHyperparamsState", "inject_hyperparams", "set_hyperparams"]

CACHED = 4  # inner optimizers kept per injected optimizer (distinct non-schedule values)


class InjectHyperparamsState(NamedTuple):
    """State of an ``inject_hyperparams`` optimizer (optax's ``InjectHyperparamsState``, less
    its count: the inner state keeps its own).

    Attributes:
      hyperparams: ``{name: value}`` for each numeric argument of the factory: a 0-d CPU
        tensor (float64 for a float, int64 for an int) or a tuple of them (``betas``).
        Replace values with ``set_hyperparams``; the next update uses them.
      inner_state: the inner optimizer's state.
    """

    hyperparams: dict[str, Any]
    inner_state: Any


def _numeric(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int | float):
        return True
    if isinstance(v, Tensor):
        return v.dim() == 0 and not v.dtype.is_complex and v.dtype != torch.bool
    return isinstance(v, tuple | list) and len(v) > 0 and all(_numeric(x) and not isinstance(x, tuple | list)
                                                              for x in v)


def _to_state(v: Any) -> Any:
    """A factory argument as the state holds it."""
    if isinstance(v, tuple | list):
        return tuple(_to_state(x) for x in v)
    if isinstance(v, Tensor):
        v = v.item()
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    return torch.tensor(float(v), dtype=torch.float64)


def _to_python(v: Any) -> Any:
    """The state's value as the factory argument (Python numbers: what torch's groups hold)."""
    if isinstance(v, tuple | list):
        return tuple(_to_python(x) for x in v)
    if isinstance(v, Tensor):
        return v.item()
    return v


def _is_schedulable(param: inspect.Parameter) -> bool:
    # fdp.optim's factories annotate the arguments they take as schedules ``Hyper``.
    return param.annotation in ("Hyper", "Hyper | None") or getattr(param.annotation, "__name__", None) == "Hyper"


class _Slot:
    """A schedule (for the factory) that returns the value the running update took from the
    state. Per thread: simulated ranks are threads that may share an optimizer."""

    def __init__(self, name: str, local: threading.local, owner: str) -> None:
        self.name, self.local, self.owner = name, local, owner

    def __call__(self, count: Any) -> float:
        values = getattr(self.local, "values", None)
        if values is None:
            raise RuntimeError(f"{self.owner}: {self.name} is in the optimizer state, not the optimizer: "
                               f"read it as state.hyperparams[{self.name!r}]")
        return values[self.name]


def inject_hyperparams(factory: Callable[..., Optimizer], *, static_args: str | Iterable[str] = ()
                       ) -> Callable[..., Optimizer]:
    """A factory like ``factory`` whose optimizer keeps its numeric hyper-parameters in its state.

    ``inject_hyperparams(fdp.optim.adamw)(lr=1e-3, weight_decay=0.1)`` is ``adamw(lr=1e-3,
    weight_decay=0.1)`` whose state (an ``InjectHyperparamsState``) holds ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` (the numeric arguments, defaults included) as 0-d tensors;
    ``state = fdp.optim.set_hyperparams(state, lr=...)`` changes them for the next update,
    with torch.optim's numbers after ``group["lr"] = ...``, bit for bit. They are saved and
    loaded with the state (``fdp.save``/``fdp.load``).

    The fused step (``reducer.grad_and_update(loss_fn, opt)``, alone or last in a ``chain``;
    unsharded, ``shard=True`` and ``shard="params"``) runs it too when ``factory``'s
    optimizer has a ``LeafKernel``: its ``FusedState`` keeps the values
    (``opt_state.hyperparams``), ``set_hyperparams(opt_state, lr=...)`` changes them, and
    each step runs the kernel of ``opt.bind(opt_state.hyperparams)`` (the inner optimizer
    with those values fixed, built once per distinct set of values, the last ``CACHED``
    kept): the same core, buffers and numbers as the plain path; compiled
    (``step.compile()``), the ``lr`` is read in the graph from the state (a new value
    compiles nothing) and the others are fixed in the graph (a new ``betas`` compiles the
    step anew; docs/compile.md). A value that would change
    the state's fields (``sgd``'s ``momentum`` from 0) is refused there; so is an injected
    optimizer inside a ``partition`` or under ``ema``/``multi_steps`` (plain path only).

    Args:
      factory: a function returning an ``Optimizer`` (``fdp.optim.adamw``, your own).
      static_args: arguments never injected (kept as given), besides bools, ``None``,
        strings, callables (schedules stay schedules: evaluated by the inner optimizer, and
        not in the state), masks and ``donate``.

    Returns:
      A function taking ``factory``'s arguments and returning an ``Optimizer`` whose state
      is an ``InjectHyperparamsState``.

    Raises:
      ValueError: ``static_args`` names an argument ``factory`` does not take.
      TypeError: ``factory`` takes ``*args`` or ``**kwargs``.

    Example:
      >>> opt = fdp.optim.inject_hyperparams(fdp.optim.sgd)(lr=0.1)
      >>> params = {"w": torch.ones(2)}
      >>> state = opt.init(params)
      >>> float(state.hyperparams["lr"])
      0.1
      >>> state = fdp.optim.set_hyperparams(state, lr=0.5)
      >>> opt.update({"w": torch.ones(2)}, state, params)[0]["w"]
      tensor([0.5000, 0.5000])
    """
    name = f"fdp.optim.inject_hyperparams({getattr(factory, '__name__', 'factory')})"
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    signature = inspect.signature(factory)
    if not static <= set(signature.parameters):
        raise ValueError(f"{name}: static_args {sorted(static - set(signature.parameters))} are not "
                         f"arguments of the factory ({list(signature.parameters)})")
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        raise TypeError(f"{name}: a factory with *args or **kwargs cannot be injected (name its arguments)")

    def make(*args: Any, **kwargs: Any) -> Optimizer:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            hint = {"learning_rate": "lr", "b1": "betas=(b1, b2)", "b2": "betas=(b1, b2)"}
            named = [f"{k} -> {hint[k]}" for k in kwargs if k in hint and k not in signature.parameters]
            raise TypeError(f"{name}: {e}" + (f" (fdp's optimizers take torch.optim's names: {', '.join(named)})"
                                                if named else "")) from None
        bound.apply_defaults()
        fixed = {k: v for k, v in bound.arguments.items() if k in static or k == "donate" or not _numeric(v)}
        injected = {k: v for k, v in bound.arguments.items() if k not in fixed}
        slots = [k for k in injected if _is_schedulable(signature.parameters[k])]
        rebuilt = [k for k in injected if k not in slots]
        local = threading.local()
        slot_args = {k: _Slot(k, local, name) for k in slots}
        inner = LRU(CACHED)  # (simulated ranks, threads, share them)

        def check_slots(values: dict[str, Any], where: str) -> None:
            for k in slots:  # the factory does not see these values: its checks, here
                if not values[k] >= 0:
                    raise ValueError(f"{name}: invalid {k} {values[k]}{where} (must be >= 0)")

        def inner_for(values: dict[str, Any]) -> Optimizer:
            """The inner optimizer for ``values`` (checked), reading the slots' values per update."""
            return inner.get(tuple(values[k] for k in rebuilt),
                             lambda: factory(**fixed, **slot_args, **{k: values[k] for k in rebuilt}))

        initial = {k: _to_python(v) for k, v in injected.items()}
        check_slots(initial, "")
        first = inner_for(initial)  # the factory's checks of the values given, now

        def values_of(hyperparams: dict[str, Any], what: str) -> dict[str, Any]:
            if not isinstance(hyperparams, dict) or set(hyperparams) != set(injected):
                got = sorted(hyperparams) if isinstance(hyperparams, dict) else type(hyperparams).__name__
                raise ValueError(f"{name}: {what} has {got}; this optimizer injects {sorted(injected)}")
            values = {k: _to_python(v) for k, v in hyperparams.items()}
            check_slots(values, f" in {what}")
            return values

        binder = _Binder(name, factory, fixed, slots, rebuilt, initial, values_of)

        def init(params: Any) -> InjectHyperparamsState:
            return InjectHyperparamsState({k: _to_state(v) for k, v in initial.items()}, first.init(params))

        def update(grads: Any, state: InjectHyperparamsState, params: Any) -> tuple[Any, InjectHyperparamsState]:
            if not isinstance(state, InjectHyperparamsState):
                raise TypeError(f"{name}: state must be the InjectHyperparamsState of its init, got "
                                f"{type(state).__name__}")
            values = values_of(state.hyperparams, "state.hyperparams")
            opt = inner_for(values)
            local.values = {k: float(values[k]) for k in slots}
            try:
                params, inner = opt.update(grads, state.inner_state, params)
            finally:
                local.values = None
            return params, InjectHyperparamsState(dict(state.hyperparams), inner)  # (a dict of its own)

        return Optimizer(init, update, Form(bind=binder))

    make.__name__ = f"inject_hyperparams({getattr(factory, '__name__', 'factory')})"
    make.__doc__ = factory.__doc__
    return make


class _Held:
    """A schedule (for the factory) returning the value a traced step put in it: the state's
    0-d tensor, a graph input (``_Binder.traced``)."""

    def __init__(self, name: str, owner: str) -> None:
        self.name, self.owner = name, owner
        self.value: Tensor | None = None

    def __call__(self, count: Any) -> Any:
        if self.value is None:
            raise RuntimeError(f"{self.owner}: {self.name} is read from the state by the compiled step only while "
                               "it updates (fdp.CompiledStep)")
        return self.value


class Traced(NamedTuple):
    """An injected optimizer as a compiled step runs it (``_Binder.traced``): ``optimizer``
    built with the values read on the host fixed in it, and each of ``held``'s schedules
    returning the state's tensor the step puts in it while it updates."""

    optimizer: Optimizer
    held: dict[str, _Held]


class _Binder:
    """``Form.bind`` of an ``inject_hyperparams`` optimizer.

    ``bind(values)`` is the inner optimizer with every value fixed in it (what the eager fused
    step runs: its kernels run inside autograd's hooks, where a per-thread value is not the
    caller's), built once per distinct set of values (the last ``CACHED`` kept).

    Under ``torch.compile`` (``fdp.CompiledStep``) the ``lr`` (when the factory takes it as
    a schedule, as fdp.optim's do) is read in the graph from the state's tensor (a graph
    input: a new value compiles nothing), and the others (``weight_decay``, whose zero
    torch's kernels test in Python, ``betas``, ``eps``, ``momentum``...) are read on the host
    before the call (``host_values``: checked as ``bind`` checks them) and fixed in the
    optimizer (``traced``): the graph is guarded on them, so a new value compiles the step
    anew, as optax builds the inner optimizer anew."""

    def __init__(self, name: str, factory: Callable[..., Optimizer], fixed: dict, slots: list[str],
                 rebuilt: list[str], initial: dict[str, Any], values_of: Callable[[dict, str], dict]) -> None:
        self.name, self.factory, self.fixed, self.slots, self.rebuilt = name, factory, fixed, slots, rebuilt
        self.initial, self.values_of = initial, values_of
        self.held = [k for k in slots if k == "lr"]  # (read in a compiled step's graph)
        self.fixed_in_graph = [k for k in (*slots, *rebuilt) if k not in self.held]
        self._bound: LRU[tuple, Optimizer] = LRU(CACHED)  # (simulated ranks, threads, share them)
        self._traced: LRU[tuple, Traced] = LRU(CACHED)

    def __call__(self, hyperparams: dict[str, Any] | None = None) -> Optimizer:
        values = self.initial if hyperparams is None else self.values_of(hyperparams, "the hyperparams")
        keys = [*self.slots, *self.rebuilt]
        return self._bound.get(tuple(values[k] for k in keys), lambda: self.factory(
            **self.fixed, **{k: float(values[k]) for k in self.slots}, **{k: values[k] for k in self.rebuilt}))

    def host_values(self, hyperparams: dict[str, Any]) -> tuple:
        """The state's values of the arguments other than ``lr``, read on the host and checked
        (every value is): what ``traced`` fixes in the optimizer."""
        values = self.values_of(hyperparams, "the hyperparams")
        return tuple(values[k] for k in self.fixed_in_graph)

    def traced(self, host: tuple) -> Traced:
        """The optimizer a compiled step runs (``Traced``), for ``host_values``'s values, built
        eagerly, once per distinct values (the last ``CACHED`` kept)."""
        def make() -> Traced:
            held = {k: _Held(k, self.name) for k in self.held}
            fixed = {k: float(v) if k in self.slots else v for k, v in zip(self.fixed_in_graph, host)}
            return Traced(self.factory(**self.fixed, **held, **fixed), held)
        return self._traced.get(host, make)


def set_hyperparams(state: Any, **values: Any) -> Any:
    """``state`` with new values for hyper-parameters an ``inject_hyperparams`` optimizer keeps
    (a new state; the one passed in is not modified). The next update uses them.

    Finds the ``InjectHyperparamsState`` in ``state`` itself, or inside a ``ChainState``,
    ``EmaState`` or ``MultiStepsState`` (an injected optimizer at the end of a chain, under
    ``ema`` or ``multi_steps``); or the values a fused step's ``FusedState`` keeps
    (``opt_state.hyperparams``: ``reducer.grad_and_update`` with an injected optimizer).

    Args:
      state: the state of an injected optimizer, or of a wrapper around one.
      **values: new values by name (``lr=1e-4``, ``betas=(0.9, 0.95)``): Python numbers or
        0-d tensors, stored as the state holds them (float64 for floats).

    Returns:
      The new state.

    Raises:
      TypeError: no injected optimizer's state in ``state``.
      ValueError: a name the optimizer does not inject, a tuple of another length, or
        several injected states (a ``partition``: set each label's state).

    Example:
      >>> opt = fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-3)
      >>> state = fdp.optim.set_hyperparams(opt.init({"w": torch.ones(2)}), lr=1e-4, betas=(0.9, 0.95))
      >>> float(state.hyperparams["lr"]), [float(b) for b in state.hyperparams["betas"]]
      (0.0001, [0.9, 0.95])
    """
    name = "fdp.optim.set_hyperparams"
    found: list[InjectHyperparamsState] = []

    def replace(s: InjectHyperparamsState) -> InjectHyperparamsState:
        found.append(s)
        new = dict(s.hyperparams)
        for k, v in values.items():
            if k not in new:
                raise ValueError(f"{name}: {k!r} is not injected; this optimizer keeps {sorted(new)}. A value "
                                 "given to inject_hyperparams as a schedule (a callable) or a non-number is not "
                                 "injected: it stays as given; to change it between steps, give a number "
                                 f"({k}=1e-3) and call set_hyperparams each step")
            if not _numeric(v):
                raise ValueError(f"{name}: {k}={v!r} is not a number (or a tuple of numbers)")
            old_len = len(new[k]) if isinstance(new[k], tuple) else None
            new_len = len(v) if isinstance(v, tuple | list) else None
            if old_len != new_len:
                raise ValueError(f"{name}: {k} holds {'a number' if old_len is None else f'{old_len} numbers'}, "
                                 f"got {v!r}")
            new[k] = _to_state(v)
        return InjectHyperparamsState(new, s.inner_state)

    out = _replace_injected(state, replace)
    if not found:
        raise TypeError(f"{name}: no inject_hyperparams state in a {type(state).__name__}: build the optimizer "
                        "as fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=...) (any factory) and pass the state "
                        "its init (or the fused step's step.init) made")
    if len(found) > 1:
        raise ValueError(f"{name}: {len(found)} injected optimizers' states (a partition's labels?); set each: "
                         "PartitionState({**state.states, label: set_hyperparams(state.states[label], ...)})")
    return out


_WRAPPERS = ((ChainState, "optimizer"), (EmaState, "inner"), (MultiStepsState, "inner_opt_state"))


def _replace_injected(state: Any, fn: Callable[[InjectHyperparamsState], InjectHyperparamsState]) -> Any:
    if isinstance(state, InjectHyperparamsState):
        return fn(state)
    for cls, field in _WRAPPERS:
        if isinstance(state, cls):
            return state._replace(**{field: _replace_injected(getattr(state, field), fn)})
    if isinstance(state, PartitionState):
        return PartitionState({k: _replace_injected(v, fn) for k, v in state.states.items()})
    if _holds_hyperparams(state):  # the fused step's FusedState (fdp.optim does not import it)
        return state._replace(hyperparams=fn(InjectHyperparamsState(state.hyperparams, None)).hyperparams)
    return state


def _holds_hyperparams(state: Any) -> bool:
    """Whether ``state`` is a NamedTuple other than ``InjectHyperparamsState`` that keeps an
    injected optimizer's values itself, in a ``hyperparams`` dict (the fused step's
    ``FusedState``, whose flat buffers stand for the inner state)."""
    return (isinstance(state, tuple) and "hyperparams" in getattr(state, "_fields", ())
            and isinstance(state.hyperparams, dict))
