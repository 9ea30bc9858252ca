"""The fused train step: params, gradients and optimizer state in the plan's flat buckets.

``reducer.grad_and_update(fn, opt)`` returns a ``FusedStep``. Its buckets are the Reducer's
plan split by the optimizer's param groups (a bucket has one set of hyper-parameters), and
three things live in that layout:

* the gradients: the step machine's own reduced buckets, reused every step;
* the params: one flat tensor per bucket; the returned params are views into it. Pure by
  default: a step reads one set and writes the other, and a set is written only once
  nothing outside fdp refers to it (a storage use count), so a caller that keeps old params
  sees them unchanged, and one that rebinds ``params`` cycles through two sets. With
  ``donate=True`` the set is updated in place;
* the optimizer state: one flat tensor per bucket and state field, updated in place (as
  torch.optim's, Megatron's and apex's fused optimizers do: a second copy would double the
  optimizer's memory).

Each bucket's update is one call of the optimizer's torch.optim kernel on (flat param, flat
grad, flat state) of that bucket, run as soon as the bucket's all-reduce has landed while the
backward goes on, when every transform of the chain is elementwise; a whole-tree transform
(``clip_by_global_norm``) or ``skip_nonfinite`` needs every bucket first, so then all buckets
are updated after the last one lands (DDP's in-backward optimizer never supported clipping
at all: pytorch #71595, #124523).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _functorch, _tree, kernels
from ._autodiff import local_grads
from ._bucket import BucketPlan
from ._buffers import BucketBuffers, held_elsewhere
from ._comm import count_and_check_active
from ._group import Group
from ._step import StepMachine, all_finite
from ._sync import verify_layout
from ._timeline import StepRecord
from .hooks import CommHook
from .optim import ChainState, GradientTransform, Optimizer

__all__ = ["FusedState", "FusedStep"]

# Elements per kernel call of a bucket's update. torch.optim's CPU kernels make several
# passes over their tensors (AdamW: about ten) and allocate temporaries of their size: over a
# whole 25 MiB bucket every pass streams from memory and each temporary is a fresh large
# block, while over chunks that fit in the cache the passes stay there (CUDA's
# multi_tensor_apply cuts its work into 65,536-element chunks for the same reason). The
# figures behind the choice are in docs/performance.md ("The fused step").
CHUNK = 128 * 1024


class FusedState(NamedTuple):
    """The fused step's optimizer state, flat per bucket (save it with ``fdp.save``).

    Attributes:
      step: the optimizer's count of updates applied (the tensor the per-leaf state holds).
      buffers: per state field (e.g. ``"exp_avg"``), one flat tensor per bucket.
      transforms: the states of the chain's gradient transforms (e.g. a ``ClipState``).
    """

    step: torch.Tensor
    buffers: dict[str, list[torch.Tensor]]
    transforms: tuple


def split_chain(opt: Optimizer, name: str) -> tuple[tuple[GradientTransform, ...], Optimizer]:
    """(gradient transforms, optimizer with a leaf kernel), or a ``TypeError`` saying why not."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{name}: opt must be an fdp.optim optimizer or chain, got {type(opt).__name__}")
    transforms, optimizer = (tuple(opt.parts[:-1]), opt.parts[-1]) if opt.parts else ((), opt)
    if optimizer.leaf_kernel is None:
        raise TypeError(
            f"{name}: the fused step runs a torch.optim kernel per bucket, so it needs sgd, adam, adamw, "
            "adagrad or rmsprop (optionally in a chain after gradient transforms); for other optimizers "
            "(partition, your own) use reducer.grad and opt.update"
        )
    for t in transforms:
        if t.update_in_place is None:
            raise TypeError(
                f"{name}: every gradient transform of the chain must work in place on the reduced "
                "buckets (fdp.optim's clip_by_global_norm and clip_by_value do; GradientTransform("
                "update_in_place=...) declares it for your own); for others use reducer.grad and opt.update"
            )
    return transforms, optimizer


class ParamSet:
    """One set of flat param buffers and the data pointers of the leaves' views into it."""

    __slots__ = ("flats", "ptrs")

    def __init__(self, flats: list[torch.Tensor], ptrs: list[int]) -> None:
        self.flats, self.ptrs = flats, ptrs


class FusedCore:
    """What a (Reducer, optimizer) pair keeps across steps: plan, machine, param sets, state."""

    def __init__(self, opt: Optimizer, params: Any, *, group: Group, hook: CommHook, caps: tuple[int, ...],
                 wire: torch.dtype | None, debug: bool, hook_threshold_bytes: int, engine: str,
                 skip_nonfinite: bool, name: str) -> None:
        self.opt, self.name = opt, name
        self.transforms, optimizer = split_chain(opt, name)
        self.kernel = optimizer.leaf_kernel
        self.group, self.engine, self.skip_nonfinite = group, engine, skip_nonfinite
        self.groups = [int(g) for g in self.kernel.groups(params)]
        self.plan = BucketPlan.from_caps(params, caps, groups=self.groups)
        wires = [wire or b.dtype for b in self.plan.buckets]
        self.machine = StepMachine(self.plan, group, hook, BucketBuffers(self.plan, wires, reuse=True),
                                   debug=debug, hook_threshold_bytes=hook_threshold_bytes)
        self.elementwise = all(t.elementwise for t in self.transforms)
        self.sets: list[ParamSet] = []    # param sets in use (at most two are tracked)
        self.cur: ParamSet | None = None  # the set holding the current params
        self.scratch: list[torch.Tensor | None] = [None] * len(self.plan.buckets)  # fp32 grads of a cast wire
        self.broken: str | None = None
        self.last: StepRecord | None = None
        verify_layout(
            [(s.path, s.shape, str(s.dtype).replace("torch.", "")) for s in self.plan.slots], group, name,
            extra=f"param groups {self.groups}, bucket caps {list(caps)}, {hook.describe()}",
        )

    # ------------------------------------------------------------------ params
    def _new_set(self) -> ParamSet:
        flats = [torch.empty(b.numel, dtype=b.dtype, device=b.device) for b in self.plan.buckets]
        ptrs = [flats[s.bucket].data_ptr() + s.offset * flats[s.bucket].element_size() for s in self.plan.slots]
        new = ParamSet(flats, ptrs)
        self.sets.append(new)
        return new

    def current(self, leaves: list[torch.Tensor]) -> ParamSet:
        """The set holding ``leaves``: the current set when they are its views (no copy),
        else a set they are packed into (a tree the caller changed or made)."""
        ptrs = list(map(torch.Tensor.data_ptr, leaves))
        if self.cur is not None and ptrs == self.cur.ptrs:
            return self.cur
        target = self.free_set(avoid=self.cur)  # the tree may still hold views of the current set
        for b, flat in zip(self.plan.buckets, target.flats):
            kernels.flatten([leaves[i] for i in b.leaves], flat)
        self.cur = target
        return target

    def free_set(self, avoid: ParamSet | None) -> ParamSet:
        """A set nothing outside fdp refers to (not ``avoid``), made if there is none."""
        for ps in self.sets:
            if ps is not avoid and not any(map(held_elsewhere, ps.flats)):
                return ps
        if len(self.sets) >= 2:  # the caller keeps old params: stop tracking one of their sets
            old = next((ps for ps in self.sets if ps is not avoid and ps is not self.cur), None)
            if old is not None:
                self.sets.remove(old)
        return self._new_set()

    # ------------------------------------------------------------------ state
    def init(self, params: Any) -> FusedState:
        self.plan.leaves_of(params, f"{self.name}: init params")  # checked against the plan
        # The optimizer's own count (its dtype differs between optimizers), from an init over
        # empty leaves of the same dims: a full init would allocate a whole per-leaf state.
        empty = _tree.tree_map(lambda t: t.new_empty((0,) * t.dim()), params)
        count = self._template(empty).step.clone()
        self.broken = None  # a fresh state: a failed step's partial update is behind us
        buffers = {f: [torch.full((b.numel,), self.kernel.init_value, dtype=b.dtype, device=b.device)
                       for b in self.plan.buckets] for f in self.kernel.fields}
        return FusedState(count, buffers, tuple(t.init(params) for t in self.transforms))

    def _template(self, params: Any) -> Any:
        state = self.opt.init(params)
        return state.optimizer if isinstance(state, ChainState) else state

    def check_state(self, state: Any) -> FusedState:
        if self.broken is not None:
            raise RuntimeError(f"{self.name}: {self.broken}")
        if not isinstance(state, FusedState):
            raise TypeError(f"{self.name}: opt_state must be the FusedState of step.init(params) (or "
                            f"step.state_from_tree), got {type(state).__name__}")
        if set(state.buffers) != set(self.kernel.fields) or len(state.transforms) != len(self.transforms):
            raise ValueError(f"{self.name}: opt_state has fields {sorted(state.buffers)} and "
                             f"{len(state.transforms)} transform states; this optimizer keeps "
                             f"{sorted(self.kernel.fields)} and {len(self.transforms)}")
        for f, flats in state.buffers.items():
            if len(flats) != len(self.plan.buckets) or any(
                    t.numel() != b.numel or t.dtype != b.dtype or t.device != b.device
                    for t, b in zip(flats, self.plan.buckets)):
                raise ValueError(f"{self.name}: opt_state.buffers[{f!r}] does not match this step's "
                                 f"{len(self.plan.buckets)} buckets (a state made for another plan? "
                                 "convert it with step.state_to_tree / step.state_from_tree)")
        return state

    def state_to_tree(self, state: FusedState, params: Any) -> Any:
        state = self.check_state(state)
        template = self._template(params)
        fields = {f: _tree.tree_map(torch.clone, self.plan.views(state.buffers[f])) for f in self.kernel.fields}
        tree = template._replace(step=state.step.clone(), **fields)
        if self.opt.parts:
            return ChainState(tuple(state.transforms), tree)
        return tree

    def state_from_tree(self, tree_state: Any, params: Any) -> FusedState:
        transforms = ()
        if self.opt.parts:
            if not isinstance(tree_state, ChainState):
                raise TypeError(f"{self.name}: expected the ChainState of opt.init(params), got "
                                f"{type(tree_state).__name__}")
            transforms, tree_state = tuple(tree_state.transforms), tree_state.optimizer
        buffers = {f: self.plan.flatten(getattr(tree_state, f)) for f in self.kernel.fields}
        self.broken = None
        return FusedState(tree_state.step.clone(), buffers, transforms)

    # ------------------------------------------------------------------ one step
    def run(self, fn: Callable, has_aux: bool, params: Any, state: Any, rest: tuple, kwargs: dict,
            accumulate: Any, donate: bool, *, given: bool = False, grads: Any = None,
            active: bool | None = None) -> tuple:
        """One fused step. ``given`` (``FusedStep.update``): no backward; ``grads`` are reduced."""
        if _tree.compiling():
            raise RuntimeError(f"{self.name} cannot be traced by torch.compile (its per-bucket updates "
                               "run from hooks inside autograd); compile a step of torch.func.grad, "
                               "reducer.all_reduce and opt.update instead (docs/compile.md)")
        if _functorch.in_transform():
            raise RuntimeError(f"{self.name} cannot run inside a torch.func transform")
        state = self.check_state(state)
        plan, machine = self.plan, self.machine
        src = self.current(plan.leaves_of(params, f"{self.name} params"))
        leaves = plan.views(src.flats)  # the params as a tree in the plan's order
        dst = src if donate else self.free_set(avoid=src)
        acc = None
        if accumulate is not None:
            acc = plan.leaves_of(accumulate, f"{self.name} accumulate")
        early = self.elementwise and not self.skip_nonfinite
        if not given:
            step = machine.start("grad", acc=acc, scale=machine.scale_for(self.group.size), what=self.name)
        else:
            n = count_and_check_active(active, self.group, f"{self.name}: active-rank count")
            if n == 0:
                raise ValueError(f"{self.name}: no rank is active; stop the loop when fdp.any_rank(has_data) is False")
            is_active = active is None or bool(active)
            glist = plan.leaves_of(grads, f"{self.name} grads") if is_active else None
            step = machine.start("all_reduce", scale=machine.scale_for(n), active=is_active, what=self.name)
        updated = bytearray(len(plan.buckets))
        count = state.step
        tstates = list(state.transforms)

        def update(b: int, reduced: torch.Tensor) -> None:
            t0 = time.perf_counter()
            g = self._grad(b, reduced)
            if early:
                for i, t in enumerate(self.transforms):
                    tstates[i] = t.update_in_place([g], tstates[i])
            p = dst.flats[b]
            if dst is not src:
                p.copy_(src.flats[b])
            # In chunks: each chunk's passes stay in cache, and the kernel's temporaries are
            # chunk-sized rather than bucket-sized (CHUNK's comment).
            self.kernel.step(plan.buckets[b].group, list(p.split(CHUNK)), list(g.split(CHUNK)),
                             [list(state.buffers[f][b].split(CHUNK)) for f in self.kernel.fields], count)
            updated[b] = 1
            times = step.times[b]
            times.update_start, times.update_end = t0 - step.t0, time.perf_counter() - step.t0

        if early:
            step.on_ready = update
        try:
            if not given:
                local, value = local_grads(self.engine, fn, 0, has_aux, (leaves, *rest), kwargs,
                                           _tree.leaves(leaves), plan.treedef, machine.leaf_hooks[self.engine],
                                           step.on_backward_start)
                step.backward_done(local, machine.unhooked)
            else:
                value = None
                if glist is not None:
                    step.give(glist)
                step.launch_ready(force=True)
            results = machine.finish(step)
        except BaseException as e:
            if machine.in_flight is step:  # failed before finish: keep the ranks in step
                machine.abort(step, e)
            if any(updated):
                self.broken = (f"step {step.n} failed after {sum(updated)} of {len(plan.buckets)} buckets "
                               "had updated the optimizer state in place; load a saved state "
                               "(step.state_from_tree) or make a new one (step.init) to go on")
            raise
        finite = True
        if self.skip_nonfinite:
            finite = all_finite(results)
        if finite:
            if not early:
                gs = [self._grad(b, r) for b, r in enumerate(results)]
                for i, t in enumerate(self.transforms):
                    tstates[i] = t.update_in_place(gs, tstates[i])
            for b, r in enumerate(results):
                if not updated[b]:
                    update(b, r)
            count.add_(1)
            self.cur = dst
        out = FusedState(count, state.buffers, tuple(tstates))
        self.last = StepRecord(step.n, step.kind, finite, step.timeline())
        return plan.views(self.cur.flats), out, value

    def _grad(self, b: int, reduced: torch.Tensor) -> torch.Tensor:
        """Bucket ``b``'s averaged gradient in the params' dtype (a cast wire is cast once)."""
        bucket = self.plan.buckets[b]
        if reduced.dtype == bucket.dtype:
            return reduced
        buf = self.scratch[b]
        if buf is None:
            buf = self.scratch[b] = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        return buf.copy_(reduced)


def fused_step(cache: dict, fn: Callable, opt: Optimizer, argnums: int, has_aux: bool, accumulate: Any,
               donate: bool, config: dict) -> FusedStep:
    """``Reducer.grad_and_update``: a ``FusedStep`` whose core (plan, buffers, state layout) is
    made on first use and kept in ``cache`` per optimizer, so a step made anew each call (for
    a new ``accumulate=``) reuses it."""
    name = "fdp.Reducer.grad_and_update"
    if argnums != 0:
        raise ValueError(f"{name}: argnums must be 0 (the params are fn's first argument), got {argnums!r}")
    split_chain(opt, name)  # refuse an unsupported optimizer now, not at the first step

    def core_for(params: Any) -> FusedCore:
        entry = cache.get(id(opt))
        if entry is None or entry[0] is not opt:
            entry = cache[id(opt)] = (opt, FusedCore(opt, params, name=name, **config))
        return entry[1]

    return FusedStep(core_for, fn, has_aux, accumulate, donate)


class FusedStep:
    """``reducer.grad_and_update(fn, opt, ...)``: gradient, all-reduce and optimizer in one step.

    ``opt_state = step.init(params)``, then ``params, opt_state, value = step(params,
    opt_state, *rest, **kwargs)`` where ``value`` is what ``reducer.grad_and_value`` returns
    (the loss, or ``(loss, aux)``). The returned params are views into the step's flat
    buffers: passing them back costs nothing; any other tree (changed, loaded, made by hand)
    is packed in (one copy). The optimizer state is flat per bucket and updated in place;
    ``state_to_tree`` / ``state_from_tree`` convert it to and from the per-leaf layout of
    ``opt.init(params)`` (checkpoints that load into the plain path, another plan or world).
    The numbers equal ``reducer.grad`` + ``opt.update`` bit for bit, except with
    ``clip_by_global_norm``, whose norm is summed per bucket instead of per leaf (a different
    summation order: the clip coefficient differs in the last bits).
    """

    def __init__(self, core_for: Callable[[Any], FusedCore], fn: Callable, has_aux: bool, accumulate: Any,
                 donate: bool) -> None:
        self._core_for, self.fn, self.has_aux = core_for, fn, has_aux
        self.accumulate, self.donate = accumulate, donate
        self._core: FusedCore | None = None

    def init(self, params: Any) -> FusedState:
        """A fresh optimizer state for ``params`` (collective the first time: the step's plan is
        checked across ranks)."""
        return self._core_for(params).init(params)

    def __call__(self, params: Any, opt_state: FusedState, *rest: Any, **kwargs: Any) -> tuple[Any, FusedState, Any]:
        self._core = core = self._core_for(params)
        return core.run(self.fn, self.has_aux, params, opt_state, rest, kwargs, self.accumulate, self.donate)

    def update(self, grads: Any, opt_state: FusedState, params: Any, *, active: bool | None = None
               ) -> tuple[Any, FusedState]:
        """Average ``grads`` computed any other way over the ranks and apply the fused update
        (uneven inputs: ``active=False`` ranks pass ``grads=None`` and contribute zeros, as
        ``reducer.all_reduce``)."""
        self._core = core = self._core_for(params)
        out = core.run(self.fn, self.has_aux, params, opt_state, (), {}, None, self.donate,
                       given=True, grads=grads, active=active)
        return out[0], out[1]

    def state_to_tree(self, opt_state: FusedState, params: Any) -> Any:
        """The per-leaf optimizer state, as ``opt.init(params)`` lays it out (a copy)."""
        return self._core_for(params).state_to_tree(opt_state, params)

    def state_from_tree(self, tree_state: Any, params: Any) -> FusedState:
        """A ``FusedState`` from a per-leaf state (``opt.init``'s layout, e.g. loaded)."""
        return self._core_for(params).state_from_tree(tree_state, params)

    @property
    def last_step(self) -> StepRecord | None:
        """The record of the most recent fused step: its finite verdict and a timeline with
        each bucket's update (``BucketTimes.update_start``/``update_end``)."""
        return None if self._core is None else self._core.last
