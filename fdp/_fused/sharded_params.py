"""``ShardedParams``: the params of a fully sharded step (``Reducer(shard="params")``), this
rank's slices only; and ``SliceSets``, the step's flat slice buffers that hold them.

A fully sharded step keeps, per bucket, only this rank's slice of the padded flat params
(``fdp/_fused/shard.py``), in a *set* of slice buffers, and returns ``ShardedParams``: the
set, and what the step needs to gather it. Passing it back costs nothing; a full params tree
(the first step, a loaded checkpoint) is cut into a free set (one copy of this rank's
elements). As ``ParamSets`` does for whole buckets, a pure step reads one set and writes
another, and a set is written only once nothing outside fdp refers to it, so params a caller
keeps stay as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import _tree
from .._comm.collectives import wait
from .._plan.bucket import BucketPlan
from .._plan.buffers import held_elsewhere
from .._shard import Shard
from .params import ParamSets
from .shard import Shards
from .units import UnitsView

if TYPE_CHECKING:  # (the core makes the sets: a type-only import, no cycle)
    from .units_core import UnitCore


def elements(leaf: torch.Tensor | Shard, a: int, z: int, what: str) -> torch.Tensor:
    """Elements ``a:z`` of a leaf's flattening, from a whole tensor or a Shard that holds them."""
    if isinstance(leaf, torch.Tensor):
        return leaf.reshape(-1)[a:z]
    for start, stop, data in leaf.pieces():
        if start <= a and z <= stop:
            return data[a - start:z - start]
    raise ValueError(f"{what} is a Shard of ranges {list(leaf.ranges)}; this rank needs its elements {a}:{z} "
                     "(load it with this step's params.shards() as like)")


class SliceSet:
    """One set of slice buffers (one per bucket)."""

    __slots__ = ("flats",)

    def __init__(self, flats: list[torch.Tensor]) -> None:
        self.flats = flats

    def held(self) -> bool:
        """Whether anything outside fdp refers to this set's memory (``ParamSet.held``)."""
        return any(map(held_elsewhere, self.flats))


class ShardedParams:
    """Fully sharded params (``fdp.Reducer(params, shard="params")``): this rank's slice of
    every unit's flat params, as a fully sharded step returns them.

    Pass them back to the step (no copy). For inference, ``apply(params, buffers, x)`` under
    ``torch.no_grad()`` gathers each unit just before its module runs and frees it after, as
    the step's forward does (a collective: every rank must run it). ``full()`` gathers the
    whole params tree (a collective; every rank gets every leaf, so it needs the memory of
    the whole model); save them without a gather with ``fdp.save_sharded``.

    Attributes:
      shapes: per key, its leaf's shape (the whole leaf, not the slice).
    """

    __slots__ = ("_core", "_set", "_flats", "_versions")

    def __init__(self, core: UnitCore, pset: SliceSet) -> None:
        self._core, self._set = core, pset
        # views, so that the set counts as held (a pure step then writes the other set)
        self._flats = [f[:] for f in pset.flats]
        self._versions = [f._version for f in pset.flats]

    # ------------------------------------------------------------------ a mapping's read-only face
    def keys(self) -> list[Any]:
        return list(self._core.units.keys)

    def __iter__(self) -> Any:
        return iter(self._core.units.keys)

    def __len__(self) -> int:
        return len(self._core.units.keys)

    def __contains__(self, key: Any) -> bool:
        return key in self._core.units.keys

    @property
    def shapes(self) -> dict[Any, torch.Size]:
        return {k: torch.Size(s.shape) for k, s in zip(self._core.units.keys, self._core.plan.slots)}

    def template(self) -> Any:
        """The params tree as tensors of the leaves' shapes, dtypes and device that hold one
        element each (a zero expanded to the shape): what masks and ``opt.init`` need to know
        of the params."""
        return _tree.unflatten(self._core.plan.treedef, [
            torch.zeros((), dtype=s.dtype, device=s.device).expand(s.shape) for s in self._core.plan.slots])

    def shards(self) -> Any:
        """The params tree with each leaf an ``fdp.Shard`` of this rank's elements of it (views
        of the slices: no copy, no communication): what ``fdp.save_sharded`` writes without a
        gather, and, loaded by ``fdp.load_sharded`` (``like=params.shards()`` on any world
        size), what ``step.shard`` takes back::

            fdp.save_sharded(d, {"params": params.shards(), "opt": step.state_to_shards(opt_state, params)})
            got = fdp.load_sharded(d, {"params": params.shards(), "opt": step.state_to_shards(opt_state, params)})
            params, opt_state = step.shard(got["params"]), step.state_from_shards(got["opt"], params)
        """
        plan, s = self._core.plan, self._core.shards
        out = []
        for slot in plan.slots:
            b = slot.bucket
            a, z = max(slot.offset, s.lo[b]), min(slot.offset + slot.numel, s.hi[b])
            if a < z:
                out.append(Shard(slot.shape, slot.dtype, ((a - slot.offset, z - slot.offset),),
                                 self._flats[b][a - s.lo[b]:z - s.lo[b]]))
            else:
                out.append(Shard(slot.shape, slot.dtype, (), self._flats[b][:0]))
        return _tree.unflatten(plan.treedef, out)

    __fdp_template__ = template

    @property
    def local(self) -> list[torch.Tensor]:
        """This rank's slice of each bucket (views; padding included)."""
        return list(self._flats)

    def unchanged(self) -> bool:
        """Whether the slices are as the step returned them (nobody wrote into them since)."""
        return [f._version for f in self._set.flats] == self._versions

    # ------------------------------------------------------------------ gathers
    def __fdp_units__(self) -> UnitsView:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fdp: ShardedParams gather each unit only while it runs, so autograd cannot keep them for a "
                "backward: run inference under torch.no_grad() (or torch.inference_mode()), and train "
                "through the step (reducer.grad_and_update), which gathers them again for its backward")
        units = self._core.units
        self._core.machine.check_idle("a forward on ShardedParams")
        return units.begin(self._set.flats, training=False, finish=units.end)

    def full(self) -> Any:
        """The whole params tree on every rank (a collective: every unit is all-gathered)."""
        core = self._core
        scatter, shards, plan = core.scatter, core.shards, core.plan
        flats = []
        for b, (bucket, n) in enumerate(zip(plan.buckets, shards.padded)):
            out = torch.empty(n, dtype=bucket.dtype, device=bucket.device)
            out[shards.lo[b]:shards.hi[b]].copy_(self._set.flats[b])
            if scatter is not None:
                wait(scatter.gather(b, out), core.mesh.shard, f"{core.name}: gathering bucket {b}'s params")
                scatter.gathered(b)
            flats.append(out)
        return plan.views(flats)

    def __fdp_unsaveable__(self) -> str:
        return ("they are this rank's slices of fully sharded params (Reducer(shard='params')); save "
                "params.shards() with fdp.save_sharded (no gather), or params.full() with fdp.save (gathered: "
                "every rank holds the whole model)")

    def __repr__(self) -> str:
        s = self._core.shards
        return (f"fdp.ShardedParams({len(self)} params in {len(self._core.units.names)} units, "
                f"slice {s.rank} of {s.size})")


class SliceSets(ParamSets):
    """The slice sets of one fully sharded core: param sets whose flats are this rank's slices
    (at most two tracked, ``cur`` holding the params; see the module docstring)."""

    def __init__(self, core: UnitCore, plan: BucketPlan, shards: Shards, name: str) -> None:
        super().__init__(plan, [shards.numel(b.index) for b in plan.buckets], name)
        self.core, self.shards = core, shards

    def _new(self) -> SliceSet:
        new = SliceSet([torch.zeros(n, dtype=b.dtype, device=b.device) for b, n in zip(self.plan.buckets, self.padded)])
        self.sets.append(new)
        return new

    def leaves_of(self, params: Any, what: str) -> Any:
        return params  # (checked in ``current``)

    def current(self, params: Any, donate: bool) -> tuple[SliceSet, bool]:
        """The set holding ``params`` and whether it is a fresh copy: the current set when
        ``params`` are the ``ShardedParams`` the step returned, unchanged; else a free set they
        are copied into (``ShardedParams`` of another step with the same layout, or a full
        params tree: this rank's elements of it)."""
        if isinstance(params, ShardedParams):
            if params._set is self.cur and params._core is self.core and params.unchanged():
                return self.cur, False
            if params._core.plan != self.plan or params._core.shards.padded != self.shards.padded:
                raise ValueError(f"{self.name}: these ShardedParams were made by a step with another layout "
                                 "(units, params or sharding); convert them with params.full()")
            target = self.free(avoid=self.cur)
            torch._foreach_copy_(target.flats, params._set.flats)
        else:  # whole tensors, or Shards holding (at least) this rank's elements of each leaf
            leaves = self.plan.leaves_of(params, f"{self.name} params")
            target = self.free(avoid=self.cur)
            s = self.shards
            for b, flat in zip(self.plan.buckets, target.flats):
                lo, hi = s.lo[b.index], s.hi[b.index]
                for i, off, n in zip(b.leaves, b.offsets, b.numels):
                    a, z = max(off, lo), min(off + n, hi)
                    if a < z:
                        flat[a - lo:z - lo].copy_(elements(leaves[i], a - off, z - off,
                                                           f"{self.name}: params{self.plan.slots[i].path}"))
        self.cur = target
        return target, True

    def views(self, ps: SliceSet) -> ShardedParams:
        return ShardedParams(self.core, ps)


__all__ = ["ShardedParams", "SliceSet", "SliceSets"]
