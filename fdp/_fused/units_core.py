"""``UnitCore``: the fused step with fully sharded params (``Reducer(shard="params")``, ZeRO-3).

The same step as the sharded fused step (``fdp/_fused/core.py``, ``run.py``): the Reducer's
buckets, one per unit (``fdp/_fused/units.py``), are reduce-scattered as the backward fills
them, each rank updates its slice of the params with its slice of the optimizer state, and
clipping measures each leaf whole on one rank. What changes is what a rank keeps:

* the params: only its slices (``SliceSets``; the step returns ``ShardedParams``), gathered
  unit by unit in the forward and again in the backward, and freed after use (``Units``);
* the gradients: no bucket-sized buffer per bucket. A few *transient* wire buffers are shared
  by the buckets in flight (``BucketBuffers(transient=...)``); a bucket's reduced slice is
  copied out into a slice-sized buffer of its own, and its wire buffer goes back;
* nothing is all-gathered after the update: the next forward gathers what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._errors import CollectiveError
from .._plan.bucket import BucketPlan
from .._plan.buffers import BucketBuffers
from .._step.autodiff import autograd_on, local_grads
from .._step.config import StepConfig
from .._step.machine import Step
from .core import FusedCore
from .sharded_params import SliceSet, SliceSets
from .spans import Key
from .units import Gathering, Units

# Wire buffers shared by the buckets in flight (each the largest bucket's size): one being
# filled while one reduce-scatter is still on the wire.
TRANSIENT = 2


class UnitCore(FusedCore):
    """One layout's fully sharded step (see the module docstring)."""

    def __init__(self, config: StepConfig, plan: BucketPlan, keys: tuple[Key, ...], whole_parts: frozenset[int],
                 name: str, decayed_apart: frozenset[int] = frozenset()) -> None:
        if whole_parts:
            raise TypeError(f"{name}: with shard='params' each rank holds a slice of every unit, and an optimizer "
                            "that updates whole leaves (fdp.optim.muon) is not supported there yet; use "
                            "shard=True (each matrix is updated whole by one rank) or an element-wise optimizer")
        if config.engine != "autograd":
            raise ValueError(f"{name}: shard='params' computes gradients with autograd (engine='auto'); "
                             f"engine={config.engine!r} cannot gather units inside torch.func's transform")
        self.kept: list[torch.Tensor | None] = [None] * len(plan.buckets)
        super().__init__(config, plan, keys, whole_parts, name, decayed_apart)
        self.gathers_params = False
        self.units = Units(plan, self.shards, self.scatter, self.mesh.shard, config.units, config.reshard_after_forward,
                           config.param_dtype)

    def bucket_buffers(self, wires: list[torch.dtype]) -> BucketBuffers:
        return BucketBuffers(self.plan, wires, reuse=True, padded=self.shards.padded, transient=TRANSIENT)

    def hook_threshold(self) -> int:
        """Every bucket is hooked: a bucket launched only when the backward returns would keep
        its unit gathered until then."""
        return 0

    def param_sets(self) -> SliceSets:
        return SliceSets(self, self.plan, self.shards, self.name)

    def reduced(self, b: int, mine: torch.Tensor, keep: bool) -> torch.Tensor:
        """Bucket ``b``'s reduced slice: when the run needs it after it has landed (a whole-tree
        transform, the finite check, a replica sum), copied out of the transient wire buffer
        into a slice-sized buffer of its own; else the wire buffer's own slice, updated from
        before the buffer goes back."""
        if not keep:
            return mine
        buf = self.kept[b]
        if buf is None:
            buf = self.kept[b] = torch.empty(self.shards.numel(b), dtype=mine.dtype, device=mine.device)
        return buf.copy_(mine)

    def on_filled(self, b: int) -> None:
        self.units.on_filled(b)

    def backward(self, step: Step, src: SliceSet, fn: Callable, has_aux: bool, rest: tuple, kwargs: dict) -> Any:
        machine, units = self.machine, self.units

        def gathering(inputs: list[torch.Tensor]) -> Gathering:
            return Gathering(units.begin(src.flats, training=True, tensors=inputs, times=step.times, t0=step.t0))

        local, value = local_grads("autograd", fn, 0, has_aux, (None, *rest), kwargs, units.leaves, self.plan.treedef,
                                   machine.leaf_hooks["autograd"], step.on_backward_start, wrap=gathering)
        step.backward_done(local, machine.unhooked)
        return value

    def _run(self, run: Any, state: Any, src: Any, dst: Any, feed: Callable[[Step], Any]) -> tuple[Any, Any, Any]:
        def fed(step: Step) -> Any:
            try:
                return feed(step)
            except CollectiveError:
                raise  # (another rank's failure, or a broken group: nothing more to issue)
            except BaseException:
                # This rank failed in its forward or backward: the gathers the others still expect
                # of it go out first, then the machine drains the reduce-scatters and the status.
                step.issued_elsewhere = self.units.drain()
                raise

        try:
            return super()._run(run, state, src, dst, fed)
        finally:
            self.units.end()

    # ------------------------------------------------------------------ accumulation
    def accumulate(self, fn: Callable, has_aux: bool, params: Any, rest: tuple, kwargs: dict) -> Any:
        """As the fused step's: this rank's gradients added in place into whole-bucket
        accumulation buffers (the sum of the micro-batches, unsharded until the step averages
        it: the numbers of DDP's ``no_sync``, at the memory of one set of gradients), each unit
        gathered and freed as in a step."""
        self._check_callable()
        self.machine.check_idle(f"{self.name}.accumulate")
        units, plan = self.units, self.plan
        with autograd_on():
            src, _ = self.params.current(params, False)
            if self.acc is None:
                self.acc = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in plan.slots]
            first = not self.accumulated
            acc, got = self.acc, bytearray(len(plan.slots))
            pending = [len(b.leaves) for b in plan.buckets]

            def hook_for(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
                b = plan.slots[i].bucket

                def hook(grad: torch.Tensor) -> torch.Tensor:
                    if not got[i]:
                        got[i] = 1
                        acc[i].copy_(grad) if first else acc[i].add_(grad)
                        pending[b] -= 1
                        if pending[b] == 0:
                            units.on_filled(b)
                    return grad.new_zeros(()).expand(grad.shape)
                return hook

            def gathering(inputs: list[torch.Tensor]) -> Gathering:
                return Gathering(units.begin(src.flats, training=True, tensors=inputs))

            try:
                _, value = local_grads("autograd", fn, 0, has_aux, (None, *rest), kwargs, units.leaves, plan.treedef,
                                       [hook_for(i) for i in range(len(plan.slots))], None, wrap=gathering)
            finally:
                units.end()
            if first:
                for i in range(len(plan.slots)):
                    if not got[i]:
                        acc[i].zero_()  # (unused this micro-batch: its gradient is zero)
            self.accumulated += 1
        return value
