"""Properties on random pytrees and simulated ranks (hypothesis).

Random trees: nested dicts, lists and tuples; 0-d and empty leaves; fp32, fp16, bf16 and
fp64; random bucket caps; world sizes 1-4. Threads for the bulk, gloo processes for a
smaller sample (real processes, real asynchrony).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fdp
from fdp import _tree
from fdp._plan.bucket import MiB

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

leaf_specs = st.tuples(st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple), st.sampled_from(DTYPES))
keys = st.text("abcdefgh", min_size=1, max_size=3)
tree_specs = st.recursive(
    leaf_specs,
    lambda kids: st.one_of(
        st.dictionaries(keys, kids, min_size=1, max_size=3),
        st.lists(kids, min_size=1, max_size=3),
        st.lists(kids, min_size=1, max_size=3).map(tuple),
    ),
    max_leaves=12,
)
caps = st.lists(st.integers(1, 300), min_size=1, max_size=3)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GLOO = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def build(spec, make):
    """Instantiate a tree spec; `make(shape, dtype, i)` creates leaf number i."""
    counter = iter(range(10**6))

    def go(s):
        if isinstance(s, dict):
            return {k: go(v) for k, v in s.items()}
        if isinstance(s, list):
            return [go(v) for v in s]
        if isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], torch.dtype):
            return make(s[0], s[1], next(counter))
        return tuple(go(v) for v in s)

    return go(spec)


def integer_tree(spec, rank, world_size):
    """Leaves k * world_size with small integers k: every share and sum is exact."""
    def make(shape, dtype, i):
        g = torch.Generator().manual_seed(1000 * rank + i)
        return (torch.randint(-8, 9, shape, generator=g) * world_size).to(dtype)
    return build(spec, make)


def normal_tree(spec, rank):
    def make(shape, dtype, i):
        g = torch.Generator().manual_seed(1000 * rank + i)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return build(spec, make)


def reduce_on_ranks(spec, world_size, cap_bytes, kind, backend="threads"):
    def body(group):
        tree = (integer_tree(spec, group.rank, world_size) if kind == "int" else normal_tree(spec, group.rank))
        reducer = fdp.Reducer(tree, group, bucket_caps_mb=[c / MiB for c in cap_bytes])
        return tree, reducer.all_reduce(tree)

    return fdp.testing.run(body, world_size, backend=backend, timeout=60)


def check_mean(results, exact):
    world_size = len(results)
    per_rank = [_tree.leaves(r[0]) for r in results]
    for rank, (_, out) in enumerate(results):
        paths, got, _ = _tree.flatten_with_paths(out)
        for i, (path, g) in enumerate(zip(paths, got)):
            xs = torch.stack([p[i].double() for p in per_rank])
            mean = xs.sum(0) / world_size
            assert g.dtype == per_rank[0][i].dtype and g.shape == per_rank[0][i].shape, path
            if exact:
                assert torch.equal(g.double(), mean), f"rank {rank}, leaf {path}"
            else:
                # each rank's share is rounded once and the shares are summed in the dtype:
                # a few ulps at the magnitude of the inputs
                tol = world_size * torch.finfo(g.dtype).eps * xs.abs().amax(0) if xs.numel() else 0
                assert bool(((g.double() - mean).abs() <= tol).all()), f"rank {rank}, leaf {path}"


@SETTINGS
@given(tree_specs, st.integers(1, 4), caps)
def test_all_reduce_is_the_exact_mean_when_sums_are_exact(spec, world_size, cap_bytes):
    check_mean(reduce_on_ranks(spec, world_size, cap_bytes, "int"), exact=True)


@SETTINGS
@given(tree_specs, st.integers(1, 4), caps)
def test_all_reduce_is_the_mean_within_rounding(spec, world_size, cap_bytes):
    check_mean(reduce_on_ranks(spec, world_size, cap_bytes, "normal"), exact=False)


@pytest.mark.slow  # (a gloo world per example)
@GLOO
@given(tree_specs, st.integers(2, 3), caps)
def test_all_reduce_is_the_mean_on_gloo(spec, world_size, cap_bytes):
    check_mean(reduce_on_ranks(spec, world_size, cap_bytes, "int", backend="gloo"), exact=True)
    check_mean(reduce_on_ranks(spec, world_size, cap_bytes, "normal", backend="gloo"), exact=False)


@SETTINGS
@given(tree_specs, st.integers(1, 4), st.data())
def test_broadcast_makes_every_rank_equal_to_src(spec, world_size, data):
    src = data.draw(st.integers(0, world_size - 1))

    def body(group):
        return fdp.broadcast(normal_tree(spec, group.rank), src=src, group=group)

    want = _tree.leaves(normal_tree(spec, src))
    for rank, out in enumerate(fdp.testing.run(body, world_size, timeout=60)):
        for g, w in zip(_tree.leaves(out), want):
            assert g.dtype == w.dtype and torch.equal(g, w), f"rank {rank}"


@SETTINGS
@given(tree_specs, caps)
def test_plan_covers_each_leaf_once_and_follows_the_cap_rule(spec, cap_bytes):
    tree = normal_tree(spec, 0)
    plan = fdp.BucketPlan.build(tree, bucket_caps_mb=[c / MiB for c in cap_bytes])
    leaves = _tree.leaves(tree)
    seen = sorted(i for b in plan.buckets for i in b.leaves)
    assert seen == list(range(len(leaves)))
    groups: dict = {}
    for b in plan.buckets:
        assert all(leaves[i].dtype == b.dtype for i in b.leaves)
        groups.setdefault(b.dtype, []).append(b)
    for buckets in groups.values():
        for level, b in enumerate(buckets):
            cap = plan.caps[min(level, len(plan.caps) - 1)]
            assert b.cap_bytes == cap
            last = leaves[b.leaves[-1]]
            # it closed only once it reached its cap, and only because of its last leaf
            assert b.nbytes - last.numel() * last.element_size() < cap
            if b is not buckets[-1]:
                assert b.nbytes >= cap
        # inside a dtype group, leaves arrive in reverse tree order
        order = [i for b in buckets for i in b.leaves]
        assert order == sorted(order, reverse=True)


@SETTINGS
@given(tree_specs, caps, st.booleans())
def test_flatten_then_unflatten_is_the_identity(spec, cap_bytes, views):
    tree = normal_tree(spec, 1)
    plan = fdp.BucketPlan.build(tree, bucket_caps_mb=[c / MiB for c in cap_bytes])
    flats = plan.flatten(tree)
    back = plan.views(flats) if views else plan.unflatten(flats)
    assert _tree.structure(back) == _tree.structure(tree)
    for a, b in zip(_tree.leaves(tree), _tree.leaves(back)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert math.isclose(sum(f.numel() for f in flats), sum(t.numel() for t in _tree.leaves(tree)))



def shuffled(tree, data):
    """The same tree with every dict's keys in a drawn insertion order."""
    if isinstance(tree, dict):
        keys = data.draw(st.permutations(list(tree)))
        return {k: shuffled(tree[k], data) for k in keys}
    if isinstance(tree, (list, tuple)):
        return type(tree)(shuffled(v, data) for v in tree)
    return tree


def in_key_order_of(template, tree):
    """``tree`` with every dict's keys in ``template``'s insertion order."""
    if isinstance(tree, dict):
        return {k: in_key_order_of(template[k], tree[k]) for k in template}
    if isinstance(tree, (list, tuple)):
        return type(tree)(in_key_order_of(a, b) for a, b in zip(template, tree))
    return tree


@SETTINGS
@given(tree_specs, caps, st.integers(1, 3), st.data())
def test_dicts_match_by_key_whatever_their_order(spec, cap_bytes, world_size, data):
    # A dict with the plan's keys in any insertion order packs and reduces exactly as the
    # plan's own order, and the result comes back in the plan's order.
    tree = normal_tree(spec, 0)
    order = shuffled(tree, data)
    plan = fdp.BucketPlan.build(tree, bucket_caps_mb=[c / MiB for c in cap_bytes])
    for a, b in zip(plan.flatten(tree), plan.flatten(order)):
        assert torch.equal(a, b)

    def body(group):
        mine = normal_tree(spec, group.rank)
        reducer = fdp.Reducer(mine, group, bucket_caps_mb=[c / MiB for c in cap_bytes])
        return reducer.all_reduce(mine), reducer.all_reduce(in_key_order_of(order, mine))

    for rank, (ordered, reordered) in enumerate(fdp.testing.run(body, world_size, timeout=60)):
        assert _tree.structure(reordered) == _tree.structure(tree), f"rank {rank}: not in the plan's order"
        for a, b in zip(_tree.leaves(ordered), _tree.leaves(reordered)):
            assert torch.equal(a, b), f"rank {rank}"
