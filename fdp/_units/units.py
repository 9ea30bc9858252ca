"""Units of fully sharded params (``Reducer(shard="params")``): gathered just before they run,
freed right after.

At rest each rank holds only its slice of every bucket's params; a *unit* (the leaves under
one module prefix, such as a transformer block, or the *root*: every leaf under no prefix)
is one bucket per dtype, so a unit's slices are a bucket's slices (``fdp._slices``).

``Units`` owns, per bucket, the gathered params (a flat tensor whose storage is allocated
only while the unit is gathered: ``alloc_storage`` / ``free_storage``) and, once for its
life, each leaf as a tensor on that storage. A bucket is ``FREE``, ``UNSHARDING`` (its
all-gather in flight) or ``UNSHARDED``; the verbs are FSDP2's: ``unshard`` (issue the
all-gather), ``wait_for_unshard``, ``reshard`` (free). Through a step:

* **forward**: ``fdp.Apply`` (given the ``Gathering`` a step passes to the loss, or
  ``ShardedParams`` for inference) puts a meta placeholder in each unit leaf's place in the
  module and, around each unit module's forward, calls ``enter`` (gather the unit, or wait
  for its prefetch, and prefetch the next unit of the last step's order; the real leaves go
  into their places) and ``exit`` (placeholders back; the gathered copy freed unless
  ``reshard_after_forward=False``; a hook on the unit's outputs for the backward). Code that
  reads a unit's param outside its module's forward sees the placeholder (an error, never a
  read of freed memory), except through ``Gathering[key]``, which gathers the unit and keeps
  it for the rest of the step. The root is gathered when the forward starts and kept.
* **backward**: the first gradient reaching a unit's outputs gathers the unit again (the
  autograd graph saved its leaves, whose storage is filled again) and prefetches the unit
  that ran before it; a recomputation inside the backward (activation checkpointing) finds
  its unit gathered or gathers it (``recomputing``); once every gradient of a bucket is in
  (``StepSpec.on_complete``), nothing needs the bucket's params: they are freed.
* **end**: every gather in flight is waited for, everything is freed, and this step's
  forward order becomes the next step's prefetch order.

Every rank runs the same forward and backward, so every rank issues the same gathers in the
same order (the all-gathers, and the reduce-scatters the step machine issues, are each in
one deterministic order).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import _internals, _tree
from .._comm.agree import check_collective
from .._comm.collectives import DONE, exchange, wait
from .._comm.group import Group
from .._errors import CollectiveError
from .._plan.bucket import BucketPlan, contiguous_strides
from .._slices.exchange import Scatter
from .._slices.geometry import Slices
from .._step.record import BucketTimes, Gather
from .placeholder import Placeholder

ROOT = ""


class UnitState(enum.Enum):
    """Where one bucket's gathered params are (FSDP2's ``ShardedState``, per bucket)."""

    FREE = "free"                # no storage; only this rank's slice exists
    UNSHARDING = "unsharding"    # storage allocated, the all-gather in flight
    UNSHARDED = "unsharded"      # gathered: the leaves on its storage may be read


def alloc_storage(t: torch.Tensor, nbytes: int) -> None:
    """Give ``t``'s storage its ``nbytes`` again (the leaves made on it see the memory)."""
    t.untyped_storage().resize_(nbytes)


def free_storage(t: torch.Tensor) -> None:
    """Free ``t``'s storage, keeping the tensor and every tensor made on it (FSDP's own way)."""
    t.untyped_storage().resize_(0)


def unit_of_leaves(keys: Sequence[Any], units: Sequence[str], what: str) -> tuple[tuple[str, ...], list[int]]:
    """(unit names: the root first, then ``units`` in the order given; per leaf its unit's
    index). A leaf belongs to the longest prefix that matches its key (``"h.0"`` matches
    ``"h.0.attn.weight"``); a leaf under none belongs to the root."""
    if isinstance(units, str) or not all(isinstance(u, str) and u for u in units):
        raise TypeError(f"{what}: units must be a list of module names (non-empty strings such as 'h.0'), "
                        f"got {units!r}")
    if len(set(units)) != len(units):
        raise ValueError(f"{what}: units names a module twice: {sorted(u for u in set(units) if list(units).count(u) > 1)}")
    if not all(isinstance(k, str) for k in keys):
        raise TypeError(f"{what}: units need the params to be a dict keyed by module path (fdp.functionalize's), "
                        f"got keys {list(keys)[:4]}")
    names = (ROOT, *units)
    by_length = sorted(range(1, len(names)), key=lambda u: -len(names[u]))
    out, used = [], set()
    for k in keys:
        u = next((u for u in by_length if k == names[u] or k.startswith(names[u] + ".")), 0)
        out.append(u)
        used.add(u)
    unused = [names[u] for u in range(1, len(names)) if u not in used]
    if unused:
        raise ValueError(f"{what}: unit {unused[0]!r} holds no trainable param (the params' keys start "
                         f"{list(keys)[:3]}...); name modules that have params. A param tied to another module's "
                         "(a head tied to the embedding) is keyed by its first name, so it is that module's: leave "
                         "the tied module out of units")
    return names, out


def bucket_groups(unit_of: Sequence[int], n_units: int) -> list[int]:
    """Per leaf, its bucket group: its unit's index, or for the root's leaves, one group per
    run of consecutive root leaves (``n_units``, ``n_units + 1``, ...). So the embedding before
    the first block and the head after the last are buckets of their own, in backward order
    with the blocks: a bucket holding both would be complete only when the backward ends, and
    hold up every bucket after it."""
    out, run = [], n_units - 1
    for i, u in enumerate(unit_of):
        if u == 0:
            if i == 0 or unit_of[i - 1] != 0:
                run += 1
            out.append(run)
        else:
            out.append(u)
    return out


class UnitsView:
    """What ``fdp.Apply`` needs to run a forward unit by unit (``fdp._protocols.UnitsView``):
    per leaf its key, its real tensor and its meta placeholder, per unit its module name,
    and the calls around a unit's forward."""

    __slots__ = ("units", "keys", "tensors", "placeholders", "unit_of", "names", "root", "layout", "_finish")

    def __init__(self, units: Units, tensors: list[torch.Tensor], finish: Callable[[], None] | None) -> None:
        self.units, self.tensors, self._finish = units, tensors, finish
        self.keys, self.placeholders = units.keys, units.placeholders
        self.unit_of, self.names, self.layout = units.unit_of, units.names, units
        self.root = 0 if units.buckets_of[0] else None

    def enter(self, u: int) -> None:
        self.units.enter(u)

    def exit(self, u: int, output: Any) -> None:
        self.units.exit(u, output)

    def gathered(self, u: int) -> bool:
        """Whether unit ``u``'s params are gathered now (a recomputation may read them)."""
        return self.units.gathered(u)

    def recomputing(self) -> None:
        """torch is about to run part of the forward again inside the backward (activation
        checkpointing): units it enters are gathered and kept until their gradients are in."""
        self.units.backward = True

    def done(self) -> None:
        """The forward's call has returned (an inference forward frees everything now; a
        step's forward leaves that to the step)."""
        if self._finish is not None:
            self._finish()


# What a forward over the units is for (``Units.phase``), as messages name it.
PHASES = ("a step", "step.accumulate", "an inference forward")


class Units:
    """The gathered params of every unit of one fully sharded step (see the module docstring).

    Args:
      plan: the step's plan (one bucket per unit and dtype). slices: the slices of it over
      the shard group. scatter: the all-gathers (None: a world of one). group: the shard
      group. names: the units' module names, the root's first. reshard_after_forward: free a
      unit after its forward. param_dtype: the dtype units are gathered and computed in.
      check_idle: raises while a step of the same Reducer is in flight (an inference forward
      must not gather into a step's buffers).
    """

    def __init__(self, plan: BucketPlan, slices: Slices, scatter: Scatter | None, group: Group,
                 names: tuple[str, ...], reshard_after_forward: bool, param_dtype: torch.dtype | None,
                 check_idle: Callable[[str], None], debug: bool = False) -> None:
        self.plan, self.slices, self.scatter, self.group = plan, slices, scatter, group
        # ``debug`` (FDP_DEBUG): before each gather, every rank checks that the others gather
        # the same unit's bucket in the same kind of call (a fingerprint all-gather), so a
        # unit called on some ranks only, or an accumulate paired with a step, is named at
        # once; ``calls`` counts the forwards begun, ``phase`` is this one's kind (PHASES).
        self.debug, self.calls, self.phase = debug, 0, 0
        self.names, self.reshard_after_forward, self.check_idle = names, reshard_after_forward, check_idle
        self.keys = list(_tree.keys(plan.treedef))
        self.unit_of_bucket = [b.group if b.group < len(names) else 0 for b in plan.buckets]  # (bucket_groups)
        self.unit_of = [self.unit_of_bucket[s.bucket] for s in plan.slots]
        self.buckets_of: list[list[int]] = [[] for _ in names]
        for b, u in enumerate(self.unit_of_bucket):
            self.buckets_of[u].append(b)
        # gathered (and computed) in ``param_dtype``, kept in the params' own (mixed precision)
        dtype = [param_dtype or b.dtype for b in plan.buckets]
        self.fulls = [torch.empty(n, dtype=d, device=b.device) for b, n, d in zip(plan.buckets, slices.padded, dtype)]
        self.nbytes = [f.untyped_storage().nbytes() for f in self.fulls]
        self.leaves = [torch.empty(0, dtype=dtype[s.bucket], device=s.device).set_(
            self.fulls[s.bucket].untyped_storage(), s.offset, s.shape, contiguous_strides(s.shape))
            for s in plan.slots]
        self.placeholders = [
            Placeholder.make(s.shape, dtype[s.bucket], f"param {k!r} of unit {names[self.unit_of[i]] or '(root)'!r}")
            for i, (k, s) in enumerate(zip(self.keys, plan.slots))]
        for f in self.fulls:
            free_storage(f)
        self.state = [UnitState.FREE] * len(plan.buckets)
        self.works: list[Any] = [None] * len(plan.buckets)
        self.issued = [0.0] * len(plan.buckets)
        self.count = [0] * len(plan.buckets)  # gathers issued this step, per bucket
        self.drained: list[tuple[int, Any]] = []  # a failed step's gathers (``drain``)
        self.times: list[BucketTimes] | None = None
        self.t0 = 0.0
        first = [min((i for i, u in enumerate(self.unit_of) if u == v), default=len(self.unit_of))
                 for v in range(len(names))]
        self.order = sorted((u for u in range(len(names)) if self.buckets_of[u]), key=lambda u: first[u])
        self.src: list[torch.Tensor] | None = None
        self.entered: list[int] = []
        self.kept: set[int] = set()
        self.complete = bytearray(len(plan.buckets))  # per bucket: its gradients are all in, this step (``on_complete``)
        self.backward = False
        self.training = False

    # ------------------------------------------------------------------ a step
    def begin(self, src: list[torch.Tensor], training: bool, tensors: list[torch.Tensor] | None = None,
              finish: Callable[[], None] | None = None, times: list[BucketTimes] | None = None,
              t0: float = 0.0, phase: int = 0) -> UnitsView:
        """Start a forward over the param slices ``src`` (one per bucket); ``training``: a
        backward follows (the units' outputs get hooks, a unit is freed once its gradients
        are in their bucket). ``tensors``: the leaves the forward uses (a step's autograd
        leaves on the gathered storage; default: the units' own). ``finish``: what the
        view's ``done`` calls. ``times``: the step's ``BucketTimes`` (since ``t0``), where
        each gather is recorded."""
        self.src, self.training, self.times, self.t0 = src, training, times, t0
        self.calls, self.phase = self.calls + 1, phase
        self.entered, self.kept, self.backward = [], set(), False
        self.count = [0] * len(self.fulls)
        self.complete = bytearray(len(self.plan.buckets))
        return UnitsView(self, self.leaves if tensors is None else tensors, finish)

    def inference(self, src: list[torch.Tensor]) -> UnitsView:
        """A forward over ``src`` without a backward (``ShardedParams`` under ``torch.no_grad``):
        units gathered one at a time, everything freed when it returns."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fdp: ShardedParams gather each unit only while it runs, so autograd cannot keep them for a "
                "backward: run inference under torch.no_grad() (or torch.inference_mode()), and train "
                "through the step (reducer.grad_and_update), which gathers them again for its backward")
        self.check_idle("a forward on ShardedParams")
        return self.begin(src, training=False, finish=self.end, phase=2)

    def drain(self) -> bool:
        """This rank's forward or backward failed: issue, without waiting, the all-gathers the
        other ranks still expect of it this step (each unit's forward gather, and its backward
        one unless it stays gathered), so that they finish the step and learn of the failure
        from its status instead of waiting for the timeout. Only where gathers are point to
        point (gloo), which pairs them by unit whatever the order; elsewhere (NCCL, the threaded
        test group, or with ``debug``'s fingerprints) the order of every collective counts, and
        the others are stopped by the stall check or the timeout.
        Returns whether this rank has issued any gather this step."""
        issued = any(self.count)
        scatter = self.scatter
        # (Not under ``debug``: each gather's fingerprint is an ordered collective, which a
        # failed rank cannot issue in the order the others reach them.)
        if scatter is None or scatter.mode != "p2p" or self.src is None or self.debug:
            return issued
        scratch: dict[torch.dtype, torch.Tensor] = {}
        for b in range(len(self.fulls)):
            u = self.unit_of_bucket[b]
            expected = 1 if u == 0 or u in self.kept or not self.reshard_after_forward else 2
            for _ in range(expected - self.count[b]):
                # this rank's slice goes out; what comes in is not looked at (one slice-sized
                # buffer takes every such receive)
                mine = self.src[b].to(self.fulls[b].dtype)
                buf = scratch.get(mine.dtype)
                if buf is None:
                    buf = scratch[mine.dtype] = mine.new_empty(max(self.slices.numel(c) for c in range(len(self.fulls))))
                work = exchange([(mine, j) for j in scatter.peers], [(buf[:mine.numel()], j) for j in scatter.peers],
                                self.group, f"all-gather of bucket {b}'s params (a failed step's)", tag=2 * b + 1)
                self.drained.append((b, (work, mine, buf)))
        return issued or bool(self.drained)

    def end(self, quiet: bool = False) -> None:
        """The step is over (or failed): wait for any gather in flight, free everything, and
        keep this forward's unit order for the next step's prefetches. A gather in flight that
        fails is raised once everything is freed, unless ``quiet`` (the step failed already:
        its own error is the one to raise)."""
        drained, self.drained = self.drained, []
        for b, (work, _, _) in drained:  # (the tensors stay alive until their exchange is done)
            try:
                wait(work, self.group, f"all-gather of bucket {b}'s params (a failed step's)")
            except Exception:  # noqa: BLE001 - the step's own error is the one to raise
                pass
        error: Exception | None = None
        for b in range(len(self.fulls)):
            try:
                self.reshard(b)
            except Exception as e:  # (a gather in flight failed: free the rest, then say so)
                error = error or e
                self.reshard(b)  # (its wait left it gathered: free it)
        if self.entered:
            rest = [u for u in self.order if u not in self.entered]
            self.order = self.entered + rest
        self.src, self.times = None, None
        if error is not None and not quiet:
            raise error

    def whole(self, src: list[torch.Tensor], what: str) -> Any:
        """The whole params tree on every rank from the slices ``src`` (a collective: every
        bucket is all-gathered into a new tensor)."""
        return self.plan.views([self.gather_bucket(src, b, what) for b in range(len(self.plan.buckets))])

    def gather_bucket(self, src: list[torch.Tensor], b: int, what: str) -> torch.Tensor:
        """Bucket ``b``'s whole flat params on every rank, from the slices ``src``, in a new
        tensor (a collective: one all-gather)."""
        scatter, slices, bucket = self.scatter, self.slices, self.plan.buckets[b]
        out = torch.empty(slices.padded[b], dtype=bucket.dtype, device=bucket.device)
        out[slices.lo[b]:slices.hi[b]].copy_(src[b])
        if scatter is not None:
            wait(scatter.gather(b, out), self.group, f"{what}: gathering bucket {b}'s params")
            scatter.gathered(b)
        return out

    # ------------------------------------------------------------------ forward hooks
    def enter(self, u: int) -> None:
        if self.training and torch.is_grad_enabled() and _internals.in_forward_ad():
            raise RuntimeError(
                "fdp: torch.func.jvp (forward-mode AD) through a unit of fully sharded params inside the step's "
                "loss is not supported: the unit's gathers would pair differently across ranks in the backward. "
                "vmap and torch.func.grad inside the loss work; for jvp use shard=True (sharded optimizer state) "
                "or the unsharded step, where it runs")
        if u not in self.entered:
            self.entered.append(u)
        self.unshard_unit(u)
        if not self.backward:  # prefetch the unit that ran next last time
            order = self.order
            if u in order:
                i = order.index(u) + 1
                if i < len(order):
                    self.prefetch(order[i])

    def exit(self, u: int, output: Any) -> None:
        if self.backward:  # (a recomputation inside the backward: activation checkpointing)
            return
        if self.training and torch.is_grad_enabled():
            hook = self._pre_backward_hook(u)
            for t in _tree.leaves(output):
                if isinstance(t, torch.Tensor):
                    t = _internals.unbatched(t)  # (inside torch.func.vmap: the tensor the backward sees)
                    if t.requires_grad:
                        t.register_hook(hook)
        if u != 0 and u not in self.kept and (self.reshard_after_forward or not self.training):
            for b in self.buckets_of[u]:
                self.reshard(b)

    def keep(self, u: int) -> None:
        """Unit ``u`` was read outside its module's forward: gather it and keep it for the
        rest of the step."""
        self.kept.add(u)
        self.unshard_unit(u)

    def _pre_backward_hook(self, u: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self.before_backward(u)
        return hook

    # ------------------------------------------------------------------ backward
    def before_backward(self, u: int) -> None:
        """A gradient has reached unit ``u``'s outputs: gather it (again), and prefetch the unit
        that ran before it in the forward."""
        self.backward = True
        if all(self.complete[b] for b in self.buckets_of[u]):
            return
        self.unshard_unit(u)
        if u in self.entered:
            for v in reversed(self.entered[:self.entered.index(u)]):
                if any(not self.complete[b] for b in self.buckets_of[v]):
                    self.prefetch(v)
                    break

    def on_complete(self, b: int) -> None:
        """``StepSpec.on_complete``: every gradient of bucket ``b`` is in."""
        self.complete[b] = 1
        self.reshard(b)

    # ------------------------------------------------------------------ per unit
    def gathered(self, u: int) -> bool:
        return all(self.state[b] is UnitState.UNSHARDED for b in self.buckets_of[u])

    def unshard_unit(self, u: int) -> None:
        """Unit ``u``'s params gathered (waits for a prefetch in flight)."""
        for b in self.buckets_of[u]:
            if self.state[b] is UnitState.FREE:
                self.unshard(b)
        for b in self.buckets_of[u]:
            if self.state[b] is UnitState.UNSHARDING:
                self.wait_for_unshard(b)

    def prefetch(self, u: int) -> None:
        """Issue unit ``u``'s all-gathers (a unit whose gradients are in is not gathered again)."""
        for b in self.buckets_of[u]:
            if self.state[b] is UnitState.FREE and not self.complete[b]:
                self.unshard(b)

    # ------------------------------------------------------------------ per bucket
    def unshard(self, b: int) -> None:
        """Allocate bucket ``b``'s storage and issue its all-gather."""
        if self.src is None:
            raise RuntimeError("fdp: a unit of fully sharded params ran outside a step (its params are not "
                               "gathered); call apply inside the step's loss, or with ShardedParams under torch.no_grad()")
        full = self.fulls[b]
        if self.debug and self.scatter is not None:
            check_collective(self.group, self.calls * len(PHASES) + self.phase, b, full.numel(), full.dtype,
                             self._what(b, self.count[b] + 1))
        alloc_storage(full, self.nbytes[b])
        s = self.slices
        # (inside a transform in the loss, torch.func.jvp or grad: plain copies into fdp's buffer)
        with _internals.outside_transforms():
            full[s.lo[b]:s.hi[b]].copy_(self.src[b])
            self.works[b] = self.scatter.gather(b, full) if self.scatter is not None else DONE
        self.count[b] += 1
        self.issued[b] = time.perf_counter()
        self.state[b] = UnitState.UNSHARDING

    def _what(self, b: int, n: int) -> str:
        """Bucket ``b``'s ``n``-th gather of this call, as messages name it."""
        return (f"all-gather of unit {self.names[self.unit_of_bucket[b]] or '(root)'}'s params (bucket {b}, for "
                f"{'the forward' if n == 1 else 'the backward'} of its call {self.calls}: {PHASES[self.phase]})")

    def wait_for_unshard(self, b: int) -> None:
        work, self.works[b] = self.works[b], None
        self.state[b] = UnitState.UNSHARDED  # (allocated: freed by ``end`` even when the wait fails)
        waited = time.perf_counter()
        try:
            wait(work, self.group, self._what(b, self.count[b]))
        except CollectiveError as e:
            if not self.debug and "issued different collectives" not in str(e):
                e.add_note(
                    "fdp: a unit's gather pairs with the same unit's gather on the other ranks: a rank that never "
                    "gathers it (a branch that skips the unit on some ranks, fewer step.accumulate calls than the "
                    "others, a call skipped after an error) leaves the others waiting here; when that rank waits "
                    "in another collective meanwhile, FDP_STALL_S names both, otherwise the timeout ends it. "
                    "FDP_DEBUG=1 (or Reducer(debug=True)) names such a call before its gather, on every rank.")
            raise
        if self.scatter is not None:
            with _internals.outside_transforms():
                self.scatter.gathered(b)
        if self.times is not None:
            t0 = self.t0
            times = self.times[b]
            times.gather_nbytes = self.nbytes[b]
            times.gathers.append(Gather(self.issued[b] - t0, waited - t0, time.perf_counter() - t0))

    def reshard(self, b: int) -> None:
        """Free bucket ``b``'s gathered params (after its all-gather, if one is in flight)."""
        if self.state[b] is UnitState.UNSHARDING:
            self.wait_for_unshard(b)
        if self.state[b] is UnitState.UNSHARDED:
            free_storage(self.fulls[b])
            self.state[b] = UnitState.FREE
            times = self.times
            if times is not None and times[b].gathers and times[b].gathers[-1].freed is None:
                times[b].gathers[-1] = times[b].gathers[-1]._replace(freed=time.perf_counter() - self.t0)


class Gathering(Mapping):
    """The params a fully sharded step passes to the loss function: a read-only mapping
    from each key to its leaf. ``fdp.Apply`` runs the forward unit by unit through it
    (``units_view``); reading a leaf directly (``params[key]``) gathers its unit and keeps
    it gathered until the step's backward is done with it."""

    __slots__ = ("_view", "_index")

    def __init__(self, view: UnitsView) -> None:
        self._view = view
        self._index = {k: i for i, k in enumerate(view.keys)}

    def __getitem__(self, key: Any) -> torch.Tensor:
        i = self._index[key]
        self._view.units.keep(self._view.unit_of[i])
        return self._view.tensors[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._view.keys)

    def __len__(self) -> int:
        return len(self._view.keys)

    def units_view(self) -> UnitsView:
        return self._view

    def __repr__(self) -> str:
        return f"fdp.Gathering({len(self)} params in {len(self._view.names)} units)"


__all__ = ["ROOT", "Gathering", "UnitState", "Units", "UnitsView", "alloc_storage", "bucket_groups", "free_storage",
           "unit_of_leaves"]
