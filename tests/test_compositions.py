"""Where two features meet (a failure and the fused step's repair, a comm hook and several
buckets, accumulation and uneven inputs, a new optimizer each step...): the right numbers or
a named error on every rank. Every number is checked against the plain path (``reducer.grad``
+ ``opt.update``), DDP + torch.optim, or torch's own functions, on simulated ranks (threads,
and gloo processes where it matters)."""

import math
import os
import re

import optree
import pytest
import torch
import torch.nn.functional as F
from models import CAPS, batch, loss_of, mlp
from test_optim_library import torch_lrs
from torch import nn
from trees import assert_trees_equal

import fdp


def square(seed=0):
    """A model whose weight is square (so ``w.t()`` has its shape) and a loss of it."""
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}

    def loss(p, x):
        return (torch.tanh(x @ p["w"] + p["b"]) ** 2).sum() + (p["w"] @ p["w"]).sum() * 0.1

    return params, loss


def other_views(group, make_view):
    params, loss = square()
    opt = fdp.optim.adam(lr=0.1)
    reducer = fdp.Reducer(params, group)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    plain, pstate = dict(params), opt.init(params)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(group.rank))
    fused, state, _ = step(params, state, x)
    plain, pstate = opt.update(reducer.grad(loss)(plain, x), pstate, plain)
    # Hand back another view of the memory the step returned: same data pointer, other values.
    # (The plain path gets the same values contiguous: a transposed operand changes how the
    # matmul sums, and the fused step packs the values into its contiguous buffers.)
    returned = fused["w"]
    fused = {**fused, "w": make_view(returned)}
    assert fused["w"].data_ptr() == returned.data_ptr() and fused["w"].shape == returned.shape
    plain = {**plain, "w": make_view(plain["w"]).contiguous()}
    for _ in range(2):
        fused, state, _ = step(fused, state, x)
        plain, pstate = opt.update(reducer.grad(loss)(plain, x), pstate, plain)
    return fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("view", ["transpose", "expand"])
def test_1_another_view_of_the_returned_memory_is_packed_not_taken_as_unchanged(view, backend):
    make_view = {"transpose": lambda w: w.t(), "expand": lambda w: w[0].expand(4, 4)}[view]
    for rank, (fused, plain) in enumerate(fdp.testing.run(other_views, 2, backend=backend, args=(make_view,))):
        assert_trees_equal(fused, plain, f"rank {rank}, params after a {view} view was passed back")


class KernelFault:
    """An optimizer whose ``LeafKernel`` raises on one rank, from its ``nth`` call of an armed
    step on (so that rank has updated some buckets first): out of memory in the update."""

    def __init__(self, opt, rank, nth=1):
        self.calls, self.armed, self.rank, self.nth = 0, False, rank, nth
        kernel = opt.form.leaf_kernel

        def step(*args):
            if self.armed:
                self.calls += 1
                if self.calls > self.nth:
                    raise RuntimeError(f"injected failure in the optimizer's kernel (call {self.calls})")
            return kernel.step(*args)

        self.opt = opt._replace(form=opt.form._replace(leaf_kernel=kernel._replace(step=step)))


class TransformFault:
    """A per-leaf transform (after the clip: applied in each bucket's update, before its
    kernel) that raises on one rank when armed: that rank updates nothing at all."""

    def __init__(self, rank, reach="leaf"):
        self.armed, self.rank = False, rank

        def apply(tensors, state):
            if self.armed:
                raise RuntimeError("injected failure in a transform")
            return state

        self.transform = fdp.optim.GradientTransform(lambda params: (), lambda g, s, p: (g, s), reach=reach,
                                                     apply=apply)


WHERE = {  # how a step's updates come after its backward
    "clip": dict(clip=True),
    "skip_nonfinite": dict(skip_nonfinite=True),
    "sharded-clip": dict(clip=True, shard=True),
    "sharded-skip_nonfinite": dict(skip_nonfinite=True, shard=True),
    "clip-transform": dict(clip=True, transform=True),  # rank 1 fails before updating anything
    "clip-donated": dict(clip=True, donate=True),  # rank 1's params are partly updated in place
    "clip-bf16-wire": dict(clip=True, reduce_dtype=torch.bfloat16),  # a cast hook: NaN travels in bf16
}
UNSHARDED = [w for w in WHERE if not WHERE[w].get("shard")]


def kernel_fails_on_one_rank(group, where):
    cfg = WHERE[where]
    apply, params, buffers = fdp.functionalize(mlp(seed=12))
    loss = loss_of(apply, buffers)
    adamw = fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=lambda path, p: p.dim() >= 2)
    clip = (fdp.optim.clip_by_global_norm(0.5),) if cfg.get("clip") else ()
    if cfg.get("transform"):
        fault = TransformFault(rank=1)
        opt = fdp.optim.chain(*clip, fault.transform, adamw)
    else:
        fault = KernelFault(adamw, rank=1)
        opt = fdp.optim.chain(*clip, fault.opt)
    plain_opt = fdp.optim.chain(*clip, adamw)
    reducer = fdp.Reducer(params, group, skip_nonfinite=cfg.get("skip_nonfinite", False),
                          shard=cfg.get("shard", False), reduce_dtype=cfg.get("reduce_dtype"),
                          hook_threshold_bytes=0, **CAPS)
    step = reducer.grad_and_update(loss, opt, donate=cfg.get("donate", False))
    state = step.init(params)
    fused = {k: v.clone() for k, v in params.items()}
    plain = {k: v.clone() for k, v in params.items()}  # (a donated step may take fused's memory)
    pstate = plain_opt.init(plain)
    fused, state, _ = step(fused, state, *batch(group.rank, 0))
    fault.armed = group.rank == fault.rank
    try:
        fused, state, _ = step(fused, state, *batch(group.rank, 1))
        failed = None
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        failed = (type(e).__name__, str(e), getattr(e, "__notes__", []))
    fault.armed = False
    return cfg, step, reducer, loss, plain_opt, fused, state, plain, pstate, failed


def a_failed_update_is_set_right_by_the_next_call(group, where):
    """Unsharded: the failing rank raises at once; the next call restores it from rank 0."""
    cfg, step, reducer, loss, plain_opt, fused, state, plain, pstate, failed = kernel_fails_on_one_rank(group, where)
    try:  # the failed rank's partly updated state is refused until then (no collective: nobody waits)
        step.state_to_tree(state, fused)
        refused = None
    except Exception as e:  # noqa: BLE001
        refused = (type(e).__name__, str(e))
    for i in range(2, 4):  # every rank goes on with what it holds; rank 1 is restored first
        fused, state, _ = step(fused, state, *batch(group.rank, i))
    for i in range(4):  # the plain path that never failed
        plain, pstate = plain_opt.update(reducer.grad(loss)(plain, *batch(group.rank, i)), pstate, plain)
    return failed, refused, fused, plain, step.state_to_tree(state, fused), pstate


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("where", UNSHARDED)
def test_2_a_failed_update_on_one_rank_raises_there_and_the_next_call_restores_it_from_a_whole_one(where, backend):
    # Unsharded, a step's updates wait for every bucket, and a backward failure stops every
    # rank before them: a failure in one rank's update leaves the others' updates whole and
    # exact. That rank raises at once; every rank reads the verdict at its next call, which
    # makes the failed rank's params and state rank 0's before going on. Nothing is lost: the
    # replicas then equal the plain path that never failed, bit for bit.
    results = fdp.testing.run(a_failed_update_is_set_right_by_the_next_call, 2, backend=backend, timeout=120,
                              args=(where,))
    for rank, (failed, refused, fused, plain, tree, pstate) in enumerate(results):
        if rank == 1:
            assert failed is not None and failed[0] == "RuntimeError" and "injected failure in" in failed[1], failed
            assert any("next call of the step" in note and "restores this rank's params" in note
                       for note in failed[2]), failed[2]
            assert refused is not None and refused[0] == "RuntimeError", "rank 1: its partly updated state was read"
            assert "next call of the step restores them" in refused[1], refused[1]
        else:
            assert failed is None, f"rank {rank}: its update was whole, yet the step raised {failed}"
            assert refused is None, f"rank {rank}: its whole state was refused: {refused}"
        assert_trees_equal(fused, plain, f"rank {rank}, params after the restoring call")
        assert_trees_equal(fused, results[0][2], f"rank {rank} is not a replica of rank 0")
        for field in ("exp_avg", "exp_avg_sq"):
            got = getattr(tree[-1] if isinstance(tree, tuple) else tree, field)
            want = getattr(pstate[-1] if isinstance(pstate, tuple) else pstate, field)
            assert_trees_equal(got, want, f"rank {rank}, AdamW's {field}")


def sharded_update_fails_on_one_rank(group, where):
    cfg, step, reducer, loss, plain_opt, fused, state, plain, pstate, failed = kernel_fails_on_one_rank(group, where)
    try:  # the partly updated state is refused (before any collective: no rank waits)
        step(fused, state, *batch(group.rank, 1))
        refused = None
    except Exception as e:  # noqa: BLE001
        refused = (type(e).__name__, str(e))
    # A fresh state goes on; the pure step left `fused` as it was: the plain path from here.
    state = step.init(fused)
    plain, pstate = dict(fused), plain_opt.init(fused)
    for i in range(2, 4):
        fused, state, _ = step(fused, state, *batch(group.rank, i))
        plain, pstate = plain_opt.update(reducer.grad(loss)(plain, *batch(group.rank, i)), pstate, plain)
    return failed, refused, fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("where", [w for w in WHERE if w not in UNSHARDED])
def test_2_a_sharded_update_failure_fails_the_step_on_every_rank_and_refuses_the_state(where, backend):
    # Sharded, a rank's slices of the state are its own: no other rank could restore them, so
    # the step's status is read in the step itself. A rank left waiting in a collective would
    # end in the group's timeout error, which the messages below do not match (the generous
    # timeout only bounds how long that takes).
    results = fdp.testing.run(sharded_update_fails_on_one_rank, 2, backend=backend, timeout=120, args=(where,))
    for rank, (failed, refused, fused, plain) in enumerate(results):
        assert failed is not None, f"rank {rank}: the step reported success while rank 1's update failed"
        if rank == 1:
            assert failed[0] == "RuntimeError" and "injected failure in" in failed[1], f"rank 1: {failed}"
        else:
            assert failed[0] == "CollectiveError", f"rank {rank}: {failed}"
            assert re.search(r"failed on 1 other rank\(s\) of 2 after the backward.*this is rank 0", failed[1]), failed[1]
            assert "timeout" not in failed[1].split("this is rank")[0], failed[1]
        # Rank 0 had updated its state before the failure was known, rank 1 its first kernel
        # call's leaves: every rank refuses the state, so none goes on alone into collectives
        # the others never issue.
        assert refused is not None and refused[0] == "RuntimeError", f"rank {rank}: a partly updated state was used"
        assert re.search(r"updated .*optimizer state in place.*on every rank", refused[1]), refused[1]
        assert_trees_equal(fused, plain, f"rank {rank}, after a fresh state")
        assert_trees_equal(fused, results[0][2], f"rank {rank} is not a replica of rank 0")


def backward_fails_on_one_rank(group, where):
    """Rank 1's backward fails in step 1 after some buckets have launched (its first layer's
    weight gets its gradient last); the updates wait for every bucket."""
    from models import FailOnce

    cfg = WHERE[where]
    apply, params, buffers = fdp.functionalize(mlp(seed=14))
    base = loss_of(apply, buffers)

    def loss(p, x, y):
        return base({**p, "0.weight": FailOnce.apply(p["0.weight"])}, x, y)

    adamw = fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=lambda path, p: p.dim() >= 2)
    opt = fdp.optim.chain(*((fdp.optim.clip_by_global_norm(0.5),) if cfg.get("clip") else ()), adamw)
    reducer = fdp.Reducer(params, group, skip_nonfinite=cfg.get("skip_nonfinite", False),
                          shard=cfg.get("shard", False), reduce_dtype=cfg.get("reduce_dtype"),
                          hook_threshold_bytes=0, **CAPS)
    step = reducer.grad_and_update(loss, opt, donate=cfg.get("donate", False))
    state = step.init(params)
    fused = {k: v.clone() for k, v in params.items()}
    plain = {k: v.clone() for k, v in params.items()}
    pstate = opt.init(plain)
    outcome = []
    for i in range(3):
        FailOnce.arm(group.rank == 1 and i == 1)
        try:
            fused, state, _ = step(fused, state, *batch(group.rank, i))
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            outcome.append((type(e).__name__, str(e)))
        FailOnce.arm(False)
        if i != 1:  # the failed step's gradients are discarded everywhere: the plain path skips its batch
            plain, pstate = opt.update(reducer.grad(base)(plain, *batch(group.rank, i)), pstate, plain)
    return outcome, fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("where", ["clip", "skip_nonfinite", "clip-donated", "clip-bf16-wire", "sharded-clip"])
def test_a_backward_failure_on_one_rank_stops_every_rank_before_any_update_and_the_state_goes_on(where, backend):
    # Unsharded, the failed rank fills the buckets it still owes with NaN, every rank's last
    # bucket comes back NaN, and only then is a status exchanged (no second collective in a
    # step that does not fail); sharded, the buckets' own status says it. Either way every rank
    # raises in the failed step before updating anything, and the same state goes on.
    results = fdp.testing.run(backward_fails_on_one_rank, 2, backend=backend, timeout=120, args=(where,))
    for rank, (outcome, fused, plain) in enumerate(results):
        assert outcome[0] is None and outcome[2] is None, f"rank {rank}: {outcome}"
        if rank == 1:
            assert outcome[1][0] == "RuntimeError" and "injected failure" in outcome[1][1], outcome[1]
        else:
            assert outcome[1][0] == "CollectiveError", outcome[1]
            assert "failed on 1 other rank(s) of 2 (an exception in their loss or backward)" in outcome[1][1]
        assert_trees_equal(fused, plain, f"rank {rank}, the step after the failed one against the plain path")


def accumulated_after_a_failed_update(group):
    cfg, step, reducer, loss, plain_opt, fused, state, plain, pstate, failed = kernel_fails_on_one_rank(group, "clip")
    raised = None
    for attempt in range(2):
        step.accumulate(fused, *batch(group.rank, 20))  # rank 1's from params the others do not have
        try:
            fused, state, _ = step(fused, state, *batch(group.rank, 21))
        except fdp.CollectiveError as e:
            raised = (attempt, str(e))
    for i in range(2):  # the plain path that never failed (it runs once every rank is restored)
        plain, pstate = plain_opt.update(reducer.grad(loss)(plain, *batch(group.rank, i)), pstate, plain)
    local = fdp.local_grad(loss)(plain, *batch(group.rank, 20))
    plain, pstate = plain_opt.update(reducer.grad(loss, accumulate=local)(plain, *batch(group.rank, 21)), pstate, plain)
    return failed, raised, fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_micro_batches_accumulated_after_a_failed_update_are_discarded_on_every_rank_once_restored(backend):
    # The failed rank accumulated its micro-batches from its partly updated params: the call
    # that restores it makes every rank's params and state rank 0's, then discards every
    # rank's micro-batches and raises; the next attempt goes on, as if nothing had failed.
    results = fdp.testing.run(accumulated_after_a_failed_update, 2, backend=backend, timeout=120)
    for rank, (failed, raised, fused, plain) in enumerate(results):
        assert (failed is not None) == (rank == 1), f"rank {rank}: {failed}"
        assert raised is not None and raised[0] == 0, f"rank {rank}: the restoring call did not raise: {raised}"
        assert "compute them again" in raised[1] and "now rank 0's" in raised[1], raised[1]
        assert_trees_equal(fused, plain, f"rank {rank}, against the plain path that never failed")


def every_rank_fails_its_update(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=12))
    loss = loss_of(apply, buffers)
    adamw = fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=lambda path, p: p.dim() >= 2)
    fault = KernelFault(adamw, rank=group.rank)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), fault.opt)
    plain_opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), adamw)
    reducer = fdp.Reducer(params, group, hook_threshold_bytes=0, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    fused = {k: v.clone() for k, v in params.items()}
    state = step.init(fused)
    fused, state, _ = step(fused, state, *batch(group.rank, 0))
    seen = []
    fault.armed = True
    try:
        step(fused, state, *batch(group.rank, 1))
    except RuntimeError as e:
        seen.append(str(e))
    fault.armed = False
    try:  # no rank's update is whole: nothing to restore from; every rank refuses the state
        step(fused, state, *batch(group.rank, 2))
    except RuntimeError as e:
        seen.append(str(e))
    state = step.init(fused)  # the pure step left fused at step 0's result on every rank
    plain, pstate = dict(fused), plain_opt.init(fused)
    fused, state, _ = step(fused, state, *batch(group.rank, 3))
    plain, pstate = plain_opt.update(reducer.grad(loss)(plain, *batch(group.rank, 3)), pstate, plain)
    return seen, fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_an_update_failing_on_every_rank_refuses_the_state_everywhere_until_a_fresh_one(backend):
    results = fdp.testing.run(every_rank_fails_its_update, 2, backend=backend, timeout=120)
    for rank, (seen, fused, plain) in enumerate(results):
        assert len(seen) == 2 and "injected failure" in seen[0], f"rank {rank}: {seen}"
        assert "failed on every rank" in seen[1] and "step.init" in seen[1], f"rank {rank}: {seen[1]}"
        assert_trees_equal(fused, plain, f"rank {rank}, after a fresh state")
        assert_trees_equal(fused, results[0][1], f"rank {rank} is not a replica of rank 0")


def plain_path_after_a_failed_update(group):
    cfg, step, reducer, loss, plain_opt, fused, state, plain, pstate, failed = kernel_fails_on_one_rank(group, "clip")
    try:  # the replicas differ until the fused step restores rank 1: the plain path refuses
        reducer.grad(loss)(fused, *batch(group.rank, 2))
        refused = None
    except fdp.CollectiveError as e:
        refused = str(e)
    fused, state, _ = step(fused, state, *batch(group.rank, 2))  # restores rank 1, then steps
    grads = reducer.grad(loss)(fused, *batch(group.rank, 3))  # and the plain path runs again
    return failed, refused, fused, grads


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_after_a_failed_update_the_plain_path_refuses_until_the_fused_step_restores_the_rank(backend):
    results = fdp.testing.run(plain_path_after_a_failed_update, 2, backend=backend, timeout=120)
    for rank, (failed, refused, fused, grads) in enumerate(results):
        assert (failed is not None) == (rank == 1), f"rank {rank}: {failed}"
        assert refused is not None and "failed on rank(s) [1]" in refused, f"rank {rank}: {refused}"
        assert "call the fused step on every rank" in refused, refused
        assert_trees_equal(fused, results[0][2], f"rank {rank} is not a replica of rank 0")
        assert_trees_equal(grads, results[0][3], f"rank {rank}: gradients of the plain path")


def under_inference_mode(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=13))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.adamw(lr=1e-2)
    x, y = batch(group.rank, 0)
    local = torch.func.grad(loss)(params, x, y)  # torch's own gradient of this rank, outside
    with torch.inference_mode():
        reducer = fdp.Reducer(params, group, **CAPS)  # made inside too: its buffers are used outside
        grads = reducer.grad(loss)(params, x, y)
        inside = torch.func.grad(loss)(params, x, y)
        step = reducer.grad_and_update(loss, opt)
        fused, state, _ = step(params, step.init(params), x, y)
    want = fdp.psum({k: g / group.size for k, g in local.items()}, group)
    plain = opt.update(reducer.grad(loss)(params, x, y), opt.init(params), params)[0]
    return grads, inside, local, want, fused, plain


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_3_inference_mode_gives_the_right_gradients_and_updates(backend):
    for rank, (grads, inside, local, want, fused, plain) in enumerate(
            fdp.testing.run(under_inference_mode, 2, backend=backend)):
        assert_trees_equal(inside, local, f"rank {rank}: torch.func.grad inside inference_mode")
        for k in want:  # the mean of torch.func.grad's over the ranks (two ranks: one rounding)
            torch.testing.assert_close(grads[k], want[k], rtol=1e-6, atol=1e-7, msg=f"rank {rank}, grad {k!r}")
            assert grads[k].abs().sum() > 0, f"rank {rank}: zero gradient for {k!r}"
        assert_trees_equal(fused, plain, f"rank {rank}: fused step inside inference_mode")


def batches_made_in_inference_mode(group):
    """A batch from an inference-mode pipeline, the step itself outside it: every fdp gradient
    path takes it as torch.func.grad does (it raised torch's "cannot be saved for backward")."""
    apply, params, buffers = fdp.functionalize(mlp(seed=13))
    loss = loss_of(apply, buffers)
    with torch.inference_mode():
        x, y = (t.clone() for t in batch(group.rank, 0))
    assert x.is_inference()
    reducer = fdp.Reducer(params, group, **CAPS)
    opt = fdp.optim.adamw(lr=1e-2)
    local = fdp.local_grad(loss)(params, x, y)
    grads = reducer.grad(loss)(params, x, y)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    step.accumulate(params, x, y)
    fused, state, _ = step(params, state, x, y)
    ordinary = tuple(t.clone() for t in batch(group.rank, 0))
    twice = fdp.psum({k: 2 * g / group.size for k, g in torch.func.grad(loss)(params, *ordinary).items()}, group)
    return local, torch.func.grad(loss)(params, *ordinary), grads, fused, opt.update(twice, opt.init(params), params)[0]


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_3b_a_batch_made_in_inference_mode_trains_as_under_torch_func_grad(backend):
    for rank, (local, want, grads, fused, plain) in enumerate(
            fdp.testing.run(batches_made_in_inference_mode, 2, backend=backend)):
        assert_trees_equal(local, want, f"rank {rank}: fdp.local_grad")
        assert all(g.abs().sum() > 0 for g in grads.values())
        for k in plain:
            torch.testing.assert_close(fused[k], plain[k], rtol=1e-6, atol=1e-7, msg=f"rank {rank}: {k}")


def reordered(params):
    return {k: params[k] for k in reversed(list(params))}


def train(step, params, state, rank, steps):
    for i in steps:
        params, state, _ = step(params, state, *batch(rank, i))
    return params, state


def test_4_a_fused_state_of_another_layout_is_refused_by_load_and_by_the_step(tmp_path):
    apply, params, buffers = fdp.functionalize(mlp(seed=14))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.adam(lr=1e-2)
    caps = dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.01)
    reducer = fdp.Reducer(params, **caps)
    step = reducer.grad_and_update(loss, opt)
    p, state = train(step, dict(params), step.init(params), 0, range(2))
    fdp.save(tmp_path / "fused.pt", {"params": p, "opt": state})
    # The same params built in another key order: the same bucket sizes, other leaves in them.
    other = reordered(params)
    reducer2 = fdp.Reducer(other, **caps)
    assert [b.numel for b in reducer2.plan.buckets] == [b.numel for b in reducer.plan.buckets]
    assert [b.paths for b in reducer2.plan.buckets] != [b.paths for b in reducer.plan.buckets]
    step2 = reducer2.grad_and_update(loss, opt)
    like = {"params": reordered(p), "opt": step2.init(other)}
    with pytest.raises(fdp.CheckpointError, match="made for another bucket plan"):
        fdp.load(tmp_path / "fused.pt", like=like)
    with pytest.raises(ValueError, match="made for another layout"):
        step2(reordered(p), state, *batch(0, 2))
    # The per-leaf form converts it; the run goes on as if nothing had moved.
    converted = step2.state_from_tree(step.state_to_tree(state, p), reordered(p))
    want, _ = train(step, p, state, 0, range(2, 4))
    got, _ = train(step2, reordered(p), converted, 0, range(2, 4))
    assert_trees_equal(reordered(got), want, "after the conversion")


def clip_each_leaf(max_norm, seen=None):
    """A user's per-leaf norm clip: each gradient leaf scaled to norm <= max_norm on its own."""
    def coef(g):
        return torch.clamp(max_norm / (torch.linalg.vector_norm(g) + 1e-6), max=1.0)

    def update(grads, state, params):
        return optree.tree_map(lambda g: g * coef(g), grads), state

    def apply(tensors, state):
        if seen is not None:
            seen.append([tuple(t.shape) for t in tensors])
        for t in tensors:
            t.mul_(coef(t))
        return state

    return fdp.optim.GradientTransform(lambda params: (), update, reach="leaf", apply=apply)


def per_leaf(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=15))
    loss = loss_of(apply, buffers)
    seen = []
    opt = fdp.optim.chain(clip_each_leaf(0.05, seen), fdp.optim.sgd(lr=0.5, momentum=0.9))
    reducer = fdp.Reducer(params, group, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    fused, plain, pstate = dict(params), dict(params), opt.init(params)
    for i in range(3):
        fused, state, _ = step(fused, state, *batch(group.rank, i))
        plain, pstate = opt.update(reducer.grad(loss)(plain, *batch(group.rank, i)), pstate, plain)
    return fused, plain, seen, [s.shape for s in reducer.plan.slots]


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_6_a_per_leaf_transform_gets_leaves_in_the_fused_step_and_the_plain_paths_numbers(backend):
    for rank, (fused, plain, seen, shapes) in enumerate(fdp.testing.run(per_leaf, 2, backend=backend)):
        assert_trees_equal(fused, plain, f"rank {rank}")
        # The plain path's chain hands apply the whole tree, the fused step each bucket's
        # leaves: over 3 steps of each, every leaf 6 times, always whole (never a bucket).
        given = sorted(s for call in seen for s in call)
        assert given == sorted([tuple(s) for s in shapes] * 6), f"rank {rank}: apply saw {seen}"


def test_6_whole_tree_transforms_without_a_global_scale_and_sharded_per_leaf_ones_are_refused():
    params = {"w": torch.ones(3)}
    reducer = fdp.Reducer(params)
    tree = fdp.optim.stateless(lambda grads, params: grads)  # reach="tree", no stats/scale
    with pytest.raises(TypeError, match=r"part 0 of the chain is a whole-tree transform .* not a global scale"):
        reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.chain(tree, fdp.optim.sgd(lr=0.1)))

    def sharded(group):  # (a shard group of one is the unsharded step, which takes it)
        reducer = fdp.Reducer(params, group, shard=True)
        with pytest.raises(TypeError, match=r"part 0 of the chain declares reach='leaf': with shard=True"):
            reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.chain(clip_each_leaf(1.0), fdp.optim.sgd(lr=0.1)))

    fdp.testing.run(sharded, 2)


NORM_TYPES = [2.0, 1.0, 0.0, math.inf, -math.inf, 0.5, 3.0]
MAX_NORM = {0.0: 4.0, -math.inf: 1e-7}  # so that each norm type clips (others: 0.05)


def clipped_like_torch(group, norm_type, steps=3):
    max_norm = MAX_NORM.get(norm_type, 0.05)
    ddp = nn.parallel.DistributedDataParallel(mlp(seed=16))
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    apply, params, buffers = fdp.functionalize(mlp(seed=16))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(max_norm, norm_type), fdp.optim.sgd(lr=0.5, momentum=0.9))
    reducer = fdp.Reducer(params, group, **CAPS)
    fused_step = reducer.grad_and_update(loss, opt)
    sharded_step = fdp.Reducer(params, group, shard=True, **CAPS).grad_and_update(loss, opt)
    plain, pstate = dict(params), opt.init(params)
    fused, fstate = dict(params), fused_step.init(params)
    sharded, sstate = dict(params), sharded_step.init(params)
    norms = {"torch": [], "plain": [], "fused": [], "sharded": []}
    for i in range(steps):
        x, y = batch(group.rank, i)
        torch_opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        norms["torch"].append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm, norm_type))
        torch_opt.step()
        plain, pstate = opt.update(reducer.grad(loss)(plain, x, y), pstate, plain)
        norms["plain"].append(pstate.transforms[0].norm)
        fused, fstate, _ = fused_step(fused, fstate, x, y)
        norms["fused"].append(fused_step.state_to_tree(fstate, fused).transforms[0].norm)
        sharded, sstate, _ = sharded_step(sharded, sstate, x, y)
        norms["sharded"].append(sharded_step.state_to_tree(sstate, sharded).transforms[0].norm)
    want = {k: p.detach().clone() for k, p in ddp.module.named_parameters()}
    return want, {"plain": plain, "fused": fused, "sharded": sharded}, norms, max_norm


@pytest.mark.parametrize("norm_type", [pytest.param(n, marks=() if n == 2.0 else pytest.mark.slow)
                                       for n in NORM_TYPES])  # (`make test`: the 2-norm)
def test_7_every_norm_type_clips_as_clip_grad_norm_with_ddp_in_the_plain_fused_and_sharded_steps(norm_type):
    results = fdp.testing.run(clipped_like_torch, 2, backend="gloo", args=(norm_type,), timeout=120)
    for rank, (want, got, norms, max_norm) in enumerate(results):
        assert any(n > max_norm for n in norms["torch"]), f"the test's max_norm does not clip ({norms['torch']})"
        for path in ("plain", "fused", "sharded"):
            for i, (n, t) in enumerate(zip(norms[path], norms["torch"])):
                assert torch.equal(n, t), f"rank {rank}, {path} step, norm_type {norm_type}: norm {n} at step {i}, torch {t}"
            assert_trees_equal(got[path], want, f"rank {rank}, {path} step against DDP + clip_grad_norm_")


# A copy of a sharded state (optree.tree_map(torch.clone, state)) is refused by fdp.save as
# the state itself is: tests/test_shard.py::test_a_sharded_checkpoint_resumes_bit_exactly_
# unsharded_and_on_another_world_size (its `saved` checks both, on two ranks).


def masked_three_ranks(group, steps=10):
    apply, params, buffers = fdp.functionalize(mlp(seed=17))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=lambda path, p: p.dim() >= 2)
    reducer = fdp.Reducer(params, group, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    fused, state = dict(params), step.init(params)
    plain, pstate = dict(params), opt.init(params)
    for i in range(steps):
        fused, state, _ = step(fused, state, *batch(group.rank, i))
        plain, pstate = opt.update(reducer.grad(loss)(plain, *batch(group.rank, i)), pstate, plain)
    return fused, plain, step.state_to_tree(state, fused), pstate


def test_10a_with_a_mask_on_three_ranks_the_fused_step_equals_the_plain_path_bit_for_bit():
    for rank, (fused, plain, fstate, pstate) in enumerate(fdp.testing.run(masked_three_ranks, 3, backend="gloo")):
        assert_trees_equal(fused, plain, f"rank {rank}, params after 10 steps")
        assert_trees_equal(fstate, pstate, f"rank {rank}, optimizer state after 10 steps")


# ----------------------------------------------------------------------------- crashes
def one_rank_shard_groups(group):
    from torch.distributed.device_mesh import init_device_mesh

    apply, params, buffers = fdp.functionalize(mlp(seed=18))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), fdp.optim.adamw(lr=1e-2))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))  # shard groups of one
    out = []
    for over, shard in ((group, False), (mesh, True)):
        step = fdp.Reducer(params, over, shard=shard, **CAPS).grad_and_update(loss, opt)
        p, state = train(step, dict(params), step.init(params), group.rank, range(3))
        out.append((p, step.state_to_tree(state, p)))
    return out


def test_crash_shard_true_over_shard_groups_of_one_rank_is_the_unsharded_step():
    apply, params, buffers = fdp.functionalize(mlp(seed=18))  # a world of one (no process group)
    loss = loss_of(apply, buffers)
    opt = fdp.optim.adamw(lr=1e-2)
    got = []
    for shard in (False, True):
        step = fdp.Reducer(params, shard=shard, **CAPS).grad_and_update(loss, opt)
        got.append(train(step, dict(params), step.init(params), 0, range(3))[0])
    assert_trees_equal(got[1], got[0], "world of one, shard=True")
    for rank, ((p, st), (sp, sst)) in enumerate(fdp.testing.run(one_rank_shard_groups, 2, backend="gloo")):
        assert_trees_equal(sp, p, f"rank {rank}, (2, 1) mesh: params")
        assert_trees_equal(sst, st, f"rank {rank}, (2, 1) mesh: optimizer state")


def test_crash_donate_refuses_a_tensor_that_appears_twice_naming_both_paths():
    w = torch.randn(4, 4)
    params = {"a": w, "b": w, "c": torch.randn(4)}  # tied by hand, not by functionalize

    def loss(p):
        return (p["a"] @ p["b"] + p["c"]).square().sum()

    with pytest.raises(ValueError):  # the plain path refuses the same input
        fdp.optim.sgd(lr=0.1, donate=True).update(torch.func.grad(loss)(params), fdp.optim.sgd(lr=0.1).init(params), params)
    step = fdp.Reducer(params).grad_and_update(loss, fdp.optim.sgd(lr=0.1), donate=True)
    state = step.init(params)
    with pytest.raises(ValueError, match=r"params\['a'\] and params\['b'\] are the same memory"):
        step(params, state)
    assert params["a"] is params["b"] and torch.equal(params["a"], w), "the refused step changed the tree"


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_crash_a_new_optimizer_object_every_step_reuses_one_engine_and_memory_stays_flat():
    params = {"w": torch.randn(1024, 1024) * 0.01, "b": torch.zeros(1024)}  # 4 MiB

    def loss(p, x):
        return torch.tanh(x @ p["w"] + p["b"]).square().mean()

    x = torch.randn(8, 1024)
    reducer = fdp.Reducer(params)
    lrs = [1e-3 * (1 + i % 7) for i in range(30)]  # the lr changed by hand: a new adamw each step
    fused, state, before, sets = dict(params), None, None, set()
    for i, lr in enumerate(lrs):
        step = reducer.grad_and_update(loss, fdp.optim.adamw(lr=lr))
        state = step.init(params) if state is None else state
        fused, state, _ = step(fused, state, x)
        if i == 2:
            before = rss_bytes()
        sets.add(fused["w"].data_ptr())  # (one engine cycles through two param sets)
        assert len(sets) <= 2, f"step {i}: the params were in {len(sets)} flat sets (an engine per optimizer?)"
    grown = rss_bytes() - before
    assert grown < 32 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB over 27 steps"
    plain, pstate = dict(params), fdp.optim.adamw(lr=lrs[0]).init(params)
    for lr in lrs:
        plain, pstate = fdp.optim.adamw(lr=lr).update(reducer.grad(loss)(plain, x), pstate, plain)
    assert_trees_equal(fused, plain, "a new adamw each step, against the plain path")


def test_crash_state_to_tree_returns_the_state_in_the_given_params_order():
    apply, params, buffers = fdp.functionalize(mlp(seed=19))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.adam(lr=1e-2)
    step = fdp.Reducer(params, **CAPS).grad_and_update(loss, opt)
    p, state = train(step, dict(params), step.init(params), 0, range(2))
    mine, theirs = step.state_to_tree(state, p), step.state_to_tree(state, reordered(p))
    assert list(theirs.exp_avg) == list(reordered(p)) == list(opt.init(reordered(p)).exp_avg)
    for field in ("exp_avg", "exp_avg_sq"):
        assert_trees_equal(reordered(getattr(theirs, field)), getattr(mine, field), field)


def integer_sums(group):
    r = group.rank
    big = 2**62 + r  # two of them: 2**63 + 1, past int64
    tree = {
        "int": 123456789,
        "int32": torch.tensor([2_000_000_000, -7], dtype=torch.int32),
        "uint8": torch.tensor([200, 1], dtype=torch.uint8),
        "int64": torch.tensor([2**62 - 1 + r, -(2**62)], dtype=torch.int64),  # sums fit int64 exactly
        "big_int": big,
        "bool": torch.tensor([True, r == 0]),
    }
    s, m = fdp.psum(tree, group), fdp.pmean(tree, group)
    try:
        fdp.psum({"past": torch.tensor([big])}, group)
        overflow = None
    except OverflowError as e:
        overflow = str(e)
    return s, m, overflow


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_8_integer_sums_and_means_are_exact_or_refused_on_every_rank(backend):
    n = 2
    for rank, (s, m, overflow) in enumerate(fdp.testing.run(integer_sums, n, backend=backend)):
        where = f"rank {rank}"
        assert s["int"] == 2 * 123456789 and type(s["int"]) is int, where
        assert m["int"] == 123456789.0 and type(m["int"]) is float, f"{where}: pmean(123456789) = {m['int']!r}"
        # torch's own sums of the ranks' tensors (torch.sum promotes integers to int64 too)
        want = {"int32": torch.tensor([[2_000_000_000, -7]] * n, dtype=torch.int32).sum(0),
                "uint8": torch.tensor([[200, 1]] * n, dtype=torch.uint8).sum(0),
                "int64": torch.tensor([[2**62 - 1, -(2**62)], [2**62, -(2**62)]]).sum(0),
                "bool": torch.tensor([[True, True], [True, False]]).sum(0)}
        for k, w in want.items():
            assert s[k].dtype == torch.int64 == w.dtype and torch.equal(s[k], w), f"{where}: psum {k} = {s[k]}, torch {w}"
            assert m[k].dtype == torch.float64, f"{where}: pmean {k} is {m[k].dtype}"
            assert m[k].tolist() == [int(v) / n for v in w.tolist()], f"{where}: pmean {k} = {m[k]}"
        assert s["big_int"] == 2**63 + 1 and m["big_int"] == (2**63 + 1) / 2, where  # Python ints: exact
        assert overflow is not None and "leaf ['past']" in overflow and "outside int64" in overflow, \
            f"{where}: an int64 sum past 2**63 was not refused: {overflow}"


LR = torch.optim.lr_scheduler
S = fdp.optim.schedules


@pytest.mark.filterwarnings("ignore::UserWarning")  # SequentialLR's warning about step order
@pytest.mark.parametrize("gamma", [0.1, *(pytest.param(g, marks=pytest.mark.slow) for g in (0.3, 0.7, 0.99))])
def test_10b_step_decay_equals_steplr_and_sequential_steplrs_bit_for_bit(gamma):
    n = 300
    want = torch_lrs(lambda o: LR.StepLR(o, step_size=2, gamma=gamma), n, 0.2)
    ours = S.step_decay(0.2, 2, gamma)
    assert [ours(t) for t in range(n)] == want, "in order"
    assert [S.step_decay(0.2, 2, gamma)(t) for t in reversed(range(n))][::-1] == want, "in any order"
    assert [float(ours(torch.tensor(float(t), dtype=torch.float64))) for t in range(n)] == want, "traced"
    assert want != [0.2 * gamma ** (t // 2) for t in range(n)], "the closed form would pass this test too"
    seq = torch_lrs(lambda o: LR.SequentialLR(o, [LR.StepLR(o, 3, gamma), LR.StepLR(o, 2, 0.3)], milestones=[10]),
                    40, 0.2)
    joined = S.join([S.step_decay(0.2, 3, gamma), S.step_decay(0.2, 2, 0.3)], [10])
    assert [joined(t) for t in range(40)] == seq, "SequentialLR of two StepLRs"


def test_10b_float64_params_under_step_decay_equal_torch_sgd_with_steplr_bit_for_bit():
    g = torch.Generator().manual_seed(20)
    w0 = torch.randn(16, dtype=torch.float64, generator=g)
    grads = [torch.randn(16, dtype=torch.float64, generator=g) for _ in range(30)]
    w = w0.clone().requires_grad_()
    torch_opt = torch.optim.SGD([w], lr=0.2, momentum=0.9)
    sched = LR.StepLR(torch_opt, step_size=1, gamma=0.7)
    opt = fdp.optim.sgd(S.step_decay(0.2, 1, 0.7), momentum=0.9)
    params, state = {"w": w0.clone()}, opt.init({"w": w0})
    for i, grad in enumerate(grads):
        w.grad = grad.clone()
        torch_opt.step()
        sched.step()
        params, state = opt.update({"w": grad}, state, params)
        assert torch.equal(params["w"], w.detach()), f"step {i}: fp64 params differ from SGD + StepLR"


def test_10c_adagrad_on_complex_params_equals_torch_adagrad_over_100_steps():
    g = torch.Generator().manual_seed(21)
    w0 = torch.randn(6, 3, dtype=torch.complex64, generator=g)
    w = w0.clone().requires_grad_()
    kw = dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.3)
    torch_opt = torch.optim.Adagrad([w], **kw)
    opt = fdp.optim.adagrad(**kw)
    params = {"w": w0.clone()}
    state = opt.init(params)
    for i in range(100):
        grad = torch.randn(6, 3, dtype=torch.complex64, generator=g)
        w.grad = grad.clone()
        torch_opt.step()
        params, state = opt.update({"w": grad}, state, params)
        assert torch.equal(state.sum["w"], torch_opt.state[w]["sum"]), f"step {i}: the accumulator differs"
        assert torch.equal(params["w"], w.detach()), f"step {i}: params differ"


def powersgd_grads(group, steps=5, hook=None, caps=0.001):
    """Gradients of a Reducer with PowerSGD (compressing from its second step) over several
    buckets: each step from the same params, so each step's numbers stand alone."""
    apply, params, buffers = fdp.functionalize(mlp(width=24, seed=22))
    hook = hook or fdp.hooks.powersgd(rank=1, start_iter=1)
    reducer = fdp.Reducer(params, group, comm_hook=hook, bucket_cap_mb=caps, first_bucket_cap_mb=caps)
    grad_fn = reducer.grad(loss_of(apply, buffers))
    out = [grad_fn(params, *batch(group.rank, i)) for i in range(steps)]
    return out, len(reducer.plan.buckets), hook.state.iter


def test_5_powersgd_over_several_buckets_on_gloo_equals_the_sequential_threads_run():
    """On gloo each bucket's compressed exchange issues its later all-reduces from callbacks;
    two buckets in flight at once issued them in different orders on different ranks (gloo
    aborted the process). The threaded group runs every collective in order: the reference."""
    want = fdp.testing.run(powersgd_grads, 2)
    got = fdp.testing.run(powersgd_grads, 2, backend="gloo", timeout=120)
    for rank, ((grads, nb, it), (ref, _, _)) in enumerate(zip(got, want)):
        assert nb >= 3 and it == 5, f"rank {rank}: {nb} buckets, {it} steps counted"
        for i, (g, r) in enumerate(zip(grads, ref)):
            assert_trees_equal(g, r, f"rank {rank}, step {i}")
        assert torch.linalg.matrix_rank(grads[-1]["2.weight"]) == 1, "it did not compress"


def shared_hook(group):
    _, params, _ = fdp.functionalize(mlp(width=24, seed=22))
    hook = fdp.hooks.powersgd(rank=1, start_iter=1)
    first = fdp.Reducer(params, group, comm_hook=hook)
    try:
        fdp.Reducer({"w": torch.zeros(24, 24)}, group, comm_hook=hook)
        refused = None
    except ValueError as e:
        refused = str(e)
    first.all_reduce(params)  # the first Reducer keeps it
    del first
    # Free again once its Reducer is gone, and as a new hook: the same numbers as a fresh one.
    reused = powersgd_grads(group, hook=hook)[0]
    fresh = powersgd_grads(group)[0]
    return refused, reused, fresh


def test_5_a_powersgd_hook_serves_one_reducer_and_a_second_is_refused_on_every_rank():
    for rank, (refused, reused, fresh) in enumerate(fdp.testing.run(shared_hook, 2, backend="gloo", timeout=120)):
        assert refused is not None and "already serves another fdp.Reducer" in refused, f"rank {rank}: {refused}"
        for i, (a, b) in enumerate(zip(reused, fresh)):
            assert_trees_equal(a, b, f"rank {rank}, step {i}: a hook reused after its Reducer against a fresh one")


def powersgd_through_the_auto_freeze(group):
    apply, params, buffers = fdp.functionalize(mlp(width=24, seed=23))
    loss = loss_of(apply, buffers)
    reducer = fdp.Reducer(params, group, bucket_cap_mb="auto", comm_hook=fdp.hooks.powersgd(rank=1, start_iter=1))
    grad_fn = reducer.grad(loss)
    i = 0
    while not reducer.tuning.frozen:  # calibration: many small buckets, compressing from step 1
        grad_fn(params, *batch(group.rank, i))
        i += 1
    first, rest = reducer.tuning.choice.caps
    fresh = fdp.Reducer(params, group, bucket_cap_mb=rest / 2**20, first_bucket_cap_mb=first / 2**20,
                        comm_hook=fdp.hooks.powersgd(rank=1, start_iter=1))
    assert fresh.plan == reducer.plan
    after = [grad_fn(params, *batch(group.rank, i + j)) for j in range(3)]
    want = [fresh.grad(loss)(params, *batch(group.rank, i + j)) for j in range(3)]
    return after, want


def test_5_powersgd_starts_afresh_on_the_plan_bucket_cap_mb_auto_freezes():
    for rank, (after, want) in enumerate(fdp.testing.run(powersgd_through_the_auto_freeze, 2, backend="gloo",
                                                          timeout=120)):
        for i, (a, w) in enumerate(zip(after, want)):
            assert_trees_equal(a, w, f"rank {rank}, step {i} after the freeze, against a fresh Reducer and hook")


# ----------------------------------------------------------------------------- auto freeze
def freeze_fails_on_one_rank(group):
    params = {"w": torch.randn(4000, generator=torch.Generator().manual_seed(24)), "b": torch.zeros(10)}

    def loss(p, x):
        return (p["w"] * x).square().sum() + p["b"].sum()

    x = torch.randn(4000, generator=torch.Generator().manual_seed(group.rank))
    reducer = fdp.Reducer(params, group, bucket_cap_mb="auto")
    fault = KernelFault(fdp.optim.adamw(1e-3), rank=1, nth=0)  # the kernel timed at the freeze
    fault.armed = group.rank == 1
    try:
        fdp.cost.calibrate(reducer, loss, params, x, optimizer=fault.opt)
        failed = None
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        failed = (type(e).__name__, str(e))
    fault.armed = False
    frozen_after_failure = reducer.tuning.frozen
    choice = fdp.cost.calibrate(reducer, loss, params, x, optimizer=fault.opt)  # tried again: it freezes
    grads = reducer.grad(loss)(params, x)
    return failed, frozen_after_failure, choice, reducer.plan.fingerprint, grads


def test_a_rank_failing_in_the_auto_freeze_fails_every_rank_at_once_with_the_cause():
    results = fdp.testing.run(freeze_fails_on_one_rank, 2, backend="gloo", timeout=120)
    for rank, (failed, frozen, choice, fingerprint, grads) in enumerate(results):
        assert failed is not None, f"rank {rank}: the freeze reported success"
        if rank == 1:
            assert failed[0] == "RuntimeError" and "injected failure" in failed[1], failed
        else:  # at once (not the group's 48 s timeout), naming rank 1 and its error
            assert failed[0] == "CollectiveError", failed
            assert re.search(r"failed on rank\(s\) \[1\] of 2 .*rank 1: RuntimeError: injected failure", failed[1]), failed[1]
        assert not frozen, f"rank {rank}: frozen after a failed freeze"
        assert (choice, fingerprint) == results[0][2:4], f"rank {rank}: another plan than rank 0's"
        assert_trees_equal(grads, results[0][4], f"rank {rank}: gradients after the freeze")
