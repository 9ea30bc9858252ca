"""Hyper-parameters changed between steps: ``fdp.optim.inject_hyperparams`` (the values in
the state, optax's way) against torch.optim with ``group["lr"]`` (``betas``, ``momentum``,
``weight_decay``, ...) set before every ``step()``, over 100 steps in fp32 and fp64, with
``torch.equal``; and the way people do it by hand, a new optimizer object every step, in the
fused step: memory flat over 500 steps, torch.optim's numbers. (``inject_hyperparams`` in the
fused step: ``tests/test_optim_inject_fused.py``.)"""

from __future__ import annotations

import functools

import pytest
import torch
from models import CAPS, batch, loss_of, mlp, rss_mib
from optim_cases import assert_equal, decays, grads_for, params_of

import fdp

STEPS = 100
DTYPES = {"f32": torch.float32, "f64": torch.float64}


def lr_at(t):
    return 1e-2 * 0.97**t + 1e-4 * (t % 7)  # a value torch's schedulers would not give: set by hand


# name: (fdp factory, torch class, first kwargs, the values set before step t)
TORCH = {
    "adamw": (fdp.optim.adamw, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1),
              lambda t: dict(lr=lr_at(t), betas=(0.9 - 0.001 * (t % 5), 0.999 if t < 50 else 0.99),
                             weight_decay=0.1 if t % 3 else 0.05)),
    "adam-amsgrad": (functools.partial(fdp.optim.adam, amsgrad=True), torch.optim.Adam,
                     dict(lr=1e-2, weight_decay=0.01, amsgrad=True),
                     lambda t: dict(lr=lr_at(t), betas=(0.8, 0.99) if t % 2 else (0.9, 0.999), eps=1e-8 * (1 + t % 3))),
    "sgd": (fdp.optim.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
            lambda t: dict(lr=0.05 * lr_at(t) / 1e-2, momentum=0.9 if t < 30 else 0.5 + 0.01 * (t % 4),
                           weight_decay=1e-3 * (t % 2))),
    "rmsprop": (fdp.optim.rmsprop, torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True),
                lambda t: dict(lr=lr_at(t) / 10, alpha=0.99 - 0.01 * (t % 3), momentum=0.5 + 0.1 * (t % 2))),
    "adagrad": (fdp.optim.adagrad, torch.optim.Adagrad, dict(lr=1e-2, lr_decay=1e-3),
                lambda t: dict(lr=lr_at(t), lr_decay=1e-3 * (t % 3))),
    "radam": (fdp.optim.radam, torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
              lambda t: dict(lr=lr_at(t), betas=(0.9, 0.999 - 0.001 * (t % 2)), weight_decay=0.1 * (t % 2))),
    "adamax": (fdp.optim.adamax, torch.optim.Adamax, dict(lr=1e-2),
               lambda t: dict(lr=lr_at(t), betas=(0.9 - 0.01 * (t % 2), 0.999))),
    "adadelta": (fdp.optim.adadelta, torch.optim.Adadelta, dict(lr=1.0),
                 lambda t: dict(lr=lr_at(t) * 100, rho=0.9 - 0.05 * (t % 2))),
    "nadam": (fdp.optim.nadam, torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.1),
              lambda t: dict(lr=lr_at(t), betas=(0.9, 0.999 - 0.001 * (t % 2)), weight_decay=0.1 * (t % 2))),
}
CASES = [(n, dt) for n in TORCH for dt in DTYPES]


@pytest.mark.parametrize("name,dt", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_injected_hyperparameters_equal_torch_param_groups_set_before_every_step(name, dt):
    factory, cls, first, values_at = TORCH[name]
    params = params_of(DTYPES[dt])
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = cls(list(ref.values()), **first)
    opt = fdp.optim.inject_hyperparams(factory)(**{k: v for k, v in first.items() if k != "amsgrad"})
    state = opt.init(params)
    for t in range(STEPS):
        values = values_at(t)
        for k, v in values.items():
            torch_opt.param_groups[0][k] = v
        state = fdp.optim.set_hyperparams(state, **values)
        grads = grads_for(params, t)
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        params, state = opt.update(grads, state, params)
        assert_equal(params, {k: p.detach() for k, p in ref.items()}, f"{name} {dt} step {t + 1}")
    for k, v in values_at(STEPS - 1).items():
        got = state.hyperparams[k]
        assert (tuple(map(float, got)) if isinstance(got, tuple) else float(got)) == (
            tuple(v) if isinstance(v, tuple) else v), f"state.hyperparams[{k!r}]"


def test_lion_with_injected_lr_and_betas_equals_optax_formula_written_out():
    params = params_of(torch.float64)
    ref = {k: v.clone() for k, v in params.items()}
    mu = {k: torch.zeros_like(v) for k, v in params.items()}
    opt = fdp.optim.inject_hyperparams(fdp.optim.lion)(lr=1e-3, weight_decay=0.1, mask=decays)
    state = opt.init(params)
    assert sorted(state.hyperparams) == ["b1", "b2", "lr", "weight_decay"]
    for t in range(STEPS):
        lr, b1, b2 = lr_at(t) / 10, 0.9 - 0.01 * (t % 3), 0.99 if t < 50 else 0.95
        state = fdp.optim.set_hyperparams(state, lr=lr, b1=b1, b2=b2)
        grads = grads_for(params, t)
        for k, p in ref.items():  # optax.lion's expressions, in optax's order
            update = torch.sign((1.0 - b1) * grads[k] + b1 * mu[k])
            mu[k] = (1.0 - b2) * grads[k] + b2 * mu[k]
            if p.dim() >= 2:
                update = update + 0.1 * p
            ref[k] = p + update * -lr
        params, state = opt.update(grads, state, params)
        assert_equal(params, ref, f"lion step {t + 1}")


def test_changing_lr_and_weight_decay_every_step_builds_the_inner_optimizer_once():
    built = []

    @functools.wraps(fdp.optim.adamw)
    def counted(*args, **kwargs):
        built.append(kwargs)
        return fdp.optim.adamw(*args, **kwargs)

    opt = fdp.optim.inject_hyperparams(counted)(lr=1e-2, weight_decay=0.1, mask=decays)
    params = params_of(torch.float32)
    state = opt.init(params)
    for t in range(20):
        state = fdp.optim.set_hyperparams(state, lr=lr_at(t), weight_decay=0.01 * t)
        params, state = opt.update(grads_for(params, t), state, params)
    assert len(built) == 1, "lr and weight_decay are read from the state: nothing is built per step"
    for betas in [(0.9, 0.99), (0.9, 0.999), (0.9, 0.99)]:
        state = fdp.optim.set_hyperparams(state, betas=betas)
        params, state = opt.update(grads_for(params, 0), state, params)
    assert len(built) == 2, "a new beta builds once; a value seen before comes from the cache"


def test_injected_state_survives_save_load_and_wrappers():
    params = params_of(torch.float32)
    opt = fdp.optim.ema(fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0),
                                        fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-2)), 0.9)
    p, s = params, opt.init(params)
    straight_p, straight_s = params, s
    for t in range(6):
        straight_s = fdp.optim.set_hyperparams(straight_s, lr=lr_at(t))
        straight_p, straight_s = opt.update(grads_for(params, t), straight_s, straight_p)
    for t in range(3):
        s = fdp.optim.set_hyperparams(s, lr=lr_at(t))
        p, s = opt.update(grads_for(params, t), s, p)
    assert float(s.optimizer.inner.hyperparams["lr"]) == lr_at(2)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        fdp.save(f"{d}/ckpt.pt", {"params": p, "opt": s})
        loaded = fdp.load(f"{d}/ckpt.pt", like={"params": params, "opt": opt.init(params)})
    p, s = loaded["params"], loaded["opt"]
    assert float(s.optimizer.inner.hyperparams["lr"]) == lr_at(2), "the value set came back"
    for t in range(3, 6):
        s = fdp.optim.set_hyperparams(s, lr=lr_at(t))
        p, s = opt.update(grads_for(params, t), s, p)
    assert_equal(p, straight_p, "resumed vs uninterrupted")
    assert_equal(fdp.optim.ema_params(s, p), fdp.optim.ema_params(straight_s, straight_p), "ema")


def test_bad_values_and_names_are_refused():
    params = {"w": torch.ones(2)}
    opt = fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-3)
    state = opt.init(params)
    with pytest.raises(ValueError, match="'momentum' is not injected; this optimizer keeps"):
        fdp.optim.set_hyperparams(state, momentum=0.9)
    with pytest.raises(ValueError, match="betas holds 2 numbers"):
        fdp.optim.set_hyperparams(state, betas=0.9)
    with pytest.raises(ValueError, match="invalid lr -0.1"):
        opt.update(params, fdp.optim.set_hyperparams(state, lr=-0.1), params)
    with pytest.raises(ValueError, match=r"invalid betas\[1\] 1.5"):  # the factory's own check
        opt.update(params, fdp.optim.set_hyperparams(state, betas=(0.9, 1.5)), params)
    with pytest.raises(TypeError, match=r"no inject_hyperparams state.*inject_hyperparams\(fdp.optim.adamw\)"):
        fdp.optim.set_hyperparams(fdp.optim.adamw().init(params), lr=0.1)
    with pytest.raises(TypeError, match="read opt_state.hyperparams"):  # fdp.optim.hyperparams reads kernels'
        fdp.optim.hyperparams(opt, state)
    sgd = fdp.optim.inject_hyperparams(fdp.optim.sgd)(lr=0.1)  # momentum 0: no momentum buffer
    with pytest.raises(ValueError, match="momentum_buffer is None, but this optimizer needs it"):
        sgd.update(params, fdp.optim.set_hyperparams(sgd.init(params), momentum=0.9), params)
    with pytest.raises(ValueError, match="static_args"):
        fdp.optim.inject_hyperparams(fdp.optim.adamw, static_args="momentum")
    two = fdp.optim.partition({"w": "a"}, {"a": opt, "b": opt})
    with pytest.raises(ValueError, match="set each"):
        fdp.optim.set_hyperparams(two.init(params)._replace(states={"a": state, "b": state}), lr=0.1)


def test_the_fused_step_refuses_an_injected_optimizer_where_it_cannot_run_it():
    # (it runs one at the end of a chain: tests/test_optim_inject_fused.py)
    params = {"w": torch.ones(3, 2), "b": torch.ones(2)}
    injected = fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-3)
    reducer = fdp.Reducer(params)
    with pytest.raises(TypeError, match="inside a partition label does not run in the fused step"):
        reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.partition(
            {"w": "a", "b": "b"}, {"a": injected, "b": fdp.optim.sgd(0.1)}))
    with pytest.raises(TypeError, match="a wrapper around inject_hyperparams"):
        reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.ema(injected, 0.9))


# ------------------------------- a new optimizer object every step, in the fused step

def new_optimizer_every_step(group, steps):
    apply, params, buffers = fdp.functionalize(mlp(width=384, seed=3))
    loss = loss_of(apply, buffers)
    reducer = fdp.Reducer(params, group, **CAPS)
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    torch_opt = torch.optim.AdamW(list(ref.values()), lr=1e-3, weight_decay=0.1)
    p, s = dict(params), None
    rss, sets = {}, set()
    for t in range(steps):
        lr = 1e-3 * (1 + (t % 10)) / 10
        step = reducer.grad_and_update(loss, fdp.optim.adamw(lr=lr, weight_decay=0.1))  # new every step
        s = step.init(params) if s is None else s
        x, y = batch(group.rank, t)
        p, s, _ = step(p, s, x, y)
        sets.add(next(iter(p.values())).data_ptr())  # (one engine: it cycles through two param sets)
        grads = reducer.grad(loss)({k: v.detach() for k, v in ref.items()}, x, y)
        for k, v in ref.items():
            v.grad = grads[k]
        torch_opt.param_groups[0]["lr"] = lr
        torch_opt.step()
        if t + 1 in (100, steps):
            rss[t + 1] = rss_mib()
    return {"params": p, "torch": {k: v.detach() for k, v in ref.items()}, "rss": rss,
            "sets": len(sets),
            "param_mib": sum(v.numel() * v.element_size() for v in params.values()) / 2**20}


@pytest.mark.slow  # (500 steps)
def test_a_new_optimizer_every_step_in_the_fused_step_holds_memory_flat_and_equals_torch():
    (res,) = fdp.testing.run(new_optimizer_every_step, 1, args=(500,), timeout=600)
    assert res["param_mib"] > 0.5, "params big enough that a core per step would show"
    assert res["sets"] <= 2, f"the params were in {res['sets']} flat sets: one layout, one engine"
    grown = res["rss"][500] - res["rss"][100]
    # A core per step would hold the params, grads and state again each step: ~400 x 4 x param_mib.
    assert grown < 32, f"RSS grew {grown:.1f} MiB between step 100 and step 500 ({res['rss']})"
    assert_equal(res["params"], res["torch"], "fused step with a new adamw(lr=...) each step vs group['lr']")
