"""torch.optim state dicts to and from fdp states (``fdp.optim.state_from_torch`` /
``state_to_torch``): a DDP + torch.optim run resumed in fdp, and an fdp run resumed in DDP +
torch.optim, continue bit for bit, on 2 gloo ranks.

Forward: N steps of DDP + torch.optim, convert the optimizer's state dict, M steps of fdp;
compared with N + M steps of DDP. Reverse: N steps of fdp, convert, M steps of DDP;
compared with N + M steps of fdp. For SGD (momentum), Adam, AdamW, Adagrad, RMSprop, two
param groups (``mask=``) with a ``LambdaLR`` schedule (also through the fused step), and a
chain (``clip_grad_norm_`` + AdamW: the ``ChainState`` around the optimizer's state).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import batch, ce_loss, init_
from torch import nn

import fdp

N, M, TOTAL, WD, MAX_NORM, PEAK = 4, 4, 8, 0.1, 0.3, 0.02


def model() -> nn.Module:
    return init_(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4)), seed=3)


def multiplier(t: int) -> float:
    return min(1.0, (t + 1) / 3) * (1 + math.cos(math.pi * t / TOTAL)) / 2


def decays(p: torch.Tensor) -> bool:
    return p.dim() >= 2


@dataclass(frozen=True)
class Case:
    fdp: Any            # () -> fdp optimizer
    torch: Any          # (named params) -> torch.optim optimizer
    schedule: bool = False
    clip: bool = False
    sgd: bool = False   # torch's SGD keeps no count: state_from_torch needs step=
    fused: bool = False  # also resume through the fused step


def two_groups(cls, **kw):
    def make(named):
        return cls([{"params": [p for _, p in named if decays(p)], "weight_decay": WD},
                    {"params": [p for _, p in named if not decays(p)], "weight_decay": 0.0}], **kw)
    return make


def scheduled(t: int) -> float:
    return PEAK * multiplier(t)


CASES = {
    "sgd-momentum": Case(lambda: fdp.optim.sgd(0.05, momentum=0.9, nesterov=True),
                         lambda named: torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9,
                                                       nesterov=True), sgd=True),
    "adam": Case(lambda: fdp.optim.adam(0.01, weight_decay=0.01),
                 lambda named: torch.optim.Adam([p for _, p in named], lr=0.01, weight_decay=0.01)),
    "adagrad": Case(lambda: fdp.optim.adagrad(0.05, lr_decay=0.01, initial_accumulator_value=0.1),
                    lambda named: torch.optim.Adagrad([p for _, p in named], lr=0.05, lr_decay=0.01,
                                                      initial_accumulator_value=0.1)),
    "rmsprop": Case(lambda: fdp.optim.rmsprop(0.01, momentum=0.5, centered=True),
                    lambda named: torch.optim.RMSprop([p for _, p in named], lr=0.01, momentum=0.5,
                                                      centered=True)),
    "adamw-groups-schedule": Case(
        lambda: fdp.optim.adamw(scheduled, weight_decay=WD, mask=lambda path, p: decays(p)),
        two_groups(torch.optim.AdamW, lr=PEAK), schedule=True, fused=True),
    "chain-clip-adamw": Case(
        lambda: fdp.optim.chain(fdp.optim.clip_by_global_norm(MAX_NORM),
                                fdp.optim.adamw(scheduled, weight_decay=WD, mask=lambda path, p: decays(p))),
        two_groups(torch.optim.AdamW, lr=PEAK), schedule=True, clip=True),
}


def torch_steps(group, case: Case, params: dict, start: int, steps: int, opt_sd=None, snapshot_at=None):
    """DDP + torch.optim from ``params`` (and ``opt_sd``) for ``steps`` steps from ``start``;
    returns the final params and, if asked, (params, optimizer state dict) at ``snapshot_at``."""
    net = model()
    with torch.no_grad():
        for k, p in net.named_parameters():
            p.copy_(params[k])
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.002)
    opt = case.torch(list(ddp.module.named_parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier) if case.schedule else None
    if opt_sd is not None:
        opt.load_state_dict(opt_sd)
        if sched is not None:
            sched.last_epoch = start  # a torch scheduler keeps its own count
    snapshot = None
    for s in range(start, start + steps):
        if s == snapshot_at:
            snapshot = (current(ddp), copy.deepcopy(opt.state_dict()))
        x, y = batch(group.rank, s, n=8)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        if case.clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        opt.step()
        if sched is not None:
            sched.step()
    return current(ddp), snapshot


def current(ddp) -> dict:
    return {k: v.detach().clone() for k, v in ddp.module.named_parameters()}


def fdp_steps(group, case: Case, opt, params: dict, state, start: int, steps: int, fused: bool):
    apply, _, buffers = fdp.functionalize(model())
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.002)
    if fused:
        step = reducer.grad_and_update(ce_loss(apply), opt, has_aux=True)
        opt_state = step.state_from_tree(state, params)
        for s in range(start, start + steps):
            params, opt_state, _ = step(params, opt_state, buffers, *batch(group.rank, s, n=8))
        return params, step.state_to_tree(opt_state, params)
    grad_fn = reducer.grad(ce_loss(apply), has_aux=True)
    for s in range(start, start + steps):
        grads, _ = grad_fn(params, buffers, *batch(group.rank, s, n=8))
        params, state = opt.update(grads, state, params)
    return params, state


def both_directions(group, name: str, fused: bool) -> dict:
    case = CASES[name]
    _, start, _ = fdp.functionalize(model())
    # Forward: DDP N steps -> convert -> fdp M steps, against DDP N + M steps.
    ddp_end, (at_n, torch_sd) = torch_steps(group, case, start, 0, N + M, snapshot_at=N)
    opt = case.fdp()
    params = {k: v.clone() for k, v in at_n.items()}
    state = fdp.optim.state_from_torch(opt, torch_sd, params, step=N if case.sgd else None)
    resumed, _ = fdp_steps(group, case, opt, params, state, N, M, fused)
    # Reverse: fdp N steps -> convert -> DDP M steps, against fdp N + M steps.
    opt = case.fdp()
    params, state = fdp_steps(group, case, opt, dict(start), opt.init(start), 0, N, fused)
    sd = fdp.optim.state_to_torch(opt, state, params)
    fdp_end, _ = fdp_steps(group, case, opt, params, state, N, M, fused)
    ddp_resumed, _ = torch_steps(group, case, params, N, M, opt_sd=sd)
    return {"forward": (resumed, ddp_end), "reverse": (ddp_resumed, fdp_end)}


def all_cases(group) -> dict:
    out = {}
    for name, case in CASES.items():
        out[name] = both_directions(group, name, fused=False)
        if case.fused:
            out[f"{name}-fused"] = both_directions(group, name, fused=True)
    return out


@pytest.fixture(scope="module")
def results():
    return fdp.testing.run(all_cases, 2, backend="gloo", timeout=240)


@pytest.mark.parametrize("name", [*CASES, *(f"{n}-fused" for n, c in CASES.items() if c.fused)])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_a_run_resumed_across_torch_optim_and_fdp_continues_bit_for_bit(results, name, direction):
    for rank, res in enumerate(results):
        got, want = res[name][direction]
        assert any(not torch.equal(got[k], model().state_dict()[k]) for k in want), "nothing trained"
        diffs = {k: (got[k] - want[k]).abs().max().item() for k in want}
        for k in want:
            assert torch.equal(got[k], want[k]), (
                f"{name}, {direction}, rank {rank}: params[{k!r}] after {N} + {M} steps differs from "
                f"the uninterrupted run; max abs diff per leaf: {diffs}")


# ----------------------------------------------------------- one process: layout and errors


def trained_torch(cls, named: bool = False, **kw):
    net = model()
    opt = cls(net.named_parameters() if named else net.parameters(), **kw)
    for s in range(2):
        x, y = batch(0, s, n=8)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return net, opt


def test_the_state_holds_torchs_tensors_under_the_leaves_names():
    net, opt = trained_torch(torch.optim.AdamW, lr=0.01)
    _, params, _ = fdp.functionalize(net)
    state = fdp.optim.state_from_torch(fdp.optim.adamw(0.01), opt.state_dict(), params)
    assert isinstance(state, fdp.optim.AdamWState) and int(state.step) == 2
    for k, p in net.named_parameters():
        assert torch.equal(state.exp_avg[k], opt.state[p]["exp_avg"])
        assert torch.equal(state.exp_avg_sq[k], opt.state[p]["exp_avg_sq"])
    back = fdp.optim.state_to_torch(fdp.optim.adamw(0.01), state, params)
    mine = opt.state_dict()
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in mine["param_groups"]]
    assert {k: v for k, v in back["param_groups"][0].items()} == mine["param_groups"][0]
    for i, entry in mine["state"].items():
        assert entry.keys() == back["state"][i].keys()
        assert all(torch.equal(entry[f], back["state"][i][f]) for f in entry)


def test_names_come_from_named_parameters_and_ddp_prefixes_are_ignored():
    try:
        net, opt = trained_torch(torch.optim.Adam, named=True, lr=0.01)
    except (TypeError, AttributeError) as e:  # torch < 2.6: no named parameters in optimizers
        pytest.skip(f"this torch's optimizers take no named parameters: {e}")
    sd = opt.state_dict()
    reordered = {"param_groups": [{**sd["param_groups"][0],
                                   "params": sd["param_groups"][0]["params"][::-1],
                                   "param_names": ["module." + n for n in sd["param_groups"][0]["param_names"][::-1]]}],
                 "state": sd["state"]}
    _, params, _ = fdp.functionalize(net)
    state = fdp.optim.state_from_torch(fdp.optim.adam(0.01), reordered, params)
    for k, p in net.named_parameters():
        assert torch.equal(state.exp_avg[k], opt.state[p]["exp_avg"]), k


def test_mismatches_are_refused_naming_the_leaf_or_group():
    net, opt = trained_torch(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    _, params, _ = fdp.functionalize(net)
    sd = opt.state_dict()
    with pytest.raises(ValueError, match=r"group 0 has weight_decay=0.1, but opt uses weight_decay=0.5"):
        fdp.optim.state_from_torch(fdp.optim.adamw(0.01, weight_decay=0.5), sd, params)
    state = fdp.optim.state_from_torch(fdp.optim.adamw(0.01, weight_decay=0.5), sd, params, strict=False)
    assert int(state.step) == 2
    with pytest.raises(ValueError, match=r"holds \['exp_avg', 'exp_avg_sq'\].*which torch.optim.SGD never keeps: "
                                         r"it is another torch optimizer's state"):
        fdp.optim.state_from_torch(fdp.optim.sgd(0.01, weight_decay=0.1), sd, params, step=2, strict=False)
    with pytest.raises(ValueError, match=r"torch's exp_avg for params\['3.weight'\] \(torch parameter 0.*has shape \(16, 8\), the leaf \(4, 16\)"):
        fdp.optim.state_from_torch(fdp.optim.adamw(0.01, weight_decay=0.1), sd, params,
                                   names=["3.weight", "0.bias", "1.weight", "1.bias", "0.weight", "3.bias"])
    sgd_net, sgd = trained_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="SGD keeps no step count; pass step="):
        fdp.optim.state_from_torch(fdp.optim.sgd(0.1, momentum=0.9), sgd.state_dict(), params)
    with pytest.raises(TypeError, match="convert a partition's states per label"):
        fdp.optim.state_from_torch(fdp.optim.partition(lambda path, p: "a", {"a": fdp.optim.sgd(0.1)}),
                                   sgd.state_dict(), params)


def test_a_torch_state_fdp_does_not_convert_says_so():
    """NAdam (and RAdam, Adamax, Adadelta, Muon) states are not converted: said as such, not as
    a question about hyper-parameters; a NAdam state given with adam names the field that is
    another optimizer's."""
    net, opt = trained_torch(torch.optim.NAdam, lr=0.01)
    _, params, _ = fdp.functionalize(net)
    with pytest.raises(TypeError, match=r"converting a torch.optim.NAdam state is not supported.*convert SGD, Adam, "
                                        r"AdamW, Adagrad, RMSprop states"):
        fdp.optim.state_from_torch(fdp.optim.nadam(lr=0.01), opt.state_dict(), params)
    with pytest.raises(TypeError, match="torch.optim.NAdam state is not supported"):
        fdp.optim.state_to_torch(fdp.optim.nadam(lr=0.01), fdp.optim.nadam(lr=0.01).init(params), params)
    with pytest.raises(ValueError, match=r"\['mu_product'\] .*which torch.optim.Adam never keeps"):
        fdp.optim.state_from_torch(fdp.optim.adam(lr=0.01), opt.state_dict(), params)
