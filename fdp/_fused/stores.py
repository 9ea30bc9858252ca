"""Where a fused step keeps the params, gradients and optimizer state: a ``Store``, one of three,
chosen when the engine is built (``store_for``).

* ``ReplicatedStore`` (no ``shard``): every rank holds whole flat buckets of params,
  gradients and state (DDP's layout, flat).
* ``SlicedStore`` (``shard=True``, ZeRO-1/2): each bucket is reduce-scattered, a rank keeps
  and updates its slice of the state, and the updated params are all-gathered at the end of
  the step, so every rank holds whole params between steps.
* ``UnitStore`` (``shard="params"``, ZeRO-3): a rank keeps only its slices of the params,
  gradients and state; units are gathered on demand around their forward and backward
  (``fdp._units``), the wire buffers are transient, and nothing is gathered after the update.

The engine (``fdp/_fused/engine.py``) and its runs are written once against the ``Store``
protocol: what differs between the three is what a store answers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .. import _tree
from .._comm.group import Group
from .._plan.bucket import BucketPlan
from .._plan.buffers import BucketBuffers
from .._slices.exchange import Scatter, Straddles
from .._slices.geometry import Slices
from .._step.autodiff import autograd_on, local_grads
from .._step.config import StepConfig
from .._step.machine import Step, StepMachine
from .._units.units import Gathering, Units, alloc_storage, free_storage
from ..hooks import CommHook
from .params import ParamSet, ParamSets, SliceSets

__all__ = ["Accumulation", "ReplicatedStore", "SlicedStore", "Store", "StoreKind", "UnitStore", "store_for"]

# Wire buffers a fully sharded step's buckets in flight share (each the largest bucket's size).
# One: a bucket is filled once the previous one's reduce-scatter has landed, which it has by
# then when a unit's backward takes longer than its reduce-scatter (the backward of a unit is
# also its recompute under activation checkpointing). A second (one filled while one is on the
# wire) cost 18 MiB of 439 at the step's peak in `bench large` at 2 ranks (docs/measurements.md).
TRANSIENT = 1


class StoreKind(enum.Enum):
    REPLICATED = "replicated"
    SLICED = "sliced over the ranks"
    UNITS = "units gathered on demand"


class Accumulation:
    """This rank's local gradients of the micro-batches since the last step (``step.accumulate``),
    summed in place: per leaf (``grads``), and where they lie in flat per-bucket buffers, those
    (``flats``); or, with ``reduce_micro_batches``, their means over the ranks, reduced as they
    went, this rank's slice of each bucket (``slices``, ``fdp/_fused/micro.py``); ``count``
    micro-batches so far. A micro-batch is added only once its backward has completed (a
    failed one adds nothing). ``lost``: the step that was to close the cycle failed after
    taking its micro-batches (they went into its buckets): why the next step alone is refused
    (None: nothing lost)."""

    __slots__ = ("grads", "flats", "slices", "count", "lost")

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] | None = None
        self.flats: list[torch.Tensor] | None = None
        self.slices: list[torch.Tensor | None] | None = None
        self.count = 0
        self.lost: str | None = None

    def flat(self, plan: BucketPlan) -> None:
        """Make the flat per-bucket buffers (``flats``, ``grads`` their per-leaf views) once."""
        if self.grads is None:
            self.flats = [torch.empty(b.numel, dtype=b.dtype, device=b.device) for b in plan.buckets]
            self.grads = _tree.leaves(plan.views(self.flats))


class Store(Protocol):
    """What the fused engine asks of where its params, gradients and state live.

    Attributes:
      kind: which of the three stores. slices: how each bucket is cut over the shard group
      (one slice, the whole bucket, when replicated). scatter: the reduce-scatter and
      all-gather (None: the buckets are all-reduced whole). straddles: the leaves that cross
      a slice boundary, for exact per-leaf statistics (None when unsliced). params: the
      param sets. gathers_params: the updated slices are all-gathered at the end of the step.
      compute: the dtype the loss sees whole params cast to (``param_dtype``; None: the
      params themselves, or units gathered in it). hook_threshold: the step machine's
      ``hook_threshold_bytes``.
    """

    kind: StoreKind
    slices: Slices
    scatter: Scatter | None
    straddles: Straddles | None
    params: ParamSets
    gathers_params: bool
    compute: torch.dtype | None
    hook_threshold: int

    def comm_hook(self, hook: CommHook) -> CommHook:
        """The hook each bucket's collective goes through (the configured one, or the scatter)."""
        ...

    def bucket_buffers(self, wires: list[torch.dtype]) -> BucketBuffers:
        """The flat buffers buckets are filled and reduced in."""
        ...

    def attach(self, machine: StepMachine) -> None:
        """The engine's step machine is built."""
        ...

    # ``keep(b, mine, keep) -> Tensor``: bucket ``b``'s reduced (slice of the) gradient ``mine``,
    # as a run keeps it (``keep``: the run needs it after the bucket's collective has landed,
    # not only while it lands); None: ``mine`` itself, a view of the bucket's buffer, which is
    # reused only next step.
    keep: Callable[[int, torch.Tensor, bool], torch.Tensor] | None
    # ``StepSpec.on_complete``: bucket ``b``'s gradients are all in, not yet in its flat buffer,
    # and ``StepSpec.on_filled``: they are in it (None: nothing to do).
    on_complete: Callable[[int], None] | None
    on_filled: Callable[[int], None] | None

    def differentiated(self, src: ParamSet, step: Step) -> tuple[list[torch.Tensor], Callable | None]:
        """The leaves a step's loss is differentiated in, over the params in ``src``, and what
        makes the loss's argument from them (None: the tree of them)."""
        ...

    def failed(self) -> bool:
        """This rank's forward or backward failed: issue what the other ranks still expect of it
        outside the step machine; returns whether it had issued any such collective."""
        ...

    def ended(self, quiet: bool = False) -> None:
        """The step is over (or failed: ``quiet``, a collective that fails in the clean-up is
        not raised, so the step's own error is the one the caller sees)."""
        ...

    def accumulate(self, acc: Accumulation, fn: Callable, has_aux: bool, params: Any, rest: tuple,
                   kwargs: dict) -> Any:
        """Add this rank's gradients of one micro-batch into ``acc`` (no communication)."""
        ...

    def gathered_bytes(self) -> int:
        """Bytes of gathered params held now, beyond this rank's own (0 but for units)."""
        ...


def store_for(config: StepConfig, plan: BucketPlan, name: str) -> Store:
    """The store of a Reducer's fused steps: units with ``shard="params"``, sliced with
    ``shard=True`` over more than one rank, else replicated."""
    if config.units is not None:
        return UnitStore(config, plan, name)
    if config.sharded:
        return SlicedStore(config, plan, name)
    return ReplicatedStore(config, plan, name)


def _scattering(scatter: Scatter, hook: CommHook) -> CommHook:
    """The configured hook's wire dtype, with the bucket's reduce-scatter as its collective."""
    return CommHook(lambda bucket, flat, group: scatter.launch(bucket.index, flat), dtype=hook.dtype,
                    name=f"{hook.name}, sharded", in_place=True)


class ReplicatedStore:
    """Whole flat buckets of params, gradients and state on every rank."""

    kind = StoreKind.REPLICATED
    scatter: Scatter | None = None
    straddles: Straddles | None = None
    gathers_params = False
    keep = None
    on_complete = None
    on_filled = None

    def __init__(self, config: StepConfig, plan: BucketPlan, name: str) -> None:
        self.config, self.plan, self.name = config, plan, name
        self.slices = Slices(plan, 1, 0)
        self.params = ParamSets(plan, self.slices, name)
        self.hook_threshold = config.hook_threshold_bytes
        # Mixed precision (``param_dtype``): the loss runs on a copy of the params cast to it,
        # made again each step from the masters the update writes (Megatron's bf16 params
        # with fp32 main params); the gradients are cast back at the bucket fill.
        self.compute = config.param_dtype if any(b.dtype != config.param_dtype for b in plan.buckets) \
            and config.param_dtype is not None else None
        self._casts: list[torch.Tensor] | None = None
        self._cast_leaves: list[torch.Tensor] = []

    def cast(self, src: ParamSet) -> list[torch.Tensor]:
        """The params of ``src`` cast to ``param_dtype`` (one buffer per bucket, made once and
        written again each call), each leaf a view of them, in plan order."""
        plan = self.plan
        if self._casts is None:
            self._casts = [torch.empty(b.numel, dtype=self.compute, device=b.device) for b in plan.buckets]
            self._cast_leaves = _tree.leaves(plan.views(self._casts))
        torch._foreach_copy_(self._casts, [f[:b.numel] for f, b in zip(src.flats, plan.buckets)])
        return self._cast_leaves

    def comm_hook(self, hook: CommHook) -> CommHook:
        return hook

    def bucket_buffers(self, wires: list[torch.dtype]) -> BucketBuffers:
        return BucketBuffers(self.plan, wires, reuse=True, padded=self.slices.padded)

    def attach(self, machine: StepMachine) -> None:
        pass

    def differentiated(self, src: ParamSet, step: Step) -> tuple[list[torch.Tensor], Callable | None]:
        if self.compute is not None:
            return self.cast(src), None
        return src.inner(self.plan), None  # (the padding of a sliced step's flats is left out)

    def failed(self) -> bool:
        return False

    def ended(self, quiet: bool = False) -> None:
        pass

    def gathered_bytes(self) -> int:
        return 0

    def accumulate(self, acc: Accumulation, fn: Callable, has_aux: bool, params: Any, rest: tuple,
                   kwargs: dict) -> Any:
        return _accumulate_flat(self.plan, self.params, self.config.engine, acc, fn, has_aux, params, rest, kwargs,
                                self.name, self.cast if self.compute is not None else None)


class SlicedStore(ReplicatedStore):
    """Whole flat buckets of params on every rank between steps; each bucket reduce-scattered,
    each rank's slice of the state and of the update, the params all-gathered after it."""

    kind = StoreKind.SLICED
    gathers_params = True

    def __init__(self, config: StepConfig, plan: BucketPlan, name: str) -> None:
        super().__init__(config, plan, name)
        shard: Group = config.mesh.shard
        self.slices = Slices(plan, shard.size, shard.rank)
        self.params = ParamSets(plan, self.slices, name)
        self.scatter = Scatter(self.slices, shard)
        self.straddles = Straddles(plan, self.slices)

    def comm_hook(self, hook: CommHook) -> CommHook:  # (the Reducer has checked that it sums in place)
        return _scattering(self.scatter, hook)


class UnitStore:
    """Only this rank's slices of params, gradients and state; each unit gathered on demand."""

    kind = StoreKind.UNITS
    gathers_params = False
    compute = None  # (the units are gathered in param_dtype themselves: fdp._units)
    hook_threshold = 0  # every bucket hooked: a bucket launched only when the backward returns keeps its unit

    def __init__(self, config: StepConfig, plan: BucketPlan, name: str) -> None:
        if config.engine != "autograd":
            raise ValueError(f"{name}: shard='params' computes gradients with autograd (engine='auto'); "
                             f"engine={config.engine!r} cannot gather units inside torch.func's transform")
        self.config, self.plan, self.name = config, plan, name
        shard = config.mesh.shard
        self.slices = Slices(plan, shard.size, shard.rank) if config.sharded else Slices(plan, 1, 0)
        self.scatter = Scatter(self.slices, shard) if config.sharded else None
        self.straddles = Straddles(plan, self.slices) if config.sharded else None
        self.machine: StepMachine | None = None
        self.units = Units(plan, self.slices, self.scatter, shard, config.units, config.reshard_after_forward,
                           config.param_dtype, self._check_idle, config.debug)
        self.params = SliceSets(self.units, plan, self.slices, name)
        self.kept: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self._acc: Accumulation | None = None  # step.accumulate's buffers, once made

    def _check_idle(self, what: str) -> None:
        if self.machine is not None:
            self.machine.check_idle(what)

    def comm_hook(self, hook: CommHook) -> CommHook:
        return _scattering(self.scatter, hook) if self.scatter is not None else hook

    def bucket_buffers(self, wires: list[torch.dtype]) -> BucketBuffers:
        return BucketBuffers(self.plan, wires, reuse=True, padded=self.slices.padded, transient=TRANSIENT)

    def attach(self, machine: StepMachine) -> None:
        self.machine = machine

    def keep(self, b: int, mine: torch.Tensor, keep: bool) -> torch.Tensor:
        """Copied out of the transient wire buffer into a slice-sized buffer of its own when the
        run needs it after it has landed (a whole-tree transform, the finite check, a replica
        sum); else the wire buffer's own slice, updated from before the buffer goes back."""
        if not keep:
            return mine
        buf = self.kept[b]
        if buf is None:
            buf = self.kept[b] = torch.empty(self.slices.numel(b), dtype=mine.dtype, device=mine.device)
        return buf.copy_(mine)

    def on_complete(self, b: int) -> None:
        """``StepSpec.on_complete``: bucket ``b``'s gradients are all in, so its unit's params can
        go (before a flat buffer is found and filled: not held beside it)."""
        self.units.on_complete(b)

    def on_filled(self, b: int) -> None:
        """``StepSpec.on_filled``: bucket ``b``'s gradients are in its flat buffer, so the
        accumulated micro-batches of its leaves can go when this step took them (made again by
        the next ``step.accumulate``): the memory of one set of whole gradients is not held
        into the update."""
        acc = self._acc
        if acc is not None and acc.count == 0 and acc.grads is not None:
            for i in self.plan.buckets[b].leaves:
                free_storage(acc.grads[i])

    def differentiated(self, src: Any, step: Step) -> tuple[list[torch.Tensor], Callable | None]:
        units = self.units

        def gathering(inputs: list[torch.Tensor]) -> Gathering:
            return Gathering(units.begin(src.flats, training=True, tensors=inputs, times=step.times, t0=step.t0))

        return units.leaves, gathering

    def failed(self) -> bool:
        return self.units.drain()

    def ended(self, quiet: bool = False) -> None:
        # The reduced slices kept for the update are not held between steps: at the next step's
        # peak (its backward, the accumulated micro-batches still whole) they would be one more
        # set of sharded gradients (measured: 72 MiB of 511 at 2 ranks in `bench large`).
        self.kept = [None] * len(self.kept)
        self.units.end(quiet)

    def gathered_bytes(self) -> int:
        return sum(f.untyped_storage().nbytes() for f in self.units.fulls)

    def accumulate(self, acc: Accumulation, fn: Callable, has_aux: bool, params: Any, rest: tuple,
                   kwargs: dict) -> Any:
        """This rank's gradients added into whole per-leaf accumulation buffers (the sum of the
        micro-batches, unsharded until the step averages it: the numbers of DDP's ``no_sync``),
        each unit gathered and freed as in a step. The sum takes one set of gradients; after
        the first micro-batch, each leaf's new sum is written beside the old one until the
        backward completes (a failed micro-batch adds nothing), so up to two sets at the peak."""
        self._check_idle(f"{self.name}.accumulate")
        units, plan = self.units, self.plan
        with autograd_on():
            src, _ = self.params.current(params, False)
            if acc.grads is None:
                acc.grads = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in plan.slots]
                self._acc = acc
            first = not acc.count
            if first:  # (the last step freed them bucket by bucket)
                for t in acc.grads:
                    alloc_storage(t, t.numel() * t.element_size())
            # After the first, each leaf's new sum is written beside the old one (one pass, as an
            # in-place add) and replaces it only when the whole backward has completed: a
            # micro-batch that fails adds nothing. (The first is copied in: nothing to keep.)
            grads, got = acc.grads, bytearray(len(plan.slots))
            sums: list[torch.Tensor | None] = [None] * len(plan.slots)
            pending = [len(b.leaves) for b in plan.buckets]

            def hook_for(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
                b = plan.slots[i].bucket

                def hook(grad: torch.Tensor) -> torch.Tensor:
                    if not got[i]:
                        got[i] = 1
                        if first:
                            grads[i].copy_(grad)
                        else:
                            sums[i] = torch.add(grads[i], grad, out=torch.empty_like(grads[i]))
                        pending[b] -= 1
                        if pending[b] == 0:
                            units.on_complete(b)
                    return grad.new_zeros(()).expand(grad.shape)
                return hook

            def gathering(inputs: list[torch.Tensor]) -> Gathering:
                return Gathering(units.begin(src.flats, training=True, tensors=inputs, phase=1))

            try:
                _, value = local_grads("autograd", fn, 0, has_aux, (None, *rest), kwargs, units.leaves, plan.treedef,
                                       [hook_for(i) for i in range(len(plan.slots))], None, wrap=gathering)
            except BaseException:
                units.drain()  # (the gathers the other ranks still expect of this micro-batch)
                raise
            finally:
                units.end()
            if first:
                for i in range(len(plan.slots)):
                    if not got[i]:
                        grads[i].zero_()  # (unused this micro-batch: its gradient is zero)
            else:
                for i, s in enumerate(sums):
                    if s is not None:
                        grads[i] = s
            acc.count += 1
            acc.lost = None
        return value


def _accumulate_flat(plan: BucketPlan, sets: ParamSets, engine: str, acc: Accumulation, fn: Callable, has_aux: bool,
                     params: Any, rest: tuple, kwargs: dict, name: str,
                     cast: Callable[[ParamSet], list[torch.Tensor]] | None = None) -> Any:
    """One micro-batch's local gradients added into flat per-bucket buffers (the first one
    copied) once its backward has completed: a micro-batch that fails adds nothing. (Not by
    autograd's own ``.grad`` accumulation: a backward that raised half-way would leave the
    leaves it had reached added; the same one add per element, at the memory of one more set
    of gradients while they are added.) ``cast``: mixed precision, the loss sees the params
    cast as in the step (their gradients are added into the buffers in the params' own
    dtype)."""
    with autograd_on():
        leaves = plan.leaves_of(params, f"{name}.accumulate params")
        if cast is not None:
            pset, _ = sets.current(leaves, False)
            leaves = cast(pset)
            params = _tree.unflatten(plan.treedef, leaves)
        grads, value = local_grads(engine, fn, 0, has_aux, (params, *rest), kwargs, leaves, plan.treedef, None, None)
        acc.flat(plan)
        if acc.count:
            if grads and grads[0].dtype != acc.grads[0].dtype:  # (mixed precision: the sum kept in the masters' dtype)
                grads = [g.to(a.dtype) for g, a in zip(grads, acc.grads)]
            torch._foreach_add_(acc.grads, grads)
        else:
            torch._foreach_copy_(acc.grads, grads)
        acc.count += 1
        acc.lost = None
    return value
