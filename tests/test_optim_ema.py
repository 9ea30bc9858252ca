"""``fdp.optim.ema``: the EMA of the params in the optimizer state, against torch's own
``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` with
``update_parameters(model)`` after every ``optimizer.step()``, over 100 steps in fp32 and
fp64, with ``torch.equal``: in the plain path, the fused step and the sharded fused step on
two simulated ranks (and gloo processes), and through a save and a resume."""

from __future__ import annotations

import pytest
import torch
from models import CAPS, batch, loss_of, mlp
from optim_cases import assert_same_tree as assert_equal
from optim_cases import decays, grads_for, params_of, resumed_runs
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fdp

STEPS = 100
DTYPES = {"f32": torch.float32, "f64": torch.float64}


class Holder(nn.Module):
    """A module whose parameters are a params dict's tensors, in its order (what
    AveragedModel averages)."""

    def __init__(self, params):
        super().__init__()
        self.names = list(params)
        self.ps = nn.ParameterList([nn.Parameter(v.detach().clone()) for v in params.values()])

    def tree(self, module=None):
        return {k: p.detach().clone() for k, p in zip(self.names, (module or self).ps)}


class TorchEma:
    """torch.optim's ``cls`` on a module (two param groups with ``mask``, a ``LambdaLR`` with
    ``factor``, ``clip`` on the param list before each step), and an ``AveragedModel`` EMA of
    it updated after every step: the reference every test compares with."""

    def __init__(self, cls, params, kw, decay, *, mask=False, factor=None, clip=None, groups=None):
        self.model = Holder(params)
        ps = list(self.model.ps)
        if groups is not None:
            self.opt = cls(groups(ps), **kw)
        elif mask:
            pairs = [{"params": [p for p in ps if p.dim() >= 2]},
                     {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
            self.opt = cls([g for g in pairs if g["params"]], **kw)
        else:
            self.opt = cls(ps, **kw)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, factor) if factor else None
        self.clip = clip
        self.avg = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(decay))

    @property
    def params(self):
        return self.model.tree()

    @property
    def ema(self):
        return self.model.tree(self.avg.module)

    def step(self, grads):
        for k, p in zip(self.model.names, self.model.ps):
            p.grad = grads[k].clone()
        if self.clip is not None:
            self.clip(list(self.model.ps))
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        self.avg.update_parameters(self.model)


# ------------------------------------------------------------------ the plain path

PLAIN = {  # name: (fdp optimizer, torch class, its kwargs, mask)
    "adamw-mask": (lambda donate: fdp.optim.adamw(1e-2, weight_decay=0.1, mask=decays, donate=donate),
                   torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), True),
    "sgd-momentum": (lambda donate: fdp.optim.sgd(0.05, momentum=0.9, nesterov=True, donate=donate),
                     torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), False),
    "nadam": (lambda donate: fdp.optim.nadam(1e-2, weight_decay=0.1, donate=donate), torch.optim.NAdam,
              dict(lr=1e-2, weight_decay=0.1), False),
}
PLAIN_CASES = [(n, dt, decay, donate) for n in PLAIN for dt in DTYPES for decay in (0.999, 0.9)
               for donate in (False, True)]


@pytest.mark.parametrize("name,dt,decay,donate", PLAIN_CASES,
                         ids=[f"{n}-{d}-{e}-{'donate' if o else 'pure'}" for n, d, e, o in PLAIN_CASES])
def test_ema_equals_averaged_model_with_get_ema_multi_avg_fn_bit_for_bit_over_100_steps(name, dt, decay, donate):
    make, cls, kw, mask = PLAIN[name]
    params = params_of(DTYPES[dt])
    ref = TorchEma(cls, params, kw, decay, mask=mask)
    inner = make(donate)
    opt = fdp.optim.ema(inner, decay, donate=donate)
    params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    assert fdp.optim.ema_params(state, params) is params, "before any update: the params (AveragedModel's copy)"
    for t in range(STEPS):
        grads = grads_for(params, t)
        ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, ref.params, f"{name} {dt} params, step {t + 1}")
        assert_equal(fdp.optim.ema_params(state, params), ref.ema, f"{name} {dt} decay {decay} ema, step {t + 1}")
    assert type(state).__name__ == f"Ema{type(inner.init(params)).__name__}"
    assert int(state.step) == STEPS and int(ref.avg.n_averaged) == STEPS


def test_ema_of_a_donating_optimizer_updates_everything_in_place():
    params = params_of(torch.float32)
    ref = TorchEma(torch.optim.AdamW, params, dict(lr=1e-2), 0.9)
    opt = fdp.optim.ema(fdp.optim.adamw(1e-2, donate=True), 0.9, donate=True)
    params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    ema_tensors = list(state.ema.values())
    for t in range(STEPS):
        grads = grads_for(params, t)
        ref.step(grads)
        params, state = opt.update(grads, state, params)
    assert all(a is b for a, b in zip(state.ema.values(), ema_tensors)), "donate=True: the same tensors"
    assert_equal(params, ref.params, "donated params")
    assert_equal(fdp.optim.ema_params(state, params), ref.ema, "donated ema")


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("outside", [True, False], ids=["ema-of-chain", "chain-of-ema"])
def test_ema_with_clipping_mask_and_schedule_equals_clip_grad_norm_lambdalr_and_averaged_model(dt, outside):
    params = params_of(DTYPES[dt], seed=1)
    ref = TorchEma(torch.optim.AdamW, params, dict(lr=1e-2, weight_decay=0.1), 0.95, mask=True,
                   factor=lambda t: 0.97**t, clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))
    adamw = fdp.optim.adamw(lambda t: 1e-2 * 0.97**t, weight_decay=0.1, mask=decays)
    clip = fdp.optim.clip_by_global_norm(1.0)
    if outside:
        opt = fdp.optim.ema(fdp.optim.chain(clip, adamw), 0.95)
    else:
        opt = fdp.optim.chain(clip, fdp.optim.ema(adamw, 0.95))
    params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    for t in range(STEPS):
        grads = grads_for(params, t, scale=3.0)
        ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert float(state.transforms[0].norm) > 1.0, "the test must clip"
    assert_equal(params, ref.params, f"{dt} params")
    assert_equal(fdp.optim.ema_params(state, params), ref.ema, f"{dt} ema")
    info = fdp.optim.hyperparams(opt, state)
    assert info["step"] == STEPS and info["lr"] == 1e-2 * 0.97 ** (STEPS - 1)


def test_ema_of_a_partition_averages_per_label_and_equals_param_groups():
    params = params_of(torch.float64, seed=2)
    ref = TorchEma(torch.optim.AdamW, params, dict(lr=1e-2), 0.9, groups=lambda ps: [
        {"params": [p for p in ps if p.dim() >= 2], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [p for p in ps if 0 < p.dim() < 2], "lr": 3e-2, "weight_decay": 0.0},
        {"params": [p for p in ps if p.dim() == 0], "lr": 0.0}])  # (frozen: lr 0 changes nothing)
    labels = {k: "w" if v.dim() >= 2 else "b" if v.dim() else "frozen" for k, v in params.items()}
    opt = fdp.optim.ema(fdp.optim.partition(labels, {"w": fdp.optim.adamw(1e-2, weight_decay=0.1),
                                                     "b": fdp.optim.adamw(3e-2, weight_decay=0.0),
                                                     "frozen": fdp.optim.frozen()}), 0.9)
    state = opt.init(params)
    assert [type(s).__name__ for s in state.states.values()] == ["EmaAdamWState", "EmaAdamWState", "tuple"]
    assert opt.form.partition is not None and opt.form.partition.optimizers["w"].form.leaf_kernel.fields[-1] == "ema"
    for t in range(STEPS):
        grads = grads_for(params, t)
        ref.step(grads)
        params, state = opt.update(grads, state, params)
    assert int(state.states["w"].step) == STEPS
    assert_equal(params, ref.params, "partition params")
    assert_equal(fdp.optim.ema_params(state, params), ref.ema, "partition ema")


def _skip_on(steps):
    """A global scale that skips the listed updates (as a loss scaler on a non-finite step)."""
    def scale(stats, state):
        n = int(state)
        return (None if n in steps else torch.tensor(1.0)), state + 1
    return fdp.optim.global_scale(lambda params: torch.zeros((), dtype=torch.int64),
                                  lambda leaves: [t.sum() for t in leaves], scale)


def test_a_skipped_update_leaves_the_average_as_it_leaves_the_params():
    params = params_of(torch.float32)
    skipped = {3, 4, 10}
    ref = TorchEma(torch.optim.SGD, params, dict(lr=0.1, momentum=0.9), 0.9)
    opt = fdp.optim.ema(fdp.optim.chain(_skip_on(skipped), fdp.optim.sgd(0.1, momentum=0.9)), 0.9)
    state = opt.init(params)
    for t in range(20):
        grads = grads_for(params, t)
        if t not in skipped:  # torch: no optimizer.step(), no update_parameters()
            ref.step(grads)
        params, state = opt.update(grads, state, params)
    assert int(state.optimizer.step) == 20 - len(skipped)
    assert_equal(params, ref.params, "params")
    assert_equal(fdp.optim.ema_params(state, params), ref.ema, "ema")


# ------------------------------------------------------------------ ema_update: use_buffers

def test_ema_update_on_params_and_buffers_equals_averaged_model_with_use_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = None
    for t in range(30):
        g = torch.Generator().manual_seed(t)
        model(torch.randn(8, 5, generator=g)).square().mean().backward()  # BatchNorm's buffers move
        opt.step()
        opt.zero_grad()
        avg.update_parameters(model)
        current = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
        mine = fdp.optim.ema_update(mine if mine is not None else current, current, t, decay=0.8)
    want = {k: v.detach() for k, v in [*avg.module.named_parameters(), *avg.module.named_buffers()]}
    assert mine["1.num_batches_tracked"].dtype == torch.int64  # the integer branch ran
    assert_equal(mine, want, "params and buffers")


def test_ema_update_leaves_its_inputs_unchanged():
    average, current = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    out = fdp.optim.ema_update(average, current, 5, decay=0.5)
    assert torch.equal(average["w"], torch.zeros(3)) and torch.equal(current["w"], torch.ones(3))
    assert torch.equal(out["w"], torch.full((3,), 0.5))


# ------------------------------------------------------------------ the leaf-list form

def test_leaf_kernel_adds_an_ema_field_and_equals_the_tree_update_on_flat_chunks():
    inner = fdp.optim.adamw(1e-2, weight_decay=0.1, mask=decays)
    opt = fdp.optim.ema(inner, 0.9)
    lk = opt.form.leaf_kernel
    assert lk.fields == ("exp_avg", "exp_avg_sq", "ema") and lk.groups is inner.form.leaf_kernel.groups
    params = params_of(torch.float32)
    groups = lk.groups(params)
    members = {grp: [k for k, g in zip(params, groups) if g == grp] for grp in set(groups)}

    def flat(tree, ks):
        return torch.cat([tree[k].reshape(-1) for k in ks])

    flats = {grp: flat(params, ks) for grp, ks in members.items()}
    states = {grp: [torch.full_like(f, lk.init_value) for _ in lk.fields] for grp, f in flats.items()}
    state = opt.init(params)
    count = state.step.clone()
    for t in range(20):
        grads = grads_for(params, t)
        for grp, ks in members.items():
            n = flats[grp].numel()
            cuts = [0, n // 3, n // 2, n]

            def pieces(x, cuts=cuts):
                return [x[a:b] for a, b in zip(cuts, cuts[1:])]

            lk.step(grp, pieces(flats[grp]), pieces(flat(grads, ks)), [pieces(s) for s in states[grp]], count)
        count += 1
        params, state = opt.update(grads, state, params)
        for grp, ks in members.items():
            assert torch.equal(flats[grp], flat(params, ks)), f"group {grp} step {t + 1}"
            for field, s in zip(lk.fields, states[grp]):
                assert torch.equal(s, flat(getattr(state, field), ks)), f"state.{field} group {grp}"


# ------------------------------------------- the fused and sharded steps, on simulated ranks

CLIP = 0.05


def _schedule(t):
    return 0.99**t


def tracks(group, dtype=torch.float32, steps=STEPS, donate=False, decay=0.95):
    """Four copies of one model from the same start, on the same batches: the fused step, the
    sharded fused step, ``reducer.grad`` + ``opt.update``, and torch.optim + AveragedModel fed
    with ``reducer.grad``'s gradients."""
    apply, params, buffers = fdp.functionalize(mlp(seed=0).to(dtype))
    loss = loss_of(apply, buffers)

    def make():
        return fdp.optim.ema(fdp.optim.chain(
            fdp.optim.clip_by_value(-CLIP, CLIP),
            fdp.optim.adamw(lambda t: 1e-2 * _schedule(t), weight_decay=0.1, mask=decays, donate=donate)),
            decay, donate=donate)

    reducer = fdp.Reducer(params, group, hook_threshold_bytes=0, **CAPS)
    fused = reducer.grad_and_update(loss, make(), donate=donate)
    sharded = fdp.Reducer(params, group, shard=True, hook_threshold_bytes=0, **CAPS).grad_and_update(
        loss, make(), donate=donate)
    opt = make()
    fp, fs = {k: v.clone() for k, v in params.items()}, fused.init(params)
    sp, ss = {k: v.clone() for k, v in params.items()}, sharded.init(params)
    pp, ps = {k: v.clone() for k, v in params.items()}, opt.init(params)
    ref = TorchEma(torch.optim.AdamW, params, dict(lr=1e-2, weight_decay=0.1), decay, mask=True,
                   factor=_schedule, clip=lambda ps: torch.nn.utils.clip_grad_value_(ps, CLIP))
    for i in range(steps):
        x, y = batch(group.rank, i)
        x = x.to(dtype)
        fp, fs, _ = fused(fp, fs, x, y)
        sp, ss, _ = sharded(sp, ss, x, y)
        pp, ps = opt.update(reducer.grad(loss)(pp, x, y), ps, pp)
        ref.step(reducer.grad(loss)(ref.params, x, y))
    fs_tree, ss_tree = fused.state_to_tree(fs, fp), sharded.state_to_tree(ss, sp)
    return {"fused": (fp, fs_tree), "sharded": (sp, ss_tree), "plain": (pp, ps),
            "reference": (ref.params, ref.ema), "buckets": len(fused.plan.buckets),
            "fields": sorted(fs.buffers)}


def assert_tracks_equal(results, what):
    for rank, res in enumerate(results):
        want_params, want_ema = res["reference"]
        for track in ("plain", "fused", "sharded"):
            params, state = res[track]
            assert_equal(params, want_params, f"{what}, rank {rank}, {track} params vs torch.optim")
            assert_equal(fdp.optim.ema_params(state, params), want_ema,
                         f"{what}, rank {rank}, {track} ema vs AveragedModel")
        plain_state = fdp._tree.leaves(res["plain"][1])
        for track in ("fused", "sharded"):
            got = fdp._tree.leaves(res[track][1])
            bad = [j for j, (a, b) in enumerate(zip(got, plain_state)) if not torch.equal(a, b)]
            assert len(got) == len(plain_state) and not bad, f"{what}, rank {rank}: {track} state leaves {bad}"


# 100 steps in f32 and f64; 30 with donation (a layout path)
FUSED_CASES = [("f32", False, STEPS), ("f32", True, 30), ("f64", False, STEPS)]


@pytest.mark.parametrize("dt,donate,steps", FUSED_CASES,
                         ids=[f"{d}-{'donate' if o else 'pure'}-{k}steps" for d, o, k in FUSED_CASES])
@pytest.mark.slow  # (up to 100 steps, four tracks)
def test_fused_and_sharded_steps_keep_the_averaged_model_bit_for_bit_on_two_ranks(dt, donate, steps):
    results = fdp.testing.run(tracks, 2, args=(DTYPES[dt], steps, donate), timeout=300)
    assert results[0]["buckets"] > 1, "the test needs several buckets"
    assert results[0]["fields"] == ["ema", "exp_avg", "exp_avg_sq"]
    assert_tracks_equal(results, f"ema(adamw) {dt}")


def hidden(key, p):
    """Muon for the hidden matrices, AdamW for the first layer's and the head's params, the
    first bias frozen."""
    if key == "0.bias":
        return "frozen"
    return "muon" if p.dim() == 2 and key not in ("0.weight", "6.weight") else "adamw"


def partition_tracks(group, dtype=torch.float32, steps=STEPS):
    """The usual pairing (Muon for hidden matrices, AdamW for the rest, a frozen leaf, one
    global-norm clip) under ``ema``: the fused step, the sharded fused step and the plain path,
    against torch.optim.Muon + AdamW + clip_grad_norm_ + AveragedModel."""
    apply, params, buffers = fdp.functionalize(mlp(seed=0).to(dtype))
    loss = loss_of(apply, buffers)

    def make():
        return fdp.optim.ema(fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), fdp.optim.partition(hidden, {
            "muon": fdp.optim.muon(lr=0.02), "frozen": fdp.optim.frozen(),
            "adamw": fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=decays)})), 0.95)

    reducer = fdp.Reducer(params, group, hook_threshold_bytes=0, **CAPS)
    fused = reducer.grad_and_update(loss, make())
    sharded = fdp.Reducer(params, group, shard=True, hook_threshold_bytes=0, **CAPS).grad_and_update(loss, make())
    opt = make()
    fp, fs = {k: v.clone() for k, v in params.items()}, fused.init(params)
    sp, ss = {k: v.clone() for k, v in params.items()}, sharded.init(params)
    pp, ps = {k: v.clone() for k, v in params.items()}, opt.init(params)
    model = Holder(params)
    named = dict(zip(model.names, model.ps))
    label = {k: hidden(k, v) for k, v in named.items()}
    tmuon = torch.optim.Muon([v for k, v in named.items() if label[k] == "muon"], lr=0.02)
    tadam = torch.optim.AdamW([{"params": [v for k, v in named.items() if label[k] == "adamw" and v.dim() >= 2]},
                               {"params": [v for k, v in named.items() if label[k] == "adamw" and v.dim() < 2],
                                "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.95))
    for i in range(steps):
        x, y = batch(group.rank, i)
        x = x.to(dtype)
        fp, fs, _ = fused(fp, fs, x, y)
        sp, ss, _ = sharded(sp, ss, x, y)
        pp, ps = opt.update(reducer.grad(loss)(pp, x, y), ps, pp)
        grads = reducer.grad(loss)(model.tree(), x, y)
        for k, v in named.items():
            v.grad = grads[k]
        torch.nn.utils.clip_grad_norm_(list(named.values()), 0.5)
        tmuon.step()
        tadam.step()
        avg.update_parameters(model)
    return {"fused": (fp, fused.state_to_tree(fs, fp)), "sharded": (sp, sharded.state_to_tree(ss, sp)),
            "plain": (pp, ps), "reference": (model.tree(), model.tree(avg.module)),
            "fields": sorted(fs.buffers)}


@pytest.mark.slow  # (100 steps, four tracks)
@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("dt", list(DTYPES))
def test_ema_of_muon_and_adamw_in_a_partition_runs_fused_and_sharded_bit_for_bit(dt):
    results = fdp.testing.run(partition_tracks, 2, args=(DTYPES[dt],), timeout=300)
    assert results[0]["fields"] == ["adamw:ema", "adamw:exp_avg", "adamw:exp_avg_sq", "muon:ema",
                                    "muon:momentum_buffer"]
    assert_tracks_equal(results, f"ema(clip, partition(muon, adamw, frozen)) {dt}")


def gloo_tracks(group):
    return tracks(group, torch.float32, 30)


@pytest.mark.slow  # (on gloo)
def test_fused_and_sharded_ema_equal_averaged_model_on_gloo_ranks():
    assert_tracks_equal(fdp.testing.run(gloo_tracks, 2, backend="gloo", timeout=300), "ema(adamw) on gloo")


def resume(group, path):
    """``resumed_runs`` of ema(sgd): each track's params and averaged params."""
    runs = resumed_runs(group, fdp.optim.ema(fdp.optim.sgd(0.1, momentum=0.9), 0.9), path)
    ema = {track: fdp.optim.ema_params(st if step is None else step.state_to_tree(st, par), par)
           for track, (step, st, par) in runs.items()}
    return {track: par for track, (_, _, par) in runs.items()}, ema


def test_the_average_is_saved_loaded_and_resumed_into_another_step_bit_for_bit(tmp_path):
    for rank, (params, ema) in enumerate(fdp.testing.run(resume, 2, args=(str(tmp_path / "ckpt.pt"),))):
        for track in ("fused", "plain"):
            assert_equal(params[track], params["sharded"], f"rank {rank}: resumed {track} vs sharded params")
            assert_equal(ema[track], ema["sharded"], f"rank {rank}: resumed {track} vs sharded ema")
        assert not all(torch.equal(ema["plain"][k], params["plain"][k]) for k in params["plain"])


def nonfinite(group):
    """The sharded fused step with skip_nonfinite: a step with an inf on one rank moves
    neither the params nor the average (the count does not move), on every rank."""
    apply, params, buffers = fdp.functionalize(mlp(seed=5))
    loss = loss_of(apply, buffers)
    step = fdp.Reducer(params, group, shard=True, skip_nonfinite=True, **CAPS).grad_and_update(
        loss, fdp.optim.ema(fdp.optim.adam(1e-2), 0.9))
    p, s = dict(params), step.init(params)
    for i in range(3):
        p, s, _ = step(p, s, *batch(group.rank, i))
    before = fdp.optim.ema_params(step.state_to_tree(s, p), p)
    x, y = batch(group.rank, 3)
    if group.rank == 1:
        x[0, 0] = float("inf")
    p, s, _ = step(p, s, x, y)
    return before, fdp.optim.ema_params(step.state_to_tree(s, p), p), int(s.step), step.last_step.finite


def test_a_nonfinite_step_of_the_sharded_fused_step_leaves_the_average():
    for rank, (before, after, count, finite) in enumerate(fdp.testing.run(nonfinite, 2)):
        assert not finite and count == 3, f"rank {rank}"
        assert_equal(after, before, f"rank {rank}: the average after a skipped step")


def test_a_torch_run_with_an_averaged_model_continues_in_fdp_bit_for_bit():
    # torch.optim + AveragedModel for 5 steps, then fdp from their state: ``opt.init``'s
    # state with the inner optimizer's fields from ``state_from_torch`` and the average.
    params = params_of(torch.float32, seed=3)
    ref = TorchEma(torch.optim.AdamW, params, dict(lr=1e-2), 0.9)
    for t in range(5):
        ref.step(grads_for(params, t))
    inner = fdp.optim.adamw(1e-2)
    opt = fdp.optim.ema(inner, 0.9)
    mine = ref.params
    state = opt.init(mine)._replace(**fdp.optim.state_from_torch(inner, ref.opt.state_dict(), mine)._asdict(),
                                    ema=ref.ema)
    for t in range(5, 5 + STEPS):
        grads = grads_for(params, t)
        ref.step(grads)
        mine, state = opt.update(grads, state, mine)
    assert_equal(mine, ref.params, "params")
    assert_equal(fdp.optim.ema_params(state, mine), ref.ema, "ema")


# ------------------------------------------------------------------------- bad input

def test_bad_decay_a_foreign_state_and_a_flat_state_are_refused():
    with pytest.raises(ValueError, match=r"invalid decay 1.5 \(must be in \[0, 1\]\)"):
        fdp.optim.ema(fdp.optim.sgd(0.1), 1.5)
    with pytest.raises(ValueError, match="invalid decay -0.1"):
        fdp.optim.ema_update({"w": torch.zeros(1)}, {"w": torch.zeros(1)}, 1, decay=-0.1)
    params = {"w": torch.ones(2)}
    opt = fdp.optim.ema(fdp.optim.sgd(0.1))
    with pytest.raises(TypeError, match="state must be the state of fdp.optim.ema"):
        opt.update(params, fdp.optim.sgd(0.1).init(params), params)
    reducer = fdp.Reducer(params)
    step = reducer.grad_and_update(lambda p: p["w"].sum(), opt)
    flat = step.init(params)
    with pytest.raises(TypeError, match=r"step.state_to_tree\(opt_state, params\)"):
        fdp.optim.ema_params(flat, params)
    assert fdp.optim.ema_params(step.state_to_tree(flat, params), params) is params
    with pytest.raises(ValueError, match="state.ema"):
        opt.update(params, opt.init(params)._replace(ema={"w": torch.ones(3)}), params)
