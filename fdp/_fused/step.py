"""``FusedStep``, what ``reducer.grad_and_update`` returns, and the Reducer's cache of engines.

A ``FusedStep`` is cheap: it holds the loss function, the optimizer, its ``Program`` and its
``StepMode``. What is expensive (flat param sets, gradient buffers, the step machine) lives in
an ``Engine``, which the Reducer keeps in a small cache (``Engines``) keyed by layout, so a
step made anew each call (for a new ``accumulate=``, or a new ``adamw(lr=...)`` object)
reuses the engine of the step before it, and the cache never holds more than ``MAX`` engines.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import _internals, _tree
from .._comm.reshard import reshard_after_forward
from .._comm.schedule import in_order, issue_early
from .._lru import LRU
from .._plan.bucket import BucketPlan
from .._protocols import ParamSource, template_of
from .._shard import Shard
from .._sources.trees import on_device
from .._step.autodiff import autograd_on
from .._step.config import StepConfig
from .._step.record import StepRecord
from .._units.params import ShardedParams, average_slices, shards_of
from ..optim import Inspection, Optimizer, ema_params, inspect
from ..optim._flat import split_chain
from . import eager, traced
from .engine import Engine, StepMemory
from .mode import StepMode
from .program import Program
from .state import FusedState, StateLayout
from .stores import StoreKind

NAME = "fdp.Reducer.grad_and_update"

# ``step.accumulate``, ``step.update`` and ``step.idle`` run from hooks inside autograd and keep
# buffers between calls: they are left out of any compiled graph (a graph break: they run
# eagerly inside a compiled function; with fullgraph=True, dynamo's error gives this reason
# first). The step itself is traced (``fdp/_fused/traced.py``).
EAGER_ONLY = (f"{NAME}'s step.accumulate, step.update and step.idle cannot be traced by torch.compile (they run "
              "from hooks inside autograd); call them outside the compiled function: the compiled step "
              "itself (step(params, opt_state, ...)) traces, and adds the micro-batches step.accumulate summed")


eager_only = eager.eager_only(EAGER_ONLY)

# A call of the step that cannot be traced runs eagerly instead (a graph break; with
# fullgraph=True dynamo's error gives this reason first). ``step.compile()`` names the cause.
EAGER_INSTEAD = (
    f"{NAME}: this call of the step cannot be traced by torch.compile: the step is not bound yet (call "
    "step.init(params) eagerly first), an eager step's status is still in flight or its state is refused, or "
    "the step has an option decided on the host (uneven, accumulate=, "
    "clip_by_global_norm(error_if_nonfinite=True), debug, a comm hook without a traced form; "
    "inject_hyperparams, which step.compile() runs); step.compile() raises naming which. Without fullgraph=True "
    "it runs eagerly here")
eager_instead = eager.eager_only(EAGER_INSTEAD)


@functools.cache
def schedule_pass(roots: tuple[bool, ...] | None = None, regather: bool = True, prefetch: bool = True) -> Any:
    """fdp's pass for Inductor (fdp/_comm/schedule.py), made once per kind (Inductor imported
    then): the collectives' schedule, then their order kept (``in_order``). ``roots`` (fully
    sharded params: per bucket, whether the root's) adds the memory schedule of
    ``fdp/_comm/reshard.py`` (``regather``: ``reshard_after_forward``; ``prefetch``: the
    second gathers one unit ahead)."""
    def scheduled(graph: Any) -> None:
        issue_early(graph)
        after = reshard_after_forward(graph, roots, regather, prefetch) if roots is not None else None
        in_order(graph, after=after)

    key = "" if roots is None else (
        "+reshard/2:" + "".join("r" if r else "u" for r in roots) + f":{int(regather)}:{int(prefetch)}")
    return _internals.inductor_post_grad_pass(scheduled, f"fdp.issue_early/1+in_order/3+scatter/2{key}")


def _both(first: Callable, second: Callable) -> Callable[[list[Any]], list[bool]]:
    """The guard filter that keeps a guard where both ``first`` and ``second`` keep it."""
    def keep(entries: list[Any]) -> list[bool]:
        return [a and b for a, b in zip(first(entries), second(entries))]
    return keep


class CompiledStep:
    """A fused step compiled as one graph (``step.compile()``): call it as the step, and
    ``accumulate`` as ``step.accumulate``, each compiled (see ``FusedStep.compile``).

    ``accumulate`` compiles for the unsharded step and ``shard=True``: this rank's gradients
    added into the step's own flat buffers inside the graph (the first micro-batch of a cycle
    and the others are two graphs; the count is kept eagerly). With fully sharded params or
    ``reduce_micro_batches`` it runs the eager ``step.accumulate`` (the units' gathers and the
    micro-batches' reduce-scatters run from hooks).
    """

    def __init__(self, step: FusedStep, options: dict, schedule: bool = True, guard_libraries: bool = False
                 ) -> None:
        self.step, self.options, self.schedule, self.guard_libraries = step, options, schedule, guard_libraries
        # "step" and "accumulate" compiled, each with whether fdp gave it the C++ wrapper
        self._fns: dict[str, tuple[Callable, bool]] = {}
        self._traceable = False
        self._cpp_wrapper = True  # (fdp's default on CPU; False once Inductor failed to compile a graph with it)

    def _options(self, engine: Engine) -> tuple[dict, bool]:
        """``torch.compile``'s options, and whether fdp added the C++ wrapper to them. With
        Inductor, fdp's pass: each collective (with its fill) issued as early as its inputs
        allow, waited as late as its users allow (fdp/_comm/schedule.py); with fully sharded
        params, each unit gathered one ahead of its use and again for its backward
        (fdp/_comm/reshard.py); and on CPU, unless the options say otherwise, Inductor's C++
        wrapper. And, unless ``guard_libraries``, a guard filter that drops dynamo's checks of
        the library code's identity (``_internals.library_guards_dropped``), composed with the
        user's own filter."""
        options = dict(self.options)
        given = dict(options.get("options") or {})
        inductor = options.get("backend", "inductor") == "inductor"
        wrapper = (inductor and self._cpp_wrapper and "cpp_wrapper" not in given
                   and _internals.cpp_wrapper_by_default(engine.device))
        if wrapper:
            given["cpp_wrapper"] = True
        if self.schedule and inductor and "post_grad_custom_post_pass" not in given:
            roots, regather = None, True
            if engine.store.kind is StoreKind.UNITS:  # (the second gathers a unit ahead, as eagerly: docs/compile.md)
                units = engine.store.units
                roots = tuple(u == 0 for u in units.unit_of_bucket)
                regather = units.reshard_after_forward
            given["post_grad_custom_post_pass"] = schedule_pass(roots, regather)
        mine = None if self.guard_libraries else _internals.library_guards_dropped(__name__)
        if mine is not None and (inductor or "mode" not in options):  # (torch.compile takes no options with a mode)
            theirs = given.get("guard_filter_fn")
            given["guard_filter_fn"] = mine if theirs is None else _both(theirs, mine)
        if not given:
            return options, wrapper
        mode = options.pop("mode", None)
        if mode is not None:  # (torch.compile takes a mode or options: the mode's own options, and these)
            given = {**_internals.inductor_mode_options(mode, options.get("dynamic")), **given}
        return {**options, "options": given}, wrapper

    def _compiled(self, which: str, engine: Engine) -> Callable:
        """The compiled step (``which``: "step") or accumulate, compiled on first use."""
        made = self._fns.get(which)
        if made is None:
            step = self.step

            def accumulate(params: Any, rest: tuple, kwargs: dict, first: bool) -> Any:
                return traced.traced_accumulate(engine, step.fn, step.has_aux, params, rest, kwargs, first)
            fn = step.__call__ if which == "step" else accumulate
            options, wrapper = self._options(engine)
            made = self._fns[which] = (torch.compile(fn, **options), wrapper)
        return made[0]

    def _run(self, which: str, engine: Engine, *args: Any, **kwargs: Any) -> Any:
        """Call the compiled ``which``. Where Inductor fails to compile one of its graphs with the
        C++ wrapper fdp chose (an op the wrapper cannot call: torch's own all_to_all_single in a
        loss, on torch 2.13), nothing of the graph has run: this compiles it again with the
        Python wrapper, once, and says so; the user's own ``cpp_wrapper`` is left as given."""
        try:
            with _internals.tracing_autograd():
                return self._compiled(which, engine)(*args, **kwargs)
        except _internals.inductor_compile_errors() as e:
            if not self._fns[which][1]:
                raise
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(f"{NAME} rank {engine.group.rank}: Inductor's C++ wrapper (step.compile()'s default on "
                          f"CPU) could not compile this step ({why}); compiling it with the Python wrapper instead "
                          "(step.compile(options={'cpp_wrapper': False}) asks for that from the start)",
                          RuntimeWarning, stacklevel=3)
            self._cpp_wrapper = False
            del self._fns[which]
        with _internals.tracing_autograd():
            return self._compiled(which, engine)(*args, **kwargs)

    def _ready(self, params: Any) -> Engine:
        step = self.step
        step._bind(params)  # (eager: binding checks the plan across ranks; then a lookup)
        # The verdict an eager step of this Reducer left in flight, read now (collective)
        owed = step._engine._settle()
        if owed is not None:
            raise RuntimeError(f"{NAME}: step {owed[0]}'s update failed on rank(s) {owed[1]} after the others "
                               "had made theirs; call the eager step once (it restores those ranks from a healthy "
                               "one), then the compiled one")
        if not self._traceable:
            step._check_traceable(compiled_step=True)  # (here, eagerly: the reason is the error's first line)
            self._traceable = True
        return step._engine

    def __call__(self, params: Any, opt_state: FusedState, *rest: Any, **kwargs: Any) -> tuple[Any, FusedState, Any]:
        engine = self._ready(params)
        lost, engine.acc.lost = engine.acc.lost, None
        if lost is not None:  # (an eager step took step.accumulate's micro-batches with it, on every rank)
            raise RuntimeError(lost)
        program = self.step._program
        if program.injected is None:
            return self._run("step", engine, params, opt_state, *rest, **kwargs)
        # An inject_hyperparams optimizer: the values its graph fixes read here, on the host
        # (the graph is guarded on them: a new betas compiles anew; the lr is read in the
        # graph, from the state's tensor)
        self.step._layout.check(opt_state)
        program.traced = program.for_trace(opt_state.hyperparams)
        try:
            return self._run("step", engine, params, opt_state, *rest, **kwargs)
        finally:
            program.traced = None

    def accumulate(self, params: Any, *rest: Any, **kwargs: Any) -> Any:
        engine = self._ready(params)
        if engine.store.kind is StoreKind.UNITS or engine.reduces_micro_batches:
            return self.step.accumulate(params, *rest, **kwargs)
        engine._check_callable()
        acc = engine.acc
        with autograd_on():  # (the buffers step.accumulate makes on its first call)
            acc.flat(engine.plan)
        value = self._run("accumulate", engine, params, rest, kwargs, not acc.count)
        acc.count += 1
        acc.lost = None
        return value


class Engines:
    """A Reducer's fused engines, by (plan, param groups); the least recently used goes first
    once there are ``MAX``."""

    MAX = 4

    def __init__(self, config: StepConfig) -> None:
        self.config = config
        self._engines: LRU[tuple, Engine] = LRU(self.MAX)

    def get(self, plan: BucketPlan, program: Program) -> Engine:
        return self._engines.get((plan.fingerprint, program.engine_key), lambda: Engine(
            self.config, plan, program.keys, program.whole_parts, NAME, program.decayed_apart))

    def current(self, program: Program, engine: Engine) -> bool:
        """Whether ``engine`` is still the cached engine of ``program``'s layout (it is then the
        most recently used again)."""
        return self._engines.peek((engine.plan.fingerprint, program.engine_key)) is engine

    def __len__(self) -> int:
        return len(self._engines)


class FusedStep:
    """``reducer.grad_and_update(fn, opt, ...)``: gradient, all-reduce and optimizer in one step.

    ``opt_state = step.init(params)``, then ``params, opt_state, value = step(params,
    opt_state, *rest, **kwargs)`` where ``value`` is what ``reducer.grad_and_value`` returns
    (the loss, or ``(loss, aux)``). The returned params are views into the step's flat
    buffers: passing them back costs nothing; any other tree (changed, loaded, made by hand,
    another view of the same memory) is packed in (one copy). The optimizer state is flat per
    bucket and updated in place; ``state_to_tree`` / ``state_from_tree`` convert it to and
    from the per-leaf layout of ``opt.init(params)`` (checkpoints that load into the plain
    path, another plan or world), and ``state_to_shards`` / ``state_from_shards`` to and from
    the same layout holding this rank's parts (``fdp.Shard``s: sharded checkpoints written
    without a gather by ``fdp.save_sharded``).

    The numbers equal ``reducer.grad`` + ``opt.update`` bit for bit, on any world size, with
    every transform fdp.optim has: the buckets are the Reducer's own (DDP's), so every
    gradient is summed in the same order, and ``clip_by_global_norm``'s norm is each leaf's
    norm (from its view in the bucket) and then the norm of those in leaf order, as
    ``clip_grad_norm_`` computes it.

    Sharded (``Reducer(..., shard=True)``), each rank keeps only its slice of every bucket's
    optimizer state (``FusedState.buffers`` holds slices): a bucket's gradients are
    reduce-scattered, each rank updates its slice of the params, and the params are
    all-gathered (docs/concepts.md, "Sharded optimizer state"). A leaf's norm is computed on
    one rank, whole (the parts of a leaf that crosses a slice boundary are sent to it), so
    clipping is exact too. On two ranks the numbers equal the unsharded step's bit for bit;
    on more, the gradient sums of a reduce-scatter may round differently from an
    all-reduce's.

    A failure on any rank in the loss or the backward fails the step on every rank, before
    any update when the updates wait for every bucket (the state goes on). A failure in one
    rank's update (a transform, the optimizer's kernel, out of memory), unsharded and with
    the updates waiting for every bucket (a chain that clips, ``skip_nonfinite``, or a plan
    whose buckets all launch when the backward returns), raises on that rank at once; the
    other ranks' updates are whole, and every rank's next call restores that rank's params
    and state from a rank whose update succeeded, then goes on (no status exchange after the
    updates in the step itself: it is read at the next call). Sharded, or with updates on
    arrival during the backward, a failure after the buckets were reduced fails the step on
    every rank, and every rank refuses the state until a fresh one is given (``init``,
    ``state_from_tree``, a loaded state).
    """

    def __init__(self, engines: Engines, plan: BucketPlan, opt: Optimizer, fn: Callable, has_aux: bool,
                 accumulate: Any, donate: bool, uneven: bool = False) -> None:
        split_chain(opt, NAME, sharded=engines.config.sharded)  # refuse an unsupported optimizer now
        self._engines, self._plan, self.opt = engines, plan, opt
        self.fn, self.has_aux, self.donate, self.uneven = fn, has_aux, donate, bool(uneven)
        self._acc_tree = accumulate  # (grad_and_update's accumulate=: a gradient tree, bound here)
        self._device = plan.buckets[0].device if plan.buckets else torch.device("cpu")
        self._program: Program | None = None
        self._engine: Engine | None = None
        self._layout: StateLayout | None = None
        self._mode: StepMode | None = None
        self._last: StepRecord | None = None

    def _bind(self, params: Any) -> tuple[Engine, Program, StateLayout, StepMode]:
        engine, program = self._engine, self._program
        if engine is not None and self._engines.current(program, engine):  # (every call after the first)
            return engine, program, self._layout, self._mode
        # What an engine keeps across calls is made as ordinary tensors, also when the first
        # call is inside torch.inference_mode() (the step updates them in place outside it).
        with autograd_on():
            return self._bind_now(params)

    def _bind_now(self, params: Any) -> tuple[Engine, Program, StateLayout, StepMode]:
        if self._program is None:  # (read on params in the plan's leaf order)
            params = template_of(params)
            ordered = _tree.unflatten(self._plan.treedef, self._plan.leaves_of(params, f"{NAME} params"))
            self._program = Program(self.opt, ordered, NAME, sharded=self._engines.config.sharded)
        engine = self._engines.get(self._plan, self._program)
        if engine is not self._engine or self._layout is None:
            self._engine, self._layout = engine, engine.state_layout(self._program)
            self._mode = engine.mode_of(self._program)
        return engine, self._program, self._layout, self._mode

    def init(self, params: Any) -> FusedState:
        """A fresh optimizer state for ``params`` (collective the first time: the step's plan is
        checked across ranks). ``params`` may be the meta tensors of a model built on the
        meta device: the state is made on the step's device."""
        engine, _, layout, _ = self._bind(params)
        with autograd_on():  # (an inference tensor could not be updated in place by the step)
            state = layout.init(on_device(template_of(params), self._device))
        engine.fresh_state()
        return state

    def shard(self, params: Any) -> Any:
        """Fully sharded params (``Reducer(shard="params")``): this rank's slices of a whole
        params tree, as the ``fdp.ShardedParams`` the step takes and returns (a copy of this
        rank's elements; no communication). Drop the whole tree afterwards (and the module's
        copy: ``model.to("meta")``): from then on the rank holds only its slices. The leaves
        may also be ``fdp.Shard`` s holding at least this rank's elements (``fdp.load_sharded``
        with ``params.shards()`` as ``like``: a sharded checkpoint, on any world size). Or
        ``params`` is where they come from, read unit by unit so that no rank ever holds the
        whole model: ``fdp.deferred_init(model)`` (a model built on the meta device,
        initialised module by module) or ``fdp.safetensors_params(path)`` (a HF-style
        checkpoint, each rank reading only its elements).

        Raises:
          TypeError: the Reducer does not shard its params.
        """
        source = isinstance(params, ParamSource)
        engine, _, _, _ = self._bind(self._plan.template() if source else params)
        if engine.store.kind is not StoreKind.UNITS:
            hint = (" (read whole params from this source with source.materialize(params))" if source else "")
            raise TypeError(f"{NAME}: step.shard(params) is for fully sharded params (Reducer(shard='params')); "
                            f"this step's params are whole on every rank{hint}")
        sets = engine.store.params
        pset, _ = sets.current(params, False)
        return sets.views(pset)

    def param_shards(self) -> Any:
        """The params tree with each leaf an ``fdp.Shard`` of the elements this rank holds in a
        fully sharded step, holding no data (zero-strided): the ``like`` of
        ``fdp.load_sharded`` before any ``ShardedParams`` exist (a model built on the meta
        device, resumed from a sharded checkpoint on any world size)::

            like = {"params": step.param_shards(), "opt": step.state_to_shards(step.init(params), params)}
            got = fdp.load_sharded(d, like)
            params, opt_state = step.shard(got["params"]), step.state_from_shards(got["opt"], params)

        Raises:
          TypeError: the step's params are not fully sharded.
        """
        engine, _, _, _ = self._bind(self._plan.template())
        if engine.store.kind is not StoreKind.UNITS:
            raise TypeError(f"{NAME}: step.param_shards() is for fully sharded params (Reducer(shard='params'))")
        return shards_of(engine.store.params.units, None)

    def __call__(self, params: Any, opt_state: FusedState, *rest: Any, **kwargs: Any) -> tuple[Any, FusedState, Any]:
        if torch.compiler.is_compiling():
            return self._traced(params, opt_state, rest, kwargs)
        return self._eager(params, opt_state, rest, kwargs)

    def compile(self, *, schedule: bool = True, guard_libraries: bool = False, **options: Any) -> CompiledStep:
        """This step compiled as one graph: ``torch.compile(step, fullgraph=True, **options)``
        (``options``: ``torch.compile``'s, e.g. ``backend="aot_eager"`` or ``mode=``), called
        like the step, with ``accumulate`` compiled too (``fdp.CompiledStep``). It binds the
        step eagerly on its first call (a collective: the plan is checked across ranks) and
        traces with ``torch.autograd.grad`` (``torch._dynamo.config.trace_autograd_ops``), so
        activation checkpointing inside the loss compiles too. A user's own compiled function
        that calls ``step(...)`` traces the same step (docs/compile.md)::

            compiled = step.compile()
            for micro_batches in loader:
                for x, y in micro_batches[:-1]:
                    compiled.accumulate(params, x, y)
                params, opt_state, loss = compiled(params, opt_state, *micro_batches[-1])

        With Inductor (the default backend) fdp's pass schedules the graph's collectives: each
        (with its fill) issued as soon as its inputs are ready, waited right before its first
        use, in the traced order (``fdp/_comm/schedule.py``; ``schedule=False``: as traced).
        With fully sharded params its reshard pass then gathers each unit one unit ahead of its
        use and, with ``reshard_after_forward``, again for its backward, and keeps one
        reduce-scatter in flight (``fdp/_comm/reshard.py``), so the gathered params are held
        about as long as the eager step holds them. Each collective is then made to follow the
        one before it, so Inductor's own reordering keeps their order on every rank. With
        Inductor and the params on the CPU, the code that calls the graph's kernels is compiled
        to C++ as well (Inductor's ``cpp_wrapper``: a few percent of a small model's step; more
        compile time with a cold cache); ``options={"cpp_wrapper": False}`` keeps the Python
        wrapper. A graph Inductor cannot compile with the C++ wrapper (an op in the loss the
        wrapper cannot call) is compiled again with the Python one, with a ``RuntimeWarning``.

        Before each call dynamo checks its guards. Those that check that the functions, classes
        and modules of torch, optree and fdp which the step reaches through module globals are
        still the same objects are dropped (``guard_libraries=True`` keeps them: dynamo's
        default): code that does not change while a job runs, and about half of the checks'
        time (docs/compile.md, "Each call's cost"). Every value the step reads is still checked,
        and everything of the user's own modules, the model and the inputs. A ``guard_filter_fn``
        given in ``options`` applies too.

        ``skip_nonfinite`` and ``fdp.optim.loss_scale`` compile (the check and the kept update
        are graph nodes; ``step.inspect`` reads the verdict), and so does an ``inject_hyperparams`` optimizer
        here: the ``lr`` is read in the graph from the state, the other values on the host
        before each call, fixed in the graph (a new ``betas`` compiles anew).

        Raises (on the first call): ``RuntimeError`` naming an option of the step that cannot
        be traced (``uneven``, ``debug``, ...), before anything is compiled.
        """
        return CompiledStep(self, {"fullgraph": True, **options}, schedule, guard_libraries)

    def _untraceable(self, compiled_step: bool = False) -> str | None:
        return traced.refusal(self._engine, self._program, self._acc_tree, self.uneven, compiled_step)

    def _check_traceable(self, compiled_step: bool = False) -> None:
        why = self._untraceable(compiled_step)
        if why is not None:
            raise RuntimeError(f"{NAME}: this step cannot be traced by torch.compile: {why}; call it outside the "
                               "compiled function (docs/compile.md)")

    @eager_only
    def _eager(self, params: Any, opt_state: FusedState, rest: tuple, kwargs: dict) -> tuple[Any, FusedState, Any]:
        return self._grad_step(params, opt_state, rest, kwargs, True)

    def _traced(self, params: Any, opt_state: FusedState, rest: tuple, kwargs: dict) -> tuple[Any, FusedState, Any]:
        """The step inside ``torch.compile`` (``fdp/_fused/traced.py``), or, where this call
        cannot be traced, the eager step (a graph break: ``EAGER_INSTEAD``)."""
        engine = self._engine
        if (engine is None or engine.refusal is not None or self._engines.config.steps.pending is not None
                or self._untraceable() is not None):
            return self._eager_instead(params, opt_state, rest, kwargs)
        return traced.traced_grad_step(engine, self._program, self._layout, self.fn, self.has_aux, params,
                                       opt_state, rest, kwargs, self.donate)

    @eager_instead
    def _eager_instead(self, params: Any, opt_state: FusedState, rest: tuple, kwargs: dict
                       ) -> tuple[Any, FusedState, Any]:
        return self._grad_step(params, opt_state, rest, kwargs, True)

    @eager_only
    def idle(self, params: Any, opt_state: FusedState, *rest: Any, **kwargs: Any) -> tuple[Any, FusedState, Any]:
        """This step on a rank that has no data of its own (uneven inputs; the step was made with
        ``grad_and_update(..., uneven=True)``): it runs ``fn`` on ``rest`` (any batch of the
        right kind, e.g. this rank's last one: with fully sharded params the forward and
        backward issue every unit's gathers), but its gradients count as zeros and the mean is
        over the ranks that called the step itself. Every rank updates alike, so the replicas
        stay identical. Returns what the step returns; the value is of the stand-in batch::

            while fdp.any_rank(has_data):
                if has_data:
                    params, opt_state, loss = step(params, opt_state, *batch)
                else:
                    params, opt_state, _ = step.idle(params, opt_state, *last_batch)

        Raises:
          TypeError: the step was not made with ``uneven=True``.
          ValueError: no rank is active this step.
        """
        if not self.uneven:
            raise TypeError(f"{NAME}: step.idle needs the step made with grad_and_update(..., uneven=True): "
                            "then every call counts the active ranks (one small all-reduce), so every rank "
                            "knows the mean is over them")
        return self._grad_step(params, opt_state, rest, kwargs, False)

    def _grad_step(self, params: Any, opt_state: Any, rest: tuple, kwargs: dict, active: bool) -> tuple:
        self._bind(params)  # (sets the engine, program, layout and mode this call runs with)
        try:
            return self._engine.run_grad(self._program, self._mode, self._layout, self.fn, self.has_aux, params, opt_state, rest, kwargs,
                                   self._acc_tree, self.donate, active=active if self.uneven else None)
        finally:
            self._last = self._engines.config.steps.last

    @eager_only
    def accumulate(self, params: Any, *rest: Any, **kwargs: Any) -> Any:
        """Gradient accumulation without communication (DDP's ``no_sync``): this rank's
        gradients of ``fn(params, *rest, **kwargs)`` are added into the step's own
        accumulation buffers (flat per bucket; the first micro-batch's copied) once its
        backward has completed, and nothing else happens. The next call of the step adds its own micro-batch's gradients to the
        sum, averages it over the ranks while its backward runs, and updates, as usual::

            for x, y in micro_batches[:-1]:
                step.accumulate(params, x, y)
            params, opt_state, loss = step(params, opt_state, *micro_batches[-1])

        The same numbers as DDP's ``no_sync`` loop (the gradients summed in the same order,
        then averaged). Returns what ``fn`` returns (the loss, or ``(loss, aux)``), detached.

        Failures: a micro-batch whose loss or backward raises adds nothing (skipping it is
        exact: the sum is the one without it). The step that closes the cycle takes the sum
        into its buckets; when it fails (on any rank: every rank raises in that call), the
        micro-batches go with it, and the next step called without accumulating again is
        refused on every rank, saying to redo the cycle (a retry of the step alone would
        average a gradient without them).

        With fully sharded params (``shard="params"``) the gradients are not communicated but
        the params are: each unit is all-gathered for the micro-batch's forward and backward,
        as in a step, so ``accumulate`` is a collective there: every rank must call it the same
        number of times (the sum is kept whole, unsharded, until the step averages it; after
        the first micro-batch the new sums are written beside the old ones until the backward
        completes, so up to two sets of whole gradients at the peak).

        With ``Reducer(..., shard=..., reduce_micro_batches=True)`` each micro-batch is
        reduce-scattered as its backward goes, as in a step (a collective on every rank, a step
        of kind ``"accumulate"`` in ``reducer.steps``), and a rank keeps only its slice of the
        sum of the micro-batches' means (FSDP2's gradient sync on every micro-batch, and its
        numbers): two sets of sharded gradients at most, instead of whole ones. A micro-batch
        that fails on any rank then adds nothing on every rank, and every rank raises.
        """
        engine, _, _, _ = self._bind(params)
        if self.uneven and engine.reduces_micro_batches:
            raise ValueError(f"{NAME}: step.accumulate with reduce_micro_batches=True averages each micro-batch over "
                             "every rank as it goes, but a step made with uneven=True averages over the ranks that "
                             "still have data, known only at the step: build the Reducer without "
                             "reduce_micro_batches for uneven inputs")
        return engine.accumulate(self.fn, self.has_aux, params, rest, kwargs)

    @eager_only
    def update(self, grads: Any, opt_state: FusedState, params: Any, *, active: bool | None = None
               ) -> tuple[Any, FusedState]:
        """Average ``grads`` computed any other way over the ranks and apply the fused update
        (uneven inputs: ``active=False`` ranks pass ``grads=None`` and contribute zeros, as
        ``reducer.all_reduce``)."""
        engine, program, layout, mode = self._bind(params)
        try:
            return engine.run_update(program, mode, layout, grads, opt_state, params, active, self.donate)
        finally:
            self._last = self._engines.config.steps.last

    def ema_params(self, opt_state: FusedState, params: Any) -> Any:
        """The average of the params that ``fdp.optim.ema(opt)`` keeps in ``opt_state``, as
        params: with fully sharded params, ``fdp.ShardedParams`` of the average (each rank its
        own slices, from its own state: no gather; a Muon matrix's average comes from its
        owner, one exchange), to evaluate with ``apply`` or save with ``params.shards()``;
        else the whole tree (``fdp.optim.ema_params(step.state_to_tree(opt_state, params),
        params)``). Before the first update the average is ``params`` themselves; a
        ``frozen()`` label's leaves are the params'.

        Raises:
          TypeError: ``opt_state``'s optimizer keeps no average (no ``fdp.optim.ema``).
        """
        engine, _, _, _ = self._bind(params)
        if engine.store.kind is not StoreKind.UNITS:
            return ema_params(self.state_to_tree(opt_state, params), params)
        units = engine.store.params.units
        avg = ema_params(self.state_to_shards(opt_state, params), self._plan.template())
        if avg is None or not any(isinstance(leaf, Shard) for leaf in _tree.leaves(avg)):
            return params  # (no average taken yet)
        return ShardedParams(units, average_slices(units, self._plan.leaves_of(avg, f"{NAME} average"),
                                                   params.flats, engine.owners))

    def state_to_tree(self, opt_state: FusedState, params: Any) -> Any:
        """The per-leaf optimizer state, as ``opt.init(params)`` lays it out, in ``params``'
        own structure (a copy). Sharded (``Reducer(shard=True)``), a collective: every rank's
        slices are gathered, and every rank gets the whole state (save it with ``fdp.save``;
        it loads into any world size, plan, or the unsharded step)."""
        engine, _, layout, _ = self._bind(params)
        return layout.to_tree(engine.check_state(layout, opt_state), template_of(params))

    def state_from_tree(self, tree_state: Any, params: Any) -> FusedState:
        """A ``FusedState`` from a per-leaf state (``opt.init``'s layout, e.g. loaded)."""
        engine, _, layout, _ = self._bind(params)
        with autograd_on():
            state = layout.from_tree(tree_state, template_of(params))
        engine.fresh_state()
        return state

    def state_to_shards(self, opt_state: FusedState, params: Any) -> Any:
        """The per-leaf optimizer state, as ``state_to_tree`` lays it out, with each tensor of
        the state's fields an ``fdp.Shard`` of this rank's elements of that leaf; no
        communication. Sharded, a leaf's elements on a rank are those of its slice (one
        range), or the whole leaf on its owner (Muon), or none; unsharded, the whole leaf. The
        count and the transforms' states are tensors (replicated). Nothing is copied: the
        Shards' data are views of ``opt_state``'s buffers, and the count and injected
        hyper-parameters are its own tensors, so the tree always reads one moment, the latest
        (save it before the next step if you want this step's).

        A sharded checkpoint without a gather, and its resumption on any world size::

            fdp.save_sharded(d, {"params": params, "opt": step.state_to_shards(opt_state, params), "step": n})
            like = {"params": params, "opt": step.state_to_shards(step.init(params), params), "step": 0}
            state = fdp.load_sharded(d, like)
            opt_state = step.state_from_shards(state["opt"], params)

        ``like = {..., "opt": opt.init(params)}`` loads the plain per-leaf tensors instead.
        """
        engine, _, layout, _ = self._bind(params)
        return layout.to_shards(engine.check_state(layout, opt_state), template_of(params))

    def state_from_shards(self, tree_state: Any, params: Any) -> FusedState:
        """This rank's ``FusedState`` from ``state_to_shards``'s layout (e.g. loaded by
        ``fdp.load_sharded`` with ``step.state_to_shards(step.init(params), params)`` as
        ``like``). Each leaf's Shard must hold this rank's elements of it (a whole tensor
        does too); they are copied into fresh buffers. No communication.

        Raises:
          ValueError: a Shard lacks some of this rank's elements, or a leaf's shape or
            dtype is not the param's (names the leaf and the elements needed).
        """
        engine, _, layout, _ = self._bind(params)
        with autograd_on():
            state = layout.from_shards(tree_state, template_of(params))
        engine.fresh_state()
        return state

    @property
    def plan(self) -> BucketPlan:
        """The bucket plan the step runs on (its Reducer's)."""
        return self._plan

    def memory(self) -> StepMemory:
        """What this step holds besides the optimizer state, in bytes (``fdp.StepMemory``):
        its flat param sets, gradient buffers, accumulation buffers and (fully sharded) the
        units' params gathered right now. Made on the first call of the step (or ``init``).

        Example::

            held = step.memory()
            print(held.param_sets, held.params / 2**20, held.gradients / 2**20)
        """
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"{NAME}: step.memory() before the step was bound to its params (call step.init "
                               "or the step first)")
        return engine.memory()

    def inspect(self, opt_state: FusedState, *, next_update: bool = False) -> Inspection:
        """What the last step did, for logging: ``fdp.optim.inspect(step.opt, opt_state)`` (the
        count, the lr and other hyper-parameters per label, the clip's norm, the loss scale, the
        EMA's decay) with the last call's ``finite`` verdict and the Reducer's count of steps
        skipped as non-finite. Reads scalars every rank holds: no gather, also sharded. After
        a compiled step (``step.compile()``, or ``step`` inside a compiled function) the verdict
        is the one its graph wrote (reading it waits for the step on a GPU), and ``skipped``
        counts compiled and eager steps alike.

        Example::

            params, opt_state, loss = step(params, opt_state, x, y)
            info = step.inspect(opt_state)
            log({"loss": float(loss), **info.scalars()}, step=info.step)
        """
        if not isinstance(opt_state, FusedState):
            raise TypeError(f"{NAME}.inspect: opt_state must be the FusedState this step returned (or step.init's), "
                            f"got a {type(opt_state).__name__}; for the state of opt.init/opt.update use "
                            "fdp.optim.inspect(opt, state)")
        info = inspect(self.opt, opt_state, next_update=next_update)
        last, engine = self._last, self._engine
        finite = None if last is None else last.finite
        skipped = self._engines.config.steps.nonfinite
        if engine is not None and engine.decided:  # compiled steps' verdicts, written by their graphs
            verdicts = engine.verdicts
            skipped += int(verdicts.skipped)
            if engine.traced_last:
                finite = bool(verdicts.finite)
        return info._replace(finite=finite, skipped=skipped)

    @property
    def last_step(self) -> StepRecord | None:
        """The record of this step's most recent call: its finite verdict (False: nothing was
        updated) and a timeline with each bucket's update (``BucketTimes.update_start``/
        ``update_end``). ``reducer.last_step`` is the same record until the Reducer's next step."""
        return self._last
