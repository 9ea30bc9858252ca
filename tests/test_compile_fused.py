"""The fused step under torch.compile, in every step kind: one graph with the collectives
inside (fdp/_fused/traced.py), against the same step run eagerly.

Every case runs on 2 (3, or 4 for a 2-D mesh) gloo ranks, each a forked process
(tests/compiling.py), or on 2 thread ranks in a forked process, and compiles with
``aot_eager``: dynamo's trace and AOTAutograd's graph, run with eager kernels, so the numbers
are those of the ops the graph holds. Where the math is the same as the eager step's (SGD,
Muon, clipping, bf16 params, accumulation, a loss scale) they are equal bit for bit; AdamW's
kernel takes torch's tensor-step path under compile (bias corrections as tensors), a few ulps
apart per step, and so does a scheduled lr (a tensor in the graph), so those are compared
within ``RTOL``. With 3 ranks the sharded steps agree bit for bit too: on gloo the traced
reduce-scatter adds the parts in the eager step's order.
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from compiling import import_compilers, on_thread_ranks, skip_unless_dynamo_traces_fdp
from models import Block, BlockNet, init_, tokens

import fdp
import fdp.testing

pytestmark = pytest.mark.compile
# `make test` runs one case of each step kind (clipping through SGD, aot_eager: about 10 s
# each); every other test here is `slow` (dynamo traces, Inductor compiles: seconds to a minute)

# fp32 AdamW under compile against eager, after a few steps of lr 1e-2 on these models.
RTOL, ATOL = 1e-5, 1e-6
KINDS = {"replicated": {}, "sliced": {"shard": True}, "units": {"shard": "params"}}


class CheckpointedNet(BlockNet):
    """``BlockNet`` with each block run under ``torch.utils.checkpoint`` (non-reentrant), at the
    call site, as HF and FSDP2 users write it."""

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = checkpoint.checkpoint(b, x, use_reentrant=False)
        return self.head(self.ln(x))


def _token_loss(apply, buffers):
    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten())
    return loss


def _opt(name):
    return {
        "clip_sgd": lambda: fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), fdp.optim.sgd(lr=0.1, momentum=0.9)),
        "adamw": lambda: fdp.optim.adamw(lr=1e-2),
        "muon_sgd": lambda: fdp.optim.partition(lambda k, v: "m" if v.dim() == 2 else "o", {
            "m": fdp.optim.muon(lr=0.02), "o": fdp.optim.sgd(lr=0.1, momentum=0.9)}),
        "recipe": lambda: fdp.optim.ema(fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), fdp.optim.partition(
            lambda k, v: "m" if v.dim() == 2 else "o", {"m": fdp.optim.muon(lr=0.02),
                                                        "o": fdp.optim.sgd(lr=0.1, momentum=0.9)})), decay=0.9),
        "masked_sgd": lambda: fdp.optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.01, mask=lambda k, v: v.dim() > 1),
        "masked_sgd_schedule": lambda: fdp.optim.sgd(lr=fdp.optim.schedules.cosine(0.1, 20), momentum=0.9,
                                                     weight_decay=0.01, mask=lambda k, v: v.dim() > 1),
    }[name]()


def _block_net(kind, net=BlockNet, **reducer_kw):
    """A tied-embedding block net functionalized, its module moved to the meta device (as a
    user drops the module's copy: the tied head must stay tied in the graph), and the
    Reducer's keywords for ``kind`` (small caps: several buckets). Returns ``(apply, params,
    buffers, kw)``."""
    model = init_(net(vocab=32, d=16, n=2), 3)
    apply, params, buffers = fdp.functionalize(model)
    kw = {**KINDS[kind], **reducer_kw, "bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.002}
    if kind == "units":
        kw["units"] = fdp.units(model, Block)
    model.to("meta")
    return apply, params, buffers, kw


def _run(group, kind, opt, compile_how, steps=4, accumulate=(), net=BlockNet, reducer_kw=None, inductor=False,
         reset=True, options=None):
    """``steps`` steps of the fused step of ``kind`` on a tied-embedding block net (its module
    moved to the meta device), eagerly and
    compiled (``compile_how``: "function" compiles a train step that calls the step,
    "method" uses ``step.compile``), from the same params; ``accumulate``: the steps before
    which micro-batches go through ``step.accumulate`` (eagerly, as they must), how many.
    Returns both runs' (params as whole tensors, optimizer state as a tree, losses) and the
    number of graphs dynamo made. ``options``: ``step.compile``'s (with ``inductor``)."""
    if reset:
        torch._dynamo.reset()
    apply, params, buffers, kw = _block_net(kind, net, **(reducer_kw or {}))
    loss = _token_loss(apply, buffers)
    out, graphs = [], [0]

    def count(gm, example_inputs):
        graphs[0] += 1
        if inductor:
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g.forward)(gm, example_inputs)

    for compiled in (False, True):
        step = fdp.Reducer(params, group, **kw).grad_and_update(loss, _opt(opt))
        state = step.init(params)
        p = step.shard(params) if kind == "units" else params
        run = step
        if compiled and compile_how == "method" and inductor:  # (Inductor with fdp's passes, as users get it)
            from torch._dynamo.utils import counters
            before = counters["stats"]["unique_graphs"]
            run = step.compile(**(options or {}))
        elif compiled and compile_how == "method":
            run = step.compile(backend=count)
        elif compiled:
            run = torch.compile(lambda p, s, x, y, step=step: step(p, s, x, y), fullgraph=True, backend=count)
        losses = []
        for i in range(steps):
            for j in range(dict(accumulate).get(i, 0)):
                (run if run is not step and compile_how == "method" else step).accumulate(
                    p, *tokens(group.rank, 100 * i + j))
            p, state, value = run(p, state, *tokens(group.rank, i))
            losses.append(float(value))
        whole = p.full() if kind == "units" else dict(p)
        out.append((whole, step.state_to_tree(state, p), losses))
        if compiled and compile_how == "method" and inductor:
            graphs[0] = counters["stats"]["unique_graphs"] - before
    return out, graphs[0]


def _assert_same(eager, compiled, exact):
    (pe, se, le), (pc, sc, lc) = eager, compiled
    for k in pe:
        if exact:
            assert torch.equal(pe[k], pc[k]), (k, (pe[k] - pc[k]).abs().max())
        else:
            torch.testing.assert_close(pc[k], pe[k], rtol=RTOL, atol=ATOL)
    for a, b in zip(fdp._tree.leaves(se), fdp._tree.leaves(sc)):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=RTOL, atol=ATOL)
    if exact:
        assert le == lc


def _kind_case(group, kind, opt, reset=True):
    (eager, compiled), graphs = _run(group, kind, opt, "function", reset=reset)
    _assert_same(eager, compiled, exact=opt not in ("adamw", "masked_sgd_schedule"))
    return graphs, compiled[0]


# Clipping and Muon in every kind; AdamW and the schedule (compared within RTOL) in two and one.
CASES = [(k, "clip_sgd") for k in sorted(KINDS)] + [pytest.param(*case, marks=pytest.mark.slow) for case in [
    *((k, "muon_sgd") for k in sorted(KINDS)), ("replicated", "adamw"), ("units", "adamw"),
    ("sliced", "masked_sgd_schedule")]]


@pytest.mark.parametrize("kind,opt", CASES)
def test_a_compiled_train_step_calling_the_fused_step_is_one_graph_with_its_eager_numbers(kind, opt):
    """Clipping (the sharded norm measured whole per leaf, as eager) and a Muon + SGD partition
    (Muon's matrices exchanged with their owners when sharded): bit for bit. AdamW, and a
    masked SGD with an lr schedule (the lr a tensor computed in the graph from the count, which
    torch's kernel applies by another path than a float's): within RTOL. One graph per run
    (no recompile across steps as the schedule moves); replicas identical."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    got = fdp.testing.run(_kind_case, 2, backend="gloo", timeout=300, args=(kind, opt))
    assert [g for g, _ in got] == [1, 1]
    for k in got[0][1]:
        assert torch.equal(got[0][1][k], got[1][1][k]), k


@pytest.mark.parametrize("kind", [pytest.param("replicated", marks=pytest.mark.slow),
                                  pytest.param("sliced", marks=pytest.mark.slow), "units"])
def test_on_two_thread_ranks_a_compiled_step_is_one_graph_per_rank_with_its_eager_numbers(kind):
    """The same as above on fdp.testing's thread ranks (one process, a threaded group): each
    rank compiles its own graph (the functional collectives name that rank's group) and the
    compiled run equals the eager one bit for bit; replicas identical."""
    skip_unless_dynamo_traces_fdp()
    got = on_thread_ranks(_kind_case, 2, args=(kind, "clip_sgd", False))  # (no rank resets dynamo under the other)
    assert [g for g, _ in got] == [1, 1]
    for k in got[0][1]:
        assert torch.equal(got[0][1][k], got[1][1][k]), k


def _accumulate_case(group, kind, how):
    # accumulation of 0, 2, 1 and 3 micro-batches before the steps: two graphs of the step (with
    # and without micro-batches), not one per count; compiled.accumulate adds two (the first
    # micro-batch of a cycle, and the others)
    (eager, compiled), graphs = _run(group, kind, "clip_sgd", how, steps=6, accumulate=((1, 2), (2, 1), (4, 3)))
    _assert_same(eager, compiled, exact=True)
    return graphs


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("how", ["function", "method"])
@pytest.mark.slow
def test_accumulation_then_a_compiled_step_equals_eager_and_counts_do_not_recompile(kind, how):
    """``step.accumulate`` (eager) or ``compiled.accumulate`` (``step.compile()``'s: in a graph
    unsharded and with shard=True; eager for fully sharded params) before the compiled step."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    graphs = 4 if how == "method" and kind != "units" else 2
    assert fdp.testing.run(_accumulate_case, 2, backend="gloo", timeout=300, args=(kind, how)) == [graphs] * 2


def _micro_reduced_case(group, kind, bf16):
    kw = {"reduce_micro_batches": True, **({"param_dtype": torch.bfloat16} if bf16 else {})}
    (eager, compiled), graphs = _run(group, kind, "clip_sgd", "method", steps=6, accumulate=((1, 2), (2, 1), (4, 3)),
                                     reducer_kw=kw)
    _assert_same(eager, compiled, exact=True)
    return graphs


@pytest.mark.parametrize("kind,bf16", [("sliced", False), ("units", True)], ids=["sliced", "units-bf16"])
@pytest.mark.slow
def test_micro_batches_reduced_as_they_go_then_a_compiled_step_equal_eager(kind, bf16):
    """``reduce_micro_batches=True``: the micro-batches reduce-scatter eagerly as they go
    (``compiled.accumulate`` runs ``step.accumulate``), and the compiled step adds its own
    reduced slice to their sum in the graph, in the order the eager step (and FSDP2) adds
    them: bit for bit, two graphs (with and without micro-batches), whatever the count."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    assert fdp.testing.run(_micro_reduced_case, 2, backend="gloo", timeout=300, args=(kind, bf16)) == [2, 2]


def _mesh_case(group, kind, opt):
    """The sharded step of ``kind`` over a 2x2 (replicate, shard) mesh, eagerly and through
    ``step.compile()``; returns whether they agree bit for bit, and the compiled params."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    apply, params, buffers, kw = _block_net(kind)
    out = []
    for compiled in (False, True):
        step = fdp.Reducer(params, mesh, **kw).grad_and_update(_token_loss(apply, buffers), _opt(opt))
        state = step.init(params)
        p = step.shard(params) if kind == "units" else params
        run = step.compile(backend="aot_eager") if compiled else step
        for i in range(4):
            p, state, _ = run(p, state, *tokens(group.rank, i))
        out.append(p.full() if kind == "units" else dict(p))
    return all(torch.equal(out[0][k], out[1][k]) for k in out[0]), out[1]


@pytest.mark.parametrize("kind,opt", [("sliced", "clip_sgd"), ("units", "muon_sgd")])
@pytest.mark.slow  # (4 ranks)
def test_on_a_2x2_mesh_the_compiled_sharded_steps_equal_eager(kind, opt):
    """HSDP: each slice reduce-scattered over the shard group, then summed over the replicas
    (one all-reduce in the graph, gloo's sum as the eager step's), the params gathered over the
    shard group: bit for bit the eager step on 4 ranks; every rank holds the same params."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    got = fdp.testing.run(_mesh_case, 4, backend="gloo", timeout=600, args=(kind, opt))
    assert [same for same, _ in got] == [True] * 4
    for _, params in got[1:]:
        assert all(torch.equal(params[k], got[0][1][k]) for k in params)


def _lost_cycle_case(group, kind):
    """Two micro-batches, then an eager closing step that fails on rank 1 (its forward); then
    the compiled step alone; then the whole cycle again, compiled. Returns what each call did."""
    torch._dynamo.reset()
    apply, params, buffers, kw = _block_net(kind)
    step = fdp.Reducer(params, group, **kw).grad_and_update(_token_loss(apply, buffers), _opt("clip_sgd"))
    state = step.init(params)
    p = step.shard(params) if kind == "units" else params
    compiled = step.compile(backend="aot_eager")
    x, y = tokens(group.rank, 2)
    out = []
    for j in range(2):
        step.accumulate(p, *tokens(group.rank, j))
    try:
        p, state, _ = step(p, state, x.float() if group.rank == 1 else x, y)  # (the embedding refuses floats)
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        out.append(type(e).__name__)
    for cycle in ((), range(2)):
        try:
            for j in cycle:
                compiled.accumulate(p, *tokens(group.rank, j))
            p, state, _ = compiled(p, state, x, y)
            out.append("ok")
        except RuntimeError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("kind", ["replicated", "units"])
@pytest.mark.slow
def test_a_compiled_step_after_a_failed_cycle_refuses_as_the_eager_step_until_the_cycle_is_redone(kind):
    """An eager closing step that failed took the micro-batches with it on every rank: the
    compiled step called alone then refuses on every rank with the eager step's reason (it
    would average a gradient without them), and the cycle redone compiled goes on."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for rank, out in enumerate(fdp.testing.run(_lost_cycle_case, 2, backend="gloo", timeout=300, args=(kind,))):
        assert out[0] in ("RuntimeError", "CollectiveError"), (rank, out)
        assert "Redo the whole cycle" in out[1] and "summed 2 micro-batch(es)" in out[1], (rank, out)
        assert out[2] == "ok", (rank, out)


def _bf16_checkpointed_case(group, kind):
    (eager, compiled), graphs = _run(group, kind, "muon_sgd", "method", net=CheckpointedNet,
                                     reducer_kw={"param_dtype": torch.bfloat16})
    _assert_same(eager, compiled, exact=True)
    return graphs


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.slow
def test_step_compile_runs_activation_checkpointing_and_bf16_params_exactly(kind):
    """``step.compile()`` traces the loss with ``torch.autograd.grad``, so
    ``torch.utils.checkpoint`` inside it compiles (torch.func's transforms refuse its hooks);
    bf16 compute from fp32 masters; the same bits as the eager step with checkpointing."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    assert fdp.testing.run(_bf16_checkpointed_case, 2, backend="gloo", timeout=300, args=(kind,)) == [1, 1]


def _three_ranks_case(group, kind):
    (eager, compiled), _ = _run(group, kind, "clip_sgd", "function")
    _assert_same(eager, compiled, exact=True)
    return compiled[0]


@pytest.mark.parametrize("kind", ["sliced", "units"])
@pytest.mark.slow
def test_on_three_ranks_the_compiled_sharded_steps_agree_with_eager_and_replicas_are_identical(kind):
    """Three ranks: leaves straddle slices on every rank, and a rank may own none of them (its
    exchange receives nothing it uses: the graph must keep it, or the others hang); bit for
    bit the eager step (the traced reduce-scatter adds the parts in its order)."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    got = fdp.testing.run(_three_ranks_case, 3, backend="gloo", timeout=300, args=(kind,))
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k


def _resume_case(group, tmp, kind, inductor=False):
    """Two compiled steps, a sharded checkpoint, two eager steps from it; and the other way;
    against four eager steps (``inductor``: ``step.compile()`` with fdp's passes, else
    ``aot_eager``)."""
    torch._dynamo.reset()
    if inductor:
        import_compilers(inductor=True)
    options = {} if inductor else {"backend": "aot_eager"}
    model = init_(BlockNet(vocab=32, d=16, n=2), 3)
    apply, params, buffers = fdp.functionalize(model)
    kw = {**KINDS[kind], "bucket_cap_mb": 0.004}
    if kind == "units":
        kw["units"] = fdp.units(model, Block)

    def make():
        return fdp.Reducer(params, group, **kw).grad_and_update(_token_loss(apply, buffers), _opt("clip_sgd"))

    def start(step):
        return (step.shard(params) if kind == "units" else params), step.init(params)

    results = []
    for first, second in (("eager", "eager"), ("compiled", "eager"), ("eager", "compiled")):
        step = make()
        p, s = start(step)
        for i in range(2):
            p, s, _ = (step.compile(**options) if first == "compiled" else step)(p, s, *tokens(group.rank, i))
        d = os.path.join(tmp, f"{first}-{second}")
        saved = p.shards() if kind == "units" else p
        fdp.save_sharded(d, {"params": saved, "opt": step.state_to_shards(s, p)}, group=group)
        step = make()
        p0, s0 = start(step)
        got = fdp.load_sharded(d, {"params": p0.shards() if kind == "units" else p0,
                                   "opt": step.state_to_shards(s0, p0)}, group=group)
        p = step.shard(got["params"]) if kind == "units" else got["params"]
        s = step.state_from_shards(got["opt"], p)
        run = step.compile(**options) if second == "compiled" else step
        for i in range(2, 4):
            p, s, _ = run(p, s, *tokens(group.rank, i))
        results.append(p.full() if kind == "units" else dict(p))
    return results


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.slow
def test_a_checkpoint_of_a_compiled_run_resumes_eagerly_and_back(kind, tmp_path):
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    got = fdp.testing.run(_resume_case, 2, backend="gloo", timeout=300, args=(str(tmp_path), kind))
    for straight, compiled_first, compiled_second in got:
        for k in straight:
            assert torch.equal(straight[k], compiled_first[k]) and torch.equal(straight[k], compiled_second[k]), k


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_checkpoint_of_a_fully_sharded_run_under_inductor_resumes_eagerly_and_back(tmp_path):
    """The same round trip with ``step.compile()`` under Inductor and fdp's passes (the
    updates moved up to their reduce-scatters, the units gathered again for the backward):
    the state saved from a compiled run is the one an eager run continues from, and back,
    within float32's rounding of Inductor's fused update."""
    skip_unless_dynamo_traces_fdp()
    import_compilers(inductor=True)
    got = fdp.testing.run(_resume_case, 2, backend="gloo", timeout=900, args=(str(tmp_path), "units", True))
    for straight, compiled_first, compiled_second in got:
        for k in straight:
            torch.testing.assert_close(compiled_first[k], straight[k], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(compiled_second[k], straight[k], rtol=RTOL, atol=ATOL)


def _module_guards_case(group, skip):
    """Two steps, then the first block's LayerNorm given another ``eps``, then a third step:
    eagerly with and without the change, and compiled (``aot_eager``) with dynamo's guards on
    the model's modules kept (the default) or skipped (``skip``)."""
    torch._dynamo.reset()
    model = init_(BlockNet(vocab=32, d=16, n=2), 3)
    apply, params, buffers = fdp.functionalize(model)
    loss = _token_loss(apply, buffers)
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} if skip else {}
    out = {}
    norm = model.blocks[0].ln
    for how in ("eager", "eager-unchanged", "compiled"):
        step = fdp.Reducer(params, group).grad_and_update(loss, _opt("clip_sgd"))
        p, s = params, step.init(params)
        run = step.compile(backend="aot_eager", options=options) if how == "compiled" else step
        for i in range(2):
            p, s, _ = run(p, s, *tokens(group.rank, i))
        if how != "eager-unchanged":
            norm.eps = 0.5
        p, s, _ = run(p, s, *tokens(group.rank, 2))
        norm.eps = 1e-5
        out[how] = dict(p)

    def same(a, b):
        return all(torch.equal(out[a][k], out[b][k]) for k in out[a])
    return same("compiled", "eager"), same("compiled", "eager-unchanged")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"),
                    reason="torch.compiler.skip_guard_on_all_nn_modules_unsafe is new in torch 2.9")
def test_the_modules_guards_see_a_change_to_the_model_and_skipping_them_is_the_users_call():
    """``step.compile(options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})``
    reaches dynamo (docs/compile.md, "Each call's cost"): the same numbers as the eager step, and
    fewer checks a call; the cost, shown: an attribute of the model changed after the first call
    (a LayerNorm's ``eps``) is seen by the default compiled step (it compiles anew, and equals
    the eager step) and not by the one without the modules' guards (it runs the graph traced
    before the change). (A forward hook added later is seen by neither: dynamo does not guard
    on hooks by default, ``torch._dynamo.config.skip_nnmodule_hook_guards``.)"""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    kept = fdp.testing.run(_module_guards_case, 2, backend="gloo", timeout=300, args=(False,))
    skipped = fdp.testing.run(_module_guards_case, 2, backend="gloo", timeout=300, args=(True,))
    assert kept == [(True, False), (True, False)]
    assert skipped == [(False, True), (False, True)]


def _scaled(loss):
    """The test's own code, reached by the loss through this module's globals (rebound below)."""
    return loss


def _library_guards_case(group, guard_libraries):
    """Three steps: eagerly, and compiled (``aot_eager``, ``guard_libraries`` as given). Before
    the second, the user's code changes (this module's ``_scaled`` rebound: the loss times 3);
    before the third, library code too: fdp's traced fill (``fdp/_fused/traced.py``'s
    ``traced_fill``, which the eager step does not run) rebound to one that doubles the
    gradients, which an eager run stands for with the loss times 6 (exactly twice the
    gradients: a power of two). "user-code-only": eager without the library's change."""
    global _scaled
    torch._dynamo.reset()
    model = init_(BlockNet(vocab=32, d=16, n=2), 3)
    apply, params, buffers = fdp.functionalize(model)

    def loss(p, x, y):
        return _scaled(F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()))

    library = sys.modules["fdp._fused.traced"]
    fill, scaled = library.traced_fill, _scaled
    out = {}
    for how in ("eager", "user-code-only", "compiled"):
        step = fdp.Reducer(params, group).grad_and_update(loss, fdp.optim.sgd(lr=0.1))
        p, s = params, step.init(params)
        run = step.compile(backend="aot_eager", guard_libraries=guard_libraries) if how == "compiled" else step
        try:
            p, s, _ = run(p, s, *tokens(group.rank, 0))
            _scaled = lambda v: 3 * v  # noqa: E731 - the user's code, changed
            p, s, _ = run(p, s, *tokens(group.rank, 1))
            if how == "compiled":  # the library's code, changed
                library.traced_fill = lambda *args: 2 * fill(*args)
            elif how == "eager":
                _scaled = lambda v: 6 * v  # noqa: E731
            p, s, _ = run(p, s, *tokens(group.rank, 2))
        finally:
            library.traced_fill, _scaled = fill, scaled
        out[how] = dict(p)

    def same(a, b):
        return all(torch.equal(out[a][k], out[b][k]) for k in out[a])
    return same("compiled", "eager"), same("compiled", "user-code-only")


@pytest.mark.slow
def test_the_compiled_step_checks_the_users_code_every_call_and_the_librarys_code_once():
    """``step.compile()`` drops dynamo's guards on which objects the functions and modules of
    torch, optree and fdp are (docs/compile.md, "Each call's cost"), and keeps every other: a
    function of the user's module rebound after the first call is seen (the step compiles
    anew and equals the eager step), one of fdp's is not (the graph traced before it runs on);
    ``guard_libraries=True`` keeps those guards too (dynamo's default) and sees both. (An
    object the user's code reaches too, such as ``torch.nn.functional``, is guarded where the
    user's code reaches it: dynamo guards each object once, through the first way it found.)"""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    dropped = fdp.testing.run(_library_guards_case, 2, backend="gloo", timeout=300, args=(False,))
    kept = fdp.testing.run(_library_guards_case, 2, backend="gloo", timeout=300, args=(True,))
    assert dropped == [(False, True), (False, True)]
    assert kept == [(True, False), (True, False)]


def _mode_case(group):
    import_compilers(inductor=True)
    (eager, compiled), _ = _run(group, "replicated", "clip_sgd", "method", steps=2, accumulate=((1, 1),),
                                inductor=True, options={"mode": "default"})
    _assert_same(eager, compiled, exact=False)
    return True


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_step_compile_takes_a_mode_with_fdps_options():
    """``step.compile(mode=...)``: torch.compile takes a mode or options, not both; fdp passes
    its pass and guard filter as options, with the mode's own options."""
    skip_unless_dynamo_traces_fdp()
    import_compilers(inductor=True)
    assert fdp.testing.run(_mode_case, 2, backend="gloo", timeout=900) == [True, True]


# What fdp's own bookkeeping would guard on, per number, if the traced step read it as dynamo
# does by default: a plan's shapes and buckets, an engine's update orders, an Apply's shapes
# and ties, a state layout's sizes (fdp/_internals.py, ``trace_constant``).
BOOKKEEPING = ("._shapes", "._dtypes", ".plan.buckets", ".plan.slots", ".orders", "._param_shapes",
               "._buffer_shapes", "._home.first", ".mine.sizes")


def _guards_and_errors_case(group, kind):
    """Two compiled steps (``aot_eager``, a micro-batch accumulated before the second) of the
    block net in ``kind``; every guard's source dynamo made for them; then the errors of the
    compiled step given params with one leaf of another shape, params without a leaf, the
    state of another optimizer and that of a step with other buckets."""
    torch._dynamo.reset()
    apply, params, buffers, kw = _block_net(kind)
    names = []

    def seen(entries):
        names.extend(e.name for e in entries)
        return [True] * len(entries)

    step = fdp.Reducer(params, group, **kw).grad_and_update(_token_loss(apply, buffers), _opt("clip_sgd"))
    state = step.init(params)
    p = step.shard(params) if kind == "units" else params
    compiled = step.compile(backend="aot_eager", options={"guard_filter_fn": seen})
    p, state, _ = compiled(p, state, *tokens(group.rank, 0))
    compiled.accumulate(p, *tokens(group.rank, 1))
    p, state, _ = compiled(p, state, *tokens(group.rank, 2))
    counted = list(names)  # (the calls below compile graphs that raise fdp's errors: their guards are not counted)
    errors = []
    if kind != "units":  # (fully sharded params are step.shard's, never the user's tree)
        wrong = {**p, "ln.bias": torch.zeros(7)}
        fewer = {k: v for k, v in p.items() if k != "ln.bias"}
        for bad in (wrong, fewer):
            try:
                compiled(bad, state, *tokens(group.rank, 3))
            except Exception as e:  # noqa: BLE001 - the message is what is checked
                errors.append(str(e))
    others = [{"opt": "adamw"}] + ([{"bucket_cap_mb": 25, "first_bucket_cap_mb": 1}] if kind != "units" else [])
    for other in others:  # (a state of another optimizer; of other buckets: units make the buckets)
        opt = _opt(other.pop("opt", "clip_sgd"))
        made = fdp.Reducer(params, group, **{**kw, **other}).grad_and_update(_token_loss(apply, buffers), opt)
        try:
            compiled(p, made.init(params), *tokens(group.rank, 3))
        except Exception as e:  # noqa: BLE001
            errors.append(str(e))
    return counted, errors


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.slow
def test_the_compiled_step_checks_fdps_bookkeeping_once_at_trace_time_not_before_every_call(kind):
    """The compiled step's checks of its inputs against fdp's own bookkeeping (the plan's leaf
    shapes, the Apply's, the state layout's sizes) and what its graph is built from (the
    buckets, the update orders) are made at trace time with the bookkeeping a constant: dynamo
    guards on the inputs, not on each number fdp keeps, before every call (a per-leaf cost on
    every call of a compiled step: docs/compile.md, "Each call's cost"). A wrong input still
    gets fdp's error, naming the leaf."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for names, errors in fdp.testing.run(_guards_and_errors_case, 2, backend="gloo", timeout=300, args=(kind,)):
        assert names, "no guards seen"
        assert not [n for n in names if any(b in n for b in BOOKKEEPING)], [
            n for n in names if any(b in n for b in BOOKKEEPING)][:5]
        if kind != "units":
            # (a shape that changed after the first call is a symbol in dynamo's retrace: "(s91,)")
            assert "leaf ['ln.bias'] has shape (" in errors[0] and "the plan expects (16,)" in errors[0], errors[0]
            assert "does not match the bucket plan's structure: missing leaf ['ln.bias']" in errors[1], errors[1]
            assert "opt_state.buffers['momentum_buffer'] does not match this step's" in errors[3], errors[3]
        fields = errors[2 if kind != "units" else 0]
        assert "opt_state has fields ['exp_avg', 'exp_avg_sq'] and 0 transform states; this optimizer keeps " \
               "['momentum_buffer'] and 1" in fields, fields


def _refusal(group, option, how):
    torch._dynamo.reset()
    params = {"w": torch.ones(4, 3), "b": torch.zeros(4)}

    def loss(p, x):
        return (x @ p["w"].T + p["b"]).square().sum()

    kw = {"debug": True} if option == "debug" else {}
    opt = {"inject_hyperparams": lambda: fdp.optim.inject_hyperparams(fdp.optim.sgd)(lr=0.1),
           "clip_error_if_nonfinite": lambda: fdp.optim.chain(
               fdp.optim.clip_by_global_norm(1.0, error_if_nonfinite=True), fdp.optim.sgd(lr=0.1)),
           }.get(option, lambda: fdp.optim.sgd(lr=0.1))()
    step = fdp.Reducer(params, group, **kw).grad_and_update(loss, opt, uneven=option == "uneven")
    state = step.init(params)
    if how == "graph-break":  # no fullgraph: the step runs eagerly inside the compiled function
        eager, _, _ = step(params, state, torch.ones(2, 3))
        got, _, _ = torch.compile(lambda p, s, x: step(p, s, x), backend="eager")(params, step.init(params),
                                                                                torch.ones(2, 3))
        return all(torch.equal(eager[k], got[k]) for k in eager)
    run = step.compile(backend="eager") if how == "method" else torch.compile(
        lambda p, s, x: step(p, s, x), fullgraph=True, backend="eager")
    try:
        run(params, state, torch.ones(2, 3))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return "\n".join(str(e).splitlines()[:3])
    return None


REFUSED = {"debug": "debug=True", "uneven": "uneven=True",
           "clip_error_if_nonfinite": "error_if_nonfinite=True) reads the norm on the host"}


@pytest.mark.parametrize("option,how", [(o, "method") for o in REFUSED] + [
    (o, how) for o in ("debug", "clip_error_if_nonfinite", "inject_hyperparams") for how in ("function", "graph-break")])
@pytest.mark.slow
def test_options_that_cannot_be_traced_are_refused_by_name(option, how):
    """``step.compile`` refuses before compiling, naming the option in the error's first line;
    a compiled function of one's own with ``fullgraph=True`` fails with dynamo's error whose
    first lines give fdp's reason (the options listed, step.compile() to name which); without
    fullgraph the step runs eagerly there (a graph break), with its eager numbers."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for got in fdp.testing.run(_refusal, 2, backend="gloo", timeout=300, args=(option, how)):
        if how == "graph-break":
            assert got is True
            continue
        assert got is not None and "cannot be traced by torch.compile" in got, got
        assert (REFUSED[option] if how == "method" else "step.compile() raises naming which") in got, got


def _unbound(group):
    torch._dynamo.reset()
    params = {"w": torch.ones(3)}
    step = fdp.Reducer(params, group).grad_and_update(lambda p: p["w"].square().sum(), fdp.optim.sgd(lr=0.1))
    state = fdp.optim.sgd(lr=0.1).init(params)
    try:
        torch.compile(lambda p, s: step(p, s), fullgraph=True, backend="eager")(params, state)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    return None


@pytest.mark.slow
def test_a_step_compiled_before_it_was_bound_says_to_call_init_first():
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for error in fdp.testing.run(_unbound, 2, backend="gloo", timeout=300):
        assert error is not None and "step.init(params)" in error, error


def _accumulate_in_graph(group):
    torch._dynamo.reset()
    params = {"w": torch.ones(3)}
    step = fdp.Reducer(params, group).grad_and_update(lambda p, x: (p["w"] * x).square().sum(),
                                                      fdp.optim.sgd(lr=0.1))
    step.init(params)
    try:
        torch.compile(lambda p, x: step.accumulate(p, x), fullgraph=True, backend="eager")(params, torch.ones(3))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return "\n".join(str(e).splitlines()[:3])
    return None


@pytest.mark.slow
def test_step_accumulate_inside_a_compiled_function_gives_fdps_reason():
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for error in fdp.testing.run(_accumulate_in_graph, 2, backend="gloo", timeout=300):
        assert error is not None and "step.accumulate" in error and "outside the compiled function" in error, error


def _thousand_steps(group, injected):
    """1,000 compiled steps of a sharded fused step with a clip and ``skip_nonfinite``, the
    loss scaled up now and then (a different clip factor) and made infinite on one rank now
    and then (a skipped step), micro-batches accumulated before every third step and none
    before the others; the lr a schedule in the graph, or (``injected``) an
    ``inject_hyperparams`` value set from the schedule before every step. Returns how many
    graphs dynamo made, how many cache entries (guard sets) the compiled step's code holds,
    the count, and the steps skipped as ``step.inspect`` says and as expected."""
    torch._dynamo.reset()
    params = {"w": torch.linspace(-1, 1, 12).reshape(4, 3), "b": torch.zeros(4)}

    def loss(p, x, k):
        return ((x @ p["w"].T + p["b"]).square().mean() * k)

    schedule = fdp.optim.schedules.warmup_cosine(0.1, 10, 1000)
    sgd = fdp.optim.inject_hyperparams(fdp.optim.sgd)(lr=0.1, momentum=0.9) if injected else fdp.optim.sgd(
        lr=schedule, momentum=0.9)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.5), sgd)
    step = fdp.Reducer(params, group, shard=True, skip_nonfinite=True).grad_and_update(loss, opt)
    state = step.init(params)
    graphs = []
    compiled = step.compile(backend=lambda gm, ex: graphs.append(gm) or gm.forward)
    p = params
    g = torch.Generator().manual_seed(group.rank)
    skipped = 0
    for i in range(1000):
        bad = i % 97 == 50
        skipped += bad
        k = torch.tensor(float("inf") if bad and group.rank == i % 2 else 10.0 if i % 7 == 0 else 1.0)
        x = torch.randn(2, 3, generator=g)
        for _ in range(i % 3):
            step.accumulate(p, x, k.clamp(max=10.0))
        if injected:
            state = fdp.optim.set_hyperparams(state, lr=schedule(i - skipped + bad))
        p, state, _ = compiled(p, state, x, k)
    entries = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(type(step).__call__.__code__))
    return len(graphs), entries, int(state.step), step.inspect(state).skipped, skipped


@pytest.mark.parametrize("injected", [False, True], ids=["schedule", "set_hyperparams"])
@pytest.mark.slow
def test_a_thousand_compiled_steps_with_a_changing_lr_accumulation_and_skipped_steps_do_not_recompile(injected):
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for graphs, entries, count, skipped, expected in fdp.testing.run(_thousand_steps, 2, backend="gloo", timeout=300,
                                                                      args=(injected,)):
        assert (graphs, entries) == (2, 2)
        assert expected == 10 and skipped == expected and count == 1000 - expected


def _nonfinite_case(group, kind, opt):
    """Eight steps with ``skip_nonfinite``, eagerly and compiled, the loss infinite on one rank
    at steps 2 and 5: the params, the state (as a tree), ``step.inspect``'s verdicts and counts
    per step of both runs, and how many graphs dynamo made."""
    params = {"w": torch.linspace(-1, 1, 12).reshape(4, 3), "b": torch.zeros(4), "v": torch.ones(5)}

    def loss(p, x, k):
        return (x @ p["w"].T + p["b"]).square().mean() * k + p["v"].square().sum()

    runs, graphs = [], []
    for compiled in (False, True):
        step = fdp.Reducer(params, group, skip_nonfinite=True, **KINDS[kind]).grad_and_update(loss, _opt(opt))
        state = step.init(params)
        p = step.shard(params) if kind == "units" else params
        run = step.compile(backend=lambda gm, ex: graphs.append(gm) or gm.forward) if compiled else step
        g = torch.Generator().manual_seed(group.rank)
        seen = []
        for i in range(8):
            k = torch.tensor(float("inf") if i in (2, 5) and group.rank == i % 2 else 1.0)
            p, state, _ = run(p, state, torch.randn(2, 3, generator=g), k)
            info = step.inspect(state)
            seen.append((info.finite, info.skipped, int(state.step)))
        runs.append((p.full() if kind == "units" else dict(p), fdp._tree.leaves(step.state_to_tree(state, p)), seen))
    return runs, len(graphs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_skip_nonfinite_compiles_skipped_steps_keep_params_and_state_as_eagerly(kind):
    """The finite check is a graph node (every rank's, sharded), the update is kept where it
    holds: the params, the state (a clip's last norm included) and ``step.inspect``'s verdicts
    equal the eager step's, bit for bit, in one graph."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()

    def case(group):
        torch._dynamo.reset()
        return [_nonfinite_case(group, kind, opt) for opt in ("clip_sgd", "muon_sgd")]

    for per_opt in fdp.testing.run(case, 2, backend="gloo", timeout=300):
        for ((pe, se, ve), (pc, sc, vc)), graphs in per_opt:
            assert graphs == 1
            assert ve == vc and [v[0] for v in ve] == [True, True, False, True, True, False, True, True], ve
            assert all(torch.equal(pe[k], pc[k]) for k in pe)
            assert all(torch.equal(a, b) for a, b in zip(se, sc))


def _loss_scale_case(group, kind, clip_first, skip_nonfinite):
    """A loss scale (GradScaler's numbers) in the chain, eagerly and through ``step.compile()``,
    from the same params; a rank's loss made inf at steps 2 (rank 0) and 5 (rank 1). Returns
    both runs' (params, state leaves, per step (finite, skipped, scale)) and the graphs made."""
    torch._dynamo.reset()
    apply, params, buffers, kw = _block_net(kind, skip_nonfinite=skip_nonfinite)

    def loss(p, x, y, scale, bad):  # (scaler.scale(loss): the state's scale, passed in)
        return F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()) * scale * bad
    runs, graphs = [], []
    for compiled in (False, True):
        scaling, clip = fdp.optim.loss_scale(init_scale=2.0 ** 4, growth_interval=2), fdp.optim.clip_by_global_norm(0.05)
        opt = fdp.optim.chain(*((clip, scaling) if clip_first else (scaling, clip)), fdp.optim.sgd(lr=0.1, momentum=0.9))
        step = fdp.Reducer(params, group, **kw).grad_and_update(loss, opt)
        state = step.init(params)
        p = step.shard(params) if kind == "units" else params
        run = step.compile(backend=lambda gm, ex: graphs.append(gm) or gm.forward) if compiled else step
        seen = []
        for i in range(7):
            bad = torch.tensor(float("inf") if i in (2, 5) and group.rank == (i == 5) else 1.0)
            p, state, _ = run(p, state, *tokens(group.rank, i), fdp.optim.current_loss_scale(state), bad)
            info = step.inspect(state)
            seen.append((info.finite, info.skipped, float(fdp.optim.current_loss_scale(state))))
        runs.append((p.full() if kind == "units" else dict(p), fdp._tree.leaves(step.state_to_tree(state, p)), seen))
    return runs, len(graphs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_a_loss_scale_compiles_and_skips_overflowing_steps_as_eagerly(kind):
    """``loss_scale``'s verdict is a graph node: an overflowing step (one rank's inf) is
    computed and not kept, the scale backs off and grows, as the eager step (and so
    GradScaler, tests/test_loss_scale.py) does, bit for bit, in one graph; first in the chain
    or after a clip, with and without ``skip_nonfinite`` (which, rejecting a step, shows it to
    the first global scale only: a loss scale after a clip then does not back off)."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()

    def case(group):
        return [_loss_scale_case(group, kind, clip_first, skip) for clip_first, skip in
                ((False, False), (True, True))]

    for per_case, backs_off in zip(zip(*fdp.testing.run(case, 2, backend="gloo", timeout=300)), (True, False)):
        for ((pe, se, ve), (pc, sc, vc)), graphs in per_case:
            assert graphs == 1
            assert ve == vc and [v[0] for v in ve] == [True, True, False, True, True, False, True], ve
            assert [v[2] for v in ve] == ([16.0, 32.0, 16.0, 16.0, 32.0, 16.0, 16.0] if backs_off else
                                          [16.0, 32.0, 32.0, 32.0, 64.0, 64.0, 64.0]), ve
            assert all(torch.equal(pe[k], pc[k]) for k in pe)
            assert all(torch.equal(a, b) for a, b in zip(se, sc))


def _injected_case(group, kind, factory, extra):
    """An ``inject_hyperparams`` optimizer through ``step.compile()``, eagerly and compiled from
    the same params: a new lr every step (``set_hyperparams``), ``extra`` (a value fixed in the
    graph) set at step 4 and back at step 6. Returns the largest difference between the runs'
    params and how many graphs dynamo made."""
    params = {"w": torch.linspace(-1, 1, 12).reshape(4, 3), "b": torch.zeros(4)}

    def loss(p, x):
        return (x @ p["w"].T + p["b"]).square().mean()

    out, graphs = [], []
    for compiled in (False, True):
        opt = fdp.optim.inject_hyperparams(factory)(lr=0.1, weight_decay=0.01, **{k: v for k, (v, _) in extra.items()})
        step = fdp.Reducer(params, group, **KINDS[kind]).grad_and_update(loss, opt)
        state = step.init(params)
        p = step.shard(params) if kind == "units" else params
        run = step.compile(backend=lambda gm, ex: graphs.append(gm) or gm.forward) if compiled else step
        g = torch.Generator().manual_seed(group.rank)
        for i in range(8):
            state = fdp.optim.set_hyperparams(state, lr=0.1 / (i + 1))
            if i in (4, 6):
                state = fdp.optim.set_hyperparams(state, **{k: v[i == 4] for k, v in extra.items()})
            p, state, _ = run(p, state, torch.randn(2, 3, generator=g))
        out.append(p.full() if kind == "units" else dict(p))
    return max(float((out[0][k] - out[1][k]).abs().max()) for k in out[0]), len(graphs)


def _injected_cases(group):
    torch._dynamo.reset()
    return [_injected_case(group, "replicated", fdp.optim.adamw, {"betas": ((0.9, 0.999), (0.8, 0.99))}),
            _injected_case(group, "units", fdp.optim.sgd, {"momentum": (0.9, 0.5)})]


@pytest.mark.slow
def test_step_compile_runs_inject_hyperparams_and_a_new_lr_each_step_compiles_nothing():
    """The lr is read in the graph from the state's tensor: eight values, no recompile; a new
    betas (or momentum) is fixed in the graph: one more graph, and the old values, set again,
    find their first graph. The numbers are the eager step's within the tolerance of a tensor
    lr (AdamW: ``RTOL``; SGD's ``lr * grad`` rounds once more)."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for (adamw_diff, adamw_graphs), (sgd_diff, sgd_graphs) in fdp.testing.run(_injected_cases, 2, backend="gloo",
                                                                              timeout=300):
        assert adamw_graphs == 2 and sgd_graphs == 2
        assert adamw_diff < 1e-5 and sgd_diff < 1e-7, (adamw_diff, sgd_diff)


def _scheduled_case(group, kind):
    """The Muon + SGD step with a clip (``kind``), compiled with ``aot_eager`` twice: as traced,
    and with fdp's collective scheduling pass (``fdp/_comm/schedule.py``) run on AOTAutograd's
    graph. Returns both runs' params after three steps, and per graph the collectives in issue
    order and, per collective, the nodes between its launch and its wait."""
    from torch._dynamo.backends.common import aot_autograd

    from fdp._comm.schedule import COLLECTIVES, issue_early

    seen = {False: [], True: []}

    def compiler(scheduled):
        def fw(gm, _):
            if scheduled:
                issue_early(gm.graph)
                gm.recompile()
            calls = [n for n in gm.graph.nodes if n.op == "call_function"]
            at = {n: i for i, n in enumerate(calls)}

            def name(n):
                return getattr(getattr(n.target, "_schema", None), "name", "")

            launches = [n for n in calls if name(n).split("::")[-1] in COLLECTIVES]
            waits = [next(u for u in c.users if name(u).endswith("wait_tensor")) for c in launches]
            seen[scheduled].append(([name(c) for c in launches], [at[w] - at[c] - 1 for c, w in zip(launches, waits)]))
            return gm.forward
        return aot_autograd(fw_compiler=fw)

    out = []
    for scheduled in (False, True):
        torch._dynamo.reset()
        model = init_(BlockNet(vocab=32, d=16, n=2), 3)
        apply, params, buffers = fdp.functionalize(model)
        kw = {**KINDS[kind], "bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.002}
        if kind == "units":
            kw["units"] = fdp.units(model, Block)
        step = fdp.Reducer(params, group, **kw).grad_and_update(_token_loss(apply, buffers), _opt("muon_sgd"))
        state = step.init(params)
        p = step.shard(params) if kind == "units" else params
        compiled = step.compile(backend=compiler(scheduled))
        for i in range(3):
            p, state, _ = compiled(p, state, *tokens(group.rank, i))
        out.append(p.full() if kind == "units" else dict(p))
    return out, seen


@pytest.mark.parametrize("kind", ["sliced", "units"])
@pytest.mark.slow
def test_fdps_scheduling_pass_launches_collectives_early_in_the_same_order_with_the_same_numbers(kind):
    """The pass moves each collective (and the fill feeding it) up to where its inputs are
    ready and each wait down to its first user: the first buckets' collectives then have the
    rest of the backward between launch and wait, the ranks issue the collectives in the order
    the step traced them (Muon's owners differ per rank), and the numbers are the same."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for (plain, scheduled), seen in fdp.testing.run(_scheduled_case, 2, backend="gloo", timeout=300, args=(kind,)):
        assert all(torch.equal(plain[k], scheduled[k]) for k in plain)
        assert [o for o, _ in seen[True]] == [o for o, _ in seen[False]] and len(seen[False][0][0]) > 4, seen
        (_, between), (_, between_s) = seen[False][0], seen[True][0]  # (the step's graph: the EMA's first is another)
        assert sum(between_s) > 10 * max(1, sum(between)), (between, between_s)


def _two_collectives():
    """An FX graph of two all-reduces, the first with two matrix products between its launch
    and its wait, the second with none; and its nodes by role."""
    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    first = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    mm1 = g.call_function(aten.mm.default, (w, w))
    mm2 = g.call_function(aten.mm.default, (g.call_function(aten.add.Tensor, (mm1, w)), w))
    wait1 = g.call_function(c10d.wait_tensor.default, (first,))
    second = g.call_function(c10d.all_reduce.default, (mm2, "sum", "0"))
    wait2 = g.call_function(c10d.wait_tensor.default, (second,))
    g.output((g.call_function(aten.add.Tensor, (wait1, wait2)),))
    names = {"first": first.name, "mm1": mm1.name, "mm2": mm2.name, "wait1": wait1.name, "second": second.name}
    return torch.fx.GraphModule(torch.nn.Module(), g), names


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.slow
def test_in_order_chains_the_collectives_and_holds_each_ones_overlap(hold):
    """``in_order`` (fdp's last pass for Inductor): the second collective depends on the first
    (Inductor's ``control_deps``, which its memory reordering honours); with ``hold``, also the
    first matrix product after the first launch depends on it and the first wait on the last
    product before it; the second collective, with nothing to hide behind, gets no hold."""
    from fdp._comm.schedule import in_order

    if not fdp._internals.keep_node_order(torch.fx.Graph(), {}):
        pytest.skip("this torch has no control_deps (torch < 2.13): in_order keeps nothing")
    gm, n = _two_collectives()
    in_order(gm.graph, hold=hold)
    gm.graph.lint()
    deps = {node.name: tuple(d.name for d in node.args[0]) for node in gm.graph.nodes
            if node.op == "call_function" and "control_deps" in str(node.target)}
    expected = {n["second"]: (n["first"],)}
    if hold:
        expected.update({n["mm1"]: (n["first"],), n["wait1"]: (n["mm2"],)})
    assert deps == expected


def test_the_passes_see_fdps_gloo_collectives_as_the_ones_they_stand_for():
    """On gloo fdp's traced all-gather and reduce-scatter are its own point-to-point ops
    (``fdp/_comm/traced.py``); the passes treat them as torch's: collectives (issued early, kept
    in order), param gathers (reshard) and reduce-scatters (bounded one at a time), while an
    ``all_to_all_single`` (Muon's owners, a leaf's exchange) is no reduce-scatter, equal parts
    or not."""
    from fdp._comm.schedule import COLLECTIVES, is_op, is_scatter

    c10d, ours = torch.ops._c10d_functional, torch.ops.fdp
    g = torch.fx.Graph()
    x = g.placeholder("x")
    nodes = [g.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 2, "0")),
             g.call_function(ours.reduce_scatter_tensor.default, (x, "sum", 2, "0", 0)),
             g.call_function(c10d.all_to_all_single.default, (x, [8, 8], [8, 8], "0")),
             g.call_function(c10d.all_reduce.default, (x, "sum", "0")),
             g.call_function(ours.all_gather_into_tensor.default, (x, 2, "0", 1)),
             g.call_function(torch.ops.aten.mm.default, (x, x))]
    assert [is_scatter(n) for n in nodes] == [True, True, False, False, False, False]
    assert [is_op(n, COLLECTIVES) for n in nodes] == [True] * 5 + [False]
    assert [is_op(n, ("all_gather_into_tensor",)) for n in nodes] == [False] * 4 + [True, False]
    assert is_op(nodes[-1], ("mm",), "aten") and not is_op(nodes[-1], ("mm",))


def _gathers_alive(gm):
    """Per param all-gather of ``gm`` (first gathers and second ones, in graph order): the
    interval of nodes from its launch to the last node reading its buffer (through views), and
    the most buffers of units alive at once."""
    import operator

    from fdp._comm.schedule import is_op

    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    out = []
    for g in (n for n in nodes if is_op(n, ("all_gather_into_tensor",))):
        seen, todo, last = set(), [g], at[g]
        while todo:
            n = todo.pop()
            for u in n.users:
                last = max(last, at[u])
                view = u.target is operator.getitem or getattr(u.target, "is_view", False) or is_op(u, ("wait_tensor",))
                if view and u not in seen:
                    seen.add(u)
                    todo.append(u)
        out.append((at[g], last))
    return out


def _resharded_case(group, net, reducer_kw):
    """The fully sharded Muon + SGD step (``net``, 3 blocks) compiled with ``aot_eager`` two
    ways: with fdp's scheduling pass and the reshard pass (``fdp/_comm/reshard.py``) run on
    AOTAutograd's graph, and with the reshard pass without prefetch and the collectives' order
    kept (``in_order``: Inductor's ``control_deps``); and eagerly. (The numbers of the step as
    traced and with the scheduling pass alone are checked by the tests above.) Returns the
    params of each after three steps, the step graph's gather intervals and its collectives
    per way, and as traced (the first way's graph before the passes)."""
    from torch._dynamo.backends.common import aot_autograd

    from fdp._comm.reshard import reshard_after_forward
    from fdp._comm.schedule import COLLECTIVES, in_order, is_op, issue_early

    out, seen = [], {}
    for how in ("eager", "resharded", "ordered"):
        torch._dynamo.reset()
        model = init_(net(vocab=32, d=16, n=3), 3)
        apply, params, buffers = fdp.functionalize(model)
        kw = {"shard": "params", "bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.002,
              "units": fdp.units(model, Block), **reducer_kw}
        step = fdp.Reducer(params, group, **kw).grad_and_update(_token_loss(apply, buffers), _opt("muon_sgd"))
        state = step.init(params)
        p = step.shard(params)
        units = step._engine.store.units

        def fw(gm, _, how=how, units=units):
            def record(way):
                seen.setdefault(way, (_gathers_alive(gm), [n.target._schema.name for n in gm.graph.nodes
                                                           if is_op(n, COLLECTIVES)]))
            if how == "resharded":
                record("traced")
            issue_early(gm.graph)
            reshard_after_forward(gm.graph, [u == 0 for u in units.unit_of_bucket], units.reshard_after_forward,
                                  prefetch=how == "resharded")
            record(how)
            if how == "ordered":  # (each collective but the first then a control_deps node after the one before)
                in_order(gm.graph)
                assert sum(is_op(n, COLLECTIVES) for n in gm.graph.nodes) == 1
            gm.recompile()
            return gm.forward

        run = step if how == "eager" else step.compile(backend=aot_autograd(fw_compiler=fw))
        for i in range(3):
            p, state, _ = run(p, state, *tokens(group.rank, i))
        out.append(p.full())
    roots = sum(u == 0 for u in units.unit_of_bucket)
    return out, seen, roots


@pytest.mark.parametrize("net,reducer_kw", [(BlockNet, {}), (CheckpointedNet, {"param_dtype": torch.bfloat16}),
                                            (BlockNet, {"reshard_after_forward": False})],
                         ids=["fp32", "checkpointed-bf16", "kept-after-forward"])
@pytest.mark.slow
def test_the_reshard_pass_gathers_one_unit_ahead_and_again_for_the_backward_with_the_same_numbers(net, reducer_kw):
    """fdp's memory schedule for compiled fully sharded params: as traced, every unit's
    params are gathered at the graph's start and kept to the end of its backward (all of them
    alive at once); with the pass, a unit is gathered right before the one before it runs, and
    (``reshard_after_forward``) gathered a second time for its backward (activation
    checkpointing's recomputation reads the second gather), so at most two units' buffers
    (and the root's) are alive at once. The numbers are the eager step's, bit for bit, and
    the ranks issue the same collectives in the same order."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    got = fdp.testing.run(_resharded_case, 2, backend="gloo", timeout=300, args=(net, reducer_kw))
    for (eager, *compiled), seen, roots in got:
        for p in compiled:
            assert all(torch.equal(eager[k], p[k]) for k in eager)

        def most_alive(intervals):
            return max(sum(a <= i <= z for a, z in intervals) for i in range(max(z for _, z in intervals) + 1))

        traced, resharded = seen["traced"][0], seen["resharded"][0]
        units = len(traced) - roots
        assert units == 3 and most_alive(traced) == len(traced)
        # (each block but the forward's last, kept into its backward, which comes next; the head is the root's)
        again = 0 if reducer_kw.get("reshard_after_forward") is False else units - 1
        assert len(resharded) == len(traced) + again == len(seen["ordered"][0])
        if again:  # (kept after the forward, every unit is alive from its forward to its backward, as eagerly)
            assert most_alive(resharded) <= 2 + roots, resharded
            assert most_alive(seen["ordered"][0]) <= 2 + roots
    assert got[0][1]["resharded"][1] == got[1][1]["resharded"][1]


def _reduced_case(group):
    """The fully sharded AdamW step (3 blocks) eagerly, and compiled with ``aot_eager`` as
    traced and with fdp's scheduling and reshard passes: the params after three steps of each,
    and per reduce-scatter in the passes' graph (graph order) the position of its issue and
    of the last node that reads its reduced slice (through views; the graph's output aside)."""
    import operator

    from torch._dynamo.backends.common import aot_autograd

    from fdp._comm.reshard import reshard_after_forward
    from fdp._comm.schedule import is_op, is_scatter, issue_early

    out, seen = {}, []
    for how in ("eager", "traced", "scheduled"):
        torch._dynamo.reset()
        model = init_(BlockNet(vocab=32, d=16, n=3), 3)
        apply, params, buffers = fdp.functionalize(model)
        step = fdp.Reducer(params, group, shard="params", bucket_cap_mb=0.004, first_bucket_cap_mb=0.002,
                           units=fdp.units(model, Block)).grad_and_update(_token_loss(apply, buffers), _opt("adamw"))
        state = step.init(params)
        p = step.shard(params)
        units = step._engine.store.units

        def fw(gm, _, how=how, units=units):
            if how == "scheduled":
                issue_early(gm.graph)
                reshard_after_forward(gm.graph, [u == 0 for u in units.unit_of_bucket], units.reshard_after_forward)
                nodes = list(gm.graph.nodes)
                at = {n: i for i, n in enumerate(nodes)}
                for c in (n for n in nodes if is_scatter(n)):
                    last, todo = at[c], [c]
                    while todo:
                        for u in todo.pop().users:
                            if u.op != "output":
                                last = max(last, at[u])
                                if is_op(u, ("wait_tensor",)) or u.target is operator.getitem \
                                        or getattr(u.target, "is_view", False):
                                    todo.append(u)
                    seen.append((at[c], last))
                gm.recompile()
            return gm.forward

        run = step if how == "eager" else step.compile(backend=aot_autograd(fw_compiler=fw))
        for i in range(3):
            p, state, _ = run(p, state, *tokens(group.rank, i))
        out[how] = p.full()
    return out, seen


@pytest.mark.slow
def test_the_reshard_pass_updates_each_bucket_once_reduced_with_the_same_numbers():
    """Compiled fully sharded params: each bucket's update runs as soon as its reduce-scatter
    is waited for (as the eager step updates a bucket from the backward's hooks), so its
    reduced slice is read for the last time before the next reduce-scatter is issued: one
    reduced slice at a time, where the traced step updates every bucket after the last
    reduce-scatter (all of them alive at once). The numbers are the traced step's bit for bit
    (the eager step's within float32's rounding: the traced AdamW rounds its own way)."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    for out, seen in fdp.testing.run(_reduced_case, 2, backend="gloo", timeout=300):
        assert all(torch.equal(out["traced"][k], out["scheduled"][k]) for k in out["eager"])
        for k in out["eager"]:
            torch.testing.assert_close(out["scheduled"][k], out["eager"][k], rtol=1e-5, atol=1e-6)
        assert len(seen) >= 4, seen  # (the three blocks' buckets and the root's)
        for (_, last), (issue, _) in zip(seen, seen[1:]):
            assert last < issue, seen


def _donated_case(group, kind, compiled):
    """Three donated steps; the params after them, and whether the given ones were written:
    fully sharded, the given slices hold the new ones (their memory); else the given tensors
    (re-pointed by the eager step at its own buffers, written in place by the compiled one)
    hold the new params."""
    torch._dynamo.reset()
    model = init_(BlockNet(vocab=32, d=16, n=2), 3)
    apply, params, buffers = fdp.functionalize(model)
    units = {"units": fdp.units(model, Block)} if kind == "units" else {}
    step = fdp.Reducer(params, group, bucket_cap_mb=0.004, **KINDS[kind], **units).grad_and_update(
        _token_loss(apply, buffers), _opt("clip_sgd"), donate=True)
    state = step.init(params)
    p = step.shard(params) if kind == "units" else params
    run = step.compile(backend="aot_eager") if compiled else step
    given = [f.data_ptr() for f in p.flats] if kind == "units" else None
    for i in range(3):
        p, state, _ = run(p, state, *tokens(group.rank, i))
    if kind == "units":
        return p.full(), [f.data_ptr() for f in p.flats] == given
    return {k: v.clone() for k, v in p.items()}, all(torch.equal(params[k], p[k]) for k in p)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.slow
def test_a_donated_step_compiled_writes_the_given_params_as_eagerly(kind):
    """``donate=True``: the compiled step writes the new params (fully sharded: the new slices)
    into the given tensors (no second copy of them in the graph's outputs), so the caller's
    tensors hold them, as after the eager step; the numbers are the eager step's."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    eager = fdp.testing.run(_donated_case, 2, backend="gloo", timeout=300, args=(kind, False))
    compiled = fdp.testing.run(_donated_case, 2, backend="gloo", timeout=300, args=(kind, True))
    for (pe, same_e), (pc, same_c) in zip(eager, compiled):
        assert same_e and same_c
        assert all(torch.equal(pe[k], pc[k]) for k in pe)


def _inductor_case(group):
    import re

    import_compilers(inductor=True)
    ((eager, compiled), graphs), codes = fdp._internals.inductor_code(lambda: _run(
        group, "units", "muon_sgd", "method", steps=3, reducer_kw={"param_dtype": torch.bfloat16}, inductor=True))
    # the collectives in the order the wrapper calls them: its Python (``fdp.op.default(``) or,
    # step.compile()'s default on CPU, its C++ (``findSchemaOrThrow("fdp::op"``, ``aoti_torch_cpu_..._op(``)
    called = (r"(?:_c10d_functional|fdp)\.(\w+)\.default\(|findSchemaOrThrow\(\"(?:_c10d_functional|fdp)::(\w+)\""
              r"|aoti_torch_cpu__c10d_functional_(\w+)\(")
    issued = [name for code in codes for m in re.finditer(called, code)
              for name in [next(g for g in m.groups() if g)] if name != "wait_tensor"]
    (pe, _, _), (pc, _, _) = eager, compiled
    # bf16 compute: Inductor keeps a fused kernel's intermediates in fp32 where eager rounds
    # every op to bf16 (one bf16 ulp is 2**-8 relative), and Muon iterates in bf16
    for k in pe:
        torch.testing.assert_close(pc[k], pe[k], rtol=2e-2, atol=1e-2)
    return graphs, issued


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_inductor_compiles_the_fully_sharded_step_with_muon_owners_and_bf16():
    """One Inductor compile (the rest of the file checks traces with aot_eager): a fully
    sharded step whose graph holds every collective kind fdp issues (all-gather and
    reduce-scatter, on gloo fdp's point-to-point ops, the all-to-alls of Muon's owners) and
    bf16 casts, lowered with fdp's passes (the collectives' schedule, each unit
    gathered again for its backward, their order kept through Inductor's reordering) and
    run: every rank issues the same collectives in the same order."""
    skip_unless_dynamo_traces_fdp()
    import_compilers(inductor=True)
    got = fdp.testing.run(_inductor_case, 2, backend="gloo", timeout=900)
    assert [g for g, _ in got] == [1, 1]
    # Muon's owners make the ranks' graphs differ: Inductor's reordering must not change the
    # order they issue the collectives in (fdp's in_order pass)
    (_, mine), (_, theirs) = got
    assert mine == theirs and set(mine) == {"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}, mine


def _cpp_wrapper_case(group, kind):
    import_compilers(inductor=True)
    ((eager, compiled), _), codes = fdp._internals.inductor_code(lambda: _run(
        group, kind, "clip_sgd", "method", steps=3, accumulate=((1, 2),), inductor=True))
    _assert_same(eager, compiled, exact=False)
    return sum("inductor_entry_impl" in code for code in codes), len(codes)


@pytest.mark.timeout(900)
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_compiled_steps_call_their_kernels_from_cpp_on_cpu_with_their_eager_numbers(kind):
    """``step.compile()`` on CPU gives Inductor its C++ wrapper (``cpp_wrapper``): the step's
    graphs (and the compiled accumulate's) call their kernels from compiled code, also fdp's
    own gloo collectives (ops the wrapper calls through the dispatcher), clipping's norms and
    the all-reduce, and the steps agree with eager. ``shard=True`` with clipping met two torch
    2.13 bugs of the wrapper, both worked around: torch's ``all_to_all_single`` (the
    statistics of leaves that straddle slices) has a schema it cannot call (fdp's own
    all-to-all on gloo now), and it read a one-tensor ``_foreach_norm``'s list as a tensor
    (SIGSEGV; fdp's traced norms never ask for one alone)."""
    skip_unless_dynamo_traces_fdp()
    import_compilers(inductor=True)
    got = fdp.testing.run(_cpp_wrapper_case, 2, backend="gloo", timeout=900, args=(kind,))
    for in_cpp, graphs in got:
        assert graphs >= 1 and in_cpp == graphs, (in_cpp, graphs)


def _wrapper_fallback_case(group, how):
    """A step whose loss calls torch's own ``all_to_all_single`` (each rank's rows exchanged):
    Inductor's C++ wrapper cannot call that op on torch 2.13. Eager, then compiled ``how``:
    "default" (fdp's wrapper on CPU), "python" (``cpp_wrapper=False``), "cpp" (``True``, the
    user's own); each the params after two steps, or the error, and fdp's warnings."""
    import warnings

    import torch.distributed._functional_collectives as fc

    import_compilers(inductor=True)
    torch.manual_seed(0)
    apply, start, _ = fdp.functionalize(torch.nn.Linear(4, 2))
    start = fdp.broadcast({k: v.detach().clone() for k, v in start.items()}, group=group)
    pg = group.process_group

    def loss_fn(params, x):
        return apply(params, {}, fc.all_to_all_single(x, None, None, pg))[0].square().mean()

    x = torch.arange(16.0).reshape(4, 4) / 8 + group.rank
    out = []
    for compiled in (False, True):
        params = {k: v.clone() for k, v in start.items()}
        step = fdp.Reducer(params, group).grad_and_update(loss_fn, fdp.optim.sgd(0.1))
        state = step.init(params)
        options = {} if how == "default" else {"options": {"cpp_wrapper": how == "cpp"}}
        run = step.compile(**options) if compiled else step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(2):
                    params, state, _ = run(params, state, x)
            except Exception as e:  # (the user's own wrapper: Inductor's error)
                params = f"{type(e).__name__}: {e}"
        out.append((params, [str(w.message) for w in caught if "C++ wrapper" in str(w.message)]))
    return out


@pytest.mark.timeout(900)
@pytest.mark.slow
@pytest.mark.parametrize("how", ["default", "python", "cpp"])
def test_a_graph_the_cpp_wrapper_cannot_compile_is_compiled_with_the_python_wrapper(how):
    """Where Inductor cannot compile a graph with the C++ wrapper ``step.compile()`` chose for
    CPU (an op in the user's loss its wrapper cannot call), fdp compiles that graph again with
    the Python wrapper: one warning a rank naming Inductor's reason and the option that asks
    for the Python wrapper at once, and the eager step's numbers. With ``cpp_wrapper=False``
    nothing is said; with the user's own ``cpp_wrapper=True`` Inductor's error is raised."""
    skip_unless_dynamo_traces_fdp()
    got = fdp.testing.run(_wrapper_fallback_case, 2, backend="gloo", timeout=900, args=(how,))
    for rank, ((eager, said_eager), (compiled, said)) in enumerate(got):
        assert said_eager == []
        if how == "cpp":
            assert isinstance(compiled, str) and "custom_op_wrapper" in compiled, compiled
            assert said == []
            continue
        for k in eager:
            torch.testing.assert_close(compiled[k], eager[k], rtol=RTOL, atol=ATOL)
        if how == "python":
            assert said == []
        else:
            assert len(said) == 1, said
            assert said[0].startswith(f"fdp.Reducer.grad_and_update rank {rank}: Inductor's C++ wrapper"), said
            assert "custom_op_wrapper" in said[0] and "options={'cpp_wrapper': False}" in said[0], said


def _unit_buffers_case(group, kind):
    """The most buffers of a unit's size (its params gathered, its flat gradient bucket) alive
    at once over one step of the bench's GPT (width 256, 4 blocks) fully sharded, ``kind``
    ``zero3`` (eager) or ``zero3-compiled`` (Inductor): the profiler's allocation events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from fdp.bench import sharded

    import_compilers(inductor=True)
    torch._dynamo.reset()
    k = sharded.Kind(kind, group, 256, 4, False)
    store = k.step_fn._engine.store
    unit_bytes = {store.slices.padded[b] * 4 for b, u in enumerate(store.units.unit_of_bucket) if u != 0}
    for t in range(2):
        k.step(t, 2)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        k.step(2, 2)
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live, most = set(), 0
    for _, ptr, size in sorted(events):
        if abs(size) in unit_bytes:
            (live.add if size > 0 else live.discard)(ptr)
            most = max(most, len(live))
    return most


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_compiled_fully_sharded_step_holds_two_units_and_two_gradient_buckets_at_most():
    """The compiled fully sharded step's memory schedule (``fdp/_comm/reshard.py``), as
    Inductor runs it: at most two units gathered (the one computing, the next one prefetched)
    and two flat gradient buckets (one in its reduce-scatter, one being filled) alive at once;
    the eager step holds two units (its gradient bucket is allocated once, for good). Without
    the fills kept after their unit's second gather, Inductor computes a bias's gradient (a sum
    of the residual stream's) one unit early, into a third bucket: five at once."""
    skip_unless_dynamo_traces_fdp()
    import_compilers(inductor=True)
    eager = fdp.testing.run(_unit_buffers_case, 2, backend="gloo", timeout=900, args=("zero3",))
    compiled = fdp.testing.run(_unit_buffers_case, 2, backend="gloo", timeout=900, args=("zero3-compiled",))
    assert eager == [2, 2] and compiled == [4, 4], (eager, compiled)


def _rescheduled_case(group, opt, reducer_kw, net=BlockNet, accumulate=()):
    import_compilers(inductor=True)
    (eager, compiled), _ = _run(group, "units", opt, "method", steps=4, reducer_kw=reducer_kw, inductor=True,
                                net=net, accumulate=accumulate)
    _assert_same(eager, compiled, exact=False)
    return True


@pytest.mark.timeout(900)
@pytest.mark.slow
@pytest.mark.parametrize("opt,reducer_kw,net,accumulate", [
    ("adamw", {}, BlockNet, ()), ("masked_sgd_schedule", {"skip_nonfinite": True}, BlockNet, ()),
    ("clip_sgd", {"reshard_after_forward": False}, BlockNet, ()),
    ("clip_sgd", {}, CheckpointedNet, ((1, 2),))],
    ids=["adamw", "schedule-mask-skip_nonfinite", "clip-kept-after-forward", "checkpointed-accumulate"])
def test_the_fully_sharded_step_under_inductor_with_its_memory_schedule_has_its_eager_numbers(
        opt, reducer_kw, net, accumulate):
    """``step.compile()`` of fully sharded params under Inductor, where fdp's passes move each
    bucket's update (its writes into the state, the step count, the verdict of
    ``skip_nonfinite``) up to its reduce-scatter's wait, keep the forward's last unit gathered
    and each fill after its unit's second gather: the params and state are the eager step's
    over four steps (within float32's rounding: Inductor fuses the update). With activation
    checkpointing the backward recomputes each block from its gathered params (the pass's
    second gathers are what it reads), with micro-batches before a step (Muon under Inductor:
    ``test_inductor_compiles_the_fully_sharded_step_with_muon_owners_and_bf16``)."""
    skip_unless_dynamo_traces_fdp()
    import_compilers(inductor=True)
    assert fdp.testing.run(_rescheduled_case, 2, backend="gloo", timeout=900,
                           args=(opt, reducer_kw, net, accumulate)) == [True, True]


GLOBAL_NORM_UNDER_CPP_WRAPPER = """
import torch, fdp
def norm(a, b):
    return fdp.optim.global_norm({"a": a, "b": b})
a, b = torch.randn(10), torch.randn(5, dtype=torch.float64)  # (each dtype group one leaf)
got = torch.compile(norm, options={"cpp_wrapper": True}, fullgraph=True)(a, b)
print(torch.equal(got, norm(a, b)), got.dtype)
"""


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_global_norm_compiles_with_the_cpp_wrapper_when_a_dtype_has_one_leaf():
    """``fdp.optim.global_norm`` inside a user's ``torch.compile`` with Inductor's C++ wrapper:
    torch's ``get_total_norm`` (what it calls eagerly on torch >= 2.6) asks ``_foreach_norm``
    for a (device, dtype) group of one leaf, which the wrapper reads back as a tensor instead
    of a list (torch 2.13: SIGSEGV); traced, fdp computes the same norm its own way, with no
    one-tensor ``_foreach_norm``. Run in a process of its own (a crash is a failed test, not a
    lost worker)."""
    import subprocess
    import sys

    import_compilers(inductor=True)
    done = subprocess.run([sys.executable, "-c", GLOBAL_NORM_UNDER_CPP_WRAPPER], capture_output=True, text=True,
                          timeout=540, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.split() == ["True", "torch.float64"], (done.returncode, done.stdout,
                                                                                       done.stderr[-2000:])


def _two_steps_case(group):
    """Two fused steps compiled in one process: the second compile of the step's code makes
    dynamo treat the ints that differ between them (the runs' offsets) as symbolic; the
    traced update sorts nothing at trace time, so both still trace (and agree with eager)."""
    torch._dynamo.reset()
    for kind in ("replicated", "sliced"):
        (eager, compiled), _ = _run(group, kind, "masked_sgd", "method", steps=3, accumulate=((1, 2),), reset=False)
        _assert_same(eager, compiled, exact=True)
    return True


@pytest.mark.slow
def test_two_fused_steps_compiled_in_one_process_both_trace():
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    assert fdp.testing.run(_two_steps_case, 2, backend="gloo", timeout=300) == [True, True]


def _recipe_case(group):
    (eager, compiled), graphs = _run(group, "units", "recipe", "method", steps=6, accumulate=((2, 2), (4, 1)),
                                     net=CheckpointedNet, reducer_kw={"param_dtype": torch.bfloat16})
    _assert_same(eager, compiled, exact=True)
    return graphs


@pytest.mark.slow
def test_the_large_model_recipe_compiles_with_its_eager_numbers():
    """Fully sharded params, bf16 compute, activation checkpointing, clipping, Muon + SGD
    (Muon's owners), an EMA of the params, accumulation: ``step.compile()`` equals the eager
    step bit for bit (the EMA is in the state compared). Three graphs in six steps: the EMA's
    first average (a copy, decided on the count) and the later ones, and the step after
    micro-batches."""
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    assert fdp.testing.run(_recipe_case, 2, backend="gloo", timeout=300) == [3, 3]


def _hf_case(group, kind, inductor=False):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0))
    apply, params, buffers = fdp.functionalize(model)

    def loss(p, x):  # (from the logits: HF's labels= loss warns once through logging, which dynamo refuses)
        logits = apply(p, buffers, input_ids=x)[0].logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), x[:, 1:].reshape(-1))

    kw = {**KINDS[kind], "param_dtype": torch.bfloat16}
    if kind == "units":
        kw["units"] = fdp.units(model, type(model.transformer.h[0]))
    out = []
    for compiled in (False, True):
        step = fdp.Reducer(params, group, **kw).grad_and_update(loss, _opt("clip_sgd"))
        state = step.init(params)
        p = step.shard(params) if kind == "units" else params
        run = (step.compile() if inductor else step.compile(backend="aot_eager")) if compiled else step
        g = torch.Generator().manual_seed(group.rank)
        for _ in range(3):
            p, state, _ = run(p, state, torch.randint(64, (2, 16), generator=g))
        out.append(p.full() if kind == "units" else dict(p))
    if inductor:  # (Inductor keeps a fused kernel's intermediates in fp32 where eager rounds each op to bf16)
        for k in out[0]:
            torch.testing.assert_close(out[1][k], out[0][k], rtol=2e-2, atol=1e-2)
        return True
    return all(torch.equal(out[0][k], out[1][k]) for k in out[0])


@pytest.mark.parametrize("kind", ["replicated", "units"])
@pytest.mark.slow
def test_hf_gpt2_compiled_with_bf16_params_equals_eager(kind):
    """A model nobody here wrote: HF GPT-2 (tiny config, tied head), bf16 params, clipping."""
    pytest.importorskip("transformers", reason="transformers is in the test extras; not installed here")
    skip_unless_dynamo_traces_fdp()
    import_compilers()
    assert fdp.testing.run(_hf_case, 2, backend="gloo", timeout=300, args=(kind,)) == [True, True]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_hf_gpt2_fully_sharded_under_inductor_with_fdps_memory_schedule_equals_eager():
    """HF GPT-2 (tiny, tied head: the embedding in the root, read by the head too), bf16 params,
    clipping, fully sharded, ``step.compile()`` under Inductor with fdp's passes (its blocks
    gathered again for the backward but the last, fills after their block's second gather,
    updates once reduced): the eager step's params within bf16's rounding."""
    pytest.importorskip("transformers", reason="transformers is in the test extras; not installed here")
    skip_unless_dynamo_traces_fdp()
    import_compilers(inductor=True)
    assert fdp.testing.run(_hf_case, 2, backend="gloo", timeout=900, args=("units", True)) == [True, True]
