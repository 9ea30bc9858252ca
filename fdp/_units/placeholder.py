"""``Placeholder``: what stands in a unit's param's place in the module while the unit is not
gathered (fully sharded params)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _internals

__all__ = ["Placeholder"]


# What code may ask of a unit's param outside its module's forward: its metadata.
_METADATA = frozenset({"shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "size", "dim",
                       "numel", "nelement", "is_floating_point", "is_complex", "element_size", "stride",
                       "is_contiguous", "names", "grad_fn", "__len__"})


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property's getter: the property's name
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class Placeholder(torch.Tensor):
    """What stands in a unit's param's place in the module while the unit is not gathered: a
    tensor with the param's shape and dtype and no memory (meta), whose metadata may be read
    but which raises on any computation, naming the param and its unit (a meta tensor alone
    would not: ``cpu_tensor @ meta_tensor`` returns a CPU tensor of garbage)."""

    what: str

    @staticmethod
    def make(shape: Sequence[int], dtype: torch.dtype, what: str) -> Placeholder:
        t = _internals.make_subclass(Placeholder, torch.empty(shape, dtype=dtype, device="meta"))
        t.what = what
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _name(func) in _METADATA:
            with _internals.torch_function_subclass_disabled():
                return func(*args, **(kwargs or {}))
        what = next((a.what for a in (*args, *(kwargs or {}).values()) if isinstance(a, Placeholder)), "a param")
        raise RuntimeError(
            f"fdp: {what} was used outside its unit's forward; with shard='params' a unit's params are gathered "
            "only while its module runs. Use it inside that module, read it through the params the step "
            "passes to the loss (params[key] gathers its unit for the step), or leave it out of units (the "
            "root is gathered for the whole step)")

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return f"fdp.Placeholder({self.what}, shape={tuple(self.shape)})"
