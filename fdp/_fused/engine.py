"""``Engine``: what a fused step keeps across calls for one layout, written once over a store.

An engine belongs to one Reducer and one layout: the Reducer's bucket plan (DDP's buckets, the
same ones ``reducer.grad`` reduces, so a fused step sums every gradient in the same order on
any world size) and each leaf's key (its part of a partition and its hyper-parameter group:
``Program.keys``). Inside each bucket, the leaves of one key form *spans*
(``fdp._slices.geometry``); a bucket's update is one kernel call per key over its spans.
Where params, gradients and optimizer state live is its ``Store`` (replicated, sliced over the
ranks, or units gathered on demand: ``fdp/_fused/stores.py``), chosen when it is built; the
engine owns the step machine, the store, the accumulation buffers, and whether its state is
refused after a failure. Optimizers that lay the params out alike share one engine (a new
``adamw(lr=...)`` object per step reuses it).

One step (``run_grad``): the step status left in flight by the last call is read (and a rank
whose update failed is restored from a healthy one: ``repair``), the params are found (or
packed) in a param set, a ``Run`` starts the step machine, the backward (or the given
gradients) fills and reduces the buckets, each bucket is transformed and updated
(``fdp/_fused/run.py``), the run's ``Verdict`` is taken, and the params come back as views of
the set that holds the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _internals, _tree
from .._comm.agree import count_and_check_active, count_ranks, verify_layout
from .._comm.collectives import broadcast, wait
from .._errors import CollectiveError
from .._log import log
from .._plan.bucket import BucketPlan
from .._slices.exchange import Owners
from .._slices.geometry import Key, Slices, Span, Spans
from .._step.autodiff import autograd_on, local_grads, local_grads_into
from .._step.config import StepConfig
from .._step.machine import Step, StepMachine
from .._step.record import StepRecord
from .buckets import Buckets, BucketViews
from .micro import MicroRun
from .mode import StepMode, Verdict, refused
from .params import ParamSet
from .program import Program
from .run import Run, status_failed
from .state import FusedState, StateLayout
from .stores import Accumulation, Store, StoreKind, store_for
from .traced import orders as traced_orders

__all__ = ["Engine", "StepMemory"]


class StepMemory(NamedTuple):
    """What a fused step holds besides the optimizer state it is given, in bytes
    (``step.memory()``): a footprint to check, and to compare between step kinds.

    Attributes:
      param_sets: flat param sets held (a pure step cycles through two once warm; a donated
        one, one; a fully sharded one holds this rank's slices only).
      params: their bytes.
      gradients: the flat gradient buffers the buckets are filled and reduced in (a fully
        sharded step: a few transient ones, shared by the buckets in flight).
      accumulation: ``step.accumulate``'s buffers (0 before its first call).
      gathered: fully sharded params: bytes of units' params gathered right now (0 between
        steps and after an inference forward).
    """

    param_sets: int
    params: int
    gradients: int
    accumulation: int
    gathered: int


class TracedVerdicts(NamedTuple):
    """What compiled steps decided (``skip_nonfinite``'s check, a loss scale's), written by
    their graphs (0-d tensors on the step's device: reading one waits for the step):
    ``finite``, whether the last compiled step updated; ``skipped``, how many compiled steps
    updated nothing."""

    finite: torch.Tensor
    skipped: torch.Tensor


class Engine:
    """One layout's fused step machinery (see the module docstring)."""

    def __init__(self, config: StepConfig, plan: BucketPlan, keys: tuple[Key, ...], whole_parts: frozenset[int],
                 name: str, decayed_apart: frozenset[int] = frozenset()) -> None:
        self.config, self.plan, self.keys, self.name = config, plan, keys, name
        self.mesh, self.group = config.mesh, config.mesh.full
        store: Store = store_for(config, plan, name)
        self.store = store
        # The keys the kernel calls run over: a part decayed apart (``Program.decayed_apart``)
        # runs as group 1 (no decay) throughout, its group-0 runs decayed first (``decays``).
        self.run_keys = tuple((p, 1) if p in decayed_apart else (p, g) for p, g in keys)
        wires = [config.wire or b.dtype for b in plan.buckets]
        self.machine = StepMachine(plan, self.group, store.comm_hook(config.hook), store.bucket_buffers(wires),
                                   debug=config.debug, hook_threshold_bytes=store.hook_threshold, steps=config.steps)
        store.attach(self.machine)
        self.parts = 1 + max((k[0] for k in keys), default=0)
        self.whole_parts = whole_parts
        slices = store.slices
        # Sliced, whole leaves (Muon's matrices) are each owned and updated by one rank.
        owners = None
        if store.scatter is not None and whole_parts:
            owners = Owners(plan, slices, [i for i, k in enumerate(keys) if k[0] in whole_parts])
        self.owners = owners
        spans = self.spans_of(slices.rank)
        # Per bucket: ``(part, spans)`` of each part decayed apart, its group-0 runs (in chunks).
        decays: list[list[tuple[int, list[Span]]]] = [[] for _ in plan.buckets]
        if decayed_apart:
            by_group = self.spans_of(slices.rank, keys).by_key
            decays = [[(p, s) for (p, g), s in r if p in decayed_apart and g == 0] for r in by_group]
        self.buckets = Buckets(
            name=name, plan=plan, mesh=self.mesh, machine=self.machine, store=store, spans=spans, decays=decays,
            # one kernel call on the (slice's) flat tensors: one key, one span covering it, one chunk
            whole=[len(r) == 1 and r[0][1] == [Span(0, slices.numel(b), 0, None)] for b, r in enumerate(spans.by_key)],
            cast=[w != b.dtype for w, b in zip(wires, plan.buckets)], owners=owners, views=BucketViews(plan),
            skip_nonfinite=config.skip_nonfinite, sharded=store.scatter is not None,
            sliced_sets=store.kind is StoreKind.SLICED, group=self.group)
        # the params tree with each leaf's index for a leaf: its structure, for a traced step
        self.skeleton = _tree.unflatten(plan.treedef, list(range(len(plan.slots))))
        self.orders = traced_orders(self.buckets, self.parts)  # (each bucket's runs as a traced update takes them)
        self.refusal: str | None = None  # why this engine's state is refused (a failure left replicas apart)
        # What compiled steps decided (``skip_nonfinite``, a loss scale), written by the graph on
        # the step's device (``TracedVerdicts``; ``decided``: a compiled step has written them);
        # ``traced_last``: the last step was a compiled one that decided
        self.device = device = plan.buckets[0].device if plan.buckets else torch.device("cpu")
        self.verdicts = TracedVerdicts(torch.ones((), dtype=torch.bool, device=device),
                                       torch.zeros((), dtype=torch.int64, device=device))
        self.decided = False
        self.traced_last = False
        self.checked: dict | None = None  # the buffers of the last state that passed the layout check
        self.acc = Accumulation()  # the micro-batches' local gradients since the last step
        # ``reduce_micro_batches``: each micro-batch reduce-scattered, the sum kept sliced
        self.reduces_micro_batches = config.reduce_micro_batches and store.scatter is not None
        where = "" if store.scatter is None else (f", sharded over {slices.size} ranks" + (
            f" x {self.mesh.replicate.size} replicas" if self.mesh.replicate is not None else ""))
        verify_layout(
            [(s.path, s.shape, str(s.dtype).replace("torch.", "")) for s in plan.slots], self.group, name,
            extra=f"param groups {list(keys)}, bucket caps {list(plan.caps)}, {self.machine.hook.describe()}{where}",
        )

    # ------------------------------------------------------------------ what a program asks
    def mode_of(self, program: Program) -> StepMode:
        """How ``program``'s steps run on this engine (decided once per program)."""
        store = self.store
        return StepMode.of(
            needs_all=program.whole_tree or self.config.skip_nonfinite or self.owners is not None,
            sharded=store.scatter is not None, lands_early=self.machine.hooked_buckets > 0,
            has_status=self.machine.status, sums_in_place=self.machine.hook.in_place)

    def state_layout(self, program: Program) -> StateLayout:
        return StateLayout(program, self.plan, self.store.slices, self.mesh.shard, self.name, self.spans_of)

    def spans_of(self, rank: int, keys: tuple[Key, ...] | None = None) -> Spans:
        """Rank ``rank``'s spans of every bucket (``fdp._slices.geometry``), by the keys the
        kernel calls run over (or by ``keys``)."""
        slices = self.store.slices
        if rank != slices.rank:
            slices = Slices(self.plan, slices.size, rank)
        owner = self.owners.owner if self.owners is not None else None
        return Spans(self.plan, self.run_keys if keys is None else keys, set(self.whole_parts), slices, self.parts,
                     owner)

    def check_state(self, layout: StateLayout, state: Any, repairing: bool = False) -> FusedState:
        """``state``, checked against ``layout``; refused while the engine refuses its state
        (unless this call restores it: ``repair``)."""
        if self.refusal is not None and not repairing:
            raise RuntimeError(f"{self.name}: {self.refusal}")
        # The state a step returned comes back: its layout and buffers were checked then.
        if (type(state) is FusedState and state.layout is layout.layout and state.buffers is self.checked
                and state.transforms.__len__() == len(layout.transforms)):
            return state
        state = layout.check(state)
        self.checked = state.buffers
        return state

    def memory(self) -> StepMemory:
        """What this engine holds now (see ``StepMemory``)."""
        sets = self.store.params.sets
        acc = self.acc.slices if self.acc.slices is not None else \
            self.acc.grads if self.acc.flats is None else self.acc.flats
        return StepMemory(
            param_sets=len(sets), params=sum(f.untyped_storage().nbytes() for s in sets for f in s.flats),
            gradients=self.machine.buffers.nbytes(),
            accumulation=sum(t.untyped_storage().nbytes() for t in acc or () if t is not None),
            gathered=self.store.gathered_bytes())

    def fresh_state(self) -> None:
        """A fresh or loaded state is given: a failed step's partial update is behind us."""
        self.refusal = None

    # ------------------------------------------------------------------ accumulation
    def accumulate(self, fn: Callable, has_aux: bool, params: Any, rest: tuple, kwargs: dict) -> Any:
        """This rank's gradients of one micro-batch, added in place into the accumulation
        buffers (the first one copied): no communication, no gradient tree kept. The next
        step adds its own and averages the sum (DDP's ``no_sync``, then a step)."""
        self._check_callable()
        if self.reduces_micro_batches:
            return self._accumulate_reduced(fn, has_aux, params, rest, kwargs)
        return self.store.accumulate(self.acc, fn, has_aux, params, rest, kwargs)

    def _accumulate_reduced(self, fn: Callable, has_aux: bool, params: Any, rest: tuple, kwargs: dict) -> Any:
        """One micro-batch reduce-scattered as its backward goes, this rank's slice of its mean
        added into the sharded sum (``reduce_micro_batches``: ``fdp/_fused/micro.py``)."""
        with autograd_on():
            self._settle()
            sets = self.store.params
            src, _ = sets.current(sets.leaves_of(params, "params"), False)
            micro = MicroRun(self.buckets, self.acc, self.machine.scale_for(self.group.size), self.config.engine)
            value = micro.run(fn, has_aux, src, rest, kwargs)
            self.config.steps.last = StepRecord(micro.step.n, "accumulate", True, micro.step.timeline())
            return value

    # ------------------------------------------------------------------ one step
    def run_grad(self, program: Program, mode: StepMode, layout: StateLayout, fn: Callable, has_aux: bool,
                 params: Any, state: Any, rest: tuple, kwargs: dict, accumulate: Any, donate: bool,
                 active: bool | None = None) -> tuple[Any, FusedState, Any]:
        """One step from the loss: backward, all-reduce, update. ``active`` (uneven inputs; every
        rank passes it): False for a rank without data of its own, whose gradients count as
        zeros; the mean is over the active ranks (one small all-reduce counts them)."""
        self._check_callable()
        with autograd_on():
            owed = self._settle()
            state = self.check_state(layout, state, repairing=owed is not None)
            n = self.group.size
            acc = self.acc
            if active is not None:
                n = count_and_check_active(active, self.group, f"{self.name}: active-rank count")
                if n == 0:
                    raise ValueError(f"{self.name}: no rank is active; stop the loop when fdp.any_rank(has_data) "
                                     "is False")
                if not active and acc.count:
                    raise ValueError(f"{self.name}: step.idle after step.accumulate: a rank with micro-batches of "
                                     "its own has data; call the step itself")
            given, owned, taken, reduced = None, False, acc.count, None
            if acc.count:
                if accumulate is not None:
                    raise ValueError(f"{self.name}: step.accumulate(...) was called before this step, and it "
                                     "also got accumulate=: use one way of accumulating")
                owned, acc.count = True, 0
                if acc.slices is not None:  # reduced as they went: this rank's slices of their sum
                    reduced, acc.slices = acc.slices, None
                else:
                    given = acc.grads
            elif accumulate is not None:
                given = self.plan.leaves_of(accumulate, f"{self.name} accumulate")
            lost, acc.lost = acc.lost, None
            src, dst = self._sets(params, donate)
            if owed is not None:
                self.repair(owed, src, state, given=given is not None or reduced is not None, inputs=params)
            run = Run(self.buckets, mode, program, layout, state, src, dst, kind="grad", acc=given,
                      acc_owned=owned and given is not None, scale=self.machine.scale_for(n), active=active is None or bool(active),
                      reduced=reduced)

            def feed(step: Step) -> Any:
                if lost is not None:  # (inside the step: the other ranks learn of it in this call)
                    raise RuntimeError(lost)
                return self.backward(step, src, fn, has_aux, rest, kwargs)

            try:
                return self._run(run, state, src, dst, feed)
            except BaseException:
                if owned and (run.step.early or run.step.early_ranks or not any(run.updated)):
                    # The micro-batches went into this step's buckets (added to in place, freed):
                    # a retry of this call alone would average a gradient without them.
                    acc.lost = (
                        f"{self.name}: step {run.step.n} failed after step.accumulate(...) had summed {taken} "
                        "micro-batch(es) on this rank, and they went with it; this call alone would average a "
                        "gradient without them. Redo the whole cycle: step.accumulate(...) for each micro-batch "
                        "again, then the step")
                raise

    def backward(self, step: Step, src: ParamSet, fn: Callable, has_aux: bool, rest: tuple, kwargs: dict) -> Any:
        """The loss and its backward on the params in ``src``, each leaf's gradient handed to the
        step machine by its hook; returns the loss (or ``(loss, aux)``)."""
        machine, engine = self.machine, self.config.engine
        if step.spec.acc_owned and engine == "autograd" and not machine.hooked_buckets and self.store.compute is None:
            # After step.accumulate, with every bucket launched when the backward returns: the
            # last micro-batch is added into the accumulation buffers by autograd too, and each
            # bucket is filled from its flat sum (no gradient tree, no per-leaf add or copy).
            value = local_grads_into(fn, has_aux, (None, *rest), kwargs, src.inner(self.plan), self.plan.treedef,
                                     self.acc.grads, step.on_backward_start, src.reused)
            step.summed_into(self.acc.flats)
            return value
        leaves, wrap = self.store.differentiated(src, step)
        local, value = local_grads(engine, fn, 0, has_aux, (None, *rest), kwargs, leaves, self.plan.treedef,
                                   machine.leaf_hooks[engine], step.on_backward_start, wrap=wrap)
        step.backward_done(local, machine.unhooked)
        return value

    def run_update(self, program: Program, mode: StepMode, layout: StateLayout, grads: Any, state: Any, params: Any,
                   active: bool | None, donate: bool) -> tuple[Any, FusedState]:
        """One step from gradients computed any other way: all-reduce, update."""
        self._check_callable()
        with autograd_on():
            owed = self._settle()
            state = self.check_state(layout, state, repairing=owed is not None)
            n = count_and_check_active(active, self.group, f"{self.name}: active-rank count")
            if n == 0:
                raise ValueError(f"{self.name}: no rank is active; stop the loop when fdp.any_rank(has_data) is False")
            is_active = active is None or bool(active)
            glist = self.plan.leaves_of(grads, f"{self.name} grads") if is_active else None
            src, dst = self._sets(params, donate)
            if owed is not None:
                self.repair(owed, src, state, given=True, inputs=params)
            if self.acc.count:
                raise ValueError(f"{self.name}: step.accumulate(...) was called before step.update, which takes "
                                 "gradients computed any other way: accumulate into those instead")
            run = Run(self.buckets, mode, program, layout, state, src, dst, kind="all_reduce", acc=None,
                      acc_owned=False, scale=self.machine.scale_for(n), active=is_active)

            def given(step: Step) -> None:
                if glist is not None:
                    step.give(glist)
                step.launch_ready(force=True)

            out_params, out_state, _ = self._run(run, state, src, dst, given)
            return out_params, out_state

    def _check_callable(self) -> None:
        if _tree.compiling():
            raise RuntimeError(f"{self.name} cannot be traced by torch.compile (its per-bucket updates "
                               "run from hooks inside autograd); compile a step of torch.func.grad, "
                               "reducer.all_reduce and opt.update instead (docs/compile.md)")
        if _internals.in_functorch_transform():
            raise RuntimeError(f"{self.name} cannot run inside a torch.func transform")

    def _settle(self) -> tuple[int, list[int]] | None:
        """``Steps.settle`` at the start of a step: a status that says the ranks ran different
        steps together (or that cannot be read) also refuses this engine's state, which that
        step updated on every rank."""
        try:
            return self.config.steps.settle()
        except CollectiveError as e:
            self.refusal = status_failed("the last step", e)
            raise

    def repair(self, owed: tuple[int, list[int]], src: ParamSet, state: FusedState, given: bool,
               inputs: Any = None) -> None:
        """Step ``n``'s update failed on the ranks ``failed`` after the others had made theirs
        (``owed``; its status, left in flight by ``Run.close``, was read at the start of this
        call): every rank's inputs to this call, the params in ``src`` and the optimizer
        state, become those of the lowest-ranked rank whose update succeeded. Every such rank
        holds step ``n``'s exact result, so the replicas go on from it as if nothing had
        failed. When the update failed on every rank there is no such rank: every rank
        refuses the state until a fresh one (as a failure found in the same step).

        Gradients this call was given (``given``: accumulated micro-batches, ``accumulate=``,
        ``step.update``'s) were computed by the failed ranks from params the others did not
        have: when any rank has some, every rank discards them after restoring and raises
        (one more small all-reduce decides it), and the next call goes on. The caller keeps
        the params it passed then (this call returns nothing): when they are not views of
        ``src`` (the params the step was first given, copied in), the restored values are
        written into them too (``inputs``: the params this call was given), so the next
        call starts from rank ``source``'s params on every rank."""
        n, failed = owed
        group, steps = self.group, self.config.steps
        steps.owed = None
        healthy = [r for r in range(group.size) if r not in failed]
        if not healthy:
            self.refusal = refused(f"the update of step {n} failed on every rank, each partly updating its "
                                   "optimizer state in place (and with donate=True the params)")
            raise RuntimeError(f"{self.name}: {self.refusal}")
        source = healthy[0]
        what = f"{self.name}: restoring the params and optimizer state of rank(s) {failed} from rank {source}"
        # Every tensor of the state, whatever pytree holds it (a transform's state, injected
        # hyper-parameters such as betas=(b1, b2)); plain Python values are the same everywhere.
        try:
            tensors = [*src.flats, state.step, *(t for k in sorted(state.buffers) for t in state.buffers[k]),
                       *(t for t in _tree.leaves(state.transforms) if isinstance(t, torch.Tensor)),
                       *(t for k in sorted(state.hyperparams or {}) for t in _tree.leaves(state.hyperparams[k])
                         if isinstance(t, torch.Tensor))]
            sent = [t if t.device == group.device else t.to(group.device) for t in tensors]
            unready: BaseException | None = None
        except Exception as e:  # noqa: BLE001 - every rank learns of it below, before any broadcast
            tensors, sent, unready = [], [], e
        # Every rank agrees it can take part before any broadcast: a rank that cannot would
        # leave the others in a collective it never enters.
        if count_ranks(unready is not None, group, f"{what}: ranks ready"):
            self.refusal = refused(f"restoring rank(s) {failed} from rank {source} after step {n} failed "
                                   f"({type(unready).__name__ + ': ' + str(unready) if unready else 'on another rank'})")
            raise RuntimeError(f"{self.name}: {self.refusal}") from unready
        works = [broadcast(t, source, group, what, async_op=True) for t in sent]
        for work in works:
            wait(work, group, what)
        for t, got in zip(tensors, sent):
            if got is not t:
                t.copy_(got)
        self.refusal = None
        log.warning("%s: the update of step %d failed on rank(s) %s after the others had made theirs; their params "
                    "and optimizer state are restored from rank %d's", self.name, n, failed, source)
        if count_ranks(given, group, f"{what}: ranks given gradients"):
            if inputs is not None:
                leaves = self.plan.leaves_of(inputs, f"{self.name} params")
                if not src.holds(leaves):
                    with torch.no_grad():
                        torch._foreach_copy_(leaves, src.inner(self.plan))
            raise CollectiveError(
                f"fdp: {self.name}: the update of step {n} failed on rank(s) {failed} after the others had made theirs; "
                f"every rank's params and optimizer state are now rank {source}'s (this is rank {group.rank}). The "
                f"gradients this call was given (step.accumulate's micro-batches, accumulate=, step.update's) were "
                f"computed on rank(s) {failed} from params the others did not have, so every rank discards them: "
                "compute them again and call the step again")

    def _sets(self, params: Any, donate: bool) -> tuple[ParamSet, ParamSet]:
        sets = self.store.params
        src, packed = sets.current(sets.leaves_of(params, "params"), donate)
        dst = src if donate or packed else sets.free(avoid=src)
        return src, dst

    def _take(self, verdict: Verdict) -> bool:
        """Keep what a run's verdict says of the state, and raise its error."""
        if verdict.refusal is not None:
            self.refusal = verdict.refusal
        if verdict.error is not None:
            raise verdict.error
        return verdict.updated

    def _run(self, run: Run, state: FusedState, src: ParamSet, dst: ParamSet,
             feed: Callable[[Step], Any]) -> tuple[Any, FusedState, Any]:
        machine, step, store = self.machine, run.step, self.store
        failing = True
        try:
            try:
                try:
                    value = feed(step)
                except CollectiveError:
                    raise  # (another rank's failure, or a broken group: nothing more to issue)
                except BaseException:
                    # This rank failed in its forward or backward: what the others still expect of
                    # it outside the machine goes out first (a fully sharded step's gathers).
                    store.failed()
                    raise
                machine.finish(step)
                run.await_replicas()
            except BaseException as e:
                if machine.in_flight is step:
                    machine.abort(step, e)
                if machine.in_flight is step:
                    # An early step whose buckets were drained: every rank issues the rest of
                    # the step's collectives, and its status fails the step everywhere.
                    run.fail(e)
                    run.drain()
                    self._take(run.finish())  # raises e
                if any(run.updated):
                    self.refusal = refused(
                        f"step {step.n} failed after {sum(run.updated)} of {len(run.updated)} buckets had updated the "
                        "optimizer state in place (and with donate=True the params)")
                raise
            updated = self._take(run.finish())
            failing = False
        finally:
            run.release()
            store.ended(quiet=failing)
        sets = store.params
        if updated:
            state.step.add_(1)
            sets.cur = dst
        transforms = tuple(run.tstates)
        if run.skipped == "nonfinite":  # nothing ran but the statistics the first global scale saw
            transforms = tuple(run.tstates[i] if i == run.shown else t for i, t in enumerate(state.transforms))
        out = state._replace(transforms=transforms)
        steps = self.config.steps
        steps.nonfinite += not updated
        steps.last = StepRecord(step.n, step.kind, updated, step.timeline())
        self.traced_last = False
        return sets.views(sets.cur), out, value
