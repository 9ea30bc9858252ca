"""What a checkpoint holds, leaf by leaf, for ``fdp.save`` and ``fdp.save_sharded`` alike.

A train state's leaves are tensors or plain values (``PLAIN``); a leaf's content is checked
by its CRC32 (``crc32``). The state types a checkpoint meets say what they are instead of
being known here: ``__fdp_unsaveable__`` (one rank's part that must not be saved as it is:
a sharded ``FusedState``), ``__fdp_per_rank__`` (a row per rank, tied to the world size:
``RngState``), ``__fdp_check_load__`` (whether a loaded state fits where it is loaded: a
``FusedState``'s layout).

CRC32 is the zip format's own check; like every CRC of degree n it detects each burst error
of up to n bits (Peterson and Brown, "Cyclic codes for error detection", Proc. IRE, 1961).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from .. import _tree
from .._errors import CheckpointError

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
    """Raise if a state in ``tree`` says it must not be saved as it is (``__fdp_unsaveable__``:
    a sharded ``FusedState`` holds one rank's slices)."""
    for p, node in _tree.nodes_with(tree, "__fdp_unsaveable__"):
        reason = node.__fdp_unsaveable__()
        if reason:
            raise CheckpointError(f"{who}: {p} cannot be saved as it is: {reason}")


def per_rank_paths(tree: Any) -> list[str]:
    """Paths of the leaves under a per-rank state (``__fdp_per_rank__``: an ``RngState``, one
    row per rank), which tie a checkpoint to its world size."""
    return [p + q for p, node in _tree.nodes_with(tree, "__fdp_per_rank__")
            for q in _tree.paths(_tree.structure(node)) if q != "<root>"]


def check_loaded(loaded: Any, like: Any, where: str) -> None:
    """States that know their layout (a fused optimizer state) say whether they fit ``like``'s."""
    for (p, got), (_, want) in zip(_tree.nodes_with(loaded, "__fdp_check_load__"),
                                   _tree.nodes_with(like, "__fdp_check_load__")):
        problem = got.__fdp_check_load__(want)
        if problem:
            raise CheckpointError(f"{where}: {p}: {problem}")
