"""Communication hooks: what a Reducer does with each filled bucket.

A hook is called once per bucket per step as ``hook(bucket, flat, group)`` and returns a
``torch.futures.Future`` whose value is the reduced flat tensor (same numel). ``bucket`` is
the ``fdp.Bucket`` (index, paths, shapes, ``last``), ``flat`` the filled 1-D buffer and
``group`` the ``fdp.Group``. By default fdp fills the buffer already multiplied by
1/world_size (fused into the copy, as DDP does), so a hook only has to *sum*. The tensor a
hook returns is handed to the caller as the gradient, so it must not be one the hook
reuses later.

A hook declares what it can do by being wrapped in ``CommHook``; the Reducer asks these
capabilities and never compares a hook's identity (every hook, the default included, runs
its own body on the same road):

* ``dtype``: the wire dtype buckets are filled in (the cast is fused into the copy);
* ``prescale``: whether the buffer arrives multiplied by 1/world_size;
* ``in_place``: the function sums ``flat`` over the group *in place* with an elementwise
  SUM and returns a work handle (``wait(timeout)``, ``is_completed()``). The step then waits
  with the group's timeout, polls completion for the timeline, and hands out ``flat`` itself
  (no copy). Calling such a hook directly still returns a Future, like any other hook;
* ``traced``: a function ``(flat, group) -> Tensor`` that does the same reduction with
  traceable collectives, used under ``torch.compile``; hooks without one are refused there;
* ``bind``: a function ``(reducer, plan)`` each Reducer calls with itself and its bucket plan
  (again when ``bucket_cap_mb="auto"`` freezes a new plan): a hook that keeps state per
  bucket (PowerSGD) ties it to that plan there, or refuses a second Reducer.

Built-ins: ``allreduce`` (the default), ``fp16_compress``, ``bf16_compress``, ``noop`` and
``powersgd(...)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import _internals
from ._comm import collectives as comm
from ._comm.group import Group
from ._comm.traced import traced_all_reduce
from ._plan.bucket import Bucket

HookFn = Callable[[Bucket, torch.Tensor, Group], Any]
TracedFn = Callable[[torch.Tensor, Group], torch.Tensor]

__all__ = ["CommHook", "allreduce", "bf16_compress", "fp16_compress", "noop", "powersgd"]


class CommHook:
    """A comm hook function plus the capabilities it declares.

    Args:
      fn: ``fn(bucket, flat, group) -> Future[Tensor]``; with ``in_place=True``,
        ``fn(bucket, flat, group) -> work`` that sums ``flat`` over the group in place.
      dtype: the wire dtype buckets are filled in (``None``: the gradients' own dtype, or the
        Reducer's ``reduce_dtype``). The result is cast back to the gradients' dtype.
      prescale: if True (default) the buffer arrives multiplied by 1/world_size.
      name: for error messages and logs.
      in_place: ``fn`` reduces ``flat`` in place with an elementwise SUM and returns a work
        handle with ``wait(timeout)`` and ``is_completed()`` (a c10d ``Work``).
      traced: ``traced(flat, group) -> Tensor``, the same reduction built from traceable
        collectives (``torch.distributed._functional_collectives``), for ``torch.compile``.
      bind: ``bind(reducer, plan)``, called by every Reducer that uses the hook, once it has
        checked its plan across ranks, and again with the new plan when ``bucket_cap_mb="auto"``
        freezes one; may raise (a stateful hook that already serves another Reducer).

    A plain callable passed as ``comm_hook=`` is wrapped as ``CommHook(fn)``. A hook whose
    function returns something other than a Future, or a Future of anything but a floating
    tensor of the bucket's size, makes the step raise ``TypeError`` naming the hook and the
    bucket.

    Raises:
      TypeError: ``fn`` or ``traced`` is not callable.

    Example:
      >>> sizes = []
      >>> def logging_allreduce(bucket, flat, group):
      ...     sizes.append(bucket.nbytes)
      ...     return fdp.hooks.allreduce(bucket, flat, group)  # then do what the default does
      >>> params = {"w": torch.ones(4)}
      >>> reducer = fdp.Reducer(params, comm_hook=fdp.hooks.CommHook(logging_allreduce, name="logging"))
      >>> mean = reducer.all_reduce(params)
      >>> sizes  # one call per bucket per step
      [16]
    """

    def __init__(self, fn: HookFn, *, dtype: torch.dtype | None = None, prescale: bool = True,
                 name: str | None = None, in_place: bool = False, traced: TracedFn | None = None,
                 bind: Callable[[Any, Any], None] | None = None):
        if not callable(fn):
            raise TypeError(f"fdp: a comm hook must be callable, got {type(fn).__name__}")
        for arg, value in (("traced", traced), ("bind", bind)):
            if value is not None and not callable(value):
                raise TypeError(f"fdp: CommHook({arg}=...) must be callable, got {type(value).__name__}")
        self.bind = bind
        self.fn = fn
        self.dtype = dtype
        self.prescale = prescale
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.in_place = in_place
        self.traced = traced

    def attach(self, reducer: Any, plan: Any) -> None:
        """Called by a Reducer with itself and its plan (see ``bind``)."""
        if self.bind is not None:
            self.bind(reducer, plan)

    @property
    def traceable(self) -> bool:
        """Whether the hook can run under ``torch.compile`` (it declared ``traced``)."""
        return self.traced is not None

    def __call__(self, bucket: Bucket, flat: torch.Tensor, group: Group) -> torch.futures.Future:
        """Run the hook on one bucket; always returns a Future of the reduced tensor."""
        if not self.in_place:
            return self.fn(bucket, flat, group)
        work = self.fn(bucket, flat, group)
        return work.get_future().then(lambda _: flat)

    def launch(self, bucket: Bucket, flat: torch.Tensor, group: Group) -> Any:
        """Start the reduction of one bucket: a work handle (``in_place``) or a Future."""
        handle = self.fn(bucket, flat, group)
        if not self.in_place and not isinstance(handle, _internals.FUTURE):
            raise TypeError(
                f"fdp: comm hook {self.name} returned {type(handle).__name__} for bucket {bucket.index}; "
                "it must return a torch.futures.Future whose value is the reduced flat tensor"
            )
        return handle

    def collect(self, handle: Any, bucket: Bucket, flat: torch.Tensor, group: Group, what: str) -> torch.Tensor:
        """Wait for ``handle`` (from ``launch``) and return the reduced bucket, 1-D, ``bucket.numel`` long.

        An ``in_place`` hook's result is ``flat`` itself; a Future's value is checked (a floating tensor of the bucket's size) and raises
        ``TypeError`` naming the hook and the bucket otherwise.
        """
        if self.in_place:
            comm.wait(handle, group, what)
            return flat
        value = comm.wait_future(handle, group, f"{what} (comm hook {self.name})")
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != bucket.numel or not value.is_floating_point():
            got = (f"a {type(value).__name__}" if not isinstance(value, torch.Tensor)
                   else f"a {value.dtype} tensor of shape {tuple(value.shape)}")
            raise TypeError(
                f"fdp: comm hook {self.name} returned {got} for bucket {bucket.index}; expected a floating "
                f"tensor of {bucket.numel} elements (the reduced bucket)"
            )
        return value.reshape(-1)

    def check_config(self, reduce_dtype: torch.dtype | None, shard: bool | str, what: str) -> None:
        """Raise if a Reducer's ``reduce_dtype`` or ``shard`` (True, ``"state"`` or ``"params"``) cannot go with this hook:
        ``ValueError`` for a non-floating ``reduce_dtype`` or one other than the hook's wire
        dtype; ``TypeError`` for sharding with a hook that is not a sum in place (sharding
        reduce-scatters the buckets in the hook's wire dtype instead of calling it)."""
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
            raise ValueError(f"{what}: reduce_dtype must be a floating dtype, got {reduce_dtype}")
        if reduce_dtype is not None and self.dtype is not None and reduce_dtype != self.dtype:
            raise ValueError(f"{what}: reduce_dtype={reduce_dtype} conflicts with comm hook {self.name}, "
                             f"which reduces in {self.dtype}")
        if shard and not self.in_place:
            raise TypeError(f"{what}: shard={shard!r} reduce-scatters buckets in the comm hook's wire dtype, which "
                            f"needs a summing hook (allreduce, fp16_compress, bf16_compress, or "
                            f"CommHook(in_place=True)); {self.name} is not one")

    def describe(self) -> str:
        """What ranks must agree on: name, wire dtype, prescale (checked at Reducer construction)."""
        wire = "the gradients' dtype" if self.dtype is None else str(self.dtype).replace("torch.", "")
        return f"comm hook {self.name} (wire {wire}, prescale={self.prescale})"

    def __repr__(self) -> str:
        return (f"fdp.hooks.CommHook({self.name}, dtype={self.dtype}, prescale={self.prescale}, "
                f"in_place={self.in_place}, traceable={self.traceable})")


def as_hook(hook: CommHook | HookFn | None) -> CommHook:
    """The ``CommHook`` for a ``comm_hook=`` argument: the default for None, a plain callable wrapped."""
    if hook is None:
        return allreduce
    if isinstance(hook, CommHook):
        return hook
    return CommHook(hook)


def _sum_in_place(bucket: Bucket, flat: torch.Tensor, group: Group) -> Any:
    return comm.all_reduce(flat, group, f"all-reduce of bucket {bucket.index}", async_op=True)


def _noop(bucket: Bucket, flat: torch.Tensor, group: Group) -> torch.futures.Future:
    return comm.completed(flat)


allreduce = CommHook(_sum_in_place, name="allreduce", in_place=True, traced=traced_all_reduce)
allreduce.__doc__ = "Sum the prescaled buckets: the mean over ranks (the default)."

fp16_compress = CommHook(_sum_in_place, dtype=torch.float16, name="fp16_compress", in_place=True,
                         traced=traced_all_reduce)
fp16_compress.__doc__ = """Fill buckets in fp16 (scale and cast fused, rounded once), sum in fp16, decompress into
the gradients' dtype. Halves the bytes on the wire (DDP's ``fp16_compress_hook``)."""

bf16_compress = CommHook(_sum_in_place, dtype=torch.bfloat16, name="bf16_compress", in_place=True,
                         traced=traced_all_reduce)
bf16_compress.__doc__ = """Like ``fp16_compress`` with bfloat16: fp32's range, 8 bits of mantissa.

DDP's ``bf16_compress_hook``, which fdp also allows on gloo and the CPU.

Example:
  >>> reducer = fdp.Reducer({"w": torch.zeros(2)}, comm_hook=fdp.hooks.bf16_compress)
  >>> reducer.all_reduce({"w": torch.full((2,), 1 / 3)})["w"]  # rounded to bf16 on the wire, cast back
  tensor([0.3340, 0.3340])
"""

noop = CommHook(_noop, name="noop")
noop.__doc__ = """No communication: each rank keeps its own (1/world-scaled) gradients. For measuring
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

    The returned hook is stateful (errors, warm-start matrices, kept per bucket index): it
    belongs to one Reducer, whose ``grad``, ``all_reduce`` and fused steps share it as steps
    of one model. A second Reducer built with it raises ``ValueError`` (one's compression
    error would be added to the other's leaves): make one hook per Reducer. When
    ``bucket_cap_mb="auto"`` freezes its plan, the hook starts afresh on the new buckets, as
    a new hook given to a Reducer built with the frozen caps would (``start_iter`` counts
    from the freeze). ``hook.state`` is the underlying ``PowerSGDState`` once the first step
    has run. The arguments are ``PowerSGDState``'s (``rank`` is its
    ``matrix_approximation_rank``, ``start_iter`` its ``start_powerSGD_iter``). It divides by
    the world size itself (``prescale=False``). In a world of one it does nothing.

    Once compressing, torch's hook issues each bucket's second and third all-reduce from the
    callbacks of its first, on the backend's threads; two buckets in flight at once would then
    issue theirs in an order that differs between ranks (gloo aborts the process, DDP's hook
    does the same). fdp starts a bucket's exchange only once the previous bucket's has ended,
    so every rank issues the same sequence (the backward waits for it there).

    Raises:
      ValueError: ``rank < 1`` or ``start_iter < 0``; a second Reducer built with the hook.

    Example:
      >>> hook = fdp.hooks.powersgd(rank=2, start_iter=10)
      >>> hook.name, hook.prescale, hook.state
      ('powersgd(rank=2)', False, None)
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if rank < 1:
        raise ValueError(f"fdp.hooks.powersgd: rank must be >= 1, got {rank}")
    if start_iter < 0:
        raise ValueError(f"fdp.hooks.powersgd: start_iter must be >= 0, got {start_iter}")

    holder: dict[str, Any] = {}
    name = f"powersgd(rank={rank})"

    def _bind(reducer: Any, plan: Any) -> None:
        owner = holder.get("owner")
        current = owner() if owner is not None else None
        if current is not None and current is not reducer:
            raise ValueError(
                f"fdp.hooks.{name}: this hook already serves another fdp.Reducer. Its state (error "
                "feedback and warm-start matrices) is kept per bucket index of that Reducer's plan, so a "
                "second Reducer would add one's compression error to the other's leaves; make one hook "
                "per Reducer (call fdp.hooks.powersgd(...) again)")
        if current is None or holder.get("plan") != plan.fingerprint:  # a new owner, or its frozen plan
            holder.clear()
            hook.state = None
        holder["owner"], holder["plan"] = weakref.ref(reducer), plan.fingerprint

    def _powersgd(bucket: Bucket, flat: torch.Tensor, group: Group) -> torch.futures.Future:
        if group.process_group is None:
            return comm.completed(flat)
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
        prev = holder.get("pending")
        if prev is not None and not prev.done() and state.iter >= state.start_powerSGD_iter:
            # (compressing: the previous bucket's callbacks may still issue collectives)
            comm.wait_future(prev, group, f"{name}: bucket {bucket.index - 1}'s exchange, before bucket "
                             f"{bucket.index}'s starts")
        fut = holder["pending"] = psgd.powerSGD_hook(state, _GradBucketView(bucket, flat))
        return fut

    hook = CommHook(_powersgd, prescale=False, name=name, bind=_bind)
    hook.state = None
    return hook
