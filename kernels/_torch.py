"""Multi-tensor flatten/unflatten with stock torch ops (every device; the CPU path).

Every op here is a single pass at memory bandwidth where torch offers one:
``torch.cat(out=)`` for a plain flatten, ``torch.mul(out=)`` per leaf for the fused
scale(+cast), ``split_with_sizes_copy(out=)`` for unflatten into existing tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Below this many elements per leaf on average, one launch per leaf costs more than an
# extra pass over the bucket, so scaling is done as cat + one in-place multiply.
_SMALL_LEAF = 16384


def _views(out: torch.Tensor, srcs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    views, o = [], 0
    for t in srcs:
        n = t.numel()
        views.append(out[o : o + n].view(t.shape))
        o += n
    return views


def flatten(srcs: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None) -> torch.Tensor:
    if not srcs:
        return out
    src_dtype = srcs[0].dtype
    contiguous = all(t.is_contiguous() for t in srcs)
    small = contiguous and out.numel() < _SMALL_LEAF * len(srcs)
    if scale is None:  # a copy; a cast rounds once (half -> half goes through fp32 exactly)
        if contiguous:
            torch.cat([t.view(-1) for t in srcs], out=out)
        else:
            for v, t in zip(_views(out, srcs), srcs):
                v.copy_(t)
        return out
    compute = torch.promote_types(torch.promote_types(src_dtype, out.dtype), torch.float32)
    if compute == out.dtype:
        # Widening or same dtype: the copy into `out` is exact, then one multiply in place.
        if small or out.dtype != src_dtype:
            flatten(srcs, out, None)
            out.mul_(scale)
        else:
            for v, t in zip(_views(out, srcs), srcs):
                torch.mul(t, scale, out=v)
    elif compute == src_dtype or src_dtype == out.dtype:
        # Narrowing (e.g. fp32 -> bf16): multiply in the source dtype, round once on the store.
        # Same 16-bit dtype: torch multiplies halves in fp32 ("opmath") and rounds once.
        if small:
            torch.mul(torch.cat([t.view(-1) for t in srcs]), scale, out=out)
        else:
            for v, t in zip(_views(out, srcs), srcs):
                torch.mul(t, scale, out=v)
    else:
        # Between two 16-bit types: multiply in fp32, round once to `out`.
        for v, t in zip(_views(out, srcs), srcs):
            torch.mul(t.to(compute), scale, out=v)
    return out


def unflatten(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    if not outs:
        return
    if all(o.dtype == flat.dtype and o.is_contiguous() for o in outs):
        torch.split_with_sizes_copy(flat, [o.numel() for o in outs], out=[o.view(-1) for o in outs])
        return
    o = 0
    for t in outs:
        n = t.numel()
        t.copy_(flat[o : o + n].view(t.shape))
        o += n
