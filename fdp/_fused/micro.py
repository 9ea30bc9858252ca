"""``MicroRun``: one micro-batch of ``step.accumulate`` reduced as it goes
(``Reducer(..., reduce_micro_batches=True)``), its sum kept sharded.

The usual accumulation (DDP's ``no_sync``) keeps the sum of a rank's micro-batches whole until
the step averages it: one whole set of gradients on every rank, which for fully sharded params
is the largest thing a rank holds at the step's peak (docs/measurements.md, "The large-model
recipe"). Reduced micro-batches (FSDP2's default, gradient sync on every micro-batch; what
ZeRO-2/3 do) cost one reduce-scatter per micro-batch and keep only this rank's slice of the
sum: each bucket is filled, scaled and reduce-scattered as in a step (the step machine, the
same hooks, gathers and failure handling), and its slice added into the sum as it lands. The
step then adds its own micro-batch's slice into that sum (``Run.reduced``), so the gradient
is ``((mb_1 + mb_2) + ... + mb_n)`` of the ranks' means, FSDP2's order.

A micro-batch that fails on any rank adds nothing on every rank: the new sums are written
beside the old ones and replace them only once the step's status (after the sums, so it also
covers a failure in them) says every rank's part succeeded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._errors import CollectiveError
from .._slices.exchange import Replicas
from .._step.autodiff import local_grads
from .._step.machine import StatusMode, Step, StepSpec
from .buckets import Buckets
from .params import ParamSet
from .stores import Accumulation

__all__ = ["MicroRun"]


class MicroRun:
    """One reduced micro-batch (see the module docstring); ``run`` returns ``fn``'s value."""

    def __init__(self, buckets: Buckets, acc: Accumulation, scale: float | None, engine: str) -> None:
        self.bk, self.acc, self.engine = buckets, acc, engine
        nb = len(buckets.plan.buckets)
        self.sums: list[torch.Tensor | None] = [None] * nb  # the new sums, beside acc.slices
        self.error: BaseException | None = None  # this rank's failure in adding a slice
        mesh = buckets.mesh
        self.replicas = Replicas(mesh.replicate, nb) if mesh.replicate is not None else None
        self.step: Step = buckets.machine.start(StepSpec(
            "accumulate", what=f"{buckets.name}.accumulate", scale=scale, on_ready=self.arrive,
            status=StatusMode.AFTER, on_complete=buckets.store.on_complete, on_filled=buckets.store.on_filled))

    def arrive(self, b: int, flat: torch.Tensor) -> None:
        """``StepSpec.on_ready``: bucket ``b``'s reduce-scatter has landed (inside the backward's
        hooks: never raises; a failure goes into the status)."""
        try:
            mine = self.bk.store.scatter.finish(b, flat)
            if self.replicas is not None:  # (summed over the replicas in place: its own copy)
                for landed in self.replicas.arrive(b, mine.clone()):
                    self._add(landed, self.replicas.slices[landed])
                return
            self._add(b, mine)
        except Exception as e:  # noqa: BLE001 - reported through the step's status
            self.error = self.error or e

    def _add(self, b: int, mine: torch.Tensor) -> None:
        g = self.bk.views.grad_of(b, mine) if self.bk.cast[b] else mine
        old = self.acc.slices[b] if self.acc.count else None
        self.sums[b] = g.clone() if old is None else torch.add(old, g)

    def run(self, fn: Callable, has_aux: bool, src: ParamSet, rest: tuple, kwargs: dict) -> Any:
        bk, step = self.bk, self.step
        machine, store, plan, engine = bk.machine, bk.store, bk.plan, self.engine
        quiet = True
        try:
            try:
                try:
                    leaves, wrap = store.differentiated(src, step)
                    local, value = local_grads(engine, fn, 0, has_aux, (None, *rest), kwargs, leaves, plan.treedef,
                                               machine.leaf_hooks[engine], step.on_backward_start, wrap=wrap)
                    step.backward_done(local, machine.unhooked)
                except CollectiveError:
                    raise
                except BaseException:
                    store.failed()  # (a fully sharded step's gathers the other ranks still expect)
                    raise
                machine.finish(step)
                if self.replicas is not None:
                    for b in self.replicas.wait_all():
                        self._add(b, self.replicas.slices[b])
            except BaseException as e:
                if machine.in_flight is step:
                    machine.abort(step, e)
                if machine.in_flight is step:  # drained: the status tells every rank
                    if self.replicas is not None:
                        self.replicas.drain(self.bk.wire_zeros)
                    try:
                        machine.close(step, failed=True)
                    except CollectiveError:
                        pass  # (the group is broken: this rank's own error is the one to raise)
                raise
            failed = machine.close(step, failed=self.error is not None)
            if self.error is not None:
                raise self.error
            if failed:
                raise CollectiveError(
                    f"fdp: {bk.name}.accumulate: micro-batch {self.acc.count + 1} (step {step.n}) failed on {failed} "
                    f"rank(s) of {bk.group.size}; every rank adds nothing of it (this is rank {bk.group.rank}), and "
                    "the ranks are still in step: accumulate it again, or go on without it")
            quiet = False
        finally:
            store.ended(quiet=quiet)
        self.acc.slices, self.sums = self.sums, [None] * len(self.sums)
        self.acc.count += 1
        self.acc.lost = None
        return value
