"""``fdp.optim.inspect(opt, state)`` and ``step.inspect(opt_state)``: one place to read what the
last update did (the count, the lr and hyper-parameters per label, the clip's norm, the loss
scale, the EMA's decay and averages, ``multi_steps``' micro-steps, the step's finite verdict
and skipped steps), equal to what torch's objects report on the same run, and the same from
the plain path's per-leaf state and from every fused step kind's flat state, sharded ones
included (nothing gathered)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from models import CAPS, Block, block_net, tokens
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fdp

STEPS = 5


def lr_a(t):
    return 0.02 * min(1.0, (t + 1) / 2)


def lr_b(t):
    return 0.01 * (1 + math.cos(math.pi * t / STEPS)) / 2


def is_matrix(path, p):
    return "a" if p.dim() >= 2 else "b"


def recipe():
    """ema(chain(loss scale, clip, two labels with their own schedules)): GradScaler,
    clip_grad_norm_, AdamW with two param groups under LambdaLR, AveragedModel."""
    return fdp.optim.ema(fdp.optim.chain(
        fdp.optim.loss_scale(init_scale=2.0 ** 10, growth_interval=2),
        fdp.optim.clip_by_global_norm(0.5),
        fdp.optim.partition(is_matrix, {"a": fdp.optim.adamw(lr_a, weight_decay=0.1),
                                        "b": fdp.optim.adamw(lr_b, weight_decay=0.0)})), decay=0.9)


def data(t):
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_the_plain_paths_inspection_equals_what_torchs_objects_report_each_step():
    net = model()
    ref = model()
    matrices = [p for p in ref.parameters() if p.dim() >= 2]
    vectors = [p for p in ref.parameters() if p.dim() < 2]
    topt = torch.optim.AdamW([{"params": matrices, "lr": 1.0, "weight_decay": 0.1},
                              {"params": vectors, "lr": 1.0, "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(topt, [lr_a, lr_b])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    swa = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    apply, params, _ = fdp.functionalize(net)
    opt = recipe()
    state = opt.init(params)
    info = fdp.optim.inspect(opt, state, next_update=True)
    assert info.step == 0 and info.lr == {"a": lr_a(0), "b": lr_b(0)}, info
    before = fdp.optim.inspect(opt, state)  # no update yet: nothing to report but the values to come
    assert (before.hyperparams, before.clip_norm, before.lr) == ({"a": {}, "b": {}}, None, {}), before

    for t in range(STEPS):
        x, y = data(t)
        topt.zero_grad()
        scaler.scale(F.cross_entropy(ref(x), y)).backward()
        scaler.unscale_(topt)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        scaler.step(topt)
        groups = [dict(g) for g in topt.param_groups]  # (as the step used them)
        scaler.update()
        swa.update_parameters(ref)
        sched.step()

        def loss(p, x, y, scale):
            return F.cross_entropy(apply(p, {}, x)[0], y) * scale

        grads = torch.func.grad(loss)(params, x, y, fdp.optim.current_loss_scale(state))
        params, state = opt.update(grads, state, params)
        info = fdp.optim.inspect(opt, state)
        assert info.step == t + 1
        for label, group in zip("ab", groups):
            for key, value in info.hyperparams[label].items():
                assert value == group[key], (t, label, key, value, group[key])
        assert info.lr == {"a": groups[0]["lr"], "b": groups[1]["lr"]}
        assert info.clip_norm == float(norm), (t, info.clip_norm, float(norm))
        assert info.loss_scale == scaler.get_scale()
        assert (info.ema_decay, info.averages) == (0.9, int(swa.n_averaged))
        assert (info.finite, info.skipped, info.micro_steps) == (None, None, None)
    assert info.loss_scale == 2.0 ** 12  # (it grew twice: growth_interval=2)
    scalars = info.scalars()
    assert scalars["lr/a"] == info.lr["a"] and scalars["betas.1/b"] == 0.999 and scalars["step"] == STEPS
    assert "amsgrad/a" not in scalars  # (booleans are not numbers to log)


def fused_kinds(group, kind):
    """The recipe on the block net through one step kind; each step's inspection."""
    net = block_net(seed=1)
    apply, params, buffers = fdp.functionalize(net)
    opt = recipe()
    kw = {"shard": True} if kind == "sharded" else {"shard": "params", "units": fdp.units(net, Block)} \
        if kind == "params" else {}

    def loss_fn(p, state_scale, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()) * state_scale

    out = []
    if kind == "plain":
        reducer = fdp.Reducer(params, group, **CAPS)
        state = opt.init(params)
        for t in range(STEPS):
            x, y = tokens(group.rank, t)
            grads = reducer.grad(loss_fn)(params, fdp.optim.current_loss_scale(state), x, y)
            params, state = opt.update(grads, state, params)
            out.append(fdp.optim.inspect(opt, state))
        return out
    reducer = fdp.Reducer(params, group, **CAPS, **kw)
    step = reducer.grad_and_update(loss_fn, opt)
    if kind == "params":
        params = step.shard(params)
    state = step.init(params)
    for t in range(STEPS):
        x, y = tokens(group.rank, t)
        scale = torch.tensor(2.0 ** 10) if t == 0 else torch.tensor(out[-1].loss_scale)
        params, state, _ = step(params, state, scale, x, y)
        info = step.inspect(state)
        assert info._replace(finite=None, skipped=None) == fdp.optim.inspect(opt, state)
        out.append(info)
    return out


@pytest.mark.parametrize("kind", ["fused", "sharded", "params"])
def test_every_fused_kind_reports_what_the_plain_path_reports_without_a_gather(kind):
    plain = fdp.testing.run(fused_kinds, 2, args=("plain",))
    fused = fdp.testing.run(fused_kinds, 2, args=(kind,))
    for rank in range(2):
        for t, (a, b) in enumerate(zip(plain[rank], fused[rank])):
            assert (b.finite, b.skipped) == (True, 0)
            assert b.step == a.step == t + 1 and b.hyperparams == a.hyperparams, (kind, t, a, b)
            assert (b.loss_scale, b.ema_decay, b.averages) == (a.loss_scale, a.ema_decay, a.averages)
            assert b.clip_norm == pytest.approx(a.clip_norm, rel=1e-5), (kind, t)  # (summed in another order)
    assert fused[0] == fused[1]  # every rank reads the same


def test_injected_values_and_a_skipped_step_on_the_fused_step():
    """inject_hyperparams: the values set_hyperparams set are what the next update uses and
    what the inspection reports after it; skip_nonfinite: the skipped step's norm, verdict
    and count."""
    params = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0),
                          fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=0.1, betas=(0.9, 0.99)))
    reducer = fdp.Reducer(params, skip_nonfinite=True)
    step = reducer.grad_and_update(lambda p, s: ((p["w"] * s).sum() + p["b"].sum()), opt)
    state = step.init(params)
    params, state, _ = step(params, state, torch.tensor(1.0))
    info = step.inspect(state)
    assert (info.step, info.lr, info.hyperparams[None]["betas"]) == (1, 0.1, (0.9, 0.99))
    assert (info.finite, info.skipped, info.clip_norm) == (True, 0, float(torch.tensor(8.0).sqrt()))
    state = fdp.optim.set_hyperparams(state, lr=0.05)
    assert step.inspect(state, next_update=True).lr == 0.05
    params, state, _ = step(params, state, torch.tensor(float("inf")))
    info = step.inspect(state)
    assert (info.step, info.finite, info.skipped) == (1, False, 1) and math.isinf(info.clip_norm)
    params, state, _ = step(params, state, torch.tensor(1.0))
    info = step.inspect(state)
    assert (info.step, info.lr, info.finite, info.skipped) == (2, 0.05, True, 1)


def test_multi_steps_muon_and_a_frozen_label_on_the_plain_path():
    params = {"w": torch.randn(4, 4), "b": torch.zeros(4), "e": torch.ones(2)}
    opt = fdp.optim.multi_steps(fdp.optim.partition(
        lambda path, p: "m" if p.dim() == 2 else ("f" if path == "e" else "v"),
        {"m": fdp.optim.muon(lr=0.02), "v": fdp.optim.sgd(lr=lambda t: 0.1 * (t + 1)), "f": fdp.optim.frozen()}), 3)
    state = opt.init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    seen = []
    for _ in range(7):
        params, state = opt.update(grads, state, params)
        info = fdp.optim.inspect(opt, state)
        seen.append((info.step, info.micro_steps))
    assert seen == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert info.hyperparams["f"] == {} and info.lr == {"m": 0.02, "v": 0.2}  # (the second update used lr(1))
    assert info.hyperparams["m"]["momentum"] == torch.optim.Muon([torch.nn.Parameter(torch.ones(2, 2))]).defaults[
        "momentum"]


def test_under_torch_compile_the_compiled_steps_state_is_read_as_the_eager_ones():
    """The plain step compiles whole (torch.func.grad + the update); the inspection reads the
    state it returns, outside the graph, and equals the eager run's."""
    params = {"w": torch.ones(3, 2)}
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(lr=lambda t: 0.1 / (t + 1)))

    def train_step(params, state, x):
        grads = torch.func.grad(lambda p: (p["w"] * x).sum())(params)
        return opt.update(grads, state, params)

    compiled = torch.compile(train_step, fullgraph=True, backend="aot_eager")
    eager_p, eager_s = params, opt.init(params)
    comp_p, comp_s = params, opt.init(params)
    for t in range(3):
        x = torch.full((3, 2), float(t + 1))
        eager_p, eager_s = train_step(eager_p, eager_s, x)
        comp_p, comp_s = compiled(comp_p, comp_s, x)
        assert fdp.optim.inspect(opt, comp_s) == fdp.optim.inspect(opt, eager_s)
    assert fdp.optim.inspect(opt, comp_s).lr == 0.1 / 3


def test_a_state_of_another_optimizer_is_refused_by_name():
    opt = fdp.optim.adamw(0.1)
    with pytest.raises(TypeError, match="fdp.optim.inspect: found no step count|not the state of this optimizer"):
        fdp.optim.inspect(opt, {"w": torch.ones(2)})
    with pytest.raises(TypeError, match="opt must be an fdp.optim optimizer"):
        fdp.optim.inspect(torch.optim.SGD, opt.init({"w": torch.ones(2)}))
    params = {"w": torch.ones(2)}
    step = fdp.Reducer(params).grad_and_update(lambda p: p["w"].sum(), opt)
    with pytest.raises(TypeError, match=r"must be the FusedState this step returned .* fdp.optim.inspect\(opt, state\)"):
        step.inspect(opt.init(params))
