"""``psum`` and ``pmean``: a pytree summed or averaged over ranks (JAX's names).

For what is not a gradient: a logged loss, an eval accuracy, a count of tokens. Leaves may be
tensors of any numeric dtype or Python numbers; they travel as one flat buffer per (device,
dtype) through ``fdp._comm`` (the group's timeout, errors naming the rank), so a tree of a
dozen metrics costs one or two all-reduces. In a world of one nothing is sent, and the results
have the same types as with many ranks, so the same logging code runs under ``python`` and
``torchrun``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _tree, kernels
from ._comm import collectives as comm
from ._comm.agree import verify_layout
from ._comm.group import Group, resolve

_NUMBER_DTYPES = {bool: torch.int64, int: torch.int64, float: torch.float64}
_LOW = (1 << 32) - 1


def psum(tree: Any, group: Group | Any = None) -> Any:
    """The sum over ranks of every leaf of ``tree``: the same result on every rank.

    Args:
      tree: a pytree whose leaves are tensors (any numeric dtype, any shape, on the group's
        devices) or Python numbers (``int``, ``float``, ``bool``).
      group: the ranks to sum over (default: the world, or a world of one).

    Returns:
      A tree of the same structure: a tensor leaf becomes a new tensor of the same shape and
      device (not differentiable; the input is not modified). A floating tensor keeps its
      dtype; an integer or bool tensor becomes an int64 tensor (as ``torch.sum`` promotes
      them), its exact sum: narrower integers are summed in int64, which cannot overflow for
      any world size, and int64 ones in two 32-bit halves. An ``int`` or ``bool`` leaf
      becomes the exact ``int``, a ``float`` leaf a ``float`` (summed in float64). Eager
      only: call it outside a ``torch.compile``d step.

    Raises:
      TypeError: a leaf that is neither a tensor nor a number, a complex, sparse or uint64
        tensor, or an ``int`` outside int64 (the message names its path).
      OverflowError: an integer tensor whose sum leaves int64's range (on every rank; the
        message names the leaf).
      ReplicaMismatchError: ranks passed trees of different layouts (checked the first time a
        layout is seen, on every call with ``FDP_DEBUG=1``).
      CollectiveError: a rank did not join within the group's timeout.

    A collective: every rank calls it with a tree of the same layout.

    Example:
      >>> fdp.psum({"tokens": 512, "correct": torch.tensor([True, False, True])})  # a world of one
      {'tokens': 512, 'correct': tensor([1, 0, 1])}
    """
    return _reduce(tree, resolve(group), mean=False, what="fdp.psum")


def pmean(tree: Any, group: Group | Any = None) -> Any:
    """The mean over ranks of every leaf of ``tree``: the same result on every rank.

    Leaves are summed, then divided by the number of ranks, except fp16 and bf16 ones, which
    are multiplied by 1/world before the sum (as gradient buckets are) so that the sum cannot
    overflow. Integer and bool leaves are summed exactly (as ``fdp.psum`` sums them) and come
    back in float64: an integer tensor as a float64 tensor (the exact sum rounded once to
    float64, then divided), a Python ``int`` as a ``float`` (the exact sum divided by the
    world size, rounded once: ``123456789`` stays ``123456789.0``).

    Args:
      tree: a pytree of tensors (any numeric dtype) and Python numbers.
      group: the ranks to average over (default: the world, or a world of one).

    Returns:
      A tree of the same structure; tensors keep their shape and device (floating ones their
      dtype, integer and bool ones become float64); numbers come back as ``float``.

    Raises:
      TypeError, ReplicaMismatchError, CollectiveError: as ``fdp.psum`` (a mean never
      overflows).

    A collective: every rank calls it with a tree of the same layout.

    Example:
      >>> logged = fdp.pmean({"loss": torch.tensor(2.5), "steps": 3})  # the same on every rank
      >>> logged
      {'loss': tensor(2.5000), 'steps': 3.0}
      >>> if fdp.init().is_main: print(f"loss {logged['loss'].item():.4f}")
      loss 2.5000
    """
    return _reduce(tree, resolve(group), mean=True, what="fdp.pmean")


def _prescaled(dtype: torch.dtype) -> bool:
    """fp16/bf16 shares are scaled before the sum, as DDP scales gradient buckets, so the sum
    cannot overflow; wider dtypes are summed, then divided (exact when the sum is)."""
    return dtype.is_floating_point and dtype.itemsize < 4


def _wire(x: torch.Tensor, path: str, what: str) -> tuple[torch.dtype, bool]:
    """How a tensor leaf travels: (the dtype it is summed in, whether as two 32-bit halves)."""
    if x.is_complex() or x.layout != torch.strided:
        raise TypeError(f"{what}: leaf {path} is a {x.layout} {x.dtype} tensor; expected a dense real tensor")
    if x.is_floating_point():
        return x.dtype, False
    if x.dtype == torch.int64:
        return torch.int64, True  # its sum may leave int64: summed as halves, checked exactly
    if x.dtype == torch.uint64:
        raise TypeError(f"{what}: leaf {path} is a uint64 tensor, which fdp cannot sum exactly; "
                        "convert it to int64 (or float64) first")
    return torch.int64, False  # bool and integers of <= 32 bits: an int64 sum cannot overflow


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int64 tensor as (high, low) 32-bit halves, each an int64: t = high * 2**32 + low."""
    return t >> 32, t & _LOW


def _reduce(tree: Any, g: Group, *, mean: bool, what: str) -> Any:
    paths, leaves, treedef = _tree.flatten_with_paths(tree)
    tensors: list[torch.Tensor] = []
    wires: list[tuple[torch.dtype, bool]] = []
    for p, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            wires.append(_wire(x, p, what))
            tensors.append(x.detach())
        elif type(x) in _NUMBER_DTYPES:
            if type(x) is int and not -2**63 <= x < 2**63:
                raise TypeError(f"{what}: leaf {p} is the int {x}, outside int64 (what fdp sums ints in)")
            tensors.append(torch.tensor(x, dtype=_NUMBER_DTYPES[type(x)], device=g.device))
            wires.append((tensors[-1].dtype, type(x) is int))
        else:
            raise TypeError(f"{what}: leaf {p} is a {type(x).__name__}; expected a tensor or a Python number")
    if not tensors:
        return tree
    meta = [(p, tuple(t.shape), str(t.dtype)) for p, t in zip(paths, tensors)]
    if g.process_group is not None:
        # Every call: a layout agreed on earlier says nothing about this call's (sync_buffers' lesson); one tiny all-gather.
        verify_layout(meta, g, what)
    # What travels: each leaf in its wire dtype, an int64 one as its two halves.
    parts: list[torch.Tensor] = []
    owner: list[int] = []
    for i, (t, (_, split)) in enumerate(zip(tensors, wires)):
        pieces = _halves(t) if split else (t,)
        parts.extend(pieces)
        owner.extend([i] * len(pieces))
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for j, (t, i) in enumerate(zip(parts, owner)):
        groups.setdefault((t.device, wires[i][0]), []).append(j)
    flats, works = [], []
    for n, ((device, dtype), idx) in enumerate(groups.items()):
        flat = torch.empty(sum(parts[j].numel() for j in idx), dtype=dtype, device=device)
        scale = 1.0 / g.size if mean and _prescaled(dtype) and g.size > 1 else None
        kernels.flatten([parts[j].to(dtype) for j in idx], flat, scale=scale)
        works.append(comm.all_reduce(flat, g, f"{what}: all-reduce {n} of {len(groups)} ({dtype})",
                                      async_op=True))
        flats.append(flat)
    for w in works:
        comm.wait(w, g, what)
    summed: list[Any] = [None] * len(parts)
    for flat, idx in zip(flats, groups.values()):
        for j, part in zip(idx, torch.split(flat, [parts[j].numel() for j in idx])):
            summed[j] = part.view(parts[j].shape)
    out: list[Any] = []
    j = 0
    for p, x, (dtype, split) in zip(paths, leaves, wires):
        if split:
            high, low = summed[j], summed[j + 1]
            j += 2
        else:
            total = summed[j]
            j += 1
        if not isinstance(x, torch.Tensor):
            value = (high.item() << 32) + low.item() if split else total.item()  # exact for ints
            # a mean: Python's int / int is the exact quotient rounded once; float / int is float64's
            out.append(value / g.size if mean else value)
            continue
        if split:
            high = high + (low >> 32)  # carry: every half is now in range, the sum exact
            low = low & _LOW
            if mean:  # the exact sum rounded once to float64 (high * 2**32 is exact)
                total = high.double() * 2**32 + low.double()
            else:
                if bool(((high < -2**31) | (high >= 2**31)).any()):
                    raise OverflowError(
                        f"{what}: leaf {p} (int64) sums to a value outside int64 over {g.size} ranks, so its "
                        "exact sum cannot be returned; sum it as float64 (x.double()) if an inexact sum will do")
                total = high * 2**32 + low
        if not mean:
            out.append(total)
        elif dtype.is_floating_point:
            out.append(total if _prescaled(dtype) else total / g.size)
        else:
            out.append(total.double() / g.size)
    return _tree.unflatten(treedef, out)
