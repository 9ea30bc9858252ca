"""``ParamSets``: the fused step's flat param buffers, and which one holds the caller's params
(``SliceSets``: a fully sharded step's, this rank's slices only).

A fused step keeps the params in one flat tensor per bucket (a *set*); the params it returns
are views into a set. Pure by default: a step reads one set and writes another, and a set is
written only once nothing outside fdp refers to it (a storage use count), so a caller that
keeps old params sees them unchanged, and one that rebinds ``params`` cycles through two sets.

A tree passed in is "the one returned" only if every leaf is exactly the view fdp handed out
(same data pointer, shape and strides) and unchanged since (its version counter, which a
view shares with its set, is the one recorded when the step returned). Anything else (a
tree the caller changed in place, another view of the same memory such as ``w.t()`` of a
square ``w``, a tree loaded or made by hand) is packed into a free set: one copy.

A fully sharded step keeps only this rank's slice of every bucket in a set (``SliceSets``)
and returns ``fdp.ShardedParams``: the set's slices and the ``Units`` that gather them; a
whole params tree (the first step, a loaded checkpoint) is cut into a free set.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _tree, kernels
from .._internals import version
from .._plan.bucket import BucketPlan, contiguous_strides
from .._plan.buffers import held_elsewhere
from .._protocols import ParamSource
from .._shard import elements
from .._slices.geometry import Slices
from .._step.autodiff import Reused
from .._units.params import ShardedParams
from .._units.units import Units


class ParamSet:
    """One set of flat param buffers, and what the views fdp handed out of it look like."""

    __slots__ = ("flats", "ptrs", "shapes", "strides", "versions", "_inner", "reused", "_leaves")

    def __init__(self, flats: list[torch.Tensor], plan: BucketPlan) -> None:
        self.flats = flats
        self._inner: list[torch.Tensor] | None = None
        self._leaves = [len(b.leaves) for b in plan.buckets]
        # the autograd leaves a step's backward reuses over this set (``fdp._step.autodiff.Reused``)
        self.reused = Reused()
        self.ptrs = [flats[s.bucket].data_ptr() + s.offset * flats[s.bucket].element_size() for s in plan.slots]
        self.shapes = [torch.Size(s.shape) for s in plan.slots]
        self.strides = [contiguous_strides(s.shape) for s in plan.slots]
        self.versions: list[int] | None = None  # per leaf, its set's version when handed out

    def inner(self, plan: BucketPlan) -> list[torch.Tensor]:
        """Each leaf as a view of this set, in plan order: made once, for fdp's own reads (a
        step's backward detaches them); never handed out (the step returns fresh views)."""
        if self._inner is None:
            self._inner = _tree.leaves(plan.views(self.flats))
        return self._inner

    def held(self) -> bool:
        """Whether anything outside fdp refers to this set's memory (then no step may write
        it): each bucket's storage references, less those of fdp's own views of it (the inner
        views, and the autograd leaves the step's backward made from them, one per leaf)."""
        mine = (self._inner is not None) + bool(self.reused.inputs)
        return any(held_elsewhere(f, mine * n) for f, n in zip(self.flats, self._leaves))

    def handed_out(self, plan: BucketPlan) -> None:
        """The step returns views of this set now: remember its version counters."""
        per_bucket = [version(f) for f in self.flats]
        self.versions = [per_bucket[s.bucket] for s in plan.slots]

    def holds(self, leaves: list[torch.Tensor]) -> bool:
        """Whether ``leaves`` are exactly the views handed out, unchanged since (C-level maps:
        no Python per leaf)."""
        return (self.versions is not None
                and list(map(torch.Tensor.data_ptr, leaves)) == self.ptrs
                and list(map(torch.Tensor.size, leaves)) == self.shapes
                and list(map(torch.Tensor.stride, leaves)) == self.strides
                and list(map(version, leaves)) == self.versions)


class ParamSets:
    """The sets of one fused engine: at most two tracked, ``cur`` the one holding the params;
    each set holds whole (padded) buckets, of which this rank updates ``mine``."""

    def __init__(self, plan: BucketPlan, slices: Slices, name: str) -> None:
        self.plan, self.slices, self.name = plan, slices, name
        self.padded = slices.padded
        self.sets: list[ParamSet] = []
        self.cur: ParamSet | None = None
        # ``mine(b, flat)``: the part of a set's flat tensor of bucket ``b`` this rank updates,
        # its slice (the whole bucket when unsharded)
        self.mine = slices.mine

    def _new(self) -> ParamSet:
        flats = [torch.zeros(n, dtype=b.dtype, device=b.device) for b, n in zip(self.plan.buckets, self.padded)]
        new = ParamSet(flats, self.plan)
        self.sets.append(new)
        return new

    def current(self, leaves: list[torch.Tensor], donate: bool) -> tuple[ParamSet, bool]:
        """The set holding ``leaves`` and whether it is a fresh copy: the current set when
        they are its views, unchanged (no copy), else a set they are packed into. A fresh
        copy is fdp's alone, so even a pure step updates it in place (the caller's tree is
        untouched either way): a packing step holds two params-sized sets, the caller's and
        the copy, not three.

        Donated, the caller's tensors are consumed: each packed leaf is re-pointed at its
        place in the set (``Tensor.set_``), so its old memory is freed now if nothing else
        holds it (a tree loaded from a checkpoint), rather than living beside the set. A
        donated tree that holds one tensor twice is refused (it would be untied)."""
        if self.cur is not None and self.cur.holds(leaves):
            return self.cur, False
        if donate:
            self._refuse_aliases(leaves)
        target = self.free(avoid=self.cur)  # the tree may still hold views of the current set
        for b, flat in zip(self.plan.buckets, target.flats):
            if not donate:
                kernels.flatten([leaves[i] for i in b.leaves], flat[:b.numel])
                continue
            storage = flat.untyped_storage()
            for i, off, n in zip(b.leaves, b.offsets, b.numels):  # leaf by leaf: one leaf's memory extra at most
                t = leaves[i]
                flat[off:off + n].view(t.shape).copy_(t)
                # (not a view: set_ would leave its autograd view metadata pointing at the base)
                if type(t) is torch.Tensor and not t.requires_grad and t._base is None and t.dtype == flat.dtype:
                    t.set_(storage, off, t.shape, contiguous_strides(t.shape))
        self.cur = target
        return target, True

    def _refuse_aliases(self, leaves: list[torch.Tensor]) -> None:
        ptrs = [p for p, t in zip(map(torch.Tensor.data_ptr, leaves), leaves) if t.numel()]
        if len(set(ptrs)) == len(ptrs):
            return
        seen: dict[int, str] = {}
        for s, t in zip(self.plan.slots, leaves):
            if not t.numel():
                continue
            p = t.data_ptr()
            if p in seen:
                raise ValueError(
                    f"{self.name}: params{seen[p]} and params{s.path} are the same memory; with "
                    "donate=True the step would untie them (each is packed into its own place). Pass "
                    "each tensor once (fdp.functionalize keeps tied weights once) or use donate=False")
            seen[p] = s.path

    def free(self, avoid: ParamSet | None) -> ParamSet:
        """A set nothing outside fdp refers to (not ``avoid``), made if there is none."""
        for ps in self.sets:
            if ps is not avoid and not ps.held():
                return ps
        if len(self.sets) >= 2:  # the caller keeps old params: stop tracking one of their sets
            old = next((ps for ps in self.sets if ps is not avoid and ps is not self.cur), None)
            if old is not None:
                self.sets.remove(old)
        return self._new()

    def views(self, ps: ParamSet) -> Any:
        """The params tree the step returns: views into ``ps`` (its padding left out)."""
        out = self.plan.views(ps.flats)
        ps.handed_out(self.plan)
        return out

    def leaves_of(self, tree: Any, what: str) -> list[torch.Tensor]:
        return self.plan.leaves_of(tree, f"{self.name} {what}")


def _whole(b: int, flat: torch.Tensor) -> torch.Tensor:
    return flat


class SliceSet:
    """One set of slice buffers (one per bucket) of a fully sharded step."""

    __slots__ = ("flats",)

    def __init__(self, flats: list[torch.Tensor]) -> None:
        self.flats = flats

    def held(self) -> bool:
        """Whether anything outside fdp refers to this set's memory (``ParamSet.held``)."""
        return any(map(held_elsewhere, self.flats))


class SliceSets(ParamSets):
    """The slice sets of one fully sharded engine: param sets whose flats are this rank's slices
    (at most two tracked, ``cur`` holding the params; see the module docstring)."""

    def __init__(self, units: Units, plan: BucketPlan, slices: Slices, name: str) -> None:
        super().__init__(plan, slices, name)
        self.units = units
        self.padded = [slices.numel(b.index) for b in plan.buckets]
        self.mine = _whole  # (the set holds this rank's slices only)

    def _new(self) -> SliceSet:
        new = SliceSet([torch.zeros(n, dtype=b.dtype, device=b.device) for b, n in zip(self.plan.buckets, self.padded)])
        self.sets.append(new)
        return new

    def leaves_of(self, params: Any, what: str) -> Any:
        return params  # (checked in ``current``)

    def current(self, params: Any, donate: bool) -> tuple[SliceSet, bool]:
        """The set holding ``params`` and whether it is a fresh copy: the current set when
        ``params`` are the ``ShardedParams`` the step returned, unchanged; else a free set they
        are copied into (``ShardedParams`` of another step with the same layout, or a whole
        params tree, or Shards holding at least this rank's elements of each leaf)."""
        if isinstance(params, ShardedParams):
            if self.cur is not None and params.flats is self.cur.flats and params.units is self.units \
                    and params.unchanged():
                return self.cur, False
            theirs = params.units
            if theirs.plan != self.plan or theirs.slices.padded != self.slices.padded:
                raise ValueError(f"{self.name}: these ShardedParams were made by a step with another layout "
                                 "(units, params or sharding); convert them with params.full()")
            target = self.free(avoid=self.cur)
            torch._foreach_copy_(target.flats, params.flats)
        elif isinstance(params, ParamSource):
            target = self.free(avoid=self.cur)
            self._read(params, target)
        else:
            leaves = self.plan.leaves_of(params, f"{self.name} params")
            target = self.free(avoid=self.cur)
            s = self.slices
            for b, flat in zip(self.plan.buckets, target.flats):
                lo, hi = s.lo[b.index], s.hi[b.index]
                for i, off, n in zip(b.leaves, b.offsets, b.numels):
                    a, z = max(off, lo), min(off + n, hi)
                    if a < z:
                        got = elements(leaves[i], a - off, z - off)
                        if got is None:
                            raise ValueError(
                                f"{self.name}: params{self.plan.slots[i].path} is a Shard of ranges "
                                f"{list(leaves[i].ranges)}; this rank needs its elements {a - off}:{z - off} (load it "
                                "with this step's params.shards() as like)")
                        flat[a - lo:z - lo].copy_(got)
        self.cur = target
        return target, True

    def _read(self, source: ParamSource, target: SliceSet) -> None:
        """Fill ``target`` from ``source`` one bucket (a unit, per dtype) at a time: each read
        is of the leaves of which this rank holds elements, and is dropped once its elements
        are copied, so the rank holds its slices plus one unit's leaves at most."""
        s, keys = self.slices, _tree.keys(self.plan.treedef)
        for b, flat in zip(self.plan.buckets, target.flats):
            lo, hi = s.lo[b.index], s.hi[b.index]
            asked = [(i, off, max(off, lo), min(off + n, hi)) for i, off, n in zip(b.leaves, b.offsets, b.numels)]
            asked = [x for x in asked if x[2] < x[3]]
            if not asked:
                continue
            slots = self.plan.slots
            got = source.read([(keys[i], tuple(slots[i].shape), slots[i].dtype) for i, _, _, _ in asked],
                              [(a - off, z - off) for i, off, a, z in asked], b.device)
            for (i, off, a, z), leaf in zip(asked, got):
                part = elements(leaf, a - off, z - off)
                if part is None:
                    raise ValueError(f"{self.name}: the source gave params{slots[i].path} without this rank's "
                                     f"elements {a - off}:{z - off}")
                flat[a - lo:z - lo].copy_(part.reshape(-1))
            del got

    def views(self, ps: SliceSet) -> ShardedParams:
        return ShardedParams(self.units, ps.flats)


__all__ = ["ParamSet", "ParamSets", "SliceSet", "SliceSets"]
