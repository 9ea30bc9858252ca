"""``Run``: one fused step's per-bucket progress, from the buckets' collectives to the status.

A bucket *arrives* when its collective lands (sharded: this rank's slice summed, and over the
replicas of a 2-D mesh); the chain's leading element and per-leaf transforms (the program's
*prefix*) run on it then, and a global scale right after them has its per-leaf statistics
measured. It is *updated* by the optimizer's kernel, per run of leaves of one
hyper-parameter group, on its (slice of the) flat params, gradients and state: on arrival,
while the backward goes on, when nothing needs every bucket first (*early*); otherwise once
every bucket has arrived, after the whole-tree transforms and the finite check. Sharded,
each bucket's params are then *gathered* from every rank.

When each of these happens is the step's ``StepMode`` (``fdp/_fused/mode.py``), decided once
per program; what the run reads about the buckets is its engine's ``Buckets``
(``fdp/_fused/buckets.py``); where params, gradients and state live is the engine's store.

Failures. Every collective of a step is issued on every rank, in the same order, whatever
happened locally: a rank whose backward, transform or kernel failed skips its own work, goes
on issuing the step's collectives (zeros where it has nothing), and the step's status, issued
after the updates and gathers, tells every rank. When the updates wait for every bucket, a
rank whose backward failed stops every rank before any update, and the state stays usable
(``StepMode.status``: NaN buckets, or a status with the buckets). A step that fails after its
buckets were reduced is refused afterwards on every rank (some rank may have updated its state
in place), and so is one in which this rank had updated anything, or whose status could not be
exchanged: the run's ``Verdict`` says so, and the engine keeps the refusal.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .._comm.agree import count_ranks
from .._comm.collectives import wait
from .._errors import CollectiveError
from .._slices.exchange import Replicas
from .._slices.geometry import Span, pieces
from .._step.machine import Step, StepSpec, all_finite
from ..optim import GradientTransform
from .buckets import Buckets
from .mode import StepMode, Verdict, VerdictTiming, refused
from .params import ParamSet
from .program import Program
from .state import FusedState, StateLayout


class Run:
    """One fused step (see the module docstring). The engine makes one per call; ``finish``
    returns its ``Verdict``."""

    def __init__(self, buckets: Buckets, mode: StepMode, program: Program, layout: StateLayout, state: FusedState,
                 src: ParamSet, dst: ParamSet, *, kind: str, acc: list[torch.Tensor] | None, acc_owned: bool,
                 scale: float | None, active: bool, reduced: list[torch.Tensor | None] | None = None) -> None:
        bk = self.bk = buckets
        nb = len(bk.plan.buckets)
        self.mode, self.program, self.state, self.src, self.dst = mode, program, state, src, dst
        self.layout = layout
        # Each part's kernel for this step: an injected optimizer's bound to the state's values
        # (read here, once per step, before anything starts; the kernels then run in the hooks).
        # (a step without injected values takes the parts' own kernels without a call: the common case)
        self.kernels = program.default_kernels if program.injected is None and state.hyperparams is None \
            else program.kernels(state.hyperparams)
        # each part's count in its optimizer's dtype (a partition of SGD, int64, and Adam, float)
        self.counts = [state.step if part.count_dtype in (None, state.step.dtype) else state.step.to(part.count_dtype)
                       for part in program.parts]
        self.early = mode.on_arrival
        self.slices: list[torch.Tensor | None] = [None] * nb  # reduced (slices of) buckets, wire dtype
        self.grads: list[torch.Tensor | None] = [None] * nb   # ... in the params' dtype
        self.updated = bytearray(nb)
        self.tstates = list(state.transforms)
        self.stats: dict[int, torch.Tensor] = {}  # leaf -> the measured global scale's statistic
        self.coef: torch.Tensor | None = None     # the last global scale's factor, applied in update
        self.error: BaseException | None = None   # this rank's first failure
        self.skipped: str | None = None           # why nothing was updated: "nonfinite" or "scale"
        self.shown: int | None = None             # the global scale a rejected step was shown (its new state is kept)
        self.replicas = Replicas(bk.mesh.replicate, nb) if bk.sharded and bk.mesh.replicate is not None else None
        self.gathers: list[tuple[int, Any]] = []
        self.wholes: dict[int, torch.Tensor] = {}  # sharded: the whole leaves this rank owns, their gradients
        self.owned_params: dict[int, torch.Tensor] | None = None  # fully sharded: those leaves' params
        # ``reduce_micro_batches``: per bucket, the sum of the micro-batches ``step.accumulate``
        # reduced (this rank's slice, params' dtype); this step's arriving slice is added into it,
        # which then is the bucket's gradient (one set of sharded gradients, no kept copy).
        self.reduced = reduced
        self.step: Step = bk.machine.start(StepSpec(
            kind, what=bk.name, acc=acc, acc_owned=acc_owned, scale=scale, active=active, on_ready=self.arrive,
            status=mode.status, on_complete=bk.store.on_complete,
            on_filled=bk.store.on_filled))

    # ------------------------------------------------------------------ arrival
    def fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e

    def arrive(self, b: int, flat: torch.Tensor) -> None:
        """``StepSpec.on_ready``: bucket ``b``'s collective has landed in ``flat``. Runs inside
        the backward's hooks: it never raises (a failure is kept for the status)."""
        store = self.bk.store
        try:
            mine = store.scatter.finish(b, flat) if store.scatter is not None else flat
            if store.keep is not None:  # (added into the micro-batches' sum at once, it needs no copy of its own)
                mine = store.keep(b, mine, (not self.early and self.reduced is None) or self.replicas is not None)
        except Exception as e:  # noqa: BLE001 - reported through the step's status
            self.fail(e)
            mine = self.bk.wire_zeros(b)
        if self.replicas is not None:
            for landed in self.replicas.arrive(b, mine):
                self._arrived(landed, self.replicas.slices[landed])
            return
        self._arrived(b, mine)

    def _arrived(self, b: int, mine: torch.Tensor) -> None:
        """Bucket ``b``'s (slice of the) averaged gradient is final."""
        self.slices[b] = mine
        if self.error is not None:
            return
        program = self.program
        try:
            g = self.bk.views.grad_of(b, mine) if self.bk.cast[b] else mine
            if self.reduced is not None:  # the micro-batches before, added in the order FSDP2 adds them
                g, self.reduced[b] = self.reduced[b].add_(g), None
                if not self.bk.cast[b]:
                    self.slices[b] = g
            self.grads[b] = g
            for i in range(program.prefix):
                self._apply(i, b, g)
            if self.early:
                self.update(b)
            elif program.measure is not None:
                leaves, views = self._measurable(b, g)
                self.stats.update(zip(leaves, program.measure.stats(views)))
        except Exception as e:  # noqa: BLE001 - reported through the step's status
            self.fail(e)

    def _measurable(self, b: int, g: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
        """The leaves of bucket ``b`` this rank measures, as views of its gradient ``g``."""
        bk = self.bk
        if bk.store.straddles is not None:
            return bk.store.straddles.inside_views(b, g)
        return list(bk.plan.buckets[b].leaves), bk.views.leaf_views(b, g)

    def _apply(self, i: int, b: int, g: torch.Tensor) -> None:
        t: GradientTransform = self.program.transforms[i]
        tensors = [g] if t.reach == "element" else self.bk.views.leaf_views(b, g)
        self.tstates[i] = t.apply(tensors, self.tstates[i])

    def grad(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s (slice of the) gradient in the params' dtype (a cast wire is cast once)."""
        g = self.grads[b]
        if g is None:
            g = self.grads[b] = self.bk.views.grad_of(b, self.slices[b])
        return g

    # ------------------------------------------------------------------ update
    def update(self, b: int) -> None:
        """Bucket ``b``'s (slice of the) params, with its optimizer state, by the kernel."""
        bk, step, state, kernels = self.bk, self.step, self.state, self.kernels
        t0 = time.perf_counter()
        g = self.grads[b]
        if self.coef is not None:
            g.mul_(self.coef)
        for i in self.program.suffix:
            self._apply(i, b, g)
        p, src = self.dst.flats[b], self.src.flats[b]
        if bk.sliced_sets:  # whole buckets in the sets, of which this rank updates its slice
            mine = bk.store.params.mine
            p, src = mine(b, p), mine(b, src)
        if self.dst is not self.src:
            p.copy_(src)
        buffers, keys = state.buffers, self.layout.keys
        self.updated[b] = 1  # from the first kernel call on, the state may be changed in place
        for part, spans in bk.decays[b]:  # (a part decayed apart: its group-0 runs first)
            kernels[part].decay(pieces(p, spans, False), self.counts[part])
        if bk.whole[b]:  # one key, one span, one kernel call: the tensors themselves
            (part, group), _ = bk.spans.by_key[b][0]
            kernels[part].step(group, [p], [g], [[buffers[k][b]] for k in keys[part]], self.counts[part])
        else:
            # Per key, over its spans: in chunks (each chunk's passes stay in cache, and the
            # kernel's temporaries are chunk-sized: fdp.optim._flat.CHUNK's comment), or each
            # leaf whole, in its shape (Muon).
            for (part, group), spans in bk.spans.by_key[b]:
                states = [buffers[k][b] for k in keys[part]]
                if spans and spans[0].owned:  # whole leaves this rank owns: in the whole bucket
                    ps = self._owned(b, spans)
                    gs = [self.wholes[s.leaf] for s in spans]
                else:
                    ps, gs = pieces(p, spans, False), pieces(g, spans, False)
                kernels[part].step(group, ps, gs, [pieces(s, spans, True) for s in states], self.counts[part])
        times = step.times[b]
        times.update_start, times.update_end = t0 - step.t0, time.perf_counter() - step.t0

    def _owned(self, b: int, spans: list[Span]) -> list[torch.Tensor]:
        """The params of the whole leaves this rank owns in bucket ``b`` (views of the whole
        bucket, in their shapes; copied from the set read first when the step is pure; with
        fully sharded params, the whole leaves brought to their owner)."""
        if self.owned_params is not None:
            return [self.owned_params[s.leaf] for s in spans]
        dst, src = self.dst.flats[b], self.src.flats[b]
        out = []
        for s in spans:
            p = dst[s.lo:s.hi]
            if self.dst is not self.src:
                p.copy_(src[s.lo:s.hi])
            out.append(p.view(s.shape))
        return out

    # ------------------------------------------------------------------ after the buckets
    def await_replicas(self) -> None:
        """The step machine has every bucket: wait for the replica sums still in flight."""
        if self.replicas is not None:
            for b in self.replicas.wait_all():
                self._arrived(b, self.replicas.slices[b])

    def drain(self) -> None:
        """This rank's step failed before the machine finished (the machine has drained the
        buckets): issue the rest of the step's collectives, with nothing of its own."""
        if self.replicas is not None:
            self.replicas.drain(self.bk.wire_zeros)

    def release(self) -> None:
        """The step is over: drop this run's references to its tensors (the reduced slices and
        gradients, the owned leaves), so they go now, not when the garbage collector breaks the
        cycle between the run and its step (the step's ``on_ready`` is this run's method)."""
        nb = len(self.slices)
        self.slices, self.grads = [None] * nb, [None] * nb
        self.wholes, self.owned_params, self.stats, self.gathers = {}, None, {}, []
        self.reduced = None

    def finish(self) -> Verdict:
        """Everything after the buckets: the finite check, the whole-tree transforms, the
        updates left, the gathers, and the step's ``Verdict``: whether it updated (False: a
        non-finite step, or a global scale that skipped it), a refusal of the state from now
        on, and the error to raise (this rank's, or a ``CollectiveError`` when another rank
        failed)."""
        bk = self.bk
        finite = True
        if bk.skip_nonfinite:
            finite = self._guarded(lambda: all_finite(self.slices if self.reduced is None else
                                                      [self.grad(b) for b in range(len(self.slices))]), True)
            if bk.sharded:  # each rank checked its slices: the verdict is every rank's
                finite = count_ranks(not finite, bk.mesh.shard, f"{bk.name}: finite check") == 0
            if not finite:
                self.skipped = "nonfinite"
        if not self.early:
            # A rejected step still meets the first global scale: a loss scale decides about
            # non-finite gradients itself and backs off on them (only a scale that skips keeps
            # its new state; the same verdict on every rank, so the same collectives).
            finite = self._whole_tree(rejected=not finite) and finite
        if finite and bk.owners is not None:
            self._sharded_whole_leaves()
            return self.close(finite)
        if finite:
            for b in range(len(self.slices)):
                if not self.updated[b] and self.error is None:
                    try:
                        self.update(b)
                    except Exception as e:  # noqa: BLE001 - reported through the step's status
                        self.fail(e)
                if bk.store.gathers_params:  # bucket b's params gather while bucket b + 1 updates
                    if self.gathers:  # one in flight at a time: its staging buffer serves the next
                        self._gathered(*self.gathers.pop())
                    self.gathers.append((b, bk.store.scatter.gather(b, self.dst.flats[b], apart=True)))
            for b, work in self.gathers:
                self._gathered(b, work)
        return self.close(finite)

    def _sharded_whole_leaves(self) -> None:
        """A sharded step with whole leaves (Muon): each owner gets its leaves' gradients whole,
        every bucket is updated (the owners their whole leaves), the new params of the whole
        leaves go back to the ranks whose slices hold them, then the all-gathers: every
        collective issued on every rank, also after a failure here."""
        bk, shard = self.bk, self.bk.mesh.shard
        grads = [self.grads[b] if self.error is None and self.grads[b] is not None else self._zeros(b)
                 for b in range(len(self.slices))]
        if not bk.store.gathers_params and not bk.sliced_sets and not self.program.suffix:
            self._unit_whole_leaves(grads)
            return
        wholes = bk.owners.to_owners(grads, shard)
        if not bk.store.gathers_params and not bk.sliced_sets:
            # Fully sharded params: no rank holds a whole leaf; its owner gets its params too.
            self.owned_params = bk.owners.to_owners(self.src.flats, shard)
        if self.error is None:
            try:
                if self.coef is not None and wholes:
                    torch._foreach_mul_(list(wholes.values()), self.coef)
                for i in self.program.suffix:  # element-wise (per-leaf ones cannot shard)
                    self.tstates[i] = self.program.transforms[i].apply(list(wholes.values()), self.tstates[i])
                self.wholes = wholes
                for b in range(len(self.slices)):
                    self.update(b)
            except Exception as e:  # noqa: BLE001 - reported through the step's status
                self.fail(e)
        if self.owned_params is not None:  # fully sharded: the owners' updated leaves back into slices
            bk.owners.to_holders(self.dst.flats, shard, self.owned_params)
            return
        bk.owners.to_holders(self.dst.flats, shard)
        for b in range(len(self.slices)):  # one all-gather in flight at a time (its staging buffer)
            if self.gathers:
                self._gathered(*self.gathers.pop())
            self.gathers.append((b, bk.store.scatter.gather(b, self.dst.flats[b], apart=True)))
        for b, work in self.gathers:
            self._gathered(b, work)

    def _unit_whole_leaves(self, grads: list[torch.Tensor]) -> None:
        """``_sharded_whole_leaves`` with fully sharded params, one bucket (a unit) at a time:
        each owner gets the bucket's owned leaves' gradients and params whole, updates the
        bucket, and sends the new elements back into the holders' slices, so a rank holds one
        unit's owned matrices whole at most (three collectives per bucket, every one issued on
        every rank, also after a failure)."""
        shard, owners = self.bk.mesh.shard, self.bk.owners
        for b in range(len(self.slices)):
            if not owners.in_bucket(b):
                if self.error is None and not self.updated[b]:
                    self._guarded(lambda b=b: self.update(b), None)
                continue
            wholes = owners.to_owners(grads, shard, b)
            self.owned_params = owners.to_owners(self.src.flats, shard, b)
            if self.error is None:
                try:
                    if self.coef is not None and wholes:
                        torch._foreach_mul_(list(wholes.values()), self.coef)
                    self.wholes = wholes
                    self.update(b)
                except Exception as e:  # noqa: BLE001 - reported through the step's status
                    self.fail(e)
            owners.to_holders(self.dst.flats, shard, self.owned_params, b)
            self.wholes, self.owned_params = {}, {}

    def _guarded(self, fn: Any, default: Any) -> Any:
        if self.error is not None:
            return default
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported through the step's status
            self.fail(e)
            return default

    def _whole_tree(self, rejected: bool = False) -> bool:
        """Every bucket has arrived: run the program's middle transforms over all of them (a
        global scale's factor from every leaf's statistic, in leaf order). The last global
        scale's factor is left for ``update`` to multiply each bucket by. Returns False when
        a global scale skips the step (sharded, every rank decides it from the same gathered
        statistics, also a rank that failed, so all issue the same collectives after it).
        ``rejected``: the finite check has rejected the step; only the first global scale
        runs, to skip it itself (then ``skipped`` is ``"scale"`` and its state is kept)."""
        program = self.program
        if rejected and program.measure is None:
            return False
        for i in range(program.prefix, program.prefix + 1 if rejected else program.last_tree + 1):
            t = program.transforms[i]
            if self.coef is not None:  # an earlier global scale: its product first
                self._guarded(lambda coef=self.coef: self._mul_all(coef), None)
                self.coef = None
            if t.reach != "tree":
                self._guarded(lambda i=i: [self._apply(i, b, self.grad(b)) for b in range(len(self.slices))], None)
                continue
            stats = self._leaf_stats(t, measured=i == program.prefix)
            if self.error is not None and not self.bk.sharded:
                continue
            try:
                factor, new = t.scale(stats, self.tstates[i])
            except Exception as e:  # noqa: BLE001 - reported through the step's status
                if rejected:  # the finite check's skip stands (clip_by_global_norm(error_if_nonfinite=True))
                    return False
                self.fail(e)
                continue
            if self.error is None:
                self.tstates[i] = new
                if rejected:  # its statistics of this step are kept (a clip's norm: inf), nothing else
                    self.shown = i
            if factor is None:
                self.skipped = "scale"
                return False
            self.coef = factor
        return True

    def _mul_all(self, coef: torch.Tensor) -> None:
        torch._foreach_mul_([self.grad(b) for b in range(len(self.slices))], coef)

    def _leaf_stats(self, t: GradientTransform, measured: bool) -> list[torch.Tensor]:
        """Every leaf's statistic for the global scale ``t``, in leaf order (sharded: each
        leaf measured on one rank, then gathered: collectives every rank issues)."""
        bk = self.bk
        own: dict[int, torch.Tensor] = {}
        if self.error is None:
            try:
                if measured:
                    own = dict(self.stats)
                else:
                    for b in range(len(self.slices)):
                        leaves, views = self._measurable(b, self.grad(b))
                        own.update(zip(leaves, t.stats(views)))
            except Exception as e:  # noqa: BLE001 - reported through the step's status
                self.fail(e)
                own = {}
        straddles = bk.store.straddles
        if straddles is None:
            return [own[i] for i in range(len(bk.plan.slots))] if self.error is None else []
        grads = [self.grad(b) if self.error is None else self._zeros(b) for b in range(len(self.slices))]
        for b in straddles.buckets:  # (one bucket's straddling leaves whole at a time)
            leaves, wholes = straddles.exchange(grads, bk.mesh.shard, b)
            if self.error is None and leaves:
                try:
                    own.update(zip(leaves, t.stats(wholes)))
                except Exception as e:  # noqa: BLE001 - reported through the step's status
                    self.fail(e)
            del wholes
        return straddles.gather(own if self.error is None else {}, bk.mesh.shard)

    def _zeros(self, b: int) -> torch.Tensor:
        bucket = self.bk.plan.buckets[b]
        return torch.zeros(self.bk.store.slices.numel(b), dtype=bucket.dtype, device=bucket.device)

    def _gathered(self, b: int, work: Any) -> None:
        bk = self.bk
        wait(work, bk.mesh.shard, f"all-gather of bucket {b}'s params")
        bk.store.scatter.gathered(b)
        self.step.times[b].gathered = time.perf_counter() - self.step.t0

    def close(self, updated: bool) -> Verdict:
        """The step's verdict on every rank: this rank's error, or ``CollectiveError`` if another
        rank failed; every rank then refuses the state (some rank may have updated its state, or
        part of it, before the failure was known: the replicas' states differ). Refusing on
        every rank, not only on those that updated, keeps the ranks in step: a rank that went on
        alone would wait in the next step's collectives for the timeout.

        When the verdict comes at the next call (``VerdictTiming.NEXT_CALL``) the status is left
        in flight: this rank's own error is returned at once, and every rank reads the verdict
        at the start of its next call (``Engine.repair`` sets the failed ranks right then). Its
        updates waited for every bucket, and a backward failure has stopped every rank before
        them, so a failure here is in this rank's own update only: the others' updates are whole
        and exact."""
        bk, rank, n = self.bk, self.bk.group.rank, self.step.n
        if self.mode.verdict is VerdictTiming.NEXT_CALL:
            bk.machine.close(self.step, self.error is not None, wait=False)
            if self.error is None:
                return Verdict(updated)
            self.error.add_note(
                f"fdp: rank {rank}'s part of step {n} failed after its buckets were reduced; the other ranks' "
                "updates are whole. The next call of the step (on every rank) restores this rank's params and "
                "optimizer state from a rank whose update succeeded, and goes on from there.")
            return Verdict(updated, (
                f"this rank's part of step {n} failed after its buckets were reduced (the error raised then), "
                "leaving its params and optimizer state behind or partly updated; the next call of the step "
                "restores them from a rank whose update succeeded, on this rank and the others alike"), self.error)
        try:
            failed = bk.machine.close(self.step, self.error is not None)
        except CollectiveError as e:  # the ranks ran different steps together, or the group broke
            return Verdict(updated, status_failed(f"step {n}", e), e)
        if not failed:
            return Verdict(updated)
        if self.step.early_ranks == bk.group.size and self.error is not None:
            return Verdict(updated, None, self.error)  # every rank failed before its buckets: none updated
        mine = (f"rank {rank} had updated {sum(self.updated)} of {len(self.updated)} buckets of the optimizer "
                "state in place (and with donate=True the params)" if any(self.updated) else
                f"rank {rank} updated nothing, but other ranks may have updated their optimizer state in place "
                "(and with donate=True the params)")
        when = "in their loss or backward" if self.step.early_ranks else "after its buckets were reduced"
        refusal = refused(f"step {n} failed on {failed} rank(s) {when}, and {mine}, so the replicas' states differ now")
        where = ("in their loss or backward" if self.step.early_ranks == failed else
                 "after the backward (in a transform, the optimizer's kernel or a gather)" if not self.step.early_ranks
                 else f"({self.step.early_ranks} in their loss or backward, the others after it)")
        error = self.error or CollectiveError(
            f"fdp: step {n} of {bk.name} failed on {failed} other rank(s) of {bk.group.size} {where}; this is "
            f"rank {rank}. "
            + ("This rank's state was updated" if any(self.updated) else "Other ranks may have updated their state")
            + ", so every rank refuses it now: load a saved state or make a new one (step.init) to go on.")
        return Verdict(updated, refusal, error)


def status_failed(which: str, e: CollectiveError) -> str:
    """The refusal after ``which`` step's status, issued after its updates, failed with ``e``
    (the ranks ran different steps together, or the group broke): its updates may differ
    between the replicas."""
    return refused(f"{which}'s status failed after its updates ({e}), so the replicas' states may differ")


__all__ = ["Run", "status_failed"]
