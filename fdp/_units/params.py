"""``ShardedParams``: the params of a fully sharded step (``Reducer(shard="params")``), this
rank's slices only, and the handle that gathers them (the step's ``Units``).

A fully sharded step keeps, per bucket, only this rank's slice of the padded flat params
(``fdp._slices``) in a *set* of slice buffers (``fdp._fused.params.SliceSets``) and returns
``ShardedParams``: the set's slices and the ``Units`` that gather them. Passing them back to
the step costs nothing; a whole params tree (the first step, a loaded checkpoint) is cut into
a set (one copy of this rank's elements).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .. import _tree
from .._internals import version
from .._shard import Shard, elements
from .units import Units, UnitsView

__all__ = ["ShardedParams", "average_slices", "shards_of"]


def shards_of(units: Units, views: list[torch.Tensor] | None) -> Any:
    """The params tree with each leaf an ``fdp.Shard`` of this rank's elements: views of the
    slices ``views``, or, with None, zero-strided data holding nothing (what
    ``fdp.load_sharded`` needs of a ``like``: the ranges, shapes, dtypes and devices)."""
    plan, s = units.plan, units.slices
    out = []
    for slot in plan.slots:
        b = slot.bucket
        a, z = max(slot.offset, s.lo[b]), min(slot.offset + slot.numel, s.hi[b])
        n = max(z - a, 0)
        if views is None:
            data = torch.zeros((), dtype=slot.dtype, device=slot.device).expand(n)
        else:
            data = views[b][a - s.lo[b]:z - s.lo[b]] if n else views[b][:0]
        out.append(Shard(slot.shape, slot.dtype, ((a - slot.offset, z - slot.offset),) if n else (), data))
    return _tree.unflatten(plan.treedef, out)


def average_slices(units: Units, leaves: list[Any], flats: list[torch.Tensor], owners: Any) -> list[torch.Tensor]:
    """This rank's slices of a tree given per leaf as an ``fdp.Shard`` of this rank's elements
    (an optimizer state's field, ``step.state_to_shards``), a whole Shard on the owner of a
    leaf updated whole (Muon's matrices: sent to the slices that hold them, an exchange over
    ``owners``), or a plain tensor where the field has no value (its elements taken from the
    params' slices ``flats``)."""
    plan, s = units.plan, units.slices
    out = [torch.zeros_like(f) for f in flats]
    wholes: dict[int, torch.Tensor] = {}
    # An owned leaf without a value of its own (a label the field does not cover): the params'
    # (the same leaves on every rank, so every rank takes part in the exchange or none does).
    bare = owners is not None and any(not isinstance(leaves[i], Shard) for i in owners.owner)
    params = owners.to_owners(flats, units.group) if bare else {}
    for i, slot in enumerate(plan.slots):
        b, off, leaf = slot.bucket, slot.offset, leaves[i]
        if owners is not None and i in owners.owner:
            if owners.owner[i] == s.rank:  # (sent to the slices by to_holders below)
                wholes[i] = leaf.to_tensor() if isinstance(leaf, Shard) else params[i]
            continue
        a, z = max(off, s.lo[b]), min(off + slot.numel, s.hi[b])
        if a >= z:
            continue
        got = elements(leaf, a - off, z - off) if isinstance(leaf, Shard) else None
        out[b][a - s.lo[b]:z - s.lo[b]].copy_(flats[b][a - s.lo[b]:z - s.lo[b]] if got is None else got)
    if owners is not None:
        owners.to_holders(out, units.group, wholes)
    return out


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

    __slots__ = ("units", "flats", "_views", "_versions")

    def __init__(self, units: Units, flats: list[torch.Tensor]) -> None:
        self.units, self.flats = units, flats  # (the set's own list: the step knows it by identity)
        # views, so that the set counts as held (a pure step then writes the other set)
        self._views = [f[:] for f in flats]
        # (None under torch.compile: a compiled step's slices are graph outputs, taken in by copy)
        self._versions = None if _tree.compiling() else [version(f) for f in flats]

    # ------------------------------------------------------------------ a mapping's read-only face
    def keys(self) -> list[Any]:
        return list(self.units.keys)

    def __iter__(self) -> Any:
        return iter(self.units.keys)

    def __len__(self) -> int:
        return len(self.units.keys)

    def __contains__(self, key: Any) -> bool:
        return key in self.units.keys

    @property
    def shapes(self) -> dict[Any, torch.Size]:
        return {k: torch.Size(s.shape) for k, s in zip(self.units.keys, self.units.plan.slots)}

    def template(self) -> Any:
        """The params tree as tensors of the leaves' shapes, dtypes and device that hold one
        element each (a zero expanded to the shape): what masks and ``opt.init`` need to know
        of the params."""
        return self.units.plan.template()

    def shards(self) -> Any:
        """The params tree with each leaf an ``fdp.Shard`` of this rank's elements of it (views
        of the slices: no copy, no communication): what ``fdp.save_sharded`` writes without a
        gather, and, loaded by ``fdp.load_sharded`` (``like=params.shards()`` on any world
        size), what ``step.shard`` takes back::

            fdp.save_sharded(d, {"params": params.shards(), "opt": step.state_to_shards(opt_state, params)})
            got = fdp.load_sharded(d, {"params": params.shards(), "opt": step.state_to_shards(opt_state, params)})
            params, opt_state = step.shard(got["params"]), step.state_from_shards(got["opt"], params)
        """
        return shards_of(self.units, self._views)

    @property
    def local(self) -> list[torch.Tensor]:
        """This rank's slice of each bucket (views; padding included)."""
        return list(self._views)

    def unchanged(self) -> bool:
        """Whether the slices are as the step returned them (nobody wrote into them since)."""
        return self._versions is not None and [version(f) for f in self.flats] == self._versions

    # ------------------------------------------------------------------ gathers
    def units_view(self) -> UnitsView:
        """The forward over these params, unit by unit (``fdp.Apply``; inference only)."""
        return self.units.inference(self.flats)

    def full(self) -> Any:
        """The whole params tree on every rank (a collective: every unit is all-gathered)."""
        return self.units.whole(self.flats, "fdp.ShardedParams.full")

    def full_by_unit(self) -> Iterator[dict[Any, torch.Tensor]]:
        """The whole leaves, one unit (bucket) at a time: each item maps the unit's keys to
        whole tensors, gathered when the item is asked for and not kept afterwards by fdp, so
        a rank holds its slices plus one unit (a collective: every rank must consume every
        item, in order; ``fdp.save_safetensors`` writes them this way)."""
        plan, keys = self.units.plan, self.units.keys
        for b, bucket in enumerate(plan.buckets):
            flat = self.units.gather_bucket(self.flats, b, "fdp.ShardedParams.full_by_unit")
            yield {keys[i]: flat[off:off + n].view(plan.slots[i].shape)
                   for i, off, n in zip(bucket.leaves, bucket.offsets, bucket.numels)}
            del flat

    def unsaveable_reason(self) -> str:
        """Why ``fdp.save`` refuses these params (``fdp._protocols.Unsaveable``)."""
        return ("they are this rank's slices of fully sharded params (Reducer(shard='params')); save "
                "params.shards() with fdp.save_sharded (no gather), or params.full() with fdp.save (gathered: "
                "every rank holds the whole model)")

    def __repr__(self) -> str:
        s = self.units.slices
        return (f"fdp.ShardedParams({len(self)} params in {len(self.units.names)} units, "
                f"slice {s.rank} of {s.size})")
