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


def psum(tree: Any, group: Group | Any = None) -> Any:
    """The sum over ranks of every leaf of ``tree``: the same result on every rank.

    Args:
      tree: a pytree whose leaves are tensors (any numeric dtype, any shape, on the group's
        devices) or Python numbers (``int``, ``float``, ``bool``).
      group: the ranks to sum over (default: the world, or a world of one).

    Returns:
      A tree of the same structure: a tensor leaf becomes a new tensor of the same shape,
      dtype and device (a bool tensor: an int64 count; not differentiable, and the input is
      not modified); an ``int`` or ``bool`` leaf an ``int``, a ``float`` leaf a ``float``
      (summed in float64). Eager only: call it outside a ``torch.compile``d step.

    Raises:
      TypeError: a leaf that is neither a tensor nor a number (the message names its path).
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
    overflow. Integer leaves are summed exactly and come back floating: an integer tensor in
    the default float dtype, a Python ``int`` as a ``float``.

    Args:
      tree: a pytree of tensors (any numeric dtype) and Python numbers.
      group: the ranks to average over (default: the world, or a world of one).

    Returns:
      A tree of the same structure; tensors keep their shape and device (floating ones their
      dtype); numbers come back as ``float``.

    Raises:
      TypeError, ReplicaMismatchError, CollectiveError: as ``fdp.psum``.

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


def _reduce(tree: Any, g: Group, *, mean: bool, what: str) -> Any:
    paths, leaves, treedef = _tree.flatten_with_paths(tree)
    tensors: list[torch.Tensor] = []
    for p, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            if x.is_complex() or x.layout != torch.strided:
                raise TypeError(f"{what}: leaf {p} is a {x.layout} {x.dtype} tensor; expected a dense real tensor")
            tensors.append(x.detach())
        elif type(x) in _NUMBER_DTYPES:
            tensors.append(torch.tensor(x, dtype=_NUMBER_DTYPES[type(x)], device=g.device))
        else:
            raise TypeError(f"{what}: leaf {p} is a {type(x).__name__}; expected a tensor or a Python number")
    if not tensors:
        return tree
    meta = [(p, tuple(t.shape), str(t.dtype)) for p, t in zip(paths, tensors)]
    if g.process_group is not None:
        # Every call: a layout agreed on earlier says nothing about this call's (the
        # sync_buffers lesson of issue 15, item 3); one tiny all-gather.
        verify_layout(meta, g, what)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        dtype = torch.int64 if t.dtype == torch.bool else t.dtype  # bools are counted
        groups.setdefault((t.device, dtype), []).append(i)
    flats, works = [], []
    for n, ((device, dtype), idx) in enumerate(groups.items()):
        flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=dtype, device=device)
        scale = 1.0 / g.size if mean and _prescaled(dtype) and g.size > 1 else None
        kernels.flatten([tensors[i].to(dtype) for i in idx], flat, scale=scale)
        works.append(comm.all_reduce(flat, g, f"{what}: all-reduce {n} of {len(groups)} ({dtype})",
                                      async_op=True))
        flats.append(flat)
    for w in works:
        comm.wait(w, g, what)
    out: list[Any] = [None] * len(tensors)
    for flat, ((_, dtype), idx) in zip(flats, groups.items()):
        if mean and not _prescaled(dtype):
            flat = flat / g.size
        for i, part in zip(idx, torch.split(flat, [tensors[i].numel() for i in idx])):
            out[i] = part.view(tensors[i].shape)
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            value = out[i].item()
            out[i] = float(value) if mean or isinstance(x, float) else int(value)
    return _tree.unflatten(treedef, out)
