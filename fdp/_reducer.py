"""``Reducer``: the public face of bucketed, overlapped gradient averaging.

The Reducer holds the configuration (plan, group, comm hook, buffers) and offers the
``torch.func``-shaped calls (``grad``, ``grad_and_value``) plus ``all_reduce`` for
gradients computed any other way. What one step does is the step machine's job
(``fdp/_step/machine.py``: leaf hooks, fill, launch, wait, finish); how this rank's gradients
are computed is ``fdp/_step/autodiff.py``'s; who owns the flat buffers is
``fdp/_plan/buffers.py``; the fused step (``grad_and_update``) is ``fdp/_fused``'s.

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
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _internals, _tree
from ._comm.agree import count_and_check_active, verify_layout
from ._comm.group import Group
from ._comm.mesh import resolve_mesh
from ._fused.step import Engines, FusedStep
from ._log import debug_mode, log
from ._plan.bucket import NO_CAP, BucketPlan
from ._plan.buffers import BucketBuffers
from ._protocols import StepKind
from ._sources.trees import on_device
from ._step.autodiff import autograd_on, local_grads, refuse_sharded, resolve_engine, select
from ._step.config import StepConfig
from ._step.machine import HOOK_MEAN_BYTES, Step, StepMachine, Steps, StepSpec, all_finite
from ._step.record import StepRecord
from ._step.traced import traced_all_reduce
from ._units.units import bucket_groups, unit_of_leaves
from .cost._autocaps import AutoCaps
from .hooks import CommHook, as_hook
from .optim import Optimizer

__all__ = ["Pending", "Reducer"]


class Pending:
    """Handle of an ``all_reduce_async``: ``wait()`` returns the averaged tree."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish, self._result = finish, None

    def wait(self) -> Any:
        """Block until every bucket is reduced; return the averaged tree (again on later calls)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result


class Reducer:
    """Averages gradient pytrees over a group in size-capped buckets, overlapping the backward.

    Args:
      params: the pytree being differentiated (e.g. ``params`` from ``fdp.functionalize``);
        only its layout is used. Floating-point leaves on one device; may be empty. Leaves
        on the meta device (a model built under ``torch.device("meta")``) stand for leaves
        on the group's device: give the step their values with ``fdp.deferred_init`` or
        ``fdp.safetensors_params``, no rank ever holding the whole model.
      group: an ``fdp.Group``, a ProcessGroup, a 1-D DeviceMesh, a 2-D DeviceMesh with dims
        ``("replicate", "shard")`` (see ``shard``), or None for the world (a world of one
        without torch.distributed).
      bucket_cap_mb, first_bucket_cap_mb, bucket_caps_mb: bucket sizes in MiB, as
        ``fdp.BucketPlan.build`` (DDP's defaults: 25 and a 1 MiB first bucket).
        ``bucket_cap_mb="auto"``: the first ``grad`` steps run on a fine calibration plan,
        then rank 0 chooses the caps that minimise the predicted step (``fdp.cost``) and
        every rank freezes the same plan (``reducer.tuning``; ``fdp.cost.calibrate`` before
        ``grad_and_update``, which needs the frozen caps).
      reduce_dtype: dtype the buckets are filled and reduced in (default: the gradients').
      comm_hook: an ``fdp.hooks`` hook or a callable ``(bucket, flat, group) -> Future``.
      grad_views: return views into buffers reused every step (no allocation; valid until the
        next call) instead of fresh tensors.
      overlap: launch all-reduces from hooks during the backward (default). ``False`` runs
        the local backward to completion first, then reduces (the fallback path).
      skip_nonfinite: after each reduction, check the averaged gradients for inf/NaN (one
        fused pass, AMP's found_inf check). The verdict is the same on every rank (they all
        hold the same reduced values): ``reducer.last_step.finite``
        lets ``if reducer.last_step.finite: params, state = opt.update(...)`` skip a bad step on all
        ranks together; ``reducer.nonfinite_steps`` counts them.
      debug: before each bucket collective, check that all ranks issue the same one (costs a
        small collective per bucket). Default: the ``FDP_DEBUG`` environment variable.
      engine: how this rank's gradients are computed: ``"auto"`` (plain autograd on fresh
        leaves, the same numbers as ``torch.func.grad`` without its per-op wrapping),
        ``"autograd"``, or ``"functorch"`` (``torch.func.grad`` itself).
      hook_threshold_bytes: trailing buckets whose leaves average fewer bytes than this get
        no leaf hooks and launch when the backward returns (a hook costs more than an early
        launch of thousands of tiny leaves gains). ``0`` hooks every bucket.
      shard: shard the optimizer state of ``grad_and_update`` over the ranks (``True`` or
        ``"state"``, ZeRO-1/2): each bucket is reduce-scattered, each rank updates its slice
        with its slice of the state, and the params are all-gathered (docs/concepts.md).
        ``"params"`` (ZeRO-3, FSDP): the params are sharded too; each rank keeps only its
        slice of every unit (see ``units``), the step gathers a unit just before its module
        runs and frees it after, and returns ``fdp.ShardedParams``. ``group`` may then be a
        2-D ``DeviceMesh`` with dims ``("replicate", "shard")`` (HSDP: slices are also
        all-reduced over ``replicate``). ``grad``/``all_reduce`` are unchanged (a 2-D mesh:
        over all its ranks).
      units: with ``shard="params"``, the module names whose params are gathered together
        (``fdp.units(model, Block)`` lists a model's blocks); a param under none of them
        belongs to the *root*, gathered for the whole step. Each unit is one bucket (per
        dtype): the plan's buckets are the units, in reverse registration order. Without
        ``units`` every param is the root's: a rank holds 1/world of the params at rest,
        but the whole model is gathered for the whole step (no memory saved in the step).
      param_dtype: the dtype the fused step's forward and backward run in (mixed precision:
        FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``, Megatron's bf16 params with fp32
        main params). The params, their gradients' buckets and the optimizer state stay in
        the params' own dtype (the masters); each step the loss gets the params cast to
        ``param_dtype`` (with ``shard="params"``, each unit's slice is cast before its
        all-gather: half the bytes for bf16), and the gradients are cast back at the bucket
        fill and reduced in ``reduce_dtype`` (default: the params' dtype). ``apply`` casts
        floating-point inputs to the params' dtype when it gets params in a lower one
        (FSDP2's ``cast_forward_inputs``; ``apply.cast_inputs(False)`` turns it off). Only
        ``grad_and_update``'s step uses it (``grad`` differentiates the params it is given).
      reshard_after_forward: with ``shard="params"``, free each unit after its forward and
        gather it again for its backward (default, FSDP2's); ``False`` keeps every unit
        gathered from its forward until its gradients are reduced (one gather per unit per
        step, the memory of the whole params at the end of the forward).
      reduce_micro_batches: with ``shard``, ``step.accumulate`` reduce-scatters each
        micro-batch's gradients as its backward goes (as a step does) and keeps only this
        rank's slice of their sum: 1/world of a set of gradients held between micro-batches,
        for one reduce-scatter per micro-batch (FSDP2's default gradient sync on every
        micro-batch, and ZeRO-2/3's). The gradient is the sum of the micro-batches' means,
        FSDP2's numbers; the default (``False``) keeps the whole local sum until the step
        averages it (DDP's ``no_sync``; ``set_requires_gradient_sync(False)``): the two round
        differently. Each reduced micro-batch counts as a step of ``reducer.steps`` (kind
        ``"accumulate"``).

    Attributes:
      plan: the ``fdp.BucketPlan`` built from ``params``' layout.
      tuning: with ``bucket_cap_mb="auto"``, the ``fdp.cost.AutoCaps`` (``frozen``,
        ``choice``); None otherwise.
      group: the ``fdp.Group`` the gradients are averaged over.
      hook: the ``fdp.hooks.CommHook`` every bucket goes through.
      shard: ``False``, ``"state"`` (the optimizer state is sharded) or ``"params"`` (the
        params too).
      nonfinite_steps: with ``skip_nonfinite=True``, how many steps had a non-finite
        averaged gradient (a reducer-level counter, the same on every rank).

    The construction is a collective: every rank checks that all ranks built the same bucket
    plan (same leaves, shapes, dtypes and caps), the same comm hook and wire dtype, and the
    same debug setting, and raises ``fdp.ReplicaMismatchError`` naming the first difference
    and the ranks otherwise.

    A step that fails on one rank (an exception in the loss or the backward, before or after
    it launched some buckets) is finished with its remaining buckets marked as failed, so the
    other ranks raise ``fdp.CollectiveError`` for that step too, and the next call starts a
    fresh step on every rank: gradients of two steps are never summed, and no rank's retry
    pairs with the others' step.

    Raises:
      ValueError: a cap <= 0, params on several devices, or a bad ``reduce_dtype`` (not
        floating, or not the hook's wire dtype), ``engine`` or ``hook_threshold_bytes``.
      TypeError: a leaf that is not a floating-point tensor (names its path), or a bad hook.
      ReplicaMismatchError: ranks built different plans, hooks or debug settings.

    Example:
      >>> apply, params, buffers = fdp.functionalize(nn.Linear(4, 2))
      >>> def loss_fn(params, buffers, x, y):
      ...     out, buffers = apply(params, buffers, x)
      ...     return F.mse_loss(out, y), buffers
      >>> reducer = fdp.Reducer(params)
      >>> grads, buffers = reducer.grad(loss_fn, has_aux=True)(params, buffers, torch.randn(8, 4), torch.randn(8, 2))
      >>> list(grads), reducer.steps
      (['weight', 'bias'], 1)
    """

    def __init__(
        self,
        params: Any,
        group: Group | Any = None,
        *,
        bucket_cap_mb: float | str = 25,
        first_bucket_cap_mb: float = 1,
        bucket_caps_mb: Sequence[float] | None = None,
        reduce_dtype: torch.dtype | None = None,
        comm_hook: CommHook | Callable | None = None,
        grad_views: bool = False,
        overlap: bool = True,
        debug: bool | None = None,
        skip_nonfinite: bool = False,
        engine: str = "auto",
        hook_threshold_bytes: int = HOOK_MEAN_BYTES,
        shard: bool | str = False,
        units: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_micro_batches: bool = False,
    ) -> None:
        mesh = resolve_mesh(group)
        self.group = mesh.full
        params = on_device(params, self.group.device)
        if shard not in (False, True, "state", "params"):
            raise ValueError(f"fdp.Reducer: shard must be False, True (or 'state': the optimizer state) or "
                             f"'params' (the params too), got {shard!r}")
        self.shard = {True: "state"}.get(shard, shard)
        if units is not None and self.shard != "params":
            raise ValueError("fdp.Reducer: units= is for params gathered unit by unit, which only fully sharded "
                             "params are; pass shard='params'")
        if reduce_micro_batches and not self.shard:
            raise ValueError("fdp.Reducer: reduce_micro_batches=True keeps this rank's slice of the micro-batches' "
                             "sum, which needs a sharded step: pass shard=True or shard='params' (unsharded, the "
                             "whole sum is what a rank keeps either way)")
        if param_dtype is not None and not (isinstance(param_dtype, torch.dtype) and param_dtype.is_floating_point):
            raise ValueError(f"fdp.Reducer: param_dtype must be a floating dtype, got {param_dtype!r}")
        if bucket_cap_mb == "auto" and (first_bucket_cap_mb != 1 or bucket_caps_mb is not None):
            raise ValueError("fdp.Reducer: bucket_cap_mb='auto' chooses every cap; pass no first_bucket_cap_mb/bucket_caps_mb")
        if bucket_cap_mb == "auto" and self.shard == "params":
            raise ValueError("fdp.Reducer: with shard='params' the buckets are the units; bucket_cap_mb='auto' has "
                             "nothing to choose")
        self.tuning = AutoCaps(shard=bool(shard)) if bucket_cap_mb == "auto" else None
        names = None
        if self.shard == "params":  # one bucket per unit (and dtype), no cap
            names, of_leaf = unit_of_leaves(_tree.keys(_tree.structure(params)), tuple(units or ()), "fdp.Reducer")
            plan = BucketPlan.from_caps(params, (NO_CAP,), groups=bucket_groups(of_leaf, len(names)))
        else:
            plan = BucketPlan.build(  # "auto" starts on the calibration plan
                params, bucket_cap_mb=25 if self.tuning else bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
                bucket_caps_mb=AutoCaps.CALIBRATION_CAPS_MB if self.tuning else bucket_caps_mb)
        plan.check_one_device("fdp.Reducer")
        self.hook = as_hook(comm_hook)
        self.hook.check_config(reduce_dtype, shard, "fdp.Reducer")
        if not (isinstance(hook_threshold_bytes, int) and hook_threshold_bytes >= 0):
            raise ValueError(f"fdp.Reducer: hook_threshold_bytes must be an int >= 0, got {hook_threshold_bytes!r}")
        # Everything resolved once, in one frozen object every machine and fused step reads.
        self._config = StepConfig(
            mesh=mesh, shard=bool(self.shard), hook=self.hook, wire=self.hook.dtype or reduce_dtype,
            debug=debug_mode() if debug is None else bool(debug), hook_threshold_bytes=hook_threshold_bytes,
            engine=resolve_engine(engine), skip_nonfinite=bool(skip_nonfinite), grad_views=bool(grad_views),
            overlap=bool(overlap), steps=Steps(), units=names, reshard_after_forward=bool(reshard_after_forward),
            param_dtype=param_dtype, reduce_micro_batches=bool(reduce_micro_batches))
        self._fused = Engines(self._config)
        self._built_with_accumulate = 0  # grad_and_update(..., accumulate=) calls (the old recipe, warned once)
        with autograd_on():  # its buffers are ordinary tensors, also if made in torch.inference_mode()
            self._use_plan(plan)

    def _use_plan(self, plan: BucketPlan) -> None:
        """Build the step machine and buffers for ``plan`` and check it is every rank's."""
        config = self._config
        self.plan, wire = plan, config.wire
        self._wire = [wire or b.dtype for b in plan.buckets]
        old = getattr(self, "_machine", None)
        self._machine = StepMachine(
            plan, self.group, self.hook, BucketBuffers(plan, self._wire, reuse=config.grad_views),
            debug=config.debug, hook_threshold_bytes=config.hook_threshold_bytes, steps=config.steps,
        )
        self._bucket_buffers = self._machine.buffers
        # Everything that decides which collectives a step issues, and in which dtype, must
        # agree across ranks: the plan, the hook, the wire dtype, debug's fingerprint checks.
        wire_name = "the gradients' dtype" if wire is None else str(wire).replace("torch.", "")
        frozen = f", auto plan {plan.fingerprint}" if old is not None else ""
        units = "" if config.units is None else (
            f", units {list(config.units[1:])}, reshard_after_forward={config.reshard_after_forward}, "
            f"param_dtype={config.param_dtype}")
        units += f", reduce_micro_batches={config.reduce_micro_batches}" if config.reduce_micro_batches else ""
        verify_layout(
            [(s.path, s.shape, str(s.dtype).replace("torch.", "")) for s in plan.slots],
            self.group, "fdp.Reducer",
            extra=(f"bucket caps {list(plan.caps)} bytes, {self.hook.describe()}, reduce dtype {wire_name}, "
                   f"debug={config.debug}, shard={self.shard!r} (shard group of {config.mesh.shard.size})"
                   f"{units}{frozen}"),
        )
        self.hook.attach(self, plan)  # (a stateful hook ties its state to this plan, or refuses)
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
        overlaps its backward (``examples/grad_accumulation.py``).

        ``fn`` may itself differentiate the params (``torch.autograd.grad(...,
        create_graph=True)``: gradient penalties, meta-gradients): only the outer backward's
        gradients are averaged, and the inner calls see the true gradients.

        ``fn`` must be pure in the differentiated argument: thread buffers through it
        (``has_aux=True``). ``accumulate`` is bound when ``grad`` is called: build ``grad_fn``
        each step (cheap).

        Raises:
          ValueError: ``fn``'s output is not a scalar tensor (or ``(loss, aux)``), or the
            differentiated argument or ``accumulate`` does not match the plan (names the leaf).
          RuntimeError: inside another ``torch.func`` transform or ``torch.compile`` (use
            ``all_reduce`` there), or while another step of this reducer is in flight.
          CollectiveError: a bucket's collective failed or timed out (in debug mode,
            ``ReplicaMismatchError`` first if ranks were about to issue different ones).
        """
        gv = self.grad_and_value(fn, argnums, has_aux, accumulate=accumulate)

        def grad_fn(*args: Any, **kwargs: Any) -> Any:
            grads, value = gv(*args, **kwargs)
            return (grads, value[1]) if has_aux else grads

        return grad_fn

    def grad_and_value(self, fn: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False, *,
                       accumulate: Any = None) -> Callable:
        """Like ``torch.func.grad_and_value``, with gradients averaged over ranks (see ``grad``).

        The value (``loss`` or ``(loss, aux)``) is detached and this rank's, not averaged.
        """

        def grad_and_value_fn(*args: Any, **kwargs: Any) -> Any:
            return self._grad_step(fn, argnums, has_aux, accumulate, args, kwargs)

        return grad_and_value_fn

    def grad_and_update(self, fn: Callable, opt: Optimizer, *, has_aux: bool = False,
                        accumulate: Any = None, donate: bool = False, uneven: bool = False) -> FusedStep:
        """The fused train step: gradient, all-reduce and optimizer update in one call.

        ``step = reducer.grad_and_update(loss_fn, opt)``; ``opt_state = step.init(params)``;
        then each step ``params, opt_state, value = step(params, opt_state, *rest)``, where
        ``loss_fn(params, *rest)`` is as for ``grad`` and ``value`` is what
        ``grad_and_value`` returns. Params, gradients and optimizer state live in flat
        per-bucket buffers (the plan split by the optimizer's param groups); each bucket is
        updated by one call of the optimizer's torch.optim kernel as soon as its all-reduce
        lands, while the backward goes on (after the last bucket, with a whole-tree
        transform such as ``clip_by_global_norm``, or with ``skip_nonfinite``: then a
        non-finite step updates nothing on every rank, and ``step.last_step.finite`` says
        so). See ``fdp.FusedStep`` for the memory and the numbers.

        Args:
          fn: the loss function; its first argument is the params.
          opt: an optimizer with a per-leaf kernel (``sgd``, ``adam``, ``adamw``, ``nadam``,
            ``radam``, ``adamax``, ``adadelta``, ``adagrad``, ``rmsprop``, ``lion``, ``muon``; a
            ``partition`` of them; under ``ema`` or ``inject_hyperparams``), optionally in a
            ``chain`` after gradient transforms (``clip_by_global_norm``, ``clip_by_value``, ...);
            docs/optim.md's table says which run fused.
          has_aux: as for ``grad``.
          accumulate: local gradients of earlier micro-batches, added before averaging. Built
            anew each step (a gradient tree summed per micro-batch outside the step) this is
            the slow recipe, and a second such build warns once: make the step once and call
            ``step.accumulate(params, *micro_batch)`` for each micro-batch but the last.
          donate: update the params in place (the tree passed in is consumed) instead of
            writing a second set of flat buffers.
          uneven: some ranks may run out of data before others (DDP's ``join``): every call
            counts the active ranks (one small all-reduce), a rank without data calls
            ``step.idle`` (its gradients count as zeros) and the mean is over the others.

        Raises:
          TypeError: an optimizer the fused step cannot run per bucket (``adafactor``, your
            own): use ``grad`` + ``opt.update`` for those.

        Example::

            step = reducer.grad_and_update(loss_fn, fdp.optim.adamw(lr=1e-3), has_aux=True)
            opt_state = step.init(params)
            for x, y in loader:
                params, opt_state, (loss, buffers) = step(params, opt_state, buffers, x, y)
        """
        if self.tuning is not None and not self.tuning.frozen:
            raise RuntimeError("fdp.Reducer.grad_and_update: bucket_cap_mb='auto' has not chosen its caps yet; "
                               "run fdp.cost.calibrate(reducer, loss_fn, *args, optimizer=opt) first (the fused plan is built once)")
        if accumulate is not None:
            self._built_with_accumulate += 1
            if self._built_with_accumulate == 2:
                warnings.warn(
                    "fdp.Reducer.grad_and_update(..., accumulate=) is built again: built each step, the "
                    "micro-batches' gradient trees are summed outside the step, which runs much slower than "
                    "DDP's no_sync loop. Make the step once and call step.accumulate(params, *micro_batch) for "
                    "each micro-batch but the last, then step(params, opt_state, *last_micro_batch): the same "
                    "numbers, added in place in the step's own buffers (docs/migrating-from-ddp.md)",
                    UserWarning, stacklevel=2)
        return FusedStep(self._fused, self.plan, opt, fn, has_aux, accumulate, donate, uneven)

    def all_reduce(self, grads: Any, *, active: bool | None = None) -> Any:
        """Average a gradient tree computed any other way (e.g. a plain ``torch.func.grad``).

        Args:
          grads: a tree with the plan's layout (ignored, may be None, when ``active=False``).
          active: for uneven inputs (DDP's join). ``None`` (default): every rank takes part.
            ``True``/``False``: a rank with ``active=False`` contributes zeros and the mean is
            over the active ranks only. Every rank, active or not, receives the mean, so
            applying it keeps the replicas identical. Every rank must pass ``active=``, or
            none: one tiny all-reduce per call counts the active ranks and checks that, and a
            disagreement raises ``fdp.ReplicaMismatchError`` on every rank.

        A collective, through the same buckets and comm hook as ``grad``.

        Raises:
          ValueError: no rank is active, or ``grads`` does not match the plan (names the leaf).
          RuntimeError: another step of this reducer is in flight.
          CollectiveError: a bucket's collective failed or timed out.

        Example:
          >>> reducer = fdp.Reducer({"w": torch.zeros(3)})
          >>> reducer.all_reduce({"w": torch.ones(3)})["w"]  # a world of one: the mean is the input
          tensor([1., 1., 1.])
        """
        if _tree.compiling():
            if self.skip_nonfinite or self.debug:
                raise RuntimeError("fdp.Reducer: skip_nonfinite and debug read values on the host; "
                                   "they are not supported under torch.compile")
            return traced_all_reduce(grads, self.plan, self.hook, self._wire, self.group, active)
        return self.all_reduce_async(grads, active=active).wait()

    def all_reduce_async(self, grads: Any, *, active: bool | None = None) -> Pending:
        """Launch ``all_reduce`` and return a handle whose ``wait()`` returns the mean.

        One step at a time: wait on it before this reducer's next call. As ``all_reduce``.
        """
        self._machine.check_idle("all_reduce")
        n = count_and_check_active(active, self.group, "fdp.Reducer.all_reduce: active-rank count")
        if n == 0:
            raise ValueError("fdp.Reducer.all_reduce: no rank is active; stop the loop when "
                             "fdp.any_rank(has_data) is False")
        is_active = active is None or bool(active)
        leaves = None
        if is_active:
            leaves = self.plan.leaves_of(grads, "all_reduce grads")
            self.plan.check_devices(leaves, "all_reduce grads")
        step = self._reduce(leaves, n=n, kind="all_reduce")
        return Pending(lambda: self.plan.views(self._complete(step)))

    @property
    def last_step(self) -> StepRecord | None:
        """The ``fdp.StepRecord`` of the most recent completed step, ``grad`` or fused
        (``grad_and_update``) alike (``None`` before the first)."""
        return self._config.steps.last

    @property
    def steps(self) -> int:
        """Number of completed steps, ``grad``, ``all_reduce`` and fused alike (a
        reducer-level counter, the same on every rank)."""
        return self._config.steps.completed

    @property
    def nonfinite_steps(self) -> int:
        """With ``skip_nonfinite=True``, how many steps had a non-finite averaged gradient;
        also the fused steps a global scale skipped (a loss scaler's overflow)."""
        return self._config.steps.nonfinite

    @property
    def engine(self) -> str:
        """How local gradients are computed: ``"autograd"`` (also for ``engine="auto"``) or ``"functorch"``."""
        return self._config.engine

    @property
    def debug(self) -> bool:
        """Whether each collective's fingerprint is checked across ranks first."""
        return self._config.debug

    @property
    def skip_nonfinite(self) -> bool:
        """Whether each step checks the averaged gradients for inf/NaN."""
        return self._config.skip_nonfinite

    @property
    def grad_views(self) -> bool:
        """Whether ``grad`` returns views into buffers reused every step."""
        return self._config.grad_views

    @property
    def overlap(self) -> bool:
        """Whether all-reduces are launched during the backward."""
        return self._config.overlap

    @property
    def hooked_buckets(self) -> int:
        """How many leading buckets have leaf hooks (the rest launch when the backward returns)."""
        return self._machine.hooked_buckets

    def __repr__(self) -> str:
        return (f"fdp.Reducer({self.plan!r}, group={self.group!r}, hook={self.hook.name}, "
                f"overlap={self.overlap})")

    # ------------------------------------------------------------------ the steps
    def _grad_step(self, fn: Callable, argnums: Any, has_aux: bool, accumulate: Any,
                   args: tuple, kwargs: dict) -> Any:
        if _tree.compiling():
            raise RuntimeError(
                "fdp.Reducer.grad cannot be traced by torch.compile: its overlapped backward runs "
                "Python hooks inside autograd. In a compiled step compute the local gradients with "
                "torch.func.grad and average them with reducer.all_reduce(grads), which compiles to "
                "functional collectives (docs/compile.md)"
            )
        with autograd_on():  # also inside torch.inference_mode(), as torch.func.grad
            return self._grad_step_recording(fn, argnums, has_aux, accumulate, args, kwargs)

    def _grad_step_recording(self, fn: Callable, argnums: Any, has_aux: bool, accumulate: Any,
                             args: tuple, kwargs: dict) -> Any:
        self._machine.check_idle("grad")
        if _internals.in_functorch_transform():
            raise RuntimeError("fdp.Reducer.grad cannot run inside another torch.func transform "
                               "(vmap/grad/jvp); call it at the top level of the train step")
        plan = self.plan
        acc = None
        if accumulate is not None:
            acc = plan.leaves_of(accumulate, "accumulate")
            plan.check_devices(acc, "accumulate")
        refuse_sharded(select(args, argnums), "fdp.Reducer.grad")
        leaves = plan.leaves_of(select(args, argnums), "reducer.grad params")
        plan.check_devices(leaves, "reducer.grad params")
        engine = self._config.engine
        if not self.overlap or (engine == "functorch" and not _internals.FUNCTORCH):
            grads, value = local_grads(engine, fn, argnums, has_aux, args, kwargs, leaves, plan.treedef,
                                       None, None)
            if acc is not None:
                grads = torch._foreach_add(acc, grads)
            step = self._reduce(grads, n=self.group.size, kind="grad")
            return plan.views(self._complete(step)), value
        machine = self._machine
        step = machine.start(StepSpec("grad", what="fdp.Reducer.grad", acc=acc,
                                      scale=machine.scale_for(self.group.size),
                                      defer=self.tuning is not None and self.tuning.deferring()))
        try:
            grads, value = local_grads(engine, fn, argnums, has_aux, args, kwargs, leaves, plan.treedef,
                                       machine.leaf_hooks[engine], step.on_backward_start)
            step.backward_done(grads, machine.unhooked)
        except BaseException as e:
            machine.abort(step, e)
            raise
        return plan.views(self._complete(step)), value

    def _reduce(self, leaves: list[torch.Tensor] | None, *, n: int, kind: StepKind) -> Step:
        """Launch every bucket of ``leaves`` for a mean over ``n`` ranks (None: an inactive
        rank, contributing zeros)."""
        machine = self._machine
        step = machine.start(StepSpec(kind, what=f"fdp.Reducer.{kind}", scale=machine.scale_for(n),
                                      active=leaves is not None))
        try:
            if leaves is not None:
                step.give(leaves)
            step.launch_ready(force=True)
        except BaseException as e:
            machine.abort(step, e)
            raise
        return step

    def _complete(self, step: Step) -> list[torch.Tensor]:
        """Wait for ``step`` and return the flat tensors (gradients' dtype) the result views."""
        results = self._machine.finish(step)
        finite = True
        steps = self._config.steps
        if self.skip_nonfinite:
            finite = all_finite(results)
            steps.nonfinite += not finite
        flats = self._bucket_buffers.grads(results, step.flats)
        last = steps.last = StepRecord(step.n, step.kind, finite, step.timeline())
        if self.tuning is not None and not self.tuning.frozen:
            caps = self.tuning.observe(self.plan, step.kind, last.timeline, self.group,
                                       wire_dtype=self._config.wire, hook_threshold_bytes=self._config.hook_threshold_bytes)
            if caps is not None:  # freeze: every rank builds the plan of rank 0's caps
                self._use_plan(BucketPlan.from_caps(self.plan.views(self.plan.new_buffers()), caps))
        return flats
