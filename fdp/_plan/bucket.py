"""``BucketPlan``: the static layout of a pytree's leaves in size-capped flat buckets."""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .. import _internals, _tree, kernels

MiB = 1024 * 1024
# The cap of ``bucket_cap_mb=float("inf")``: no bucket ever reaches it, so each (device, dtype)
# group gets one bucket after its first (``int(inf * MiB)`` would raise OverflowError).
NO_CAP = 1 << 62


@_internals.trace_constant
def _expected(plan: BucketPlan) -> tuple[int, tuple[torch.Size, ...], tuple[torch.dtype, ...]]:
    """``plan``'s leaf count, shapes and dtypes; in a trace, a constant (dynamo guards on the
    leaves compared with them, not on each of the plan's numbers)."""
    return len(plan.slots), tuple(plan._shapes), tuple(plan._dtypes)


@_internals.trace_constant
def _difference(plan: BucketPlan, keys: tuple[str, ...] | None, n: int) -> str:
    """Where a tree of ``n`` leaves (a dict's ``keys``, or None) differs from ``plan``'s, as
    ``_tree.first_difference`` says it eagerly (dynamo cannot trace optree's accessors); at
    trace time."""
    expected = [s.path for s in plan.slots]
    counts = f"(expected {len(expected)} leaves, found {n})"
    if keys is not None:
        got = [f"[{k!r}]" for k in keys]
        missing = [p for p in expected if p not in got]
        if missing:
            return f"missing leaf {missing[0]} {counts}"
        extra = [p for p in got if p not in expected]
        if extra:
            return f"unexpected extra leaf {extra[0]} {counts}"
    return counts


@_internals.trace_constant
def _placed(plan: BucketPlan) -> tuple[int, tuple[tuple[tuple[int, int, int, tuple[int, ...]], ...], ...]]:
    """``plan``'s leaf count and, per bucket, each leaf's ``(index, offset, numel, shape)``; in a
    trace, a constant."""
    return len(plan.slots), tuple(
        tuple((i, off, n, tuple(plan.slots[i].shape)) for i, off, n in zip(b.leaves, b.offsets, b.numels))
        for b in plan.buckets)


@dataclass(frozen=True)
class LeafSlot:
    """Where one leaf lives: its bucket and its element offset inside that bucket."""

    index: int  # position in tree order
    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    numel: int
    bucket: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One flat buffer's worth of leaves.

    ``leaves`` are indices in tree order, listed in the order they sit in the buffer (the
    reverse of tree order: the order a backward produces them); ``offsets``, ``numels``,
    ``shapes`` and ``paths`` describe them in the same order. ``last`` marks the final bucket
    of a step (the one holding the first leaves of the tree). Comm hooks receive it with
    every flat buffer.

    Attributes:
      index: the bucket's position in the plan (the order buckets fill in a backward).
      dtype, device: of every leaf in it.
      leaves, offsets, numels, shapes, paths: per leaf, in buffer order.
      numel: elements in the flat buffer.
      cap_bytes: the cap it was filled up to (it may exceed it by one leaf).
      last: whether this is the final bucket of a step.

    Example:
      >>> plan = fdp.BucketPlan.build({"a": torch.zeros(3), "b": torch.zeros(2)})
      >>> b = plan.buckets[0]
      >>> b.paths, b.offsets, b.numel, b.nbytes, b.last
      (("['b']", "['a']"), (0, 2), 5, 20, True)
    """

    index: int
    dtype: torch.dtype
    device: torch.device
    leaves: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    cap_bytes: int
    paths: tuple[str, ...]
    last: bool
    group: int = 0  # the leaves' group (e.g. an optimizer's param group), when the plan has groups

    @property
    def nbytes(self) -> int:
        """The flat buffer's size in bytes (``numel`` times the dtype's size)."""
        return self.numel * itemsize(self.dtype)


# Attribute getters mapped over leaves (C-level: no Python bytecode per leaf).
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (for ``Tensor.set_``)."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _caps(bucket_cap_mb: float, first_bucket_cap_mb: float, bucket_caps_mb: Sequence[float] | None) -> tuple[int, ...]:
    if bucket_caps_mb is not None:
        caps_mb = list(bucket_caps_mb)
        if not caps_mb:
            raise ValueError("fdp.BucketPlan: bucket_caps_mb must not be empty")
    else:
        caps_mb = [first_bucket_cap_mb, bucket_cap_mb]
    for c in caps_mb:
        if not (isinstance(c, (int, float)) and c > 0):  # NaN fails too
            raise ValueError(f"fdp.BucketPlan: bucket caps must be > 0 MiB (or inf for no cap; fdp.Reducer also takes 'auto'), got {c!r}")
    return tuple(NO_CAP if math.isinf(c) else max(1, min(NO_CAP, int(c * MiB))) for c in caps_mb)


def assign(leaf_bytes: Sequence[int], leaf_keys: Sequence[Any], caps: Sequence[int]) -> list[list[int]]:
    """DDP's greedy bucket assignment (c10d's ``compute_bucket_assignment_by_size``): the
    buckets as lists of leaf indices, in buffer order, the buckets in fill order.

    Leaves are taken in reverse order (the order a backward produces them); leaves of
    different ``leaf_keys`` (device, dtype, optimizer group) never share a bucket; each key
    fills its buckets greedily, its k-th bucket closing once its bytes reach ``caps[k]``
    (the last cap repeating), the crossing leaf included. Buckets are ordered by their
    first leaf, largest index first. ``BucketPlan`` and the cost model both use this one.
    """
    open_: dict[Any, list] = {}
    level: dict[Any, int] = {}
    closed: list[list[int]] = []
    for i in reversed(range(len(leaf_bytes))):
        key = leaf_keys[i]
        b = open_.get(key)
        if b is None:
            b = open_[key] = [[], 0, caps[min(level.get(key, 0), len(caps) - 1)]]
        b[0].append(i)
        b[1] += leaf_bytes[i]
        if b[1] >= b[2]:
            closed.append(open_.pop(key)[0])
            level[key] = level.get(key, 0) + 1
    closed.extend(b[0] for b in open_.values())
    closed.sort(key=lambda members: -members[0])
    return closed


class BucketPlan:
    """How a pytree of tensors is packed into flat buckets: static, immutable, hashable.

    Leaves are taken in *reverse* tree order (the order a backward produces gradients),
    grouped by (device, dtype); each group fills buckets greedily, and a bucket closes once
    its bytes reach its cap, including the leaf that crosses the cap (so a bucket may exceed
    its cap by up to one leaf). Each (device, dtype) group's first bucket gets the first cap,
    the following ones the next caps, the last cap repeating. Buckets are ordered by their
    first leaf, which is the order they fill during a backward. This is exactly DDP's
    ``_compute_bucket_assignment_by_size``, so a model gets the same buckets as under DDP.

    Only floating-point leaves can be bucketed; integer and bool leaves are rejected (they
    have no gradient; ``fdp.broadcast`` handles integer state separately).

    Build with ``BucketPlan.build(tree, ...)``. ``plan.fingerprint`` depends only on the
    layout (paths, shapes, dtypes, device types, caps), so it is identical on every rank
    that holds the same model, and different otherwise.

    Attributes:
      buckets: the ``fdp.Bucket`` s, in fill order.
      slots: per leaf in tree order, where it lives (``path``, ``shape``, ``dtype``,
        ``device``, ``bucket``, ``offset``).
      caps: the bucket caps in bytes (first bucket, second, ...; the last repeats).
      treedef: the tree's structure.

    Example:
      >>> params = {"a": torch.ones(300), "b": torch.ones(300)}  # 1,200 bytes each
      >>> plan = fdp.BucketPlan.build(params, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
      >>> [b.paths for b in plan.buckets]  # reverse tree order: the order a backward produces
      [("['b']",), ("['a']",)]
      >>> flats = plan.flatten(params, scale=0.5)
      >>> plan.unflatten(flats)["a"][:3]
      tensor([0.5000, 0.5000, 0.5000])
    """

    def __init__(self, treedef: _tree.TreeDef, slots: tuple[LeafSlot, ...], buckets: tuple[Bucket, ...], caps: tuple[int, ...]):
        self.treedef = treedef
        self.slots = slots
        self.buckets = buckets
        self.caps = caps
        self._shapes = [torch.Size(s.shape) for s in slots]
        self._dtypes = [s.dtype for s in slots]
        self._devices = [s.device for s in slots]
        self._templates: list[list[torch.Tensor]] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        tree: Any,
        *,
        bucket_cap_mb: float = 25,
        first_bucket_cap_mb: float = 1,
        bucket_caps_mb: Sequence[float] | None = None,
    ) -> BucketPlan:
        """Plan the buckets of ``tree`` (a pytree of floating-point tensors).

        Args:
          tree: any pytree (dicts keep insertion order) whose leaves are tensors.
          bucket_cap_mb: cap of every bucket after the first, in MiB (DDP's default, 25);
            ``float("inf")`` means no cap: one more bucket per (device, dtype) group.
          first_bucket_cap_mb: cap of each (device, dtype) group's first bucket, in MiB
            (DDP's default, 1: the first gradients to arrive start communicating early);
            with both caps ``inf``, each (device, dtype) group is one bucket.
          bucket_caps_mb: an explicit list of caps in MiB (first bucket, second, ...; the
            last repeats). Overrides the two above.

        Raises:
          ValueError: a cap <= 0 or NaN, or an empty ``bucket_caps_mb``.
          TypeError: a leaf that is not a floating-point tensor (the message names its path).
        """
        return cls.from_caps(tree, _caps(bucket_cap_mb, first_bucket_cap_mb, bucket_caps_mb), floating_only=True)

    @classmethod
    def from_caps(cls, tree: Any, caps: tuple[int, ...], *, floating_only: bool = True,
                  groups: Sequence[int] | None = None) -> BucketPlan:
        """``build`` with caps in bytes. ``floating_only=False`` also takes integer and bool
        leaves (fdp's coalesced broadcasts move any dtype as bytes). ``groups``: an int per
        leaf; leaves of different groups never share a bucket (an optimizer's param groups:
        a bucket then has one set of hyper-parameters), and each group fills its buckets as
        a (device, dtype) group does. Without it the plan is DDP's."""
        paths, leaves, treedef = _tree.flatten_with_paths(tree)
        if groups is not None and len(groups) != len(leaves):
            raise ValueError(f"fdp.BucketPlan: {len(groups)} groups for {len(leaves)} leaves")
        for p, t in zip(paths, leaves):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"fdp.BucketPlan: leaf {p} is a {type(t).__name__}, expected a Tensor")
            if floating_only and not t.is_floating_point():
                raise TypeError(
                    f"fdp.BucketPlan: leaf {p} has dtype {t.dtype}; only floating-point leaves can "
                    "be bucketed (integer/bool state has no gradient: keep it out of the params tree)"
                )
            if t.is_sparse or t.layout != torch.strided:
                raise TypeError(f"fdp.BucketPlan: leaf {p} has layout {t.layout}; only dense tensors are supported")
        keys = [(t.device, t.dtype) if groups is None else (t.device, t.dtype, int(groups[i]))
                for i, t in enumerate(leaves)]
        assigned = assign([t.numel() * t.element_size() for t in leaves], keys, caps)
        level: dict[tuple, int] = {}  # buckets of each key so far (in fill order: closing order)
        closed = []
        for members in assigned:
            key = keys[members[0]]
            k = level[key] = level.get(key, -1) + 1
            closed.append({"key": key, "leaves": members, "cap": caps[min(k, len(caps) - 1)]})
        slots: list[LeafSlot | None] = [None] * len(leaves)
        buckets = []
        for bi, b in enumerate(closed):
            offsets, numels, off = [], [], 0
            for i in b["leaves"]:
                t = leaves[i]
                slots[i] = LeafSlot(i, paths[i], tuple(t.shape), t.dtype, t.device, t.numel(), bi, off)
                offsets.append(off)
                numels.append(t.numel())
                off += t.numel()
            device, dtype = b["key"][:2]
            buckets.append(Bucket(
                bi, dtype, device, tuple(b["leaves"]), tuple(offsets), tuple(numels),
                tuple(tuple(leaves[i].shape) for i in b["leaves"]), off, b["cap"],
                tuple(paths[i] for i in b["leaves"]), bi == len(closed) - 1,
                b["key"][2] if len(b["key"]) > 2 else 0,
            ))
        return cls(treedef, tuple(slots), tuple(buckets), caps)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ identity
    @cached_property
    def fingerprint(self) -> str:
        """A hex digest of the layout: equal on two ranks iff their plans are the same."""
        h = hashlib.sha256()
        h.update(repr(self.caps).encode())
        for s in self.slots:
            h.update(f"{s.path}|{s.shape}|{s.dtype}|{s.device.type}|{s.bucket}|{s.offset};".encode())
        h.update(repr([b.group for b in self.buckets]).encode())
        return h.hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketPlan) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.nbytes / MiB:.2f}" for b in self.buckets[:8])
        more = ", ..." if len(self.buckets) > 8 else ""
        return (f"BucketPlan({len(self.slots)} leaves in {len(self.buckets)} buckets; "
                f"MiB: [{sizes}{more}]; fingerprint {self.fingerprint[:12]})")

    def summary(self) -> str:
        """One line per bucket: index, dtype, device, MiB, leaf count, first and last path."""
        lines = [repr(self)]
        for b in self.buckets:
            lines.append(f"  bucket {b.index}: {b.dtype} {b.device} {b.nbytes / MiB:.3f} MiB, "
                         f"{len(b.leaves)} leaves ({b.paths[0]} .. {b.paths[-1]})")
        return "\n".join(lines)

    # ------------------------------------------------------------------ checking
    def leaves_of(self, tree: Any, what: str = "tree") -> list[torch.Tensor]:
        """The leaves of ``tree``, in the plan's order, after checking them against the plan.

        Dicts are matched by key: a dict with the plan's keys in another insertion order
        (``{**decay, **no_decay}``) gives its leaves in the plan's order, so whatever is built
        from them (a Reducer's gradients) follows the plan's order, not the caller's. The
        common case, the plan's own order, costs one structure comparison.

        Raises ``ValueError`` naming the missing and unexpected leaf paths, or the first leaf
        whose shape or dtype differs.
        """
        leaves, treedef = _tree.flatten(tree)
        # (Under torch.compile the structure comparison is skipped: dynamo cannot trace
        # PyTreeSpec's C comparison, and it guards on the input structure itself; the count,
        # shape and dtype checks below still run at trace time, against the plan taken as a
        # constant: dynamo guards on the leaves, not on each of the plan's numbers. Dicts are
        # then taken in the order given.)
        compiling = _tree.compiling()
        if not compiling and treedef != self.treedef:
            leaves = _tree.in_order_of(self.treedef, treedef, leaves,
                                       f"fdp: {what} does not match the bucket plan's structure")
        count, shapes, dtypes = _expected(self) if compiling else (len(self.slots), self._shapes, self._dtypes)
        if len(leaves) != count:
            why = _tree.first_difference(self.treedef, treedef) if not compiling else _difference(
                self, tuple(tree) if type(tree) is dict and all(isinstance(k, str) for k in tree) else None, len(leaves))
            raise ValueError(f"fdp: {what} does not match the bucket plan's structure: {why}")
        try:
            if compiling:  # dynamo cannot call attrgetter objects
                same = [t.shape for t in leaves] == list(shapes) and [t.dtype for t in leaves] == list(dtypes)
            else:
                same = list(map(_shape, leaves)) == self._shapes and list(map(_dtype, leaves)) == self._dtypes
        except AttributeError:  # a leaf that is not a tensor
            same = False
        if not same:
            self._raise_leaf_mismatch(leaves, what)
        return leaves

    def _raise_leaf_mismatch(self, leaves: Sequence[Any], what: str) -> None:
        for s, t in zip(self.slots, leaves):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"fdp: {what} leaf {s.path} is a {type(t).__name__}, expected a Tensor")
            if t.shape != s.shape:
                raise ValueError(f"fdp: {what} leaf {s.path} has shape {tuple(t.shape)}, the plan expects {s.shape}")
            if t.dtype != s.dtype:
                raise ValueError(f"fdp: {what} leaf {s.path} has dtype {t.dtype}, the plan expects {s.dtype}")

    def check_one_device(self, what: str) -> None:
        """Raise ``ValueError`` naming a leaf per device if the plan's leaves are on several."""
        first: dict[torch.device, str] = {}
        for s in self.slots:
            first.setdefault(s.device, s.path)
        if len(first) > 1:
            shown = ", ".join(f"{p} on {d}" for d, p in first.items())
            raise ValueError(f"{what}: params must live on one device, found several: {shown}")

    def check_devices(self, leaves: Sequence[torch.Tensor], what: str) -> None:
        if list(map(_device, leaves)) == self._devices:  # the per-step case: one C-level pass
            return
        for s, t in zip(self.slots, leaves):
            if t.device != s.device:
                raise ValueError(f"fdp: {what} leaf {s.path} is on {t.device}, the plan expects {s.device}")

    # ------------------------------------------------------------------ data movement
    def new_buffers(self, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Uninitialised flat buffers, one per bucket (in ``dtype``, default each bucket's)."""
        return [torch.empty(b.numel, dtype=dtype or b.dtype, device=b.device) for b in self.buckets]

    def flatten(
        self,
        tree: Any,
        *,
        scale: float | None = None,
        dtype: torch.dtype | None = None,
        out: Sequence[torch.Tensor] | None = None,
        impl: str | None = None,
    ) -> list[torch.Tensor]:
        """Pack ``tree`` into one flat tensor per bucket, fused with ``* scale`` and a cast.

        Each element becomes ``(x.to(c) * scale).to(dtype)`` with ``c`` the widest of fp32 and
        the two dtypes (one rounding). ``dtype`` defaults to each bucket's own dtype.
        ``out`` reuses the caller's buffers (no allocation). ``impl`` forces the copy kernel
        (``"torch"`` or ``"triton"``; default: ``FDP_KERNELS``, else Triton for CUDA tensors
        when it is installed).

        Raises:
          ValueError: ``tree`` does not match the plan (structure, shape, dtype or device:
            names the first differing leaf).
        """
        leaves = self.leaves_of(tree, "flatten")
        self.check_devices(leaves, "flatten")
        flats = self._out_buffers(out, dtype)
        for b, flat in zip(self.buckets, flats):
            kernels.flatten([leaves[i] for i in b.leaves], flat, scale=scale, impl=impl)
        return flats

    def _out_buffers(self, out: Sequence[torch.Tensor] | None, dtype: torch.dtype | None) -> list[torch.Tensor]:
        if out is None:
            return self.new_buffers(dtype)
        out = list(out)
        if len(out) != len(self.buckets):
            raise ValueError(f"fdp: out= has {len(out)} buffers, the plan has {len(self.buckets)} buckets")
        for b, o in zip(self.buckets, out):
            if o.dim() != 1 or o.numel() != b.numel or o.device != b.device:
                raise ValueError(
                    f"fdp: out[{b.index}] must be a 1-D tensor of {b.numel} elements on {b.device}, "
                    f"got shape {tuple(o.shape)} on {o.device}"
                )
            if dtype is not None and o.dtype != dtype:
                raise ValueError(f"fdp: out[{b.index}] has dtype {o.dtype}, expected {dtype}")
        return out

    def unflatten(
        self,
        flats: Sequence[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        out: Any = None,
        impl: str | None = None,
    ) -> Any:
        """Unpack flat buckets into a tree shaped like the plan's.

        Without ``out``, each bucket is copied once (cast to ``dtype``, default each leaf's own)
        and the returned leaves are views into that copy, so the result never aliases
        ``flats``. With ``out=tree``, the values are copied into that tree's tensors and it
        is returned.

        Raises:
          ValueError: not one 1-D tensor of the bucket's size per bucket, or an ``out`` that
            does not match the plan.
        """
        flats = list(flats)
        if len(flats) != len(self.buckets):
            raise ValueError(f"fdp: unflatten got {len(flats)} flat tensors, the plan has {len(self.buckets)} buckets")
        for b, f in zip(self.buckets, flats):
            if f.dim() != 1 or f.numel() != b.numel:
                raise ValueError(
                    f"fdp: flat tensor {b.index} must be 1-D with {b.numel} elements "
                    f"(bucket {b.index}: {b.paths[0]} .. {b.paths[-1]}), got shape {tuple(f.shape)}"
                )
        if out is not None:
            leaves = self.leaves_of(out, "unflatten out=")
            for b, f in zip(self.buckets, flats):
                kernels.unflatten(f, [leaves[i] for i in b.leaves], impl=impl)
            return out
        return self.views([f.to(dtype or b.dtype, copy=True) for b, f in zip(self.buckets, flats)])

    def template(self) -> Any:
        """The tree as tensors of the leaves' shapes, dtypes and device that hold one element
        each (a zero expanded to the shape): what masks and ``opt.init`` need to know of it."""
        return _tree.unflatten(self.treedef, [
            torch.zeros((), dtype=s.dtype, device=s.device).expand(s.shape) for s in self.slots])

    def views(self, flats: Sequence[torch.Tensor], treedef: _tree.TreeDef | None = None) -> Any:
        """A tree of views into ``flats`` (no copy): valid as long as the buffers are.

        ``treedef``: the structure to build (default the plan's; under torch.compile pass one
        flattened inside the traced code, since dynamo replaces optree's tree specs).
        """
        if _tree.compiling():  # traceable slicing, where each leaf lies a constant (``_placed``)
            count, placed = _placed(self)
            leaves: list[Any] = [None] * count
            for per_leaf, f in zip(placed, flats):
                for i, off, n, shape in per_leaf:
                    leaves[i] = f[off : off + n].view(shape)
        else:  # every view of a bucket from one C++ call (``python -m fdp.bench micro``, row "views")
            leaves = [None] * len(self.slots)
            for b, f, shapes in zip(self.buckets, flats, self._shape_templates()):
                for i, v in zip(b.leaves, kernels.views(f, shapes)):
                    leaves[i] = v
        return _tree.unflatten(treedef or self.treedef, leaves)

    def _shape_templates(self) -> list[list[torch.Tensor]]:
        """Per bucket, storage-less tensors shaped like its leaves (what the view call reads)."""
        if self._templates is None:
            self._templates = [[torch.empty(s, device="meta") for s in b.shapes] for b in self.buckets]
        return self._templates

