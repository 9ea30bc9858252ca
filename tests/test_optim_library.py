"""fdp.optim as a library: chain, clipping, schedules, masks and partitions, more optimizers.

Every check is against the real torch object: torch.optim classes with param groups,
torch.nn.utils.clip_grad_norm_ / clip_grad_value_, torch.optim.lr_scheduler sequences.
"""

from __future__ import annotations

import math
import types

import hypothesis.strategies as st
import pytest
import torch
from compiling import skip_unless_dynamo_traces_fdp
from hypothesis import given, settings
from lines import fdp_lines
from optim_cases import assert_equal, grads_for

import fdp
import fdp._tree
from fdp.optim import schedules as S

STEPS = 12


def make_params(shapes=((6, 4), (6,), (), (3, 6)), seed=0, f64_last=True):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, shape in enumerate(shapes):
        dtype = torch.float64 if f64_last and i == len(shapes) - 1 else torch.float32
        out[f"layer{i}.{'weight' if len(shape) >= 2 else 'bias'}"] = torch.randn(shape, generator=g, dtype=dtype)
    return out


class TorchLoop:
    """torch.optim on leaf tensors, with param groups given as lists of keys."""

    def __init__(self, cls, params, groups=None, **kw):
        self.params = {k: v.clone().requires_grad_() for k, v in params.items()}
        if groups is None:
            groups = [{"keys": list(params)}]
        self.opt = cls([{**{a: b for a, b in g.items() if a != "keys"},
                         "params": [self.params[k] for k in g["keys"]]} for g in groups], **kw)

    def step(self, grads, clip=None):
        for k, p in self.params.items():
            p.grad = grads[k].clone()
        if clip is not None:
            clip(list(self.params.values()))
        self.opt.step()
        return {k: p.detach().clone() for k, p in self.params.items()}


# ------------------------------------------------------------------ more optimizers

OPTIMIZERS = {
    "adam": (fdp.optim.adam, torch.optim.Adam, [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
                                                 dict(lr=1e-2, maximize=True, betas=(0.8, 0.99))]),
    "adagrad": (fdp.optim.adagrad, torch.optim.Adagrad, [dict(lr=0.1), dict(lr=0.1, lr_decay=0.01, weight_decay=0.1,
                                                                             initial_accumulator_value=0.5)]),
    "rmsprop": (fdp.optim.rmsprop, torch.optim.RMSprop, [dict(lr=1e-2), dict(lr=1e-2, momentum=0.9, centered=True,
                                                                             weight_decay=0.1)]),
    "adamw": (fdp.optim.adamw, torch.optim.AdamW, [dict(lr=1e-2, weight_decay=0.3)]),
    "sgd": (fdp.optim.sgd, torch.optim.SGD, [dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.1)]),
}
CASES = [(name, i, kw) for name, (_, _, kws) in OPTIMIZERS.items() for i, kw in enumerate(kws)]


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("name,i,kw", CASES, ids=[f"{n}-{i}" for n, i, _ in CASES])
def test_each_optimizer_matches_its_torch_class_bitwise(name, i, kw, donate):
    make, cls, _ = OPTIMIZERS[name]
    params = make_params()
    ref = TorchLoop(cls, params, **kw)
    opt = make(**kw, donate=donate)
    state = opt.init(params)
    for t in range(STEPS):
        grads = grads_for(params, t)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"{name}({kw}) step {t + 1}")
    assert int(state.step) == STEPS
    for field in state._fields[1:]:
        ours = getattr(state, field)
        if ours is None:
            continue
        key = {"sum": "sum"}.get(field, field)
        for k, p in ref.params.items():
            assert torch.equal(ours[k], ref.opt.state[p][key]), f"{name}: state.{field}[{k!r}]"


@settings(max_examples=15, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 4), max_size=3).map(tuple), min_size=1, max_size=6),
       name=st.sampled_from(sorted(OPTIMIZERS)), decay_bias=st.booleans())
def test_random_trees_with_a_decay_mask_match_torch_param_groups(shapes, name, decay_bias):
    make, cls, kws = OPTIMIZERS[name]
    kw = {**kws[-1], "weight_decay": 0.2}
    params = make_params(shapes, f64_last=False)
    decays = [k for k, v in params.items() if v.dim() >= 2 or decay_bias]
    rest = [k for k in params if k not in decays]
    groups = [{"keys": decays}] + ([{"keys": rest, "weight_decay": 0.0}] if rest else [])
    ref = TorchLoop(cls, params, groups=[g for g in groups if g["keys"]], **kw)
    opt = make(**kw, mask=lambda path, p: p.dim() >= 2 or decay_bias)
    state = opt.init(params)
    for t in range(4):
        grads = grads_for(params, t)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"{name} with mask, shapes {shapes}, step {t + 1}")


def test_mask_as_a_tree_equals_mask_as_a_callable():
    params = make_params()
    tree_mask = {k: v.dim() >= 2 for k, v in params.items()}
    a, b = fdp.optim.adamw(0.1, mask=tree_mask), fdp.optim.adamw(0.1, mask=lambda path, p: p.dim() >= 2)
    pa, sa = params, a.init(params)
    pb, sb = params, b.init(params)
    for t in range(3):
        pa, sa = a.update(grads_for(params, t), sa, pa)
        pb, sb = b.update(grads_for(params, t), sb, pb)
    assert_equal(pa, pb, "tree mask vs callable mask")


def test_a_mask_of_another_structure_or_not_bools_names_the_leaf():
    params = make_params()
    with pytest.raises(ValueError, match=r"mask does not have the structure.*layer3"):
        fdp.optim.adamw(0.1, mask={k: True for k in list(params)[:3]}).update(
            params, fdp.optim.adamw(0.1).init(params), params)
    opt = fdp.optim.adamw(0.1, mask=lambda path, p: "yes")
    with pytest.raises(TypeError, match=r"mask\['layer0.weight'\] is 'yes'"):
        opt.update(params, opt.init(params), params)


def test_partition_equals_torch_param_groups_with_a_frozen_label():
    params = make_params()
    labels = {"layer0.weight": "fast", "layer1.bias": "slow", "layer2.bias": "frozen", "layer3.weight": "fast"}
    opt = fdp.optim.partition(labels, {"fast": fdp.optim.adamw(1e-2, weight_decay=0.1),
                                       "slow": fdp.optim.adamw(1e-3, weight_decay=0.0),
                                       "frozen": fdp.optim.frozen()})
    ref = TorchLoop(torch.optim.AdamW, params, groups=[
        {"keys": ["layer0.weight", "layer3.weight"], "lr": 1e-2, "weight_decay": 0.1},
        {"keys": ["layer1.bias"], "lr": 1e-3, "weight_decay": 0.0}])
    state = opt.init(params)
    frozen_before = params["layer2.bias"].clone()
    for t in range(STEPS):
        grads = grads_for(params, t)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"partition step {t + 1}")
    assert torch.equal(params["layer2.bias"], frozen_before), "the frozen label changed"
    assert set(state.states) == {"fast", "slow", "frozen"} and int(state.states["fast"].step) == STEPS


def test_partition_names_a_leaf_without_an_optimizer():
    params = make_params()
    opt = fdp.optim.partition(lambda path, p: "a" if p.dim() else "b", {"a": fdp.optim.sgd(0.1)})
    with pytest.raises(ValueError, match=r"params\['layer2.bias'\] has label 'b'"):
        opt.init(params)


# ------------------------------------------------------------------------ clipping


@pytest.mark.parametrize("max_norm,norm_type", [(0.5, 2.0), (100.0, 2.0), (0.3, 1.0), (0.2, math.inf)])
def test_clip_by_global_norm_equals_clip_grad_norm_bitwise(max_norm, norm_type):
    params = make_params()
    grads = grads_for(params, 0, scale=3.0)
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    for k, p in ref.items():
        p.grad = grads[k].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(ref.values()), max_norm, norm_type)
    clip = fdp.optim.clip_by_global_norm(max_norm, norm_type)
    before = {k: v.clone() for k, v in grads.items()}
    clipped, state = clip.update(grads, clip.init(params), params)
    assert torch.equal(state.norm, norm), f"norm {state.norm} vs torch {norm}"
    assert_equal(clipped, {k: p.grad for k, p in ref.items()}, "clipped grads")
    assert_equal(grads, before, "input grads (must not be modified)")


def test_clip_by_global_norm_error_if_nonfinite_like_torch():
    params = make_params()
    grads = grads_for(params, 0)
    grads["layer1.bias"][0] = float("nan")
    ref = [g.clone().requires_grad_() for g in params.values()]
    for p, g in zip(ref, grads.values()):
        p.grad = g.clone()
    with pytest.raises(RuntimeError, match="non-finite") as torch_err:
        torch.nn.utils.clip_grad_norm_(ref, 1.0, error_if_nonfinite=True)
    clip = fdp.optim.clip_by_global_norm(1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite") as ours:
        clip.update(grads, clip.init(params), params)
    assert str(ours.value) == str(torch_err.value)
    quiet = fdp.optim.clip_by_global_norm(1.0)  # without the flag: nan grads, as torch's
    out, _ = quiet.update(grads, quiet.init(params), params)
    assert torch.isnan(out["layer0.weight"]).all()


def test_clip_by_value_equals_clip_grad_value_():
    params = make_params()
    grads = grads_for(params, 0, scale=2.0)
    ref = [g.clone().requires_grad_() for g in params.values()]
    for p, g in zip(ref, grads.values()):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_value_(ref, 0.7)
    out, _ = fdp.optim.clip_by_value(-0.7, 0.7).update(grads, (), params)
    assert_equal(out, dict(zip(params, [p.grad for p in ref])), "clip_by_value")


def test_a_users_own_transform_composes():
    double = fdp.optim.stateless(lambda grads, params: fdp._tree.tree_map(lambda g: 2 * g, grads))
    params = make_params()
    a = fdp.optim.chain(double, fdp.optim.sgd(0.1))
    b = fdp.optim.sgd(0.2)
    pa, _ = a.update(grads_for(params, 0), a.init(params), params)
    pb, _ = b.update(grads_for(params, 0), b.init(params), params)
    assert_equal(pa, pb, "chain(double, sgd(0.1)) vs sgd(0.2)")


def test_chain_refuses_an_optimizer_in_front_or_none_at_the_end():
    with pytest.raises(TypeError, match="last part must be an Optimizer"):
        fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0))
    with pytest.raises(TypeError, match="part 0 must be a GradientTransform"):
        fdp.optim.chain(fdp.optim.sgd(0.1), fdp.optim.sgd(0.1))


def test_clip_then_adamw_with_masks_and_warmup_cosine_equals_torch():
    params = make_params()
    peak, warmup, total = 1e-2, 3, STEPS
    decays = [k for k, v in params.items() if v.dim() >= 2]
    ref = TorchLoop(torch.optim.AdamW, params, lr=peak, groups=[
        {"keys": decays, "weight_decay": 0.1},
        {"keys": [k for k in params if k not in decays], "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(ref.opt, lambda t: t / warmup if t < warmup else
                                              (1 + math.cos(math.pi * (t - warmup) / (total - warmup))) / 2)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(
        S.warmup_cosine(peak, warmup, total), weight_decay=0.1, mask=lambda path, p: p.dim() >= 2))
    state = opt.init(params)
    for t in range(STEPS):
        grads = grads_for(params, t, scale=2.0)
        want = ref.step(grads, clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))
        sched.step()
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"clip + adamw + warm-up cosine, step {t + 1}")


def test_donate_grads_clips_the_callers_grads_in_place_as_clip_grad_norm_does():
    params = make_params()
    ref = TorchLoop(torch.optim.AdamW, params, lr=1e-2)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(lr=1e-2, donate=True),
                          donate_grads=True)
    state = opt.init(params)
    params = {k: v.clone() for k, v in params.items()}
    for t in range(4):
        grads = grads_for(params, t, scale=2.0)
        holders = {k: torch.zeros_like(v, requires_grad=True) for k, v in grads.items()}
        for k, h in holders.items():
            h.grad = grads[k].clone()
        torch.nn.utils.clip_grad_norm_(list(holders.values()), 1.0)
        clipped = {k: h.grad for k, h in holders.items()}  # what torch leaves in .grad
        want = ref.step(grads, clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"step {t + 1}")
        assert_equal(grads, clipped, f"the donated grads hold the clipped values after step {t + 1}")


# ------------------------------------------------------------------------ schedules


def torch_lrs(make_scheduler, n, base=1.0):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


LR = torch.optim.lr_scheduler
SCHEDULES = {
    "LambdaLR": (lambda o: LR.LambdaLR(o, lambda t: 0.9**t), lambda: (lambda t: 0.5 * 0.9**t), 0.5),
    "LinearLR": (lambda o: LR.LinearLR(o, start_factor=0.1, total_iters=7), lambda: S.linear(0.3, 0.1, 1.0, 7), 0.3),
    "CosineAnnealingLR": (lambda o: LR.CosineAnnealingLR(o, T_max=20, eta_min=0.01),
                          lambda: S.cosine(0.4, 20, final=0.01), 0.4),
    "StepLR": (lambda o: LR.StepLR(o, step_size=3, gamma=0.5), lambda: S.step_decay(0.2, 3, 0.5), 0.2),
    "SequentialLR": (lambda o: LR.SequentialLR(o, [LR.LinearLR(o, start_factor=0.25, total_iters=4),
                                                   LR.CosineAnnealingLR(o, T_max=16)], milestones=[4]),
                     lambda: S.warmup_cosine(0.6, 4, 20, start_factor=0.25), 0.6),
    "constant": (lambda o: LR.LambdaLR(o, lambda t: 1.0), lambda: S.constant(0.7), 0.7),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # SequentialLR's warning about step order
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_equals_the_torch_scheduler_sequence(name):
    make_torch, make_ours, base = SCHEDULES[name]
    n = 20
    want = torch_lrs(make_torch, n, base)
    ours = make_ours()
    got = [ours(t) for t in range(n)]
    for t, (g, w) in enumerate(zip(got, want)):
        # LambdaLR, StepLR's powers and the constant are the same expression; torch's
        # chainable LinearLR / CosineAnnealingLR multiply the previous lr by a ratio each
        # step, which rounds differently from the closed form fdp uses (a few ulps).
        assert g == pytest.approx(w, rel=1e-12, abs=1e-15), f"{name}: step {t}: fdp {g}, torch {w}"
    if name in ("LambdaLR", "constant", "StepLR"):
        assert got == want, f"{name} differs from torch bitwise: {got} vs {want}"
    traced = [float(ours(torch.tensor(t, dtype=torch.float64))) for t in range(n)]
    assert traced == pytest.approx(got, rel=1e-12, abs=1e-15), f"{name}: tensor path differs"


def test_schedule_closed_forms_equal_torchs_bitwise():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.4)
    cos = LR.CosineAnnealingLR(opt, T_max=20, eta_min=0.01)
    ours = S.cosine(0.4, 20, final=0.01)
    for t in range(21):
        cos.last_epoch = t
        assert cos._get_closed_form_lr()[0] == ours(t), f"cosine step {t}"
    lin = LR.LinearLR(opt, start_factor=0.1, total_iters=7)
    ours = S.linear(0.4, 0.1, 1.0, 7)
    for t in range(10):
        lin.last_epoch = t
        assert lin._get_closed_form_lr()[0] == ours(t), f"linear step {t}"


def test_join_restarts_the_next_schedule_at_its_boundary():
    sched = S.join([S.constant(1.0), S.linear(2.0, 0.5, 1.0, 2), S.constant(3.0)], [2, 5])
    assert [sched(t) for t in range(7)] == [1.0, 1.0, 1.0, 1.5, 2.0, 3.0, 3.0]
    assert [float(sched(torch.tensor(t))) for t in range(7)] == [1.0, 1.0, 1.0, 1.5, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="boundaries"):
        S.join([S.constant(1.0)], [3])


def test_weight_decay_schedule_equals_setting_the_group_each_step():
    params = make_params()
    ref = TorchLoop(torch.optim.AdamW, params, lr=1e-2)
    opt = fdp.optim.adamw(1e-2, weight_decay=lambda t: 0.1 * (t + 1))
    state = opt.init(params)
    for t in range(5):
        ref.opt.param_groups[0]["weight_decay"] = 0.1 * (t + 1)
        grads = grads_for(params, t)
        want = ref.step(grads)
        params, state = opt.update(grads, state, params)
        assert_equal(params, want, f"weight-decay schedule step {t + 1}")


@pytest.mark.slow  # (a dynamo trace per schedule)
@pytest.mark.compile
@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "adam", "rmsprop", "adagrad"])
def test_schedules_compile_into_one_graph_without_recompiles(opt_name):
    skip_unless_dynamo_traces_fdp()  # (optree's flatten: torch < 2.13 with optree 0.20, docs/compile.md)
    make = {"sgd": lambda lr: fdp.optim.sgd(lr, momentum=0.9), "adamw": fdp.optim.adamw,
            "adam": fdp.optim.adam, "rmsprop": fdp.optim.rmsprop, "adagrad": fdp.optim.adagrad}[opt_name]
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    sched = S.warmup_cosine(0.05, 3, 10)
    compiled_opt, eager_opt = make(sched), make(sched)
    params = {"w": torch.ones(4), "b": torch.ones(2)}
    step = torch.compile(compiled_opt.update, fullgraph=True, backend=backend)
    cp, cs = params, compiled_opt.init(params)
    ep, es = params, eager_opt.init(params)
    for t in range(8):
        grads = {"w": torch.linspace(-1, 1, 4) * (t + 1), "b": torch.full((2,), -0.5)}
        cp, cs = step(grads, cs, cp)
        ep, es = eager_opt.update(grads, es, ep)
    assert len(graphs) == 1, f"{opt_name}: {len(graphs)} graphs for 8 steps (recompiled)"
    assert int(cs.step) == 8
    for k in ep:  # the lr is a float64 tensor in the graph, a Python float eagerly
        torch.testing.assert_close(cp[k], ep[k], rtol=1e-5, atol=1e-6, msg=f"{opt_name}: params[{k!r}]")


# ----------------------------------------------------------- donate, checkpoints


def test_donate_refuses_a_tensor_that_appears_twice_and_names_both_paths():
    shared = torch.ones(3)
    params = {"embed": shared, "other": torch.ones(2), "head": shared}
    opt = fdp.optim.adamw(0.1, donate=True)
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"params\['embed'\] and params\['head'\] are the same memory"):
        opt.update(fdp._tree.tree_map(torch.ones_like, params), state, params)
    assert torch.equal(shared, torch.ones(3)), "the refused update changed the tensor"
    pure = fdp.optim.adamw(0.1)  # the pure path updates each leaf once, into new tensors
    new, _ = pure.update(fdp._tree.tree_map(torch.ones_like, params), pure.init(params), params)
    assert torch.equal(new["embed"], new["head"]) and torch.equal(shared, torch.ones(3))


def test_empty_leaves_are_not_aliases():
    # two empty tensors may share an address (nullptr): donate's alias check must not refuse them
    params = {"a": torch.ones(0), "b": torch.ones(0), "c": torch.ones(2)}
    c = params["c"]
    opt = fdp.optim.sgd(0.1, donate=True)
    new, _ = opt.update(fdp._tree.tree_map(torch.ones_like, params), opt.init(params), params)
    assert [tuple(new[k].shape) for k in "abc"] == [(0,), (0,), (2,)]
    assert torch.equal(new["c"], torch.full((2,), 0.9)), new["c"]
    assert new["c"].data_ptr() == c.data_ptr(), "donate=True updates in place"


def test_chain_state_round_trips_through_save_and_the_step_survives_resume(tmp_path):
    params = make_params()
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.partition(
        lambda path, p: "frozen" if path == "layer1.bias" else "decay" if p.dim() >= 2 else "rest",
        {"decay": fdp.optim.adamw(S.warmup_cosine(1e-2, 2, 10), weight_decay=0.1),
         "rest": fdp.optim.rmsprop(S.step_decay(1e-2, 3), momentum=0.5),
         "frozen": fdp.optim.frozen()}))
    state = opt.init(params)
    straight_p, straight_s = params, state
    for t in range(8):
        straight_p, straight_s = opt.update(grads_for(params, t), straight_s, straight_p)
    p, s = params, state
    for t in range(4):
        p, s = opt.update(grads_for(params, t), s, p)
    fdp.save(tmp_path / "ckpt.pt", {"params": p, "opt": s})
    loaded = fdp.load(tmp_path / "ckpt.pt", like={"params": params, "opt": opt.init(params)})
    p, s = loaded["params"], loaded["opt"]
    assert int(s.optimizer.states["decay"].step) == 4, "the step count did not survive"
    for t in range(4, 8):
        p, s = opt.update(grads_for(params, t), s, p)
    assert_equal(p, straight_p, "resumed vs uninterrupted")
    assert torch.equal(p["layer1.bias"], params["layer1.bias"]), "the frozen leaf moved"


def fdp_lines_in_one_update(opt, n_leaves):
    """Python lines run inside the fdp package during one update past the first."""
    params = {f"layer{i}.{'weight' if i % 2 else 'bias'}": torch.randn(2, 2) if i % 2 else torch.randn(2)
              for i in range(n_leaves)}
    grads = fdp._tree.tree_map(torch.ones_like, params)
    params, state = opt.update(grads, opt.init(params), params)
    return fdp_lines(lambda: opt.update(grads, state, params))


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_chain_with_a_mask_runs_no_python_per_leaf(donate):
    def make():
        return fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(
            S.warmup_cosine(1e-2, 2, 10), mask=lambda path, p: p.dim() >= 2, donate=donate))
    small, large = fdp_lines_in_one_update(make(), 10), fdp_lines_in_one_update(make(), 1000)
    assert small == large, f"fdp ran {small} Python lines for 10 leaves but {large} for 1,000"


def test_chain_never_modifies_the_callers_grads_and_reuses_its_scratch_safely():
    params = make_params()
    kept = []

    def keeping_update(grads, state, params):  # an optimizer that keeps the grads it saw
        kept.append(grads)
        return params, state

    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.1), fdp.optim.clip_by_value(-0.01, 0.01),
                          fdp.optim.Optimizer(lambda p: (), keeping_update))
    state = opt.init(params)
    seen = []
    for t in range(3):
        grads = grads_for(params, t)
        before = {k: v.clone() for k, v in grads.items()}
        opt.update(grads, state, params)
        assert_equal(grads, before, f"the caller's grads after update {t + 1}")
        seen.append({k: v.clone() for k, v in kept[-1].items()})
    for t, (got, want) in enumerate(zip(kept, seen)):  # later steps did not overwrite them
        assert_equal(got, want, f"grads kept from update {t + 1}")
    clip = fdp.optim.clip_by_global_norm(0.1)
    by_hand, _ = clip.update(grads_for(params, 2), clip.init(params), params)
    by_hand, _ = fdp.optim.clip_by_value(-0.01, 0.01).update(by_hand, (), params)
    assert_equal(kept[-1], by_hand, "in-place chain vs the transforms applied one by one")


@pytest.mark.parametrize("name,i,kw", CASES, ids=[f"{n}-{i}" for n, i, _ in CASES])
def test_leaf_kernel_on_flat_per_group_tensors_equals_the_tree_update(name, i, kw):
    # What a fused step does: one flat tensor per hyper-parameter group (f32 leaves only, as
    # a bucket holds one dtype), one kernel call per group per step.
    make = OPTIMIZERS[name][0]
    opt = make(**kw, mask=lambda path, p: p.dim() >= 2)
    params = make_params(f64_last=False)
    lk = opt.form.leaf_kernel
    groups = lk.groups(params)
    keys = list(params)
    members = {grp: [k for k, g in zip(keys, groups) if g == grp] for grp in set(groups)}
    assert set(members) == {0, 1}

    def flat(tree, ks):
        return torch.cat([tree[k].reshape(-1) for k in ks])

    flats = {grp: flat(params, ks) for grp, ks in members.items()}
    states = {grp: [torch.full_like(f, lk.init_value) for _ in lk.fields] for grp, f in flats.items()}
    count = torch.zeros(())
    state = opt.init(params)
    for t in range(6):
        grads = grads_for(params, t)
        for grp, ks in members.items():
            lk.step(grp, [flats[grp]], [flat(grads, ks)], [[s] for s in states[grp]], count)
        count += 1
        params, state = opt.update(grads, state, params)
        for grp, ks in members.items():
            assert torch.equal(flats[grp], flat(params, ks)), f"{name}: group {grp} ({ks}) step {t + 1}"
            for field, s in zip(lk.fields, states[grp]):
                assert torch.equal(s, flat(getattr(state, field), ks)), f"{name}: state.{field} group {grp}"


def test_only_kernel_optimizers_have_a_leaf_kernel():
    assert fdp.optim.adamw(0.1).form.leaf_kernel.fields == ("exp_avg", "exp_avg_sq")
    assert fdp.optim.sgd(0.1).form.leaf_kernel.fields == ()
    assert fdp.optim.chain(fdp.optim.sgd(0.1)).form.leaf_kernel is None
    assert fdp.optim.frozen().form.leaf_kernel.fields == ()  # a kernel that changes nothing
    assert fdp.optim.adafactor(0.1).form.leaf_kernel is None  # not element-wise


@pytest.mark.slow  # (a dynamo trace)
@pytest.mark.compile
def test_the_full_chain_compiles_into_one_graph_and_matches_eager():
    skip_unless_dynamo_traces_fdp()
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def make():
        return fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(
            S.warmup_cosine(0.05, 3, 10), weight_decay=0.1, mask=lambda path, p: p.dim() >= 2))

    copt, eopt = make(), make()
    params = {"w": torch.ones(4, 2), "b": torch.ones(2)}
    step = torch.compile(copt.update, fullgraph=True, backend=backend)
    cp, cs, ep, es = params, copt.init(params), params, eopt.init(params)
    for t in range(6):
        grads = {"w": torch.linspace(-1, 1, 8).view(4, 2) * (t + 1), "b": torch.full((2,), -0.5)}
        cp, cs = step(grads, cs, cp)
        ep, es = eopt.update(grads, es, ep)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 6 steps"
    for k in ep:
        torch.testing.assert_close(cp[k], ep[k], rtol=1e-5, atol=1e-6, msg=f"params[{k!r}]")
    torch.testing.assert_close(cs.transforms[0].norm, es.transforms[0].norm)


def test_donate_rechecks_trees_that_are_not_the_tensors_it_checked_before():
    # donate=True recognises the params and state it checked last step by identity; any
    # other tensor is checked again, and a bad one is still named.
    params = make_params()
    opt = fdp.optim.adamw(1e-2, donate=True)
    state = opt.init(params)
    for t in range(2):
        params, state = opt.update(grads_for(params, t), state, params)
    other = opt.init({**params, "layer0.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"state\.exp_avg\['layer0\.weight'\] has shape \(2, 2\)"):
        opt.update(grads_for(params, 2), other._replace(step=state.step), params)
    swapped = {**params, "layer1.bias": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"grads\['layer1\.bias'\] has shape \(6,\).*params\['layer1\.bias'\] has shape \(5,\)"):
        opt.update(grads_for(params, 2), state, swapped)
    aliased = {**params, "layer2.bias": params["layer1.bias"]}
    with pytest.raises(ValueError, match="are the same memory"):
        opt.update({**grads_for(params, 2), "layer2.bias": torch.ones(6)}, state, aliased)


def _shared_chain_run(group, opt):
    params = make_params(seed=group.rank)
    state = opt.init(params)
    for t in range(5):
        params, state = opt.update(grads_for(params, t, scale=1.0 + group.rank), state, params)
    return params


def test_one_chain_shared_by_simulated_ranks_on_threads_gives_each_rank_its_own_numbers():
    # The chain's scratch buffers and donate's identity cache are per thread.
    def make():
        return fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), fdp.optim.adamw(1e-2, donate=True))

    shared = make()
    res = fdp.testing.run(_shared_chain_run, 2, args=(shared,))
    for rank in range(2):  # the same rank's work alone, with its own chain
        alone = _shared_chain_run(types.SimpleNamespace(rank=rank), make())
        assert_equal(res[rank], alone, f"rank {rank} with a shared chain")


# The docstring examples of fdp.optim and fdp.optim.schedules run as doctests in
# tests/test_docs.py (test_docstring_examples_run), with every other public name's.


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, 0.5, 0.0, math.inf, -math.inf])
def test_clip_stats_in_pieces_equal_clip_grad_norm_bitwise(norm_type):
    """clip_by_global_norm's stats/scale pair, fed one piece of the leaves at a time (as the
    fused step does, bucket by bucket, then in leaf order), gives torch.nn.utils
    .clip_grad_norm_'s norm and clipped grads bit for bit, for every norm type, also with
    dtypes interleaved (torch stacks the per-tensor norms grouped by dtype) and a zero leaf
    (norm_type=0 counts the leaves that are not all zero)."""
    g = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float64, torch.bfloat16, torch.float32]
    grads = [torch.randn(97 * (i + 1), generator=g).to(d) for i, d in enumerate(dtypes)]
    grads[2].zero_()
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads):
        p.grad = t.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)
    clip = fdp.optim.clip_by_global_norm(0.5, norm_type)
    stats = [n for lo in range(0, len(grads), 2) for n in clip.stats(grads[lo:lo + 2])]
    coef, state = clip.scale(stats, clip.init(grads))
    assert torch.equal(state.norm, want_norm), (state.norm, want_norm)
    for i, (t, p) in enumerate(zip(grads, params)):
        assert torch.equal(t.clone().mul_(coef), p.grad), f"grad {i} ({t.dtype})"
    tree = {f"g{i}": t for i, t in enumerate(grads)}
    clipped, state = clip.update(tree, clip.init(grads), tree)  # the tree form: the same numbers
    assert torch.equal(state.norm, want_norm)
    assert all(torch.equal(clipped[f"g{i}"], p.grad) for i, p in enumerate(params))


@pytest.mark.parametrize("schedule", [
    fdp.optim.schedules.constant(0.1), fdp.optim.schedules.warmup_cosine(0.1, 2, 10),
    fdp.optim.schedules.join([fdp.optim.schedules.constant(0.1), fdp.optim.schedules.cosine(0.1, 5)], [3]),
], ids=repr)
def test_a_schedule_at_a_negative_step_raises_a_value_error_saying_what_the_step_is(schedule):
    with pytest.raises(ValueError, match=r"called with step -1; a schedule's step is the number of updates"):
        schedule(-1)
    assert schedule(0) >= 0.0
