"""The fused train step (``reducer.grad_and_update``): the same numbers as the plain path and
as DDP + torch.optim, with params, grads and state in flat buckets."""

import math

import pytest
import torch
import torch.nn.functional as F
from models import CAPS, FailOnce, batch, loss_of, mlp
from torch import nn

import fdp

OPTIMIZERS = {
    "sgd-momentum": lambda: fdp.optim.sgd(lr=0.1, momentum=0.9),
    "sgd-nesterov-wd-mask": lambda: fdp.optim.sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                  mask=lambda path, p: p.dim() >= 2),
    "adam": lambda: fdp.optim.adam(lr=1e-2, weight_decay=0.01),
    "adamw-mask-schedule": lambda: fdp.optim.adamw(lr=fdp.optim.schedules.warmup_cosine(1e-2, 2, 10),
                                                   weight_decay=0.1, mask=lambda path, p: p.dim() >= 2),
    "adamw-amsgrad": lambda: fdp.optim.adamw(lr=1e-2, amsgrad=True),
    "adagrad": lambda: fdp.optim.adagrad(lr=1e-2, initial_accumulator_value=0.1),
    "rmsprop-centered": lambda: fdp.optim.rmsprop(lr=1e-3, momentum=0.5, centered=True),
    "chain-clip-value": lambda: fdp.optim.chain(fdp.optim.clip_by_value(-0.01, 0.01), fdp.optim.adamw(lr=1e-2)),
}
def fused_vs_plain(group, name, donate, steps=4):
    apply, params, buffers = fdp.functionalize(mlp(seed=0))
    loss = loss_of(apply, buffers)
    opt = OPTIMIZERS[name]()
    reducer = fdp.Reducer(params, group, hook_threshold_bytes=0, **CAPS)
    step = reducer.grad_and_update(loss, opt, donate=donate)
    state = step.init(params)
    fused = {k: v.clone() for k, v in params.items()}
    plain, plain_state = dict(params), opt.init(params)
    for i in range(steps):
        x, y = batch(group.rank, i)
        fused, state, value = step(fused, state, x, y)
        grads, want = reducer.grad_and_value(loss)(plain, x, y)
        plain, plain_state = opt.update(grads, plain_state, plain)
        assert torch.equal(value, want), f"step {i}: loss"
    return fused, plain, step.state_to_tree(state, fused), plain_state


def leaves_equal(a, b):
    la, lb = fdp._tree.leaves(a), fdp._tree.leaves(b)
    assert len(la) == len(lb)
    return [i for i, (x, y) in enumerate(zip(la, lb)) if not torch.equal(x, y)]


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_step_equals_reducer_grad_and_opt_update_bit_for_bit(name, donate):
    for rank, (fused, plain, fstate, pstate) in enumerate(fdp.testing.run(fused_vs_plain, 2, args=(name, donate))):
        for k in plain:
            assert torch.equal(fused[k], plain[k]), f"rank {rank}, param {k!r}"
        assert not leaves_equal(fstate, pstate), f"rank {rank}: optimizer state differs"


def fused_vs_ddp(group, steps=5, shard=False, mesh=False):
    torch.manual_seed(0)
    model = mlp(seed=2)
    ddp = nn.parallel.DistributedDataParallel(mlp(seed=2), bucket_cap_mb=0.002)
    decay = [p for n, p in ddp.module.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in ddp.module.named_parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    apply, params, buffers = fdp.functionalize(model)
    over = group
    if mesh:  # a 2-D (replicate, shard) mesh over the group's ranks
        from torch.distributed.device_mesh import init_device_mesh

        over = init_device_mesh("cpu", (2, group.size // 2), mesh_dim_names=("replicate", "shard"))
    reducer = fdp.Reducer(params, over, bucket_cap_mb=0.002, shard=shard)
    step = reducer.grad_and_update(loss_of(apply, buffers),
                                   fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=lambda path, p: p.dim() >= 2))
    state = step.init(params)
    for i in range(steps):
        x, y = batch(group.rank, i)
        torch_opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        torch_opt.step()
        params, state, _ = step(params, state, x, y)
    return params, {k: p.detach().clone() for k, p in ddp.module.named_parameters()}


def test_fused_adamw_with_decay_groups_equals_ddp_and_torch_adamw_on_gloo_ranks():
    for rank, (fused, ddp) in enumerate(fdp.testing.run(fused_vs_ddp, 2, backend="gloo", timeout=120)):
        for k in ddp:
            assert torch.equal(fused[k], ddp[k]), f"rank {rank}, param {k!r}"


def clipped(group, norm_type, steps=6):
    apply, params, buffers = fdp.functionalize(mlp(seed=3))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05, norm_type),
                          fdp.optim.adamw(lr=1e-2, mask=lambda path, p: p.dim() >= 2))
    reducer = fdp.Reducer(params, group, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    fused, plain, plain_state = dict(params), dict(params), opt.init(params)
    for i in range(steps):
        x, y = batch(group.rank, i)
        fused, state, _ = step(fused, state, x, y)
        plain, plain_state = opt.update(reducer.grad(loss)(plain, x, y), plain_state, plain)
    return fused, plain, plain_state.transforms[0].norm, step.state_to_tree(state, fused).transforms[0].norm


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 0.0, math.inf, -math.inf])
def test_global_norm_clipping_equals_the_plain_path_bit_for_bit(norm_type):
    """The fused step's norm is each leaf's (from its view in the bucket, measured as the
    bucket lands), then the norm of those in leaf order: clip_grad_norm_'s, so the fused
    step equals reducer.grad + opt.update exactly, for every norm type (a norm summed per
    bucket counted buckets for norm_type=0)."""
    for rank, (fused, plain, pnorm, fnorm) in enumerate(fdp.testing.run(clipped, 2, args=(norm_type,))):
        assert torch.equal(fnorm, pnorm), f"rank {rank}: norm {fnorm} != {pnorm}"
        for k in plain:
            assert torch.equal(fused[k], plain[k]), f"rank {rank}, {k!r}"


def accumulated(group, k=3):
    apply, params, buffers = fdp.functionalize(mlp(seed=4))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.sgd(lr=0.1, momentum=0.9)
    reducer = fdp.Reducer(params, group, **CAPS)
    state = opt.init(params)
    fstate = None
    fused, plain = dict(params), dict(params)
    for s in range(2):
        xs = [batch(group.rank, 10 * s + j) for j in range(k)]
        acc = None
        for x, y in xs[:-1]:
            g = torch.func.grad(loss)(fused, x, y)
            acc = g if acc is None else {n: acc[n] + g[n] for n in g}
        step = reducer.grad_and_update(loss, opt, accumulate=acc)
        fstate = step.init(fused) if fstate is None else fstate
        fused, fstate, _ = step(fused, fstate, *xs[-1])
        acc = None
        for x, y in xs[:-1]:
            g = torch.func.grad(loss)(plain, x, y)
            acc = g if acc is None else {n: acc[n] + g[n] for n in g}
        plain, state = opt.update(reducer.grad(loss, accumulate=acc)(plain, *xs[-1]), state, plain)
    return fused, plain


@pytest.mark.filterwarnings(r"ignore:fdp.Reducer.grad_and_update\(..., accumulate=\) is built again")  # (the old recipe, on purpose)
def test_accumulated_micro_batches_update_as_the_plain_path():
    for rank, (fused, plain) in enumerate(fdp.testing.run(accumulated, 2)):
        for k in plain:
            assert torch.equal(fused[k], plain[k]), f"rank {rank}, param {k!r}"


def nonfinite(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=5))
    loss = loss_of(apply, buffers)
    reducer = fdp.Reducer(params, group, skip_nonfinite=True, **CAPS)
    step = reducer.grad_and_update(loss, fdp.optim.adam(lr=1e-2))
    state = step.init(params)
    x, y = batch(group.rank, 0)
    params, state, _ = step(params, state, x, y)
    before = {k: v.clone() for k, v in params.items()}
    bad = x.clone()
    if group.rank == 1:
        bad[0, 0] = float("inf")
    params, state, _ = step(params, state, bad, y)
    verdict = step.last_step.finite
    return before, params, int(state.step), verdict


def test_a_nonfinite_step_updates_nothing_on_any_rank():
    for rank, (before, after, count, finite) in enumerate(fdp.testing.run(nonfinite, 2)):
        assert not finite and count == 1, f"rank {rank}"
        for k in before:
            assert torch.equal(before[k], after[k]), f"rank {rank}, param {k!r} moved on a skipped step"


def with_hook(group, hook_name):
    apply, params, buffers = fdp.functionalize(mlp(seed=6))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.adamw(lr=1e-2)
    reducer = fdp.Reducer(params, group, comm_hook=getattr(fdp.hooks, hook_name), **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    fused, plain, pstate = dict(params), dict(params), opt.init(params)
    for i in range(3):
        x, y = batch(group.rank, i)
        fused, state, _ = step(fused, state, x, y)
        plain, pstate = opt.update(reducer.grad(loss)(plain, x, y), pstate, plain)
    return fused, plain


@pytest.mark.parametrize("hook_name", ["bf16_compress", "fp16_compress"])
def test_comm_hooks_update_an_fp32_master_copy_as_the_plain_path(hook_name):
    for rank, (fused, plain) in enumerate(fdp.testing.run(with_hook, 2, backend="gloo", args=(hook_name,))):
        for k in plain:
            assert fused[k].dtype == torch.float32
            assert torch.equal(fused[k], plain[k]), f"rank {rank}, param {k!r}"


def uneven(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=7))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.sgd(lr=0.1, momentum=0.9)
    reducer = fdp.Reducer(params, group, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    fused, plain, pstate = dict(params), dict(params), opt.init(params)
    for i in range(3):
        active = not (group.rank == 1 and i == 2)
        x, y = batch(group.rank, i)
        g = torch.func.grad(loss)(fused, x, y) if active else None
        fused, state = step.update(g, state, fused, active=active)
        g = torch.func.grad(loss)(plain, x, y) if active else None
        plain, pstate = opt.update(reducer.all_reduce(g, active=active), pstate, plain)
    return fused, plain


def test_uneven_inputs_update_every_rank_as_the_plain_path():
    for rank, (fused, plain) in enumerate(fdp.testing.run(uneven, 2)):
        for k in plain:
            assert torch.equal(fused[k], plain[k]), f"rank {rank}, param {k!r}"


def test_kept_params_are_never_overwritten_and_a_changed_tree_is_repacked():
    apply, params, buffers = fdp.functionalize(mlp(seed=8))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.sgd(lr=0.1)
    reducer = fdp.Reducer(params)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    x, y = batch(0, 0)
    p1, state, _ = step(params, state, x, y)
    kept = {k: v.clone() for k, v in p1.items()}
    p2, state, _ = step(p1, state, x, y)
    p3, state, _ = step(p2, state, x, y)  # the set p1 lives in is still held: not reused
    for k in kept:
        assert torch.equal(p1[k], kept[k]), f"kept params {k!r} were overwritten"
    changed = dict(p3)
    changed["0.weight"] = torch.zeros_like(p3["0.weight"])  # a leaf replaced by the caller
    got, state, _ = step(changed, state, x, y)
    want = opt.update(reducer.grad(loss)(changed, x, y), opt.init(changed), changed)[0]
    assert torch.equal(got["0.weight"], want["0.weight"]), "the replaced leaf was ignored"


def test_a_donated_tree_is_repointed_into_the_flat_set_and_its_old_memory_freed():
    import weakref

    apply, params, buffers = fdp.functionalize(mlp(seed=9))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.sgd(lr=0.1)
    reducer = fdp.Reducer(params, **CAPS)
    x, y = batch(0, 0)
    want = opt.update(reducer.grad(loss)(params, x, y), opt.init(params), params)[0]
    loaded = {k: v.clone() for k, v in params.items()}  # e.g. fresh from fdp.load: nothing else holds it
    old = weakref.ref(loaded["0.weight"].untyped_storage())
    assert old() is not None  # alive while the tensor holds it
    step = reducer.grad_and_update(loss, opt, donate=True)
    state = step.init(loaded)
    out, state, _ = step(loaded, state, x, y)
    assert old() is None, "the donated tree's memory outlived the pack"
    for k in out:
        assert loaded[k].data_ptr() == out[k].data_ptr(), f"{k!r} was not re-pointed"
        assert torch.equal(out[k], want[k]), f"param {k!r}"
    kept = {k: v.clone() for k, v in params.items()}
    pure = reducer.grad_and_update(loss, fdp.optim.sgd(lr=0.1))
    pure(params, pure.init(params), x, y)
    for k in kept:  # pure: the caller's tensors keep their own memory and values
        assert torch.equal(params[k], kept[k]), f"pure step changed {k!r}"


def broadcast_then_step(group, donate):
    import weakref

    apply, params, buffers = fdp.functionalize(mlp(width=128, seed=11))  # > 64 KiB: not in fdp._comm.lifetime.RECENT
    loss = loss_of(apply, buffers)
    opt = fdp.optim.sgd(lr=0.1, momentum=0.9)
    reducer = fdp.Reducer(params, group, **CAPS)
    x, y = batch(group.rank, 0)
    want = opt.update(reducer.grad(loss)(params, x, y), opt.init(params), params)[0]
    synced = fdp.broadcast(params, group=group)  # what DDP's constructor does
    assert all(t._base is None for t in synced.values()), "broadcast leaves are autograd views"
    bucket = weakref.ref(synced["0.weight"].untyped_storage())  # one storage behind every leaf
    kept = {k: v.clone() for k, v in synced.items()}
    step = reducer.grad_and_update(loss, opt, donate=donate)
    state = step.init(synced)
    out, state, _ = step(synced, state, x, y)
    freed = bucket() is None
    unchanged = all(torch.equal(synced[k], kept[k]) for k in kept)
    sets = step.memory().param_sets
    return freed, unchanged, sets, all(torch.equal(out[k], want[k]) for k in want)


def test_a_donated_broadcast_tree_is_freed_by_the_first_step_and_a_pure_one_packed_once():
    """The first fused step after fdp.broadcast holds no third params-sized set: donated, the
    broadcast's bucket is freed during the pack (its leaves are re-pointable aliases, not
    views); pure, the packed copy is the set the update writes (the caller's tree untouched)."""
    for rank, (freed, _unchanged, _sets, equal) in enumerate(fdp.testing.run(broadcast_then_step, 2, args=(True,))):
        assert freed, f"rank {rank}: the broadcast bucket outlived a donated first step"
        assert equal, f"rank {rank}: params differ from the plain path"
    for rank, (freed, unchanged, sets, equal) in enumerate(fdp.testing.run(broadcast_then_step, 2, args=(False,))):
        assert not freed and unchanged, f"rank {rank}: a pure step changed or freed the caller's tree"
        assert sets == 1, f"rank {rank}: the first pure step made {sets} param sets (packed copy + output)"
        assert equal, f"rank {rank}: params differ from the plain path"


def test_steady_state_allocates_no_new_param_sets():
    apply, params, buffers = fdp.functionalize(mlp(seed=9))
    loss = loss_of(apply, buffers)
    reducer = fdp.Reducer(params)
    step = reducer.grad_and_update(loss, fdp.optim.adamw(lr=1e-3))
    state = step.init(params)
    x, y = batch(0, 0)
    ptrs = set()
    for _ in range(6):
        params, state, _ = step(params, state, x, y)
        ptrs.add(params["0.weight"].data_ptr())
    assert len(ptrs) == 2, f"{len(ptrs)} distinct param buffers over 6 steps (pure: two sets in turn)"


def resume(group, tmp, world_after):
    apply, params, buffers = fdp.functionalize(mlp(seed=10))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.chain(fdp.optim.clip_by_value(-0.05, 0.05), fdp.optim.adamw(lr=1e-2))
    reducer = fdp.Reducer(params, group, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    for i in range(2):
        params, state, _ = step(params, state, *batch(0, i))
    fdp.save(f"{tmp}/ckpt.pt", {"params": params, "opt": step.state_to_tree(state, params)})
    for i in range(2, 4):
        params, state, _ = step(params, state, *batch(0, i))
    return params


def resumed(group, tmp, shard=False):
    apply, params, buffers = fdp.functionalize(mlp(seed=10))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.chain(fdp.optim.clip_by_value(-0.05, 0.05), fdp.optim.adamw(lr=1e-2))
    reducer = fdp.Reducer(params, group, bucket_cap_mb=1, shard=shard)  # another plan
    step = reducer.grad_and_update(loss, opt)
    like = {"params": params, "opt": opt.init(params)}
    loaded = fdp.load(f"{tmp}/ckpt.pt", like=like, group=group)
    params = loaded["params"]
    state = step.state_from_tree(loaded["opt"], params)
    for i in range(2, 4):
        params, state, _ = step(params, state, *batch(0, i))
    return params


def test_checkpoint_resume_through_the_per_leaf_layout_into_another_world_and_plan(tmp_path):
    straight = fdp.testing.run(resume, 2, args=(str(tmp_path), 1))[0]  # every rank has the same data
    again = fdp.testing.run(resumed, 1, args=(str(tmp_path),))[0]
    for k in straight:
        assert torch.equal(straight[k], again[k]), f"param {k!r}"


def test_elementwise_updates_run_while_the_backward_goes_on():
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    apply, params, buffers = fdp.functionalize(model)
    reducer = fdp.Reducer(params, bucket_cap_mb=0.2, first_bucket_cap_mb=0.2, hook_threshold_bytes=0)
    step = reducer.grad_and_update(loss_of(apply, buffers), fdp.optim.adamw(lr=1e-3))
    state = step.init(params)
    params, state, _ = step(params, state, torch.randn(64, 256), torch.randint(0, 10, (64,)))
    tl = step.last_step.timeline
    assert all(b.update_start is not None for b in tl.buckets)
    assert tl.buckets[0].update_end < tl.backward_end, "the first bucket was updated during the backward"
    assert tl.exposed_update < sum(b.update_end - b.update_start for b in tl.buckets)


def test_unsupported_optimizers_are_refused_with_the_way_out():
    params = {"w": torch.ones(3)}
    reducer = fdp.Reducer(params)
    part = fdp.optim.partition({"w": "a"}, {"a": fdp.optim.adafactor(lr=0.1)})  # not element-wise
    with pytest.raises(TypeError, match="every label of a partition.*use reducer.grad and opt.update"):
        reducer.grad_and_update(lambda p: p["w"].sum(), part)
    with pytest.raises(TypeError, match="not element-wise.*use reducer.grad and opt.update"):
        reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.adafactor(lr=0.1))
    with pytest.raises(TypeError, match="argnums"):  # the params are always fn's first argument
        reducer.grad_and_update(lambda b, p: p["w"].sum(), fdp.optim.sgd(lr=0.1), argnums=1)
    step = reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.sgd(lr=0.1))
    with pytest.raises(TypeError, match="FusedState"):
        step(params, fdp.optim.sgd(lr=0.1).init(params))


def test_a_step_that_failed_after_updating_some_buckets_refuses_its_state_until_a_fresh_one():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    apply, params, buffers = fdp.functionalize(model)
    reducer = fdp.Reducer(params, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001, hook_threshold_bytes=0)

    def loss(p, x, fail):
        p = {**p, "0.weight": FailOnce.apply(p["0.weight"])}  # its backward runs last
        return apply(p, buffers, x)[0].square().mean()

    opt = fdp.optim.sgd(lr=0.1, momentum=0.9)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)
    x = torch.randn(8, 64)
    FailOnce.arm()
    with pytest.raises(RuntimeError, match="injected"):
        step(params, state, x, True)
    with pytest.raises(RuntimeError, match="had updated .* of the optimizer state in place"):
        step(params, state, x, False)
    state = step.init(params)  # a fresh state: accepted again
    params, state, _ = step(params, state, x, False)
    assert int(state.step) == 1


def test_a_masked_adamw_updates_each_bucket_in_one_kernel_call_with_the_plain_paths_numbers():
    # A decay mask puts weights and biases in two groups whose leaves alternate in a bucket:
    # AdamW's group-0 runs are decayed first (LeafKernel.decay), then one kernel call without
    # decay covers the bucket, instead of one call per run of each group.
    apply, params, buffers = fdp.functionalize(mlp(seed=21))
    loss = loss_of(apply, buffers)
    adamw = fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=lambda path, p: p.dim() >= 2)
    calls = {"step": 0, "decay": 0}
    kernel = adamw.form.leaf_kernel

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    counting = adamw._replace(form=adamw.form._replace(leaf_kernel=kernel._replace(
        step=counted("step", kernel.step), decay=counted("decay", kernel.decay))))
    reducer = fdp.Reducer(params, **CAPS)
    nb = len(reducer.plan.buckets)
    assert nb >= 2
    step = reducer.grad_and_update(loss, counting)
    fused, state = dict(params), step.init(params)
    plain, pstate = dict(params), adamw.init(params)
    for i in range(3):
        fused, state, _ = step(fused, state, *batch(0, i))
        plain, pstate = adamw.update(reducer.grad(loss)(plain, *batch(0, i)), pstate, plain)
    assert calls == {"step": 3 * nb, "decay": 3 * nb}, calls
    for k in plain:
        assert torch.equal(fused[k], plain[k]), k


def test_with_accumulation_a_kept_leaf_is_never_overwritten_and_otherwise_two_sets_serve():
    # The step keeps views of its param sets and autograd leaves made from them for reuse
    # (ParamSet.inner, .reused): a set is free when nothing but those refers to it, and held
    # as soon as anything else does, one leaf of it included.
    apply, params, buffers = fdp.functionalize(mlp(seed=22))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(lr=1e-2))
    reducer = fdp.Reducer(params, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state = step.init(params)

    def one(p, s, i):
        for m in range(2):
            step.accumulate(p, *batch(0, 10 * i + m))
        return step(p, s, *batch(0, 10 * i + 2))[:2]

    ptrs = set()
    for i in range(6):
        params, state = one(params, state, i)
        ptrs.add(params["0.weight"].data_ptr())
    assert len(ptrs) == 2, f"{len(ptrs)} distinct param sets over 6 pure steps with nothing kept"
    leaf = params["2.weight"]  # keep one leaf of this set only
    value = leaf.clone()
    for i in range(6, 9):
        params, state = one(params, state, i)
    assert torch.equal(leaf, value), "a kept leaf of an earlier set was overwritten"


def test_the_old_accumulation_recipe_built_each_step_warns_once():
    """grad_and_update(..., accumulate=) built anew each step still gives the right numbers
    (test_accumulated_micro_batches_update_as_the_plain_path) but is the slow recipe: the
    second build warns once, naming step.accumulate; step.accumulate itself never warns."""
    import warnings

    apply, params, buffers = fdp.functionalize(mlp(seed=4))
    loss = loss_of(apply, buffers)
    reducer = fdp.Reducer(params)
    acc = {k: torch.zeros_like(v) for k, v in params.items()}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(4):
            reducer.grad_and_update(loss, fdp.optim.sgd(lr=0.1), accumulate=acc)
        step = reducer.grad_and_update(loss, fdp.optim.sgd(lr=0.1))
        step.accumulate(params, *batch(0, 0))
    mine = [w for w in seen if "step.accumulate(params, *micro_batch)" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in seen]
