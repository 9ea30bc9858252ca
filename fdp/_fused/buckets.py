"""``Buckets``: what one fused engine's runs read about its buckets, fixed when it is built, and
``BucketViews``, the per-leaf and params-dtype views of a bucket's reduced gradient.

A bucket's update is one kernel call per key over its spans (``fdp._slices.geometry.Spans``):
``whole`` marks the buckets whose update is one kernel call on the (slice's) flat tensors
themselves (one key, one span covering it, one chunk); ``decays`` lists, per bucket, the
group-0 spans of each part decayed apart (``Program.decayed_apart``: AdamW's decay applied
first, then one call without decay over both groups); ``cast`` marks the buckets whose wire
dtype is not the params' (a bf16 wire), whose gradient is cast once before the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from .._comm.group import Group
from .._comm.mesh import Mesh
from .._plan.bucket import BucketPlan
from .._slices.exchange import Owners
from .._slices.geometry import Span, Spans
from .._step.machine import StepMachine
from .stores import Store

__all__ = ["BucketViews", "Buckets"]


class BucketViews:
    """Each bucket's gradient as views of its leaves, and in the params' dtype (the engine's
    own caches: made once, reused while the buffers are the same)."""

    def __init__(self, plan: BucketPlan) -> None:
        self.plan = plan
        self.templates = [[torch.empty(s, device="meta") for s in b.shapes] for b in plan.buckets]
        self.scratch: list[torch.Tensor | None] = [None] * len(plan.buckets)  # params-dtype grads of a cast wire
        # per bucket: (the gradient flat, its leaves' views) last made
        self.made: list[tuple[torch.Tensor, list[torch.Tensor]] | None] = [None] * len(plan.buckets)

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
        made = self.made[b]
        if made is not None and made[0] is g:
            return made[1]
        views = kernels.views(g, self.templates[b])
        self.made[b] = (g, views)
        return views


@dataclass(frozen=True)
class Buckets:
    """What the runs of one fused engine read about its buckets (see the module docstring).

    Attributes:
      name: the step, named in messages. plan: the bucket plan. mesh: the groups. machine:
      the step machine. store: where params, gradients and state live. spans: this rank's
      spans of every bucket, by the keys the kernel calls run over. decays: per bucket, the
      parts decayed apart and their group-0 spans. whole: per bucket, one kernel call on the
      flat tensors. cast: per bucket, whether its wire is cast. owners: the owners of whole
      leaves (Muon, sliced), or None. views: the gradient's views. skip_nonfinite: check the
      averaged gradients for inf/NaN. sharded: the buckets are reduce-scattered in slices.
    """

    name: str
    plan: BucketPlan
    mesh: Mesh
    machine: StepMachine
    store: Store
    spans: Spans
    decays: list[list[tuple[int, list[Span]]]]
    whole: list[bool]
    cast: list[bool]
    owners: Owners | None
    views: BucketViews
    skip_nonfinite: bool
    sharded: bool  # the buckets are cut into slices over the shard group (reduce-scattered)
    sliced_sets: bool  # the param sets hold whole buckets, of which this rank updates its slice
    group: Group  # every rank (``mesh.full``)

    def wire_zeros(self, b: int) -> torch.Tensor:
        """Zeros for bucket ``b``'s (slice of the) reduced gradient, in its wire dtype (what a
        rank without a gradient of its own contributes to a collective)."""
        return torch.zeros(self.store.slices.numel(b), dtype=self.machine.buffers.wire_dtypes[b],
                           device=self.plan.buckets[b].device)
