"""``Reducer``: bucketed, asynchronous gradient averaging that overlaps the backward.

How a ``reducer.grad`` step runs (DDP's Reducer, for ``torch.func``):

1. The wrapped function registers a hook on every differentiated leaf, then the user's
   function runs under ``torch.func.grad``.
2. During the backward, each leaf's hook receives its gradient (in reverse registration
   order, interleaved with the compute of earlier layers) and stashes it. When a bucket's
   last leaf arrives, the bucket is filled in one multi-tensor copy with the 1/world scale
   (and any cast) fused in, and its all-reduce is launched asynchronously: strictly in
   bucket order, so every rank issues the same collectives in the same order.
3. When the backward returns, buckets that are not yet launched (those holding unused
   parameters, whose hooks never fire) are filled with zeros for the missing leaves and
   launched in order; then the step waits for every bucket and returns the averaged
   gradients.

Memory: the hook hands autograd an expanded zero in place of each large gradient, so the
gradient itself lives only until its bucket is filled; the reduced buckets then *become*
the returned gradients (views into them, no copy). Peak memory is one set of buckets plus
the gradients the caller still holds, as with DDP's ``.grad`` plus buckets. With
``grad_views=True`` the buckets are reused every step and the returned gradients are views
into them (DDP's ``gradient_as_bucket_view``): no per-step allocation at all, valid until
the next call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _comm, _functorch, _sync, _tree, kernels
from . import hooks as _hooks
from ._bucket import BucketPlan, _itemsize
from ._group import Group, resolve
from ._log import debug_mode, log

# Gradients smaller than this are left to autograd: replacing them costs more than it saves.
_RELEASE_BYTES = 64 * 1024
# A hook costs a few microseconds per leaf per step. A bucket whose leaves average less than
# this many bytes gains less from an early launch than its hooks cost (thousands of biases,
# say); trailing buckets like that are not hooked, and launch when the backward returns.
_HOOK_MEAN_BYTES = 16 * 1024


@dataclass
class BucketTimes:
    """One bucket's life in a step, in seconds since the step started."""

    index: int
    nbytes: int
    ready: float | None = None  # its last gradient arrived
    launch: float | None = None  # its collective was issued
    # When fdp first saw its collective complete: looked at on every later bucket launch,
    # when the backward returns, and as each wait returns, so at most the gap between two
    # of those after the true completion (no callback: a Python callback on the
    # communication thread contends for the GIL with the backward, measured at several ms
    # per step).
    done: float | None = None


@dataclass
class Timeline:
    """What happened when in one step (seconds since the call started).

    ``backward_start``/``backward_end`` are None for ``all_reduce`` steps (no backward).
    ``exposed_comm`` is the communication not hidden behind the backward: the time from the
    backward's end (or the launch of the first bucket, for ``all_reduce``) to the last
    bucket's completion.
    """

    step: int
    kind: str
    backward_start: float | None
    backward_end: float | None
    end: float
    buckets: list[BucketTimes] = field(default_factory=list)

    @property
    def comm_done(self) -> float:
        return max((b.done or 0.0) for b in self.buckets) if self.buckets else 0.0

    @property
    def exposed_comm(self) -> float:
        start = self.backward_end
        if start is None:
            start = min((b.launch or 0.0) for b in self.buckets) if self.buckets else 0.0
        return max(0.0, self.comm_done - start)


class _Step:
    """Per-step bookkeeping (one per call; nothing survives the step)."""

    __slots__ = ("n", "kind", "pending", "stash", "got", "next", "flats", "handles", "in_flight", "acc",
                 "scale", "active", "t0", "times", "bwd_start", "bwd_end")

    def __init__(self, reducer: Reducer, kind: str, acc: list[torch.Tensor] | None, scale: float | None, active: bool):
        plan = reducer.plan
        self.n = reducer._steps
        self.kind = kind
        self.pending = [len(b.leaves) for b in plan.buckets]
        self.stash: list[torch.Tensor | None] = [None] * len(plan.slots)
        self.got = bytearray(len(plan.slots))
        self.next = 0
        self.flats: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self.handles: list[Any] = [None] * len(plan.buckets)
        self.in_flight: list[int] = []  # launched buckets not yet seen complete
        self.acc = acc
        self.scale = scale
        self.active = active
        self.t0 = time.perf_counter()
        self.times = [BucketTimes(b.index, b.nbytes) for b in plan.buckets]
        self.bwd_start: float | None = None
        self.bwd_end: float | None = None


class Pending:
    """Handle of an ``all_reduce_async``: ``wait()`` returns the averaged tree."""

    def __init__(self, reducer: Reducer, step: _Step):
        self._reducer, self._step, self._result = reducer, step, None

    def wait(self) -> Any:
        if self._step is not None:
            step, self._step = self._step, None
            self._result = self._reducer._finish(step)
        return self._result


class Reducer:
    """Averages gradient pytrees over a group in size-capped buckets, overlapping the backward.

    Args:
      params: the pytree being differentiated (e.g. ``params`` from ``fdp.functionalize``);
        only its layout is used. Floating-point leaves on one device.
      group: an ``fdp.Group``, a ProcessGroup, a 1-D DeviceMesh, or None for the world (a
        world of one without torch.distributed).
      bucket_cap_mb, first_bucket_cap_mb, bucket_caps_mb: bucket sizes in MiB, as
        ``fdp.BucketPlan.build`` (DDP's defaults: 25 and a 1 MiB first bucket).
      reduce_dtype: dtype the buckets are filled and reduced in (default: the gradients').
      comm_hook: an ``fdp.hooks`` hook or a callable ``(bucket, flat, group) -> Future``.
      grad_views: return views into buffers reused every step (no allocation; valid until the
        next call) instead of fresh tensors.
      overlap: launch all-reduces from hooks during the backward (default). ``False`` runs
        ``torch.func.grad`` to completion first, then reduces (the fallback path).
      skip_nonfinite: after each reduction, check the averaged gradients for inf/NaN (one
        fused pass, AMP's found_inf check). The verdict is the same on every rank (they all
        hold the same reduced values), so ``if reducer.finite: params, state = opt.update(...)``
        skips a bad step on all ranks together; ``reducer.nonfinite_steps`` counts them.
      debug: before each bucket collective, check that all ranks issue the same one (costs a
        small collective per bucket). Default: the ``FDP_DEBUG`` environment variable.

    The construction is a collective: every rank checks that all ranks built the same bucket
    plan (same leaves, shapes, dtypes and caps), and raises ``fdp.ReplicaMismatchError``
    naming the first differing leaf and the ranks otherwise.
    """

    def __init__(
        self,
        params: Any,
        group: Group | Any = None,
        *,
        bucket_cap_mb: float = 25,
        first_bucket_cap_mb: float = 1,
        bucket_caps_mb: Sequence[float] | None = None,
        reduce_dtype: torch.dtype | None = None,
        comm_hook: _hooks.CommHook | Callable | None = None,
        grad_views: bool = False,
        overlap: bool = True,
        debug: bool | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        self.group = resolve(group)
        self.plan = BucketPlan.build(
            params, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
            bucket_caps_mb=bucket_caps_mb,
        )
        devices = {s.device for s in self.plan.slots}
        if len(devices) > 1:
            first = {}
            for s in self.plan.slots:
                first.setdefault(s.device, s.path)
            shown = ", ".join(f"{p} on {d}" for d, p in first.items())
            raise ValueError(f"fdp.Reducer: params must live on one device, found several: {shown}")
        self.hook = _hooks.as_hook(comm_hook)
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"fdp.Reducer: reduce_dtype must be a floating dtype, got {reduce_dtype}")
        if reduce_dtype is not None and self.hook.dtype is not None and reduce_dtype != self.hook.dtype:
            raise ValueError(
                f"fdp.Reducer: reduce_dtype={reduce_dtype} conflicts with comm hook "
                f"{self.hook.name}, which reduces in {self.hook.dtype}"
            )
        wire = self.hook.dtype or reduce_dtype
        self._wire = [wire or b.dtype for b in self.plan.buckets]
        self.grad_views = grad_views
        self.overlap = overlap
        # How local gradients are computed: "auto" (plain autograd, see _grad_step) or
        # "functorch" (torch.func.grad itself; its hooks need the private functorch APIs,
        # without which only the non-overlapped path can use it).
        self.engine = "auto"
        self.debug = debug_mode() if debug is None else debug
        self.skip_nonfinite = skip_nonfinite
        self.finite = True  # verdict of the last step (always True without skip_nonfinite)
        self.nonfinite_steps = 0
        self._sum_work = self.hook.fn is _hooks._sum_all_reduce  # fast path: Work with timed wait
        # Persistent buffers: needed when reusing them (grad_views), or when buckets travel in
        # another dtype than the gradients (the wire buffers are then scratch).
        self._buffers: list[torch.Tensor | None] = [None] * len(self.plan.buckets)
        self._results: list[torch.Tensor | None] = [None] * len(self.plan.buckets)
        self._bucket_of = [s.bucket for s in self.plan.slots]
        self._release = [s.numel * _itemsize(s.dtype) >= _RELEASE_BYTES for s in self.plan.slots]
        # One hook per leaf, for each engine (the functorch one unwraps its gradients), up to
        # the last bucket worth launching early; the leaves after it have no hook (None).
        worth = [i for i, b in enumerate(self.plan.buckets) if b.nbytes >= _HOOK_MEAN_BYTES * len(b.leaves)]
        self._hooked_buckets = worth[-1] + 1 if worth else 0
        self._unhooked = [i for b in self.plan.buckets[self._hooked_buckets:] for i in b.leaves]
        self._hooks = {
            engine: [self._make_hook(i, engine == "functorch") if s.bucket < self._hooked_buckets else None
                     for i, s in enumerate(self.plan.slots)]
            for engine in ("autograd", "functorch")
        }
        self._steps = 0
        self._cur: _Step | None = None
        self._timeline: Timeline | None = None
        _sync.verify_layout(
            [(s.path, s.shape, str(s.dtype).replace("torch.", "")) for s in self.plan.slots],
            self.group, "fdp.Reducer", extra=f"bucket caps {list(self.plan.caps)} bytes",
        )
        if log.isEnabledFor(logging.INFO):
            log.info("Reducer (hook %s, world %d): %s", self.hook.name, self.group.size, self.plan.summary())

    # ------------------------------------------------------------------ public API
    def grad(self, fn: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False, *,
             accumulate: Any = None) -> Callable:
        """Like ``torch.func.grad(fn, argnums, has_aux)``, with gradients averaged over ranks.

        Returns a function with the same call signature and return structure as
        ``torch.func.grad``'s: the gradients, or ``(gradients, aux)``. The all-reduces run
        during the backward. ``accumulate``: a gradient tree (same layout as the params)
        summed into this step's local gradients before they are averaged, e.g. the local
        gradients of earlier micro-batches, so the last micro-batch's reduction still
        overlaps its backward.
        """
        gv = self.grad_and_value(fn, argnums, has_aux, accumulate=accumulate)

        def grad_fn(*args: Any, **kwargs: Any) -> Any:
            grads, value = gv(*args, **kwargs)
            return (grads, value[1]) if has_aux else grads

        return grad_fn

    def grad_and_value(self, fn: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False, *,
                       accumulate: Any = None) -> Callable:
        """Like ``torch.func.grad_and_value``, with gradients averaged over ranks (see ``grad``)."""

        def grad_and_value_fn(*args: Any, **kwargs: Any) -> Any:
            return self._grad_step(fn, argnums, has_aux, accumulate, args, kwargs)

        return grad_and_value_fn

    def all_reduce(self, grads: Any, *, active: bool | None = None) -> Any:
        """Average a gradient tree computed any other way (e.g. a plain ``torch.func.grad``).

        Args:
          grads: a tree with the plan's layout (ignored, may be None, when ``active=False``).
          active: for uneven inputs (DDP's join). ``None`` (default): every rank takes part.
            ``True``/``False`` (all ranks must pass it): a rank with ``active=False``
            contributes zeros and the mean is over the active ranks only (one extra tiny
            all-reduce counts them). Every rank, active or not, receives the mean, so
            applying it keeps the replicas identical.
        """
        if _tree.compiling():
            return self._all_reduce_traced(grads, active)
        return self.all_reduce_async(grads, active=active).wait()

    def _all_reduce_traced(self, grads: Any, active: bool | None) -> Any:
        """``all_reduce`` inside ``torch.compile``: the same buckets, through functional collectives.

        Each bucket becomes ``cat -> scale/cast -> all_reduce -> wait`` nodes of the graph, so
        Inductor sees the communication and can overlap it with compute (see docs). The
        Python bookkeeping of the eager path (timeline, step checks, debug fingerprints) is
        not traced.
        """
        import torch.distributed._functional_collectives as funcol

        if active is not None:
            raise RuntimeError("fdp.Reducer.all_reduce(active=...) counts active ranks with a "
                               "data-dependent collective; it is not supported under torch.compile")
        if not self._sum_work:
            raise RuntimeError(f"fdp.Reducer: comm hook {self.hook.name} is not traceable; under "
                               "torch.compile use allreduce, bf16_compress or fp16_compress")
        if self.skip_nonfinite or self.debug:
            raise RuntimeError("fdp.Reducer: skip_nonfinite and debug read values on the host; "
                               "they are not supported under torch.compile")
        leaves = self.plan.leaves_of(grads, "all_reduce grads")
        treedef = _tree.structure(grads)
        scale = self._scale(1.0 / self.group.size)
        pg = self.group.process_group
        outs = []
        for b, wire in zip(self.plan.buckets, self._wire):
            flat = torch.cat([leaves[i].reshape(-1) for i in b.leaves])
            if scale is not None:  # multiply in the wide dtype, round once (as kernels.flatten)
                compute = torch.promote_types(torch.promote_types(b.dtype, wire), torch.float32)
                flat = flat.to(compute) * scale
            flat = flat.to(wire)
            outs.append(funcol.all_reduce(flat, "sum", pg) if pg is not None else flat)
        outs = [funcol.wait_tensor(o).to(b.dtype) if pg is not None else o.to(b.dtype)
                for o, b in zip(outs, self.plan.buckets)]
        return self.plan.views(outs, treedef)

    def all_reduce_async(self, grads: Any, *, active: bool | None = None) -> Pending:
        """Launch ``all_reduce`` and return a handle whose ``wait()`` returns the mean."""
        self._enter("all_reduce")
        try:
            scale = 1.0 / self.group.size
            is_active = True
            if active is not None:
                n = _comm.count_ranks(bool(active), self.group, "fdp.Reducer.all_reduce: active-rank count")
                if n == 0:
                    raise ValueError("fdp.Reducer.all_reduce: no rank is active; stop the loop when "
                                     "fdp.any_rank(has_data) is False")
                scale, is_active = 1.0 / n, bool(active)
            if is_active:
                leaves = self.plan.leaves_of(grads, "all_reduce grads")
                self.plan._check_devices(leaves, "all_reduce grads")
            step = _Step(self, "all_reduce", None, self._scale(scale), is_active)
            self._cur = step
            if is_active:
                step.stash = list(leaves)
                step.got = bytearray(b"\x01" * len(leaves))
                step.pending = [0] * len(self.plan.buckets)
            self._launch_ready(step, force=True)
            return Pending(self, step)
        except BaseException:
            self._cur = None
            raise

    def last_timeline(self) -> Timeline | None:
        """The timeline of the most recent completed step (``None`` before the first)."""
        return self._timeline

    @property
    def steps(self) -> int:
        """Number of completed steps."""
        return self._steps

    def __repr__(self) -> str:
        return (f"fdp.Reducer({self.plan!r}, group={self.group!r}, hook={self.hook.name}, "
                f"overlap={self.overlap})")

    # ------------------------------------------------------------------ the step
    def _enter(self, what: str) -> None:
        if self._cur is not None:
            raise RuntimeError(
                f"fdp.Reducer: {what} called while step {self._cur.n} ({self._cur.kind}) is still in "
                "flight: a reducer runs one step at a time (was grad_fn called inside the loss "
                "function, from two threads, or an all_reduce_async handle not waited?)"
            )

    def _scale(self, scale: float) -> float | None:
        if not self.hook.prescale or scale == 1.0:
            return None
        return scale

    def _grad_step(self, fn: Callable, argnums: Any, has_aux: bool, accumulate: Any,
                   args: tuple, kwargs: dict) -> Any:
        self._enter("grad")
        if _functorch.in_transform():
            raise RuntimeError("fdp.Reducer.grad cannot run inside another torch.func transform "
                               "(vmap/grad/jvp); call it at the top level of the train step")
        acc = None
        if accumulate is not None:
            acc = self.plan.leaves_of(accumulate, "accumulate")
            self.plan._check_devices(acc, "accumulate")
        diff = _select(args, argnums)
        leaves = self.plan.leaves_of(diff, "reducer.grad params")
        self.plan._check_devices(leaves, "reducer.grad params")
        # At the top level, torch.func.grad computes exactly what autograd.grad on detached
        # leaves computes, but wraps every op of the forward and backward on the way (about
        # 1.7x the time of an MLP step, 2.4x for many small layers), so "auto" runs plain
        # autograd. "functorch" runs torch.func.grad itself, with hooks on its wrapped leaves.
        engine = "autograd" if self.engine == "auto" else self.engine
        if not self.overlap or (engine == "functorch" and not _functorch.AVAILABLE):
            grads, value = self._local(engine, fn, argnums, has_aux, args, kwargs, leaves, None)
            if acc is not None:
                grads = _tree.unflatten(self.plan.treedef, torch._foreach_add(acc, self.plan.leaves_of(grads)))
            return self.all_reduce(grads), value
        step = _Step(self, "grad", acc, self._scale(1.0 / self.group.size), True)
        self._cur = step
        try:
            grads, value = self._local(engine, fn, argnums, has_aux, args, kwargs, leaves, self._hooks[engine])
            step.bwd_end = time.perf_counter()
            if self._unhooked:  # gradients of the leaves without hooks come back from autograd
                for i in self._unhooked:
                    step.stash[i] = grads[i]  # None for an unused leaf: zero-filled at launch
            return self._finish(step), value
        except BaseException:
            self._cur = None
            raise

    def _local(self, engine: str, fn: Callable, argnums: Any, has_aux: bool, args: tuple, kwargs: dict,
               leaves: list[torch.Tensor], hooks: list[Callable] | None) -> tuple[Any, Any]:
        """This rank's gradients and value, as ``torch.func.grad_and_value`` returns them.

        With ``hooks``, each hooked leaf's hook sees its gradient as the backward produces it,
        and the gradients come back as a list in leaf order (None for a leaf the loss does
        not use); only the entries of leaves without a hook are meaningful.
        """
        if engine == "functorch":
            instrumented = self._instrument(fn, argnums, has_aux, hooks)
            grads, value = torch.func.grad_and_value(instrumented, argnums, has_aux)(*args, **kwargs)
            return (grads if hooks is None else _tree.leaves(grads)), value
        inputs = list(map(torch.Tensor.requires_grad_, map(torch.Tensor.detach, leaves)))
        if hooks is not None:
            for leaf, hook in zip(inputs, hooks):
                if hook is not None:
                    _functorch.set_leaf_hook(leaf, hook)
        args = _replace(args, argnums, _tree.unflatten(self.plan.treedef, inputs))
        with torch.enable_grad():
            out = fn(*args, **kwargs)
            loss = _loss_of(out, has_aux)
            grads: Sequence[torch.Tensor | None] = [None] * len(inputs)
            if loss.requires_grad:
                if hooks is not None:
                    loss.register_hook(self._on_backward_start)
                grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        value = (loss.detach(), _detach(out[1])) if has_aux else loss.detach()
        if hooks is not None:
            return list(grads), value
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]
        return _tree.unflatten(self.plan.treedef, grads), value

    def _instrument(self, fn: Callable, argnums: Any, has_aux: bool, hooks: list[Callable] | None) -> Callable:
        plan = self.plan

        def instrumented(*args: Any, **kwargs: Any) -> Any:
            if hooks is not None:
                for leaf, hook in zip(plan.leaves_of(_select(args, argnums)), hooks):
                    if hook is not None:
                        leaf.register_hook(hook)
            out = fn(*args, **kwargs)
            loss = _loss_of(out, has_aux)
            if hooks is not None and loss.requires_grad:
                loss.register_hook(self._on_backward_start)
            return out

        return instrumented

    def _on_backward_start(self, g: torch.Tensor) -> None:
        if self._cur is not None:
            self._cur.bwd_start = time.perf_counter()

    def _make_hook(self, i: int, wrapped: bool) -> Callable[[torch.Tensor], torch.Tensor | None]:
        bucket = self._bucket_of[i]
        release = self._release[i]
        unwrap = _functorch.unwrap if wrapped else None

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            step = self._cur
            if step is None or step.got[i]:
                return None
            step.stash[i] = unwrap(grad) if unwrap else grad
            step.got[i] = 1
            step.pending[bucket] -= 1
            if step.pending[bucket] == 0:
                step.times[bucket].ready = time.perf_counter() - step.t0
                if bucket == step.next:
                    with _functorch.outside_transforms():
                        self._launch_ready(step)
            # Hand autograd a free zero instead: the gradient then lives only in our stash.
            return grad.new_zeros(()).expand(grad.shape) if release else None

        return hook

    def _launch_ready(self, step: _Step, force: bool = False) -> None:
        """Launch buckets in order while the next one is complete (all of them if ``force``)."""
        nb = len(self.plan.buckets)
        while step.next < nb and (force or step.pending[step.next] == 0):
            self._launch(step, step.next)
            step.next += 1

    def _buffer(self, b: int) -> torch.Tensor:
        bucket = self.plan.buckets[b]
        wire = self._wire[b]
        if self.grad_views or wire != bucket.dtype:
            buf = self._buffers[b]
            if buf is None:
                buf = self._buffers[b] = torch.empty(bucket.numel, dtype=wire, device=bucket.device)
            return buf
        # The reduced bucket becomes the returned gradients: a fresh buffer every step.
        return torch.empty(bucket.numel, dtype=wire, device=bucket.device)

    def _launch(self, step: _Step, b: int) -> None:
        bucket = self.plan.buckets[b]
        flat = self._buffer(b)
        if not step.active:
            flat.zero_()
        else:
            srcs = []
            for i in bucket.leaves:
                g = step.stash[i]
                if g is None:  # unused leaf: its hook never fired, its gradient is zero
                    g = torch.zeros(self.plan.slots[i].shape, dtype=bucket.dtype, device=bucket.device)
                srcs.append(g)
                step.stash[i] = None
            if step.acc is not None:
                srcs = torch._foreach_add([step.acc[i] for i in bucket.leaves], srcs)
            kernels.flatten(srcs, flat, scale=step.scale)
        what = f"all-reduce of bucket {b} of {len(self.plan.buckets)} (step {step.n})"
        if self.debug:
            _sync.check_collective(self.group, step.n, b, bucket.numel, flat.dtype, what)
        times = step.times[b]
        _stamp_done(step)
        times.launch = time.perf_counter() - step.t0
        step.flats[b] = flat
        if self._sum_work:
            work = _comm.all_reduce(flat, self.group, what, async_op=True)
            if self.group.process_group is None:
                times.done = times.launch
            else:
                step.in_flight.append(b)
            step.handles[b] = work
        else:
            fut = self.hook(bucket, flat, self.group)
            if not isinstance(fut, torch._C.Future):  # torch.futures.Future or a c10d future
                raise TypeError(
                    f"fdp: comm hook {self.hook.name} returned {type(fut).__name__} for bucket {b}; "
                    "it must return a torch.futures.Future whose value is the reduced flat tensor"
                )
            step.in_flight.append(b)
            step.handles[b] = fut

    def _finish(self, step: _Step) -> Any:
        try:
            self._launch_ready(step, force=True)
            _stamp_done(step)
            results = []
            for b, handle in enumerate(step.handles):
                what = f"all-reduce of bucket {b} of {len(self.plan.buckets)} (step {step.n})"
                if self._sum_work:
                    _comm.wait(handle, self.group, what)
                    out = step.flats[b]
                else:
                    out = self._hook_result(handle, b, step.flats[b], what)
                _stamp_done(step)  # this bucket, and any later one already complete
                if step.times[b].done is None:  # a hook's future may still be running its callbacks
                    step.times[b].done = time.perf_counter() - step.t0
                results.append(out)
            if self.skip_nonfinite:
                self.finite = _all_finite(results)
                self.nonfinite_steps += not self.finite
            grads = self._to_tree(results, step.flats)
        finally:
            self._cur = None
        end = time.perf_counter() - step.t0
        self._timeline = Timeline(
            step.n, step.kind,
            None if step.bwd_start is None else step.bwd_start - step.t0,
            None if step.bwd_end is None else step.bwd_end - step.t0,
            end, step.times,
        )
        self._steps += 1
        return grads

    def _hook_result(self, fut: torch.futures.Future, b: int, flat: torch.Tensor, what: str) -> torch.Tensor:
        try:
            value = fut.wait()
        except Exception as e:
            raise _comm._fail(self.group, f"{what} (comm hook {self.hook.name})", e) from e
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        bucket = self.plan.buckets[b]
        if not isinstance(value, torch.Tensor) or value.numel() != bucket.numel or not value.is_floating_point():
            got = (f"a {type(value).__name__}" if not isinstance(value, torch.Tensor)
                   else f"a {value.dtype} tensor of shape {tuple(value.shape)}")
            raise TypeError(
                f"fdp: comm hook {self.hook.name} returned {got} for bucket {b}; expected a floating "
                f"tensor of {bucket.numel} elements (the reduced bucket)"
            )
        value = value.reshape(-1)
        if value.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() and not self.grad_views:
            value = value.clone()  # never hand out memory the hook may reuse
        return value

    def _to_tree(self, results: list[torch.Tensor], flats: list[torch.Tensor | None]) -> Any:
        plan = self.plan
        outs = []
        for b, (bucket, r) in enumerate(zip(plan.buckets, results)):
            if r.dtype == bucket.dtype and not self.grad_views:
                outs.append(r)  # fresh this step: hand it over
            elif self.grad_views:
                if r.dtype == bucket.dtype and r.data_ptr() == flats[b].data_ptr():
                    outs.append(r)
                else:
                    res = self._results[b]
                    if res is None:
                        res = self._results[b] = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
                    outs.append(res.copy_(r))
            else:
                outs.append(r.to(bucket.dtype))  # decompress into fresh gradients
        return plan.views(outs)


def _stamp_done(step: _Step) -> None:
    """Stamp ``done`` on the launched buckets whose collective has completed by now."""
    if not step.in_flight:
        return
    now = time.perf_counter() - step.t0
    still = []
    for b in step.in_flight:
        h = step.handles[b]
        if h.is_completed() if hasattr(h, "is_completed") else h.done():
            step.times[b].done = now
        else:
            still.append(b)
    step.in_flight = still


def _all_finite(flats: list[torch.Tensor]) -> bool:
    """Whether every element is finite: AMP's fused found_inf check, one pass per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for f in flats:
        by_dtype.setdefault(f.dtype, []).append(f)
    found = torch.zeros(1, device=flats[0].device) if flats else None
    one = torch.ones(1, device=flats[0].device) if flats else None
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)  # x * 1.0: unchanged
    return found is None or not bool(found.item())


def _loss_of(out: Any, has_aux: bool) -> torch.Tensor:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError("fdp: with has_aux=True the function must return a (loss, aux) tuple, "
                             f"got {type(out).__name__}")
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"fdp: the function passed to reducer.grad must return a scalar loss tensor, got {shape}; "
            "reduce it (e.g. .mean()) or use has_aux=True to return extra outputs"
        )
    return out


def _select(args: tuple, argnums: int | tuple[int, ...]) -> Any:
    return args[argnums] if isinstance(argnums, int) else tuple(args[i] for i in argnums)


def _replace(args: tuple, argnums: int | tuple[int, ...], new: Any) -> tuple:
    args = list(args)
    if isinstance(argnums, int):
        args[argnums] = new
    else:
        for i, v in zip(argnums, new):
            args[i] = v
    return tuple(args)


def _detach(tree: Any) -> Any:
    return _tree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)
