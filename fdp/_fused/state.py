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
from ..optim import ChainState, Optimizer
from .shard import Shards

__all__ = ["FusedState", "StateLayout"]


class FusedState(NamedTuple):
    """The fused step's optimizer state, flat per bucket (save its per-leaf form with
    ``step.state_to_tree``; unsharded, ``fdp.save`` takes it as it is).

    The state knows its layout: ``layout`` says which bucket plan (leaf paths, order, shapes,
    dtypes, caps and param groups) its flat tensors follow and, sharded, which slice of each
    bucket this rank holds. It travels with every copy, ``fdp.save`` and ``fdp.load``: a
    step refuses a state of another layout (a params dict built in another key order, another
    mask or caps) instead of applying its moments to the wrong leaves, and ``fdp.save`` and
    ``torch.distributed.checkpoint.save`` (at any depth of its state dict) refuse a sharded
    state (one rank's slices are not the state), copies included; save
    ``step.state_to_tree(opt_state, params)`` with either.

    Attributes:
      step: the optimizer's count of updates applied (the tensor the per-leaf state holds).
      buffers: per state field (e.g. ``"exp_avg"``), one flat tensor per bucket (sharded:
        this rank's slice of each bucket).
      transforms: the states of the chain's gradient transforms (e.g. a ``ClipState``).
      layout: an int64 tensor ``[version, shard rank, shard ranks, plan digest x 3]`` (see
        ``describe_layout``); ``shard ranks`` is 1 for an unsharded state.
    """

    step: torch.Tensor
    buffers: dict[str, list[torch.Tensor]]
    transforms: tuple
    layout: torch.Tensor

    @property
    def sharded(self) -> bool:
        """Whether ``buffers`` holds one rank's slices of a sharded state (``Reducer(shard=True)``)."""
        return int(self.layout[2]) > 1

    def __fdp_unsaveable__(self) -> str | None:
        """Why ``fdp.save`` must not write this state as it is (None: it may)."""
        if not self.sharded:
            return None
        rank, ranks = (int(v) for v in self.layout[1:3])
        return (f"it is rank {rank}'s slices of a state sharded over {ranks} ranks "
                "(Reducer(shard=True)), and rank 0's slices alone are not the state; save "
                "step.state_to_tree(opt_state, params) instead (gathered, per leaf: it loads into "
                "any world size, and step.state_from_tree slices it again)")

    def __getattr__(self, name: str) -> Any:
        # torch.distributed.checkpoint asks every value it saves, at any depth of the state
        # dict, for ``__create_write_items__`` (its ``_Checkpointable`` hook: how to write the
        # object; torch 2.13's planner_helpers._create_write_items, looked up with hasattr). A
        # tuple is otherwise one opaque object to DCP: pickled by one rank, and loaded on
        # every rank. Only a sharded state answers, and its answer is a refusal; an unsharded
        # one (the same on every rank) is saved as DCP saves any object.
        if name == "__create_write_items__" and self.sharded:
            return self._refuse_dcp
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _refuse_dcp(self, fqn: str, obj: Any) -> list:
        rank, ranks = (int(v) for v in self.layout[1:3])
        raise ValueError(
            f"fdp: torch.distributed.checkpoint cannot save {fqn!r} (shard rank {rank}): it is this rank's "
            f"slices of a fused optimizer state sharded over {ranks} ranks (Reducer(shard=True)), which DCP "
            "would store as one object from one rank and load on every rank. Put "
            "step.state_to_tree(opt_state, params) there instead (gathered, per leaf: it loads into any world "
            "size; after dcp.load, opt_state = step.state_from_tree(loaded, params)), or save with fdp.save")

    def __fdp_check_load__(self, like: Any) -> str | None:
        """Why a loaded state cannot stand where ``like`` stood (None: it can)."""
        if isinstance(like, FusedState) and not torch.equal(self.layout.cpu(), like.layout.cpu()):
            return (f"the checkpoint's fused optimizer state has layout {describe_layout(self.layout)}, the "
                    f"train state's {describe_layout(like.layout)}: it was made for another bucket plan "
                    "(params in another key order, another mask, caps or param groups) or sharding; "
                    "save step.state_to_tree(opt_state, params), the per-leaf form, to load it into another layout")
        return None


LAYOUT_VERSION = 1


def layout_tensor(plan: BucketPlan, shards: Shards) -> torch.Tensor:
    """The ``FusedState.layout`` of a state in ``plan``'s buckets cut by ``shards``."""
    fp = plan.fingerprint
    words = [int(fp[i:i + 15], 16) for i in (0, 15, 30)]  # 60 bits each: positive int64s
    return torch.tensor([LAYOUT_VERSION, shards.rank, shards.size, *words], dtype=torch.int64)


def describe_layout(layout: torch.Tensor) -> str:
    v = [int(x) for x in layout.tolist()]
    if len(v) != 6 or v[0] != LAYOUT_VERSION:
        return f"unknown ({v})"
    where = "unsharded" if v[2] == 1 else f"slice {v[1]} of {v[2]}"
    return f"plan {v[3]:015x}..., {where}"


class StateLayout:
    """Makes, checks and converts a ``FusedState`` for one fused step's plan and shards."""

    def __init__(self, opt: Optimizer, transforms: tuple, plan: BucketPlan, shards: Shards,
                 group: Group, name: str) -> None:
        self.opt, self.transforms, self.plan, self.shards, self.group = opt, transforms, plan, shards, group
        self.kernel = (opt.parts[-1] if opt.parts else opt).leaf_kernel
        self.name = name
        self.layout = layout_tensor(plan, shards)

    def init(self, params: Any) -> FusedState:
        self.plan.leaves_of(params, f"{self.name}: init params")  # checked against the plan
        # The optimizer's own count (its dtype differs between optimizers), from an init over
        # empty leaves of the same dims: a full init would allocate a whole per-leaf state.
        empty = _tree.tree_map(lambda t: t.new_empty((0,) * t.dim()), params)
        count = self.template(empty).step.clone()
        buffers = {f: [torch.full((self.shards.numel(b.index),), self.kernel.init_value, dtype=b.dtype,
                                  device=b.device) for b in self.plan.buckets] for f in self.kernel.fields}
        return FusedState(count, buffers, tuple(t.init(params) for t in self.transforms), self.layout)

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
        layout = state.layout
        if layout is not self.layout and not (isinstance(layout, torch.Tensor) and layout.shape == self.layout.shape
                                              and torch.equal(layout.cpu(), self.layout)):
            shown = describe_layout(layout) if isinstance(layout, torch.Tensor) else repr(layout)
            raise ValueError(
                f"{self.name}: opt_state was made for another layout ({shown}; this step: "
                f"{describe_layout(self.layout)}): its flat tensors follow another bucket plan (params in another "
                "key order, another mask, caps or param groups) or another sharding, so its moments would land on "
                "the wrong leaves. Convert it: step.state_from_tree(old_step.state_to_tree(opt_state, params), params)")
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
        # In params' own structure: a dict given in another key order than the plan's gets
        # its state in its own order, as opt.init(params) lays it out.
        want = _tree.structure(params)
        fields = {}
        for f in self.kernel.fields:
            flats = [self._whole(b, t) for b, t in enumerate(state.buffers[f])]
            leaves = list(map(torch.Tensor.clone, _tree.leaves(self.plan.views(flats))))
            if want != self.plan.treedef:
                leaves = _tree.in_order_of(want, self.plan.treedef, leaves, f"{self.name}: state_to_tree params")
            fields[f] = _tree.unflatten(want, leaves)
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
                whole = [self.shards.mine(b, self._padded(b, t)).clone() for b, t in enumerate(whole)]
            buffers[f] = whole
        return FusedState(tree_state.step.clone(), buffers, transforms, self.layout)

    def _padded(self, b: int, t: torch.Tensor) -> torch.Tensor:
        n = self.shards.padded[b]
        return t if t.numel() == n else torch.cat([t, t.new_zeros(n - t.numel())])
