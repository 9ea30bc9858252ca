"""What a checkpoint holds, leaf by leaf, for ``fdp.save`` and ``fdp.save_sharded`` alike.

A train state's leaves are tensors or plain values (``PLAIN``); a leaf's content is checked
by its CRC32 (``crc32``). The state types a checkpoint meets say what they are instead of
being known here, through the protocols of ``fdp._protocols``: ``Unsaveable`` (one rank's
part that must not be saved as it is: a sharded ``FusedState``, ``ShardedParams``),
``PerRank`` (a row per rank, tied to the world size: ``RngState``), ``ChecksLoad`` (whether
a loaded state fits where it is loaded: a ``FusedState``'s layout).

CRC32 is the zip format's own check; like every CRC of degree n it detects each burst error
of up to n bits (Peterson and Brown, "Cyclic codes for error detection", Proc. IRE, 1961).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from .. import _tree
from .._errors import CheckpointError
from .._protocols import ChecksLoad, PerRank, Unsaveable
from .._shard import Shard

__all__ = ["PLAIN", "check_loaded", "crc32", "per_rank_paths", "refuse_unsaveable", "tensor_bytes"]

# Plain values a checkpoint may hold besides tensors (they load under weights_only=True and
# are JSON values). None is not a leaf: optree treats it as an empty subtree, so it
# round-trips as structure.
PLAIN = (bool, int, float, str)


def tensor_bytes(t: torch.Tensor) -> Any:
    """A CPU tensor's bytes in row-major order, as a buffer (no copy when ``t`` is contiguous)."""
    data = t.detach().reshape(-1)
    if not data.numel():
        return memoryview(b"")
    return data.contiguous().view(torch.uint8).numpy()


def crc32(value: Any) -> int:
    """CRC32 of a tensor's bytes (row-major), or of a plain value's type and repr."""
    if isinstance(value, torch.Tensor):
        return zlib.crc32(tensor_bytes(value))
    return zlib.crc32(f"{type(value).__name__}:{value!r}".encode())


def refuse_unsaveable(tree: Any, who: str) -> None:
    """Raise if a state in ``tree`` says it must not be saved as it is (``fdp._protocols.Unsaveable``:
    a sharded ``FusedState`` holds one rank's slices)."""
    for p, node in _tree.nodes_with(tree, Unsaveable):
        reason = node.unsaveable_reason()
        if reason:
            raise CheckpointError(f"{who}: {p} cannot be saved as it is: {reason}")


def refuse_meta(paths: list[str], leaves: list[Any], who: str) -> None:
    """A ``like`` leaf on the meta device would load as a tensor without data: refused, naming
    it (loaded tensors are placed on ``like``'s devices)."""
    for p, leaf in zip(paths, leaves):
        t = leaf.data if isinstance(leaf, Shard) else leaf
        if isinstance(t, torch.Tensor) and t.is_meta:
            raise CheckpointError(
                f"{who}: like{p} is on the meta device, where a loaded tensor would hold no data (loaded "
                "tensors go to like's devices); give like on the device to load to: for fully sharded params "
                "step.param_shards(), for a model built on meta its params after step.shard or materialize")


def per_rank_paths(tree: Any) -> list[str]:
    """Paths of the leaves under a per-rank state (``fdp._protocols.PerRank``: an ``RngState``, one
    row per rank), which tie a checkpoint to its world size."""
    return [p + q for p, node in _tree.nodes_with(tree, PerRank) if node.per_rank()
            for q in _tree.paths(_tree.structure(node)) if q != "<root>"]


def check_loaded(loaded: Any, like: Any, where: str) -> None:
    """States that know their layout (a fused optimizer state) say whether they fit ``like``'s."""
    for (p, got), (_, want) in zip(_tree.nodes_with(loaded, ChecksLoad), _tree.nodes_with(like, ChecksLoad)):
        problem = got.check_load(want)
        if problem:
            raise CheckpointError(f"{where}: {p}: {problem}")
