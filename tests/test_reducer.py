"""fdp.Reducer: averaged gradients equal the per-rank mean and torch DDP, overlap, hooks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import batch, ce_loss, mlp
from torch import nn

import fdp
from fdp._plan.bucket import MiB

OVERLAP = [True, False]


def Reducer(*args, **kwargs):
    """These small test models have leaves of a few KiB, which the Reducer would leave
    unhooked (not worth an early launch); hook them all so the overlap path is what runs.
    The unhooked path has tests of its own below."""
    kwargs.setdefault("hook_threshold_bytes", 0)
    return fdp.Reducer(*args, **kwargs)

# "autograd": plain autograd on detached leaves (what "auto" picks at the top level);
# "functorch": torch.func.grad with hooks on functorch-wrapped leaves (the private-API path).
ENGINES = ["autograd", "functorch"]


def rank_sum_in_order(per_rank, scale):
    """The threaded PG adds the ranks' tensors in rank order: the exact expected mean."""
    out = per_rank[0] * scale
    for t in per_rank[1:]:
        out = out + t * scale
    return out


def grads_and_locals(group, overlap, caps, engine="autograd"):
    model = mlp(seed=0)
    apply, params, buffers = fdp.functionalize(model)
    loss = ce_loss(apply)
    reducer = Reducer(params, group, bucket_caps_mb=caps, overlap=overlap, engine=engine)
    x, y = batch(group.rank)
    grads, _ = reducer.grad(loss, has_aux=True)(params, buffers, x, y)
    local, _ = torch.func.grad(loss, has_aux=True)(params, buffers, x, y)
    return grads, local, len(reducer.plan.buckets)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("caps", [None, [1 / MiB]], ids=["default-caps", "one-bucket-per-leaf"])
def test_grads_are_the_bitexact_mean_of_per_rank_grads(world_size, overlap, caps, engine):
    res = fdp.testing.run(grads_and_locals, world_size, args=(overlap, caps, engine))
    if caps:
        assert res[0][2] == len(res[0][0])  # really one bucket per leaf
    for k in res[0][0]:
        expected = rank_sum_in_order([r[1][k] for r in res], 1.0 / world_size)
        for rank, r in enumerate(res):
            assert torch.equal(r[0][k], expected), f"rank {rank}, leaf {k!r}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("overlap", OVERLAP)
def test_grads_are_the_bitexact_mean_on_gloo(overlap, engine):
    res = fdp.testing.run(grads_and_locals, 2, backend="gloo", args=(overlap, [200 / MiB], engine))
    for k in res[0][0]:
        expected = res[0][1][k] * 0.5 + res[1][1][k] * 0.5
        for rank, r in enumerate(res):
            assert torch.equal(r[0][k], expected), f"rank {rank}, leaf {k!r}"


def ddp_parity(group, overlap, engine, steps=5, lr=0.1):
    torch.manual_seed(0)
    ref_model = mlp(width=32, seed=1)
    ddp = nn.parallel.DistributedDataParallel(mlp(width=32, seed=1), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    apply, params, buffers = fdp.functionalize(ref_model)
    reducer = Reducer(params, group, bucket_cap_mb=0.002, first_bucket_cap_mb=0.002, overlap=overlap, engine=engine)
    grad_fn = reducer.grad(ce_loss(apply), has_aux=True)
    for step in range(steps):
        x, y = batch(group.rank, step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        grads, _ = grad_fn(params, buffers, x, y)
        # torch.optim.SGD (no momentum) is exactly p.add_(g, alpha=-lr)
        params = {k: p.clone().add_(grads[k], alpha=-lr) for k, p in params.items()}
    return params, {k: v.detach().clone() for k, v in ddp.module.named_parameters()}, len(reducer.plan.buckets)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("overlap", OVERLAP)
def test_five_sgd_steps_equal_torch_ddp_bitwise(overlap, engine):
    res = fdp.testing.run(ddp_parity, 2, backend="gloo", args=(overlap, engine))
    for rank, (mine, theirs, nbuckets) in enumerate(res):
        assert nbuckets > 2
        for k in theirs:
            assert torch.equal(mine[k], theirs[k]), f"rank {rank}, leaf {k!r}: fdp differs from DDP"


def overlap_timeline(group, engine):
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    apply, params, buffers = fdp.functionalize(model)
    reducer = Reducer(params, group, bucket_cap_mb=0.5, first_bucket_cap_mb=0.25, engine=engine)
    x = torch.randn(64, 256)
    grad_fn = reducer.grad(lambda p, x: apply(p, buffers, x)[0].square().mean())
    timelines = []
    for _ in range(3):
        grad_fn(params, x)
        timelines.append(reducer.last_step.timeline)
    return timelines, len(reducer.plan.buckets)


@pytest.mark.parametrize("engine", ENGINES)
def test_first_bucket_is_launched_before_the_backward_ends_on_gloo(engine):
    res = fdp.testing.run(overlap_timeline, 2, backend="gloo", args=(engine,))
    for rank, (timelines, nbuckets) in enumerate(res):
        assert nbuckets >= 4
        for tl in timelines:
            assert tl.kind == "grad" and tl.backward_start is not None
            first = tl.buckets[0]
            assert tl.backward_start <= first.ready <= first.launch < tl.backward_end, f"rank {rank}: {tl}"
            assert all(b.done is not None and b.done >= b.launch for b in tl.buckets)
            launches = [b.launch for b in tl.buckets]
            assert launches == sorted(launches), "buckets must launch strictly in order"
            assert tl.exposed_comm >= 0 and tl.end >= tl.comm_done


def accumulate_vs_big_batch(group, k):
    model = mlp(seed=2)
    apply, params, buffers = fdp.functionalize(model)

    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0], y, reduction="sum")

    reducer = Reducer(params, group, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
    xs, ys = zip(*[batch(group.rank, step=i, n=4) for i in range(k)])
    acc = None
    for x, y in zip(xs[:-1], ys[:-1]):
        g = torch.func.grad(loss)(params, x, y)
        acc = g if acc is None else {n: acc[n] + g[n] for n in g}
    micro = reducer.grad(loss, accumulate=acc)(params, xs[-1], ys[-1])
    big = reducer.grad(loss)(params, torch.cat(xs), torch.cat(ys))
    return micro, big


@pytest.mark.parametrize("k", [2, 4])
def test_accumulated_micro_batches_equal_one_big_batch(k):
    for micro, big in fdp.testing.run(accumulate_vs_big_batch, 2, args=(k,)):
        for n in big:
            torch.testing.assert_close(micro[n], big[n], rtol=1e-5, atol=1e-6, msg=f"leaf {n!r}")


def unused_params(group, overlap, engine, hook_bytes=0):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.head_a = nn.Linear(8, 4)
            self.head_b = nn.Linear(8, 4)
            self.never = nn.Linear(8, 4)

        def forward(self, x, which):
            h = torch.tanh(self.body(x))
            return self.head_a(h) if which == 0 else self.head_b(h)

    apply, params, buffers = fdp.functionalize(TwoHeads())
    reducer = Reducer(params, group, bucket_cap_mb=1 / 1024, first_bucket_cap_mb=1 / 1024, overlap=overlap,
                      engine=engine, hook_threshold_bytes=hook_bytes)
    x, y = batch(group.rank)
    which = group.rank % 2  # ranks use different heads
    grads = reducer.grad(lambda p: F.cross_entropy(apply(p, buffers, x, which)[0], y))(params)
    local = torch.func.grad(lambda p: F.cross_entropy(apply(p, buffers, x, which)[0], y))(params)
    return grads, local


@pytest.mark.parametrize("hook_bytes", [0, 16 * 1024], ids=["hooked", "unhooked"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_unused_and_rank_dependent_parameters(backend, overlap, engine, hook_bytes):
    res = fdp.testing.run(unused_params, 2, backend=backend, args=(overlap, engine, hook_bytes), timeout=30)
    for rank, (grads, _) in enumerate(res):
        assert torch.equal(grads["never.weight"], torch.zeros(4, 8)), f"rank {rank}"
        # head_a is used only on rank 0, head_b only on rank 1: each gets half its rank's grad
        assert torch.equal(grads["head_a.weight"], res[0][1]["head_a.weight"] * 0.5), f"rank {rank}"
        assert torch.equal(grads["head_b.weight"], res[1][1]["head_b.weight"] * 0.5), f"rank {rank}"


def grad_views(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=3))
    reducer = Reducer(params, group, grad_views=True)
    loss = ce_loss(apply)
    g1, _ = reducer.grad(loss, has_aux=True)(params, buffers, *batch(group.rank, 0))
    snap = {k: v.clone() for k, v in g1.items()}
    ptrs = {k: v.data_ptr() for k, v in g1.items()}
    g2, _ = reducer.grad(loss, has_aux=True)(params, buffers, *batch(group.rank, 1))
    fresh = Reducer(params, group)
    g3, _ = fresh.grad(loss, has_aux=True)(params, buffers, *batch(group.rank, 1))
    return snap, ptrs, g1, g2, g3


def test_grad_views_reuse_buffers_and_fresh_grads_do_not():
    for snap, ptrs, g1, g2, g3 in fdp.testing.run(grad_views, 2):
        for k in g2:
            assert g2[k].data_ptr() == ptrs[k], "grad_views must reuse the same memory every step"
            assert torch.equal(g1[k], g2[k]), "the previous step's views now show the new values"
            assert torch.equal(g2[k], g3[k]), "grad_views changes where results live, not their values"
        assert any(not torch.equal(snap[k], g2[k]) for k in g2)


def world_of_one():
    apply, params, buffers = fdp.functionalize(mlp(seed=4))
    reducer = Reducer(params)  # no torch.distributed at all
    loss = ce_loss(apply)
    x, y = batch(0)
    g, _ = reducer.grad(loss, has_aux=True)(params, buffers, x, y)
    ref, _ = torch.func.grad(loss, has_aux=True)(params, buffers, x, y)
    return g, ref, reducer.group


def test_world_of_one_needs_no_process_group():
    assert not dist.is_initialized()
    g, ref, group = world_of_one()
    assert group.size == 1 and group.process_group is None
    for k in ref:
        assert torch.equal(g[k], ref[k]), k


@pytest.mark.parametrize("engine", ENGINES)
def test_grad_and_value_and_argnums_follow_torch_func(engine):
    apply, params, buffers = fdp.functionalize(mlp(seed=5))
    x, y = batch(0)

    def loss(scale, p, x, y):
        out = apply(p, buffers, x)[0]
        return F.cross_entropy(out, y) * scale, {"logits": out}

    reducer = Reducer(params, engine=engine)
    (g, (value, aux)) = reducer.grad_and_value(loss, argnums=1, has_aux=True)(2.0, params, x, y)
    (rg, (rvalue, raux)) = torch.func.grad_and_value(loss, argnums=1, has_aux=True)(2.0, params, x, y)
    assert torch.equal(value, rvalue) and torch.equal(aux["logits"], raux["logits"])
    assert not aux["logits"].requires_grad
    assert all(torch.equal(g[k], rg[k]) for k in rg)
    g2 = reducer.grad(lambda p: loss(1.0, p, x, y)[0])(params)
    assert set(g2) == set(params)


# --------------------------------------------------------------------------- bad input

def test_non_scalar_loss_is_a_clear_error():
    apply, params, buffers = fdp.functionalize(mlp(seed=6))
    reducer = Reducer(params)
    x, _ = batch(0)
    with pytest.raises(ValueError, match=r"scalar loss tensor, got \(6, 4\)"):
        reducer.grad(lambda p: apply(p, buffers, x)[0])(params)
    # the reducer is usable again afterwards
    reducer.grad(lambda p: apply(p, buffers, x)[0].sum())(params)


def test_mismatched_trees_dtypes_and_devices_name_the_leaf():
    apply, params, buffers = fdp.functionalize(mlp(seed=7))
    reducer = Reducer(params)
    bad = dict(params)
    bad["2.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"\['2.weight'\] has shape \(3, 3\)"):
        reducer.all_reduce(bad)
    with pytest.raises(ValueError, match=r"\['0.bias'\] has dtype torch.float64"):
        reducer.all_reduce({**params, "0.bias": params["0.bias"].double()})
    with pytest.raises(ValueError, match=r"missing leaf \['6.bias'\]"):
        reducer.all_reduce({k: v for k, v in params.items() if k != "6.bias"})
    with pytest.raises(ValueError, match=r"\['0.weight'\] has shape"):
        reducer.grad(lambda p: sum(v.sum() for v in p.values()))({**params, "0.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="one device"):
        Reducer({"a": torch.zeros(2), "b": torch.zeros(2, device="meta")})
    with pytest.raises(TypeError, match=r"\['n'\] has dtype torch.int64"):
        Reducer({"a": torch.zeros(2), "n": torch.zeros(2, dtype=torch.long)})


def test_reentering_a_reducer_mid_step_is_an_error():
    apply, params, buffers = fdp.functionalize(mlp(seed=8))
    reducer = Reducer(params)
    pending = reducer.all_reduce_async(params)
    with pytest.raises(RuntimeError, match="still in flight"):
        reducer.all_reduce(params)
    pending.wait()

    def loss(p):
        reducer.grad(lambda q: q["0.bias"].sum())(p)  # nested use of the same reducer
        return p["0.bias"].sum()

    with pytest.raises(RuntimeError, match="still in flight"):
        reducer.grad(loss)(params)
    reducer.all_reduce(params)  # usable again


def test_grad_inside_another_transform_is_an_error():
    apply, params, buffers = fdp.functionalize(mlp(seed=9))
    reducer = Reducer(params)
    with pytest.raises(RuntimeError, match="inside another torch.func transform"):
        torch.func.grad(lambda p: reducer.grad(lambda q: q["0.bias"].sum())(p)["0.bias"].sum())(params)


def test_mismatched_plans_across_ranks_are_reported_on_every_rank():
    def body(group):
        width = 16 if group.rank == 0 else 17
        _, params, _ = fdp.functionalize(mlp(width=width, seed=0))
        Reducer(params, group)

    with pytest.raises(fdp.ReplicaMismatchError, match=r"leaf \['0.weight'\] has shape \(16, 8\) float32 on rank 0 but \(17, 8\) float32 on rank 1"):
        fdp.testing.run(body, 2, backend="gloo", timeout=30)

    def caps(group):
        _, params, _ = fdp.functionalize(mlp(seed=0))
        Reducer(params, group, bucket_cap_mb=25 if group.rank == 0 else 5)

    with pytest.raises(fdp.ReplicaMismatchError, match="bucket caps"):
        fdp.testing.run(caps, 2, timeout=30)


def test_functorch_engine_rejects_mutating_captured_tensors_like_torch_func():
    counter = torch.zeros(())
    reducer = Reducer({"w": torch.ones(2)}, engine="functorch")
    with pytest.raises(RuntimeError, match="captured"):
        reducer.grad(lambda p: counter.add_(1) + p["w"].sum())({"w": torch.ones(2)})



def unhooked_tail(group):
    """A big layer (hooked, launched during the backward) before many tiny ones (the
    trailing buckets: unhooked, reduced when the backward returns)."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)], nn.Linear(8, 4096), nn.Tanh(),
                          nn.Linear(4096, 64))
    apply, params, buffers = fdp.functionalize(init_model(model))
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.5, first_bucket_cap_mb=0.5)  # default threshold
    x, y = batch(group.rank)
    loss = lambda p: apply(p, buffers, x)[0].square().mean()  # noqa: E731
    grads = reducer.grad(loss)(params)
    local = torch.func.grad(loss)(params)
    return grads, local, reducer.hooked_buckets, len(reducer.plan.buckets), reducer.last_step.timeline


def init_model(model):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_trailing_buckets_of_tiny_leaves_are_reduced_after_the_backward_exactly():
    res = fdp.testing.run(unhooked_tail, 2, backend="gloo")
    for rank, (grads, _, hooked, nbuckets, tl) in enumerate(res):
        assert 0 < hooked < nbuckets, (hooked, nbuckets)
        assert tl.buckets[0].launch < tl.backward_end, "the big layer's bucket overlaps the backward"
        assert tl.buckets[-1].launch >= tl.backward_end, "the tiny layers' bucket waits for the end"
        for k in grads:
            assert torch.equal(grads[k], res[0][1][k] * 0.5 + res[1][1][k] * 0.5), f"rank {rank}, leaf {k!r}"


def decay_groups_in_another_order(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=4))
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    decay = {k: v for k, v in params.items() if k.endswith("weight")}
    no_decay = {k: v for k, v in params.items() if not k.endswith("weight")}
    x, y = batch(group.rank)
    grad_fn = reducer.grad(ce_loss(apply), has_aux=True)
    ordered, _ = grad_fn(params, buffers, x, y)
    reordered, _ = grad_fn({**decay, **no_decay}, buffers, x, y)
    acc, _ = grad_fn(params, buffers, x, y)
    acc_reordered = dict(reversed(acc.items()))
    accumulated, _ = reducer.grad(ce_loss(apply), has_aux=True, accumulate=acc_reordered)(
        {**decay, **no_decay}, buffers, x, y)
    return list(params), ordered, reordered, accumulated, acc


def test_params_dict_in_another_key_order_is_matched_by_key():
    for rank, (keys, ordered, reordered, accumulated, acc) in enumerate(
            fdp.testing.run(decay_groups_in_another_order, 2)):
        assert list(reordered) == keys and list(accumulated) == keys, "grads come back in the plan's order"
        for k in keys:
            assert torch.equal(ordered[k], reordered[k]), f"rank {rank}, leaf {k!r}"
            torch.testing.assert_close(accumulated[k], ordered[k] + acc[k], msg=f"rank {rank}, leaf {k!r}")


def test_params_with_other_keys_name_the_missing_and_extra_ones():
    apply, params, buffers = fdp.functionalize(mlp(seed=7))
    reducer = fdp.Reducer(params)
    renamed = {("head.bias" if k == "6.bias" else k): v for k, v in reversed(params.items())}
    with pytest.raises(ValueError, match=r"missing leaf \['6.bias'\]; unexpected extra leaf \['head.bias'\]"):
        reducer.all_reduce(renamed)


def functorch_engine_reordered(group, hook_bytes):
    apply, params, buffers = fdp.functionalize(mlp(seed=4))
    reducer = fdp.Reducer(params, group, engine="functorch", hook_threshold_bytes=hook_bytes)
    x, y = batch(group.rank)
    grads, _ = reducer.grad(ce_loss(apply), has_aux=True)(dict(reversed(params.items())), buffers, x, y)
    local, _ = torch.func.grad(ce_loss(apply), has_aux=True)(params, buffers, x, y)
    return grads, local


@pytest.mark.parametrize("hook_bytes", [0, 16 * 1024], ids=["hooked", "unhooked"])
def test_functorch_engine_pairs_a_reordered_params_dict_by_key(hook_bytes):
    res = fdp.testing.run(functorch_engine_reordered, 2, args=(hook_bytes,))
    for rank, (grads, _) in enumerate(res):
        assert list(grads) == list(res[0][1]), "gradients come back in the plan's order"
        for k in grads:
            assert torch.equal(grads[k], res[0][1][k] * 0.5 + res[1][1][k] * 0.5), f"rank {rank}, leaf {k!r}"
