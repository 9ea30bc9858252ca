"""Replica checks: ``assert_replicas_equal`` (are the replicas bit-identical?) and
``assert_same_shapes`` (do all ranks hold the same layout?). One small collective each.

Each rank hashes every leaf's bytes, position by position, and all ranks compare a digest
of those hashes with one all-gather of five int64s; only when they differ do two more
gathers name the leaves and ranks.

The per-leaf hash is a position-weighted sum over the raw bits, modulo 2**64:
``sum_i C[i // S] * T[i % S] * word_i`` with odd pseudo-random weights (splitmix64 values,
identical in every process; T is a table of S = 2**18 weights per device, C is computed per
span of S words) and the leaf's bytes read as sign-extended int32 words (int16 or uint8
when the byte count is not a multiple of 4). A leaf of up to S words costs three tensor
operations (widen into a reused buffer, multiply, sum). A plain wrapping sum of the words (what
this check used before) is blind to two swapped elements and to changes that cancel: two
sign-bit flips add 2 * 2**31 to an int32 sum, which wraps to 0. Here a
swap of words a, b at positions p, q changes the hash by ``(b - a) * (w_p - w_q)``, and a
set of changes cancels only if the weights happen to satisfy a linear relation modulo
2**64, about a 2**-32 chance for a given pair of sign flips (a flip of an int32 sign bit
moves the word by 2**31, so only the low 33 bits of a weight matter) and less for other
changes. This detects drift; it is not a defence against an adversary who knows the
weights.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from . import _tree
from ._comm import collectives as comm
from ._comm.agree import describe_layouts, tree_meta, verify_layout
from ._comm.group import Group, resolve
from ._errors import ReplicaMismatchError

_SPAN = 1 << 18  # positions per weight table (2 MiB of int64 per device)
_SEED_TABLE, _SEED_SPANS = 0x5F3759DF, 0x2545F491


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64's finaliser constants (Steele, Lea, Flood, "Fast splittable pseudorandom number
# generators", OOPSLA 2014; the values of java.util.SplittableRandom), as signed int64s.
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64s (torch's ``>>`` is arithmetic on signed types)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _weights(start: int, n: int, seed: int, device: torch.device) -> torch.Tensor:
    """Odd splitmix64 values of positions ``start .. start + n`` (int64 arithmetic wraps)."""
    z = (torch.arange(start, start + n, dtype=torch.int64, device=device) + seed) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _M1
    z = (z ^ _shift_right(z, 27)) * _M2
    return (z ^ _shift_right(z, 31)) | 1


def _span_weight(k: int) -> int:
    """The odd splitmix64 value of span ``k`` as a signed int64 (Python ints: no tensor op)."""
    mask = (1 << 64) - 1
    z = ((k + _SEED_SPANS) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return _signed((z ^ (z >> 31)) | 1)


_tables: dict[torch.device, torch.Tensor] = {}


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in logical (row-major) order as int32, int16 or uint8 words.

    The width depends only on the byte count, and the words only on the values, never on
    strides or the storage offset, so equal values give equal words on every rank.
    """
    flat = t.reshape(-1)  # a copy only if ``t`` is not contiguous
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    data = flat.view(torch.uint8)
    for width, word in ((4, torch.int32), (2, torch.int16)):
        if data.numel() % width == 0:
            if data.storage_offset() % width:
                data = data.clone()  # aligned storage, so the wider view is allowed
            return data.view(word)
    return data


def leaf_hash(t: torch.Tensor, scratch: dict[torch.device, torch.Tensor] | None = None) -> torch.Tensor:
    """A position-sensitive 64-bit hash of a tensor's bytes (an int64 scalar on its device).

    Equal values (bit for bit, same dtype and shape) give equal hashes on every rank and
    device; see the module docstring for what a different tensor's hash can collide with.
    ``scratch`` lends one reusable int64 buffer per device to a series of calls.
    """
    scratch = {} if scratch is None else scratch
    with torch.no_grad():
        words = _words(t)
        device, n = words.device, words.numel()
        table = _tables.get(device)
        if table is None:
            table = _tables[device] = _weights(0, _SPAN, _SEED_TABLE, device)
        if n == 0:
            return torch.zeros((), dtype=torch.int64, device=device)
        acc: Any = None
        for k, start in enumerate(range(0, n, _SPAN)):
            m = min(_SPAN, n - start)
            buf = scratch.get(device)
            if buf is None or buf.numel() < m:
                buf = scratch[device] = torch.empty(m, dtype=torch.int64, device=device)
            part = buf[:m].copy_(words[start:start + m]).mul_(table[:m]).sum()  # widen, weigh, sum
            acc = part if k == 0 else acc + part * _span_weight(k)
        return acc


class ReplicaCheck:
    """An ``assert_replicas_equal(..., wait=False)`` in flight: ``wait()`` raises on drift.

    Example:
      >>> check = fdp.assert_replicas_equal({"w": torch.ones(3)}, wait=False)
      >>> check.wait()  # later, e.g. after the next step
    """

    def __init__(self, tree: Any, hashes: torch.Tensor, work: Any, rows: torch.Tensor, g: Group):
        self._tree, self._hashes, self._work, self._rows, self._g = tree, hashes, work, rows, g

    def wait(self) -> None:
        """Wait for the comparison; raise ``ReplicaMismatchError`` if the ranks differed.

        Waits within the group's timeout (``CollectiveError`` past it); later calls do nothing.
        """
        if self._work is None:
            return
        work, self._work = self._work, None
        comm.wait(work, self._g, "assert_replicas_equal")
        rows = self._rows.cpu()
        if not bool((rows == rows[0]).all()):
            _report_drift(self._tree, self._hashes, rows, self._g)


def assert_replicas_equal(tree: Any, group: Group | Any = None, *, wait: bool = True) -> ReplicaCheck | None:
    """Check, cheaply, that every rank holds bit-identical values in ``tree``.

    Each rank computes a position-sensitive hash of every leaf's bytes (so reordered
    elements and changes that cancel in a plain sum are seen) and a digest of the tree's
    layout and of those hashes; one all-gather of five numbers compares them. Only when ranks
    differ do further gathers find which leaves and ranks.

    Args:
      tree: a pytree of tensors (any dtype, any device, any strides).
      group: the ranks (default: the world, or a world of one).
      wait: ``False`` launches the comparison and returns at once with a ``ReplicaCheck``;
        call its ``wait()`` later (e.g. next step) to raise if the ranks differed. The step
        then pays only for the hashes: the collective overlaps the next step's compute.

    Returns:
      ``None``, or with ``wait=False`` the ``ReplicaCheck`` to wait on.

    Raises:
      ReplicaMismatchError: on every rank, naming the leaves whose values differ from rank
        0's and the ranks that hold the different values (or, if the trees' layouts differ,
        the first differing leaf, as ``assert_same_shapes``).
      TypeError: a leaf that is not a tensor (named by its path).
      CollectiveError: a rank did not join within the group's timeout.

    A collective. What it costs per step is measured by ``python -m fdp.bench replicas``
    (docs/measurements.md, "The replica check").

    Example:
      >>> fdp.assert_replicas_equal({"w": torch.ones(3)})  # returns None when all ranks agree
    """
    g = resolve(group)
    leaves, treedef = _tree.flatten(tree)
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            path = _tree.paths(treedef)[i]
            raise TypeError(f"fdp.assert_replicas_equal: leaf {path} is a {type(t).__name__}, expected a Tensor")
    if g.process_group is None:
        return None if wait else ReplicaCheck(tree, torch.zeros(0), None, torch.zeros(0), g)
    if leaves:
        scratch: dict[torch.device, torch.Tensor] = {}
        hashes = torch.stack([leaf_hash(t, scratch).to(g.device) for t in leaves]).cpu()
    else:
        hashes = torch.zeros(0, dtype=torch.int64)
    h = hashlib.sha256(repr(treedef).encode())
    for t in leaves:
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
    layout = h.digest()
    values = hashlib.sha256(hashes.numpy().tobytes()).digest()
    mine = torch.tensor([len(leaves), *(int.from_bytes(d[:7], "little") for d in (layout, layout[7:], values, values[7:]))],
                        dtype=torch.int64, device=g.device)
    work, rows = comm.all_gather_start(mine, g, "assert_replicas_equal")
    check = ReplicaCheck(tree, hashes, work, rows, g)
    if not wait:
        return check
    check.wait()
    return None


def _report_drift(tree: Any, hashes: torch.Tensor, rows: torch.Tensor, g: Group) -> None:
    meta, _ = tree_meta(tree)
    if not bool((rows[:, :3] == rows[0, :3]).all()):  # the layouts differ
        everyone = comm.all_gather_object((list(meta), ""), g, "assert_replicas_equal (layout report)")
        raise ReplicaMismatchError("fdp: assert_replicas_equal: " + describe_layouts(everyone)
                                   + f" (reported on rank {g.rank})")
    per_leaf = comm.all_gather(hashes.to(g.device), g, "assert_replicas_equal (leaf report)").cpu()
    by_leaf: dict[int, list[int]] = {}
    for r, i in (per_leaf != per_leaf[0]).nonzero().tolist():
        by_leaf.setdefault(i, []).append(r)
    shown = "; ".join(f"leaf {meta[i][0]} differs on rank(s) {ranks}" for i, ranks in list(by_leaf.items())[:10])
    more = f" (and {len(by_leaf) - 10} more)" if len(by_leaf) > 10 else ""
    raise ReplicaMismatchError(
        f"fdp: replicas have drifted: {len(by_leaf)} of {len(meta)} leaves differ from rank 0: "
        f"{shown}{more} (reported on rank {g.rank})"
    )


def assert_same_shapes(tree: Any, group: Group | Any = None) -> None:
    """Check that every rank holds a tree with the same leaf paths, shapes and dtypes.

    Raises:
      ReplicaMismatchError: on every rank, naming the first differing leaf path, the ranks
        and both values (e.g. ``leaf ['fc.weight'] has shape (4, 8) float32 on rank 0 but
        (4, 9) float32 on rank 1``), or the leaf counts.

    A collective (one all-gather of a digest). Non-tensor leaves are compared by type only.

    Example:
      >>> fdp.assert_same_shapes({"w": torch.zeros(4, 8)})  # a world of one: always the same
    """
    meta, _ = tree_meta(tree)
    verify_layout(meta, resolve(group), "assert_same_shapes")
