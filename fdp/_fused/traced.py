"""The fused step inside ``torch.compile``: one graph of the forward, the backward, every
bucket's collective, the chain's transforms, the per-bucket update and (``shard=True``) the
params' all-gather.

The eager fused step runs its updates from hooks inside autograd, which a compiled backward
(one opaque node) cannot call. Traced, the step is written as the pure function it computes:
``torch.func.grad_and_value`` of the loss; per bucket of the Reducer's plan, the fill (the
gradients concatenated, padded to the slices, multiplied by ``1/world`` in the wide dtype and
rounded once to the wire dtype, as ``kernels.flatten``), the collective through
``torch.distributed._functional_collectives`` (an all-reduce, or a reduce-scatter into this
rank's slice), the chain's transforms on the reduced bucket, and the optimizer's kernel per
key over the same spans as the eager step, writing the ``FusedState``'s buffers in place; then,
sharded, one all-gather per bucket of the updated slices. The compiler sees every collective
as a graph node and may schedule it against the compute (docs/compile.md).

So the compiled step takes and returns what the eager one does: the same ``FusedState`` (a
state from a compiled step resumes in an eager one and back), params in the plan's structure
(views of one flat tensor per bucket, graph outputs: an eager step packs them into its own
sets, one copy). What it reads on the host in eager mode is decided at trace time or refused
by name (``refusal``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _internals, _tree
from .._plan.bucket import BucketPlan
from .._slices.geometry import Slices, pieces
from ..optim import GradientTransform
from .engine import Engine
from .program import Program
from .state import FusedState, StateLayout
from .stores import StoreKind

__all__ = ["refusal", "traced_grad_step"]


def refusal(engine: Engine, program: Program, accumulate: Any, uneven: bool) -> str | None:
    """Why this step cannot be traced (None: it can)."""
    config, store = engine.config, engine.store
    if store.kind is StoreKind.UNITS:
        return "fully sharded params (shard='params') gather their units from hooks inside autograd"
    if engine.owners is not None:
        return "whole leaves owned by one rank each (Muon with shard=True) are exchanged point to point"
    if engine.mesh.replicate is not None:
        return "a 2-D mesh sums each slice over the replicas after its reduce-scatter, point to point"
    if config.skip_nonfinite:
        return "skip_nonfinite=True decides on the host whether to update"
    if config.debug:
        return "debug=True compares fingerprints of the buckets on the host"
    if uneven:
        return "uneven=True counts the active ranks on the host"
    if accumulate is not None:
        return "accumulate= adds a gradient tree built outside the step"
    if engine.acc.slices is not None:
        return "reduce_micro_batches=True keeps the micro-batches' sharded sums, reduced by eager calls"
    if program.injected is not None:
        return ("inject_hyperparams binds its values on the host each step; give the optimizer a schedule "
                "(lr=fdp.optim.schedules...), evaluated in the graph from the step count")
    if not config.hook.traceable:
        return f"comm hook {config.hook.name} declares no traced form (CommHook(traced=...))"
    for t in program.transforms:
        if t.reach == "tree" and getattr(t, "may_skip", False):
            return "a global scale that may skip the step decides on the host"
    return None


def traced_grad_step(engine: Engine, program: Program, layout: StateLayout, fn: Callable, has_aux: bool,
                     params: Any, state: FusedState, rest: tuple, kwargs: dict) -> tuple[Any, FusedState, Any]:
    """One fused step as graph nodes (see the module docstring): ``(params, state, value)``."""
    plan, store, bk = engine.plan, engine.store, engine.buckets
    name = engine.name
    _check_state(layout, state, name)
    leaves = plan.leaves_of(params, f"{name} params")
    treedef = _tree.structure(params)  # (dynamo replaces optree's specs: one made inside the trace)
    compute = store.compute
    inputs = [t.detach().to(compute) for t in leaves] if compute is not None else [t.detach() for t in leaves]

    def loss_of(xs: list[torch.Tensor]) -> Any:
        return fn(_tree.unflatten(treedef, xs), *rest, **kwargs)

    grads, value = torch.func.grad_and_value(loss_of, has_aux=has_aux)(inputs)
    acc = engine.acc
    if acc.count:  # step.accumulate's micro-batches (eager calls before this one): added before the mean
        grads = [g + a for g, a in zip(grads, acc.grads)]
        acc.count = 0

    machine, slices = engine.machine, store.slices
    group = engine.mesh.shard if store.scatter is not None else engine.group
    scale = machine.scale_for(engine.group.size)
    hook = engine.config.hook
    reduced = []
    for b, bucket in enumerate(plan.buckets):
        wire = machine.buffers.wire_dtypes[b]
        flat = torch.cat([grads[i].reshape(-1) for i in bucket.leaves])
        if scale is not None:  # multiply in the wide dtype, round once (as kernels.flatten)
            wide = torch.promote_types(torch.promote_types(bucket.dtype, wire), torch.float32)
            flat = flat.to(wide) * scale
        flat = flat.to(wire)
        if store.scatter is not None:
            pad = slices.padded[b] - bucket.numel
            if pad:
                flat = torch.cat([flat, flat.new_zeros(pad)])
            got = _reduce_scatter(flat, group)
        else:
            got = hook.traced(flat, group)
        reduced.append(got.to(bucket.dtype))

    # The chain's transforms, in the eager step's order: the prefix per bucket, the whole-tree
    # ones (a global scale's factor from every leaf's statistic, in leaf order), the suffix.
    tstates = list(state.transforms)
    for i in range(program.prefix):
        for b in range(len(reduced)):
            tstates[i] = _apply(program.transforms[i], plan, slices, b, reduced[b], tstates[i])
    for i in range(program.prefix, program.last_tree + 1):
        t: GradientTransform = program.transforms[i]
        if t.reach != "tree":
            for b in range(len(reduced)):
                tstates[i] = _apply(t, plan, slices, b, reduced[b], tstates[i])
            continue
        stats = _leaf_stats(t, plan, store, group, reduced)
        factor, tstates[i] = t.scale(stats, tstates[i])
        if factor is None:
            raise RuntimeError(f"{name}: the global scale at part {i} of the chain skipped the step under "
                               "torch.compile, which cannot skip a step on the host; run this step eagerly")
        for g in reduced:
            g.mul_(factor)
    for i in program.suffix:
        for b in range(len(reduced)):
            tstates[i] = _apply(program.transforms[i], plan, slices, b, reduced[b], tstates[i])

    # The updates: per bucket, one kernel call per key over its spans, as the eager ``Run.update``.
    kernels = program.default_kernels if program.injected is None and state.hyperparams is None \
        else program.kernels(state.hyperparams)
    counts = [state.step if part.count_dtype in (None, state.step.dtype) else state.step.to(part.count_dtype)
              for part in program.parts]
    buffers, keys = state.buffers, layout.keys
    out = []
    for b, bucket in enumerate(plan.buckets):
        p = torch.cat([leaves[i].detach().reshape(-1) for i in bucket.leaves])
        if store.scatter is not None:
            pad = slices.padded[b] - bucket.numel
            if pad:
                p = torch.cat([p, p.new_zeros(pad)])
            p = p[slices.lo[b]:slices.hi[b]].clone()
        g = reduced[b]
        for part, spans in bk.decays[b]:
            kernels[part].decay(pieces(p, spans, False), counts[part])
        if bk.whole[b]:
            (part, grp), _ = bk.spans.by_key[b][0]
            kernels[part].step(grp, [p], [g], [[buffers[k][b]] for k in keys[part]], counts[part])
        else:
            for (part, grp), spans in bk.spans.by_key[b]:
                states = [buffers[k][b] for k in keys[part]]
                kernels[part].step(grp, pieces(p, spans, False), pieces(g, spans, False),
                                   [pieces(s, spans, True) for s in states], counts[part])
        if store.scatter is not None:
            p = _all_gather(p, group)
        out.append(p)
    state.step.add_(1)
    new = plan.views(out, treedef)
    return new, state._replace(transforms=tuple(tstates)), _detached(value)


def _views(flat: torch.Tensor, bucket: Any) -> list[torch.Tensor]:
    return [flat[off:off + n].view(shape) for off, n, shape in zip(bucket.offsets, bucket.numels, bucket.shapes)]


def _apply(t: GradientTransform, plan: BucketPlan, slices: Slices, b: int, g: torch.Tensor, tstate: Any) -> Any:
    """A per-element or per-leaf transform on bucket ``b``'s reduced (slice of the) gradient, in place."""
    tensors = [g] if t.reach == "element" else _views(g, plan.buckets[b])
    return t.apply(tensors, tstate)


def _leaf_stats(t: GradientTransform, plan: BucketPlan, store: Any, group: Any,
                reduced: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf's statistic for the global scale ``t``, in leaf order. Sharded, each leaf is
    measured whole on one rank (those that cross a slice boundary sent there first, one
    all-to-all per bucket that has any), and the statistics put together with one all-reduce
    in which each leaf has one non-zero contribution: exact, as the eager ``Straddles``."""
    straddles = store.straddles
    if straddles is None:
        stats: list[torch.Tensor] = []
        for b in range(len(reduced)):
            stats.extend(t.stats(_views(reduced[b], plan.buckets[b])))
        order = [i for bucket in plan.buckets for i in bucket.leaves]
        by_leaf = dict(zip(order, stats))
        return [by_leaf[i] for i in range(len(plan.slots))]
    own: dict[int, torch.Tensor] = {}
    for b in range(len(reduced)):
        leaves, views = straddles.inside_views(b, reduced[b])
        own.update(zip(leaves, t.stats(views)))
    for b in straddles.buckets:
        leaves, wholes = _exchange(straddles, reduced, group, b)
        if leaves:
            own.update(zip(leaves, t.stats(wholes)))
    slots = plan.slots
    vec = torch.zeros(len(slots), dtype=torch.float64, device=reduced[0].device if reduced else None)
    parts = [own[i].reshape(1).to(torch.float64) if i in own else vec.new_zeros(1) for i in range(len(slots))]
    vec = _all_reduce(torch.cat(parts), group)
    return [vec[i].to(own[i].dtype if i in own else slots[i].dtype) for i in range(len(slots))]


def _exchange(straddles: Any, grads: list[torch.Tensor], group: Any, b: int) -> tuple[list[int], list[torch.Tensor]]:
    """``Straddles.exchange`` as graph nodes: the straddling leaves of bucket ``b`` this rank
    owns, whole (one ``all_to_all_single`` in the params' dtype)."""
    s, slots = straddles.slices, straddles.plan.slots
    sends, recvs = straddles.sends[b], straddles.recvs[b]
    g = grads[b]
    out_parts = [g[lo - s.lo[b]:hi - s.lo[b]] for j in range(s.size) for _, lo, hi in sends[j]]
    send = torch.cat(out_parts) if out_parts else g.new_zeros(0)
    in_sizes = [sum(hi - lo for _, lo, hi in sends[j]) for j in range(s.size)]
    out_sizes = [sum(hi - lo for _, lo, hi in recvs[k]) for k in range(s.size)]
    funcol = _internals.functional_collectives()
    recv = funcol.wait_tensor(funcol.all_to_all_single(send, out_sizes, in_sizes, group.process_group))
    got: dict[int, list[torch.Tensor]] = {}
    pos = 0
    for k in range(s.size):
        for i, lo, hi in recvs[k]:
            got.setdefault(i, []).append(recv[pos:pos + hi - lo])
            pos += hi - lo
    leaves, wholes = [], []
    for i, off in straddles.mine[b]:
        own = g[off - s.lo[b]:s.hi[b] - s.lo[b]]
        leaves.append(i)
        wholes.append(torch.cat([own, *got[i]]).view(slots[i].shape))
    return leaves, wholes


def _reduce_scatter(flat: torch.Tensor, group: Any) -> torch.Tensor:
    funcol = _internals.functional_collectives()
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(flat, "sum", 0, group.process_group))


def _all_gather(flat: torch.Tensor, group: Any) -> torch.Tensor:
    funcol = _internals.functional_collectives()
    return funcol.wait_tensor(funcol.all_gather_tensor(flat, 0, group.process_group))


def _all_reduce(flat: torch.Tensor, group: Any) -> torch.Tensor:
    funcol = _internals.functional_collectives()
    return funcol.wait_tensor(funcol.all_reduce(flat, "sum", group.process_group))


def _check_state(layout: StateLayout, state: Any, name: str) -> None:
    """What of ``StateLayout.check`` can be decided at trace time: the type, the fields and each
    buffer's size and dtype (the layout tensor's digest is compared on the host, eagerly)."""
    if not isinstance(state, FusedState):
        raise TypeError(f"{name}: opt_state must be the FusedState of step.init(params) (or "
                        f"step.state_from_tree), got {type(state).__name__}")
    keys = [key for ks in layout.keys for key in ks]
    if set(state.buffers) != set(keys) or len(state.transforms) != len(layout.transforms):
        raise ValueError(f"{name}: opt_state has fields {sorted(state.buffers)} and {len(state.transforms)} "
                         f"transform states; this optimizer keeps {sorted(keys)} and {len(layout.transforms)}")
    for k, ks in enumerate(layout.keys):
        for key in ks:
            flats = state.buffers[key]
            if len(flats) != len(layout.plan.buckets) or any(
                    t.numel() != layout.mine.sizes[b.index][k] or t.dtype != b.dtype
                    for t, b in zip(flats, layout.plan.buckets)):
                raise ValueError(f"{name}: opt_state.buffers[{key!r}] does not match this step's buckets (a state "
                                 "made for another plan, world size or sharding?)")


def _detached(value: Any) -> Any:
    return _tree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)
