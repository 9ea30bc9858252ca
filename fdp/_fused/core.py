"""``FusedCore``: what a fused step keeps across calls for one layout.

A core belongs to one Reducer and one layout: the Reducer's bucket plan (DDP's buckets, the
same ones ``reducer.grad`` reduces, so a fused step sums every gradient in the same order on
any world size) and each leaf's key (its part of a partition and its hyper-parameter group:
``Program.keys``). Inside each bucket, the leaves of one key form *spans*
(``fdp/_fused/spans.py``); a bucket's update is one kernel call per key over its spans. The core owns the step machine, the flat gradient
buffers, the param sets and, sharded, the slices and their collectives. Optimizers that
lay the params out alike share one core (a new ``adamw(lr=...)`` object per step reuses it).

One step: the params are found (or packed) in a param set (``ParamSets``), a ``Run`` starts
the step machine, the backward (or the given gradients) fills and reduces the buckets, each
bucket is transformed and updated (``fdp/_fused/run.py``), and the params come back as views
of the set that holds the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _tree, kernels
from .._comm.agree import count_and_check_active, count_ranks, verify_layout
from .._comm.collectives import broadcast, wait
from .._errors import CollectiveError
from .._log import log
from .._plan.bucket import BucketPlan
from .._plan.buffers import BucketBuffers
from .._step import functorch
from .._step.autodiff import autograd_on, local_grads, local_grads_into
from .._step.config import StepConfig
from .._step.machine import Step, StepMachine
from .._step.record import StepRecord
from ..hooks import CommHook
from .params import ParamSet, ParamSets
from .program import Program
from .run import Run
from .shard import Owners, Scatter, Shards, Straddles
from .spans import Key, Span, Spans
from .state import FusedState, StateLayout


class FusedCore:
    """One layout's fused step machinery (see the module docstring)."""

    def __init__(self, config: StepConfig, plan: BucketPlan, keys: tuple[Key, ...], whole_parts: frozenset[int],
                 name: str, decayed_apart: frozenset[int] = frozenset()) -> None:
        self.config, self.plan, self.keys, self.name = config, plan, keys, name
        # The keys the kernel calls run over: a part decayed apart (``Program.decayed_apart``)
        # runs as group 1 (no decay) throughout, its group-0 runs decayed first (``decays``).
        self.run_keys = tuple((p, 1) if p in decayed_apart else (p, g) for p, g in keys)
        self.mesh, self.group = config.mesh, config.mesh.full
        self.sharded = config.sharded
        sg = self.mesh.shard
        self.shards = Shards(plan, sg.size, sg.rank) if self.sharded else Shards(plan, 1, 0)
        self.scatter: Scatter | None = None
        self.straddles: Straddles | None = None
        hook = config.hook
        if self.sharded:  # (the Reducer has checked that the hook sums in place)
            scatter = self.scatter = Scatter(self.shards, sg)
            self.straddles = Straddles(plan, self.shards)
            hook = CommHook(lambda bucket, flat, group: scatter.launch(bucket.index, flat), dtype=hook.dtype,
                            name=f"{hook.name}, sharded", in_place=True)
        wires = [config.wire or b.dtype for b in plan.buckets]
        self.machine = StepMachine(plan, self.group, hook, self.bucket_buffers(wires), debug=config.debug,
                                   hook_threshold_bytes=self.hook_threshold(), steps=config.steps)
        self.params = self.param_sets()
        # Sharded (ZeRO-1/2), the updated slices are all-gathered at the end of the step.
        self.gathers_params = self.scatter is not None
        self.parts = 1 + max((k[0] for k in keys), default=0)
        self.whole_parts = whole_parts
        # Sharded, whole leaves (Muon's matrices) are each owned and updated by one rank.
        self.owners: Owners | None = None
        if self.sharded and whole_parts:
            self.owners = Owners(plan, self.shards, [i for i, k in enumerate(keys) if k[0] in whole_parts])
        self.spans = self.spans_of(self.shards.rank)
        # Per bucket: ``(part, spans)`` of each part decayed apart, its group-0 runs (in chunks).
        self.decays: list[list[tuple[int, list[Span]]]] = [[] for _ in plan.buckets]
        if decayed_apart:
            by_group = self.spans_of(self.shards.rank, keys).by_key
            self.decays = [[(p, spans) for (p, g), spans in r if p in decayed_apart and g == 0] for r in by_group]
        # Per bucket: whether its update is one kernel call on the (slice's) flat tensors
        # themselves (one key, one span covering it, one chunk), and whether the wire is cast.
        self.whole = [len(r) == 1 and r[0][1] == [Span(0, self.shards.numel(b), 0, None)]
                      for b, r in enumerate(self.spans.by_key)]
        self.cast = [w != b.dtype for w, b in zip(wires, plan.buckets)]
        self.templates = [[torch.empty(s, device="meta") for s in b.shapes] for b in plan.buckets]
        self.scratch: list[torch.Tensor | None] = [None] * len(plan.buckets)  # params-dtype grads of a cast wire
        self.broken: str | None = None
        self.checked: dict | None = None  # the buffers of the last state that passed the layout check
        # Local gradients of the micro-batches since the last step (``accumulate``): flat per
        # bucket in the params' dtype, as per-leaf views; made on first use.
        self.acc: list[torch.Tensor] | None = None
        self.acc_flats: list[torch.Tensor] | None = None
        self.accumulated = 0
        # per bucket: (the gradient flat, its leaves' views) last made (``leaf_views``)
        self.views: list[tuple[torch.Tensor, list[torch.Tensor]] | None] = [None] * len(plan.buckets)
        where = "" if not self.sharded else (f", sharded over {sg.size} ranks" + (
            f" x {self.mesh.replicate.size} replicas" if self.mesh.replicate is not None else ""))
        verify_layout(
            [(s.path, s.shape, str(s.dtype).replace("torch.", "")) for s in plan.slots], self.group, name,
            extra=f"param groups {list(keys)}, bucket caps {list(plan.caps)}, {hook.describe()}{where}",
        )

    # ------------------------------------------------------------------ what a layout keeps
    def bucket_buffers(self, wires: list[torch.dtype]) -> BucketBuffers:
        """The flat buffers the buckets are filled and reduced in: one per bucket, reused."""
        return BucketBuffers(self.plan, wires, reuse=True, padded=self.shards.padded)

    def hook_threshold(self) -> int:
        """The step machine's ``hook_threshold_bytes`` (the Reducer's)."""
        return self.config.hook_threshold_bytes

    def param_sets(self) -> Any:
        """The flat param buffers (``ParamSets``: the whole padded buckets)."""
        return ParamSets(self.plan, self.shards.padded, self.name)

    # ------------------------------------------------------------------ pieces a run uses
    def reduced(self, b: int, mine: torch.Tensor, keep: bool) -> torch.Tensor:
        """Bucket ``b``'s reduced (slice of the) gradient ``mine``, as the run keeps it (here:
        ``mine`` itself, a view of the bucket's buffer; ``keep``: the run needs it after the
        bucket's collective has landed, not only while it lands)."""
        return mine

    def grad_of(self, b: int, reduced: torch.Tensor) -> torch.Tensor:
        """Bucket ``b``'s (slice of the) averaged gradient in the params' dtype (a cast wire is
        cast once, into a buffer kept for the next step)."""
        bucket = self.plan.buckets[b]
        if reduced.dtype == bucket.dtype:
            return reduced
        buf = self.scratch[b]
        if buf is None:
            buf = self.scratch[b] = torch.empty(reduced.numel(), dtype=bucket.dtype, device=bucket.device)
        return buf.copy_(reduced)

    def leaf_views(self, b: int, g: torch.Tensor) -> list[torch.Tensor]:
        """Bucket ``b``'s leaves as views of its gradient ``g`` (unsharded: the whole bucket), in
        buffer order (one C++ call; the same views again while ``g`` is the same buffer)."""
        made = self.views[b]
        if made is not None and made[0] is g:
            return made[1]
        views = kernels.views(g, self.templates[b])
        self.views[b] = (g, views)
        return views

    def check_state(self, layout: StateLayout, state: Any, repairing: bool = False) -> FusedState:
        """``state``, checked against ``layout``; refused while the core is ``broken`` (unless
        this call restores it: ``repair``)."""
        if self.broken is not None and not repairing:
            raise RuntimeError(f"{self.name}: {self.broken}")
        # The state a step returned comes back: its layout and buffers were checked then.
        if (type(state) is FusedState and state.layout is layout.layout and state.buffers is self.checked
                and state.transforms.__len__() == len(layout.transforms)):
            return state
        state = layout.check(state)
        self.checked = state.buffers
        return state

    def spans_of(self, rank: int, keys: tuple[Key, ...] | None = None) -> Spans:
        """Rank ``rank``'s spans of every bucket (``fdp/_fused/spans.py``), by the keys the kernel
        calls run over (or by ``keys``)."""
        shards = self.shards if rank == self.shards.rank else Shards(self.plan, self.shards.size, rank)
        owner = self.owners.owner if self.owners is not None else None
        return Spans(self.plan, self.run_keys if keys is None else keys, set(self.whole_parts), shards, self.parts,
                     owner)

    def state_layout(self, program: Program) -> StateLayout:
        return StateLayout(program, self.plan, self.shards, self.mesh.shard, self.name, self.spans_of)

    # ------------------------------------------------------------------ accumulation
    def accumulate(self, fn: Callable, has_aux: bool, params: Any, rest: tuple, kwargs: dict) -> Any:
        """This rank's gradients of one micro-batch, added in place into the accumulation
        buffers (the first one copied): no communication, no gradient tree kept. The next
        step adds its own and averages the sum (DDP's ``no_sync``, then a step)."""
        self._check_callable()
        with autograd_on():
            leaves = self.plan.leaves_of(params, f"{self.name}.accumulate params")
            if self.accumulated and self.config.engine == "autograd":  # added in place by autograd itself
                # (the params the step returned: their set's own views and autograd leaves, reused)
                cur = self.params.cur
                reused = None
                if type(cur) is ParamSet and cur.holds(leaves):
                    leaves, reused = cur.inner(self.plan), cur.reused
                value = local_grads_into(fn, has_aux, (params, *rest), kwargs, leaves, self.plan.treedef, self.acc,
                                         reused=reused)
                self.accumulated += 1
                return value
            grads, value = local_grads(self.config.engine, fn, 0, has_aux, (params, *rest), kwargs, leaves,
                                       self.plan.treedef, None, None)
            if self.acc is None:
                flats = self.acc_flats = [torch.empty(b.numel, dtype=b.dtype, device=b.device)
                                          for b in self.plan.buckets]
                self.acc = _tree.leaves(self.plan.views(flats))
            if self.accumulated:
                torch._foreach_add_(self.acc, grads)
            else:
                torch._foreach_copy_(self.acc, grads)
            self.accumulated += 1
        return value

    # ------------------------------------------------------------------ one step
    def run_grad(self, program: Program, layout: StateLayout, fn: Callable, has_aux: bool, params: Any,
                 state: Any, rest: tuple, kwargs: dict, accumulate: Any, donate: bool,
                 active: bool | None = None) -> tuple[Any, FusedState, Any]:
        """One step from the loss: backward, all-reduce, update. ``active`` (uneven inputs; every
        rank passes it): False for a rank without data of its own, whose gradients count as
        zeros; the mean is over the active ranks (one small all-reduce counts them)."""
        self._check_callable()
        with autograd_on():
            owed = self._settle()
            state = self.check_state(layout, state, repairing=owed is not None)
            n = self.group.size
            if active is not None:
                n = count_and_check_active(active, self.group, f"{self.name}: active-rank count")
                if n == 0:
                    raise ValueError(f"{self.name}: no rank is active; stop the loop when fdp.any_rank(has_data) "
                                     "is False")
                if not active and self.accumulated:
                    raise ValueError(f"{self.name}: step.idle after step.accumulate: a rank with micro-batches of "
                                     "its own has data; call the step itself")
            acc, owned = None, False
            if self.accumulated:
                if accumulate is not None:
                    raise ValueError(f"{self.name}: step.accumulate(...) was called before this step, and it "
                                     "also got accumulate=: use one way of accumulating")
                acc, owned, self.accumulated = self.acc, True, 0
            elif accumulate is not None:
                acc = self.plan.leaves_of(accumulate, f"{self.name} accumulate")
            src, dst = self._sets(params, donate)
            if owed is not None:
                self.repair(owed, src, state, given=acc is not None)
            run = Run(self, program, layout, state, src, dst, kind="grad", acc=acc, acc_owned=owned,
                      scale=self.machine.scale_for(n), active=active is None or bool(active))

            return self._run(run, state, src, dst, lambda step: self.backward(step, src, fn, has_aux, rest, kwargs))

    def backward(self, step: Step, src: ParamSet, fn: Callable, has_aux: bool, rest: tuple, kwargs: dict) -> Any:
        """The loss and its backward on the params in ``src``, each leaf's gradient handed to the
        step machine by its hook; returns the loss (or ``(loss, aux)``)."""
        machine = self.machine
        leaves = src.inner(self.plan)  # (the padding of a sharded step's flats is left out)
        engine = self.config.engine
        if step.spec.acc_owned and engine == "autograd" and not machine.hooked_buckets:
            # After step.accumulate, with every bucket launched when the backward returns: the
            # last micro-batch is added into the accumulation buffers by autograd too, and each
            # bucket is filled from its flat sum (no gradient tree, no per-leaf add or copy).
            value = local_grads_into(fn, has_aux, (None, *rest), kwargs, leaves, self.plan.treedef, self.acc,
                                     step.on_backward_start, src.reused)
            step.summed_into(self.acc_flats)
            return value
        local, value = local_grads(engine, fn, 0, has_aux, (None, *rest), kwargs, leaves,
                                   self.plan.treedef, machine.leaf_hooks[engine], step.on_backward_start)
        step.backward_done(local, machine.unhooked)
        return value

    def run_update(self, program: Program, layout: StateLayout, grads: Any, state: Any, params: Any,
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
                self.repair(owed, src, state, given=True)
            if self.accumulated:
                raise ValueError(f"{self.name}: step.accumulate(...) was called before step.update, which takes "
                                 "gradients computed any other way: accumulate into those instead")
            run = Run(self, program, layout, state, src, dst, kind="all_reduce", acc=None, acc_owned=False,
                      scale=self.machine.scale_for(n), active=is_active)

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
        if functorch.in_transform():
            raise RuntimeError(f"{self.name} cannot run inside a torch.func transform")

    def _settle(self) -> tuple[int, list[int]] | None:
        """``Steps.settle`` at the start of a step: a status that says the ranks ran different
        steps together (or that cannot be read) also refuses this core's state, which that
        step updated on every rank."""
        try:
            return self.config.steps.settle()
        except CollectiveError as e:
            self.refuse_after_status("the last step", e)
            raise

    def refuse_after_status(self, which: str, e: CollectiveError) -> None:
        """``which`` step's status, issued after its updates, failed with ``e`` (the ranks ran
        different steps together, or the group broke): its updates may differ between the
        replicas, so the state is refused until a fresh one."""
        self.broken = (f"{which}'s status failed after its updates ({e}), so the replicas' states may differ; load "
                       "a saved state (step.state_from_tree, fdp.load) or make a new one (step.init) on every rank "
                       "to go on")

    def repair(self, owed: tuple[int, list[int]], src: ParamSet, state: FusedState, given: bool) -> None:
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
        (one more small all-reduce decides it), and the next call goes on."""
        n, failed = owed
        group, steps = self.group, self.config.steps
        steps.owed = None
        healthy = [r for r in range(group.size) if r not in failed]
        if not healthy:
            self.broken = (f"the update of step {n} failed on every rank, each partly updating its optimizer state "
                           "in place (and with donate=True the params); load a saved state (step.state_from_tree, "
                           "fdp.load) or make a new one (step.init) on every rank to go on")
            raise RuntimeError(f"{self.name}: {self.broken}")
        source = healthy[0]
        tensors = [*src.flats, state.step, *(t for k in sorted(state.buffers) for t in state.buffers[k]),
                   *(t for t in _tree.leaves(state.transforms) if isinstance(t, torch.Tensor)),
                   *(state.hyperparams[k] for k in sorted(state.hyperparams or {}))]
        what = f"{self.name}: restoring the params and optimizer state of rank(s) {failed} from rank {source}"
        sent = [t if t.device == group.device else t.to(group.device) for t in tensors]
        works = [broadcast(t, source, group, what, async_op=True) for t in sent]
        for work in works:
            wait(work, group, what)
        for t, got in zip(tensors, sent):
            if got is not t:
                t.copy_(got)
        self.broken = None
        log.warning("%s: the update of step %d failed on rank(s) %s after the others had made theirs; their params "
                    "and optimizer state are restored from rank %d's", self.name, n, failed, source)
        if count_ranks(given, group, f"{what}: ranks given gradients"):
            raise CollectiveError(
                f"fdp: {self.name}: the update of step {n} failed on rank(s) {failed} after the others had made theirs; "
                f"every rank's params and optimizer state are now rank {source}'s (this is rank {group.rank}). The "
                f"gradients this call was given (step.accumulate's micro-batches, accumulate=, step.update's) were "
                f"computed on rank(s) {failed} from params the others did not have, so every rank discards them: "
                "compute them again and call the step again")

    def on_filled(self, b: int) -> None:
        """``StepSpec.on_filled`` of this core's steps (fully sharded params free a unit)."""

    def _sets(self, params: Any, donate: bool) -> tuple[ParamSet, ParamSet]:
        src, packed = self.params.current(self.params.leaves_of(params, "params"), donate)
        dst = src if donate or packed else self.params.free(avoid=src)
        return src, dst

    def _run(self, run: Run, state: FusedState, src: ParamSet, dst: ParamSet,
             feed: Callable[[Step], Any]) -> tuple[Any, FusedState, Any]:
        machine, step = self.machine, run.step
        try:
            value = feed(step)
            machine.finish(step)
            run.reduced()
        except BaseException as e:
            if machine.in_flight is step:
                machine.abort(step, e)
            if machine.in_flight is step:
                # An early step whose buckets were drained: every rank issues the rest of
                # the step's collectives, and its status fails the step everywhere.
                run.fail(e)
                run.drain()
                run.finish()  # raises e
            if any(run.updated):
                self.broken = (f"step {step.n} failed after {sum(run.updated)} of {len(run.updated)} buckets had "
                               "updated the optimizer state in place (and with donate=True the params); load a "
                               "saved state (step.state_from_tree, fdp.load) or make a new one (step.init) to go on")
            raise
        updated = run.finish()
        if updated:
            state.step.add_(1)
            self.params.cur = dst
        transforms = tuple(run.tstates)
        if run.skipped == "nonfinite":  # nothing ran but the statistics the first global scale saw
            transforms = tuple(run.tstates[i] if i == run.shown else t for i, t in enumerate(state.transforms))
        out = state._replace(transforms=transforms)
        steps = self.config.steps
        steps.nonfinite += not updated
        steps.last = StepRecord(step.n, step.kind, updated, step.timeline())
        return self.params.views(self.params.cur), out, value
