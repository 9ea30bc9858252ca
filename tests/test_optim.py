"""fdp.optim: sgd and adamw give torch.optim's numbers bit for bit, purely or in place."""

import importlib

import pytest
import torch
from lines import fdp_lines

import fdp
import fdp._tree
from fdp.optim import AdamWState, SGDState

STEPS = 20

SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.1, momentum=0.9),
    "dampening": dict(lr=0.1, momentum=0.9, dampening=0.3),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "weight_decay": dict(lr=0.1, momentum=0.5, weight_decay=0.1),
    "maximize": dict(lr=0.1, momentum=0.9, maximize=True),
}
ADAMW_CASES = {
    "default": dict(lr=1e-2),
    "weight_decay": dict(lr=1e-2, weight_decay=0.3, betas=(0.8, 0.99), eps=1e-6),
    "amsgrad": dict(lr=1e-2, amsgrad=True),
    "maximize": dict(lr=1e-2, maximize=True),
}
CASES = [("sgd", name, kw) for name, kw in SGD_CASES.items()] + [
    ("adamw", name, kw) for name, kw in ADAMW_CASES.items()
]
FACTORY = {"sgd": (fdp.optim.sgd, torch.optim.SGD), "adamw": (fdp.optim.adamw, torch.optim.AdamW)}


def make_params():
    # Mixed shapes (0-d included) and a float64 leaf: torch.optim groups by dtype.
    g = torch.Generator().manual_seed(0)
    return {
        "fc1.weight": torch.randn(6, 4, generator=g),
        "fc1.bias": torch.randn(6, generator=g),
        "scale": torch.randn((), generator=g),
        "fc2.weight": torch.randn(3, 6, generator=g, dtype=torch.float64),
    }


def grads_for(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}


def run_torch(cls, kw, steps=STEPS, schedule=None):
    """Reference: torch.optim on leaf tensors; params after every step."""
    params = {k: v.clone().requires_grad_() for k, v in make_params().items()}
    opt = cls(list(params.values()), **kw)
    history = []
    for t in range(steps):
        for k, p in params.items():
            p.grad = grads_for(params, t)[k]
        if schedule is not None:
            opt.param_groups[0]["lr"] = schedule(t)
        opt.step()
        history.append({k: p.detach().clone() for k, p in params.items()})
    return history, opt, params


def run_fdp(make, kw, steps=STEPS, schedule=None, donate=False):
    if schedule is not None:
        kw = {**kw, "lr": schedule}
    opt = make(**kw, donate=donate)
    params = make_params()
    state = opt.init(params)
    history = []
    for t in range(steps):
        params, state = opt.update(grads_for(params, t), state, params)
        history.append({k: v.clone() for k, v in params.items()})
    return history, state


def assert_history_equal(got, want, what):
    for t, (g, w) in enumerate(zip(got, want)):
        for k in w:
            assert torch.equal(g[k], w[k]), (
                f"{what}: params[{k!r}] differs from torch.optim after step {t + 1}: "
                f"max |diff| {(g[k] - w[k]).abs().max().item():.3g}"
            )


def torch_state(opt, params, key):
    return {k: opt.state[p][key] for k, p in params.items()}


@pytest.fixture(params=["default", "foreach"])
def dispatch(request, monkeypatch):
    """``default``: the dispatch torch.optim picks (single-tensor on CPU). ``foreach``: force
    the multi-tensor kernels (what CUDA gets by default) for both torch.optim and fdp."""
    if request.param == "foreach":
        def forced(params, differentiable=False, use_fused=False):
            return False, True

        for mod in ("torch.optim.sgd", "torch.optim.adam", "torch.optim.adamw"):
            module = importlib.import_module(mod)
            if hasattr(module, "_default_to_fused_or_foreach"):
                monkeypatch.setattr(module, "_default_to_fused_or_foreach", forced)
    return request.param


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("opt_name,case,kw", CASES, ids=[f"{o}-{c}" for o, c, _ in CASES])
def test_matches_torch_optim_bitwise_over_20_steps(opt_name, case, kw, donate, dispatch):
    make, cls = FACTORY[opt_name]
    want, topt, tparams = run_torch(cls, kw)
    got, state = run_fdp(make, kw, donate=donate)
    assert_history_equal(got, want, f"{opt_name}({case}, {dispatch}, donate={donate})")
    assert int(state.step) == STEPS
    fields = {"sgd": {"momentum_buffer": "momentum_buffer"},
              "adamw": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                        "max_exp_avg_sq": "max_exp_avg_sq"}}[opt_name]
    for field, key in fields.items():
        ours = getattr(state, field)
        if ours is None:
            assert key not in topt.state[tparams["scale"]], f"state.{field} is None"
            continue
        for k, ref in torch_state(topt, tparams, key).items():
            assert torch.equal(ours[k], ref), f"state.{field}[{k!r}] differs from torch.optim"


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_lr_schedule_is_called_with_updates_applied_and_matches_torch(opt_name):
    make, cls = FACTORY[opt_name]
    kw = {"sgd": dict(lr=0.1, momentum=0.9), "adamw": dict(lr=1e-2)}[opt_name]
    calls = []

    def schedule(step):
        calls.append(step)
        return 0.05 * 0.8**step

    want, _, _ = run_torch(cls, kw, schedule=lambda t: 0.05 * 0.8**t)
    got, _ = run_fdp(make, kw, schedule=schedule)
    assert calls == list(range(STEPS)), f"schedule called with {calls}"
    assert_history_equal(got, want, f"{opt_name} with a schedule")


def snapshot(tree):
    return fdp._tree.tree_map(lambda t: t.clone(), tree)


def assert_tree_equal(a, b, what):
    paths, leaves_a, _ = fdp._tree.flatten_with_paths(a)
    leaves_b = fdp._tree.leaves(b)
    assert len(leaves_a) == len(leaves_b), what
    for path, x, y in zip(paths, leaves_a, leaves_b):
        assert torch.equal(x, y), f"{what}: leaf {path} changed"


@pytest.mark.parametrize("opt_name,case,kw", CASES, ids=[f"{o}-{c}" for o, c, _ in CASES])
def test_pure_update_leaves_params_grads_and_state_unchanged(opt_name, case, kw, dispatch):
    opt = FACTORY[opt_name][0](**kw)
    params = make_params()
    state = opt.init(params)
    for t in range(3):  # past SGD's first step, whose momentum buffer is made fresh
        grads = grads_for(params, t)
        before = snapshot((params, grads, state))
        new_params, new_state = opt.update(grads, state, params)
        assert_tree_equal((params, grads, state), before, f"inputs of update {t + 1}")
        for k in params:
            assert new_params[k].data_ptr() != params[k].data_ptr(), f"params[{k!r}] aliased"
        params, state = new_params, new_state


@pytest.mark.parametrize("opt_name,case,kw", CASES, ids=[f"{o}-{c}" for o, c, _ in CASES])
def test_donate_updates_in_place_with_the_same_numbers(opt_name, case, kw):
    make = FACTORY[opt_name][0]
    want, want_state = run_fdp(make, kw, steps=3)
    opt = make(**kw, donate=True)
    params = make_params()
    state = opt.init(params)
    ptrs = [t.data_ptr() for t in fdp._tree.leaves((params, state))]
    for t in range(3):
        grads = grads_for(params, t)
        grads_before = snapshot(grads)
        out_params, out_state = opt.update(grads, state, params)
        assert out_params is params and out_state is state, "donate must return its inputs"
        assert_tree_equal(grads, grads_before, "grads (never donated)")
    got_ptrs = [t.data_ptr() for t in fdp._tree.leaves((params, state))]
    paths = fdp._tree.paths(fdp._tree.structure((params, state)))
    for path, a, b in zip(paths, ptrs, got_ptrs):
        assert a == b, f"leaf {path} was reallocated instead of updated in place"
    assert_tree_equal(params, want[-1], "donated params vs pure params")
    assert_tree_equal(state, want_state, "donated state vs pure state")


def test_state_is_a_readable_namedtuple():
    params = make_params()
    s = fdp.optim.sgd(0.1, momentum=0.9).init(params)
    assert isinstance(s, SGDState) and int(s.step) == 0
    assert s.momentum_buffer.keys() == params.keys()
    assert fdp.optim.sgd(0.1).init(params).momentum_buffer is None
    a = fdp.optim.adamw(1e-3).init(params)
    assert isinstance(a, AdamWState) and a.max_exp_avg_sq is None
    assert a.exp_avg["fc2.weight"].dtype == torch.float64
    assert fdp.optim.adamw(1e-3, amsgrad=True).init(params).max_exp_avg_sq.keys() == params.keys()


def test_adamw_defaults_are_torchs():
    import inspect

    sig = inspect.signature(fdp.optim.adamw).parameters
    ref = inspect.signature(torch.optim.AdamW).parameters
    for name in ("betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert sig[name].default == ref[name].default, f"default of {name}"


def test_nested_pytrees_work():
    opt = fdp.optim.adamw(1e-2)
    params = {"enc": [torch.ones(2), torch.ones(3)], "dec": (torch.ones(1),)}
    grads = fdp._tree.tree_map(torch.ones_like, params)
    new, state = opt.update(grads, opt.init(params), params)
    assert fdp._tree.structure(new) == fdp._tree.structure(params)
    assert all(bool((t < 1).all()) for t in fdp._tree.leaves(new))


def fdp_lines_in_one_update(make, kw, n_leaves, donate):
    """Python lines executed inside the fdp package during one update (torch's not counted)."""
    params = {f"layer{i}.weight": torch.randn(2) for i in range(n_leaves)}
    grads = {k: torch.ones(2) for k in params}
    opt = make(**kw, donate=donate)
    params, state = opt.update(grads, opt.init(params), params)  # past the first step
    return fdp_lines(lambda: opt.update(grads, state, params))


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("make,kw", [
    (fdp.optim.sgd, dict(lr=0.1, momentum=0.9)),
    (fdp.optim.adamw, dict(lr=1e-2, amsgrad=True)),
], ids=["sgd", "adamw"])
def test_update_runs_no_python_per_leaf(make, kw, donate):
    # The hot path adds no Python per leaf to what torch.optim's kernel runs: the same number
    # of fdp lines for 10 leaves as for 1,000.
    small = fdp_lines_in_one_update(make, kw, 10, donate)
    large = fdp_lines_in_one_update(make, kw, 1000, donate)
    assert small == large, f"fdp ran {small} Python lines for 10 leaves but {large} for 1,000"


# ------------------------------------------------------------------------- bad input


@pytest.fixture
def setup():
    opt = fdp.optim.adamw(1e-2, amsgrad=True)
    params = make_params()
    return opt, params, grads_for(params, 0), opt.init(params)


def test_grads_missing_a_leaf_is_named(setup):
    opt, params, grads, state = setup
    del grads["fc1.bias"]
    with pytest.raises(ValueError, match=r"grads does not have the structure.*fc1\.bias"):
        opt.update(grads, state, params)


def test_grads_in_another_order_are_refused(setup):
    opt, params, grads, state = setup
    grads = dict(reversed(grads.items()))
    with pytest.raises(ValueError, match=r"expected path \['fc1\.weight'\], found \['fc2\.weight'\]"):
        opt.update(grads, state, params)


def test_grad_of_wrong_shape_names_the_leaf(setup):
    opt, params, grads, state = setup
    grads["fc1.bias"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"grads\['fc1\.bias'\] has shape \(1,\).*params\['fc1\.bias'\] has shape \(6,\)"):
        opt.update(grads, state, params)


def test_grad_of_wrong_dtype_names_the_leaf(setup):
    opt, params, grads, state = setup
    grads["fc1.weight"] = grads["fc1.weight"].double()
    with pytest.raises(ValueError, match=r"grads\['fc1\.weight'\].*dtype torch\.float64"):
        opt.update(grads, state, params)


def test_grad_that_is_not_a_tensor_names_the_leaf(setup):
    opt, params, grads, state = setup
    grads["scale"] = 0.5
    with pytest.raises(TypeError, match=r"grads\['scale'\] is a float"):
        opt.update(grads, state, params)


def test_state_of_another_model_names_the_leaf(setup):
    opt, params, grads, state = setup
    other = {**params, "fc1.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"state\.exp_avg\['fc1\.weight'\] has shape \(2, 2\)"):
        opt.update(grads, opt.init(other), params)


def test_state_of_another_optimizer_is_refused(setup):
    opt, params, grads, _ = setup
    with pytest.raises(TypeError, match="AdamWState"):
        opt.update(grads, fdp.optim.sgd(0.1).init(params), params)
    with pytest.raises(ValueError, match="max_exp_avg_sq is None"):
        opt.update(grads, fdp.optim.adamw(1e-2).init(params), params)
    sgd = fdp.optim.sgd(0.1, momentum=0.9)
    with pytest.raises(ValueError, match="momentum_buffer is None"):
        sgd.update(grads, fdp.optim.sgd(0.1).init(params), params)


def test_integer_or_non_tensor_params_are_refused_at_init():
    with pytest.raises(TypeError, match=r"params\['count'\] has dtype torch\.int64"):
        fdp.optim.sgd(0.1).init({"w": torch.zeros(2), "count": torch.zeros((), dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"params\['w'\] is a str"):
        fdp.optim.adamw(0.1).init({"v": torch.zeros(1), "w": "x"})


@pytest.mark.parametrize("make,kw,match", [
    (fdp.optim.sgd, dict(lr=-1.0), "learning rate"),
    (fdp.optim.sgd, dict(lr=0.1, momentum=-0.1), "momentum"),
    (fdp.optim.sgd, dict(lr=0.1, nesterov=True), "nesterov"),
    (fdp.optim.sgd, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
    (fdp.optim.adamw, dict(lr=0.1, betas=(1.0, 0.999)), r"betas\[0\]"),
    (fdp.optim.adamw, dict(lr=0.1, eps=-1.0), "eps"),
    (fdp.optim.adamw, dict(lr=0.1, weight_decay=-1.0), "weight_decay"),
])
def test_invalid_hyperparameters_are_refused_like_torch(make, kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)
