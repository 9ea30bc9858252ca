"""``Shard``: one rank's part of one logical tensor.

A tensor of ``shape`` and ``dtype`` is seen as its row-major flattening, elements ``0`` to
``numel``. A ``Shard`` holds some element ranges of it: ``ranges``, sorted and disjoint
``(start, stop)`` pairs, and ``data``, a 1-D tensor with those elements concatenated in
order. ``ranges == ((0, numel),)`` is the whole tensor; ``()`` is none of it (a rank that
holds nothing of this leaf)::

    tensor (2, 5), flattened:  [ 0 1 2 3 4 | 5 6 7 8 9 ]
    rank 0: Shard((2, 5), float32, ((0, 4),),  data = [0 1 2 3])
    rank 1: Shard((2, 5), float32, ((4, 10),), data = [4 5 6 7 8 9])

Element ranges of the flattening, not boxes of the shape: a sharded step's slices cut the
flat buckets anywhere, inside a row too, and a range is what a checkpoint reads and writes
with one seek. Who makes them: ``step.state_to_shards`` (a sharded fused step's optimizer
state, per leaf), ``Shard.whole`` and ``Shard.of`` by hand. Who reads them:
``fdp.save_sharded`` and ``fdp.load_sharded``, which reshard by ranges (a save on 4 ranks
loads on 2). It is not a tensor subclass, so nothing computes on a part as if it were the
whole; in fdp's pytrees it is a leaf.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Shard", "elements"]


@dataclass(frozen=True, eq=False)
class Shard:
    """One rank's part of one logical tensor: some element ranges of its row-major flattening.

    Attributes:
      shape: the whole tensor's shape.
      dtype: its dtype (``data``'s).
      ranges: sorted, disjoint, non-empty ``(start, stop)`` element ranges of the flattened
        tensor that this part holds (``((0, numel),)``: all of it; ``()``: none).
      data: a 1-D tensor of those elements, concatenated in order (any device).

    Raises:
      ValueError: ranges out of order, overlapping, empty or outside the tensor; ``data`` not
        1-D, or of another length or dtype than the ranges and ``dtype`` say.

    Example:
      >>> t = torch.arange(10.0).view(2, 5)
      >>> part = fdp.Shard.of(t, [(4, 10)])
      >>> part.data
      tensor([4., 5., 6., 7., 8., 9.])
      >>> fdp.Shard.whole(t).to_tensor().equal(t)
      True
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    ranges: tuple[tuple[int, int], ...]
    data: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        ranges = tuple((int(a), int(b)) for a, b in self.ranges)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranges", ranges)
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"fdp.Shard: dtype must be a torch.dtype, got {self.dtype!r}")
        if any(d < 0 for d in shape):
            raise ValueError(f"fdp.Shard: shape {shape} has a negative size")
        numel = self.numel
        end = 0
        for a, b in ranges:
            if not (end <= a < b <= numel):
                raise ValueError(
                    f"fdp.Shard: ranges {list(ranges)} of a tensor of shape {shape} ({numel} elements) must be "
                    f"sorted, disjoint, non-empty and inside [0, {numel}); ({a}, {b}) is not")
            end = b
        data = self.data
        if not isinstance(data, torch.Tensor) or data.dim() != 1:
            raise ValueError(f"fdp.Shard: data must be a 1-D tensor, got "
                             f"{tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__}")
        held = sum(b - a for a, b in ranges)
        if data.numel() != held or data.dtype != self.dtype:
            raise ValueError(f"fdp.Shard: data has {data.numel()} elements of {data.dtype}; the ranges "
                             f"{list(ranges)} hold {held} of {self.dtype}")

    @classmethod
    def whole(cls, t: torch.Tensor) -> Shard:
        """The whole of ``t`` as a Shard (``data`` is a view of ``t`` when it is contiguous)."""
        t = t.detach()
        return cls(tuple(t.shape), t.dtype, ((0, t.numel()),) if t.numel() else (), t.reshape(-1))

    @classmethod
    def of(cls, t: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> Shard:
        """The elements ``ranges`` of ``t``'s flattening, copied (for tests and by-hand layouts)."""
        flat = t.detach().reshape(-1)
        parts = [flat[a:b] for a, b in ranges]
        data = torch.cat(parts) if parts else flat.new_empty(0)
        return cls(tuple(t.shape), t.dtype, tuple(ranges), data)

    @property
    def numel(self) -> int:
        """Elements of the whole tensor (``data.numel()`` is how many this part holds)."""
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def pieces(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(start, stop, elements)`` of each range, the elements a view of ``data``."""
        at = 0
        for a, b in self.ranges:
            yield a, b, self.data[at:at + (b - a)]
            at += b - a

    def to_tensor(self) -> torch.Tensor:
        """The whole tensor in its shape (a view of ``data``); only for a part that holds all of it."""
        if sum(b - a for a, b in self.ranges) != self.numel:
            raise ValueError(f"fdp.Shard.to_tensor: this part holds ranges {list(self.ranges)} of "
                             f"{self.numel} elements, not the whole tensor")
        return self.data.view(self.shape)

    def __repr__(self) -> str:
        return (f"Shard(shape={self.shape}, dtype={self.dtype}, ranges={list(self.ranges)}, "
                f"data=<{self.data.numel()} elements on {self.data.device}>)")


def elements(leaf: torch.Tensor | Shard, a: int, b: int) -> torch.Tensor | None:
    """Elements ``a:b`` of a leaf's flattening, as a view: from a whole tensor, or from a Shard
    one of whose ranges holds them all (None when none does). The one reader of a part of a
    leaf, for every caller that takes a tensor or a Shard (sharded checkpoints, a fully
    sharded step's params, a sharded optimizer state)."""
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().reshape(-1)[a:b]
    for lo, hi, data in leaf.pieces():
        if lo <= a and b <= hi:
            return data[a - lo:b - lo]
    return None
