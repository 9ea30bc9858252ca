"""``Reducer.all_reduce`` inside ``torch.compile``: the same buckets, as graph nodes.

Each bucket becomes ``cat -> scale/cast -> all_reduce -> wait`` nodes of the graph (through
the comm hook's declared traced form, ``CommHook.traced``), so Inductor sees the
communication and can overlap it with compute (docs/compile.md). The Python bookkeeping of
the eager path (timeline, step status, debug fingerprints) is not traced.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _tree
from .._comm.group import Group
from .._plan.bucket import BucketPlan
from ..hooks import CommHook


def traced_all_reduce(grads: Any, plan: BucketPlan, hook: CommHook, wire: list[torch.dtype], group: Group,
                      active: bool | None) -> Any:
    """The mean of ``grads`` over ``group``, traceable; ``wire`` is each bucket's wire dtype."""
    if active is not None:
        raise RuntimeError("fdp.Reducer.all_reduce(active=...) counts active ranks with a "
                           "data-dependent collective; it is not supported under torch.compile")
    if not hook.traceable:
        raise RuntimeError(f"fdp.Reducer: comm hook {hook.name} is not traceable (it declares "
                           "no CommHook(traced=...)); under torch.compile use allreduce, bf16_compress, "
                           "fp16_compress or a hook that declares one")
    leaves = plan.leaves_of(grads, "all_reduce grads")
    treedef = _tree.structure(grads)
    scale = 1.0 / group.size if hook.prescale and group.size > 1 else None
    outs = [hook.traced(traced_fill([leaves[i] for i in b.leaves], b.dtype, dtype, scale), group).to(b.dtype)
            for b, dtype in zip(plan.buckets, wire)]
    return plan.views(outs, treedef)


def traced_fill(grads: list[torch.Tensor], dtype: torch.dtype, wire: torch.dtype, scale: float | None) -> torch.Tensor:
    """A bucket's flat gradient on the wire, traceable: its leaves' gradients concatenated
    (``dtype``: the bucket's), multiplied by ``scale`` in the wide dtype and rounded once to
    ``wire``, as ``kernels.flatten`` fills it in eager mode."""
    if scale is None:
        return torch.cat([g.reshape(-1).to(wire) for g in grads])
    # multiplied in the wide dtype and rounded once (as kernels.flatten), leaf by leaf: the
    # compiler then writes each product straight into its place in the bucket (one flat
    # buffer, not the concatenation and its scaled copy)
    wide = torch.promote_types(torch.promote_types(dtype, wire), torch.float32)
    return torch.cat([(g.reshape(-1).to(wide) * scale).to(wire) for g in grads])
