"""fdp.optim's second round: torch.optim's NAdam, RAdam, Adamax, Adadelta and Adafactor, and
optax's Lion, in the plain path, the fused step and the sharded fused step.

Every torch optimizer is checked against the real torch.optim class (param groups for the
mask, ``LambdaLR`` for the schedule, ``clip_grad_norm_`` / ``clip_grad_value_`` for the
chains), Lion against optax's formula written out per leaf below, over 100 steps (the fused
and sharded steps: 100 in f32 and f64, 30 with donation and in bf16), with ``torch.equal``.
The fused and sharded steps run on simulated ranks (threads, and gloo processes), where each rank also keeps a torch.optim (or reference) copy of the params fed
with the same all-reduced gradients.
"""

from __future__ import annotations

import pytest
import torch
from compiling import skip_unless_dynamo_traces_fdp
from models import CAPS, batch, loss_of, mlp
from optim_cases import assert_equal, decays, grads_for, params_of, resumed_runs

import fdp

STEPS = 100
DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "c64": torch.complex64}


class TorchLoop:
    """A torch.optim class on leaf tensors; with ``mask`` two param groups (decay / none),
    with ``factor`` a ``LambdaLR``, with ``clip`` a function of the param list run before
    each step (``clip_grad_norm_``)."""

    def __init__(self, cls, params, kw, *, mask=False, factor=None, clip=None):
        self.params = {k: v.clone().requires_grad_() for k, v in params.items()}
        ps = list(self.params.values())
        if mask:
            groups = [{"params": [p for p in ps if p.dim() >= 2]},
                      {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
            self.opt = cls([g for g in groups if g["params"]], **kw)
        else:
            self.opt = cls(ps, **kw)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, factor) if factor else None
        self.clip = clip

    def step(self, grads):
        for k, p in self.params.items():
            p.grad = grads[k].clone()
        if self.clip is not None:
            self.clip(list(self.params.values()))
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        return {k: p.detach().clone() for k, p in self.params.items()}


class LionReference:
    """optax.lion (optax/_src/alias.py: scale_by_lion, add_decayed_weights, scale_by_learning_rate,
    then apply_updates), written out per leaf as optax's expressions, in optax's order."""

    def __init__(self, params, lr, b1=0.9, b2=0.99, weight_decay=1e-3, *, mask=False, clip=None):
        self.params = {k: v.clone() for k, v in params.items()}
        self.mu = {k: torch.zeros_like(v) for k, v in params.items()}
        self.lr, self.b1, self.b2, self.wd, self.mask, self.clip = lr, b1, b2, weight_decay, mask, clip
        self.count = 0

    def step(self, grads):
        if self.clip is not None:
            grads = self.clip(grads)
        lr = self.lr(self.count) if callable(self.lr) else self.lr
        for k, p in self.params.items():
            g, mu = grads[k], self.mu[k]
            update = torch.sign((1.0 - self.b1) * g + self.b1 * mu)   # scale_by_lion
            self.mu[k] = (1.0 - self.b2) * g + self.b2 * mu
            if not self.mask or p.dim() >= 2:                        # add_decayed_weights
                update = update + self.wd * p
            update = update * -lr                                    # scale_by_learning_rate
            self.params[k] = p + update                              # apply_updates
        self.count += 1
        return dict(self.params)


# ------------------------------------------------------------ the plain path vs torch.optim

TORCH = {
    "nadam": (fdp.optim.nadam, torch.optim.NAdam, [
        dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, momentum_decay=1e-2, betas=(0.8, 0.99)),
        dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True, eps=1e-6)]),
    "radam": (fdp.optim.radam, torch.optim.RAdam, [
        dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1),
        dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True, betas=(0.8, 0.9))]),
    "adamax": (fdp.optim.adamax, torch.optim.Adamax, [
        dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, maximize=True, betas=(0.8, 0.99), eps=1e-6)]),
    "adadelta": (fdp.optim.adadelta, torch.optim.Adadelta, [
        dict(), dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=0.1, maximize=True)]),
}
if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
    TORCH["adafactor"] = (fdp.optim.adafactor, torch.optim.Adafactor, [
        dict(), dict(lr=0.05, beta2_decay=-0.5, eps=(1e-20, 1e-2), d=2.0, weight_decay=0.1, maximize=True)])
CASES = [(name, i, dt) for name, (_, _, kws) in TORCH.items() for i in range(len(kws)) for dt in DTYPES
         if not (name == "adafactor" and dt == "c64")]  # torch's Adafactor refuses complex params


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("name,i,dt", CASES, ids=[f"{n}-{i}-{d}" for n, i, d in CASES])
def test_each_optimizer_equals_its_torch_class_bit_for_bit_over_100_steps(name, i, dt, donate):
    make, cls, kws = TORCH[name]
    kw = kws[i]
    params = params_of(DTYPES[dt])
    ref = TorchLoop(cls, params, kw)
    opt = make(**kw, donate=donate)
    state = opt.init(params)
    params = {k: v.clone() for k, v in params.items()}
    for t in range(STEPS):
        grads = grads_for(params, t)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"{name}({kw}) {dt} step {t + 1}")
    assert int(state.step) == STEPS
    for field in state._fields[1:]:
        for k, p in ref.params.items():
            ours = getattr(state, field)[k]
            if ours is not None:  # adafactor: a None where torch keeps no such key
                assert torch.equal(ours, ref.opt.state[p][field]), f"{name}: state.{field}[{k!r}]"
            else:
                assert field not in ref.opt.state[p], f"{name}: state.{field}[{k!r}] missing"


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("name", list(TORCH))
def test_mask_schedule_and_global_norm_clipping_equal_param_groups_lambdalr_and_clip_grad_norm(name, donate):
    make, cls, kws = TORCH[name]
    kw = dict(kws[-1])
    base = kw.pop("lr", 1.0)
    params = params_of(torch.float32, seed=1)
    ref = TorchLoop(cls, params, {**kw, "lr": base}, mask=True, factor=lambda t: 0.97**t,
                    clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0),
                          make(lr=lambda t: base * 0.97**t, **kw, mask=decays, donate=donate))
    state = opt.init(params)
    params = {k: v.clone() for k, v in params.items()}
    for t in range(STEPS):
        grads = grads_for(params, t, scale=3.0)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"{name}: mask + schedule + clip, step {t + 1}")
        assert float(state.transforms[0].norm) > 1.0, "the test must clip"


def test_nadam_continues_a_late_torch_state_bit_for_bit():
    # NAdam's mu_product is recomputed from the step count (fdp keeps no per-param copy): a
    # state taken over from torch.optim at step 3000 (past two of the kept values) and one
    # more step equal torch's, and one optimizer object serves states at different counts.
    params = params_of(torch.float32, shapes=((3, 2), (2,)))
    ref = TorchLoop(torch.optim.NAdam, params, dict(lr=1e-3, momentum_decay=5e-3))
    for t in range(3000):
        ref.step(grads_for(params, t % 7))
    opt = fdp.optim.nadam(lr=1e-3, momentum_decay=5e-3)
    late = fdp.optim.NAdamState(
        torch.tensor(3000.0), *({k: ref.opt.state[p][f].clone() for k, p in ref.params.items()}
                                for f in ("exp_avg", "exp_avg_sq")))
    mine = {k: p.detach().clone() for k, p in ref.params.items()}
    early, early_state = params, opt.init(params)
    fresh = fdp.optim.nadam(lr=1e-3, momentum_decay=5e-3)
    fresh_p, fresh_state = params, fresh.init(params)
    for t in range(3):  # interleaved: count 0, 3000, 1, 3001, ...
        grads = grads_for(params, 100 + t)
        early, early_state = opt.update(grads, early_state, early)
        fresh_p, fresh_state = fresh.update(grads, fresh_state, fresh_p)
        assert_equal(early, fresh_p, f"an early state after {t + 1} steps (shared optimizer)")
        want = ref.step(grads)
        mine, late = opt.update(grads, late, mine)
        assert_equal(mine, want, f"the late state after {3000 + t + 1} steps")


# ------------------------------------------------------------------ Lion vs optax's formula

LION = [dict(lr=1e-3), dict(lr=3e-3, b1=0.8, b2=0.95, weight_decay=0.1)]


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("dt", ["f32", "f64", "bf16"])
@pytest.mark.parametrize("i", range(len(LION)))
def test_lion_equals_optax_formula_bit_for_bit_over_100_steps(i, dt, donate):
    kw = LION[i]
    params = params_of(DTYPES[dt])
    ref = LionReference(params, **kw)
    opt = fdp.optim.lion(**kw, donate=donate)
    state = opt.init(params)
    params = {k: v.clone() for k, v in params.items()}
    for t in range(STEPS):
        grads = grads_for(params, t)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"lion({kw}) {dt} step {t + 1}")
    assert_equal(state.mu, ref.mu, "lion: state.mu")


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_lion_with_mask_schedule_and_clipping_equals_the_reference(donate):
    params = params_of(torch.float32, seed=2)
    clip = fdp.optim.clip_by_global_norm(1.0)
    ref = LionReference(params, lambda t: 1e-2 * 0.97**t, weight_decay=0.2, mask=True,
                        clip=lambda g: clip.update(g, clip.init(g), g)[0])
    opt = fdp.optim.chain(clip, fdp.optim.lion(lambda t: 1e-2 * 0.97**t, weight_decay=0.2, mask=decays,
                                               donate=donate))
    state = opt.init(params)
    params = {k: v.clone() for k, v in params.items()}
    for t in range(STEPS):
        grads = grads_for(params, t, scale=3.0)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"lion + mask + schedule + clip, step {t + 1}")


# ----------------------------------------------------------------- the leaf-list form

ELEMENTWISE = {
    "nadam": lambda: fdp.optim.nadam(1e-2, weight_decay=0.1, mask=decays),
    "nadamw": lambda: fdp.optim.nadam(1e-2, weight_decay=0.1, decoupled_weight_decay=True, mask=decays),
    "radam": lambda: fdp.optim.radam(1e-2, weight_decay=0.1, decoupled_weight_decay=True, mask=decays),
    "adamax": lambda: fdp.optim.adamax(1e-2, weight_decay=0.1, mask=decays),
    "adadelta": lambda: fdp.optim.adadelta(weight_decay=0.1, mask=decays),
    "lion": lambda: fdp.optim.lion(1e-2, weight_decay=0.1, mask=decays),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_leaf_kernel_on_flat_chunks_per_group_equals_the_tree_update(name):
    # What a fused step does: per hyper-parameter group one flat tensor, updated in chunks
    # (each chunk one kernel call at the same count), the count advanced once per update.
    opt = ELEMENTWISE[name]()
    params = params_of(torch.float32)
    lk = opt.form.leaf_kernel
    groups = lk.groups(params)
    members = {grp: [k for k, g in zip(params, groups) if g == grp] for grp in set(groups)}
    assert set(members) == {0, 1}

    def flat(tree, ks):
        return torch.cat([tree[k].reshape(-1) for k in ks])

    flats = {grp: flat(params, ks) for grp, ks in members.items()}
    states = {grp: [torch.full_like(f, lk.init_value) for _ in lk.fields] for grp, f in flats.items()}
    count = opt.init(params).step.clone()
    state = opt.init(params)
    for t in range(20):
        grads = grads_for(params, t)
        for grp, ks in members.items():
            g = flat(grads, ks)
            n = flats[grp].numel()
            cuts = [0, n // 3, n // 2, n]
            chunks = lambda x, cuts=cuts: [x[a:b] for a, b in zip(cuts, cuts[1:])]  # noqa: E731
            lk.step(grp, chunks(flats[grp]), chunks(g), [chunks(s) for s in states[grp]], count)
        count += 1
        params, state = opt.update(grads, state, params)
        for grp, ks in members.items():
            assert torch.equal(flats[grp], flat(params, ks)), f"{name}: group {grp} step {t + 1}"
            for field, s in zip(lk.fields, states[grp]):
                assert torch.equal(s, flat(getattr(state, field), ks)), f"{name}: state.{field} group {grp}"


def test_leaf_kernels_and_their_fields():
    assert fdp.optim.nadam().form.leaf_kernel.fields == ("exp_avg", "exp_avg_sq")
    assert fdp.optim.radam().form.leaf_kernel.fields == ("exp_avg", "exp_avg_sq")
    assert fdp.optim.adamax().form.leaf_kernel.fields == ("exp_avg", "exp_inf")
    assert fdp.optim.adadelta().form.leaf_kernel.fields == ("square_avg", "acc_delta")
    assert fdp.optim.lion(1e-3).form.leaf_kernel.fields == ("mu",)
    if "adafactor" in TORCH:
        assert fdp.optim.adafactor().form.leaf_kernel is None


# -------------------------------------------- the fused and sharded steps, on simulated ranks

def _schedule(t):
    return 0.99**t


FUSED = {  # name: (fdp optimizer, torch class and its kwargs, or None for Lion's reference)
    "nadam": (lambda: fdp.optim.nadam(lambda t: 1e-2 * _schedule(t), weight_decay=0.1, mask=decays),
              (torch.optim.NAdam, dict(weight_decay=0.1))),
    "nadamw": (lambda: fdp.optim.nadam(lambda t: 1e-2 * _schedule(t), weight_decay=0.1,
                                       decoupled_weight_decay=True, momentum_decay=1e-2, mask=decays),
               (torch.optim.NAdam, dict(weight_decay=0.1, decoupled_weight_decay=True, momentum_decay=1e-2))),
    "radam": (lambda: fdp.optim.radam(lambda t: 1e-2 * _schedule(t), weight_decay=0.1,
                                      decoupled_weight_decay=True, mask=decays),
              (torch.optim.RAdam, dict(weight_decay=0.1, decoupled_weight_decay=True))),
    "adamax": (lambda: fdp.optim.adamax(lambda t: 1e-2 * _schedule(t), weight_decay=0.1, mask=decays),
               (torch.optim.Adamax, dict(weight_decay=0.1))),
    "adadelta": (lambda: fdp.optim.adadelta(lambda t: 1e-2 * _schedule(t), weight_decay=0.1, mask=decays),
                 (torch.optim.Adadelta, dict(weight_decay=0.1))),
    "lion": (lambda: fdp.optim.lion(lambda t: 1e-3 * _schedule(t), weight_decay=0.1, mask=decays), None),
}
CLIP = 0.05  # clip_by_value in front of every fused optimizer: a chain, exact on every path


def reference_for(name, params):
    torch_part = FUSED[name][1]
    if torch_part is None:
        return LionReference(params, lambda t: 1e-3 * _schedule(t), weight_decay=0.1, mask=True,
                             clip=lambda g: {k: v.clamp(-CLIP, CLIP) for k, v in g.items()})
    cls, kw = torch_part
    return TorchLoop(cls, params, {**kw, "lr": 1e-2}, mask=True, factor=_schedule,
                     clip=lambda ps: torch.nn.utils.clip_grad_value_(ps, CLIP))


def tracks(group, name, dtype=torch.float32, steps=STEPS, donate=False):
    """Four copies of one model from the same start, on the same batches: the fused step, the
    sharded fused step, ``reducer.grad`` + ``opt.update``, and torch.optim (or Lion's reference)
    fed with ``reducer.grad``'s gradients. Returns the params and states of each."""
    apply, params, buffers = fdp.functionalize(mlp(seed=0).to(dtype))
    loss = loss_of(apply, buffers)

    def make():
        return fdp.optim.chain(fdp.optim.clip_by_value(-CLIP, CLIP), FUSED[name][0]())

    reducer = fdp.Reducer(params, group, hook_threshold_bytes=0, **CAPS)
    fused = reducer.grad_and_update(loss, make(), donate=donate)
    sharded = fdp.Reducer(params, group, shard=True, hook_threshold_bytes=0, **CAPS).grad_and_update(
        loss, make(), donate=donate)
    opt = make()
    fp, fs = {k: v.clone() for k, v in params.items()}, fused.init(params)
    sp, ss = {k: v.clone() for k, v in params.items()}, sharded.init(params)
    pp, ps = dict(params), opt.init(params)
    ref = reference_for(name, params)
    for i in range(steps):
        x, y = batch(group.rank, i)
        x = x.to(dtype)
        fp, fs, _ = fused(fp, fs, x, y)
        sp, ss, _ = sharded(sp, ss, x, y)
        pp, ps = opt.update(reducer.grad(loss)(pp, x, y), ps, pp)
        ref_grads = reducer.grad(loss)({k: v.detach() for k, v in ref.params.items()}, x, y)
        ref.step(ref_grads)
    rp = {k: v.detach().clone() for k, v in ref.params.items()}
    return {"fused": (fp, fused.state_to_tree(fs, fp)), "sharded": (sp, sharded.state_to_tree(ss, sp)),
            "plain": (pp, ps), "reference": (rp, None), "buckets": len(fused.plan.buckets)}


def assert_tracks_equal(results, what, sharded_exact=True):
    """``sharded_exact=False`` (bf16): torch's CPU kernels round some bf16 ops (``add(alpha=)``,
    weight decay's) differently in their vectorized body and their scalar tail, so an
    element's result depends on where it sits in the tensor a kernel call gets; a sharded
    step's slice boundary cuts a leaf at a place the per-leaf call does not, and the params
    drift apart (docs/optim.md, "bf16 params"). The sharded track is then compared with a
    tolerance; the fused step's whole buckets keep this model's leaves aligned."""
    for rank, res in enumerate(results):
        want = res["reference"][0]
        for track in ("plain", "fused", "sharded"):
            if track == "sharded" and not sharded_exact:
                for k in want:
                    torch.testing.assert_close(res[track][0][k], want[k], rtol=0.05, atol=5e-3,
                                               msg=f"{what}, rank {rank}, sharded {k!r}")
                continue
            assert_equal(res[track][0], want, f"{what}, rank {rank}, {track} vs torch.optim/reference")
        plain_state = fdp._tree.leaves(res["plain"][1])
        for track in ("fused", "sharded") if sharded_exact else ("fused",):
            got = fdp._tree.leaves(res[track][1])
            bad = [j for j, (a, b) in enumerate(zip(got, plain_state)) if not torch.equal(a, b)]
            assert len(got) == len(plain_state) and not bad, f"{what}, rank {rank}: {track} state leaves {bad}"


# The plain path is checked over 100 steps for every dtype above; here the fused and sharded
# steps run 100 steps in f32 and f64 (the long runs: the schedule's decay, RAdam's rectified
# phase), and 30 with donation and in bf16 (a layout path and a dtype's buffers; RAdam
# rectifies from step 6, NAdam's momentum product and the schedule move every step).
# `make test` runs one of them (RAdam, f32: the rectified phase, the schedule, several buckets).
FUSED_CASES = [pytest.param(n, dt, donate, steps, id=f"{n}-{dt}-{'donate' if donate else 'pure'}-{steps}steps",
                            marks=() if (n, dt, donate) == ("radam", "f32", False) else pytest.mark.slow)
               for n in FUSED for dt, donate, steps in (("f32", False, STEPS), ("f32", True, 30), ("f64", False, STEPS),
                                                        ("bf16", False, 30))]


@pytest.mark.parametrize("name,dt,donate,steps", FUSED_CASES)
def test_fused_and_sharded_steps_equal_torch_optim_bit_for_bit_on_two_ranks(name, dt, donate, steps):
    results = fdp.testing.run(tracks, 2, args=(name, DTYPES[dt], steps, donate), timeout=300)
    assert results[0]["buckets"] > 1, "the test needs several buckets"
    assert_tracks_equal(results, f"{name} {dt}", sharded_exact=dt != "bf16")


def gloo_tracks(group):
    # the same tracks through gloo's real collectives (the thread ranks above run the long ones)
    return {name: tracks(group, name, steps=20) for name in ("nadam", "radam", "adamax", "adadelta", "lion")}


@pytest.mark.slow  # (five optimizers on gloo)
def test_fused_and_sharded_steps_equal_torch_optim_on_gloo_ranks():
    results = fdp.testing.run(gloo_tracks, 2, backend="gloo", timeout=600)
    for name in results[0]:
        assert_tracks_equal([r[name] for r in results], f"{name} on gloo")


def resume(group, name, path):
    """``resumed_runs`` of this optimizer: the params of each track and the fused step's count."""
    runs = resumed_runs(group, FUSED[name][0](), path)
    return runs["sharded"][2], runs["fused"][2], runs["plain"][2], int(runs["fused"][1].step)


@pytest.mark.parametrize("name", ["nadam", "radam", "adamax", "adadelta", "lion"])
def test_state_round_trips_through_state_to_tree_save_and_load_into_another_step(name, tmp_path):
    for rank, (sharded, fused, plain, count) in enumerate(
            fdp.testing.run(resume, 2, args=(name, str(tmp_path / "ckpt.pt")))):
        assert count == 20
        assert_equal(fused, sharded, f"{name} rank {rank}: resumed fused vs sharded")
        assert_equal(plain, sharded, f"{name} rank {rank}: resumed plain vs sharded")


@pytest.mark.skipif("adafactor" not in TORCH, reason="torch.optim.Adafactor needs torch >= 2.5")
@pytest.mark.parametrize("shard", [False, True], ids=["fused", "sharded"])
def test_the_fused_step_refuses_adafactor_with_the_way_out(shard):
    params = {"w": torch.ones(3, 2)}
    reducer = fdp.Reducer(params, shard=shard)
    for opt in (fdp.optim.adafactor(), fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adafactor())):
        with pytest.raises(TypeError, match="use reducer.grad and opt.update"):
            reducer.grad_and_update(lambda p: p["w"].sum(), opt)


@pytest.mark.skipif("adafactor" not in TORCH, reason="torch.optim.Adafactor needs torch >= 2.5")
def test_adafactor_state_round_trips_through_save_and_resumes_bit_for_bit(tmp_path):
    params = params_of(torch.float32)
    opt = fdp.optim.adafactor(lr=0.05, weight_decay=0.1)
    p, s = params, opt.init(params)
    straight_p, straight_s = params, s
    for t in range(8):
        straight_p, straight_s = opt.update(grads_for(params, t), straight_s, straight_p)
    for t in range(4):
        p, s = opt.update(grads_for(params, t), s, p)
    fdp.save(tmp_path / "ckpt.pt", {"params": p, "opt": s})
    loaded = fdp.load(tmp_path / "ckpt.pt", like={"params": params, "opt": opt.init(params)})
    p, s = loaded["params"], loaded["opt"]
    assert s.variance["layer0.weight"] is None and s.row_var["layer1.bias"] is None
    for t in range(4, 8):
        p, s = opt.update(grads_for(params, t), s, p)
    assert_equal(p, straight_p, "adafactor resumed vs uninterrupted")


# ------------------------------------------------------------------------- bad input


def test_bad_hyper_parameters_are_refused_with_torchs_rules():
    cases = [
        (lambda: fdp.optim.nadam(momentum_decay=-1.0), "invalid momentum_decay -1.0"),
        (lambda: fdp.optim.nadam(betas=(1.0, 0.9)), r"invalid betas\[0\] 1.0"),
        (lambda: fdp.optim.radam(eps=-1.0), "invalid eps -1.0"),
        (lambda: fdp.optim.adamax(lr=-1.0), "invalid learning rate -1.0"),
        (lambda: fdp.optim.adadelta(rho=1.5), r"invalid rho 1.5 \(must be in \[0, 1\]\)"),
        (lambda: fdp.optim.lion(1e-3, b2=1.0), r"invalid \(b1, b2\)\[1\] 1.0"),
        (lambda: fdp.optim.lion(1e-3, weight_decay=-0.1), "invalid weight_decay -0.1"),
    ]
    if "adafactor" in TORCH:
        cases += [(lambda: fdp.optim.adafactor(d=0.5), "invalid clipping threshold d 0.5"),
                  (lambda: fdp.optim.adafactor(beta2_decay=0.1), "invalid beta2_decay 0.1"),
                  (lambda: fdp.optim.adafactor(eps=(-1.0, 1e-3)), "invalid eps1 -1.0")]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()


def test_lion_and_adafactor_name_a_complex_leaf():
    params = {"w": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)}
    with pytest.raises(TypeError, match=r"lion: params\['z'\] is complex"):
        fdp.optim.lion(1e-3).init(params)
    if "adafactor" in TORCH:
        with pytest.raises(TypeError, match=r"adafactor: params\['z'\] is complex"):
            fdp.optim.adafactor().init(params)


@pytest.mark.skipif("adafactor" not in TORCH, reason="torch.optim.Adafactor needs torch >= 2.5")
def test_adafactor_names_a_state_leaf_of_the_wrong_layout():
    params = params_of(torch.float32)
    opt = fdp.optim.adafactor()
    state = opt.init(params)
    grads = grads_for(params, 0)
    bad = state._replace(row_var={**state.row_var, "layer0.weight": torch.zeros(6, 4)})
    with pytest.raises(ValueError, match=r"state.row_var\['layer0.weight'\] is shape \(6, 4\).*needs shape \(6, 1\)"):
        opt.update(grads, bad, params)
    other = opt.init({**params, "layer1.bias": torch.zeros(6, 2)})  # a 2-D leaf where params has 1-D
    with pytest.raises(ValueError, match=r"state.row_var does not have the layout"):
        opt.update(grads, other, params)


# ---------------------------------------------------------------------- torch.compile


@pytest.mark.slow  # (a dynamo trace per schedule)
@pytest.mark.compile
@pytest.mark.parametrize("name", ["radam", "adamax", "adadelta", "lion"])
def test_schedules_compile_into_one_graph_without_recompiles(name):
    skip_unless_dynamo_traces_fdp()
    make = {"radam": fdp.optim.radam, "adamax": fdp.optim.adamax, "adadelta": fdp.optim.adadelta,
            "lion": fdp.optim.lion}[name]
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    sched = fdp.optim.schedules.warmup_cosine(0.05, 3, 10)
    compiled_opt, eager_opt = make(sched), make(sched)
    params = {"w": torch.ones(4), "b": torch.ones(2)}
    step = torch.compile(compiled_opt.update, fullgraph=True, backend=backend)
    cp, cs = params, compiled_opt.init(params)
    ep, es = params, eager_opt.init(params)
    for t in range(8):
        grads = {"w": torch.linspace(-1, 1, 4) * (t + 1), "b": torch.full((2,), -0.5)}
        cp, cs = step(grads, cs, cp)
        ep, es = eager_opt.update(grads, es, ep)
    assert len(graphs) == 1, f"{name}: {len(graphs)} graphs for 8 steps (recompiled)"
    for k in ep:  # the lr is a float64 tensor in the graph, a Python float eagerly
        torch.testing.assert_close(cp[k], ep[k], rtol=1e-5, atol=1e-6, msg=f"{name}: params[{k!r}]")


@pytest.mark.compile
def test_nadam_says_why_it_does_not_compile():
    skip_unless_dynamo_traces_fdp()
    torch._dynamo.reset()
    opt = fdp.optim.nadam()
    params = {"w": torch.ones(4)}
    step = torch.compile(opt.update, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="mu_product"):
        step({"w": torch.ones(4)}, opt.init(params), params)
