"""Dynamic loss scaling (``fdp.optim.loss_scale``) against ``torch.amp.GradScaler``.

The reference is the real thing: DDP + ``torch.amp.GradScaler`` + ``torch.optim.AdamW``
(with ``unscale_`` and ``clip_grad_norm_`` in the clipping case) on 2 gloo ranks, the
forward under CPU float16 autocast, so the scaled gradients overflow by themselves when the
scale grows; on two steps one rank's batch also holds an inf (only that rank's own
gradients are non-finite, and every rank must skip). fdp runs the same data through the
plain path (``reducer.grad`` + ``opt.update``), the fused step and the sharded fused step,
each straight and resumed from a checkpoint in the middle; every step's params, scale and
growth tracker must equal GradScaler's bit for bit, and the fused steps' records say which
steps were skipped.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from models import batch, init_
from torch import nn

import fdp

STEPS, RESUME_AT = 22, 9
INIT, INTERVAL = 2.0 ** 16, 3
LR, WD, MAX_NORM = 1e-2, 0.1, 0.5
ONE_RANK_INF = {4: 1, 13: 0}  # step -> the only rank whose batch holds an inf


def model(seed: int = 3) -> nn.Module:
    return init_(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)), seed=seed)


def data(rank: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(rank, s, n=16)
    x = x * 30  # large activations: float16 gradients overflow once the scale has grown
    if ONE_RANK_INF.get(s) == rank:
        x[0, 0] = math.inf
    return x, y


def autocast():
    return torch.autocast("cpu", dtype=torch.float16)


def loss_fn(apply):
    def f(params, buffers, x, y, scale):
        with autocast():
            out, buffers = apply(params, buffers, x)
        return F.cross_entropy(out.float(), y) * scale, buffers  # scaler.scale(loss)
    return f


def point(params: dict, scale: torch.Tensor, tracker: torch.Tensor, finite=None) -> dict:
    return {"params": {k: v.detach().clone() for k, v in params.items()}, "scale": scale.clone(),
            "tracker": tracker.clone(), "finite": finite}


def fdp_opt(clip: bool) -> fdp.optim.Optimizer:
    ls = fdp.optim.loss_scale(init_scale=INIT, growth_interval=INTERVAL)
    adamw = fdp.optim.adamw(LR, weight_decay=WD)
    return fdp.optim.chain(ls, fdp.optim.clip_by_global_norm(MAX_NORM), adamw) if clip else fdp.optim.chain(ls, adamw)


# ------------------------------------------------------------------ the reference


def torch_run(group, clip: bool) -> list[dict]:
    ddp = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.002)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=INTERVAL)
    trace = []
    for s in range(STEPS):
        x, y = data(group.rank, s)
        opt.zero_grad()
        with autocast():
            out = ddp(x)
        scaler.scale(F.cross_entropy(out.float(), y)).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        trace.append(point(dict(ddp.module.named_parameters()), scaler._scale, scaler._growth_tracker))
    return trace


# ------------------------------------------------------------------ fdp's three paths


class Plain:
    """``reducer.grad`` + ``opt.update``."""

    def __init__(self, group, clip: bool, shard: bool, skip: bool = False, seed: int = 3) -> None:
        self.group = group
        self.apply, self.params, self.buffers = fdp.functionalize(model(seed))
        self.opt = fdp_opt(clip)
        self.reducer = fdp.Reducer(self.params, group, bucket_cap_mb=0.002)
        self.grad_fn = self.reducer.grad(loss_fn(self.apply), has_aux=True)
        self.state = self.opt.init(self.params)
        self.local_finite: list[bool] = []

    def step(self, s: int) -> dict:
        x, y = data(self.group.rank, s)
        scale = fdp.optim.current_loss_scale(self.state)
        local, _ = torch.func.grad(loss_fn(self.apply), has_aux=True)(self.params, self.buffers, x, y, scale)
        self.local_finite.append(all(bool(torch.isfinite(g).all()) for g in local.values()))
        grads, _ = self.grad_fn(self.params, self.buffers, x, y, scale)
        self.params, self.state = self.opt.update(grads, self.state, self.params)
        ls = self.state.transforms[0]
        return point(self.params, ls.scale, ls.growth_tracker)

    def save(self, path: str) -> None:
        fdp.save(path, {"params": self.params, "opt": self.state}, self.group)

    def load(self, path: str) -> None:
        ckpt = fdp.load(path, like={"params": self.params, "opt": self.opt.init(self.params)}, group=self.group)
        self.params, self.state = ckpt["params"], ckpt["opt"]


class Fused(Plain):
    """``reducer.grad_and_update`` (``shard=True``: the sharded step)."""

    def __init__(self, group, clip: bool, shard: bool, skip: bool = False, seed: int = 3) -> None:
        self.group = group
        self.apply, self.params, self.buffers = fdp.functionalize(model(seed))
        self.opt = fdp_opt(clip)
        self.reducer = fdp.Reducer(self.params, group, bucket_cap_mb=0.002, shard=shard, skip_nonfinite=skip)
        self.fused = self.reducer.grad_and_update(loss_fn(self.apply), self.opt, has_aux=True)
        self.state = self.fused.init(self.params)
        assert self.state.sharded == (shard and group.size > 1)

    def step(self, s: int) -> dict:
        x, y = data(self.group.rank, s)
        scale = fdp.optim.current_loss_scale(self.state)
        self.params, self.state, _ = self.fused(self.params, self.state, self.buffers, x, y, scale)
        ls = self.state.transforms[0]
        return point(self.params, ls.scale, ls.growth_tracker, self.fused.last_step.finite)

    def save(self, path: str) -> None:  # per leaf: the form that loads into any layout
        fdp.save(path, {"params": self.params, "opt": self.fused.state_to_tree(self.state, self.params)}, self.group)

    def load(self, path: str) -> None:
        ckpt = fdp.load(path, like={"params": self.params, "opt": self.opt.init(self.params)}, group=self.group)
        self.params, self.state = ckpt["params"], self.fused.state_from_tree(ckpt["opt"], ckpt["params"])


# name -> (class, shard, skip_nonfinite: the step's own finite check runs before the chain)
PATHS = {"plain": (Plain, False, False), "fused": (Fused, False, False), "sharded": (Fused, True, False),
         "sharded+skip_nonfinite": (Fused, True, True)}


def fdp_runs(group, clip: bool, folder: str) -> dict:
    out = {}
    for name, (cls, shard, skip) in PATHS.items():
        run = cls(group, clip, shard, skip)
        straight = [run.step(s) for s in range(STEPS)]
        out[name] = straight
        if cls is Plain:
            out["local_finite"] = run.local_finite
        else:
            out[f"{name}-nonfinite_steps"] = run.reducer.nonfinite_steps
        # Resumed: RESUME_AT steps, a checkpoint, a new run (other weights) that loads it, the rest.
        first = cls(group, clip, shard, skip)
        for s in range(RESUME_AT):
            first.step(s)
        path = os.path.join(folder, f"{name}-{clip}.pt")
        first.save(path)
        second = cls(group, clip, shard, skip, seed=4)
        second.load(path)
        out[f"{name}-resumed"] = [second.step(s) for s in range(RESUME_AT, STEPS)]
    return out


def both(group, folder: str) -> dict:
    return {clip: {"torch": torch_run(group, clip), **fdp_runs(group, clip, folder)} for clip in (False, True)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("loss_scale"))
    return fdp.testing.run(both, 2, backend="gloo", timeout=280, args=(folder,))


def skipped(trace: list[dict]) -> list[bool]:
    """Which steps GradScaler skipped: those after which the scale backed off."""
    before = [torch.tensor(INIT)] + [p["scale"] for p in trace[:-1]]
    return [bool(p["scale"] < b) for p, b in zip(trace, before)]


def test_the_reference_run_grows_backs_off_and_skips_a_step_only_one_rank_saw(results):
    for clip in (False, True):
        want = results[0][clip]["torch"]
        scales = [float(p["scale"]) for p in want]
        skips = skipped(want)
        assert any(b > a for a, b in zip([INIT] + scales, scales)), f"clip={clip}: the scale never grew: {scales}"
        assert sum(skips) >= 3, f"clip={clip}: too few skipped steps to test backoff: {scales}"
        local = [results[r][clip]["local_finite"] for r in range(2)]
        one_rank = [s for s in range(STEPS) if local[0][s] != local[1][s]]
        assert one_rank, f"clip={clip}: no step had non-finite gradients on one rank only: {local}"
        assert all(skips[s] for s in one_rank), (
            f"clip={clip}: GradScaler under DDP did not skip steps {one_rank}, where one rank's gradients "
            f"were non-finite (skipped: {skips})")


@pytest.mark.parametrize("clip", [False, True], ids=["adamw", "clip-adamw"])
@pytest.mark.parametrize("path", [*PATHS, *(f"{p}-resumed" for p in PATHS)])
def test_params_scale_and_growth_tracker_equal_gradscalers_every_step(results, path, clip):
    for rank, res in enumerate(results):
        want = res[clip]["torch"]
        got = res[clip][path]
        first = RESUME_AT if path.endswith("-resumed") else 0
        skips = skipped(want)
        for s, g, w in zip(range(first, STEPS), got, want[first:], strict=True):
            where = f"{path}, clip={clip}, rank {rank}, step {s} (GradScaler {'skipped' if skips[s] else 'stepped'})"
            assert torch.equal(g["scale"], w["scale"]), f"{where}: scale {g['scale']} != GradScaler's {w['scale']}"
            assert torch.equal(g["tracker"], w["tracker"]), (
                f"{where}: growth tracker {g['tracker']} != GradScaler's {w['tracker']}")
            assert g["scale"].dtype == torch.float32 and g["tracker"].dtype == torch.int32
            for k, p in w["params"].items():
                assert torch.equal(g["params"][k], p), (
                    f"{where}: params[{k!r}] differs, max abs diff {(g['params'][k] - p).abs().max().item()}")
            if g["finite"] is not None:
                assert g["finite"] == (not skips[s]), f"{where}: step.last_step.finite is {g['finite']}"
        if path in PATHS and PATHS[path][0] is Fused:
            assert res[clip][f"{path}-nonfinite_steps"] == sum(skips), (
                f"{path}, clip={clip}, rank {rank}: reducer.nonfinite_steps is {res[clip][f'{path}-nonfinite_steps']}, "
                f"GradScaler skipped {sum(skips)} steps")


# ------------------------------------------------------------------ one process


def test_a_skipped_step_leaves_params_and_optimizer_state_and_later_transforms_unchanged():
    opt = fdp.optim.chain(fdp.optim.loss_scale(init_scale=8.0), fdp.optim.clip_by_global_norm(1.0),
                          fdp.optim.adamw(0.1))
    params = {"w": torch.ones(3), "b": torch.zeros(2)}
    state = opt.init(params)
    params, state = opt.update({"w": torch.full((3,), 8.0), "b": torch.ones(2)}, state, params)
    before_params, before = params, state
    bad = {"w": torch.tensor([1.0, math.nan, 2.0]), "b": torch.ones(2)}
    params, state = opt.update(bad, state, params)
    assert params is before_params and state.optimizer is before.optimizer
    assert state.transforms[1] is before.transforms[1], "clip ran after the loss scale skipped the step"
    assert float(state.transforms[0].scale) == 4.0 and int(state.transforms[0].growth_tracker) == 0
    assert float(before.transforms[0].scale) == 8.0, "the state passed in was changed in place"


def test_growth_stops_where_the_scale_would_overflow_as_gradscaler():
    big = 2.0 ** 127  # x 2 is inf in float32: GradScaler keeps the scale
    opt = fdp.optim.chain(fdp.optim.loss_scale(init_scale=big, growth_interval=1), fdp.optim.sgd(0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=big, growth_interval=1)
    w = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([w], lr=0.1)
    params = {"w": torch.ones(2)}
    state = opt.init(params)
    for _ in range(2):
        sgd.zero_grad()
        scaler.scale((w * 1e-30).sum()).backward()
        grads = {"w": w.grad.clone()}
        scaler.step(sgd)
        scaler.update()
        params, state = opt.update(grads, state, params)
        assert torch.equal(state.transforms[0].scale, scaler._scale)
        assert torch.equal(state.transforms[0].growth_tracker, scaler._growth_tracker)
        assert torch.equal(params["w"], w.detach())


def test_bad_arguments_and_states_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="growth_factor must be > 1.0"):
        fdp.optim.loss_scale(growth_factor=1.0)
    with pytest.raises(ValueError, match=r"backoff_factor must be in \(0, 1\)"):
        fdp.optim.loss_scale(backoff_factor=1.0)
    with pytest.raises(ValueError, match="growth_interval must be an int >= 1"):
        fdp.optim.loss_scale(growth_interval=0)
    with pytest.raises(ValueError, match="init_scale must be a positive finite number"):
        fdp.optim.loss_scale(init_scale=math.inf)
    with pytest.raises(ValueError, match=r"params\['h'\] is float16; GradScaler refuses to unscale float16"):
        fdp.optim.loss_scale().init({"w": torch.ones(2), "h": torch.ones(2, dtype=torch.float16)})
    plain = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.sgd(0.1))
    with pytest.raises(TypeError, match="got no loss_scale state"):
        fdp.optim.current_loss_scale(plain.init({"w": torch.ones(2)}))
    with pytest.raises(TypeError, match="got a SGDState, not a chain's state"):
        fdp.optim.current_loss_scale(fdp.optim.sgd(0.1).init({"w": torch.ones(2)}))
    two = fdp.optim.chain(fdp.optim.loss_scale(), fdp.optim.loss_scale(), fdp.optim.sgd(0.1))
    with pytest.raises(TypeError, match="got 2 loss_scale states"):
        fdp.optim.current_loss_scale(two.init({"w": torch.ones(2)}))


def test_the_fused_steps_own_finite_check_leaves_the_verdict_to_the_loss_scale():
    """``Reducer(skip_nonfinite=True)`` checks the gradients before the chain runs; the loss
    scale must still see a non-finite step, or its scale would never back off (and every
    later step would overflow and be skipped)."""
    apply, params, buffers = fdp.functionalize(model())
    opt = fdp.optim.chain(fdp.optim.loss_scale(init_scale=INIT, growth_interval=INTERVAL),
                          fdp.optim.clip_by_global_norm(MAX_NORM), fdp.optim.adamw(LR))
    reducer = fdp.Reducer(params, skip_nonfinite=True)
    step = reducer.grad_and_update(loss_fn(apply), opt, has_aux=True)
    plain, state = dict(params), opt.init(params)
    opt_state = step.init(params)
    for s in range(6):
        x, y = batch(0, s, n=16)
        if s in (1, 2):
            x[0, 0] = math.inf
        params, opt_state, _ = step(params, opt_state, buffers, x, y, fdp.optim.current_loss_scale(opt_state))
        grads, _ = torch.func.grad(loss_fn(apply), has_aux=True)(plain, buffers, x, y,
                                                                fdp.optim.current_loss_scale(state))
        plain, state = opt.update(grads, state, plain)
        assert step.last_step.finite == (s not in (1, 2)), f"step {s}"
        assert torch.equal(opt_state.transforms[0].scale, state.transforms[0].scale), (
            f"step {s}: the fused step's scale {opt_state.transforms[0].scale} did not follow the loss "
            f"scale's verdict ({state.transforms[0].scale})")
        assert all(torch.equal(params[k], plain[k]) for k in plain), f"step {s}"
        if s == 2:
            assert float(opt_state.transforms[0].scale) == INIT / 4, "two skipped steps, two backoffs"
    assert reducer.nonfinite_steps == 2


def test_accumulated_micro_batches_share_one_scale_and_one_verdict():
    """``step.accumulate`` (DDP's ``no_sync``) with every micro-batch's loss scaled alike: an
    inf in one micro-batch skips the whole step, as GradScaler over a ``no_sync`` loop."""
    apply, params, buffers = fdp.functionalize(model())
    opt = fdp.optim.chain(fdp.optim.loss_scale(init_scale=INIT, growth_interval=2), fdp.optim.adamw(LR))
    reducer = fdp.Reducer(params)
    step = reducer.grad_and_update(loss_fn(apply), opt, has_aux=True)
    opt_state = step.init(params)
    plain, state = dict(params), opt.init(params)
    for s in range(5):
        (x0, y0), (x1, y1) = data(0, 2 * s), data(0, 2 * s + 1)
        if s == 2:
            x0[1, 1] = math.inf
        scale = fdp.optim.current_loss_scale(opt_state)
        step.accumulate(params, buffers, x0, y0, scale)
        params, opt_state, _ = step(params, opt_state, buffers, x1, y1, scale)
        scale = fdp.optim.current_loss_scale(state)
        acc, _ = fdp.local_grad(loss_fn(apply), has_aux=True)(plain, buffers, x0, y0, scale)
        grads, _ = reducer.grad(loss_fn(apply), has_aux=True, accumulate=acc)(plain, buffers, x1, y1, scale)
        count = int(state.optimizer.step)
        plain, state = opt.update(grads, state, plain)
        assert torch.equal(opt_state.transforms[0].scale, state.transforms[0].scale), f"step {s}"
        assert all(torch.equal(params[k], plain[k]) for k in plain), f"step {s}"
        assert step.last_step.finite == (int(state.optimizer.step) > count), f"step {s}"
        if s == 2:
            assert not step.last_step.finite, "an inf in the first micro-batch did not skip the step"


def test_a_step_the_finite_check_rejected_is_still_skipped_quietly_without_a_loss_scale():
    """The rejected step meets the chain's first global scale; one that raises on a
    non-finite norm (``error_if_nonfinite=True``) does not turn the skip into a failure."""
    apply, params, buffers = fdp.functionalize(model())
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0, error_if_nonfinite=True), fdp.optim.sgd(0.1))
    reducer = fdp.Reducer(params, skip_nonfinite=True)
    step = reducer.grad_and_update(loss_fn(apply), opt, has_aux=True)
    opt_state = step.init(params)
    x, y = batch(0, 0, n=16)
    x[0, 0] = math.inf
    before = {k: v.clone() for k, v in params.items()}
    params, opt_state, _ = step(params, opt_state, buffers, x, y, torch.tensor(1.0))
    assert not step.last_step.finite and reducer.nonfinite_steps == 1
    assert all(torch.equal(params[k], before[k]) for k in before)
    assert float(opt_state.transforms[0].norm) == 0.0, "a rejected step's clip norm was kept"
    params, opt_state, _ = step(params, opt_state, buffers, *batch(0, 1, n=16), torch.tensor(1.0))
    assert step.last_step.finite and int(opt_state.step) == 1
