"""The step machine under the cases that used to give a silent wrong answer.

Each test names the promise: higher-order gradients inside the loss, ranks that disagree on
the wire dtype, a rank whose step fails half-way and retries, ranks at different steps,
``active=`` on some ranks only; plus the smaller ones: an empty params tree, a Reducer freed
on ``del``, and capability-declared hooks.
"""

import gc
import weakref

import pytest
import torch
from models import FailOnce
from torch import nn

import fdp


def penalty_loss(p):
    """A loss that differentiates the params inside itself (a gradient penalty)."""
    s = (p["w"] ** 3).sum() + (p["b"] * p["w"][0]).sum()
    (g,) = torch.autograd.grad(s, p["w"], create_graph=True)
    return s + (g ** 2).sum() * 1e-3


def penalty_params(seed, n):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, n, generator=g) * 0.1, "b": torch.randn(n, generator=g)}


@pytest.mark.parametrize("engine", ["autograd", "functorch"])
@pytest.mark.parametrize("n", [64, 128], ids=["16KiB-leaf", "64KiB-leaf"])  # 64 KiB: the released path
def test_higher_order_gradients_inside_the_loss_equal_torch_func_in_a_world_of_one(engine, n):
    params = penalty_params(0, n)
    reducer = fdp.Reducer(params, hook_threshold_bytes=0, engine=engine)
    got, value = reducer.grad_and_value(penalty_loss)(params)
    want, want_value = torch.func.grad_and_value(penalty_loss)(params)
    assert torch.equal(value, want_value), "the loss itself changed: the inner call saw a wrong gradient"
    for k in want:
        assert torch.equal(got[k], want[k]), f"leaf {k!r}: max diff {(got[k] - want[k]).abs().max()}"
    tl = reducer.last_step.timeline
    assert tl.buckets[0].launch < tl.backward_end, "the outer backward still overlaps its all-reduce"


def higher_order_on_ranks(group, n):
    params = penalty_params(group.rank, n)
    reducer = fdp.Reducer(penalty_params(0, n), group, hook_threshold_bytes=0, bucket_cap_mb=0.01,
                          first_bucket_cap_mb=0.01)
    return reducer.grad(penalty_loss)(params), torch.func.grad(penalty_loss)(params)


def test_higher_order_gradients_are_averaged_exactly_on_two_ranks():
    res = fdp.testing.run(higher_order_on_ranks, 2, args=(128,))
    for rank, (got, _) in enumerate(res):
        for k in got:
            want = res[0][1][k] * 0.5 + res[1][1][k] * 0.5
            assert torch.equal(got[k], want), f"rank {rank}, leaf {k!r}"


# ---------------------------------------------------------------------------- wire dtypes


def mixed_wires(group, kind):
    params = {"w": torch.ones(64)}
    if kind == "hooks":  # same width, different dtype
        hook = fdp.hooks.fp16_compress if group.rank == 0 else fdp.hooks.bf16_compress
        fdp.Reducer(params, group, comm_hook=hook)
    elif kind == "reduce_dtype":
        fdp.Reducer(params, group, reduce_dtype=torch.float16 if group.rank == 0 else torch.bfloat16)
    else:  # different widths: fp16 on the wire against fp32
        fdp.Reducer(params, group, comm_hook=fdp.hooks.fp16_compress if group.rank == 0 else None)


@pytest.mark.parametrize("kind", ["hooks", "reduce_dtype", "widths"])
def test_ranks_with_different_wire_dtypes_get_a_named_error_at_construction(kind):
    # (found by the construction's check, not at a timeout: that would be a CollectiveError)
    with pytest.raises(fdp.ReplicaMismatchError) as info:
        fdp.testing.run(mixed_wires, 2, backend="gloo", args=(kind,), timeout=30)
    msg = str(info.value)
    assert "rank 0 uses" in msg and "rank 1 uses" in msg, msg
    assert ("float16" in msg and "bfloat16" in msg) or "fp16_compress" in msg, msg


# ---------------------------------------------------------------------------- failed steps


def fail_then_retry(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    apply, params, buffers = fdp.functionalize(model)
    # One bucket per layer: the last layer's bucket launches before the backward reaches the
    # first layer, where rank 1's failure is injected.
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001, hook_threshold_bytes=0)

    def loss(p, x):
        p = {**p, "0.weight": FailOnce.apply(p["0.weight"])}  # its backward runs last
        out, _ = apply(p, buffers, x)
        return out.square().mean()

    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * group.rank + i)) for i in range(2)]
    outcome = []
    FailOnce.arm(group.rank == 1)
    try:
        reducer.grad(loss)(params, xs[0])
        outcome.append("ok")
    except fdp.CollectiveError as e:
        outcome.append(f"CollectiveError: {e}")
    except RuntimeError as e:
        outcome.append(f"RuntimeError: {e}")
    retried = reducer.grad(loss)(params, xs[1])  # every rank moves on to the next batch
    local = torch.func.grad(lambda p: loss(p, xs[1]))(params)
    return outcome, retried, local, reducer.steps


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_a_step_that_fails_half_way_on_one_rank_raises_on_every_rank_and_the_next_step_is_exact(backend):
    res = fdp.testing.run(fail_then_retry, 2, backend=backend, timeout=60)
    (out0, got0, local0, steps0), (out1, got1, local1, steps1) = res
    assert out1[0].startswith("RuntimeError: injected failure"), out1
    assert out0[0].startswith("CollectiveError") and "failed on 1 other rank" in out0[0], out0
    assert steps0 == steps1 == 2
    for rank, got in enumerate((got0, got1)):
        for k in got:
            assert torch.equal(got[k], local0[k] * 0.5 + local1[k] * 0.5), f"rank {rank}, leaf {k!r}"


def different_steps(group):
    params = {"w": torch.ones(8)}
    a = fdp.Reducer(params, group)
    b = fdp.Reducer(params, group)
    first = (b if group.rank == 0 else a).all_reduce(params)  # rank 1 runs a's step 0 early
    try:
        a.all_reduce(params)  # rank 0: a's step 0; rank 1: a's step 1
        return first, "no error"
    except fdp.CollectiveError as e:
        return first, str(e)


def test_ranks_running_different_steps_of_a_reducer_raise_on_every_rank():
    for rank, (first, msg) in enumerate(fdp.testing.run(different_steps, 2, backend="gloo", timeout=30)):
        assert torch.equal(first["w"], torch.ones(8)), rank
        assert "different steps" in msg, f"rank {rank}: {msg}"


def active_on_some_ranks(group):
    params = {"w": torch.ones(4)}
    reducer = fdp.Reducer(params, group)
    reducer.all_reduce(params, active=True) if group.rank == 0 else reducer.all_reduce(params)


def test_active_passed_on_some_ranks_only_is_a_named_error_not_a_timeout():
    # a timeout would be a CollectiveError (or fdp.testing's TimeoutError), not this
    with pytest.raises(fdp.ReplicaMismatchError, match="passed active="):
        fdp.testing.run(active_on_some_ranks, 2, backend="gloo", timeout=30)


# ---------------------------------------------------------------------------- smaller cases


def empty_tree(group):
    reducer = fdp.Reducer({}, group)
    x = torch.ones(3, requires_grad=True)
    grads, value = reducer.grad_and_value(lambda p, x: (x * 2).sum())({}, x)
    return grads, value, reducer.all_reduce({})


@pytest.mark.parametrize("world", [1, 2])
def test_an_empty_params_tree_gives_empty_gradients_as_torch_func_does(world):
    for grads, value, reduced in fdp.testing.run(empty_tree, world):
        assert grads == {} and reduced == {} and value.item() == 6.0


def test_a_reducer_is_freed_on_del_without_the_garbage_collector():
    params = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    gc.disable()
    try:
        reducer = fdp.Reducer(params, grad_views=True, hook_threshold_bytes=0)
        reducer.grad(lambda p: (p["w"] @ p["b"]).square().sum())(params)
        ref = weakref.ref(reducer)
        del reducer
        assert ref() is None, "a reference cycle keeps the Reducer (and its buffers) alive"
    finally:
        gc.enable()


def test_every_hook_runs_its_own_body_on_the_same_road():
    calls = []

    def counting(bucket, flat, group):
        calls.append(bucket.index)
        return fdp.hooks.allreduce.fn(bucket, flat, group)  # the default's own body

    params = {"a": torch.randn(300), "b": torch.randn(300)}
    hook = fdp.hooks.CommHook(counting, in_place=True, name="counting")
    reducer = fdp.Reducer(params, comm_hook=hook, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
    grads = reducer.grad(lambda p: (p["a"] * p["b"]).sum())(params)
    assert calls == [0, 1]
    assert torch.equal(grads["a"], params["b"]) and torch.equal(grads["b"], params["a"])
    assert fdp.hooks.allreduce.in_place and fdp.hooks.allreduce.traceable
    assert not fdp.hooks.noop.traceable and not fdp.hooks.powersgd().in_place
    future = fdp.hooks.allreduce(reducer.plan.buckets[0], torch.ones(3), fdp.Group.single())
    assert torch.equal(future.wait(), torch.ones(3)), "calling an in-place hook still gives a Future"


def test_step_record_reports_the_verdict_and_timeline_of_each_step():
    params = {"w": torch.ones(4)}
    reducer = fdp.Reducer(params, skip_nonfinite=True)
    assert reducer.last_step is None
    reducer.all_reduce({"w": torch.full((4,), float("nan"))})
    rec = reducer.last_step
    assert (rec.step, rec.kind, rec.finite) == (0, "all_reduce", False)
    assert reducer.nonfinite_steps == 1
    reducer.grad(lambda p: p["w"].sum())(params)
    assert (reducer.last_step.step, reducer.last_step.kind, reducer.last_step.finite) == (1, "grad", True)


def test_configuration_is_fixed_at_construction():
    reducer = fdp.Reducer({"w": torch.ones(2)}, engine="functorch")
    assert reducer.engine == "functorch"
    for option, value in (("engine", "autograd"), ("debug", True), ("skip_nonfinite", True),
                          ("grad_views", True), ("overlap", False)):
        with pytest.raises(AttributeError):  # read-only: the Reducer's StepConfig is frozen
            setattr(reducer, option, value)
    with pytest.raises(ValueError, match="engine must be one of"):
        fdp.Reducer({"w": torch.ones(2)}, engine="jax")
    with pytest.raises(ValueError, match="hook_threshold_bytes"):
        fdp.Reducer({"w": torch.ones(2)}, hook_threshold_bytes=-1)


def test_handed_over_gradients_are_never_overwritten_and_dropped_ones_are_reused():
    params = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    reducer = fdp.Reducer(params)
    grad_fn = reducer.grad(lambda p, s: ((p["w"] @ p["b"]) * s).sum())
    kept = grad_fn(params, 1.0)
    snapshot = {k: v.clone() for k, v in kept.items()}
    ptrs = set()
    for s in (2.0, 3.0, 4.0, 5.0):
        g = grad_fn(params, s)  # the previous g is dropped when rebound
        ptrs.add(g["w"].data_ptr())
    for k in kept:
        assert torch.equal(kept[k], snapshot[k]), f"kept gradient {k!r} was overwritten"
    assert len(ptrs) <= 2, f"{len(ptrs)} distinct buffers over 4 steps: dropped gradients were not reused"
    assert torch.equal(g["b"], (params["w"].t() @ torch.full((256,), 5.0)))


def test_a_single_kept_gradient_is_never_overwritten():
    # One leaf, one view of its bucket held: the count of references must not be misread
    # (torch 2.4 drops a temporary storage object's reference before its count is read).
    params = {"w": torch.randn(64)}
    grad_fn = fdp.Reducer(params).grad(lambda p, s: (p["w"] * s).sum())
    kept = grad_fn(params, 1.0)["w"]
    for s in (2.0, 3.0, 4.0):
        grad_fn(params, s)
    assert torch.equal(kept, torch.ones(64)), "the kept gradient was overwritten by a later step"


def test_the_reducers_counters_and_record_include_its_fused_steps():
    """reducer.steps, last_step and nonfinite_steps count plain and fused steps alike (one
    step count per Reducer: the status checks it across ranks)."""
    params = {"w": torch.ones(4)}
    reducer = fdp.Reducer(params, skip_nonfinite=True)
    step = reducer.grad_and_update(lambda p, s: (p["w"] * s).sum(), fdp.optim.sgd(lr=0.1))
    state = step.init(params)
    reducer.grad(lambda p: p["w"].sum())(params)
    params, state, _ = step(params, state, torch.ones(4))
    assert reducer.steps == 2 and reducer.last_step is step.last_step and reducer.last_step.finite
    assert reducer.last_step.step == 1
    before = params["w"].clone()
    params, state, _ = step(params, state, torch.full((4,), float("inf")))  # skipped on every rank
    assert reducer.steps == 3 and not reducer.last_step.finite and reducer.nonfinite_steps == 1
    assert torch.equal(params["w"], before) and int(state.step) == 1


def test_a_skipped_fused_step_reports_its_nonfinite_norm_and_changes_nothing_else():
    """With skip_nonfinite and clipping, a skipped step's ClipState.norm is that step's norm (inf:
    why it was skipped), not the previous step's; params, moments and the count stay."""
    params = {"w": torch.ones(4)}
    reducer = fdp.Reducer(params, skip_nonfinite=True)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(lr=0.1))
    step = reducer.grad_and_update(lambda p, s: (p["w"] * s).sum(), opt)
    state = step.init(params)
    params, state, _ = step(params, state, torch.ones(4))
    assert float(state.transforms[0].norm) == 2.0
    before = (params["w"].clone(), [t.clone() for t in state.buffers["exp_avg"]], int(state.step))
    params, state, _ = step(params, state, torch.tensor([1.0, float("inf"), 1.0, 1.0]))
    assert not step.last_step.finite and reducer.nonfinite_steps == 1
    assert float(state.transforms[0].norm) == float("inf")
    assert torch.equal(params["w"], before[0]) and int(state.step) == before[2]
    assert all(torch.equal(a, b) for a, b in zip(state.buffers["exp_avg"], before[1]))
