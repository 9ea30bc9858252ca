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

from collections.abc import Callable
from typing import Any

import torch

from .. import _tree, kernels
from .._comm.agree import count_and_check_active, verify_layout
from .._comm.collectives import all_reduce
from .._comm.mesh import Mesh
from .._plan.bucket import BucketPlan, contiguous_strides
from .._plan.buffers import BucketBuffers, held_elsewhere
from .._step import functorch
from .._step.autodiff import local_grads
from .._step.machine import StepMachine
from .._step.record import StepRecord
from ..hooks import CommHook
from ..optim import Optimizer
from ..optim._flat import split_chain
from .run import Run
from .shard import Scatter, Shards
from .state import FusedState, StateLayout

__all__ = ["FusedState", "FusedStep"]



class ParamSet:
    """One set of flat param buffers and the data pointers of the leaves' views into it."""

    __slots__ = ("flats", "ptrs")

    def __init__(self, flats: list[torch.Tensor], ptrs: list[int]) -> None:
        self.flats, self.ptrs = flats, ptrs


class FusedCore:
    """What a (Reducer, optimizer) pair keeps across steps: plan, machine, param sets, state layout."""

    def __init__(self, opt: Optimizer, params: Any, *, mesh: Mesh, shard: bool, hook: CommHook,
                 caps: tuple[int, ...], wire: torch.dtype | None, debug: bool, hook_threshold_bytes: int,
                 engine: str, skip_nonfinite: bool, name: str) -> None:
        self.opt, self.name = opt, name
        self.transforms, optimizer = split_chain(opt, name, sharded=shard)
        self.kernel = optimizer.leaf_kernel
        self.mesh, self.group = mesh, mesh.full
        self.engine, self.skip_nonfinite = engine, skip_nonfinite
        self.groups = [int(g) for g in self.kernel.groups(params)]
        self.plan = BucketPlan.from_caps(params, caps, groups=self.groups)
        sg = mesh.shard
        self.shards = Shards(self.plan, sg.size, sg.rank) if shard else Shards(self.plan, 1, 0)
        self.scatter: Scatter | None = None
        if shard:  # (the Reducer has checked that the hook sums in place)
            scatter = self.scatter = Scatter(self.shards, sg)
            hook = CommHook(lambda bucket, flat, group: scatter.launch(bucket.index, flat), dtype=hook.dtype,
                            name=f"{hook.name}, sharded", in_place=True)
        wires = [wire or b.dtype for b in self.plan.buckets]
        buffers = BucketBuffers(self.plan, wires, reuse=True, padded=self.shards.padded)
        self.machine = StepMachine(self.plan, self.group, hook, buffers, debug=debug,
                                   hook_threshold_bytes=hook_threshold_bytes)
        self.layout = StateLayout(opt, self.transforms, self.plan, self.shards, sg, name)
        self.elementwise = all(t.elementwise for t in self.transforms)
        self.sets: list[ParamSet] = []    # param sets in use (at most two are tracked)
        self.cur: ParamSet | None = None  # the set holding the current params
        self.scratch: list[torch.Tensor | None] = [None] * len(self.plan.buckets)  # fp32 grads of a cast wire
        self.broken: str | None = None
        self.last: StepRecord | None = None
        where = "" if not shard else (f", sharded over {sg.size} ranks" + (
            f" x {mesh.replicate.size} replicas" if mesh.replicate is not None else ""))
        verify_layout(
            [(s.path, s.shape, str(s.dtype).replace("torch.", "")) for s in self.plan.slots], self.group, name,
            extra=f"param groups {self.groups}, bucket caps {list(caps)}, {hook.describe()}{where}",
        )

    # ------------------------------------------------------------------ params
    def _new_set(self) -> ParamSet:
        flats = [torch.zeros(n, dtype=b.dtype, device=b.device) for b, n in zip(self.plan.buckets, self.shards.padded)]
        ptrs = [flats[s.bucket].data_ptr() + s.offset * flats[s.bucket].element_size() for s in self.plan.slots]
        new = ParamSet(flats, ptrs)
        self.sets.append(new)
        return new

    def current(self, leaves: list[torch.Tensor], donate: bool) -> tuple[ParamSet, bool]:
        """The set holding ``leaves`` and whether it is a fresh copy: the current set when
        they are its views (no copy), else a set they are packed into (a tree the caller
        changed or made). A fresh copy is fdp's alone, so even a pure step updates it in
        place (the caller's tree is untouched either way): a packing step holds two
        params-sized sets, the caller's and the copy, not three.

        Donated, the caller's tensors are consumed: each packed leaf is re-pointed at its
        place in the set (``Tensor.set_``), so its old memory is freed now if nothing else
        holds it (a tree loaded from a checkpoint), rather than living beside the set."""
        ptrs = list(map(torch.Tensor.data_ptr, leaves))
        if self.cur is not None and ptrs == self.cur.ptrs:
            return self.cur, False
        target = self.free_set(avoid=self.cur)  # the tree may still hold views of the current set
        for b, flat in zip(self.plan.buckets, target.flats):
            if not donate:
                kernels.flatten([leaves[i] for i in b.leaves], flat[:b.numel])
                continue
            storage = flat.untyped_storage()
            for i, off, n in zip(b.leaves, b.offsets, b.numels):  # leaf by leaf: one leaf's memory extra at most
                t = leaves[i]
                flat[off:off + n].view(t.shape).copy_(t)
                # (not a view: set_ would leave its autograd view metadata pointing at the base)
                if type(t) is torch.Tensor and not t.requires_grad and t._base is None and t.dtype == flat.dtype:
                    t.set_(storage, off, t.shape, contiguous_strides(t.shape))
        self.cur = target
        return target, True

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
        state = self.layout.init(params)
        self.broken = None  # a fresh state: a failed step's partial update is behind us
        return state

    def check_state(self, state: Any) -> FusedState:
        if self.broken is not None:
            raise RuntimeError(f"{self.name}: {self.broken}")
        return self.layout.check(state)

    def state_from_tree(self, tree_state: Any, params: Any) -> FusedState:
        state = self.layout.from_tree(tree_state, params)
        self.broken = None
        return state

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """Combine ``t`` over the shard group in place (``update_sharded``'s ``reduce``)."""
        all_reduce(t, self.mesh.shard, f"{self.name}: combining a transform's per-slice values", op=op)
        return t

    # ------------------------------------------------------------------ one step
    def run(self, fn: Callable, has_aux: bool, params: Any, state: Any, rest: tuple, kwargs: dict,
            accumulate: Any, donate: bool, *, given: bool = False, grads: Any = None,
            active: bool | None = None) -> tuple:
        """One fused step. ``given`` (``FusedStep.update``): no backward; ``grads`` are reduced."""
        if _tree.compiling():
            raise RuntimeError(f"{self.name} cannot be traced by torch.compile (its per-bucket updates "
                               "run from hooks inside autograd); compile a step of torch.func.grad, "
                               "reducer.all_reduce and opt.update instead (docs/compile.md)")
        if functorch.in_transform():
            raise RuntimeError(f"{self.name} cannot run inside a torch.func transform")
        state = self.check_state(state)
        plan, machine = self.plan, self.machine
        src, packed = self.current(plan.leaves_of(params, f"{self.name} params"), donate)
        dst = src if donate or packed else self.free_set(avoid=src)
        acc = None
        if accumulate is not None:
            acc = plan.leaves_of(accumulate, f"{self.name} accumulate")
        if not given:
            step = machine.start("grad", acc=acc, scale=machine.scale_for(self.group.size), what=self.name)
        else:
            n = count_and_check_active(active, self.group, f"{self.name}: active-rank count")
            if n == 0:
                raise ValueError(f"{self.name}: no rank is active; stop the loop when fdp.any_rank(has_data) is False")
            is_active = active is None or bool(active)
            glist = plan.leaves_of(grads, f"{self.name} grads") if is_active else None
            step = machine.start("all_reduce", scale=machine.scale_for(n), active=is_active, what=self.name)
        run = Run(self, step, state, src, dst)
        step.on_ready = run.arrive
        try:
            if not given:
                leaves = plan.views(src.flats)  # (the padding of a sharded step's flats is left out)
                local, value = local_grads(self.engine, fn, 0, has_aux, (leaves, *rest), kwargs,
                                           _tree.leaves(leaves), plan.treedef, machine.leaf_hooks[self.engine],
                                           step.on_backward_start)
                step.backward_done(local, machine.unhooked)
            else:
                value = None
                if glist is not None:
                    step.give(glist)
                step.launch_ready(force=True)
            machine.finish(step)
            run.reduced()
        except BaseException as e:
            if machine.in_flight is step:  # failed before finish: keep the ranks in step
                machine.abort(step, e)
            run.drain()
            if any(run.updated):
                self.broken = (f"step {step.n} failed after {sum(run.updated)} of {len(plan.buckets)} buckets "
                               "had updated the optimizer state in place (and with donate=True the params); load "
                               "a saved state (step.state_from_tree) or make a new one (step.init) to go on")
            raise
        finite = run.finish()
        if finite:
            state.step.add_(1)
            self.cur = dst
        out = state._replace(transforms=tuple(run.tstates))
        self.last = StepRecord(step.n, step.kind, finite, step.timeline())
        return plan.views(self.cur.flats), out, value

    def grad_of(self, b: int, reduced: torch.Tensor) -> torch.Tensor:
        """Bucket ``b``'s (slice of the) averaged gradient in the params' dtype (a cast wire is
        cast once)."""
        bucket = self.plan.buckets[b]
        if reduced.dtype == bucket.dtype:
            return reduced
        buf = self.scratch[b]
        if buf is None:
            buf = self.scratch[b] = torch.empty(reduced.numel(), dtype=bucket.dtype, device=bucket.device)
        return buf.copy_(reduced)


def fused_step(cache: dict, fn: Callable, opt: Optimizer, argnums: int, has_aux: bool, accumulate: Any,
               donate: bool, config: dict) -> FusedStep:
    """``Reducer.grad_and_update``: a ``FusedStep`` whose core (plan, buffers, state layout) is
    made on first use and kept in ``cache`` per optimizer, so a step made anew each call (for
    a new ``accumulate=``) reuses it."""
    name = "fdp.Reducer.grad_and_update"
    if argnums != 0:
        raise ValueError(f"{name}: argnums must be 0 (the params are fn's first argument), got {argnums!r}")
    split_chain(opt, name, sharded=config["shard"])  # refuse an unsupported optimizer now, not at the first step

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

    Sharded (``Reducer(..., shard=True)``), each rank keeps only its slice of every bucket's
    optimizer state (``FusedState.buffers`` holds slices): a bucket's gradients are
    reduce-scattered, each rank updates its slice of the params, and the params are
    all-gathered (docs/concepts.md, "Sharded optimizer state"). On two ranks the numbers equal
    the unsharded step's bit for bit; on more, the gradient sums may round differently.
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
        """The per-leaf optimizer state, as ``opt.init(params)`` lays it out (a copy). Sharded
        (``Reducer(shard=True)``), a collective: every rank's slices are gathered, and every
        rank gets the whole state (save it with ``fdp.save``; it loads into any world size,
        plan, or the unsharded step)."""
        core = self._core_for(params)
        return core.layout.to_tree(core.check_state(opt_state), params)

    def state_from_tree(self, tree_state: Any, params: Any) -> FusedState:
        """A ``FusedState`` from a per-leaf state (``opt.init``'s layout, e.g. loaded)."""
        return self._core_for(params).state_from_tree(tree_state, params)

    @property
    def last_step(self) -> StepRecord | None:
        """The record of the most recent fused step: its finite verdict and a timeline with
        each bucket's update (``BucketTimes.update_start``/``update_end``)."""
        return None if self._core is None else self._core.last
