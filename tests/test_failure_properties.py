"""A property test of failure handling (hypothesis): per example a step kind, a number of
micro-batches per cycle, clipping, an optimizer wrapper, a failure on rank 1 (in the forward
or the backward of micro-batch j, or in the update) at cycle 0 or 1, and a checkpoint round
trip; two gloo ranks run a user's loop that catches what fdp raises, then the same loop
without the fault (the failed piece skipped: a failed micro-batch fed with its loss times
zero, a cycle whose closing step failed left out, a refused state made anew where the first
run made it anew). Their params must be equal bit for bit, the replicas identical, and every
error one of fdp's named ones (or the injected one, on rank 1 only).

``make test`` draws a few examples; ``-m slow`` many more."""

import pytest
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from models import Block, FailOnce, block_net, tokens
from test_compositions import TransformFault
from trees import assert_trees_equal

import fdp

KINDS = ["replicated", "shard=True", "shard=params"]
WRAPPERS = {
    "adamw": lambda: fdp.optim.adamw(lr=1e-2, weight_decay=0.1),
    "inject-adamw": lambda: fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-2, betas=(0.8, 0.99)),
    "ema-adamw": lambda: fdp.optim.ema(fdp.optim.adamw(lr=1e-2), decay=0.9),
}
CYCLES = 4  # the failure is at cycle 0 or 1; a checkpoint round trip before the last


def build(group, spec, faulty):
    net = block_net(seed=31)
    if faulty:
        net.blocks[0].register_forward_pre_hook(lambda m, args: (FailOnce.apply(args[0]),))
    apply, params, buffers = fdp.functionalize(net)
    kw = {"shard": {"replicated": False, "shard=True": True, "shard=params": "params"}[spec["kind"]]}
    if kw["shard"] == "params":
        kw["units"] = fdp.units(net, Block)
    fault = TransformFault(rank=1, reach="element")
    parts = [fdp.optim.clip_by_global_norm(0.2)] if spec["clip"] else []
    if spec["where"] == "update":  # (in both runs: armed in the first only)
        parts.append(fault.transform)
    opt = fdp.optim.chain(*parts, WRAPPERS[spec["wrapper"]]()) if parts else WRAPPERS[spec["wrapper"]]()
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.002, first_bucket_cap_mb=0.002, hook_threshold_bytes=0, **kw)

    def loss(p, x, y, scale=1.0):
        return F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()) * scale

    step = reducer.grad_and_update(loss, opt)
    if kw["shard"] == "params":
        params = step.shard(params)
    return step, params, step.init(params), fault


# fdp's named errors a rank may see here; the last: a rank restored from another at a call
# given micro-batches it computed from its own params (they are discarded on every rank)
NAMED = ("failed on 1 other rank", "load a saved state", "Redo the whole cycle", "compute them again")


def loop(group, spec, faulty, events):
    """The user's loop. ``faulty``: inject the fault and record in ``events`` what was
    skipped or made anew; else replay ``events`` (per cycle) with no fault."""
    step, params, state, fault = build(group, spec, faulty)
    rank, micro = group.rank, spec["micro"]
    errors = []
    for c in range(CYCLES):
        if not faulty and "lost" in events.get(c, ()):
            continue
        if c == CYCLES - 1 and spec["checkpoint"]:  # a round trip through the whole-tree state
            state = step.state_from_tree(step.state_to_tree(state, params), params)
        here = faulty and c == spec["cycle"] and rank == 1
        for j in range(micro):
            x, y = tokens(rank, 10 * c + j)
            hit = here and j == spec["j"] and spec["where"] in ("forward", "backward")
            if hit and spec["where"] == "forward":
                x = x.float()  # the embedding raises in the forward
            elif hit:
                FailOnce.arm()
            if j < micro - 1:  # a micro-batch of the cycle
                zero = not faulty and ("zero", j) in events.get(c, ())
                try:
                    step.accumulate(params, x, y, 0.0 if zero else 1.0)
                except RuntimeError as e:
                    assert hit, f"rank {rank}, cycle {c}, micro-batch {j}: {e}"
                    events.setdefault(c, []).append(("zero", j))
                continue
            fault.armed = here and spec["where"] == "update"
            for _ in range(2):  # the closing step; once more after a refused state is made anew
                if not faulty and "reinit" in events.get(c, ()):
                    state = step.init(params)
                try:
                    params, state, _ = step(params, state, x, y)
                    break
                except (RuntimeError, fdp.CollectiveError) as e:
                    msg = str(e)
                    errors.append((c, type(e).__name__, msg))
                    if not (any(n in msg for n in NAMED) or (rank == 1 and ("injected" in msg or "indices" in msg))):
                        raise
                    if "load a saved state" in msg and not isinstance(e, fdp.CollectiveError):
                        # a refused state (a step before left the replicas' states apart)
                        if faulty:
                            events.setdefault(c, []).append("reinit")
                        state = step.init(params)
                        continue  # (a refusal raises before the step runs: its micro-batches wait)
                    restored = any("restores this rank's params" in n for n in getattr(e, "__notes__", ()))
                    if faulty and not restored:
                        events.setdefault(c, []).append("lost")
                    break
            fault.armed = False
    full = params.full() if isinstance(params, fdp.ShardedParams) else params
    return full, errors


def both(group, spec):
    events: dict = {}
    faulty, errors = loop(group, spec, True, events)
    # Cycle-level decisions ("lost", "reinit") are every rank's: take them from rank 1's,
    # and check below that rank 0 made the same ones.
    clean, _ = loop(group, spec, False, events)
    decided = {c: [e for e in ev if isinstance(e, str)] for c, ev in events.items()}
    return faulty, clean, errors, {c: ev for c, ev in decided.items() if ev}


SPECS = st.fixed_dictionaries({
    "kind": st.sampled_from(KINDS),
    "micro": st.integers(1, 3),
    "clip": st.booleans(),
    "wrapper": st.sampled_from(list(WRAPPERS)),
    "where": st.sampled_from(["forward", "backward", "update"]),
    "cycle": st.integers(0, 1),
    "j": st.integers(0, 2),
    "checkpoint": st.booleans(),
}).map(lambda s: {**s, "j": min(s["j"], s["micro"] - 1)})


def check(spec):
    (f0, c0, e0, ev0), (f1, c1, e1, ev1) = fdp.testing.run(both, 2, backend="gloo", timeout=120, args=(spec,))
    assert ev0 == ev1, f"{spec}: the ranks decided differently: {ev0} / {ev1}"
    assert_trees_equal(f0, f1, f"{spec}: the replicas after the failure")
    assert_trees_equal(f0, c0, f"{spec}: rank 0 against the run without the failed piece")
    assert_trees_equal(f1, c1, f"{spec}: rank 1 against the run without the failed piece")
    assert not any("injected" in m or "indices" in m for _, _, m in e0), e0


@settings(max_examples=4)
@given(SPECS)
# Found by this test: a rank restored at a call given micro-batches (which every rank then
# discards, raising) kept the stale params it had passed in, when the step had copied them in.
@example({"kind": "replicated", "micro": 2, "clip": True, "wrapper": "adamw", "where": "update", "cycle": 0, "j": 0,
          "checkpoint": False})
def test_failures_anywhere_equal_the_run_without_the_failed_piece(spec):
    check(spec)


@pytest.mark.slow
@settings(max_examples=60)
@given(SPECS)
def test_failures_anywhere_equal_the_run_without_the_failed_piece_many_examples(spec):
    check(spec)
