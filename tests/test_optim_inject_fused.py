"""``inject_hyperparams`` in the fused step (``reducer.grad_and_update``): lr, betas, weight
decay and momentum changed between steps in the step's ``FusedState`` (``set_hyperparams``),
with no new optimizer object and no new core; the numbers of DDP + torch.optim with
``group["lr"] = ...`` set before every ``step()`` and of the plain path, bit for bit, unsharded,
sharded and fully sharded; checkpoints; memory over 1,000 steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import CAPS, Block, batch, block_net, loss_of, mlp, rss_mib, tokens
from optim_cases import assert_equal
from test_optim_inject import TORCH, lr_at
from torch import nn
from trees import assert_trees_equal

import fdp

STEPS = 100


def decays(path, p):
    return p.dim() >= 2


def adamw_values(t):
    """What a user sets before step ``t``: a new lr every step, betas and weight decay now and then."""
    return dict(lr=lr_at(t), betas=(0.9 - 0.001 * (t % 5), 0.999 if t < 50 else 0.99),
                weight_decay=0.1 if t % 3 else 0.05)


def injected_adamw(clip):
    opt = fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-2, weight_decay=0.1, mask=decays)
    return fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), opt) if clip else opt


# ------------------------------- AdamW against DDP + torch.optim.AdamW, 2 gloo ranks

def against_ddp(group, steps=STEPS):
    out = {}
    for name, dtype, clip in [("f32", torch.float32, False), ("f64", torch.float64, False),
                              ("f32-clip", torch.float32, True)]:
        ddp = nn.parallel.DistributedDataParallel(mlp(seed=2).to(dtype), bucket_cap_mb=0.002)
        named = list(ddp.module.named_parameters())
        torch_opt = torch.optim.AdamW([{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
                                       {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}],
                                      lr=1e-2)
        apply, params, buffers = fdp.functionalize(mlp(seed=2).to(dtype))
        loss = loss_of(apply, buffers)
        opt = injected_adamw(clip)
        fused = fdp.Reducer(params, group, **CAPS).grad_and_update(loss, opt)
        sharded = fdp.Reducer(params, group, shard=True, **CAPS).grad_and_update(loss, opt)
        plain = fdp.Reducer(params, group, **CAPS)
        runs = {"fused": [dict(params), fused.init(params)], "sharded": [dict(params), sharded.init(params)],
                "plain": [dict(params), opt.init(params)]}
        cores = {"fused": set(), "sharded": set()}
        for t in range(steps):
            values = adamw_values(t)
            for g in torch_opt.param_groups:
                g["lr"], g["betas"] = values["lr"], values["betas"]
            torch_opt.param_groups[0]["weight_decay"] = values["weight_decay"]  # the decayed group
            x, y = batch(group.rank, t)
            x = x.to(dtype)
            torch_opt.zero_grad()
            out_ = ddp(x)
            F.cross_entropy(out_, y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
            torch_opt.step()
            for key, step in (("fused", fused), ("sharded", sharded)):
                p, s = runs[key]
                p, s, _ = step(p, fdp.optim.set_hyperparams(s, **values), x, y)
                runs[key] = [p, s]
                cores[key].add(next(iter(p.values())).data_ptr())  # (one engine: its two param sets)
            p, s = runs["plain"]
            s = fdp.optim.set_hyperparams(s, **values)
            runs["plain"] = list(opt.update(plain.grad(loss)(p, x, y), s, p))
        theirs = {k: v.detach().clone() for k, v in named}
        hp = runs["fused"][1].hyperparams
        out[name] = {"theirs": theirs, **{k: v[0] for k, v in runs.items()},
                     "trees": (fused.state_to_tree(runs["fused"][1], runs["fused"][0]),
                               sharded.state_to_tree(runs["sharded"][1], runs["sharded"][0]), runs["plain"][1]),
                     "sets": {k: len(v) for k, v in cores.items()}, "lr": float(hp["lr"]),
                     "count": int(runs["fused"][1].step)}
    return out


@pytest.mark.slow  # (100 steps on gloo, three tracks each beside DDP)
def test_adamw_with_values_set_every_step_equals_ddp_torch_adamw_and_the_plain_path_fp32_fp64_sharded():
    res = fdp.testing.run(against_ddp, 2, backend="gloo", timeout=600)
    for rank, out in enumerate(res):
        for name, r in out.items():
            what = f"rank {rank} {name}"
            assert r["count"] == STEPS and r["lr"] == lr_at(STEPS - 1), what
            assert max(r["sets"].values()) <= 2, f"{what}: params in {r['sets']} flat sets over {STEPS} steps"
            for key in ("plain", "fused", "sharded"):
                assert_equal(r[key], r["theirs"], f"{what}: {key} vs DDP + AdamW with group['lr'] set")
            assert_trees_equal(r["trees"][0], r["trees"][2], f"{what}: fused state vs plain state")
            assert_trees_equal(r["trees"][1], r["trees"][2], f"{what}: sharded state vs plain state")


# ------------------------------- every injected optimizer with a LeafKernel, fused and sharded

def every_optimizer(group, name, shard, steps=30):
    factory, cls, first, values_at = TORCH[name]
    apply, params, buffers = fdp.functionalize(mlp(seed=4).double())
    loss = loss_of(apply, buffers)
    opt = fdp.optim.inject_hyperparams(factory)(**{k: v for k, v in first.items() if k != "amsgrad"})
    reducer = fdp.Reducer(params, group, shard=shard, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = cls(list(ref.values()), **first)
    p, s = dict(params), step.init(params)
    pp, ps = dict(params), opt.init(params)
    sets = set()
    for t in range(steps):
        values = values_at(t)
        x, y = batch(group.rank, t)
        x = x.double()
        p, s, _ = step(p, fdp.optim.set_hyperparams(s, **values), x, y)
        sets.add(next(iter(p.values())).data_ptr())
        grads = reducer.grad(loss)(pp, x, y)
        pp, ps = opt.update(grads, fdp.optim.set_hyperparams(ps, **values), pp)
        for k, v in ref.items():
            v.grad = grads[k]
        for k, v in values.items():
            torch_opt.param_groups[0][k] = v
        torch_opt.step()
    return p, pp, {k: v.detach() for k, v in ref.items()}, step.state_to_tree(s, p), ps, len(sets)


# `make test` runs AdamW's two (the others: slow)
CASES = [pytest.param(n, sh, id=f"{n}-{'sharded' if sh else 'fused'}", marks=() if n == "adamw" else pytest.mark.slow)
         for n in TORCH for sh in (False, True)]


@pytest.mark.parametrize("name,shard", CASES)
def test_every_injected_optimizer_runs_in_the_fused_step_as_the_plain_path(name, shard):
    for rank, (p, pp, theirs, st, ps, sets) in enumerate(fdp.testing.run(every_optimizer, 2, args=(name, shard))):
        assert sets <= 2, f"rank {rank}: the params were in {sets} flat sets (an engine per hyper-parameter value?)"
        assert_equal(p, pp, f"rank {rank} {name}: fused vs plain path")
        assert_trees_equal(st, ps, f"rank {rank} {name}: state")
        if name != "nadam":  # (nadam's changed betas[0]: docs/optim.md, the plain path's numbers)
            assert_equal(p, theirs, f"rank {rank} {name}: fused vs torch.optim with group values set")


# ------------------------------- fully sharded params (shard="params")

def token_loss(apply, buffers):
    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten())
    return loss


def fully_sharded(group, steps=6):
    out = []
    for shard in (False, "params"):
        net = block_net(seed=1)
        apply, params, buffers = fdp.functionalize(net)
        units = fdp.units(net, Block) if shard == "params" else None
        reducer = fdp.Reducer(params, group, shard=shard, units=units)
        step = reducer.grad_and_update(token_loss(apply, buffers), injected_adamw(clip=True))
        s, p = step.init(params), {k: v.clone() for k, v in params.items()}
        for t in range(steps):
            p, s, _ = step(p, fdp.optim.set_hyperparams(s, **adamw_values(t)), *tokens(group.rank, t))
        out.append((p.full() if isinstance(p, fdp.ShardedParams) else p, step.state_to_tree(s, p)))
    return out


def test_fully_sharded_params_run_it_as_the_unsharded_fused_step():
    for rank, ((p, st), (sp, sst)) in enumerate(fdp.testing.run(fully_sharded, 2, timeout=120)):
        assert_trees_equal(p, sp, f"rank {rank} params")
        assert_trees_equal(st, sst, f"rank {rank} optimizer state")


# ------------------------------- SGD's momentum, gradients given, refusals

def sgd_momentum(group, steps=20):
    apply, params, buffers = fdp.functionalize(mlp(seed=5))
    loss = loss_of(apply, buffers)
    opt = fdp.optim.inject_hyperparams(fdp.optim.sgd)(lr=0.05, momentum=0.9, nesterov=True)
    reducer = fdp.Reducer(params, group, **CAPS)
    step = reducer.grad_and_update(loss, opt)
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = torch.optim.SGD(list(ref.values()), lr=0.05, momentum=0.9, nesterov=True)
    p, s, q, u = dict(params), step.init(params), dict(params), step.init(params)
    for t in range(steps):
        values = dict(lr=0.05 * 0.95**t, momentum=0.9 - 0.02 * (t % 7))
        x, y = batch(group.rank, t)
        p, s, _ = step(p, fdp.optim.set_hyperparams(s, **values), x, y)
        grads = reducer.grad(loss)({k: v.detach() for k, v in ref.items()}, x, y)
        q, u = step.update(grads, fdp.optim.set_hyperparams(u, **values), q)  # gradients given
        for k, v in ref.items():
            v.grad = grads[k]
        torch_opt.param_groups[0].update(values)
        torch_opt.step()
    return p, q, {k: v.detach() for k, v in ref.items()}, float(s.hyperparams["momentum"])


def test_sgd_momentum_changed_every_step_equals_torch_sgd():
    for rank, (p, q, theirs, momentum) in enumerate(fdp.testing.run(sgd_momentum, 2)):
        assert momentum == 0.9 - 0.02 * (19 % 7)
        assert_equal(p, theirs, f"rank {rank}: fused step vs torch SGD")
        assert_equal(q, theirs, f"rank {rank}: step.update vs torch SGD")


def test_values_that_change_the_layout_or_are_not_injected_are_refused():
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    reducer = fdp.Reducer(params)

    def loss(p):
        return (p["w"] * p["b"]).sum()

    step = reducer.grad_and_update(loss, fdp.optim.inject_hyperparams(fdp.optim.sgd)(lr=0.1))  # no momentum
    state = step.init(params)
    bad = fdp.optim.set_hyperparams(state, momentum=0.9)
    with pytest.raises(ValueError, match=r"\{'momentum': 0.9\} change the optimizer state's layout"):
        step(params, bad)
    with pytest.raises(ValueError, match="invalid lr -1.0"):
        step(params, fdp.optim.set_hyperparams(state, lr=-1.0))
    with pytest.raises(ValueError, match="'betas' is not injected"):
        fdp.optim.set_hyperparams(state, betas=(0.9, 0.99))
    p, state, _ = step(params, fdp.optim.set_hyperparams(state, lr=0.5))  # the state is still good
    assert torch.equal(p["w"], params["w"] - 0.5 * params["b"].expand(4, 3))
    plain = reducer.grad_and_update(loss, fdp.optim.sgd(lr=0.1))
    with pytest.raises(TypeError, match="no inject_hyperparams state in a FusedState"):
        fdp.optim.set_hyperparams(plain.init(params), lr=0.2)
    with pytest.raises(ValueError, match="holds injected hyper-parameters"):
        plain(params, state)  # the same layout, but its values would be ignored
    with pytest.raises(ValueError, match="holds no hyper-parameters"):
        step(params, plain.init(params))


# ------------------------------- checkpoints

def checkpointed(group, tmp, shard):
    apply, params, buffers = fdp.functionalize(mlp(seed=6))
    loss = loss_of(apply, buffers)
    opt = injected_adamw(clip=True)

    def make():
        return fdp.Reducer(params, group, shard=shard, **CAPS).grad_and_update(loss, opt)

    step = make()
    p, s = dict(params), step.init(params)
    straight_p, straight_s = dict(params), step.init(params)
    for t in range(8):
        x, y = batch(group.rank, t)
        straight_p, straight_s, _ = step(straight_p, fdp.optim.set_hyperparams(straight_s, **adamw_values(t)), x, y)
    for t in range(4):
        x, y = batch(group.rank, t)
        p, s, _ = step(p, fdp.optim.set_hyperparams(s, **adamw_values(t)), x, y)
    s = fdp.optim.set_hyperparams(s, **adamw_values(4))  # set, then saved before the step that uses it
    tree = step.state_to_tree(s, p)
    assert float(tree.optimizer.hyperparams["lr"]) == lr_at(4)
    fdp.save(f"{tmp}/ckpt.pt", {"params": p, "opt": tree}, group)  # (rank 0 writes; a collective)
    fdp.save_sharded(f"{tmp}/sharded", {"params": p, "opt": step.state_to_shards(s, p)}, group)
    if not shard:
        fdp.save(f"{tmp}/flat.pt", {"opt": s}, group)  # (unsharded, the FusedState itself)
    out = {}
    fresh = make()
    like_tree = {"params": params, "opt": opt.init(params)}
    loaded = fdp.load(f"{tmp}/ckpt.pt", like=like_tree)
    starts = {"tree": (loaded["params"], fresh.state_from_tree(loaded["opt"], params))}
    like = {"params": params, "opt": fresh.state_to_shards(fresh.init(params), params)}
    got = fdp.load_sharded(f"{tmp}/sharded", like, group)
    starts["shards"] = (got["params"], fresh.state_from_shards(got["opt"], params))
    if not shard:
        flat = fdp.load(f"{tmp}/flat.pt", like={"opt": fresh.init(params)})["opt"]
        starts["flat"] = (dict(p), flat)
    for key, (q, u) in starts.items():
        assert float(u.hyperparams["lr"]) == lr_at(4), key
        assert [float(b) for b in u.hyperparams["betas"]] == list(adamw_values(4)["betas"]), key
        x, y = batch(group.rank, 4)
        q, u, _ = fresh(q, u, x, y)  # the values set before saving
        for t in range(5, 8):
            x, y = batch(group.rank, t)
            q, u, _ = fresh(q, fdp.optim.set_hyperparams(u, **adamw_values(t)), x, y)
        out[key] = q
    return straight_p, out


@pytest.mark.parametrize("shard", [False, True], ids=["fused", "sharded"])
def test_a_checkpoint_resumes_with_the_values_set(tmp_path, shard):
    for rank, (straight, resumed) in enumerate(fdp.testing.run(checkpointed, 2, args=(str(tmp_path), shard))):
        assert set(resumed) == ({"tree", "shards"} if shard else {"tree", "shards", "flat"})
        for key, p in resumed.items():
            assert_equal(p, straight, f"rank {rank}: resumed from {key} vs uninterrupted")


# ------------------------------- 1,000 steps, a new lr each

def thousand_steps(group, steps):
    apply, params, buffers = fdp.functionalize(mlp(width=384, seed=3))
    loss = loss_of(apply, buffers)
    reducer = fdp.Reducer(params, group, **CAPS)
    step = reducer.grad_and_update(loss, fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-3, weight_decay=0.1))
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = torch.optim.AdamW(list(ref.values()), lr=1e-3, weight_decay=0.1)
    p, s = dict(params), step.init(params)
    rss, sets = {}, set()
    for t in range(steps):
        lr = 1e-3 * 0.999**t  # a new value every step
        x, y = batch(group.rank, t)
        p, s, _ = step(p, fdp.optim.set_hyperparams(s, lr=lr), x, y)
        sets.add(next(iter(p.values())).data_ptr())
        grads = reducer.grad(loss)({k: v.detach() for k, v in ref.items()}, x, y)
        for k, v in ref.items():
            v.grad = grads[k]
        torch_opt.param_groups[0]["lr"] = lr
        torch_opt.step()
        if t + 1 in (100, steps):
            rss[t + 1] = rss_mib()
    return {"params": p, "torch": {k: v.detach() for k, v in ref.items()}, "rss": rss,
            "sets": len(sets), "lr": float(s.hyperparams["lr"]),
            "param_mib": sum(v.numel() * v.element_size() for v in params.values()) / 2**20}


@pytest.mark.slow  # (1,000 steps)
def test_a_thousand_fused_steps_with_a_new_lr_each_use_one_engine_and_hold_memory_flat():
    (res,) = fdp.testing.run(thousand_steps, 1, args=(1000,), timeout=600)
    assert res["param_mib"] > 0.5, "params big enough that a core or a state per step would show"
    assert res["sets"] <= 2, f"the params were in {res['sets']} flat sets: an engine per lr?"
    assert res["lr"] == 1e-3 * 0.999**999
    grown = res["rss"][1000] - res["rss"][100]
    # A core (or a state) per step would hold the params, grads and moments again: ~4 x param_mib each.
    assert grown < 32, f"RSS grew {grown:.1f} MiB between step 100 and step 1000 ({res['rss']}, params " \
                       f"{res['param_mib']:.2f} MiB)"
    print(f"\nRSS at step 100 / 1000: {res['rss'][100]:.1f} / {res['rss'][1000]:.1f} MiB "
          f"(+{grown:.1f}); params {res['param_mib']:.2f} MiB")
    assert_equal(res["params"], res["torch"], "1,000 fused steps with set_hyperparams(lr=...) vs group['lr']")
