"""``fdp.optim.hyperparams(opt, state)``: the step count and the lr (weight decay, ...) the last
update used, equal to torch.optim's ``group["lr"]`` under a ``LambdaLR``, on the plain path,
in a chain and from the fused step's ``FusedState``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fdp

BASE, STEPS = 0.05, 6


def multiplier(t: int) -> float:
    return min(1.0, (t + 1) / 3) * (1 + math.cos(math.pi * t / STEPS)) / 2


def torch_lrs(cls, **kw) -> tuple[list[float], list[float]]:
    """group["lr"] during each of STEPS ``opt.step()`` calls, and after each ``sched.step()``."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = cls([w], lr=BASE, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier)
    used, after = [], []
    for _ in range(STEPS):
        w.grad = torch.ones(3)
        opt.step()
        used.append(opt.param_groups[0]["lr"])
        sched.step()
        after.append(opt.param_groups[0]["lr"])
    return used, after


CASES = {
    "sgd": (lambda lr: fdp.optim.sgd(lr, momentum=0.9), torch.optim.SGD, {"momentum": 0.9}),
    "adam": (lambda lr: fdp.optim.adam(lr), torch.optim.Adam, {}),
    "adamw": (lambda lr: fdp.optim.adamw(lr, weight_decay=0.1), torch.optim.AdamW, {"weight_decay": 0.1}),
    "adagrad": (lambda lr: fdp.optim.adagrad(lr), torch.optim.Adagrad, {}),
    "rmsprop": (lambda lr: fdp.optim.rmsprop(lr, momentum=0.5), torch.optim.RMSprop, {"momentum": 0.5}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_lr_of_each_update_equals_torch_group_lr_under_lambda_lr(name):
    make, cls, kw = CASES[name]
    used, after = torch_lrs(cls, **kw)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), make(lambda t: BASE * multiplier(t)))
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    assert fdp.optim.hyperparams(opt, state, next_update=True)["lr"] == BASE * multiplier(0)
    for t in range(STEPS):
        params, state = opt.update({"w": torch.ones(3)}, state, params)
        info = fdp.optim.hyperparams(opt, state)
        assert info["step"] == t + 1
        assert info["lr"] == used[t], f"{name}, update {t + 1}: {info['lr']} vs torch {used[t]}"
        assert fdp.optim.hyperparams(opt, state, next_update=True)["lr"] == after[t]
    # the other entries are torch's param-group values
    group = cls([torch.nn.Parameter(torch.ones(1))], lr=BASE, **kw).param_groups[0]
    for key, value in info.items():
        if key not in ("step", "lr"):
            assert group[key] == value, f"{name}: {key} = {value}, torch's group has {group[key]}"


def test_a_plain_optimizer_and_a_weight_decay_schedule():
    opt = fdp.optim.adamw(lr=0.1, weight_decay=lambda t: 0.01 * (t + 1), mask=lambda path, p: p.dim() >= 2)
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    state = opt.init(params)
    for _ in range(4):
        params, state = opt.update({"w": torch.ones(2, 2), "b": torch.ones(2)}, state, params)
    info = fdp.optim.hyperparams(opt, state)
    assert (info["step"], info["lr"], info["weight_decay"]) == (4, 0.1, 0.01 * 4)


def test_the_fused_steps_state_reports_the_same_as_the_plain_path():
    params = {"w": torch.randn(4, 3), "b": torch.zeros(3)}
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def loss_fn(p, x, y):
        return F.cross_entropy(x @ p["w"] + p["b"], y)

    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(lambda t: BASE * multiplier(t)))
    step = fdp.Reducer(params).grad_and_update(loss_fn, opt)
    fused_state = step.init(params)
    plain_state, plain = opt.init(params), params
    for _ in range(3):
        params, fused_state, _ = step(params, fused_state, x, y)
        plain, plain_state = opt.update(torch.func.grad(loss_fn)(plain, x, y), plain_state, plain)
    assert isinstance(fused_state, fdp.FusedState)
    assert fdp.optim.hyperparams(opt, fused_state) == fdp.optim.hyperparams(opt, plain_state)
    assert fdp.optim.hyperparams(opt, fused_state)["lr"] == BASE * multiplier(2)


def test_a_fresh_state_a_partition_and_a_foreign_object_are_refused_with_a_reason():
    opt = fdp.optim.sgd(0.1)
    with pytest.raises(ValueError, match="no update has been applied yet; next_update=True"):
        fdp.optim.hyperparams(opt, opt.init({"w": torch.ones(1)}))
    part = fdp.optim.partition(lambda path, p: "a", {"a": opt})
    with pytest.raises(TypeError, match=r"ask per label"):
        fdp.optim.hyperparams(part, part.init({"w": torch.ones(1)}))
    with pytest.raises(TypeError, match="no step count"):
        fdp.optim.hyperparams(opt, {"w": torch.ones(1)})
