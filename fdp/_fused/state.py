"""The fused step's optimizer state: flat per bucket (or per slice, sharded), and its per-leaf form.

``FusedState`` holds, per state field, one flat tensor per bucket; under a sharded step
(``Reducer(shard=True)``) one per bucket *slice*, this rank's. ``StateLayout`` makes,
checks and converts it: ``to_tree`` gives the per-leaf layout of ``opt.init(params)`` (a
collective when sharded: the slices are gathered), which loads into the plain path, another
bucket plan, another world size or the unsharded step; ``from_tree`` takes it back.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import _tree
from .._comm import collectives as comm
from .._comm.group import Group
from .._plan.bucket import BucketPlan
from ..optim import ChainState, GradientTransform, Optimizer
from .shard import Shards, mark_shard

__all__ = ["FusedState", "StateLayout", "split_chain"]


class FusedState(NamedTuple):
    """The fused step's optimizer state, flat per bucket (save its per-leaf form with
    ``step.state_to_tree``; unsharded, ``fdp.save`` takes it as it is).

    Attributes:
      step: the optimizer's count of updates applied (the tensor the per-leaf state holds).
      buffers: per state field (e.g. ``"exp_avg"``), one flat tensor per bucket (sharded:
        this rank's slice of each bucket).
      transforms: the states of the chain's gradient transforms (e.g. a ``ClipState``).
    """

    step: torch.Tensor
    buffers: dict[str, list[torch.Tensor]]
    transforms: tuple


def split_chain(opt: Optimizer, name: str, *, sharded: bool = False
                ) -> tuple[tuple[GradientTransform, ...], Optimizer]:
    """(gradient transforms, optimizer with a leaf kernel), or a ``TypeError`` saying why not."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{name}: opt must be an fdp.optim optimizer or chain, got {type(opt).__name__}")
    transforms, optimizer = (tuple(opt.parts[:-1]), opt.parts[-1]) if opt.parts else ((), opt)
    if optimizer.leaf_kernel is None:
        raise TypeError(
            f"{name}: the fused step runs a torch.optim kernel per bucket, so it needs sgd, adam, adamw, "
            "adagrad or rmsprop (optionally in a chain after gradient transforms); for other optimizers "
            "(partition, your own) use reducer.grad and opt.update"
        )
    for t in transforms:
        if t.update_in_place is None:
            raise TypeError(
                f"{name}: every gradient transform of the chain must work in place on the reduced "
                "buckets (fdp.optim's clip_by_global_norm and clip_by_value do; GradientTransform("
                "update_in_place=...) declares it for your own); for others use reducer.grad and opt.update"
            )
        if sharded and not t.elementwise and t.update_sharded is None and t.coefficient is None:
            raise TypeError(
                f"{name}: with shard=True each rank holds only its slice of the gradients, so a "
                "whole-tree gradient transform must declare how to combine the slices "
                "(GradientTransform(update_sharded=...) or partial=/coefficient=; fdp.optim.clip_by_global_norm has both)"
            )
    return transforms, optimizer


class StateLayout:
    """Makes, checks and converts a ``FusedState`` for one fused step's plan and shards."""

    def __init__(self, opt: Optimizer, transforms: tuple, plan: BucketPlan, shards: Shards,
                 group: Group, name: str) -> None:
        self.opt, self.transforms, self.plan, self.shards, self.group = opt, transforms, plan, shards, group
        self.kernel = (opt.parts[-1] if opt.parts else opt).leaf_kernel
        self.name = name

    def init(self, params: Any) -> FusedState:
        self.plan.leaves_of(params, f"{self.name}: init params")  # checked against the plan
        # The optimizer's own count (its dtype differs between optimizers), from an init over
        # empty leaves of the same dims: a full init would allocate a whole per-leaf state.
        empty = _tree.tree_map(lambda t: t.new_empty((0,) * t.dim()), params)
        count = self.template(empty).step.clone()
        buffers = {f: [self._mark(torch.full((self.shards.numel(b.index),), self.kernel.init_value,
                                             dtype=b.dtype, device=b.device))
                       for b in self.plan.buckets] for f in self.kernel.fields}
        return FusedState(count, buffers, tuple(t.init(params) for t in self.transforms))

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        return mark_shard(t) if self.shards.sharded else t

    def template(self, params: Any) -> Any:
        state = self.opt.init(params)
        return state.optimizer if isinstance(state, ChainState) else state

    def check(self, state: Any) -> FusedState:
        if not isinstance(state, FusedState):
            raise TypeError(f"{self.name}: opt_state must be the FusedState of step.init(params) (or "
                            f"step.state_from_tree), got {type(state).__name__}")
        if set(state.buffers) != set(self.kernel.fields) or len(state.transforms) != len(self.transforms):
            raise ValueError(f"{self.name}: opt_state has fields {sorted(state.buffers)} and "
                             f"{len(state.transforms)} transform states; this optimizer keeps "
                             f"{sorted(self.kernel.fields)} and {len(self.transforms)}")
        for f, flats in state.buffers.items():
            if len(flats) != len(self.plan.buckets) or any(
                    t.numel() != self.shards.numel(b.index) or t.dtype != b.dtype or t.device != b.device
                    for t, b in zip(flats, self.plan.buckets)):
                what = "slices" if self.shards.sharded else "buckets"
                raise ValueError(f"{self.name}: opt_state.buffers[{f!r}] does not match this step's "
                                 f"{len(self.plan.buckets)} {what} (a state made for another plan, world "
                                 "size or sharding? convert it with step.state_to_tree / step.state_from_tree)")
        return state

    def to_tree(self, state: FusedState, params: Any) -> Any:
        state = self.check(state)
        template = self.template(params)
        fields = {}
        for f in self.kernel.fields:
            flats = [self._whole(b, t) for b, t in enumerate(state.buffers[f])]
            fields[f] = _tree.tree_map(torch.clone, self.plan.views(flats))
        tree = template._replace(step=state.step.clone(), **fields)
        if self.opt.parts:
            return ChainState(tuple(state.transforms), tree)
        return tree

    def _whole(self, b: int, mine: torch.Tensor) -> torch.Tensor:
        """Bucket ``b``'s whole state from this rank's slice (an all-gather when sharded)."""
        s = self.shards
        if not s.sharded:
            return mine
        out = mine.new_empty(s.padded[b])
        what = f"{self.name}: gathering bucket {b}'s optimizer state"
        comm.wait(comm.all_gather_into(out, mine.contiguous(), self.group, what), self.group, what)
        return out

    def from_tree(self, tree_state: Any, params: Any) -> FusedState:
        transforms = ()
        if self.opt.parts:
            if not isinstance(tree_state, ChainState):
                raise TypeError(f"{self.name}: expected the ChainState of opt.init(params), got "
                                f"{type(tree_state).__name__}")
            transforms, tree_state = tuple(tree_state.transforms), tree_state.optimizer
        buffers = {}
        for f in self.kernel.fields:
            whole = self.plan.flatten(getattr(tree_state, f))
            if self.shards.sharded:
                whole = [mark_shard(self.shards.mine(b, self._padded(b, t)).clone()) for b, t in enumerate(whole)]
            buffers[f] = whole
        return FusedState(tree_state.step.clone(), buffers, transforms)

    def _padded(self, b: int, t: torch.Tensor) -> torch.Tensor:
        n = self.shards.padded[b]
        return t if t.numel() == n else torch.cat([t, t.new_zeros(n - t.numel())])
