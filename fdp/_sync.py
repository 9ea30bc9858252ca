"""The explicit broadcast steps: the init broadcast and the buffer step.

DDP keeps replicas identical with a broadcast at construction and a hidden buffer broadcast
before every forward. fdp makes both explicit calls (``broadcast``, ``sync_buffers``); the
checks DDP runs internally are user-callable functions in ``_replicas.py``. Every function
here is a collective: all ranks must call it.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _tree, kernels
from ._comm import collectives as comm
from ._comm.agree import Meta, digest, tree_meta, verify_digest, verify_layout
from ._comm.group import Group, resolve
from ._comm.traced import traced_all_reduce, traced_broadcast
from ._lru import LRU
from ._plan.bucket import BucketPlan, MiB, contiguous_strides

BROADCAST_BUCKET_MB = 250  # DDP's broadcast_bucket_size

# sync_buffers checks the layout, mode and src on every call: skipping the check once ranks
# had agreed let a float tree on one rank and an int tree on another (both seen before)
# exchange reinterpreted bytes, and different modes hang until the timeout.
# The check is one all-gather of three int64s; the digest is cached per (structure, shapes,
# dtypes, mode, src), so the host work per call is one dict lookup.
_DIGESTS: LRU[tuple, tuple[torch.Tensor, list[Meta]]] = LRU(64)


def _sync_layout(buffers: Any, leaves: list[Any], treedef: Any, extra: str) -> tuple[torch.Tensor, list[Meta]]:
    try:
        key = (treedef, tuple(t.shape for t in leaves), tuple(t.dtype for t in leaves), extra)
        hit = _DIGESTS.peek(key)
    except (AttributeError, TypeError):  # a leaf that is not a tensor: named below
        key, hit = None, None
    if hit is not None:
        return hit
    meta, _ = _tensor_leaves(buffers, "sync_buffers")
    hit = (digest(meta, extra), meta)
    if key is not None:
        _DIGESTS.put(key, hit)
    return hit


# ---------------------------------------------------------------------------- broadcast


def _tensor_leaves(tree: Any, what: str) -> tuple[list[Meta], list[torch.Tensor]]:
    meta, leaves = tree_meta(tree)
    for m, t in zip(meta, leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fdp.{what}: leaf {m[0]} is a {type(t).__name__}, expected a Tensor")
        if t.is_quantized:  # its bytes alone are not its value (scale and zero point are not sent)
            raise TypeError(f"fdp.{what}: leaf {m[0]} is a quantized tensor ({t.dtype}); "
                            "dequantize it first (quantized tensors cannot be sent as bytes)")
    return meta, leaves


# SUM needs an arithmetic type on the wire; float8 and float4 formats have none on gloo
# (and not on every NCCL), so they are averaged in float32 and rounded once back.
_SUM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _coalesced_broadcast(tree: Any, src: int, g: Group, what: str, *, aliases: bool = False) -> Any:
    """Broadcast every leaf from ``src`` in <= 250 MiB flat buckets; fresh tensors back.

    ``aliases``: the leaves share the buckets' memory without being autograd views of them
    (no ``_base``), so a consumer can re-point each leaf elsewhere (``Tensor.set_``) and the
    bucket is freed with its last leaf: a donated fused step packs a broadcast tree without
    a second params-sized set alive beside it."""
    plan = BucketPlan.from_caps(tree, (BROADCAST_BUCKET_MB * MiB,), floating_only=False)
    leaves = _tree.leaves(tree)
    flats = []
    pending: list[Any] = []
    for b in plan.buckets:
        flat = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        if g.rank == src:
            kernels.flatten([leaves[i] for i in b.leaves], flat)
        # A broadcast copies bytes, so every bucket travels as uint8: backends carry no
        # float8, uint16/32/64 or complex (gloo raises "Invalid scalar type" at the wait,
        # torch 2.13), but every backend carries bytes.
        wire = flat.view(torch.uint8)
        pending.append(comm.broadcast(wire, src, g, f"{what}: broadcast of bucket {b.index}", async_op=True))
        flats.append(flat)
        if len(pending) >= 2:  # as c10d's broadcast_coalesced: at most two buckets in flight
            comm.wait(pending.pop(0), g, f"{what}: broadcast")
    for w in pending:
        comm.wait(w, g, f"{what}: broadcast")
    if not aliases:
        return plan.views(flats)
    leaves = [None] * len(leaves)
    for b, flat in zip(plan.buckets, flats):
        storage = flat.untyped_storage()
        for i, off, shape in zip(b.leaves, b.offsets, b.shapes):
            leaves[i] = torch.empty(0, dtype=b.dtype, device=b.device).set_(
                storage, off, shape, contiguous_strides(shape))
    return _tree.unflatten(plan.treedef, leaves)


def _check_src(src: int, g: Group, what: str) -> None:
    if not 0 <= src < g.size:
        raise ValueError(f"fdp.{what}: src={src} is not a rank of this group (size {g.size})")


def broadcast(tree: Any, src: int = 0, group: Group | Any = None) -> Any:
    """Return ``tree`` with every leaf replaced by rank ``src``'s value (DDP's init broadcast).

    Coalesced: leaves are packed into flat buckets of at most 250 MiB per (device, dtype)
    and sent as bytes with one broadcast each (two in flight at a time), so any dtype works,
    also those a backend has no type for (float8, uint16, complex). The layout is checked
    first, so ranks holding different trees get a
    ``ReplicaMismatchError`` naming the leaf instead of a hang. Never writes in place: the
    result holds fresh tensors (on every rank, ``src`` included) and the input is untouched
    even if a collective fails halfway. In a world of one nothing is sent and ``tree``
    itself is returned. A collective.

    Raises:
      ReplicaMismatchError: on every rank, if the ranks' trees differ (names the first
        differing leaf and the ranks).
      TypeError: a leaf that is not a tensor, or a quantized tensor (named by its path).
      ValueError: a ``src`` outside the group.
      CollectiveError: a rank did not join within the group's timeout.

    Example:
      >>> apply, params, buffers = fdp.functionalize(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
      >>> params, buffers = fdp.broadcast((params, buffers), src=0)  # every rank starts from rank 0's
    """
    g = resolve(group)
    _check_src(src, g, "broadcast")
    meta, _ = _tensor_leaves(tree, "broadcast")
    if g.process_group is None:
        return tree
    verify_layout(meta, g, "broadcast")
    return _coalesced_broadcast(tree, src, g, "broadcast", aliases=True)


def sync_buffers(buffers: Any, *, mode: str = "broadcast", src: int = 0, group: Group | Any = None) -> Any:
    """The explicit buffer step: make non-trainable state (BatchNorm statistics) agree.

    Call it once per step, after the gradient step, on the buffers the forward returned
    (``out, buffers = apply(params, buffers, x)``). It reads the tree you pass, so buffers
    that were replaced rather than mutated are handled.

    Args:
      mode: ``"broadcast"`` (default): rank ``src``'s buffers win, exactly DDP's per-forward
        rule (``broadcast_buffers=True``), so results match DDP bit for bit.
        ``"mean"``: floating buffers are averaged over ranks (flax's ``sync_batch_stats``),
        statistics from all ranks' data; integer buffers (``num_batches_tracked``) take
        ``src``'s value.
        Float8 buffers are averaged in float32 and rounded once back.
      src: the authoritative rank.
      group: the ranks (default: the world, or a world of one).

    Every call first checks, with one all-gather of three numbers, that all ranks pass the
    same layout (leaf paths, shapes, dtypes), ``mode`` and ``src``: a tree or mode that
    differs on one rank is an error on every rank, never reinterpreted bytes or a hang.

    Returns:
      New buffers (fresh tensors); the input is not modified. In a world of one, ``buffers``
      itself (nothing to agree on).

    Raises:
      ReplicaMismatchError: on every rank, if the ranks' layouts, modes or sources differ
        (names the first differing leaf, or both modes and sources, and the ranks).
      TypeError: a leaf that is not a tensor, or a quantized tensor (named by its path).
      ValueError: an unknown ``mode`` or a ``src`` outside the group.
      CollectiveError: a rank did not join within the group's timeout.

    Example:
      >>> apply, params, buffers = fdp.functionalize(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
      >>> out, buffers = apply(params, buffers, torch.randn(8, 4))
      >>> buffers = fdp.sync_buffers(buffers)               # rank 0's statistics win (DDP)
      >>> buffers = fdp.sync_buffers(buffers, mode="mean")  # or: averaged over ranks
    """
    if mode not in ("broadcast", "mean"):
        raise ValueError(f"fdp.sync_buffers: mode must be 'broadcast' or 'mean', got {mode!r}")
    g = resolve(group)
    _check_src(src, g, "sync_buffers")
    if _tree.compiling():
        return _sync_buffers_traced(buffers, mode, src, g)
    leaves, treedef = _tree.flatten(buffers)
    if g.process_group is None:
        _tensor_leaves(buffers, "sync_buffers")
        return buffers
    extra = f"mode={mode} src={src}"
    digest, meta = _sync_layout(buffers, leaves, treedef, extra)
    verify_digest(digest, lambda: (meta, extra), g, "sync_buffers")
    if not leaves:
        return buffers
    if mode == "broadcast":
        return _coalesced_broadcast(buffers, src, g, "sync_buffers")
    floating = [i for i, t in enumerate(leaves) if t.is_floating_point()]
    others = [i for i, t in enumerate(leaves) if not t.is_floating_point()]
    out: list[Any] = [None] * len(leaves)
    if floating:
        ftree = [leaves[i] if leaves[i].dtype in _SUM_DTYPES else leaves[i].float() for i in floating]
        plan = BucketPlan.from_caps(ftree, (BROADCAST_BUCKET_MB * MiB,), floating_only=True)
        flats = plan.flatten(ftree, scale=1.0 / g.size)
        works = [comm.all_reduce(f, g, f"sync_buffers(mean): bucket {b.index}", async_op=True)
                 for b, f in zip(plan.buckets, flats)]
        for w in works:
            comm.wait(w, g, "sync_buffers(mean)")
        for i, t in zip(floating, plan.views(flats)):
            out[i] = t if t.dtype == leaves[i].dtype else t.to(leaves[i].dtype)
    if others:
        synced = _coalesced_broadcast([leaves[i] for i in others], src, g, "sync_buffers")
        for i, t in zip(others, synced):
            out[i] = t
    return _tree.unflatten(treedef, out)


def _sync_buffers_traced(buffers: Any, mode: str, src: int, g: Group) -> Any:
    """``sync_buffers`` inside ``torch.compile``: one functional collective per dtype.

    The cross-rank layout check reads values on the host, so it is not traced: check once
    eagerly (``fdp.assert_same_shapes(buffers)``) before compiling the step.
    """
    leaves, treedef = _tree.flatten(buffers)
    if g.process_group is None or not leaves:
        return buffers
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(leaves):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[Any] = [None] * len(leaves)
    for dtype, idx in by_dtype.items():
        flat = torch.cat([leaves[i].reshape(-1) for i in idx])
        if mode == "mean" and dtype.is_floating_point:
            flat = traced_all_reduce(flat * (1.0 / g.size), g)
        else:
            flat = traced_broadcast(flat, src, g)
        for i, part in zip(idx, torch.split(flat, [leaves[i].numel() for i in idx])):
            out[i] = part.view(leaves[i].shape)
    return _tree.unflatten(treedef, out)


