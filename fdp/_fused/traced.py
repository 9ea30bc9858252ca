"""The fused step inside ``torch.compile``: one graph of the forward, the backward, every
bucket's collective, the chain's transforms, the per-bucket update and (``shard=True``) the
params' all-gather.

The eager fused step runs its updates from hooks inside autograd, which a compiled backward
(one opaque node) cannot call. Traced, the step is written as the pure function it computes:
the gradients of the loss (``torch.func.grad_and_value``, or ``torch.autograd.grad`` where
dynamo traces it, which also runs activation checkpointing); per bucket of the Reducer's
plan, the fill (the gradients concatenated, padded to the slices, multiplied by ``1/world``
in the wide dtype and rounded once to the wire dtype, as ``kernels.flatten``), the collective
through ``torch.distributed._functional_collectives`` (an all-reduce, or a reduce-scatter
into this rank's slice), the chain's transforms on the reduced bucket (a sharded clip's
per-leaf norms measured whole, as the eager ``Straddles``), and the optimizer's kernel per key
over the same spans as the eager step, writing the ``FusedState``'s buffers in place (Muon's
matrices exchanged with their owners, as the eager ``Owners``); then, with ``shard=True``, one
all-gather per bucket of the updated slices. With ``shard="params"`` every bucket's slice is
all-gathered (in ``param_dtype``) at the start, and the updated slices are the result. The
compiler sees every collective as a graph node and may schedule it against the compute
(docs/compile.md).

So the compiled step takes and returns what the eager one does: the same ``FusedState`` (a
state from a compiled step resumes in an eager one and back), params in the plan's structure
(views of one flat tensor per bucket, graph outputs: an eager step packs them into its own
sets, one copy), ``ShardedParams`` when fully sharded. What the eager step reads on the host
is decided at trace time or refused by name (``refusal``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _internals, _tree
from .._comm import traced as comm
from .._plan.bucket import BucketPlan
from .._slices.exchange import Straddles
from .._slices.geometry import Slices
from .._step.traced import traced_fill
from .._units.params import ShardedParams
from ..optim import GradientTransform
from .program import Program
from .state import FusedState, StateLayout
from .stores import StoreKind

__all__ = ["Order", "orders", "refusal", "traced_accumulate", "traced_grad_step"]


def refusal(engine: Any, program: Program, accumulate: Any, uneven: bool, compiled_step: bool = False
            ) -> str | None:
    """Why this step cannot be traced (None: it can); ``compiled_step``: asked by
    ``fdp.CompiledStep``, which reads an injected optimizer's host values itself."""
    config = engine.config
    if config.debug:
        return "debug=True compares fingerprints of the buckets on the host"
    if uneven:
        return "uneven=True counts the active ranks on the host"
    if accumulate is not None:
        return "accumulate= adds a gradient tree built outside the step"
    if program.injected is not None and program.traced is None and not compiled_step:
        return ("inject_hyperparams reads some values on the host before each step (betas, eps, momentum: a new "
                "value compiles the step anew); compile the step with step.compile(), which reads them, or give "
                "the optimizer a schedule (lr=fdp.optim.schedules...), evaluated in the graph from the step count")
    if not config.hook.traceable:
        return f"comm hook {config.hook.name} declares no traced form (CommHook(traced=...))"
    for t in program.transforms:  # (a global scale that decides on the host declares it on its scale)
        why = getattr(t.scale, "host_decision", None)
        if why is not None:
            return why
    return None


def traced_grad_step(engine: Any, program: Program, layout: StateLayout, fn: Callable, has_aux: bool,
                     params: Any, state: FusedState, rest: tuple, kwargs: dict, donate: bool = False
                     ) -> tuple[Any, FusedState, Any]:
    """One fused step as graph nodes (see the module docstring): ``(params, state, value)``;
    ``donate``: the new params (with fully sharded params, the new slices) are written into the
    given ones, which the step returns (as the eager step writes them): no second copy of them
    outlives the step."""
    # (fdp's own bookkeeping, which never changes once made, read as constants: dynamo checks
    # before each call that they are the same objects, not each number in them; methods are
    # called on the engine's own plan, which takes itself as a constant for what they read)
    plan, orders = _internals.frozen(engine, "plan"), _internals.frozen(engine, "orders")
    store, bk = engine.store, engine.buckets
    name = engine.name
    layout.check(state)  # (under compile without the layout tensor's host comparison)
    machine, slices = engine.machine, store.slices
    group = engine.mesh.shard if store.scatter is not None else engine.group
    units = store.kind is StoreKind.UNITS
    if units:
        # Fully sharded: each bucket's slice all-gathered in the units' dtype (param_dtype),
        # the loss differentiated in the whole leaves, their gradients reduce-scattered below.
        if not isinstance(params, ShardedParams):
            raise TypeError(f"{name}: with shard='params' the step takes the fdp.ShardedParams of "
                            f"step.shard(params) (or of the step), got {type(params).__name__}")
        own = list(params.flats)
        fulls = []
        for b in range(len(plan.buckets)):
            mine = own[b].detach().to(store.units.fulls[b].dtype)
            fulls.append(comm.traced_all_gather(mine, group, tag=2 * b + 1) if store.scatter is not None else mine)
        # (dynamo replaces optree's specs: the params' structure is flattened inside the trace,
        # from the plan's tree of leaf indices, made eagerly with the engine)
        treedef = _tree.structure(engine.skeleton)
        inputs = _tree.leaves(engine.plan.views(fulls, treedef))
        leaves = None
    else:
        leaves, treedef, inputs = _whole_inputs(engine.plan, store, params, f"{name} params")
    grads, value = _grad_and_value(_loss_of(fn, treedef, rest, kwargs), has_aux, inputs, name)
    acc = engine.acc
    sums = None
    if acc.count:  # step.accumulate's micro-batches (eager calls before this one)
        if acc.slices is not None:  # reduce_micro_batches: this rank's slices of their reduced sum, added below
            sums, acc.slices = acc.slices, None
        else:  # their local sum, added before the mean
            held = acc.grads
            if acc.flats is not None:  # (read as the flat buffers they lie in: one graph input a bucket, not a leaf)
                held = [None] * len(grads)
                for bucket, flat in zip(plan.buckets, acc.flats):
                    for i, view in zip(bucket.leaves, _views(flat, bucket)):
                        held[i] = view
            grads = [g + a for g, a in zip(grads, held)]
        acc.count = 0

    scale = machine.scale_for(engine.group.size)
    hook = engine.config.hook
    reduced = []
    for b, bucket in enumerate(plan.buckets):
        flat = traced_fill([grads[i] for i in bucket.leaves], bucket.dtype, machine.buffers.wire_dtypes[b], scale)
        if store.scatter is not None:
            pad = slices.padded[b] - bucket.numel
            if pad:
                flat = torch.cat([flat, flat.new_zeros(pad)])
            got = comm.traced_reduce_scatter(flat, group, tag=2 * b)
            if engine.mesh.replicate is not None:  # a 2-D mesh: the slice summed over the replicas, as eagerly
                got = comm.traced_all_reduce(got, engine.mesh.replicate)
        else:
            got = hook.traced(flat, group)
        got = got.to(bucket.dtype)
        if sums is not None:  # (the micro-batches' sum first, as the eager step adds them: FSDP2's order)
            got = sums[b] + got
        reduced.append(got)

    # skip_nonfinite: the reduced gradients' finite check (every rank's, sharded), made before
    # the transforms; the update below is computed either way and kept where it passed
    ok = _all_finite(reduced, group if store.scatter is not None else None) if engine.config.skip_nonfinite else None

    # The chain's transforms, in the eager step's order: the prefix per bucket, the whole-tree
    # ones (a global scale's factor from every leaf's statistic, in leaf order), the suffix.
    tstates = list(state.transforms)
    goes: list[tuple[int, torch.Tensor]] = []  # the verdicts of the scales that may skip the step, by part
    # What every all-to-all received (``_exchange_parts``): a rank may receive nothing it uses
    # (no leaf of its own crosses a slice boundary, it owns no Muon matrix), and a graph pass
    # would then drop the collective on that rank alone, leaving the others waiting for it.
    received: list[torch.Tensor] = []
    for i in range(program.prefix):
        for b in range(len(reduced)):
            tstates[i] = _apply(program.transforms[i], plan, slices, b, reduced[b], tstates[i])
    for i in range(program.prefix, program.last_tree + 1):
        t: GradientTransform = program.transforms[i]
        if t.reach != "tree":
            for b in range(len(reduced)):
                tstates[i] = _apply(t, plan, slices, b, reduced[b], tstates[i])
            continue
        stats = _leaf_stats(t, plan, store, group, reduced, received)
        verdict = getattr(t.scale, "traced", None)
        if verdict is not None:  # a scale that may skip the step (loss_scale): its verdict a tensor
            factor, go, tstates[i] = verdict(stats, tstates[i])
            goes.append((i, go))
        else:
            factor, tstates[i] = t.scale(stats, tstates[i])
        if factor is None:
            raise RuntimeError(f"{name}: the global scale at part {i} of the chain skipped the step under "
                               "torch.compile, which cannot skip a step on the host; run this step eagerly")
        for g in reduced:
            g.mul_(factor)
    for i in program.suffix:
        for b in range(len(reduced)):
            tstates[i] = _apply(program.transforms[i], plan, slices, b, reduced[b], tstates[i])
    ok, taken = _verdict(ok, goes, program, len(tstates))

    # The updates: per bucket, one kernel call per key over its spans, as the eager ``Run.update``.
    injected = program.traced  # (fdp.CompiledStep's, made for this call's values; else no injected optimizer)
    if injected is not None:  # the lr read in the graph from the state's tensor
        for k, held in injected.held.items():
            held.value = state.hyperparams[k]
        kernels = [injected.optimizer.form.leaf_kernel]
    else:
        kernels = program.default_kernels
    counts = [state.step if part.count_dtype in (None, state.step.dtype) else state.step.to(part.count_dtype)
              for part in program.parts]
    buffers, keys = state.buffers, layout.keys
    owners = engine.owners
    wholes: dict[int, torch.Tensor] = {}
    owned: dict[int, torch.Tensor] = {}
    if owners is not None:
        # Whole leaves (Muon's matrices), each updated whole by its owner: their reduced
        # gradients sent there (one all-to-all), and, fully sharded, their params too (whole
        # params on every rank otherwise: the owner takes its own from the input leaves).
        wholes = _to_owners(owners, reduced, group, received)
        owned = _to_owners(owners, own, group, received) if units else {
            i: leaves[i].detach().clone() for i in owners.mine}
    out, before = [], []
    for b, bucket in enumerate(plan.buckets):
        if units:
            p = own[b].detach()
        else:
            p = torch.cat([leaves[i].detach().reshape(-1) for i in bucket.leaves])
        if store.scatter is not None and not units:
            pad = slices.padded[b] - bucket.numel
            if pad:
                p = torch.cat([p, p.new_zeros(pad)])
            p = p[slices.lo[b]:slices.hi[b]]
        before.append(p)
        out.append(_update_bucket(bk, b, p, reduced[b], kernels, counts, [[buffers[k][b] for k in ks] for ks in keys],
                                  owned, wholes, orders[b], ok))
    if injected is not None:
        for held in injected.held.values():
            held.value = None
    if owners is not None:  # the owners' updated leaves into the slices that hold them
        _to_holders(owners, out, owned, group, received)
    if received and out:  # every exchange's first byte (a zero) into the params: never dropped
        out[0] = out[0] - torch.stack([r[:1] for r in received]).to(out[0].dtype).sum()  # (x - +0.0 is x)
    if ok is not None:  # a skipped step keeps the params, and each part's state as the eager step does
        out = [torch.where(ok, new, old) for new, old in zip(out, before)]
        tstates = [_kept(keep, t, old) for keep, t, old in zip(taken, tstates, state.transforms)]
        verdicts = engine.verdicts
        verdicts.finite.copy_(ok)
        verdicts.skipped.add_((~ok).to(verdicts.skipped.dtype))
        engine.traced_last = engine.decided = True  # (dynamo replays these after each call of the graph)
    if units and donate:  # the new slices into the given ones, returned as given (no output aliases an input)
        for mine, new_slice in zip(own, out):
            mine.copy_(new_slice)
    if store.gathers_params:
        out = [comm.traced_all_gather(p, group, tag=2 * b + 1) for b, p in enumerate(out)]
    state.step.add_(1 if ok is None else ok.to(state.step.device, state.step.dtype))
    if units:
        new = params if donate else ShardedParams(store.units, out)
    elif donate:  # the new params into the given leaves (no second set lives on between steps)
        for b, bucket in enumerate(plan.buckets):
            for i, view in zip(bucket.leaves, _views(out[b], bucket)):
                leaves[i].copy_(view)
        new = params
    else:
        new = engine.plan.views(out, treedef)
    return new, state._replace(transforms=tuple(tstates)), _detached(value)


def traced_accumulate(engine: Any, fn: Callable, has_aux: bool, params: Any, rest: tuple, kwargs: dict,
                      first: bool) -> Any:
    """``step.accumulate`` as graph nodes (unsharded and ``shard=True``): this rank's gradients
    of one micro-batch written (``first``) or added into the engine's flat accumulation
    buffers, as the eager ``step.accumulate`` adds them (``fdp/_fused/stores.py``). The caller
    keeps the count, eagerly. Returns the value, detached."""
    plan, acc = _internals.frozen(engine, "plan"), engine.acc  # (the plan a constant: see ``traced_grad_step``)
    _, treedef, inputs = _whole_inputs(engine.plan, engine.store, params, f"{engine.name}.accumulate params")
    grads, value = _grad_and_value(_loss_of(fn, treedef, rest, kwargs), has_aux, inputs, engine.name)
    for b, bucket in enumerate(plan.buckets):
        flat = torch.cat([grads[i].reshape(-1) for i in bucket.leaves]).to(bucket.dtype)
        if first:
            acc.flats[b].copy_(flat)
        else:
            acc.flats[b].add_(flat)
    return _detached(value)


class Order(NamedTuple):
    """One bucket's runs as a traced update takes them, made eagerly with the engine (no sort
    at trace time: dynamo cannot sort ints it has made symbolic, which it does to the ints of a
    second step compiled in the same process): per key its runs (the eager spans with their
    chunks put back together); the non-owned runs by position in the (slice of the) bucket,
    ``(key index, run index)``; per part its runs by position in the part's state; the runs
    decayed first, per part decayed apart, and all of them by position."""

    by_key: list[tuple[Any, list[Any]]]
    params: list[tuple[int, int]]
    states: list[list[tuple[int, int]]]
    decays: list[tuple[int, list[Any]]]
    decay_order: list[tuple[int, int]]


def orders(bk: Any, parts: int) -> list[Order]:
    """Every bucket's ``Order`` (see there), from the engine's ``Buckets``."""
    out = []
    for b in range(len(bk.plan.buckets)):
        by_key = [(key, _merged(spans)) for key, spans in bk.spans.by_key[b]]
        runs = [(k, j, sp) for k, (_, spans) in enumerate(by_key) for j, sp in enumerate(spans)]
        params = [(k, j) for k, j, sp in sorted(runs, key=lambda r: r[2].lo) if not sp.owned]
        states = [[(k, j) for k, j, sp in sorted(runs, key=lambda r: r[2].at) if by_key[k][0][0] == part]
                  for part in range(parts)]
        decays = [(part, _merged(spans)) for part, spans in bk.decays[b]]
        decay_order = [(d, j) for d, j, sp in sorted(((d, j, sp) for d, (_, spans) in enumerate(decays)
                                                      for j, sp in enumerate(spans)), key=lambda r: r[2].lo)]
        out.append(Order(by_key, params, states, decays, decay_order))
    return out


def _update_bucket(bk: Any, b: int, p: torch.Tensor, g: torch.Tensor, kernels: list, counts: list,
                   states: list[list[torch.Tensor]], owned: dict[int, torch.Tensor],
                   wholes: dict[int, torch.Tensor], order: Order, ok: torch.Tensor | None = None) -> torch.Tensor:
    """Bucket ``b``'s (slice of the) params after the update, the state's buffers ``states``
    (per part, per field) written in place: the eager ``Run.update``'s kernel calls, per key
    over its spans, written for a graph. No kernel writes into a view: each run of a key is a
    copy of its own (a write into a view of a larger tensor becomes, in the graph, a new copy
    of the whole of it), and the results are put together with one ``cat`` per tensor; a run
    is not cut into the eager step's cache-sized chunks (the compiler makes its own loops).
    ``ok`` (``skip_nonfinite``): the state's buffers are written where it holds, else kept
    (the params are selected by the caller)."""
    by_key = order.by_key
    if ok is None and len(by_key) == 1 and not order.decays and len(by_key[0][1]) == 1:
        (part, grp), (span,) = by_key[0]
        if span.shape is None and not span.owned and span.lo == 0 and span.hi == p.numel() \
                and all(t.numel() == p.numel() for t in states[part]):
            p = p.clone()  # (one run over the whole bucket: the tensors themselves)
            kernels[part].step(grp, [p], [g], [[t] for t in states[part]], counts[part])
            return p
    if order.decays:  # a part decayed apart: its group-0 runs decayed first, in copies
        done = []
        for part, spans in order.decays:
            runs = [p[sp.lo:sp.hi].clone() for sp in spans]
            kernels[part].decay(runs, counts[part])
            done.append(runs)
        p = _assembled(p, [(order.decays[d][1][j].lo, done[d][j]) for d, j in order.decay_order])
    new_p: dict[tuple[int, int], torch.Tensor] = {}
    new_states: list[list[dict[tuple[int, int], torch.Tensor]]] = [[{} for _ in fields] for fields in states]
    for k, ((part, grp), spans) in enumerate(by_key):
        if not spans:
            continue
        if spans[0].owned:  # whole leaves this rank owns (sharded Muon): updated apart, in their shapes
            ps, gs = [owned[sp.leaf] for sp in spans], [wholes[sp.leaf] for sp in spans]
        else:
            ps = [_shaped(p[sp.lo:sp.hi].clone(), sp) for sp in spans]
            gs = [_shaped(g[sp.lo:sp.hi], sp) for sp in spans]
            new_p.update(((k, j), t) for j, t in enumerate(ps))
        runs = [[_shaped(t[sp.at:sp.at + sp.hi - sp.lo].clone(), sp) for sp in spans] for t in states[part]]
        kernels[part].step(grp, ps, gs, runs, counts[part])
        for field, got in zip(new_states[part], runs):
            field.update(((k, j), t) for j, t in enumerate(got))
    for part, (fields, news) in enumerate(zip(states, new_states)):
        for t, got in zip(fields, news):
            if got:
                new = _assembled(t, [(by_key[k][1][j].at, got[k, j]) for k, j in order.states[part]])
                t.copy_(new if ok is None else torch.where(ok, new, t))
    return _assembled(p, [(by_key[k][1][j].lo, new_p[k, j]) for k, j in order.params])


def _all_finite(reduced: list[torch.Tensor], group: Any) -> torch.Tensor:
    """Whether every reduced gradient is finite (0-d bool), on every rank of ``group`` when
    each holds slices (one all-reduce of the count of ranks that found a non-finite one)."""
    ok = torch.stack([torch.isfinite(r).all() for r in reduced]).all() if reduced else torch.ones((), dtype=torch.bool)
    if group is None:
        return ok
    return comm.traced_all_reduce((~ok).to(torch.float32).reshape(1), group)[0] == 0


def _verdict(finite: torch.Tensor | None, goes: list[tuple[int, torch.Tensor]], program: Program, parts: int
             ) -> tuple[torch.Tensor | None, list[torch.Tensor | bool]]:
    """Whether the step updates (None: it always does), and per part of the chain whether its
    new state is kept (a tensor, or True), as the eager step decides them (``Run.finish``):
    ``finite`` is ``skip_nonfinite``'s check (None: no check), ``goes`` the verdicts of the
    scales that may skip the step, by part. The parts before the first global scale (applied
    per bucket) and the first global scale always run. A step the check rejects runs nothing
    else: the first global scale's new state is kept (a clip's norm: inf; a loss scale backs
    off), and where that scale skips the step itself, the new states before it too. Otherwise
    a scale that skips keeps its own new state and those of the parts before it; the parts
    after it do not run."""
    if finite is None and not goes:
        return None, [True] * parts
    first = program.prefix if program.measure is not None else None
    first_go = goes[0][1] if goes and goes[0][0] == first else None
    update = finite
    for _, go in goes:
        update = go if update is None else update & go
    taken: list[torch.Tensor | bool] = []
    for j in range(parts):
        if j == first:
            taken.append(True)
        elif j < program.prefix:
            taken.append(True if finite is None else finite if first_go is None else finite | ~first_go)
        else:
            keep = finite
            for i, go in goes:
                if i < j:
                    keep = go if keep is None else keep & go
            taken.append(True if keep is None else keep)
    return update, taken


def _kept(ok: torch.Tensor | bool, new: Any, old: Any) -> Any:
    """A transform's state: ``new`` where ``ok`` holds, else ``old`` (leaf by leaf)."""
    if ok is True:
        return new
    return _tree.tree_map(lambda n, o: torch.where(ok, n, o) if isinstance(n, torch.Tensor) else n, new, old)


def _merged(spans: list[Any]) -> list[Any]:
    """``spans`` with the chunks of each run put back together (whole-leaf spans as they are)."""
    out: list[Any] = []
    for sp in spans:
        last = out[-1] if out else None
        if (last is not None and sp.shape is None and last.shape is None and not sp.owned and not last.owned
                and sp.lo == last.hi and sp.at == last.at + (last.hi - last.lo)):
            out[-1] = last._replace(hi=sp.hi)
        else:
            out.append(sp)
    return out


def _shaped(t: torch.Tensor, span: Any) -> torch.Tensor:
    return t if span.shape is None else t.view(span.shape)


def _assembled(base: torch.Tensor, pieces_at: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """``base`` with each ``(offset, tensor)`` (in order of offset) written over its elements
    at ``offset``, as one new tensor (one ``cat``)."""
    if len(pieces_at) == 1 and pieces_at[0][0] == 0 and pieces_at[0][1].numel() == base.numel():
        return pieces_at[0][1].reshape(-1)  # (one piece over all of it)
    parts, pos = [], 0
    for at, t in pieces_at:
        if at > pos:
            parts.append(base[pos:at])
        parts.append(t.reshape(-1))
        pos = at + t.numel()
    if pos < base.numel():
        parts.append(base[pos:])
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _whole_inputs(plan: BucketPlan, store: Any, params: Any, what: str) -> tuple[list, Any, list]:
    """Whole params' ``(leaves in plan order, the tree's structure, what the loss is
    differentiated in)``: the leaves detached, cast to ``param_dtype`` where the step computes
    in it. (Dynamo replaces optree's specs: the structure is one made inside the trace.)"""
    leaves = plan.leaves_of(params, what)
    compute = store.compute
    inputs = [t.detach().to(compute) for t in leaves] if compute is not None else [t.detach() for t in leaves]
    return leaves, _tree.structure(params), inputs


def _loss_of(fn: Callable, treedef: Any, rest: tuple, kwargs: dict) -> Callable[[list[torch.Tensor]], Any]:
    """``fn`` of the leaves put back in ``treedef``, and the rest of the step's arguments."""
    return lambda xs: fn(_tree.unflatten(treedef, xs), *rest, **kwargs)


def _grad_and_value(loss_of: Callable, has_aux: bool, inputs: list[torch.Tensor], name: str) -> tuple[list, Any]:
    """The gradients of ``loss_of`` in ``inputs`` and its value, traced: by ``torch.func`` (as the
    eager step with ``engine="functorch"``), or, where dynamo traces ``torch.autograd.grad``
    (``torch._dynamo.config.trace_autograd_ops = True``), by autograd, which also runs
    ``torch.utils.checkpoint`` inside the loss (torch.func's transforms refuse its saved-tensor
    hooks)."""
    if not _internals.dynamo_traces_autograd():
        return torch.func.grad_and_value(loss_of, has_aux=has_aux)(inputs)
    xs = [t.requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        out = loss_of(xs)
    loss, aux = out if has_aux else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise RuntimeError(f"{name}: the loss must be a scalar tensor (the step differentiates it)")
    got = torch.autograd.grad(loss, xs, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, got)]
    return grads, ((loss.detach(), aux) if has_aux else loss.detach())


def _views(flat: torch.Tensor, bucket: Any) -> list[torch.Tensor]:
    return [flat[off:off + n].view(shape) for off, n, shape in zip(bucket.offsets, bucket.numels, bucket.shapes)]


def _apply(t: GradientTransform, plan: BucketPlan, slices: Slices, b: int, g: torch.Tensor, tstate: Any) -> Any:
    """A per-element or per-leaf transform on bucket ``b``'s reduced (slice of the) gradient, in place."""
    tensors = [g] if t.reach == "element" else _views(g, plan.buckets[b])
    return t.apply(tensors, tstate)


def _leaf_stats(t: GradientTransform, plan: BucketPlan, store: Any, group: Any,
                reduced: list[torch.Tensor], received: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf's statistic for the global scale ``t``, in leaf order. Sharded, each leaf is
    measured whole on one rank (those that cross a slice boundary sent there first, one
    all-to-all per bucket that has any), and the statistics put together with one all-reduce
    in which each leaf has one non-zero contribution: exact, as the eager ``Straddles``."""
    straddles = _internals.frozen(store, "straddles")  # (geometry made once: see ``traced_grad_step``)
    if straddles is None:
        stats: list[torch.Tensor] = []
        for b in range(len(reduced)):
            stats.extend(t.stats(_views(reduced[b], plan.buckets[b])))
        order = [i for bucket in plan.buckets for i in bucket.leaves]
        by_leaf = dict(zip(order, stats))
        return [by_leaf[i] for i in range(len(plan.slots))]
    own: dict[int, torch.Tensor] = {}
    for b in range(len(reduced)):  # (the class's function: dynamo calls no method on a constant)
        leaves, views = Straddles.inside_views(straddles, b, reduced[b])
        own.update(zip(leaves, t.stats(views)))
    for b in straddles.buckets:
        leaves, wholes = _exchange(straddles, reduced, group, b, received)
        if leaves:
            own.update(zip(leaves, t.stats(wholes)))
    slots = plan.slots
    vec = torch.zeros(len(slots), dtype=torch.float64, device=reduced[0].device if reduced else None)
    parts = [own[i].reshape(1).to(torch.float64) if i in own else vec.new_zeros(1) for i in range(len(slots))]
    vec = comm.traced_all_reduce(torch.cat(parts), group)
    return [vec[i].to(own[i].dtype if i in own else slots[i].dtype) for i in range(len(slots))]


def _exchange(straddles: Any, grads: list[torch.Tensor], group: Any, b: int,
              received: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """``Straddles.exchange`` as graph nodes: the straddling leaves of bucket ``b`` this rank
    owns, whole (one ``all_to_all_single``)."""
    s, slots = straddles.slices, straddles.plan.slots
    g = grads[b]
    sends = [[g[lo - s.lo[b]:hi - s.lo[b]] for _, lo, hi in per] for per in straddles.sends[b]]
    got: dict[int, list[torch.Tensor]] = {}
    for (i, _, _), part in _exchange_parts(sends, straddles.recvs[b], g, slots, group, received):
        got.setdefault(i, []).append(part)
    leaves, wholes = [], []
    for i, off in straddles.mine[b]:
        own = g[off - s.lo[b]:s.hi[b] - s.lo[b]]
        leaves.append(i)
        wholes.append(torch.cat([own, *got[i]]).view(slots[i].shape))
    return leaves, wholes


def _to_owners(owners: Any, flats: list[torch.Tensor], group: Any, received: list[torch.Tensor]
               ) -> dict[int, torch.Tensor]:
    """``Owners.to_owners`` as graph nodes: every leaf this rank owns, whole, in its shape,
    from the ranks' slices ``flats`` (one ``all_to_all_single`` in the leaves' dtype)."""
    s, me, slots = owners.slices, owners.slices.rank, owners.plan.slots
    sends: list[list[torch.Tensor]] = [[] for _ in range(s.size)]
    recvs: list[list[tuple[int, int, int]]] = [[] for _ in range(s.size)]
    for i, parts in sorted(owners.parts.items()):
        o = owners.owner[i]
        for c, lo, hi, r in parts:
            if r == me and o != me:
                sends[o].append(flats[c][lo - s.lo[c]:hi - s.lo[c]])
            if o == me and r != me:
                recvs[r].append((i, lo, hi))
    got = dict(zip([(i, r) for r, per in enumerate(recvs) for i, _, _ in per],
                   [t for _, t in _exchange_parts(sends, recvs, flats[0], slots, group, received)]))
    # a leaf's parts in the order of the slices that hold them (``Owners.parts``: rank order)
    return {i: torch.cat([flats[c][lo - s.lo[c]:hi - s.lo[c]] if r == me else got[i, r]
                          for c, lo, hi, r in owners.parts[i]]).view(slots[i].shape) for i in owners.mine}


def _to_holders(owners: Any, mine: list[torch.Tensor], owned: dict[int, torch.Tensor], group: Any,
                received: list[torch.Tensor]) -> None:
    """``Owners.to_holders`` as graph nodes: the owners' updated leaves ``owned`` written into
    the slices ``mine`` of the ranks that hold their parts (one ``all_to_all_single``)."""
    s, me, slots = owners.slices, owners.slices.rank, owners.plan.slots
    sends: list[list[torch.Tensor]] = [[] for _ in range(s.size)]
    recvs: list[list[tuple[int, int, int]]] = [[] for _ in range(s.size)]
    for i, parts in sorted(owners.parts.items()):
        o, off = owners.owner[i], slots[i].offset
        for c, lo, hi, r in parts:
            if o == me:
                new = owned[i].reshape(-1)[lo - off:hi - off]
                if r == me:
                    mine[c][lo - s.lo[c]:hi - s.lo[c]].copy_(new)
                else:
                    sends[r].append(new)
            elif r == me:
                recvs[o].append((i, lo, hi))
    for (i, lo, hi), part in _exchange_parts(sends, recvs, mine[0], slots, group, received):
        c = slots[i].bucket
        mine[c][lo - s.lo[c]:hi - s.lo[c]].copy_(part)


def _exchange_parts(sends: list[list[torch.Tensor]], recvs: list[list[tuple[int, int, int]]],
                    like: torch.Tensor, slots: Any, group: Any,
                    received: list[torch.Tensor]) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
    """One ``all_to_all_single`` of the parts ``sends`` (per destination rank), and the parts
    received, named by ``recvs`` (per source rank: ``(leaf, lo, hi)``), in their leaves'
    dtypes (sent as bytes, as the eager exchange: leaves of several dtypes in one call; each
    part padded to ``ALIGN`` bytes, so that every part received is a view of its own dtype).

    Every rank sends every rank ``ALIGN`` zero bytes before its parts, and the step subtracts
    the first one it received from its params (``x - (+0.0)`` is ``x``): the collective is
    then used on every rank. (A graph pass drops an all-to-all whose output this rank does
    not use, from this rank's graph alone, and the ranks that send to it wait for it until
    the timeout: seen with activation checkpointing.)"""
    head = like.new_zeros(ALIGN, dtype=torch.uint8)
    parts: list[torch.Tensor] = []
    in_sizes = []
    for per in sends:
        parts.append(head)
        size = ALIGN
        for x in per:
            raw = x.reshape(-1).view(torch.uint8)
            pad = _aligned(raw.numel()) - raw.numel()
            parts.extend((raw, head[:pad]) if pad else (raw,))
            size += raw.numel() + pad
        in_sizes.append(size)
    out_sizes = [ALIGN + sum(_aligned((hi - lo) * slots[i].dtype.itemsize) for i, lo, hi in per) for per in recvs]
    recv = comm.traced_all_to_all(torch.cat(parts), out_sizes, in_sizes, group)
    received.append(recv)
    out, pos = [], 0
    for per in recvs:
        pos += ALIGN  # (the peer's zeros)
        for i, lo, hi in per:
            nbytes = (hi - lo) * slots[i].dtype.itemsize
            out.append(((i, lo, hi), recv[pos:pos + nbytes].view(slots[i].dtype)))
            pos += _aligned(nbytes)
    return out


# Bytes each part of an exchange is padded to: a part received then starts where a view of
# any dtype may (torch refuses a view of bytes as float32 at an offset not a multiple of 4).
ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _detached(value: Any) -> Any:
    return _tree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)
