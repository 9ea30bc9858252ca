"""``fdp.optim.multi_steps``: optax's ``MultiSteps`` (gradients accumulated in the state, the
inner optimizer applied to their mean on every k-th call). Checked against optax's lines
written out per leaf below, driving a real torch.optim object on every k-th call, over 100
inner updates in fp32 and fp64 with ``torch.equal``; and against fdp's own accumulation
(``accumulate=``, ``step.accumulate``), which it equals bit for bit on one rank with
``use_grad_mean=False``."""

from __future__ import annotations

import pytest
import torch
from models import CAPS, batch, loss_of, mlp
from optim_cases import assert_same_tree as assert_equal
from optim_cases import grads_for, params_of

import fdp

UPDATES = 100
DTYPES = {"f32": torch.float32, "f64": torch.float64}


class MultiStepsReference:
    """optax.MultiSteps (optax/transforms/_accumulation.py) written out per leaf, with the
    inner update a torch.optim object (its LambdaLR stepped once per inner update; ``clip``
    run on the accumulated gradients, as optax's inner chain sees them)."""

    def __init__(self, params, cls, kw, every_k, use_grad_mean=True, acc_dtype=None, factor=None, clip=None):
        self.params = {k: v.clone().requires_grad_() for k, v in params.items()}
        self.opt = cls(list(self.params.values()), **kw)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, factor) if factor else None
        self.every_k = every_k if callable(every_k) else (lambda step: every_k)
        self.mean, self.clip = use_grad_mean, clip
        self.acc = {k: torch.zeros_like(v, dtype=acc_dtype) for k, v in params.items()}
        self.mini_step, self.gradient_step = 0, 0

    def step(self, grads):
        k_steps = self.every_k(self.gradient_step)
        for k, g in grads.items():
            acc = self.acc[k]
            acc = acc + (g - acc) / (self.mini_step + 1) if self.mean else g + acc
            self.acc[k] = acc.to(self.acc[k].dtype)
        emit = self.mini_step == k_steps - 1
        if emit:
            for k, p in self.params.items():
                p.grad = self.acc[k].to(grads[k].dtype)       # cast like the updates
            if self.clip is not None:
                self.clip(list(self.params.values()))
            self.opt.step()
            if self.sched is not None:
                self.sched.step()
            self.acc = {k: torch.zeros_like(a) for k, a in self.acc.items()}
            self.gradient_step += 1
        self.mini_step = (self.mini_step + 1) % k_steps
        return {k: p.detach().clone() for k, p in self.params.items()}


CASES = [(dt, k, mean) for dt in DTYPES for k in (1, 3, 4) for mean in (True, False)]


@pytest.mark.parametrize("dt,k,mean", CASES, ids=[f"{d}-k{k}-{'mean' if m else 'sum'}" for d, k, m in CASES])
def test_multi_steps_equals_optax_multisteps_written_out_over_100_inner_updates(dt, k, mean):
    params = params_of(DTYPES[dt])
    ref = MultiStepsReference(params, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), k, mean)
    opt = fdp.optim.multi_steps(fdp.optim.adamw(1e-2, weight_decay=0.1), k, use_grad_mean=mean)
    state = opt.init(params)
    for t in range(UPDATES * k):
        grads = grads_for(params, t)
        want = ref.step(grads)
        before = params
        params, state = opt.update(grads, state, params)
        if (t + 1) % k:
            assert params is before, f"call {t + 1}: no update, the params come back as they were"
        assert_equal(params, want, f"{dt} k={k} call {t + 1}")
        assert_equal(state.acc_grads, ref.acc, f"{dt} k={k} acc_grads after call {t + 1}")
        assert (int(state.mini_step), int(state.gradient_step)) == (ref.mini_step, ref.gradient_step)
    assert int(state.gradient_step) == UPDATES and int(state.inner_opt_state.step) == UPDATES


def test_a_k_schedule_a_chain_and_an_lr_schedule_see_the_inner_count_and_the_mean():
    # k varies with gradient_step (optax's every_k_schedule), the inner chain clips the
    # accumulated mean (not each micro-batch), and adamw's schedule counts inner updates.
    params = params_of(torch.float32, seed=1)

    def every_k(step):
        return 1 if step < 20 else 2 + step % 3

    ref = MultiStepsReference(params, torch.optim.AdamW, dict(lr=1e-2), every_k, factor=lambda t: 0.97**t,
                              clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))
    opt = fdp.optim.multi_steps(fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0),
                                                fdp.optim.adamw(lambda t: 1e-2 * 0.97**t)), every_k)
    state = opt.init(params)
    calls = 0
    while int(state.gradient_step) < UPDATES:
        grads = grads_for(params, calls, scale=3.0)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        calls += 1
        assert_equal(params, want, f"call {calls}")
    assert calls == 20 + sum(2 + s % 3 for s in range(20, UPDATES))
    assert float(state.inner_opt_state.transforms[0].norm) > 1.0, "the test must clip"
    assert fdp.optim.hyperparams(fdp.optim.adamw(lambda t: 1e-2 * 0.97**t), state.inner_opt_state.optimizer)[
        "lr"] == 1e-2 * 0.97 ** (UPDATES - 1)


def test_a_float32_accumulator_for_bfloat16_params_equals_the_reference():
    params = params_of(torch.bfloat16, seed=2)
    ref = MultiStepsReference(params, torch.optim.SGD, dict(lr=0.1, momentum=0.9), 4, acc_dtype=torch.float32)
    opt = fdp.optim.multi_steps(fdp.optim.sgd(0.1, momentum=0.9), 4, accumulator_dtype=torch.float32)
    state = opt.init(params)
    assert state.acc_grads["layer0.weight"].dtype == torch.float32
    for t in range(UPDATES * 4):
        grads = grads_for(params, t)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"bf16 call {t + 1}")
    assert params["layer0.weight"].dtype == torch.bfloat16


def test_state_round_trips_through_save_in_the_middle_of_an_accumulation(tmp_path):
    params = params_of(torch.float64)
    opt = fdp.optim.multi_steps(fdp.optim.adam(1e-2), 4)
    p, s = params, opt.init(params)
    straight_p, straight_s = params, s
    for t in range(30):
        straight_p, straight_s = opt.update(grads_for(params, t), straight_s, straight_p)
    for t in range(14):  # 3 updates and 2 gradients in the accumulator
        p, s = opt.update(grads_for(params, t), s, p)
    assert (int(s.mini_step), int(s.gradient_step)) == (2, 3)
    fdp.save(tmp_path / "ckpt.pt", {"params": p, "opt": s})
    loaded = fdp.load(tmp_path / "ckpt.pt", like={"params": params, "opt": opt.init(params)})
    p, s = loaded["params"], loaded["opt"]
    for t in range(14, 30):
        p, s = opt.update(grads_for(params, t), s, p)
    assert_equal(p, straight_p, "resumed vs uninterrupted")
    assert_equal(s.acc_grads, straight_s.acc_grads, "acc_grads")


# ------------------------------------------- the relation to accumulate= and step.accumulate

def accumulation(group, k=3, updates=UPDATES):
    """One model three ways on the same micro-batches: multi_steps(use_grad_mean=False) fed
    each micro-batch's averaged gradient, the plain path's ``accumulate=`` (local sums, one
    all-reduce per k), and the fused step's ``step.accumulate``."""
    apply, params, buffers = fdp.functionalize(mlp(seed=4))
    loss = loss_of(apply, buffers)
    inner = fdp.optim.adamw(1e-2, weight_decay=0.1)
    multi = fdp.optim.multi_steps(inner, k, use_grad_mean=False)
    reducer = fdp.Reducer(params, group, **CAPS)
    step = reducer.grad_and_update(loss, inner)
    mp, ms = dict(params), multi.init(params)
    pp, ps = dict(params), inner.init(params)
    fp, fs = dict(params), step.init(params)
    for u in range(updates):
        xs = [batch(group.rank, k * u + j) for j in range(k)]
        for x, y in xs:
            mp, ms = multi.update(reducer.grad(loss)(mp, x, y), ms, mp)
        acc = None
        for x, y in xs[:-1]:
            g = torch.func.grad(loss)(pp, x, y)
            acc = g if acc is None else {n: acc[n] + g[n] for n in g}
        pp, ps = inner.update(reducer.grad(loss, accumulate=acc)(pp, *xs[-1]), ps, pp)
        for x, y in xs[:-1]:
            step.accumulate(fp, x, y)
        fp, fs, _ = step(fp, fs, *xs[-1])
    return {"multi_steps": mp, "accumulate": pp, "step.accumulate": fp}


def test_multi_steps_summing_equals_accumulate_and_step_accumulate_bit_for_bit_on_one_rank():
    (res,) = fdp.testing.run(accumulation, 1)
    assert_equal(res["multi_steps"], res["accumulate"], "multi_steps vs accumulate=")
    assert_equal(res["step.accumulate"], res["accumulate"], "step.accumulate vs accumulate=")


def test_on_two_ranks_the_sums_associate_differently_and_agree_within_rounding():
    for rank, res in enumerate(fdp.testing.run(accumulation, 2, args=(3, 20))):
        assert_equal(res["step.accumulate"], res["accumulate"], f"rank {rank}: step.accumulate vs accumulate=")
        for key, want in res["accumulate"].items():
            torch.testing.assert_close(res["multi_steps"][key], want, rtol=1e-4, atol=1e-5,
                                       msg=f"rank {rank}: multi_steps vs accumulate= [{key!r}]")


# ------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("shard", [False, True], ids=["fused", "sharded"])
def test_the_fused_step_refuses_multi_steps_and_says_what_to_use(shard):
    params = {"w": torch.ones(3, 2)}
    reducer = fdp.Reducer(params, shard=shard)
    with pytest.raises(TypeError, match="use reducer.grad and opt.update"):
        reducer.grad_and_update(lambda p: p["w"].sum(), fdp.optim.multi_steps(fdp.optim.adamw(), 2))


def test_bad_k_and_a_foreign_state_are_refused():
    with pytest.raises(ValueError, match="every_k_schedule must be .* an int >= 1, got 0"):
        fdp.optim.multi_steps(fdp.optim.sgd(0.1), 0)
    params = {"w": torch.ones(2)}
    opt = fdp.optim.multi_steps(fdp.optim.sgd(0.1), lambda step: 2.5)
    with pytest.raises(ValueError, match="got 2.5"):
        opt.update(params, opt.init(params), params)
    with pytest.raises(TypeError, match="MultiStepsState"):
        opt.update(params, fdp.optim.sgd(0.1).init(params), params)
    opt = fdp.optim.multi_steps(fdp.optim.sgd(0.1), 2)
    with pytest.raises(ValueError, match=r"grads\['w'\] has shape \(3,\)"):
        opt.update({"w": torch.ones(3)}, opt.init(params), params)


def test_the_fused_step_refuses_multi_steps_and_adafactor_naming_them_and_the_way_out():
    params = {"w": torch.zeros(2, 3)}
    reducer = fdp.Reducer(params)
    loss = lambda p: p["w"].sum()  # noqa: E731
    with pytest.raises(TypeError, match=r"fdp.optim.multi_steps accumulates .* step.accumulate\(params"):
        reducer.grad_and_update(loss, fdp.optim.multi_steps(fdp.optim.adamw(lr=1e-3), 2))
    with pytest.raises(TypeError, match=r"fdp.optim.adafactor's update is not element-wise .* reducer.grad"):
        reducer.grad_and_update(loss, fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adafactor()))
