"""fdp.optim.muon against torch.optim.Muon, and ``partition`` in the fused and sharded steps:
Muon for the hidden matrices and AdamW for the rest in one chain, two AdamW lrs,
each bit-exact with the plain path (and the plain path with torch.optim)."""

import math

import pytest
import torch
import torch.nn.functional as F
from models import batch, mlp

import fdp

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")

DTYPES = {"f32": torch.float32, "f64": torch.float64}
CAPS = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)  # several buckets, leaves across slices


def schedule(t):
    return 0.02 * (0.5 + 0.5 * math.cos(math.pi * t / 100))


OPTIONS = {
    "defaults": dict(lr=0.02),
    "plain-momentum": dict(lr=0.02, nesterov=False, momentum=0.9, weight_decay=0.0),
    "coefficients": dict(lr=0.02, ns_coefficients=(3.0, -3.2, 1.2), ns_steps=3, eps=1e-6),
    "original": dict(lr=0.02, adjust_lr_fn="original", weight_decay=0.05),
    "match-rms": dict(lr=0.01, adjust_lr_fn="match_rms_adamw"),
}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("name", OPTIONS)
def test_muon_equals_torch_muon_over_100_steps(name, dt):
    kw = OPTIONS[name]
    g = torch.Generator().manual_seed(1)
    params = {"a": torch.randn(16, 8, generator=g, dtype=DTYPES[dt]), "b": torch.randn(4, 12, generator=g,
                                                                                          dtype=DTYPES[dt])}
    ref = [torch.nn.Parameter(v.clone()) for v in params.values()]
    topt = torch.optim.Muon(ref, **kw)
    opt = fdp.optim.muon(**kw)
    state, p = opt.init(params), params
    for _ in range(100):
        grads = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}
        for r, gv in zip(ref, grads.values()):
            r.grad = gv.clone()
        topt.step()
        p, state = opt.update(grads, state, p)
    for (k, v), r in zip(p.items(), ref):
        assert torch.equal(v, r.detach()), f"{name} {dt}: {k}"
    assert torch.equal(state.momentum_buffer["a"], topt.state[ref[0]]["momentum_buffer"])


def test_muon_with_a_schedule_equals_torch_with_group_lr_set_each_step():
    g = torch.Generator().manual_seed(2)
    params = {"a": torch.randn(8, 8, generator=g)}
    ref = [torch.nn.Parameter(params["a"].clone())]
    topt = torch.optim.Muon(ref, lr=schedule(0))
    opt = fdp.optim.muon(lr=schedule)
    state, p = opt.init(params), params
    for t in range(100):
        grads = {"a": torch.randn(8, 8, generator=g)}
        ref[0].grad = grads["a"].clone()
        topt.param_groups[0]["lr"] = schedule(t)
        topt.step()
        p, state = opt.update(grads, state, p)
    assert torch.equal(p["a"], ref[0].detach())


def test_muon_refuses_what_is_not_a_matrix_and_names_it():
    with pytest.raises(ValueError, match=r"params\['b'\] has shape \(3,\).*partition"):
        fdp.optim.muon().init({"a": torch.zeros(2, 2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        fdp.optim.muon(adjust_lr_fn="nope")


def hidden(key, p):
    """Muon for the hidden matrices (not the first layer's or the head's), AdamW for the rest."""
    return "muon" if p.dim() == 2 and key not in ("0.weight", "6.weight") else "adamw"


def muon_and_adamw():
    return fdp.optim.chain(
        fdp.optim.clip_by_global_norm(0.5),
        fdp.optim.partition(hidden, {"muon": fdp.optim.muon(lr=0.02),
                                     "adamw": fdp.optim.adamw(lr=1e-2, weight_decay=0.1,
                                                              mask=lambda key, p: p.dim() >= 2)}))


def test_muon_and_adamw_in_one_chain_equal_torch_muon_and_adamw():
    """The usual pairing, written with torch.optim: Muon on the hidden matrices, AdamW with two
    groups on the rest, clip_grad_norm_ over all of them first."""
    torch.manual_seed(0)
    model = mlp(seed=3)
    apply, params, buffers = fdp.functionalize(model)
    named = dict(model.named_parameters())
    labels = {k: hidden(k, v) for k, v in named.items()}
    tmuon = torch.optim.Muon([named[k] for k in named if labels[k] == "muon"], lr=0.02)
    tadam = torch.optim.AdamW([{"params": [named[k] for k in named if labels[k] == "adamw" and named[k].dim() >= 2],
                                "weight_decay": 0.1},
                               {"params": [named[k] for k in named if labels[k] == "adamw" and named[k].dim() < 2],
                                "weight_decay": 0.0}], lr=1e-2)
    opt = muon_and_adamw()
    state, p = opt.init(params), {k: v.clone() for k, v in params.items()}
    for i in range(20):
        x, y = batch(0, i)
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        tmuon.step()
        tadam.step()
        model.zero_grad(set_to_none=True)
        grads = torch.func.grad(lambda q, x=x, y=y: F.cross_entropy(apply(q, buffers, x)[0], y))(p)
        p, state = opt.update(grads, state, p)
    for k in named:
        assert torch.equal(p[k], named[k].detach()), k


def fused_vs_plain(group, opt_fn, shard, steps=8):
    apply, params, buffers = fdp.functionalize(mlp(seed=4))

    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0], y)

    opt = opt_fn()
    reducer = fdp.Reducer(params, group, shard=shard, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    state, fp = step.init(params), dict(params)
    plain = fdp.Reducer(params, group, **CAPS)
    pp, ps = dict(params), opt.init(params)
    for i in range(steps):
        x, y = batch(group.rank, i)
        fp, state, _ = step(fp, state, x, y)
        pp, ps = opt.update(plain.grad(loss)(pp, x, y), ps, pp)
    tree = step.state_to_tree(state, fp)
    return fp, pp, tree, ps, step.init(params), step, owned_whole(step.state_to_shards(state, fp))


def owned_whole(shards):
    """The 2-D leaves whose Muon state this rank holds whole (sharded: the ones it owns)."""
    states = getattr(shards, "optimizer", shards)
    states = getattr(states, "states", {})
    if "muon" not in states:
        return []
    buf = states["muon"].momentum_buffer
    return sorted(k for k, s in buf.items() if s.ranges == ((0, s.numel),))


def assert_same(results, what):
    for rank, (fp, pp, tree, ps, *_) in enumerate(results):
        for k in pp:
            assert torch.equal(fp[k], pp[k]), f"{what}, rank {rank}: {k}"
        a, b = fdp._tree.leaves(tree), fdp._tree.leaves(ps)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"{what}, rank {rank}: state"


def test_muon_and_adamw_in_the_fused_step_equal_the_plain_path():
    assert_same(fdp.testing.run(fused_vs_plain, 2, args=(muon_and_adamw, False)), "muon + adamw, fused")


def two_lrs():
    return fdp.optim.partition(lambda key, p: "body" if key.startswith(("2.", "4.")) else "ends",
                               {"body": fdp.optim.adamw(lr=1e-2, weight_decay=0.1),
                                "ends": fdp.optim.adamw(lr=3e-3, weight_decay=0.0)})


def with_frozen():
    return fdp.optim.chain(fdp.optim.clip_by_value(-0.1, 0.1), fdp.optim.partition(
        lambda key, p: "frozen" if key.startswith("0.") else "train",
        {"train": fdp.optim.sgd(lr=0.1, momentum=0.9), "frozen": fdp.optim.frozen()}))


@pytest.mark.parametrize("shard", [False, True], ids=["fused", "sharded"])
@pytest.mark.parametrize("make", [two_lrs, with_frozen], ids=["two-adamw-lrs", "sgd-and-frozen"])
def test_a_partition_in_the_fused_and_sharded_steps_equals_the_plain_path(make, shard):
    assert_same(fdp.testing.run(fused_vs_plain, 2, args=(make, shard)), f"{make.__name__}, shard={shard}")


def test_a_partitions_state_keeps_each_labels_fields_for_its_leaves_only():
    (_, _, _, _, fresh, step, _), *_ = fdp.testing.run(fused_vs_plain, 2, args=(muon_and_adamw, False, 1))
    keys = sorted(fresh.buffers)
    assert keys == ["adamw:exp_avg", "adamw:exp_avg_sq", "muon:momentum_buffer"], keys
    plan = step.plan
    muon_elems = sum(s.numel for s in plan.slots if hidden(s.path[2:-2], torch.empty(s.shape)) == "muon")
    assert sum(t.numel() for t in fresh.buffers["muon:momentum_buffer"]) == muon_elems
    assert sum(t.numel() for t in fresh.buffers["adamw:exp_avg"]) == sum(s.numel for s in plan.slots) - muon_elems


def resumed(group, path, shard):
    """Sharded partition state through state_to_tree, fdp.save/fdp.load, state_from_tree into
    the unsharded step and back: the same numbers as the run that never stopped."""
    apply, params, buffers = fdp.functionalize(mlp(seed=5))

    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0], y)

    opt = two_lrs()
    step = fdp.Reducer(params, group, shard=True, **CAPS).grad_and_update(loss, opt)
    p, s = dict(params), step.init(params)
    for i in range(3):
        p, s, _ = step(p, s, *batch(group.rank, i))
    fdp.save(path, {"p": p, "s": step.state_to_tree(s, p)}, group)
    for i in range(3, 6):
        p, s, _ = step(p, s, *batch(group.rank, i))
    other = fdp.Reducer(params, group, shard=shard, **CAPS).grad_and_update(loss, opt)
    loaded = fdp.load(path, {"p": params, "s": opt.init(params)}, group)
    q, t = loaded["p"], other.state_from_tree(loaded["s"], loaded["p"])
    for i in range(3, 6):
        q, t, _ = other(q, t, *batch(group.rank, i))
    return p, q


@pytest.mark.parametrize("shard", [False, True], ids=["into-unsharded", "into-sharded"])
def test_a_sharded_partition_state_resumes_bit_exactly(tmp_path, shard):
    for rank, (p, q) in enumerate(fdp.testing.run(resumed, 2, args=(str(tmp_path / "ckpt.pt"), shard))):
        for k in p:
            assert torch.equal(p[k], q[k]), f"rank {rank}: {k}"


def muon_alone():
    return fdp.optim.partition(lambda key, p: "muon" if p.dim() == 2 else "sgd",
                               {"muon": fdp.optim.muon(lr=0.02), "sgd": fdp.optim.sgd(lr=0.05)})


@pytest.mark.parametrize("make", [muon_and_adamw, muon_alone], ids=["muon-adamw-clip", "muon-sgd"])
def test_sharded_muon_equals_the_plain_path_and_owns_whole_matrices(make):
    """shard=True: each matrix is owned and updated whole by one rank (balanced by Newton-Schulz
    cost) and its new params sent back to the slices that hold them; the numbers are the
    plain path's bit for bit on 2 ranks, and each rank keeps about half of Muon's state."""
    results = fdp.testing.run(fused_vs_plain, 2, args=(make, True))
    assert_same(results, f"{make.__name__}, sharded")
    sizes = [sum(t.numel() for t in r[4].buffers["muon:momentum_buffer"]) for r in results]
    largest = max(s.numel for s in results[0][5].plan.slots if len(s.shape) == 2)
    assert abs(sizes[0] - sizes[1]) <= largest, sizes
    owned = [r[6] for r in results]
    assert owned[0] and owned[1] and not set(owned[0]) & set(owned[1]), f"whole matrices owned: {owned}"


def params_only(group, make, shard, steps):
    return fused_vs_plain(group, make, shard, steps)[:2]  # (what crosses a process boundary)


def test_sharded_muon_on_three_gloo_ranks_keeps_replicas_identical_and_close_to_the_plain_path():
    """Three ranks: a reduce-scatter adds three addends in another order than gloo's ring
    all-reduce, so the sharded step is the plain path's to rounding; every rank holds the same
    params, bit for bit (each matrix was updated by one owner and sent back)."""
    results = fdp.testing.run(params_only, 3, backend="gloo", args=(muon_and_adamw, True, 4), timeout=120)
    for rank, (fp, pp) in enumerate(results):
        for k in pp:
            torch.testing.assert_close(fp[k], pp[k], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {k}")
            assert torch.equal(fp[k], results[0][0][k]), f"rank {rank}: {k} is not a replica"


def fully_sharded_vs_plain(group, make, steps=8):
    """Fully sharded params (a unit per hidden Linear) beside the plain path on the same data."""
    model = mlp(seed=4)
    apply, params, buffers = fdp.functionalize(model)

    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0], y)

    opt = make()
    step = fdp.Reducer(params, group, shard="params", units=["2", "4"]).grad_and_update(loss, opt)
    state, fp = step.init(params), step.shard(params)
    plain = fdp.Reducer(params, group, **CAPS)
    pp, ps = dict(params), opt.init(params)
    for i in range(steps):
        x, y = batch(group.rank, i)
        fp, state, _ = step(fp, state, x, y)
        pp, ps = opt.update(plain.grad(loss)(pp, x, y), ps, pp)
    return fp.full(), pp, step.state_to_tree(state, fp), ps, owned_whole(step.state_to_shards(state, fp))


@pytest.mark.parametrize("make", [muon_and_adamw, muon_alone], ids=["muon-adamw-clip", "muon-sgd"])
def test_fully_sharded_muon_equals_the_plain_path_with_each_matrix_owned_by_one_rank(make):
    """shard="params": each matrix's owner gets its gradient and its params whole, updates it
    and sends the new elements back into the slices; the plain path's numbers bit for bit on
    2 ranks (and so shard=True's), Muon's state split between the owners."""
    results = fdp.testing.run(fully_sharded_vs_plain, 2, args=(make,))
    assert_same(results, f"{make.__name__}, fully sharded")
    owned = [r[4] for r in results]
    assert owned[0] and owned[1] and not set(owned[0]) & set(owned[1]), f"whole matrices owned: {owned}"
