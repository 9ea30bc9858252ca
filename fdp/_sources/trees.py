"""Trees of a model built on the meta device, and whole trees read from a ``ParamSource``.

A model built under ``torch.device("meta")`` has leaves with shapes and dtypes and no data.
A Reducer lays such params out on its group's device (``on_device``: zero-strided
templates, no memory); a source then gives the values, unit by unit to a fully sharded step
(``fdp._fused.params.SliceSets``) or whole, one module's leaves at a time, to anything else
(``whole_tree``).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _tree
from .._protocols import ParamSource
from .._shard import Shard

__all__ = ["default_device", "name_of", "on_device", "whole_tree"]


def default_device() -> torch.device:
    """The current CUDA device if there is one, else the CPU (``fdp.Group``'s default)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def name_of(key: Any) -> str:
    """A leaf's key as a module-style name: ``"h.0.weight"`` for a flat dict's key, the
    segments joined by dots for a nested tree's key tuple."""
    return key if isinstance(key, str) else ".".join(map(str, key))


def on_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with each leaf replaced by a template on ``device`` (a zero expanded to its
    shape: no memory) when every tensor leaf is on the meta device (a model built there);
    ``tree`` itself otherwise (some leaves on meta and others not: the plan refuses the mix)."""
    leaves, treedef = _tree.flatten(tree)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not tensors or not all(t.is_meta for t in tensors):
        return tree
    return _tree.unflatten(treedef, [
        torch.zeros((), dtype=t.dtype, device=device).expand(t.shape) if isinstance(t, torch.Tensor) else t
        for t in leaves])


def whole_tree(source: ParamSource, tree: Any, device: torch.device | str | None, what: str) -> Any:
    """Every leaf of ``tree`` (its keys, shapes and dtypes: meta tensors will do) read whole
    from ``source`` onto ``device`` (default: the tree's device, or ``default_device()`` for
    meta leaves)."""
    leaves, treedef = _tree.flatten(tree)
    keys = _tree.keys(treedef)
    out = []
    for key, t in zip(keys, leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name_of(key)!r} is a {type(t).__name__}, not a tensor")
        dev = torch.device(device) if device is not None else (default_device() if t.is_meta else t.device)
        got = source.read([(key, tuple(t.shape), t.dtype)], [(0, t.numel())], dev)[0]
        out.append(got.to_tensor() if isinstance(got, Shard) else got)
    return _tree.unflatten(treedef, out)
