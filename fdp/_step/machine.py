"""The step machine: leaf gradients in, reduced flat buckets out, overlapping the backward.

``StepMachine`` is built once per Reducer from (plan, group, comm hook, buffers) and never
sees the Reducer. It owns the per-leaf hooks and starts one ``Step`` per call; the ``Step``
owns that call's state and its four actions:

1. **receive**: a leaf hook hands over the leaf's gradient as the backward produces it (in
   reverse registration order, interleaved with the compute of earlier layers);
2. **fill**: when a bucket's last leaf arrives, one multi-tensor copy writes every gradient
   of the bucket into its flat buffer with the 1/world scale and any cast fused in;
3. **launch**: the bucket's collective is issued through the comm hook, strictly in bucket
   order, so every rank issues the same collectives in the same order;
4. **finish**: buckets not launched yet (unused leaves, unhooked tail) are filled and
   launched in order, then every bucket is waited for and the reduced flat tensors are
   returned.

Only gradients of the *outer* backward count: a loss that itself differentiates the params
(``torch.autograd.grad(..., create_graph=True)``: gradient penalties, MAML) fires the leaf
hooks during its forward too. A step is armed by a hook on the loss, which runs first in
the outer backward; hooks that fire before it are inner calls and are left alone.

A rank whose step fails (an exception in its loss or backward, before or after some buckets
were launched) must not leave the others with collectives it never issues: the next call
would pair its buckets with the rest of the failed step on the other ranks and sum gradients
of two steps. ``StepMachine.abort`` drains instead: it launches the remaining buckets (zeros)
and the step's status marked as failed, so every rank issues the same collectives and every
rank raises for that step. The status is one 4-element int64 all-reduce launched right after
the last bucket and waited after it: (failed ranks, those of them that failed in their loss
or backward, sum of step numbers, sum of their squares), so a rank that is a step ahead or
behind is caught too, and the others can say where a rank failed. It is a separate
collective because any change to a bucket's size changes how gloo's ring splits it, and with
it the summation order that makes fdp's results equal DDP's bit for bit.

A caller that does its own work between the buckets and the status (the fused step's
updates) issues the status after that work (``StatusMode.closes``); a rank whose backward
failed must still stop every rank *before* that work. Either the usual status goes out with
the last bucket as well (``StatusMode.AFTER_AND_WITH_BUCKETS``: a second collective every step), or the
failure travels in the buckets themselves (``StatusMode.AFTER_AND_ON_NAN``): the failed rank fills
the buckets it drains with NaN, and since the hook sums elementwise in place, every rank's
last bucket then comes back NaN. Every rank checks one element of it; only when that is NaN
(a failure, or a gradient that is NaN there) is the status exchanged before the caller's
work, and a failure raises on every rank as above. A rank that failed after launching its
last bucket sends no NaN: its failure is told by the caller's status, after the work.
"""

from __future__ import annotations

import enum
import functools
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import _internals, kernels
from .._comm.agree import check_collective, which_ranks
from .._comm.collectives import DONE, all_reduce, is_completed, wait
from .._comm.group import Group
from .._errors import CollectiveError
from .._plan.bucket import BucketPlan, itemsize
from .._plan.buffers import BucketBuffers
from .._protocols import StepKind
from ..hooks import CommHook
from .record import BucketTimes, StepRecord, Timeline

# Gradients smaller than this are left to autograd: handing autograd a zero in their place
# costs more than the memory it frees.
RELEASE_BYTES = 64 * 1024
# Default of ``hook_threshold_bytes``: a hook costs a few microseconds per leaf per step, so
# a trailing bucket whose leaves average less than this (thousands of biases, say) gains less
# from an early launch than its hooks cost; such buckets launch when the backward returns.
HOOK_MEAN_BYTES = 16 * 1024


_is_none = functools.partial(operator.is_, None)  # (a C-level test per element, no Python frame)


def _taker(indices: Sequence[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """A function picking ``indices`` from a list, as a list (one C-level itemgetter call)."""
    if len(indices) == 1:
        i = indices[0]
        return lambda xs: [xs[i]]
    getter = operator.itemgetter(*indices)
    return lambda xs: list(getter(xs))


def hooked_count(buckets: Sequence[tuple[int, int]], hook_threshold_bytes: int) -> int:
    """How many leading buckets get leaf hooks (``(nbytes, leaf count)`` per bucket): up to
    the last whose leaves average at least ``hook_threshold_bytes``; the rest launch when
    the backward returns. The cost model prices plans with this same rule."""
    worth = [i for i, (n, k) in enumerate(buckets) if n >= hook_threshold_bytes * k]
    return worth[-1] + 1 if worth else 0


class StatusMode(enum.Enum):
    """When a step's status (which ranks failed, their step numbers) is exchanged.

    * ``WITH_BUCKETS``: issued with the last bucket, checked with the buckets; the step ends
      there (``reducer.grad``, ``all_reduce``).
    * ``AFTER``: the caller ends the step with ``StepMachine.close`` after its own work
      between the buckets and the status (the fused step's updates on arrival): every rank
      learns of a failure there, in the step or (``wait=False``) at its next call.
    * ``AFTER_AND_WITH_BUCKETS``: also with the last bucket, checked with the buckets: a rank
      whose backward failed stops every rank before the caller's work (a second status every
      step).
    * ``AFTER_AND_ON_NAN`` (the hook must sum elementwise in place): the same stop without a
      collective in the common step: a rank whose backward failed fills the buckets it drains
      with NaN, and the status is exchanged with the buckets only when the last bucket comes
      back NaN (the module docstring).
    """

    # (description, closes: the caller ends the step with StepMachine.close, with_buckets: a
    # status is issued with the last bucket and checked with the buckets)
    WITH_BUCKETS = ("with the buckets", False, True)
    AFTER = ("after the caller's work", True, False)
    AFTER_AND_WITH_BUCKETS = ("with the buckets and after the caller's work", True, True)
    AFTER_AND_ON_NAN = ("after the caller's work, and with the buckets when the last comes back NaN", True, False)

    def __init__(self, description: str, closes: bool, with_buckets: bool) -> None:
        self.description, self.closes, self.with_buckets = description, closes, with_buckets


@dataclass(frozen=True)
class StepSpec:
    """How one step runs, given once when it starts (``StepMachine.start``); nothing changes
    a step from outside afterwards.

    Attributes:
      kind: ``"grad"`` or ``"all_reduce"`` (the record's kind).
      what: the caller, named in messages (``"fdp.Reducer.grad"``...).
      acc: per leaf, gradients added to this rank's before they are averaged (accumulation).
      acc_owned: ``acc`` is the caller's own scratch (the fused step's accumulation buffer): the
        last micro-batch is added into it in place, and the bucket filled from it (no
        allocation). Otherwise ``acc`` is never modified.
      scale: the factor fused into each bucket's fill (1/world for a mean), or None.
      active: False for a rank that contributes zeros (uneven inputs).
      defer: launch nothing during the backward (ready times are still stamped): a backward
        with no communication beside it, which ``bucket_cap_mb="auto"`` calibrates on.
      on_ready: called as ``on_ready(b, reduced)`` once per bucket as soon as its result is
        known (the fused step's per-bucket update); for ``in_place`` hooks as soon as fdp
        sees the collective complete, during the backward.
      status: when the step's status is exchanged (``StatusMode``).
      on_complete: called as ``on_complete(b)`` once bucket ``b``'s gradients are all in,
        before a flat buffer is found for them and they are copied in: nothing needs the
        bucket's params for this backward any more (fully sharded params free their gathered
        copy then, so it is not held beside the flat buffer).
      on_filled: called as ``on_filled(b)`` once bucket ``b``'s gradients are in its flat
        buffer (just before its collective is launched).
    """

    kind: StepKind
    what: str = "a step"
    acc: list[torch.Tensor] | None = None
    acc_owned: bool = False
    scale: float | None = None
    active: bool = True
    defer: bool = False
    on_ready: Callable[[int, torch.Tensor], None] | None = None
    status: StatusMode = StatusMode.WITH_BUCKETS
    on_complete: Callable[[int], None] | None = None
    on_filled: Callable[[int], None] | None = None


class Pending(NamedTuple):
    """A step closed without waiting for its status (``StepMachine.close(..., wait=False)``):
    its number, whether this rank's part of it failed, and where its status is in flight."""

    n: int
    failed: bool
    slot: StatusSlot
    group: Group


class Steps:
    """What every step of one Reducer adds to, whichever machine ran it (its own, a fused
    step's): the count of steps whose collectives were all issued (the step number the
    status checks), the steps with a non-finite verdict, the last ``StepRecord``, the step
    whose status is still in flight (``pending``) and the ranks whose part of an earlier
    step failed, which a later call must still set right (``owed``; see ``settle``)."""

    __slots__ = ("completed", "nonfinite", "last", "pending", "owed")

    def __init__(self) -> None:
        self.completed = 0
        self.nonfinite = 0
        self.last: StepRecord | None = None
        self.pending: Pending | None = None
        self.owed: tuple[int, list[int]] | None = None  # (step, failed ranks)

    def settle(self) -> tuple[int, list[int]] | None:
        """The verdict of the step closed without waiting, once every rank's status is in:
        ``(step, the ranks whose part of it failed)`` until a caller has set them right
        (``owed``), else None. Every rank calls it at the same point (the start of its next
        Reducer call), so the collectives here pair up.

        Raises:
          CollectiveError: the ranks ran different steps together, or the status could not
            be exchanged.
        """
        p, self.pending = self.pending, None
        if p is not None:
            wait(p.slot.work, p.group, f"step {p.n} status")
            failed, _, steps, squares = map(int, p.slot.buf.tolist())
            check_same_step(p.n, p.group, steps, squares)
            if failed:  # (rare) which ranks
                self.owed = (p.n, which_ranks(p.failed, p.group, f"step {p.n}'s failed ranks"))
        return self.owed


class StatusSlot:
    """The step status's tensor and the last status collective, owned by the machine.

    Both outlive the step: gloo's worker thread drops its reference to a finished
    collective after the caller has seen it complete, and if that is the last reference to
    a tensor made in Python, the thread must take the GIL to free it; at interpreter
    shutdown it cannot, and the process aborts ("terminate called without an active
    exception"; the stack is in ``fdp._group.keep_until_exit``). A tensor held here is
    freed by the main thread.
    """

    __slots__ = ("buf", "work")

    def __init__(self, device: torch.device) -> None:
        self.buf = torch.zeros(4, dtype=torch.int64, device=device)
        self.work: Any = None


class _Live:
    """The step in flight, read by the leaf hooks (a holder, so hooks do not keep the machine
    alive: a Reducer is freed on ``del`` with no reference cycle)."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: Step | None = None


class StepMachine:
    """Runs Reducer steps over one bucket plan.

    Args:
      plan: the bucket layout. group: the ranks. hook: the comm hook (its declared
      capabilities decide how buckets are launched and waited for). buffers: the flat
      buffers' owner. debug: check each collective's fingerprint across ranks first.
      hook_threshold_bytes: trailing buckets whose leaves average fewer bytes get no hooks.
      steps: the count every machine of one Reducer shares (a fresh one by default).
    """

    def __init__(self, plan: BucketPlan, group: Group, hook: CommHook, buffers: BucketBuffers, *,
                 debug: bool = False, hook_threshold_bytes: int = HOOK_MEAN_BYTES, steps: Steps | None = None) -> None:
        self.plan, self.group, self.hook, self.buffers, self.debug = plan, group, hook, buffers, debug
        self.steps = steps if steps is not None else Steps()
        self.bucket_of = [s.bucket for s in plan.slots]
        self.nbytes = [b.nbytes for b in plan.buckets]
        # Per bucket: its leaves picked from a per-leaf list in one C call (buffer order), and
        # the slice of leaf indices they fill when contiguous (the common case), else None.
        self.take = [_taker(b.leaves) for b in plan.buckets]
        self.span = [(min(b.leaves), max(b.leaves) + 1) if b.leaves and max(b.leaves) - min(b.leaves) + 1 == len(b.leaves)
                     else (None, None) for b in plan.buckets]
        self.nones = [[None] * len(b.leaves) for b in plan.buckets]
        self.release = [s.numel * itemsize(s.dtype) >= RELEASE_BYTES for s in plan.slots]
        # the copy kernel for the plan's device, chosen once (fdp.kernels: Triton on CUDA)
        self.flatten = kernels.flattener(plan.buckets[0].device if plan.buckets else torch.device("cpu"))
        self.hooked_buckets = hooked_count([(b.nbytes, len(b.leaves)) for b in plan.buckets], hook_threshold_bytes)
        self.unhooked = [i for b in plan.buckets[self.hooked_buckets:] for i in b.leaves]
        # The step status all-reduce (see the module docstring); nothing to pair without buckets.
        self.status = group.process_group is not None and bool(plan.buckets)
        self.status_slot = StatusSlot(group.device) if self.status else None
        self._live = _Live()
        # One hook per leaf and engine, made once (the functorch one unwraps its gradients).
        self.leaf_hooks = {
            engine: [_leaf_hook(self._live, i, engine == "functorch") if s.bucket < self.hooked_buckets else None
                     for i, s in enumerate(plan.slots)]
            for engine in ("autograd", "functorch")
        }

    @property
    def in_flight(self) -> Step | None:
        return self._live.step

    def start(self, spec: StepSpec) -> Step:
        """Begin a step as ``spec`` says (one step at a time per machine; the verdict of a step
        closed without waiting must have been read first: ``Steps.settle``)."""
        self.check_idle(spec.what)
        owed = self.steps.settle()
        if owed is not None:
            n, failed = owed
            raise CollectiveError(
                f"fdp: {spec.what}: the update of step {n} of this Reducer's fused step failed on rank(s) {failed} "
                f"after the others had made theirs, so the replicas' params and optimizer states differ (this is "
                f"rank {self.group.rank}); call the fused step on every rank: it restores the failed ranks' params "
                "and state from a rank whose update succeeded, then goes on")
        self.buffers.release_all()
        step = Step(self, spec)
        self._live.step = step
        return step

    def check_idle(self, what: str) -> None:
        """Raise unless no step is in flight (a reducer runs one step at a time)."""
        cur = self._live.step
        if cur is not None:
            raise RuntimeError(
                f"fdp.Reducer: {what} called while step {cur.n} ({cur.kind}) is still in flight: a "
                "reducer runs one step at a time (was grad_fn called inside the loss function, from "
                "two threads, or an all_reduce_async handle not waited?)"
            )

    def scale_for(self, n: int) -> float | None:
        """The factor fused into the fill for a mean over ``n`` ranks (None: none needed, or
        the hook divides itself)."""
        return None if not self.hook.prescale or n == 1 else 1.0 / n

    def finish(self, step: Step) -> list[torch.Tensor]:
        """Launch what is left, wait for every bucket, and return the reduced flats (wire
        dtype). A step whose status ``closes`` stays in flight until ``close``."""
        try:
            return step.finish()
        except BaseException as e:
            self.abort(step, e)
            raise
        finally:
            if not step.spec.status.closes:
                self._end(step)

    def abort(self, step: Step, exc: BaseException | None = None) -> None:
        """This rank's step failed with ``exc``: issue the rest of its collectives marked as
        failed, then return (the caller re-raises). Also a step that issued nothing yet (a
        failure in the forward, or in the backward before its first bucket): every rank learns
        of the failure in this call, and no rank's next call pairs with the others' current
        step (a retried step would sum gradients of different batches, or leave out
        micro-batches the failed call had taken). After a ``CollectiveError`` nothing more is
        issued: the group is broken, or the failure was another rank's and every rank already
        knows. A step whose status ``closes`` and that was
        drained stays in flight when its only status is the close's: that status comes from
        ``close(step, failed=True)``, after the caller's own collectives (also one whose failure
        the buckets could not tell: ``AFTER_AND_ON_NAN`` after the last bucket was launched)."""
        drained = told = False
        try:
            if not isinstance(exc, CollectiveError):
                drained = True
                told = step.drain()
        except CollectiveError:
            told = True  # the group is broken: every rank's collectives fail with their own error
        finally:
            if not drained or told:
                self._end(step)

    def close(self, step: Step, failed: bool, wait: bool = True) -> int:
        """End a step whose status ``closes``: issue its status (``failed``: this rank's part of
        the step failed) and return how many ranks failed. Raises ``CollectiveError`` when
        the ranks ran different steps together, or when the status cannot be exchanged.
        ``wait=False``: leave the status in flight and return 0; every rank reads it at the
        start of its next call of this Reducer (``Steps.settle``), which says then who failed.
        """
        try:
            if wait:
                return step.close(failed)
            step.failed = step.failed or failed
            if step.status:
                step._start_status()
                self.steps.pending = Pending(step.n, bool(failed), self.status_slot, self.group)
            return 0
        finally:
            self._end(step)

    def _end(self, step: Step) -> None:
        if self._live.step is step:
            self._live.step = None
            if step.next == len(self.plan.buckets):
                self.steps.completed += 1


def _leaf_hook(live: _Live, i: int, wrapped: bool) -> Callable[[torch.Tensor], torch.Tensor | None]:
    unwrap = _internals.unwrap if wrapped else None

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        step = live.step
        if step is None:
            return None
        return step.receive(i, unwrap(grad) if unwrap else grad, grad)

    return hook


class Step:
    """One call's exchange (see the module docstring). Made by ``StepMachine.start``."""

    __slots__ = ("spec", "n", "kind", "plan", "group", "hook", "buffers", "debug", "bucket_of", "release",
                 "take", "span", "nones",
                 "status", "status_t", "status_work", "pending", "stash", "got", "next", "flats",
                 "handles", "in_flight", "acc", "scale", "active", "armed", "failed", "on_ready", "readied",
                 "t0", "times", "bwd_start", "bwd_end", "defer", "flatten", "signalled",
                 "summed", "early", "early_ranks")

    def __init__(self, machine: StepMachine, spec: StepSpec) -> None:
        plan = machine.plan
        self.spec = spec
        self.n, self.kind, self.plan, self.group = machine.steps.completed, spec.kind, plan, machine.group
        self.hook, self.buffers, self.debug = machine.hook, machine.buffers, machine.debug
        self.bucket_of, self.release = machine.bucket_of, machine.release
        self.take, self.span, self.nones = machine.take, machine.span, machine.nones
        self.flatten = machine.flatten
        self.status = machine.status
        self.status_t: StatusSlot | None = machine.status_slot
        self.status_work: Any = None
        self.pending = [len(b.leaves) for b in plan.buckets]
        self.stash: list[torch.Tensor | None] = [None] * len(plan.slots)
        self.got = bytearray(len(plan.slots))
        self.next = 0
        self.flats: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self.handles: list[Any] = [None] * len(plan.buckets)
        self.in_flight: list[int] = []  # launched buckets not yet seen complete
        self.acc, self.scale, self.active = spec.acc, spec.scale, spec.active
        self.armed = False  # set when the outer backward starts (see the module docstring)
        self.on_ready = spec.on_ready
        self.readied = bytearray(len(plan.buckets))
        self.failed = False
        self.t0 = time.perf_counter()
        self.times = list(map(BucketTimes, range(len(plan.buckets)), machine.nbytes))
        self.bwd_start: float | None = None
        self.bwd_end: float | None = None
        self.defer = spec.defer
        self.signalled = False  # (AFTER_AND_ON_NAN) this rank failed and filled a bucket with NaN
        self.early = False  # this rank failed in its loss or backward (``drain``), not after
        self.early_ranks = 0  # how many ranks did (read from the status)
        self.summed: list[torch.Tensor] | None = None  # per bucket, its gradients' flat sum (``summed_into``)

    # ------------------------------------------------------------------ during the backward
    def on_backward_start(self, grad: torch.Tensor) -> None:
        """Hook on the loss: the outer backward has begun."""
        self.armed = True
        self.bwd_start = time.perf_counter()

    def receive(self, i: int, grad: torch.Tensor, original: torch.Tensor) -> torch.Tensor | None:
        """Leaf ``i``'s gradient, from its hook. Returns what autograd should keep in its place."""
        if not self.armed or self.got[i]:
            return None
        self.stash[i] = grad
        self.got[i] = 1
        if self.in_flight and self.on_ready is not None:
            with _internals.outside_transforms():
                self.stamp_done()  # a landed bucket is updated while the backward goes on
        b = self.bucket_of[i]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.times[b].ready = time.perf_counter() - self.t0
            if b == self.next and not self.defer:
                with _internals.outside_transforms():
                    self.launch_ready()
        # Hand autograd a free zero instead: the gradient then lives only in the stash.
        return original.new_zeros(()).expand(original.shape) if self.release[i] else None

    def backward_done(self, grads: list[torch.Tensor | None], unhooked: list[int]) -> None:
        """The backward returned: take the gradients of the leaves that have no hook."""
        self.bwd_end = time.perf_counter()
        for i in unhooked:
            self.stash[i] = grads[i]  # None for an unused leaf: zero-filled at launch

    def summed_into(self, flats: list[torch.Tensor]) -> None:
        """The backward returned, having added every gradient into ``acc`` itself (the caller's
        scratch, ``StepSpec.acc_owned``; autograd's own accumulation), whose flat tensor per
        bucket is in ``flats``: every bucket is ready, and is filled from its flat sum."""
        self.bwd_end = time.perf_counter()
        self.summed = flats
        self.got = bytearray(b"\x01" * len(self.got))
        self.pending = [0] * len(self.plan.buckets)

    def give(self, leaves: list[torch.Tensor]) -> None:
        """All gradients at once (``all_reduce``): every bucket is ready."""
        self.stash = list(leaves)
        self.got = bytearray(b"\x01" * len(leaves))
        self.pending = [0] * len(self.plan.buckets)

    # ------------------------------------------------------------------ fill and launch
    def launch_ready(self, force: bool = False) -> None:
        """Launch buckets in order while the next one is complete (all of them if ``force``)."""
        nb = len(self.plan.buckets)
        while self.next < nb and (force or self.pending[self.next] == 0):
            self._launch(self.next)
            self.next += 1

    def _fill(self, b: int, flat: torch.Tensor) -> None:
        bucket = self.plan.buckets[b]
        if self.failed and self.spec.status is StatusMode.AFTER_AND_ON_NAN:  # every rank's sum of this bucket shows it
            flat.zero_()  # (a padded buffer's padding stays zero)
            flat[:bucket.numel].fill_(float("nan"))
            self.signalled = True
        elif not self.active or self.failed:
            flat.zero_()
        elif self.summed is not None:  # one copy of the bucket's flat sum (with the scale and any cast)
            self.flatten([self.summed[b]], flat[:bucket.numel] if flat.numel() != bucket.numel else flat, self.scale)
        else:
            stash, take = self.stash, self.take[b]
            srcs = take(stash)
            lo, hi = self.span[b]  # the gradients now live in the bucket only: let the stash go
            if lo is not None:
                stash[lo:hi] = self.nones[b]
            else:
                for i in bucket.leaves:
                    stash[i] = None
            # (not ``None in srcs``: that compares every tensor with None through Tensor.__eq__, in
            # Python: 10 ms for 2,000 leaves)
            if any(map(_is_none, srcs)):  # unused leaves: their hooks never fired, their gradients are zero
                srcs = [torch.zeros(self.plan.slots[i].shape, dtype=bucket.dtype, device=bucket.device)
                        if g is None else g for i, g in zip(bucket.leaves, srcs)]
            if self.acc is not None:
                acc = take(self.acc)
                if self.spec.acc_owned:  # the caller's scratch: added into in place, filled from
                    torch._foreach_add_(acc, srcs)
                    srcs = acc
                else:
                    srcs = torch._foreach_add(acc, srcs)
            if flat.numel() != bucket.numel:  # a sharded step's padded buffer: the padding stays zero
                flat = flat[:bucket.numel]
            self.flatten(srcs, flat, self.scale)

    def _launch(self, b: int) -> None:
        bucket = self.plan.buckets[b]
        if self.spec.on_complete is not None:
            self.spec.on_complete(b)
        flat = self.buffers.wire(b)
        while flat is None:  # transient buffers, all lent: the oldest collective lands first
            self._land_oldest()
            flat = self.buffers.wire(b)
        self._fill(b, flat)
        if self.spec.on_filled is not None:
            self.spec.on_filled(b)
        what = self.what(b)
        if self.debug:
            check_collective(self.group, self.n, b, flat.numel(), flat.dtype, what)
        times = self.times[b]
        self.stamp_done()
        times.launch = time.perf_counter() - self.t0
        self.flats[b] = flat
        self.handles[b] = self.hook.launch(bucket, flat, self.group)
        if self.group.process_group is None:
            times.done = times.launch
            self._landed(b, flat)
        else:
            self.in_flight.append(b)
        if bucket.last and self.status and self.hook.in_place and self.spec.status.with_buckets:
            self._start_status()  # overlaps the last bucket's all-reduce

    def _start_status(self) -> None:
        # A Future-returning hook may issue more collectives from its callbacks (PowerSGD
        # chains three), so for those the status waits until every bucket is collected:
        # issued earlier, it could interleave differently on different ranks.
        n, slot = self.n, self.status_t
        slot.buf.copy_(torch.tensor([int(self.failed), int(self.early), n, n * n], dtype=torch.int64))
        self.status_work = slot.work = all_reduce(slot.buf, self.group, f"step {n} status", async_op=True)

    def what(self, b: int) -> str:
        return f"all-reduce of bucket {b} of {len(self.plan.buckets)} (step {self.n})"

    # ------------------------------------------------------------------ wait and finish
    def stamp_done(self) -> None:
        """Stamp ``done`` on the launched buckets whose collective has completed by now."""
        if not self.in_flight:
            return
        now = time.perf_counter() - self.t0
        still = []
        ready = []
        for b in self.in_flight:
            if is_completed(self.handles[b]):
                self.times[b].done = now
                ready.append(b)
            else:
                still.append(b)
        self.in_flight = still
        for b in ready:
            self._landed(b, self.flats[b])

    def _landed(self, b: int, result: torch.Tensor) -> None:
        """Bucket ``b``'s collective is complete: hand it on (``on_ready``, in-place hooks), then
        give back its transient buffer (the caller has copied what it keeps)."""
        if self.on_ready is not None and self.hook.in_place and not self.failed:
            self._ready(b, result)
        self.buffers.release(b)

    def _land_oldest(self) -> None:
        """Wait for the oldest collective in flight and land it (its transient buffer is needed)."""
        if not self.in_flight:
            raise RuntimeError("fdp: no transient bucket buffer is free and no collective is in flight")
        b = self.in_flight.pop(0)
        self.hook.collect(self.handles[b], self.plan.buckets[b], self.flats[b], self.group, self.what(b))
        self.handles[b] = DONE
        self.times[b].done = time.perf_counter() - self.t0
        self._landed(b, self.flats[b])

    def _ready(self, b: int, result: torch.Tensor) -> None:
        if not self.readied[b]:
            self.readied[b] = 1
            self.on_ready(b, result)

    def finish(self) -> list[torch.Tensor]:
        self.launch_ready(force=True)
        self.stamp_done()
        results = []
        for b, (bucket, handle) in enumerate(zip(self.plan.buckets, self.handles)):
            results.append(self.hook.collect(handle, bucket, self.flats[b], self.group, self.what(b)))
            self.stamp_done()  # this bucket, and any later one already complete
            if self.times[b].done is None:  # a hook's future may still be running its callbacks
                self.times[b].done = time.perf_counter() - self.t0
        if self.spec.status.with_buckets:
            self._check_status()
        elif self.spec.status is StatusMode.AFTER_AND_ON_NAN and results and results[-1].numel() and bool(results[-1][0].isnan()):
            self._check_status()  # some rank failed (raises), or a gradient is NaN there: go on
        if self.on_ready is not None:
            for b, r in enumerate(results):
                self._ready(b, r)
        return results

    def drain(self) -> bool:
        """Issue the rest of this failed step's collectives, marked as failed, and wait for them.
        Returns whether every rank knows of the failure now (False: the caller's status will
        tell them, ``StatusMode.closes``)."""
        self.failed = self.early = True
        self.launch_ready(force=True)
        for b, handle in enumerate(self.handles):
            try:
                self.hook.collect(handle, self.plan.buckets[b], self.flats[b], self.group, self.what(b))
            except (CollectiveError, TypeError):
                pass
        told = self.spec.status.with_buckets or self.signalled
        if self.status and told:
            if self.status_work is None:
                self._start_status()
            wait(self.status_work, self.group, f"step {self.n} status")
        return told

    def close(self, failed: bool) -> int:
        """The status of a step whose status ``closes`` (see ``StepMachine.close``)."""
        self.failed = self.failed or failed
        if not self.status:
            return int(self.failed)
        self._start_status()  # (AFTER_AND_WITH_BUCKETS: the second one; the first was checked already)
        return self._check_status(raise_failed=False)

    def _check_status(self, raise_failed: bool = True) -> int:
        if not self.status:
            return 0
        if self.status_work is None:
            self._start_status()
        n, size = self.n, self.group.size
        wait(self.status_work, self.group, f"step {n} status")
        failed, self.early_ranks, steps, squares = map(int, self.status_t.buf.tolist())
        if failed and raise_failed:
            raise CollectiveError(
                f"fdp: step {n} failed on {failed} other rank(s) of {size} (an exception in their loss or "
                f"backward); its gradients are discarded on "
                f"every rank (this is rank {self.group.rank}). The ranks are still in step: the next call "
                "starts a fresh step everywhere."
            )
        check_same_step(n, self.group, steps, squares)
        return failed

    def timeline(self) -> Timeline:
        return Timeline(
            self.n, self.kind,
            None if self.bwd_start is None else self.bwd_start - self.t0,
            None if self.bwd_end is None else self.bwd_end - self.t0,
            time.perf_counter() - self.t0, self.times,
        )


def check_same_step(n: int, group: Group, steps: int, squares: int) -> None:
    """Raise ``CollectiveError`` unless every rank's status was of step ``n`` (the sums of the
    ranks' step numbers and of their squares)."""
    size = group.size
    if steps != n * size or squares != n * n * size:
        raise CollectiveError(
            f"fdp: the ranks ran different steps of this Reducer together (rank {group.rank} is at "
            f"step {n}; the ranks' step numbers sum to {steps}, not {n * size}): some rank called it "
            "more often than the others, so these gradients mix different steps and are discarded. "
            "Every rank must make the same sequence of Reducer calls."
        )


def all_finite(flats: list[torch.Tensor]) -> bool:
    """Whether every element is finite: AMP's fused found_inf check, one pass per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for f in flats:
        by_dtype.setdefault(f.dtype, []).append(f)
    found = torch.zeros(1, device=flats[0].device) if flats else None
    one = torch.ones(1, device=flats[0].device) if flats else None
    for group in by_dtype.values():
        _internals.non_finite_check(group, found, one)  # x * 1.0: unchanged
    return found is None or not bool(found.item())

