"""Ranks that issue different collectives are named within seconds, not at the timeout:
gloo collectives that stall compare where every rank waits (``FDP_STALL_S``, through the
group's store), and with ``debug`` a fully sharded step fingerprints each unit gather, so a
unit called on some ranks only, or a step paired with another rank's ``step.accumulate``,
is named before it is issued; without ``debug`` a watchdog thread compares the stalled
gathers (point to point on gloo) and names them within seconds. Real gloo ranks, each run with a 60 s timeout: a desync that
were only caught by the timeout would fail these tests on its message."""

import os
import threading

import pytest
import torch
import torch.nn.functional as F
from models import Block, block_net, tokens

import fdp
from fdp._comm.collectives import all_reduce, broadcast


def different_collectives(group):
    os.environ["FDP_STALL_S"] = "2"
    try:
        if group.rank == 0:
            all_reduce(torch.ones(100), group, "all-reduce of the loss (step 1)")
        else:
            broadcast(torch.ones(100), 1, group, "broadcast of the buffers (step 1)")
        return "no error"
    except fdp.CollectiveError as e:
        return str(e)


def test_ranks_waiting_on_different_collectives_are_named_after_the_stall_not_the_timeout():
    """Rank 0 all-reduces while rank 1 broadcasts: neither can finish. The first rank to see
    the other's post raises naming both collectives (the other may then see its peer leave)."""
    out = fdp.testing.run(different_collectives, 2, backend="gloo", timeout=60)
    named = [o for o in out if "the ranks issued different collectives" in o]
    assert named, out
    msg = named[0]
    assert "all-reduce of the loss (step 1)" in msg and "broadcast of the buffers (step 1)" in msg, msg
    assert "Named after 2s of waiting (FDP_STALL_S)" in msg, msg


def fully_sharded(group, case, debug=True):
    net = block_net(seed=3)
    if case == "branch":  # a data-dependent branch: rank 1 skips the second block
        def forward(x):
            x = net.emb(x)
            for i, block in enumerate(net.blocks):
                if not (i == 1 and group.rank == 1):
                    x = block(x)
            return net.head(net.ln(x))
        net.forward = forward
    apply, params, buffers = fdp.functionalize(net)
    reducer = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block), debug=debug)
    step = reducer.grad_and_update(
        lambda p, x, y: F.cross_entropy(apply(p, buffers, x)[0].flatten(0, 1), y.flatten()), fdp.optim.adamw(lr=1e-2))
    params = step.shard(params)
    state = step.init(params)
    if case == "sleep":
        os.environ["FDP_STALL_S"] = "2"  # (the check looks well before the 6.4 s timeout)
        if group.rank == 1:  # computes (here: waits for nothing; its process is killed at the end) instead
            threading.Event().wait()  # of joining the step
            return "never"
    try:
        if case == "uneven":  # rank 0 feeds three micro-batches, rank 1 two
            for j in range(3 if group.rank == 0 else 2):
                step.accumulate(params, *tokens(group.rank, j))
        step(params, state, *tokens(group.rank, 5))
        return "no error"
    except fdp.ReplicaMismatchError as e:
        return str(e)


@pytest.mark.parametrize("case", ["branch", "uneven"])
def test_debug_names_a_unit_gathered_on_some_ranks_only_before_its_gather(case):
    out = fdp.testing.run(fully_sharded, 2, backend="gloo", timeout=60, args=(case,))
    for rank, msg in enumerate(out):
        assert "ranks are about to issue different collectives" in msg, (rank, msg)
        if case == "branch":
            assert "for the backward of its call 1: a step" in msg and "blocks." in msg, msg
        else:
            assert ("call 3: step.accumulate" in msg) != ("call 3: a step" in msg), msg


def named_without_debug(group, case):
    os.environ["FDP_STALL_S"] = "2"
    try:
        return fully_sharded(group, case, debug=False)
    except fdp.CollectiveError as e:
        return str(e)


@pytest.mark.parametrize("case", ["branch", "uneven"])
def test_without_debug_a_unit_gathered_on_some_ranks_only_is_named_within_seconds_on_every_rank(case):
    """Gloo's point-to-point gathers pair by unit and cannot be waited for in pieces: the
    watchdog thread compares the stalled gather with the other rank's wait and ends it. Both
    ranks raise naming the two collectives (the rank that found them first, or both), long before
    the 48 s timeout (the 60 s run's)."""
    out = fdp.testing.run(named_without_debug, 2, backend="gloo", timeout=60, args=(case,))
    for rank, msg in enumerate(out):
        assert "the ranks issued different collectives" in msg, (rank, msg)
        # (only the stall check says this; the timeout's message is another)
        assert "Named after 2s of waiting (FDP_STALL_S), not at the 48s timeout" in msg, msg
        if case == "branch":  # rank 1 skipped blocks.1: it waits for blocks.0's backward gather
            assert "all-gather of unit blocks.1's params (bucket 2, for the backward of its call 1: a step)" in msg, msg
            assert "all-gather of unit blocks.0's params (bucket 3, for the backward of its call 1: a step)" in msg, msg
        else:  # rank 1's step waits on its gradients' all-reduce; rank 0 on a gather of its third
            # micro-batch (call 3) or of its step (call 4), as far as its gathers paired with rank 1's
            assert "all-reduce of bucket 0 of" in msg, msg
            assert "of its call 3: step.accumulate" in msg or "of its call 4: a step" in msg, msg


@pytest.mark.slow  # (waits for the run's 8 s timeout)
def test_without_debug_a_gather_the_other_rank_never_joins_ends_at_the_timeout_naming_the_unit_and_the_way():
    """A rank that waits in no collective cannot be told from a slow one: the gather waits for
    the timeout, and its error names the unit and the call, what the stall check saw (the
    other rank never waited), and FDP_DEBUG."""
    with pytest.raises((fdp.CollectiveError, TimeoutError)) as info:
        fdp.testing.run(fully_sharded, 2, backend="gloo", timeout=8, args=("sleep", False))
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "all-gather of unit" in text and "of its call 1: a step" in text, text
    assert "never waited in a collective of this group" in text, text
    # the gather that timed out is the error, not one the clean-up met on the closed group after
    assert "pair closure" not in str(info.value), text
    assert "FDP_DEBUG=1 (or Reducer(debug=True)) names such a call before its gather" in text, text


def threads_uneven(group):
    return fully_sharded(group, "uneven", debug=False)


def test_on_threads_ranks_joining_different_collectives_are_named_at_once():
    """torch's threaded group pairs collectives by order, whatever they are: fdp.testing
    compares what each rank joined with, so rank 0's third micro-batch (a gather) against
    rank 1's step (its gradients' collective) is named, not a size mismatch deep in torch or
    data mixed silently."""
    with pytest.raises(fdp.CollectiveError) as info:
        fdp.testing.run(threads_uneven, 2, timeout=60)
    msg = str(info.value)
    assert "the ranks issued different collectives, which torch's threaded group paired by order" in msg, msg
    assert "rank 0 in all-gather of" in msg and "rank 1 in " in msg, msg
