"""``TensorMarks``: a set of tensors kept by identity and held weakly.

fdp marks some tensors it hands out so that ``fdp.save`` / ``fdp.load`` can treat them
specially: per-rank RNG states (``_rng.py``) and the slices of a sharded optimizer state
(``_shard.py``). A ``WeakSet`` would compare tensors with ``==`` (elementwise), so the marks
are kept by ``id`` in a ``WeakValueDictionary``, which also drops a mark when its tensor dies.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["TensorMarks"]


class TensorMarks:
    """Tensors marked by identity (held weakly)."""

    __slots__ = ("_by_id",)

    def __init__(self) -> None:
        self._by_id: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        """Mark ``t``; returns ``t``."""
        self._by_id[id(t)] = t
        return t

    def __contains__(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self._by_id.get(id(t)) is t
