"""The bad-input catalogue: every error fdp promises, with its type and what it names.

Each case is a specification: the error type a user can catch, and the words (leaf path,
rank, file, sizes) that let them find the problem without reading fdp's source.
"""

import pytest
import torch
from models import mlp
from torch import nn

import fdp


def params_of(width=16, seed=0):
    return fdp.functionalize(mlp(width=width, seed=seed))[1]


def across_ranks(body, world_size=2):
    """Run `body` on simulated ranks; return what every rank raised (type, message)."""

    def wrapped(group):
        try:
            body(group)
        except Exception as e:  # noqa: BLE001 - the error is the result
            return type(e), str(e)
        return None

    return fdp.testing.run(wrapped, world_size, timeout=30)


# ----------------------------------------------------------------- across ranks


def test_shape_mismatch_across_ranks_names_leaf_and_ranks_on_every_rank():
    res = across_ranks(lambda g: fdp.Reducer(params_of(width=16 + g.rank), g))
    for kind, msg in res:
        assert kind is fdp.ReplicaMismatchError
        assert "leaf ['0.weight'] has shape (16, 8) float32 on rank 0 but (17, 8) float32 on rank 1" in msg


def test_leaf_count_mismatch_across_ranks_names_counts_and_ranks():
    def body(g):
        tree = {"a": torch.zeros(1)} if g.rank == 0 else {"a": torch.zeros(1), "b": torch.zeros(1)}
        fdp.assert_same_shapes(tree, g)

    for kind, msg in across_ranks(body):
        assert kind is fdp.ReplicaMismatchError
        assert "rank 0 has 1 leaves but rank 1 has 2" in msg and "['b']" in msg


def test_dtype_mismatch_across_ranks_for_broadcast():
    def body(g):
        fdp.broadcast({"x": torch.zeros(2, dtype=torch.float32 if g.rank == 0 else torch.float64)}, group=g)

    for kind, msg in across_ranks(body):
        assert kind is fdp.ReplicaMismatchError and "leaf ['x']" in msg and "float64 on rank 1" in msg


def test_drifted_replicas_name_leaf_and_rank():
    def body(g):
        fdp.assert_replicas_equal({"w": torch.full((3,), float(g.rank == 2))}, g)

    for kind, msg in across_ranks(body, 3):
        assert kind is fdp.ReplicaMismatchError and "leaf ['w'] differs on rank(s) [2]" in msg


# ----------------------------------------------------------------- one rank

CASES = {
    "tree mismatch": (
        lambda: fdp.Reducer(params_of()).all_reduce({**params_of(), "extra": torch.zeros(1)}),
        ValueError, r"\['extra'\]"),
    "grads shape mismatch": (
        lambda: fdp.Reducer(params_of()).all_reduce({**params_of(), "4.bias": torch.zeros(3)}),
        ValueError, r"leaf \['4.bias'\] has shape \(3,\), the plan expects \(16,\)"),
    "grads dtype mismatch": (
        lambda: fdp.Reducer(params_of()).all_reduce({**params_of(), "4.bias": torch.zeros(16).double()}),
        ValueError, r"leaf \['4.bias'\] has dtype torch.float64"),
    "grads on another device": (
        lambda: fdp.Reducer({"a": torch.zeros(2)}).all_reduce({"a": torch.zeros(2, device="meta")}),
        ValueError, r"leaf \['a'\] is on meta, the plan expects cpu"),
    "non-floating leaf": (
        lambda: fdp.Reducer({"w": torch.zeros(2), "steps": torch.zeros(1, dtype=torch.int64)}),
        TypeError, r"leaf \['steps'\] has dtype torch.int64"),
    "non-tensor leaf": (
        lambda: fdp.BucketPlan.build({"w": torch.zeros(2), "lr": 0.1}),
        TypeError, r"leaf \['lr'\] is a float"),
    "mixed devices": (
        lambda: fdp.Reducer({"a": torch.zeros(2), "b": torch.zeros(2, device="meta")}),
        ValueError, r"one device.*\['a'\] on cpu.*\['b'\] on meta"),
    "cap <= 0": (
        lambda: fdp.Reducer(params_of(), bucket_cap_mb=0), ValueError, "caps must be > 0"),
    "first cap <= 0": (
        lambda: fdp.BucketPlan.build(params_of(), first_bucket_cap_mb=-1), ValueError, "caps must be > 0"),
    "hook returns a tensor": (
        lambda: fdp.Reducer({"a": torch.zeros(3)}, comm_hook=lambda b, f, g: f).all_reduce({"a": torch.zeros(3)}),
        TypeError, "comm hook <lambda> returned Tensor for bucket 0"),
    "hook returns the wrong size": (
        lambda: fdp.Reducer({"a": torch.zeros(3)}, comm_hook=lambda b, f, g: _fut(torch.zeros(2))).all_reduce(
            {"a": torch.zeros(3)}),
        TypeError, r"shape \(2,\) for bucket 0; expected a floating tensor of 3 elements"),
    "hook not callable": (lambda: fdp.Reducer({"a": torch.zeros(3)}, comm_hook=42), TypeError, "callable"),
    "non-scalar loss": (
        lambda: fdp.Reducer({"w": torch.ones(3)}).grad(lambda p: p["w"] * 2)({"w": torch.ones(3)}),
        ValueError, r"scalar loss tensor, got \(3,\)"),
    "has_aux without a pair": (
        lambda: fdp.Reducer({"w": torch.ones(3)}).grad(lambda p: p["w"].sum(), has_aux=True)({"w": torch.ones(3)}),
        ValueError, r"\(loss, aux\) tuple"),
    "reducer re-entered mid-step": (
        lambda: _reenter(), RuntimeError, r"still in flight"),
    "no active rank": (
        lambda: fdp.Reducer({"w": torch.ones(3)}).all_reduce(None, active=False), ValueError, "no rank is active"),
    "broadcast src out of range": (
        lambda: fdp.broadcast({"w": torch.ones(3)}, src=5), ValueError, r"src=5 is not a rank"),
    "lazy module": (
        lambda: fdp.functionalize(nn.LazyLinear(3)), ValueError, r"'weight'.*uninitialised|uninitialised"),
    "module without parameters": (lambda: fdp.functionalize(nn.Identity()), ValueError, "no parameters"),
    "apply with a missing key": (
        lambda: _apply_without("0.bias"), ValueError, r"`params` is missing key '0.bias'"),
}


def _fut(value):
    f = torch.futures.Future()
    f.set_result(value)
    return f


def _reenter():
    r = fdp.Reducer({"w": torch.ones(2)})
    pending = r.all_reduce_async({"w": torch.ones(2)})
    try:
        r.grad(lambda p: p["w"].sum())({"w": torch.ones(2)})
    finally:
        pending.wait()


def _apply_without(key):
    apply, params, buffers = fdp.functionalize(mlp(seed=0))
    del params[key]
    apply(params, buffers, torch.zeros(2, 8))


@pytest.mark.parametrize("case", list(CASES))
def test_catalogue(case):
    fn, kind, pattern = CASES[case]
    with pytest.raises(kind, match=pattern):
        fn()


# ----------------------------------------------------------------- checkpoints


def test_corrupt_and_truncated_checkpoints_name_the_file(tmp_path):
    state = {"w": torch.randn(100), "step": 3}
    path = tmp_path / "ckpt.pt"
    fdp.save(path, state)
    data = path.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint" * 100)
    for name in ("truncated.pt", "garbage.pt", "missing.pt"):
        with pytest.raises(fdp.CheckpointError, match=name):
            fdp.load(tmp_path / name, like=state)


def test_checkpoint_with_per_rank_state_from_another_world_size_names_both_sizes(tmp_path):
    path = tmp_path / "two.pt"
    fdp.testing.run(lambda g: fdp.save(path, {"w": torch.ones(2), "rng": fdp.rng_state(g)}, g), 2)
    with pytest.raises(fdp.CheckpointError, match=r"world of 2 ranks, but this world has 1, and it holds "
                                                  r"per-rank state \(\['rng'\]\['cpu'\]\)"):
        fdp.load(path, like={"w": torch.zeros(2), "rng": fdp.rng_state()})


def test_checkpoint_that_does_not_match_names_the_leaf(tmp_path):
    path = tmp_path / "c.pt"
    fdp.save(path, {"w": torch.ones(2), "b": torch.ones(3)})
    with pytest.raises(fdp.CheckpointError, match=r"\['b'\]"):
        fdp.load(path, like={"w": torch.zeros(2), "b": torch.zeros(4)})
