"""One fused step's per-bucket progress after the step machine (``fdp/_fused.py``'s ``Run``).

A bucket *arrives* when its collective lands, is *updated* by the optimizer's kernel on its
(slice of the) flat params, gradients and state, and, sharded, its params are *gathered*
from every rank. ``FusedCore.run`` makes one ``Run`` per step and hands it the core (plan,
kernel, transforms, shards, mesh) and the step's param sets.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .._comm.agree import count_ranks
from .._comm.collectives import all_reduce, wait
from .._step.machine import all_finite
from ..optim._flat import chunks
from .state import FusedState

__all__ = ["Run"]

class Run:
    """One fused step's per-bucket progress after the step machine: a bucket *arrives* when
    its collective lands (this rank's slice summed, and all-reduced over the replicas of a
    2-D mesh), is *updated* (its slice of the params, with its slice of the state), and,
    sharded, its params are *gathered* from every rank. Updates run on arrival when every
    transform is elementwise and no finite check is asked for; otherwise once every bucket
    has arrived (a global norm, the finite verdict)."""

    __slots__ = ("core", "step", "state", "src", "dst", "slices", "grads", "rep", "next_rep", "landed",
                 "updated", "gathers", "tstates", "early", "stats", "coef", "each")

    def __init__(self, core: Any, step: Any, state: FusedState, src: Any, dst: Any) -> None:
        nb = len(core.plan.buckets)
        self.core, self.step, self.state, self.src, self.dst = core, step, state, src, dst
        self.slices: list[torch.Tensor | None] = [None] * nb  # reduced gradient slices (wire dtype)
        self.rep: list[Any] = [None] * nb  # replica all-reduces in flight (2-D meshes)
        self.next_rep = 0  # buckets whose replica all-reduce was issued
        self.landed = 0  # ... and of those, whose all-reduce is done
        self.updated = bytearray(nb)
        self.gathers: list[Any] = []
        self.grads: list[torch.Tensor | None] = [None] * nb  # ... in the params' dtype
        self.tstates = list(state.transforms)
        self.early = core.elementwise and not core.skip_nonfinite
        # The transforms each bucket's update applies itself (index, transform): all of them
        # when updating on arrival, else those after the whole-tree ones (see finish).
        self.each: list[tuple[int, Any]] = list(enumerate(core.transforms)) if self.early else []
        # A leading whole-tree transform with a partial (the global norm): each bucket's part
        # is computed as the bucket lands, during the backward; the factor after the last.
        first = core.transforms[0] if core.transforms else None
        self.stats: list[Any] | None = None
        if not self.early and first is not None and first.partial is not None and first.coefficient is not None:
            self.stats = [None] * nb
        self.coef: torch.Tensor | None = None  # that transform's factor, applied per bucket

    def arrive(self, b: int, flat: torch.Tensor) -> None:
        """``Step.on_ready``: bucket ``b``'s collective has landed in ``flat``."""
        core = self.core
        self.slices[b] = core.scatter.finish(b, flat) if core.scatter is not None else flat
        if core.mesh.replicate is not None and core.scatter is not None:
            self._launch_replicas()
            return
        self._arrived(b)

    def _arrived(self, b: int) -> None:
        """Bucket ``b``'s (slice of the) averaged gradient is final: update it now (early), or
        compute its part of the leading whole-tree transform's statistic."""
        if self.early:
            self.update(b)
        elif self.stats is not None:
            self.stats[b] = self.core.transforms[0].partial([self.grad(b)])

    def _launch_replicas(self, force: bool = False) -> None:
        """All-reduce the arrived slices over the replicas, in bucket order (zeros if ``force``
        finds a slice missing: a failed step, whose values every rank discards)."""
        core, nb = self.core, len(self.slices)
        while self.next_rep < nb and (force or self.slices[self.next_rep] is not None):
            b = self.next_rep
            if self.slices[b] is None:
                self.slices[b] = core.shards.mine(b, core.machine.buffers.wire(b)).zero_()
            self.rep[b] = all_reduce(self.slices[b], core.mesh.replicate, f"replica all-reduce of bucket {b}",
                                     async_op=True)
            self.next_rep += 1
        if force:
            return
        while self.landed < self.next_rep and self.rep[self.landed].is_completed():  # in order
            self._landed()

    def _landed(self) -> None:
        """The replica all-reduce of bucket ``self.landed`` is done: update it (early)."""
        b = self.landed
        self.rep[b] = None
        self.landed += 1
        self._arrived(b)

    def reduced(self) -> None:
        """The step machine finished: wait for the replica all-reduces still in flight."""
        core = self.core
        if core.mesh.replicate is None or core.scatter is None:
            return
        while self.landed < self.next_rep:
            wait(self.rep[self.landed], core.mesh.replicate, f"replica all-reduce of bucket {self.landed}")
            self._landed()

    def drain(self) -> None:
        """The step failed on this rank or another: issue this rank's share of whatever
        collectives the others may be waiting in (2-D: the replica all-reduces), then return."""
        core = self.core
        if core.mesh.replicate is None or core.scatter is None:
            return
        self._launch_replicas(force=True)
        for b, work in enumerate(self.rep):
            if work is not None:
                try:
                    wait(work, core.mesh.replicate, f"replica all-reduce of bucket {b}")
                except Exception:  # noqa: BLE001 - the step's own error is the one to raise
                    pass

    def grad(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s (slice of the) gradient in the params' dtype (cast once)."""
        g = self.grads[b]
        if g is None:
            g = self.grads[b] = self.core.grad_of(b, self.slices[b])
        return g

    def update(self, b: int) -> None:
        core, step = self.core, self.step
        t0 = time.perf_counter()
        g = self.grad(b)
        if self.coef is not None:
            g.mul_(self.coef)
        for i, t in self.each:
            self.tstates[i] = t.update_in_place([g], self.tstates[i])
        s = core.shards
        p = s.mine(b, self.dst.flats[b])
        if self.dst is not self.src:
            p.copy_(s.mine(b, self.src.flats[b]))
        # In chunks: each chunk's passes stay in cache, and the kernel's temporaries are
        # chunk-sized rather than bucket-sized (CHUNK's comment).
        core.kernel.step(core.plan.buckets[b].group, chunks(p), chunks(g),
                         [chunks(self.state.buffers[f][b]) for f in core.kernel.fields], self.state.step)
        self.updated[b] = 1
        times = step.times[b]
        times.update_start, times.update_end = t0 - step.t0, time.perf_counter() - step.t0

    def finish(self) -> bool:
        """Update what is left (after the global transforms and the finite check), gather the
        params of a sharded step; returns the finite verdict (False: nothing was updated)."""
        core = self.core
        sharded = core.scatter is not None
        if core.skip_nonfinite:
            finite = all_finite(self.slices)
            if sharded:  # each rank checked its slices: the verdict is every rank's
                finite = count_ranks(not finite, core.mesh.shard, f"{core.name}: finite check") == 0
            if not finite:
                return False
        if not self.early:
            self._whole_tree(sharded)
        for b in range(len(self.slices)):
            if not self.updated[b]:
                self.update(b)
            if sharded:  # bucket b's params gather while bucket b + 1 updates
                if self.gathers:  # one in flight at a time: its staging buffer serves the next
                    self._gathered(*self.gathers.pop())
                self.gathers.append((b, core.scatter.gather(b, self.dst.flats[b])))
        for b, work in self.gathers:
            self._gathered(b, work)
        return True

    def _whole_tree(self, sharded: bool) -> None:
        """Every bucket has arrived: run the chain's transforms up to the last whole-tree one
        over all buckets; those after it run per bucket in ``update``. A leading transform
        with a partial only combines the parts computed on arrival into its factor, which
        ``update`` multiplies each bucket by (the same product as its ``update_in_place``)."""
        core = self.core
        transforms = core.transforms
        start = 0
        if self.stats is not None:
            parts = [n for b, part in enumerate(self.stats)
                     for n in (part if part is not None else transforms[0].partial([self.grad(b)]))]
            self.coef, self.tstates[0] = transforms[0].coefficient(parts, self.tstates[0],
                                                                    core.reduce if sharded else None)
            start = 1
        last = max((i for i, t in enumerate(transforms) if not t.elementwise), default=-1)
        if last >= start:  # another whole-tree transform: the factor and the rest over every bucket
            gs = [self.grad(b) for b in range(len(self.slices))]
            if self.coef is not None:
                torch._foreach_mul_(gs, self.coef)
                self.coef = None
            for i in range(start, last + 1):
                t = transforms[i]
                if sharded and not t.elementwise and t.update_sharded is None:  # its partial/coefficient pair
                    coef, self.tstates[i] = t.coefficient(t.partial(gs), self.tstates[i], core.reduce)
                    torch._foreach_mul_(gs, coef)
                elif sharded and not t.elementwise:
                    self.tstates[i] = t.update_sharded(gs, self.tstates[i], core.reduce)
                else:
                    self.tstates[i] = t.update_in_place(gs, self.tstates[i])
            start = last + 1
        self.each = [(i, transforms[i]) for i in range(start, len(transforms))]

    def _gathered(self, b: int, work: Any) -> None:
        core = self.core
        wait(work, core.mesh.shard, f"all-gather of bucket {b}'s params")
        core.scatter.gathered(b)
        self.step.times[b].gathered = time.perf_counter() - self.step.t0
