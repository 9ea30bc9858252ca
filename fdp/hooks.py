"""Communication hooks: what a Reducer does with each filled bucket.

A hook is called once per bucket per step as ``hook(bucket, flat, group)`` and returns a
``torch.futures.Future`` whose value is the reduced flat tensor (same numel). ``bucket`` is
the ``fdp.Bucket`` (index, paths, shapes, ``last``), ``flat`` the filled 1-D buffer and
``group`` the ``fdp.Group``. By default fdp fills the buffer already multiplied by
1/world_size (fused into the copy, as DDP does), so a hook only has to *sum*. The tensor a
hook returns is handed to the caller as the gradient, so it must not be one the hook
reuses later.

Wrap a function in ``CommHook`` to declare a different wire dtype (the dtype buckets are
filled in: the cast is fused into the copy too) or to receive unscaled gradients
(``prescale=False``; the hook must then divide).

Built-ins: ``allreduce`` (the default), ``fp16_compress``, ``bf16_compress``, ``noop`` and
``powersgd(...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._bucket import Bucket
from ._group import Group

HookFn = Callable[[Bucket, torch.Tensor, Group], torch.futures.Future]

__all__ = ["CommHook", "allreduce", "bf16_compress", "fp16_compress", "noop", "powersgd"]


class CommHook:
    """A comm hook function plus what the Reducer needs to know about it.

    Args:
      fn: ``fn(bucket, flat, group) -> Future[Tensor]``.
      dtype: the wire dtype buckets are filled in (``None``: the gradients' own dtype, or the
        Reducer's ``reduce_dtype``). The result is cast back to the gradients' dtype.
      prescale: if True (default) the buffer arrives multiplied by 1/world_size.
      name: for error messages and logs.
    """

    def __init__(self, fn: HookFn, *, dtype: torch.dtype | None = None, prescale: bool = True, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"fdp: a comm hook must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.dtype = dtype
        self.prescale = prescale
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, bucket: Bucket, flat: torch.Tensor, group: Group) -> torch.futures.Future:
        return self.fn(bucket, flat, group)

    def __repr__(self) -> str:
        return f"fdp.hooks.CommHook({self.name}, dtype={self.dtype}, prescale={self.prescale})"


def as_hook(hook: CommHook | HookFn | None) -> CommHook:
    if hook is None:
        return allreduce
    if isinstance(hook, CommHook):
        return hook
    return CommHook(hook)


def _sum_all_reduce(bucket: Bucket, flat: torch.Tensor, group: Group) -> torch.futures.Future:
    if group.process_group is None:
        return _completed(flat)
    work = dist.all_reduce(flat, group=group.process_group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def _completed(t: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


def _noop(bucket: Bucket, flat: torch.Tensor, group: Group) -> torch.futures.Future:
    return _completed(flat)


allreduce = CommHook(_sum_all_reduce, name="allreduce")
allreduce.__doc__ = "Sum the prescaled buckets: the mean over ranks (the default)."

fp16_compress = CommHook(_sum_all_reduce, dtype=torch.float16, name="fp16_compress")
"""Fill buckets in fp16 (scale and cast fused, rounded once), sum in fp16, decompress into
the gradients' dtype. Halves the bytes on the wire (DDP's ``fp16_compress_hook``)."""

bf16_compress = CommHook(_sum_all_reduce, dtype=torch.bfloat16, name="bf16_compress")
"""Like ``fp16_compress`` with bfloat16: fp32's range, 8 bits of mantissa."""

noop = CommHook(_noop, name="noop")
"""No communication: each rank keeps its own (1/world-scaled) gradients. For measuring
what communication costs; never for training."""


class _GradBucketView:
    """The slice of DDP's ``GradBucket`` interface that torch's PowerSGD hook reads."""

    def __init__(self, bucket: Bucket, flat: torch.Tensor):
        self._bucket, self._flat = bucket, flat

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._flat

    def is_last(self) -> bool:
        return self._bucket.last

    def gradients(self) -> list[torch.Tensor]:
        b = self._bucket
        return [self._flat[o : o + n].view(s) for o, n, s in zip(b.offsets, b.numels, b.shapes)]

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._flat.copy_(tensor)


def powersgd(
    rank: int = 1,
    *,
    start_iter: int = 1000,
    error_feedback: bool = True,
    warm_start: bool = True,
    min_compression_rate: float = 2,
    orthogonalization_epsilon: float = 0,
    random_seed: int = 0,
    batch_tensors_with_same_shape: bool = False,
) -> CommHook:
    """PowerSGD low-rank gradient compression (Vogels et al., 2019), via torch's own hook.

    Runs ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` on each
    bucket with the same state semantics as DDP (plain all-reduce for the first
    ``start_iter`` steps; error feedback; warm start), so results equal DDP's with that hook.
    Unlike DDP, ``start_iter`` may be 0 or 1 even with error feedback: fdp's buckets never
    change after construction (DDP forbids it because it rebuilds buckets after step 1).

    The returned hook is stateful (errors, warm-start matrices): use one per Reducer.
    ``hook.state`` is the underlying ``PowerSGDState`` once the first step has run.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if rank < 1:
        raise ValueError(f"fdp.hooks.powersgd: rank must be >= 1, got {rank}")
    if start_iter < 0:
        raise ValueError(f"fdp.hooks.powersgd: start_iter must be >= 0, got {start_iter}")

    holder: dict[str, Any] = {}

    def _powersgd(bucket: Bucket, flat: torch.Tensor, group: Group) -> torch.futures.Future:
        if group.process_group is None:
            return _completed(flat)
        state = holder.get("state")
        if state is None:
            state = psgd.PowerSGDState(
                process_group=group.process_group,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=max(start_iter, 2),
                min_compression_rate=min_compression_rate,
                use_error_feedback=error_feedback,
                warm_start=warm_start,
                orthogonalization_epsilon=orthogonalization_epsilon,
                random_seed=random_seed,
                batch_tensors_with_same_shape=batch_tensors_with_same_shape,
            )
            state.start_powerSGD_iter = start_iter  # no bucket rebuild in fdp: 0 and 1 are safe
            holder["state"] = state
            hook.state = state
        return psgd.powerSGD_hook(state, _GradBucketView(bucket, flat))

    hook = CommHook(_powersgd, prescale=False, name=f"powersgd(rank={rank})")
    hook.state = None
    return hook
