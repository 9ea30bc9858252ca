"""Slices of the flat buckets over ranks, and the spans of each key inside a slice.

**Slices.** ``Reducer(params, group, shard=True)`` (and ``shard="params"``) pads each bucket
of the plan to a multiple of the shard group's size ``n`` and cuts it into ``n`` equal
slices; rank ``r`` owns slice ``r``::

    bucket b, padded:  [ leaf 0 | leaf 1 | leaf 2 ...      | pad ]
    slices:            [ rank 0     | rank 1     | rank 2     ]
                         S elements   S elements   S elements    (S = padded / n)

Leaves may straddle slices (a slice is a range of the bucket, not a set of leaves), as in
Megatron's distributed optimizer. The padding's params, gradients and state are zeros and
stay zeros under every fdp optimizer (a zero gradient on a zero param changes nothing).
``Slices(plan, 1, 0)`` is the unsharded layout: one slice, the whole bucket.

**Spans.** A fused step's bucket holds leaves of several keys (a key is ``(part, group)``: a
partition's label and a mask's group, ``Program.keys``). A bucket's update is one kernel call
per key, over that key's *spans*: element ranges of the (slice of the) bucket, adjacent leaves
of one key merged, cut into pieces of at most ``CHUNK`` elements (one kernel call's worth; see
``fdp.optim._flat.CHUNK``), or one span per leaf, in its shape, for a kernel that takes whole
leaves (Muon).

The state of a part is compact: per bucket, one tensor per state field holding that part's
elements of the slice, in buffer order (a span's ``at`` is its offset there), so a partition
keeps AdamW's moments only for AdamW's leaves. A program with one part keeps the slice's own
layout (``at == lo``, the padding included): the state of every element-wise optimizer is
then exactly the bucket's (or slice's) shape. In a sharded step, a whole leaf's state lives on
the rank that owns it (``fdp._slices.exchange.Owners``), which updates it whole.

``Spans.placed`` says, per leaf, which of its elements this rank's state holds and where: one
run (the part of the leaf inside the slice, or the whole of an owned leaf), what
``step.state_to_shards`` hands a sharded checkpoint as an ``fdp.Shard``; ``pieces`` cuts a
flat tensor (a bucket, a slice, a part's state) by spans.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._plan.bucket import BucketPlan
from ..optim._flat import CHUNK

__all__ = ["Key", "Placed", "Slices", "Span", "Spans", "pieces"]


class Slices:
    """How each bucket of ``plan`` is cut over ``size`` ranks, from ``rank``'s point of view.

    ``padded[b]``: the bucket's length rounded up to a multiple of ``size``; ``lo[b]:hi[b]``:
    this rank's slice of it. ``Slices(plan, 1, 0)`` is the unsharded layout (the whole bucket).
    """

    __slots__ = ("size", "rank", "padded", "lo", "hi")

    def __init__(self, plan: BucketPlan, size: int, rank: int) -> None:
        self.size, self.rank = size, rank
        self.padded = [-(-b.numel // size) * size for b in plan.buckets]
        per = [p // size for p in self.padded]
        self.lo = [rank * s for s in per]
        self.hi = [(rank + 1) * s for s in per]

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def numel(self, b: int) -> int:
        """Elements of bucket ``b``'s slice (the per-rank optimizer state's length)."""
        return self.hi[b] - self.lo[b]

    def mine(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of bucket ``b``'s padded flat tensor (a view; ``flat`` itself when
        unsharded)."""
        if self.size == 1 and flat.numel() == self.hi[b]:
            return flat
        return flat[self.lo[b]:self.hi[b]]


Key = tuple[int, int]  # (part, group)


class Span(NamedTuple):
    """Elements ``lo:hi`` of the (slice of the) bucket, at ``at`` in their part's state
    buffer; ``shape``: the leaf's, for a kernel that takes whole leaves (else None);
    ``owned``: a whole leaf this rank owns in a sharded step (``lo:hi`` are then the bucket's
    own elements, not the slice's: ``fdp._slices.exchange.Owners``)."""

    lo: int
    hi: int
    at: int
    shape: tuple[int, ...] | None
    owned: bool = False
    leaf: int = -1  # (owned spans: the leaf's index)


class Placed(NamedTuple):
    """Where one leaf's elements ``start:stop`` (of its flattening) are in this rank's state:
    at ``at`` in its part's state buffers of bucket ``bucket``. A leaf's elements on one rank
    are one run (the part of the leaf inside the slice, or the whole of an owned leaf)."""

    leaf: int
    part: int
    bucket: int
    start: int
    stop: int
    at: int


class Spans:
    """One rank's spans of every bucket (see the module docstring).

    Attributes:
      by_key: per bucket, ``[(key, [Span, ...]), ...]`` in key order.
      sizes: per bucket, per part, its state buffers' length.
      placed: per leaf index, where its elements are in this rank's state (``Placed``), or
        None when this rank holds none of them.
    """

    def __init__(self, plan: BucketPlan, keys: tuple[Key, ...], whole_parts: set[int], slices: Slices,
                 parts: int, owner: dict[int, int] | None = None) -> None:
        self.by_key: list[list[tuple[Key, list[Span]]]] = []
        self.sizes: list[list[int]] = []
        self.placed: list[Placed | None] = [None] * len(plan.slots)
        one_part = parts == 1 and owner is None
        for b in plan.buckets:
            lo_r, hi_r = slices.lo[b.index], min(slices.hi[b.index], b.numel)
            count = [0] * parts
            spans: dict[Key, list[Span]] = {}
            for i, off, n, shape in zip(b.leaves, b.offsets, b.numels, b.shapes):
                if owner is not None and keys[i][0] in whole_parts:  # sharded: the owner's, whole
                    if owner[i] == slices.rank:
                        part = keys[i][0]
                        spans.setdefault(keys[i], []).append(Span(off, off + n, count[part], tuple(shape), True, i))
                        if n:
                            self.placed[i] = Placed(i, part, b.index, 0, n, count[part])
                        count[part] += n
                    continue
                lo, hi = max(off, lo_r), min(off + n, hi_r)
                if lo >= hi:
                    continue
                key = keys[i]
                part = key[0]
                at = lo - lo_r if one_part else count[part]
                count[part] += hi - lo
                self.placed[i] = Placed(i, part, b.index, lo - off, hi - off, at)
                mine = spans.setdefault(key, [])
                if part in whole_parts:
                    mine.append(Span(lo - lo_r, hi - lo_r, at, tuple(shape)))
                elif mine and mine[-1].hi == lo - lo_r and mine[-1].at + (mine[-1].hi - mine[-1].lo) == at:
                    last = mine[-1]
                    mine[-1] = Span(last.lo, hi - lo_r, last.at, None)
                else:
                    mine.append(Span(lo - lo_r, hi - lo_r, at, None))
            self.by_key.append([(key, _chunked(s)) for key, s in sorted(spans.items())])
            self.sizes.append([slices.numel(b.index)] if one_part else count)


def _chunked(spans: list[Span]) -> list[Span]:
    """Spans of at most ``CHUNK`` elements (whole-leaf spans stay whole)."""
    out = []
    for s in spans:
        if s.shape is not None or s.hi - s.lo <= CHUNK:
            out.append(s)
            continue
        for a in range(s.lo, s.hi, CHUNK):
            z = min(a + CHUNK, s.hi)
            out.append(Span(a, z, s.at + (a - s.lo), None))
    return out


def pieces(t: torch.Tensor, spans: list[Span], state: bool) -> list[torch.Tensor]:
    """``t``'s elements in ``spans`` (each at most one kernel call's worth, or one leaf), as
    views: of the (slice of the) bucket, or (``state``) of a part's state buffer; shaped like
    its leaf for a kernel that takes whole leaves."""
    if state:
        return [t[s.at:s.at + (s.hi - s.lo)] if s.shape is None else t[s.at:s.at + (s.hi - s.lo)].view(s.shape)
                for s in spans]
    return [t[s.lo:s.hi] if s.shape is None else t[s.lo:s.hi].view(s.shape) for s in spans]
