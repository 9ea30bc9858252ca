"""fdp.BucketPlan: DDP's bucket assignment, flatten/unflatten round trips, bad input."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import fdp
from fdp._plan.bucket import MiB

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def ddp_assignment(leaves_in_backward_order, caps_bytes):
    """torch's own answer (the oracle): positions in backward order, per bucket."""
    buckets, _ = dist._compute_bucket_assignment_by_size(leaves_in_backward_order, list(caps_bytes))
    return [list(b) for b in buckets]


def plan_assignment(plan):
    n = len(plan.slots)
    return [[n - 1 - i for i in b.leaves] for b in plan.buckets]


leaf_specs = st.lists(
    st.tuples(st.integers(0, 3000), st.sampled_from([torch.float32, torch.float64])),
    min_size=1, max_size=40,
)
cap_lists = st.lists(st.integers(1, 20000), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(leaf_specs, cap_lists)
def test_assignment_equals_torch_compute_bucket_assignment_by_size(specs, caps_bytes):
    tree = {f"l{i}": torch.empty(n, dtype=d) for i, (n, d) in enumerate(specs)}
    plan = fdp.BucketPlan.build(tree, bucket_caps_mb=[c / MiB for c in caps_bytes])
    assert plan.caps == tuple(caps_bytes)
    backward_order = list(tree.values())[::-1]
    assert plan_assignment(plan) == ddp_assignment(backward_order, caps_bytes)


def test_default_caps_match_ddp_on_a_real_model():
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])
    params = {k: v.detach() for k, v in model.named_parameters()}
    plan = fdp.BucketPlan.build(params, bucket_cap_mb=1, first_bucket_cap_mb=0.25)
    assert plan_assignment(plan) == ddp_assignment(list(params.values())[::-1], [MiB // 4, MiB])
    # every bucket but the last of its group reaches its cap; none exceeds it by more than a leaf
    for b in plan.buckets[:-1]:
        assert b.nbytes >= b.cap_bytes
        assert b.nbytes - b.cap_bytes < 256 * 256 * 4


def test_first_bucket_small_then_cap():
    tree = {f"w{i}": torch.empty(1024 * 64) for i in range(10)}  # 256 KiB each
    plan = fdp.BucketPlan.build(tree, bucket_cap_mb=1, first_bucket_cap_mb=0.25)
    assert [len(b.leaves) for b in plan.buckets] == [1, 4, 4, 1]
    assert plan.buckets[0].paths == ("['w9']",)  # the last leaf arrives first in a backward


def test_dtypes_get_separate_buckets_in_arrival_order():
    tree = {"a": torch.empty(4), "b": torch.empty(4, dtype=torch.float64), "c": torch.empty(4),
            "d": torch.empty(4, dtype=torch.bfloat16)}
    plan = fdp.BucketPlan.build(tree)
    assert [(b.dtype, b.paths) for b in plan.buckets] == [
        (torch.bfloat16, ("['d']",)),
        (torch.float32, ("['c']", "['a']")),
        (torch.float64, ("['b']",)),
    ]


def test_plan_is_immutable_hashable_and_fingerprint_depends_only_on_layout():
    t1 = {"x": torch.randn(3, 4), "y": torch.randn(5)}
    t2 = {"x": torch.zeros(3, 4), "y": torch.ones(5)}
    p1, p2 = fdp.BucketPlan.build(t1), fdp.BucketPlan.build(t2)
    assert p1 == p2 and hash(p1) == hash(p2) and p1.fingerprint == p2.fingerprint
    assert len({p1, p2}) == 1
    variants = [
        {"x": torch.randn(4, 3), "y": torch.randn(5)},          # shape
        {"x": torch.randn(3, 4).double(), "y": torch.randn(5)},  # dtype
        {"z": torch.randn(3, 4), "y": torch.randn(5)},           # path
        {"y": torch.randn(5), "x": torch.randn(3, 4)},           # order
    ]
    for v in variants:
        assert fdp.BucketPlan.build(v).fingerprint != p1.fingerprint
    assert fdp.BucketPlan.build(t1, bucket_cap_mb=5).fingerprint != p1.fingerprint
    with pytest.raises(AttributeError):
        p1.buckets[0].numel = 3


def test_fingerprint_is_identical_in_every_process():
    def fp(group):
        torch.manual_seed(group.rank)
        model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.LayerNorm(9))
        return fdp.BucketPlan.build({k: v.detach() for k, v in model.named_parameters()}).fingerprint

    a, b = fdp.testing.run(fp, 2, backend="gloo")
    assert a == b


def nested_tree(draw_leaves):
    return {"enc": [draw_leaves[0], (draw_leaves[1], draw_leaves[2])], "head": {"w": draw_leaves[3], "b": draw_leaves[4]}}


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=5, max_size=5),
       st.integers(1, 200), st.booleans())
def test_flatten_unflatten_round_trip_is_bit_exact(specs, cap_bytes, transpose):
    g = torch.Generator().manual_seed(len(specs) + cap_bytes)
    leaves = []
    for shape, dtype in specs:
        t = torch.randn(shape, generator=g).to(dtype)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, 1)  # non-contiguous leaves must be copied correctly
        leaves.append(t)
    tree = nested_tree(leaves)
    plan = fdp.BucketPlan.build(tree, bucket_caps_mb=[cap_bytes / MiB])
    flats = plan.flatten(tree)
    back = plan.unflatten(flats)
    for a, b in zip(fdp._tree.leaves(tree), fdp._tree.leaves(back)):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    # unflatten never aliases its input
    for f in flats:
        f.fill_(7)
    for a, b in zip(fdp._tree.leaves(tree), fdp._tree.leaves(back)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", [None, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [None, 0.5, 1 / 3])
@pytest.mark.parametrize("big", [False, True])
def test_fused_scale_and_cast_rounds_once(src, dst, scale, big):
    n = 40000 if big else 7
    tree = {"a": torch.randn(3, n).to(src), "b": torch.randn(n).to(src).t(), "c": torch.randn(()).to(src)}
    plan = fdp.BucketPlan.build(tree)
    (flat,) = plan.flatten(tree, scale=scale, dtype=dst)
    out_dtype = dst or src
    compute = torch.promote_types(torch.promote_types(src, out_dtype), torch.float32)
    parts = [tree[k].to(compute).reshape(-1) for k in ("c", "b", "a")]
    ref = torch.cat(parts)
    if scale is not None:
        ref = ref * scale
    ref = ref.to(out_dtype)
    assert flat.dtype == out_dtype
    assert torch.equal(flat, ref)
    if src == torch.float32 and scale is not None:  # the documented special case
        assert torch.equal(flat, (torch.cat([tree[k].reshape(-1) for k in ("c", "b", "a")]).float() * scale).to(out_dtype))


def test_out_buffers_are_reused_without_allocation():
    tree = {"a": torch.randn(10), "b": torch.randn(2, 3)}
    plan = fdp.BucketPlan.build(tree)
    bufs = plan.new_buffers()
    ptrs = [b.data_ptr() for b in bufs]
    flats = plan.flatten(tree, scale=2.0, out=bufs)
    assert [f.data_ptr() for f in flats] == ptrs
    dest = {"a": torch.empty(10), "b": torch.empty(2, 3)}
    res = plan.unflatten(flats, out=dest)
    assert res is dest and torch.equal(dest["a"], tree["a"] * 2) and torch.equal(dest["b"], tree["b"] * 2)


def test_views_alias_the_buffers():
    tree = {"a": torch.randn(4), "b": torch.randn(2, 2)}
    plan = fdp.BucketPlan.build(tree)
    flats = plan.flatten(tree)
    v = plan.views(flats)
    flats[0].zero_()
    assert torch.equal(v["a"], torch.zeros(4)) and v["b"].shape == (2, 2)


# ------------------------------------------------------------------------ bad input

def test_cap_must_be_positive():
    for kw in ({"bucket_cap_mb": 0}, {"first_bucket_cap_mb": -1}, {"bucket_caps_mb": [1, 0]}, {"bucket_caps_mb": []}):
        with pytest.raises(ValueError, match="cap"):
            fdp.BucketPlan.build({"a": torch.zeros(2)}, **kw)


def test_an_infinite_cap_means_no_cap_and_nan_is_refused():
    tree = {f"w{i}": torch.zeros(64, 1024) for i in range(8)}  # 8 leaves of 256 KiB
    assert [len(b.leaves) for b in fdp.BucketPlan.build(tree, bucket_cap_mb=float("inf")).buckets] == [4, 4]
    plan = fdp.BucketPlan.build(tree, bucket_cap_mb=float("inf"), first_bucket_cap_mb=float("inf"))
    assert [len(b.leaves) for b in plan.buckets] == [8]
    reducer = fdp.Reducer(tree, bucket_cap_mb=float("inf"))
    assert torch.equal(reducer.all_reduce(tree)["w3"], tree["w3"])
    with pytest.raises(ValueError, match=r"caps must be > 0 MiB \(or inf for no cap; fdp.Reducer also takes .auto.\), got nan"):
        fdp.BucketPlan.build(tree, bucket_cap_mb=float("nan"))


def test_non_tensor_and_integer_leaves_are_rejected_by_path():
    with pytest.raises(TypeError, match=r"leaf \['b'\]\[1\] is a float"):
        fdp.BucketPlan.build({"a": torch.zeros(2), "b": [torch.zeros(1), 3.0]})
    with pytest.raises(TypeError, match=r"leaf \['n'\] has dtype torch.int64"):
        fdp.BucketPlan.build({"a": torch.zeros(2), "n": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(TypeError, match=r"leaf \['m'\] has dtype torch.bool"):
        fdp.BucketPlan.build({"m": torch.zeros(2, dtype=torch.bool)})


def test_mismatched_trees_name_the_first_differing_path():
    plan = fdp.BucketPlan.build({"a": torch.zeros(2), "b": {"c": torch.zeros(3)}})
    with pytest.raises(ValueError, match=r"\['b'\]\['c'\] has shape \(4,\)"):
        plan.flatten({"a": torch.zeros(2), "b": {"c": torch.zeros(4)}})
    with pytest.raises(ValueError, match=r"\['b'\]\['c'\] has dtype torch.float64"):
        plan.flatten({"a": torch.zeros(2), "b": {"c": torch.zeros(3, dtype=torch.float64)}})
    with pytest.raises(ValueError, match=r"\['b'\]\['d'\]"):
        plan.flatten({"a": torch.zeros(2), "b": {"d": torch.zeros(3)}})
    with pytest.raises(ValueError, match=r"missing leaf \['b'\]\['c'\]"):
        plan.flatten({"a": torch.zeros(2), "b": {}})
    with pytest.raises(ValueError, match=r"unflatten out= leaf \['a'\] has shape"):
        plan.unflatten(plan.flatten({"a": torch.zeros(2), "b": {"c": torch.zeros(3)}}),
                       out={"a": torch.zeros(5), "b": {"c": torch.zeros(3)}})
    with pytest.raises(ValueError, match="2 flat tensors|1 flat tensors"):
        plan.unflatten([torch.zeros(5), torch.zeros(1)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b.w", "c", "0", "x.y.z"]),
                          st.sampled_from(["tensor", "param", "none", "int", "dict", "list"])),
                min_size=0, max_size=6, unique_by=lambda kv: kv[0]))
def test_tree_flatten_fast_path_equals_optree(items):
    # fdp._tree.flatten takes a cached shortcut for plain dicts of tensors: whatever the
    # dict holds, the leaves (same objects, same order) and the structure must be optree's.
    import optree

    make = {"tensor": lambda: torch.ones(2), "param": lambda: torch.nn.Parameter(torch.ones(1)),
            "none": lambda: None, "int": lambda: 3, "dict": lambda: {"k": torch.zeros(1)},
            "list": lambda: [torch.zeros(1), 2]}
    tree = {k: make[kind]() for k, kind in items}
    want_leaves, want_def = optree.tree_flatten(tree, namespace=fdp._tree.NAMESPACE)
    for _ in range(2):  # the first call fills the cache, the second reads it
        leaves, treedef = fdp._tree.flatten(tree)
        assert treedef == want_def
        assert len(leaves) == len(want_leaves) and all(a is b for a, b in zip(leaves, want_leaves))
        assert all(a is b for a, b in zip(fdp._tree.leaves(tree), want_leaves))
    reordered = dict(reversed(list(tree.items())))  # insertion order is part of the structure
    assert fdp._tree.flatten(reordered)[1] == optree.tree_structure(reordered, namespace=fdp._tree.NAMESPACE)


def test_tree_structure_cache_is_bounded_and_thread_safe():
    # More layouts than the cache holds, flattened from several threads at once (simulated
    # ranks are threads): every result is still optree's, and the cache stays bounded.
    import threading

    import optree

    trees = [{f"k{i}_{j}": torch.zeros(1) for j in range(1 + i % 5)} for i in range(200)]
    errors = []

    def work():
        try:
            for t in trees:
                leaves, treedef = fdp._tree.flatten(t)
                assert treedef == optree.tree_structure(t, namespace=fdp._tree.NAMESPACE)
                assert all(a is b for a, b in zip(leaves, t.values()))
        except Exception as e:  # reported below, from the main thread
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(fdp._tree.DICT_SPECS) <= fdp._tree.DICT_SPECS.size
