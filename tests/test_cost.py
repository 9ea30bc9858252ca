"""fdp.cost: the alpha-beta costs, the bucket assignment, the step prediction and the caps
choice against hand-computed cases; bucket_cap_mb="auto" freezes one plan on every rank."""

import math
import statistics
import time
from dataclasses import replace

import pytest
import torch

import fdp
from fdp._plan.bucket import MiB
from fdp.cost import DDP_CAPS, AutoCaps, Link, StepProfile, choose_caps, predict
from fdp.cost._contention import lost, reached, share


def test_ring_and_tree_costs_match_the_formulas():
    link = Link(alpha=2e-5, beta=1e-9)
    n = 8e6
    # ring all-reduce: 2(p-1) messages, 2(p-1)/p of the buffer each way
    assert link.all_reduce(n, 4) == pytest.approx(6 * 2e-5 + 1.5 * n * 1e-9)
    assert link.all_reduce(n, 2) == pytest.approx(2 * 2e-5 + n * 1e-9)
    # tree: 2 ceil(log2 p) messages, twice the buffer
    assert link.all_reduce(n, 64, "tree") == pytest.approx(12 * 2e-5 + 2 * n * 1e-9)
    assert link.all_reduce(n, 5, "tree") == pytest.approx(6 * 2e-5 + 2 * n * 1e-9)
    assert link.all_reduce(1e3, 512, "best") == link.all_reduce(1e3, 512, "tree")  # latency-bound: tree
    assert link.all_reduce(1e9, 4, "best") == link.all_reduce(1e9, 4, "ring")  # bandwidth-bound: ring
    # reduce-scatter and all-gather: half an all-reduce each
    assert link.reduce_scatter(n, 4) == pytest.approx(3 * 2e-5 + 0.75 * n * 1e-9)
    assert link.reduce_scatter(n, 4) + link.all_gather(n, 4) == pytest.approx(link.all_reduce(n, 4))
    assert link.all_reduce(n, 1) == link.reduce_scatter(n, 1) == 0.0
    with pytest.raises(ValueError, match="algorithm"):
        link.all_reduce(n, 4, "bcube")


def test_link_parse_and_fit():
    assert Link.parse("100Gbit", alpha=1e-6).beta == pytest.approx(8 / 100e9)
    assert Link.parse("400Mbit", alpha=0).beta == pytest.approx(8 / 400e6)
    assert Link.parse("10GB", alpha=0).beta == pytest.approx(1 / 10e9)
    with pytest.raises(ValueError, match="link rate"):
        Link.parse("fast", alpha=0)
    true = Link(alpha=3e-5, beta=2e-9)
    sizes = [4096, 512 * 1024, 8 * MiB]
    for world in (2, 3, 4):
        fit = Link.fit(sizes, [true.all_reduce(n, world) for n in sizes], world)
        assert fit.alpha == pytest.approx(true.alpha, rel=1e-6), world
        assert fit.beta == pytest.approx(true.beta, rel=1e-6), world
        # A small collective slowed by a late rank raises alpha, never tilts beta (measured on
        # a 0.5 Gbit/s shaped link: a 3.4 ms 4 KiB point made the joint fit read 0.62 Gbit/s).
        late = [3e-3] + [true.all_reduce(n, world) for n in sizes[1:]]
        fit = Link.fit(sizes, late, world)
        assert fit.beta == pytest.approx(true.beta, rel=1e-6), world
        assert fit.all_reduce(sizes[0], world) == pytest.approx(3e-3, rel=1e-6)
    # Two sizes: the line through them; one: all latency.
    two = Link.fit([1000, 2000], [2e-3, 3e-3], 2)
    assert (two.alpha, two.beta) == pytest.approx((0.5e-3, 1e-6))
    assert Link.fit([1000], [2e-3], 2).all_reduce(1000, 2) == pytest.approx(2e-3)
    # Noise that inverts the larger sizes (a 256 KiB median above a 2 MiB one on loopback):
    # the line from the smallest size to the largest, never a free link.
    inverted = Link.fit([4096, 256 * 1024, 2 * MiB], [1e-4, 2.1e-3, 2e-3], 2)
    assert inverted.beta == pytest.approx((2e-3 - 1e-4) / (2 * MiB - 4096))


def two_leaves(**kw):
    """Two 4 kB leaves: the last one's gradient arrives at 10 ms, the first's at 20 ms."""
    kw.setdefault("tail", 0.001)
    return StepProfile(leaf_bytes=(4000, 4000), leaf_group=(0, 0), leaf_ready=(0.020, 0.010),
                       backward_end=0.021, **kw)


def test_predict_a_bucket_per_leaf_by_hand():
    link = Link(alpha=0.001, beta=1e-6)  # on 2 ranks: 2 ms + 4 ms per 4 kB bucket
    p = predict(two_leaves(), (4000,), link, 2, hook_threshold_bytes=0)
    # bucket 0 ('[1]') on the wire 10..16 ms, bucket 1 20..26 ms; backward ends at 21
    assert p.buckets == 2
    assert p.comm_done == pytest.approx(0.026)
    assert p.exposed_comm == pytest.approx(0.005)
    assert p.step == pytest.approx(0.027)  # + tail
    # one bucket: ready at 20 ms, 2 + 8 ms on the wire
    one = predict(two_leaves(), (10**6,), link, 2, hook_threshold_bytes=0)
    assert (one.buckets, one.comm_done) == (1, pytest.approx(0.030))
    # 4 ranks: 6 ms + 1.5 * 4 ms per bucket; the second waits for the first (16 > 20? no: 10+12=22)
    four = predict(two_leaves(), (4000,), link, 4, hook_threshold_bytes=0)
    assert four.comm_done == pytest.approx(0.022 + 0.012)
    # bf16 on the wire: half the bytes
    half = predict(two_leaves(), (4000,), link, 2, wire_ratio=0.5, hook_threshold_bytes=0)
    assert half.comm_done == pytest.approx(0.020 + 0.002 + 0.002)
    # a world of one: no communication, the step is the backward and the tail
    assert predict(two_leaves(), (4000,), link, 1).step == pytest.approx(0.022)


def test_predict_unhooked_buckets_launch_after_the_backward():
    link = Link(alpha=0.001, beta=1e-6, overhead=0.0005)
    prof = two_leaves(fill_per_leaf=0.0001, fill_per_byte=0.0)
    p = predict(prof, (4000,), link, 2, hook_threshold_bytes=10**6)  # no bucket worth a hook
    # backward 21 ms; bucket 0 issued at 21 + 0.5 + 0.1, bucket 1 at 21.6 + 0.6; each 6 ms on the wire
    assert p.backward_end == pytest.approx(0.021)
    assert p.comm_done == pytest.approx(0.0216 + 0.006 + 0.006)
    # hooked, the launch overhead lengthens the backward by one overhead per bucket
    q = predict(prof, (4000,), link, 2, hook_threshold_bytes=0)
    assert q.backward_end == pytest.approx(0.022)


def test_predict_update_after_the_last_bucket():
    link = Link(alpha=0.001, beta=1e-6)
    prof = two_leaves(update_fixed=0.002, update_per_byte=0.0)
    p = predict(prof, (10**6,), link, 2, hook_threshold_bytes=0)
    assert p.step == pytest.approx(0.030 + 0.002 + 0.001)  # comm done, update, tail


def test_predict_sharded_by_hand():
    """shard=True: reduce-scatters in place of all-reduces, the update on a 1/world slice,
    then one all-gather per bucket, in order, each after its bucket's update."""
    link = Link(alpha=0.001, beta=1e-6)  # on 2 ranks: a 4 kB reduce-scatter or all-gather is 1 + 2 ms
    p = predict(two_leaves(tail=0.0), (4000,), link, 2, hook_threshold_bytes=0, shard=True)
    # reduce-scatters 10..13 and 20..23 ms; backward ends at 21; gathers 23..26, 26..29
    assert p.comm_done == pytest.approx(0.023)
    assert p.step == pytest.approx(0.029)
    assert p.exposed_comm == pytest.approx(0.002 + 0.006)
    upd = two_leaves(tail=0.0, update_fixed=0.001, update_per_byte=0.0)
    q = predict(upd, (4000,), link, 2, hook_threshold_bytes=0, shard=True)
    # bucket 0 updates inside the backward (which ends at 22), bucket 1 at 23..24; the
    # gathers start after the last reduce-scatter (23): 23..26, then 26..29
    assert q.backward_end == pytest.approx(0.022)
    assert q.step == pytest.approx(0.029)
    assert q.exposed_comm == pytest.approx(0.001 + 0.005)
    # the slice's update: 1/world of the bytes
    per_byte = two_leaves(tail=0.0, update_per_byte=1e-6)
    assert predict(per_byte, (10**6,), link, 2, hook_threshold_bytes=0, shard=True).step == pytest.approx(
        0.020 + 0.005 + 0.004 + 0.005)  # reduce-scatter of 8 kB, update of 4 kB, all-gather
    # a world of one: nothing to scatter or gather
    assert predict(two_leaves(), (4000,), link, 1, shard=True).step == predict(two_leaves(), (4000,), link, 1).step


def test_choose_caps_sharded_prices_the_gathers():
    prof = deep_profile()
    link = Link(alpha=1e-5, beta=1.5e-9)
    c = choose_caps(prof, link, 2, shard=True)
    assert c.predicted.step == pytest.approx(predict(prof, c.caps, link, 2, shard=True).step)
    assert c.baseline.step == pytest.approx(predict(prof, DDP_CAPS, link, 2, shard=True).step)
    assert c.baseline.step > predict(prof, DDP_CAPS, link, 2).step  # the gathers after the last bucket
    assert fdp.Reducer({"w": torch.zeros(4)}, bucket_cap_mb="auto", shard=True).tuning.shard


def deep_profile(n=32, leaf=MiB, compute=0.002):
    """n leaves of ``leaf`` bytes arriving every ``compute`` seconds during the backward."""
    ready = tuple(compute * (n - i) for i in range(n))  # the last leaf first
    return StepProfile(leaf_bytes=(leaf,) * n, leaf_group=(0,) * n, leaf_ready=ready,
                       backward_end=compute * n + 0.001, tail=0.0)


def test_choose_caps_smaller_buckets_when_bandwidth_can_hide_behind_the_backward():
    prof = deep_profile()
    link = Link(alpha=1e-5, beta=1.5e-9)  # ~1.6 ms per MiB on 2 ranks, under 2 ms of compute per leaf
    c = choose_caps(prof, link, 2)
    assert c.caps[-1] < DDP_CAPS[-1]
    assert c.predicted.step < c.baseline.step * 0.8
    assert c.gain > 0.2
    assert predict(prof, c.caps, link, 2).step == pytest.approx(c.predicted.step)


def test_choose_caps_keeps_large_buckets_when_latency_dominates():
    prof = deep_profile(n=200, leaf=20_000, compute=1e-5)
    link = Link(alpha=5e-3, beta=1e-10)  # 10 ms per message: one bucket is best
    c = choose_caps(prof, link, 2)
    assert c.predicted.buckets <= c.baseline.buckets
    assert c.predicted.step <= c.baseline.step


def test_choose_caps_keeps_ddps_when_the_gain_is_below_the_threshold():
    prof = deep_profile()
    c = choose_caps(prof, Link(0.0, 0.0), 2)  # free link: every plan predicts the same step
    assert c.caps == DDP_CAPS and c.gain == 0.0


def test_profile_from_timelines_interpolates_by_bytes():
    params = {"a": torch.zeros(1000), "b": torch.zeros(3000), "c": torch.zeros(4000)}
    plan = fdp.BucketPlan.build(params, bucket_caps_mb=[20_000 / MiB])  # [c, b] then [a]
    assert [b.paths for b in plan.buckets] == [("['c']", "['b']"), ("['a']",)]
    tl = fdp.Timeline(step=0, kind="grad", backward_start=0.010, backward_end=0.040, end=0.050, buckets=[
        fdp.BucketTimes(0, 28000, ready=0.024, launch=0.025, done=0.030),
        fdp.BucketTimes(1, 4000, ready=0.035, launch=0.036, done=0.045)])
    prof = StepProfile.from_timelines(plan, [tl], Link(0.0, 0.0), hook_threshold_bytes=0)
    # bucket 0 arrives 10..24 ms: c after 16 of its 28 kB, b at its end; a at 35 ms
    assert prof.leaf_ready == pytest.approx((0.035, 0.024, 0.010 + 0.014 * 16 / 28))
    assert prof.backward_end == pytest.approx(0.040)
    assert prof.tail == pytest.approx(0.005)
    assert prof.leaf_bytes == (4000, 12000, 16000)


def test_profile_from_fused_timelines_fits_the_update_and_leaves_it_out_of_the_tail():
    params = {"a": torch.zeros(1000), "b": torch.zeros(3000), "c": torch.zeros(4000)}
    plan = fdp.BucketPlan.build(params, bucket_caps_mb=[20_000 / MiB])  # 28 kB, then 4 kB
    def timeline(u0, u1, gathered=None):
        return fdp.Timeline(step=0, kind="grad", backward_start=0.010, backward_end=0.040, end=0.060, buckets=[
            fdp.BucketTimes(0, 28000, ready=0.024, launch=0.025, done=0.030, update_start=0.030,
                            update_end=0.030 + u0, gathered=gathered),
            fdp.BucketTimes(1, 4000, ready=0.035, launch=0.036, done=0.045, update_start=0.045,
                            update_end=0.045 + u1)])
    # 1 ms + 0.25 us/byte: 8 ms for 28 kB, 2 ms for 4 kB
    prof = StepProfile.from_timelines(plan, [timeline(0.008, 0.002)], Link(0.0, 0.0), hook_threshold_bytes=0)
    assert (prof.update_fixed, prof.update_per_byte) == (pytest.approx(0.001), pytest.approx(0.25e-6))
    assert prof.tail == pytest.approx(0.060 - 0.047)  # from the last update's end
    # bucket 0's update (30..38 ms) ran inside the backward: the update term's, not the backward's
    assert prof.backward_end == pytest.approx(0.040 - 0.008)
    # sharded (a slice of 1/2 updated): per byte of the slice; the last gather ends the tail
    half = StepProfile.from_timelines(plan, [timeline(0.008, 0.002, gathered=0.055)], Link(0.0, 0.0),
                                      hook_threshold_bytes=0, update_fraction=0.5)
    assert half.update_per_byte == pytest.approx(0.5e-6) and half.tail == pytest.approx(0.005)
    # buckets of one size: no line through them, a cost per byte (not a huge slope)
    same = fdp.BucketPlan.build({"a": torch.zeros(1000), "b": torch.zeros(1000)}, bucket_caps_mb=[4000 / MiB])
    tl = fdp.Timeline(step=0, kind="grad", backward_start=0.0, backward_end=0.02, end=0.03, buckets=[
        fdp.BucketTimes(0, 4000, ready=0.01, done=0.012, update_start=0.012, update_end=0.014),
        fdp.BucketTimes(1, 4000, ready=None, done=0.017, update_start=0.017, update_end=0.0195)])  # unhooked
    p2 = StepProfile.from_timelines(same, [tl], Link(0.0, 0.0), hook_threshold_bytes=0)
    assert p2.update_fixed == 0.0 and p2.update_per_byte == pytest.approx(0.00225 / 4000)


def test_contention_pieces_by_hand():
    """A collective on the wire 10..20 ms that takes 4 ms of compute from the backward."""
    wire = [(0.010, 0.010, 0.004, 4000)]
    assert (share(0.010, 0.010, 0.005), share(0.010, 0.010, 0.015), share(0.010, 0.010, 0.030)) == pytest.approx((0, 0.5, 1))
    assert lost(wire, 0.015) == pytest.approx(0.002) and lost(wire, 0.025) == pytest.approx(0.004)
    assert reached(wire, 0.005) == pytest.approx(0.005)  # before it: no delay
    assert reached(wire, 0.013) == pytest.approx(0.015)  # inside: 15 - 2 = 13
    assert reached(wire, 0.020) == pytest.approx(0.024)  # after it: all 4 ms
    assert reached([(0.010, 0.010, 0.010, 0)], 0.012) == pytest.approx(0.022)  # a stall: after it
    for f in (0.0, 0.011, 0.017, 0.03):  # the inverse of t - lost(t)
        t = reached(wire, f)
        assert t - lost(wire, t) == pytest.approx(f)


def test_predict_with_contention_by_hand():
    # a bucket per leaf, 6 ms each on the wire; each takes 0.5 us/byte x 4 kB = 2 ms of backward
    link = Link(alpha=0.001, beta=1e-6)
    p = predict(two_leaves(contention=0.5e-6), (4000,), link, 2, hook_threshold_bytes=0)
    # bucket 0 on the wire 10..16 ms (2 ms lost); the other leaf arrives at 20 + 2 = 22 ms, on
    # the wire 22..28 ms; the backward's 21 ms of work ends at 23.5 ms (2 + 0.5 of 1/3 of 6 ms)
    assert p.backward_end == pytest.approx(0.0235)
    assert p.comm_done == pytest.approx(0.028)
    assert p.exposed_comm == pytest.approx(0.0045)
    assert p.step == pytest.approx(0.029)
    # bf16 on the wire (2 + 2 ms a bucket): the same 2 ms lost each, per gradient byte as
    # calibrated (the calibration ran with the same wire dtype); 21 ms ends at 24 (half of 22..26)
    half = predict(two_leaves(contention=0.5e-6), (4000,), link, 2, wire_ratio=0.5, hook_threshold_bytes=0)
    assert half.backward_end == pytest.approx(0.024)
    # no contention: as before
    assert predict(two_leaves(), (4000,), link, 2, hook_threshold_bytes=0).backward_end == pytest.approx(0.021)
    # one bucket (8 kB: 4 of its 10 ms lost to the backward) from 20 ms: the backward's last
    # 1 ms of work goes at 0.6 speed, t - 0.4 (t - 20) = 21
    one = predict(two_leaves(contention=0.5e-6), (10**6,), link, 2, hook_threshold_bytes=0)
    assert one.backward_end == pytest.approx(0.013 / 0.6) and one.comm_done == pytest.approx(0.030)
    # unhooked buckets go after the backward: nothing beside it
    late = predict(two_leaves(contention=0.5e-6), (4000,), link, 2, hook_threshold_bytes=10**6)
    assert late.backward_end == pytest.approx(0.021)


def test_profile_contention_from_overlapped_and_deferred_steps():
    params = {"a": torch.zeros(1000), "b": torch.zeros(3000), "c": torch.zeros(4000)}
    plan = fdp.BucketPlan.build(params, bucket_caps_mb=[20_000 / MiB])  # 28 kB, then 4 kB
    tl = fdp.Timeline(step=0, kind="grad", backward_start=0.010, backward_end=0.040, end=0.050, buckets=[
        fdp.BucketTimes(0, 28000, ready=0.024, launch=0.025, done=0.030),
        fdp.BucketTimes(1, 4000, ready=0.035, launch=0.036, done=0.045)])
    prof = StepProfile.from_timelines(plan, [tl], Link(0.0, 0.0), hook_threshold_bytes=0, contention=1e-7)
    # 2.8 ms lost over 25..30 ms, 0.4 ms over 36..45 ms (4/9 of it by the backward's end)
    assert prof.backward_end == pytest.approx(0.040 - 0.0028 - 0.0004 * 4 / 9)
    assert prof.leaf_ready[0] == pytest.approx(0.035 - 0.0028)  # 'a', after bucket 0's collective
    assert prof.leaf_ready[2] == pytest.approx(0.010 + 0.014 * 16 / 28)  # before any: unchanged
    assert prof.overlapped_bytes == pytest.approx(28000 + 4000 * 4 / 9)
    assert prof.contention == 1e-7
    # The same plan with its launches deferred past the backward (30 ms here): no overheads
    # inside it, the hooked buckets' fills added as if inside (as the overlapped steps had them)
    link = Link(0.0, 0.0, overhead=0.001)
    late = fdp.Timeline(step=0, kind="grad", backward_start=0.010, backward_end=0.030, end=0.050, buckets=[
        fdp.BucketTimes(0, 28000, ready=0.024, launch=0.031, done=0.035),
        fdp.BucketTimes(1, 4000, ready=0.029, launch=0.036, done=0.045)])
    free = StepProfile.from_timelines(plan, [late], link, hook_threshold_bytes=0)
    assert free.backward_end == pytest.approx(0.030 + 32000 * free.fill_per_byte)
    assert free.overlapped_bytes == 0
    over = StepProfile.from_timelines(plan, [tl], link, hook_threshold_bytes=0)
    assert over.backward_end == pytest.approx(0.040 - 2 * 0.001)
    both = StepProfile.with_contention(free, over)  # its longer backward per byte beside it
    assert both.contention == pytest.approx((over.backward_end - free.backward_end) / over.overlapped_bytes)
    assert both.leaf_ready == free.leaf_ready and both.backward_end == free.backward_end
    assert StepProfile.with_contention(over, free).contention == 0.0  # nothing on the wire: none
    assert StepProfile.with_contention(over, replace(over, backward_end=0.0)).contention == 0.0  # never < 0


def test_profile_over_ranks_takes_each_steps_slowest_rank_then_the_median_step():
    def prof(ready, bwd, tail=0.001, **kw):
        return StepProfile((4, 4, 4), (0, 0, 0), ready, backward_end=bwd, tail=tail, **kw)

    a = prof((0.030, 0.020, None), 0.031, tail=0.002)
    b = prof((0.025, 0.022, 0.010), 0.035, fill_per_leaf=1e-6)
    s = StepProfile.combine([a, b])
    assert s.leaf_ready == (0.030, 0.022, None)  # a leaf one rank did not see stays unknown
    assert (s.backward_end, s.tail, s.fill_per_leaf) == (0.035, 0.002, 1e-6)
    # two ranks take turns being slow: every step is as slow as its slow rank (0.050),
    # which the slower of the two medians (0.040) would miss
    fast, slow = prof((0.02, 0.01, 0.005), 0.030), prof((0.04, 0.03, 0.02), 0.050)
    rank0, rank1 = [fast, slow], [slow, fast]
    assert StepProfile.over_ranks([rank0, rank1]).backward_end == 0.050
    medians = [StepProfile.combine(r, statistics.median).backward_end for r in (rank0, rank1)]
    assert max(medians) < 0.050


def link_run(group, timed: bool):
    link = fdp.cost.measure_link(group)  # 4 KiB, 512 KiB, 8 MiB: the slope from a 16x span
    if not timed:
        return link, None
    t = torch.ones(8 * MiB // 4)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.distributed.all_reduce(t)
        times.append(time.perf_counter() - t0)
    return link, sorted(times)[2]


def test_measure_link_is_the_same_on_every_rank():
    (a, _), (b, _) = fdp.testing.run(link_run, 2, backend="gloo", args=(False,))
    assert a == b, "every rank fits the slowest rank's times"
    assert a.alpha >= 0 and a.beta > 0 and a.overhead > 0


@pytest.mark.perf
def test_measure_link_prices_a_real_all_reduce():
    (a, t_a), _ = fdp.testing.run(link_run, 2, backend="gloo", args=(True,))
    # the fitted link prices the largest measured size as a fresh all-reduce of it measures
    # (loose: a 2-core VM; a link off by the joint fit's tilt was within this too, the fit's
    # rule is checked exactly in test_link_parse_and_fit)
    assert 0.25 < a.all_reduce(8 * MiB, 2) / t_a < 4


# ---------------------------------------------------------------------------- "auto" on ranks
def auto_run(group, steps):
    torch.manual_seed(0)
    params = {f"w{i}": torch.randn(40_000) for i in range(6)}
    reducer = fdp.Reducer(params, group, bucket_cap_mb="auto", hook_threshold_bytes=0)
    x = torch.full((40_000,), float(group.rank + 1))

    def loss(p):
        return sum((w * x).sin().sum() for w in p.values())

    grad_fn = reducer.grad(loss)
    out = dict(fingerprints=[], frozen=[], exact=[])
    with pytest.raises(RuntimeError, match="calibrate"):
        reducer.grad_and_update(loss, fdp.optim.sgd(lr=0.1))
    out["deferred"] = []
    for _ in range(steps):
        g = grad_fn(params)
        tl = reducer.last_step.timeline
        out["deferred"].append(all(bt.launch >= tl.backward_end for bt in tl.buckets))
        local = torch.func.grad(loss)(params)
        out["exact"].append(all(torch.allclose(g[k], fdp.pmean(local[k], group=group), atol=1e-6) for k in g))
        out["fingerprints"].append(reducer.plan.fingerprint)
        out["frozen"].append(reducer.tuning.frozen)
    out["choice"] = reducer.tuning.choice
    out["steps"] = reducer.steps
    out["calibration"] = fdp.BucketPlan.build(params, bucket_caps_mb=AutoCaps.CALIBRATION_CAPS_MB).fingerprint
    step = reducer.grad_and_update(loss, fdp.optim.sgd(lr=0.1))  # after the freeze: the frozen caps
    state = step.init(params)
    new, state, _ = step(params, state)
    out["fused_ok"] = all(torch.allclose(new[k], params[k] - 0.1 * g[k], atol=1e-6) for k in g)
    out["after"] = reducer.plan.fingerprint
    return out


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_auto_freezes_the_same_plan_on_every_rank(backend):
    calibration = AutoCaps.WARMUP + AutoCaps.STEPS + AutoCaps.DEFERRED
    steps = calibration + 3
    res = fdp.testing.run(auto_run, 2, backend=backend, args=(steps,))
    freeze = calibration - 1  # the step on which it freezes
    # after the warm-up, every other step (DEFERRED of them) launches nothing during its backward
    deferred = [False] * AutoCaps.WARMUP + [True, False] * AutoCaps.DEFERRED
    deferred += [False] * (steps - len(deferred))
    for r in res:
        assert r["frozen"] == [False] * freeze + [True] * (steps - freeze)
        assert r["deferred"] == deferred
        assert all(r["exact"]), "calibration and frozen steps average exactly"
        assert set(r["fingerprints"][:freeze]) == {r["calibration"]}
        frozen = set(r["fingerprints"][freeze:])
        assert len(frozen) == 1 and r["after"] in frozen, "a frozen plan never changes"
        assert r["steps"] == steps and r["fused_ok"]
    assert res[0]["fingerprints"] == res[1]["fingerprints"]
    assert res[0]["choice"] == res[1]["choice"]
    assert res[0]["choice"].caps != AutoCaps.CALIBRATION_CAPS_MB
    assert math.isfinite(res[0]["choice"].predicted.step)
    for pred in (res[0]["choice"].predicted, res[0]["choice"].baseline):  # every field survives the broadcast
        assert pred.backward_end > 0 and pred.comm_done >= 0 and pred.step >= pred.backward_end


def test_calibrate_with_the_fused_steps_optimizer_prices_its_update():
    params = {"w": torch.randn(300_000), "b": torch.randn(1000)}
    loss = lambda p: p["w"].square().sum() + p["b"].sum()  # noqa: E731
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(1e-3))
    reducer = fdp.Reducer(params, bucket_cap_mb="auto")
    with pytest.raises(TypeError, match="not element-wise"):  # one the fused step cannot run
        fdp.cost.calibrate(reducer, loss, params, optimizer=fdp.optim.adafactor(lr=1e-3))
    # a partition runs in the fused step: priced at its costliest label's kernel (AdamW's)
    part = fdp.optim.partition(lambda path, p: "w" if p.dim() else "b",
                               {"w": fdp.optim.adamw(1e-3), "b": fdp.optim.sgd(0.1)})
    assert fdp.cost._autocaps.update_cost(part, reducer.plan)[1] > 0
    fdp.cost.calibrate(reducer, loss, params, optimizer=opt)
    prof = reducer.tuning.profile
    assert reducer.tuning.optimizer is opt and prof.update_per_byte > 0 and prof.update_fixed >= 0
    fixed, per_byte = fdp.cost._autocaps.update_cost(opt, reducer.plan)
    assert (fixed, per_byte) != (0.0, 0.0)  # (how well it prices a timed update: the perf test below)
    # the step built afterwards runs on the frozen caps
    step = reducer.grad_and_update(loss, opt)
    new, _, _ = step(params, step.init(params))
    assert set(new) == {"w", "b"}
    # without an optimizer: no update term
    plain = fdp.Reducer(params, bucket_cap_mb="auto")
    fdp.cost.calibrate(plain, loss, params)
    assert plain.tuning.profile.update_per_byte == 0 and plain.tuning.profile.update_fixed == 0


@pytest.mark.perf
def test_update_cost_prices_a_timed_update():
    params = {"w": torch.randn(300_000), "b": torch.randn(1000)}
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(1e-3))
    reducer = fdp.Reducer(params, bucket_cap_mb="auto")
    fdp.cost.calibrate(reducer, lambda p: p["w"].square().sum() + p["b"].sum(), params, optimizer=opt)
    fixed, per_byte = fdp.cost._autocaps.update_cost(opt, reducer.plan)
    # the fitted line prices a bucket's update about as a timed one costs (loose: a 2-core VM)
    flat = [torch.zeros(2**20), torch.ones(2**20), torch.zeros(2**20), torch.zeros(2**20)]
    t0 = time.perf_counter()
    opt.form.parts[-1].form.leaf_kernel.step(0, [flat[0]], [flat[1]], [[flat[2]], [flat[3]]], torch.ones(()))
    took = time.perf_counter() - t0
    assert 0.2 < (fixed + 4 * 2**20 * per_byte) / took < 5


def test_calibrate_runs_the_auto_steps_and_refuses_fixed_caps():
    params = {"w": torch.randn(1000)}
    reducer = fdp.Reducer(params, bucket_cap_mb="auto")
    choice = fdp.cost.calibrate(reducer, lambda p: p["w"].square().sum(), params)
    assert reducer.tuning.frozen and choice is reducer.tuning.choice
    assert reducer.steps == AutoCaps.WARMUP + AutoCaps.STEPS + AutoCaps.DEFERRED
    with pytest.raises(ValueError, match="auto"):
        fdp.cost.calibrate(fdp.Reducer(params), lambda p: p["w"].sum(), params)
    with pytest.raises(ValueError, match="bucket caps.*'auto'"):
        fdp.Reducer(params, bucket_cap_mb="fast")
    with pytest.raises(ValueError, match="chooses every cap"):  # not silently ignored
        fdp.Reducer(params, bucket_cap_mb="auto", first_bucket_cap_mb=2)
    with pytest.raises(ValueError, match="rate must be > 0"):
        fdp.cost.Link.parse("0Gbit", alpha=1e-5)
