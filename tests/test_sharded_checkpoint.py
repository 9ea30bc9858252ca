"""fdp.save_sharded / fdp.load_sharded and the fused step's state_to_shards / state_from_shards:
each rank writes its own parts with no gather, the checkpoint appears atomically, loading
reads only the ranges asked for, reshards into any world size or the plain layout bit for
bit, never unpickles, and refuses damage and mismatches naming the leaf and the rank."""

import json
import os
import pathlib
import pickle
import struct
import sys
import zlib

import procs
import pytest
import torch
import torch.nn.functional as F
from models import CAPS, Block, batch, block_net, mlp, tokens
from test_fully_sharded import loss_of as token_loss
from test_muon import muon_and_adamw, two_lrs

import fdp
import fdp._tree
import fdp.testing
from fdp import Shard, load_sharded, save_sharded

OPTIMIZERS = {
    "adamw-clip-mask": lambda: fdp.optim.chain(
        fdp.optim.clip_by_global_norm(1.0),
        fdp.optim.adamw(lr=1e-2, weight_decay=0.1, mask=lambda key, p: p.dim() >= 2)),
    "sgd-momentum": lambda: fdp.optim.sgd(lr=0.1, momentum=0.9),
    "two-adamw-lrs": two_lrs,            # a partition of two optimizers
    "muon-adamw": muon_and_adamw,        # Muon's matrices owned whole by one rank each, AdamW on the rest
}
SAVED_ON = (2, 3)


def problems_between(a, b, what):
    """Where two trees differ (structure, leaf types, dtypes, bits): [] when equal."""
    paths, la, da = fdp._tree.flatten_with_paths(a)
    lb, db = fdp._tree.flatten(b)
    if da != db:
        return [f"{what}: structures differ: {fdp._tree.first_difference(db, da)}"]
    out = []
    for p, x, y in zip(paths, la, lb):
        if isinstance(x, Shard) or isinstance(y, Shard):
            same = (isinstance(x, Shard) and isinstance(y, Shard) and (x.shape, x.dtype, x.ranges)
                    == (y.shape, y.dtype, y.ranges) and torch.equal(x.data, y.data))
        elif isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        else:
            same = type(x) is type(y) and x == y
        if not same:
            out.append(f"{what}: leaf {p} differs")
    return out


def fused_state_problems(a, b, what):
    out = problems_between((a.step, a.transforms), (b.step, b.transforms), f"{what} (count, transforms)")
    if sorted(a.buffers) != sorted(b.buffers):
        return out + [f"{what}: fields {sorted(a.buffers)} != {sorted(b.buffers)}"]
    for key in a.buffers:
        for i, (x, y) in enumerate(zip(a.buffers[key], b.buffers[key])):
            if x.dtype != y.dtype or not torch.equal(x, y):
                out.append(f"{what}: {key} of bucket {i} differs")
    return out


def loss_of(apply, buffers):
    def loss(p, x, y):
        return F.cross_entropy(apply(p, buffers, x)[0], y)
    return loss


# ------------------------------------------------------------------- the value type


def test_a_shard_checks_its_ranges_and_data_and_cuts_a_tensor():
    t = torch.arange(10.0).view(2, 5)
    part = Shard.of(t, [(1, 3), (6, 9)])
    assert part.data.tolist() == [1.0, 2.0, 6.0, 7.0, 8.0] and part.numel == 10
    assert [(a, b, d.tolist()) for a, b, d in part.pieces()] == [(1, 3, [1.0, 2.0]), (6, 9, [6.0, 7.0, 8.0])]
    whole = Shard.whole(t)
    assert whole.ranges == ((0, 10),) and whole.to_tensor().equal(t)
    assert whole.data.data_ptr() == t.data_ptr(), "the whole of a contiguous tensor is a view"
    assert Shard.whole(torch.empty(0, 3)).ranges == ()
    for ranges, data, match in [([(3, 2)], torch.zeros(0), "sorted, disjoint, non-empty"),
                                ([(0, 4), (2, 6)], torch.zeros(8), r"\(2, 6\) is not"),
                                ([(8, 11)], torch.zeros(3), r"inside \[0, 10\)"),
                                ([(0, 2)], torch.zeros(3), "data has 3 elements"),
                                ([(0, 2)], torch.zeros(2, dtype=torch.float64), "of torch.float64"),
                                ([(0, 2)], torch.zeros(1, 2), "1-D")]:
        with pytest.raises(ValueError, match=match):
            Shard((2, 5), torch.float32, ranges, data)
    with pytest.raises(ValueError, match="not the whole tensor"):
        part.to_tensor()


# ------------------------------------------------------------------- the format, one rank


def every_kind_of_leaf(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "params": {"w": torch.randn(3, 4, generator=g), "half": torch.randn(5, generator=g).to(torch.bfloat16)},
        "buffers": {"count": torch.tensor(seed, dtype=torch.int64), "mask": torch.rand(4, generator=g) > 0.5,
                    "empty": torch.zeros(0, 2)},
        "opt": fdp.optim.adamw(1e-3).init({"w": torch.zeros(3, 4)})._replace(
            exp_avg={"w": Shard.whole(torch.randn(3, 4, generator=g))}),
        "z": torch.randn(2, generator=g, dtype=torch.complex64),
        "step": seed, "lr": 0.5 / (seed + 1), "resumed": bool(seed % 2), "run": f"run-{seed}",
        "rng": fdp.rng_state(),
    }


def test_every_kind_of_leaf_round_trips_bit_for_bit_and_the_save_replaces_the_last(tmp_path):
    folder = tmp_path / "ckpt"
    save_sharded(folder, every_kind_of_leaf(1))
    first = set(os.listdir(folder))
    state = every_kind_of_leaf(4)
    save_sharded(folder, state)  # over the first: replaces it
    out = load_sharded(folder, every_kind_of_leaf(0))
    assert problems_between(out, state, "loaded") == []
    assert isinstance(out["opt"], fdp.optim.AdamWState) and out["opt"].max_exp_avg_sq is None
    files = set(os.listdir(folder))
    assert len(files) == 2 and "manifest.json" in files and not (files - {"manifest.json"}) & first, (
        f"the previous save's data file was not removed: {first} -> {files}")


def test_the_manifest_is_json_and_each_data_file_a_safetensors_file_of_its_pieces(tmp_path):
    rows = torch.arange(12.0).view(3, 4)
    save_sharded(tmp_path, {"w": Shard.whole(rows), "b": torch.ones(2, dtype=torch.bfloat16), "n": 7})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["world_size"]) == ("fdp.sharded_checkpoint", 2, 1)
    leaves = {leaf["path"]: leaf for leaf in manifest["leaves"]}
    assert leaves["['n']"] == {"path": "['n']", "kind": "plain", "type": "int", "value": 7}
    w = leaves["['w']"]
    assert (w["kind"], w["shape"], w["dtype"], len(w["pieces"])) == ("shard", [3, 4], "float32", 1)
    # A safetensors file: 8-byte little-endian header length, the JSON header, the bytes.
    data = (tmp_path / manifest["files"][0]["name"]).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    assert header["__metadata__"]["format"] == "fdp.sharded_checkpoint" and n % 8 == 0
    entry = header["['w']@0"]
    assert (entry["dtype"], entry["shape"]) == ("F32", [12])
    file_, offset, start, stop, _ = w["pieces"][0]
    assert 8 + n + entry["data_offsets"][0] == offset and (start, stop) == (0, 12)
    got = torch.frombuffer(bytearray(data[offset:offset + 48]), dtype=torch.float32)
    assert torch.equal(got, rows.reshape(-1))
    assert header["['b']@0"]["dtype"] == "BF16"


# ------------------------------------------------------------------- resharding, by hand


def cut(numel, world, rank, shift=0):
    """Rank ``rank``'s ranges of ``numel`` elements cut into ``world`` uneven parts (shifted)."""
    if not numel:
        return []
    bounds = sorted({0, numel, *((numel * k * k // (world * world) + shift) % numel for k in range(1, world))})
    return [(a, b) for a, b in zip(bounds, bounds[1:])][rank::world]


def leaves_of_any_shape():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(7, 5, generator=g), "b": torch.randn(1, generator=g),
            "c": torch.randint(0, 100, (33,), generator=g), "d": torch.randn(0, 4, generator=g)}


def saved_in_parts(group, folder, shift):
    whole = leaves_of_any_shape()
    parts = {k: Shard.of(t, cut(t.numel(), group.size, group.rank, shift)) for k, t in whole.items()}
    save_sharded(folder, {"parts": parts, "step": 5}, group)


def loaded_in_parts(group, folder, shift):
    whole = leaves_of_any_shape()
    like = {"parts": {k: Shard.of(torch.zeros_like(t), cut(t.numel(), group.size, group.rank, shift))
                      for k, t in whole.items()}, "step": 0}
    got = load_sharded(folder, like, group)
    want = {"parts": {k: Shard.of(t, like["parts"][k].ranges) for k, t in whole.items()}, "step": 5}
    return problems_between(got, want, f"rank {group.rank}")


@pytest.mark.parametrize("saved_on", [1, 3, 4])
def test_parts_saved_on_one_world_load_as_other_parts_on_another(tmp_path, saved_on):
    fdp.testing.run(saved_in_parts, saved_on, args=(str(tmp_path), 0))
    for world, shift in ((1, 0), (2, 3), (3, 1), (4, 0), (5, 2)):
        for found in fdp.testing.run(loaded_in_parts, world, args=(str(tmp_path), shift)):
            assert found == [], f"saved on {saved_on}, loaded on {world}: {found}"
    whole = load_sharded(tmp_path, {"parts": {k: torch.zeros_like(t) for k, t in leaves_of_any_shape().items()},
                                    "step": 0})
    assert problems_between(whole["parts"], leaves_of_any_shape(), "whole") == []


def test_elements_that_several_ranks_hold_are_written_once(tmp_path):
    t = torch.arange(20.0)

    def overlapping(group):  # rank r holds r*5 : r*5 + 10 (the replicas of a 2-D mesh overlap like this)
        lo = group.rank * 5
        save_sharded(tmp_path, {"t": Shard.of(t, [(lo, min(lo + 10, 20))])}, group)

    fdp.testing.run(overlapping, 3)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    pieces = manifest["leaves"][0]["pieces"]
    assert [(p[0], p[2], p[3]) for p in pieces] == [(0, 0, 10), (1, 10, 15), (2, 15, 20)]
    assert torch.equal(load_sharded(tmp_path, {"t": torch.zeros(20)})["t"], t)


# ------------------------------------------------------------------- the fused step's state


def trained(group, folder):
    """Per optimizer: 3 sharded steps, a sharded and a gathered checkpoint, 2 more steps."""
    out = {}
    for name, make in OPTIMIZERS.items():
        apply, params, buffers = fdp.functionalize(mlp(seed=7))
        step = fdp.Reducer(params, group, shard=True, **CAPS).grad_and_update(loss_of(apply, buffers), make())
        p, s = dict(params), step.init(params)
        for i in range(3):
            p, s, _ = step(p, s, *batch(group.rank, i))
        where = f"{folder}/{name}-on-{group.size}"
        save_sharded(where, {"params": p, "opt": step.state_to_shards(s, p), "step": 3}, group)
        fdp.save(f"{where}.pt", {"params": p, "opt": step.state_to_tree(s, p), "step": 3}, group)
        for i in range(3, 5):
            p, s, _ = step(p, s, *batch(group.rank, i))
        out[name] = p
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of every optimizer's sharded state on 2 and 3 gloo ranks, and where the
    uninterrupted runs ended."""
    folder = str(tmp_path_factory.mktemp("fused"))
    ends = {w: fdp.testing.run(trained, w, backend="gloo", timeout=120, args=(folder,))[0] for w in SAVED_ON}
    return folder, ends


def resumed(group, folder, saved_on, mode):
    """Per optimizer: the sharded checkpoint loaded (into ``mode``: the plain per-leaf path, the
    unsharded fused step or the sharded one), checked bit for bit against the gathered
    checkpoint's route, then 2 more steps."""
    out, found = {}, []
    for name, make in OPTIMIZERS.items():
        apply, params, buffers = fdp.functionalize(mlp(seed=8))  # other values: all of them are loaded
        loss = loss_of(apply, buffers)
        opt = make()
        where = f"{folder}/{name}-on-{saved_on}"
        gathered = fdp.load(f"{where}.pt", {"params": params, "opt": opt.init(params), "step": 0}, group)
        what = f"{name}, saved on {saved_on}, loaded on {group.size} into {mode}, rank {group.rank}"
        if mode == "plain":
            got = load_sharded(where, {"params": params, "opt": opt.init(params), "step": 0}, group)
            found += problems_between(got, gathered, what)
            p, s, reducer = got["params"], got["opt"], fdp.Reducer(params, group, **CAPS)
            for i in range(3, 5):
                p, s = opt.update(reducer.grad(loss)(p, *batch(group.rank, i)), s, p)
        else:
            step = fdp.Reducer(params, group, shard=mode == "sharded", **CAPS).grad_and_update(loss, opt)
            like = {"params": params, "opt": step.state_to_shards(step.init(params), params), "step": 0}
            got = load_sharded(where, like, group)
            found += problems_between((got["params"], got["step"]), (gathered["params"], gathered["step"]), what)
            s = step.state_from_shards(got["opt"], got["params"])
            found += fused_state_problems(s, step.state_from_tree(gathered["opt"], gathered["params"]), what)
            found += problems_between(step.state_to_shards(s, got["params"]), got["opt"], f"{what} (to_shards again)")
            p = got["params"]
            for i in range(3, 5):
                p, s, _ = step(p, s, *batch(group.rank, i))
        out[name] = p
    return out, found


@pytest.mark.parametrize("saved_on", SAVED_ON)
def test_a_sharded_state_resumes_on_the_same_world_bit_for_bit(saved, saved_on):
    folder, ends = saved
    for rank, (params, found) in enumerate(fdp.testing.run(resumed, saved_on, backend="gloo", timeout=120,
                                                           args=(folder, saved_on, "sharded"))):
        assert found == []
        for name in OPTIMIZERS:
            assert problems_between(params[name], ends[saved_on][name], f"{name}, rank {rank}") == [], (
                "resumed != uninterrupted")


ELSEWHERE = [(s, w, m) for s in SAVED_ON
             for w, m in [(1, "plain"), (1, "fused"), (2, "fused"), (2, "sharded"), (3, "sharded"), (4, "sharded")]
             if (w, m) != (s, "sharded")]  # (the same world: the test above)


@pytest.mark.parametrize("saved_on,world,mode", ELSEWHERE)
def test_a_sharded_state_loads_on_any_world_as_the_gathered_route_does(saved, saved_on, world, mode):
    """state_from_shards(load_sharded(...)) equals state_from_tree(fdp.load(state_to_tree's
    file)) bit for bit on every rank, into the plain path, the unsharded and the sharded step,
    and training goes on from it (replicas stay identical)."""
    folder, _ = saved
    backend = "gloo" if world in (2, 3) else "threads"
    results = fdp.testing.run(resumed, world, backend=backend, timeout=120, args=(folder, saved_on, mode))
    for rank, (params, found) in enumerate(results):
        assert found == []
        assert problems_between(params, results[0][0], f"rank {rank} vs rank 0") == []


def muon_saved_on_4_loaded_on_2(group, folder, stage):
    apply, params, buffers = fdp.functionalize(mlp(seed=9))
    opt = muon_and_adamw()
    step = fdp.Reducer(params, group, shard=True, **CAPS).grad_and_update(loss_of(apply, buffers), opt)
    if stage == "save":
        p, s = dict(params), step.init(params)
        for i in range(2):
            p, s, _ = step(p, s, *batch(0, i))
        save_sharded(folder, {"params": p, "opt": step.state_to_shards(s, p)}, group)
        return step.state_to_tree(s, p)
    got = load_sharded(folder, {"params": params, "opt": step.state_to_shards(step.init(params), params)}, group)
    return step.state_to_tree(step.state_from_shards(got["opt"], got["params"]), got["params"])


def test_muon_and_adamw_saved_on_4_ranks_load_on_2_as_the_whole_state():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        saved_tree = fdp.testing.run(muon_saved_on_4_loaded_on_2, 4, args=(folder, "save"))[0]
        for rank, tree in enumerate(fdp.testing.run(muon_saved_on_4_loaded_on_2, 2, args=(folder, "load"))):
            assert problems_between(tree, saved_tree, f"rank {rank}") == []


def fully_sharded(group, folder):
    """The optimizer state of a fully sharded step (shard="params"): to shards, saved, loaded
    as Shards and as whole tensors, against state_to_tree."""
    net = block_net(seed=7)
    apply, params, buffers = fdp.functionalize(net)
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(0.05), fdp.optim.adamw(lr=1e-2))
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(net, Block)).grad_and_update(
        token_loss(apply, buffers), opt)
    p, s = params, step.init(params)
    for i in range(2):
        p, s, _ = step(p, s, *tokens(group.rank, i))
    save_sharded(folder, {"opt": step.state_to_shards(s, p)}, group)
    got = load_sharded(folder, {"opt": step.state_to_shards(step.init(params), p)}, group)
    found = fused_state_problems(step.state_from_shards(got["opt"], p), s, "through Shards")
    whole = load_sharded(folder, {"opt": opt.init(params)}, group)
    return found + problems_between(whole["opt"], step.state_to_tree(s, p), "whole")


def test_a_fully_sharded_steps_optimizer_state_goes_through_shards_too(tmp_path):
    assert fdp.testing.run(fully_sharded, 2, args=(str(tmp_path),)) == [[], []]


def test_shards_of_an_unsharded_step_are_whole_leaves_and_views_of_its_state():
    apply, params, buffers = fdp.functionalize(mlp(seed=1))
    step = fdp.Reducer(params, **CAPS).grad_and_update(loss_of(apply, buffers), fdp.optim.adamw(1e-2))
    state = step.init(params)
    shards = step.state_to_shards(state, params)
    assert isinstance(shards, fdp.optim.AdamWState) and isinstance(shards.step, torch.Tensor)
    for key, part in shards.exp_avg.items():
        assert part.ranges == ((0, params[key].numel()),) and part.shape == tuple(params[key].shape)
    ptrs = {t.untyped_storage().data_ptr() for t in state.buffers["exp_avg"]}
    assert all(p.data.untyped_storage().data_ptr() in ptrs for p in shards.exp_avg.values()), "not views"
    back = step.state_from_shards(step.state_to_tree(state, params), params)  # whole tensors do too
    assert fused_state_problems(back, state, "from whole tensors") == []


def muon_alone(group, folder):
    """A plain Muon (no partition), sharded: every matrix owned whole by one rank."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False))
    apply, params, buffers = fdp.functionalize(model)
    step = fdp.Reducer(params, group, shard=True).grad_and_update(
        lambda p, x: apply(p, buffers, x)[0].square().mean(), fdp.optim.muon(lr=0.02))
    p, s = dict(params), step.init(params)
    p, s, _ = step(p, s, torch.randn(4, 8, generator=torch.Generator().manual_seed(group.rank)))
    tree = step.state_to_tree(s, p)
    found = fused_state_problems(step.state_from_tree(tree, p), s, "through state_to_tree")
    found += fused_state_problems(step.state_from_shards(step.state_to_shards(s, p), p), s, "through state_to_shards")
    save_sharded(folder, step.state_to_shards(s, p), group)
    found += problems_between(load_sharded(folder, fdp.optim.muon(lr=0.02).init(p), group), tree, "loaded whole")
    return found


def test_a_plain_muons_sharded_state_converts_both_ways(tmp_path):
    # (state_to_tree used to gather a slice-sized buffer of a compact, owner-only state: a
    # collective of mismatched sizes)
    assert fdp.testing.run(muon_alone, 2, args=(str(tmp_path),)) == [[], []]


def wrong_parts(group):
    apply, params, buffers = fdp.functionalize(mlp(seed=1))
    step = fdp.Reducer(params, group, shard=True).grad_and_update(loss_of(apply, buffers), fdp.optim.sgd(0.1, 0.9))
    shards = step.state_to_shards(step.init(params), params)
    key, mine = next((k, v) for k, v in shards.momentum_buffer.items() if v.ranges)  # a leaf this rank holds
    a, b = mine.ranges[0]
    others = Shard.of(torch.zeros(mine.shape), [(0, a)] if a else [(b, mine.numel)] if b < mine.numel else [])
    bad = shards._replace(momentum_buffer={**shards.momentum_buffer, key: others})
    with pytest.raises(ValueError, match=rf"\['{key}'\] holds elements .* needs its elements {a}:{b}"):
        step.state_from_shards(bad, params)
    wrong_shape = shards._replace(momentum_buffer={**shards.momentum_buffer, key: Shard.whole(torch.zeros(3, 3))})
    with pytest.raises(ValueError, match=rf"\['{key}'\] has shape \(3, 3\)"):
        step.state_from_shards(wrong_shape, params)
    return True


def test_state_from_shards_names_the_leaf_whose_elements_this_rank_lacks():
    assert fdp.testing.run(wrong_parts, 2) == [True, True]


# ------------------------------------------------------------------- atomicity and failures


def write_then_fail(group, folder, who, how):
    """Save a first checkpoint, then a second in which rank ``who`` fails (``how``)."""
    save_sharded(folder, {"w": Shard.of(torch.arange(12.0), cut(12, group.size, group.rank)), "n": 1}, group)
    if group.rank == who:  # (a gloo rank is its own process: the patch is this rank's alone)
        if how == "write":
            def fail(fd):
                raise OSError(5, "injected write failure")
            os.fsync = fail
        else:
            def fail(src, dst):
                raise OSError(5, "injected commit failure")
            os.replace = fail
    try:
        save_sharded(folder, {"w": Shard.of(torch.zeros(12), cut(12, group.size, group.rank)), "n": 2}, group)
    except fdp.CheckpointError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("who,how", [(1, "write"), (0, "commit")])
def test_a_rank_failing_mid_save_fails_it_everywhere_and_the_previous_checkpoint_stays(tmp_path, who, how):
    messages = fdp.testing.run(write_then_fail, 3, backend="gloo", timeout=60, args=(str(tmp_path), who, how))
    injected = f"injected {how} failure"
    assert injected in messages[who] and f"rank {who}" in messages[who], messages
    for rank, message in enumerate(messages):
        assert message != "saved", f"rank {rank} returned"
        assert f"rank {who}" in message, f"rank {rank}: {message}"
    out = load_sharded(tmp_path, {"w": torch.zeros(12), "n": 0})
    assert out["n"] == 1 and torch.equal(out["w"], torch.arange(12.0)), "the previous checkpoint is gone"
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 4 and files[-1] == "manifest.json", f"files of the failed save left behind: {files}"
    save_sharded(tmp_path, {"w": torch.ones(12), "n": 3})  # the next save replaces it, and cleans up
    assert len(os.listdir(tmp_path)) == 2


def test_a_crashed_save_leaves_no_manifest_so_nothing_loads_from_a_new_folder(tmp_path):
    folder = tmp_path / "new"
    folder.mkdir()
    (folder / "data-0123456789ab-rank00000.safetensors").write_bytes(b"left by a killed writer")
    with pytest.raises(fdp.CheckpointError, match="no manifest.json"):
        load_sharded(folder, {"w": torch.zeros(1)})
    save_sharded(folder, {"w": torch.ones(1)})
    assert sorted(os.listdir(folder))[0] != "data-0123456789ab-rank00000.safetensors"


def flip_a_byte_and_load(group, folder, world_reading):
    save_sharded(folder, {"a": Shard.of(torch.arange(100.0), cut(100, group.size, group.rank)),
                          "b": torch.ones(4)}, group)
    if group.rank == 0:
        manifest = json.loads(pathlib.Path(folder, "manifest.json").read_text())
        leaf = next(x for x in manifest["leaves"] if x["path"] == "['a']")
        file, offset, *_ = leaf["pieces"][-1]  # the last piece: written by rank 1
        name = pathlib.Path(folder, manifest["files"][file]["name"])
        data = bytearray(name.read_bytes())
        data[offset + 5] ^= 0x10
        name.write_bytes(data)


def reading(group, folder, ranges_of):
    try:
        load_sharded(folder, {"a": Shard.of(torch.zeros(100), ranges_of(group.rank)), "b": torch.zeros(4)}, group)
    except fdp.CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_flipped_byte_is_caught_naming_the_leaf_and_the_rank_that_wrote_it(tmp_path):
    fdp.testing.run(flip_a_byte_and_load, 2, args=(str(tmp_path), 2))
    with pytest.raises(fdp.CheckpointError, match=r"leaf \['a'\] is corrupt: its elements .* \(written by rank 1\)"):
        load_sharded(tmp_path, {"a": torch.zeros(100), "b": torch.zeros(4)})
    # On 2 ranks where only rank 1 reads the damaged piece: it names it, rank 0 names rank 1.
    messages = fdp.testing.run(reading, 2, args=(str(tmp_path), lambda r: [(0, 10)] if r == 0 else [(60, 100)]))
    assert "is corrupt" in messages[1] and "(rank 1)" in messages[1], messages
    assert "rank 1 could not load" in messages[0], messages
    # Only what a rank reads is checked: ranges away from the damage load.
    assert fdp.testing.run(reading, 2, args=(str(tmp_path), lambda r: [(0, 10 + r)])) == ["loaded", "loaded"]


def as_version_1(manifest):
    """A manifest rewritten as fdp's version 1 wrote it (no crc32 of its own bytes): the
    structural checks below are those a damaged version-1 manifest meets."""
    return json.dumps({**{k: v for k, v in manifest.items() if k != "crc32"}, "version": 1})


def test_a_manifest_pointing_outside_a_file_is_refused(tmp_path):
    save_sharded(tmp_path, {"a": torch.arange(10.0)})
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["leaves"][0]["pieces"][0][1] = manifest["files"][0]["bytes"] - 8  # 40 bytes from 8 before the end
    path.write_text(as_version_1(manifest))
    with pytest.raises(fdp.CheckpointError, match=r"damaged: leaf \['a'\]: piece .* outside data-"):
        load_sharded(tmp_path, {"a": torch.zeros(10)})
    manifest["files"][0]["bytes"] += 1000  # and a file that is not as long as the manifest says
    manifest["leaves"][0]["pieces"][0][1] = 200
    path.write_text(as_version_1(manifest))
    with pytest.raises(fdp.CheckpointError, match="bytes, the manifest says"):
        load_sharded(tmp_path, {"a": torch.zeros(10)})


def test_a_manifest_whose_bytes_changed_after_the_save_is_refused(tmp_path):
    """The manifest's own CRC32 catches what no other check would: a plain value edited (the
    step count 7 read as 8), a piece's CRC edited together with its data. Version 1
    manifests (no crc32) are still read."""
    save_sharded(tmp_path, {"a": torch.arange(10.0), "step": 7})
    path = tmp_path / "manifest.json"
    good = path.read_bytes()
    assert json.loads(good)["crc32"] == zlib.crc32(good[:good.rindex(b',\n"crc32": ')])
    path.write_bytes(good.replace(b'"value": 7', b'"value": 8'))
    with pytest.raises(fdp.CheckpointError, match="damaged: its bytes do not match the CRC32 it was written with"):
        load_sharded(tmp_path, {"a": torch.zeros(10), "step": 0})
    for cut in (b',\n"crc32": ', b'"crc32": '):  # the field gone, or its line changed
        at = good.rindex(cut)
        path.write_bytes(good[:at] + b"}\n" if cut.startswith(b",") else good[:at] + b'"crc32": 1}\n')
        with pytest.raises(fdp.CheckpointError, match="CRC32"):
            load_sharded(tmp_path, {"a": torch.zeros(10), "step": 0})
    path.write_text(as_version_1(json.loads(good)))
    assert load_sharded(tmp_path, {"a": torch.zeros(10), "step": 0})["step"] == 7


def test_neither_saving_nor_loading_unpickles(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling")

    for module, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    fdp.testing.run(saved_in_parts, 2, args=(str(tmp_path), 0))
    assert fdp.testing.run(loaded_in_parts, 2, args=(str(tmp_path), 1)) == [[], []]


def test_mismatches_are_refused_naming_the_leaf(tmp_path):
    save_sharded(tmp_path, {"w": torch.ones(2, 3), "n": 1, "rng": fdp.rng_state()})
    like = {"w": torch.zeros(2, 3), "n": 0, "rng": fdp.rng_state()}
    for wrong, match in [({**like, "extra": torch.ones(1)}, r"no leaf \['extra'\]"),
                         ({"w": like["w"], "n": 0}, r"has a leaf \['rng'\]\['cpu'\], which the train state lacks"),
                         ({**like, "w": torch.zeros(3, 2)}, r"leaf \['w'\] has shape \(2, 3\) .* shape \(3, 2\)"),
                         ({**like, "w": torch.zeros(2, 3, dtype=torch.float64)}, "dtype torch.float64"),
                         ({**like, "n": 0.0}, r"leaf \['n'\] is 1 \(int\) in the checkpoint, 0.0"),
                         ({**like, "n": torch.zeros(1)}, r"leaf \['n'\] is 1 \(int\) in the checkpoint, a Tensor"),
                         ({**like, "w": 0}, r"leaf \['w'\] is a tensor of shape \(2, 3\)")]:
        with pytest.raises(fdp.CheckpointError, match=match):
            load_sharded(tmp_path, wrong)

    save_sharded(tmp_path / "no-rng", {"w": torch.ones(2, 3)})

    def on_two(group):  # per-rank state does not fit another world size; the rest does
        with pytest.raises(fdp.CheckpointError, match=r"world of 1 ranks, but this world has 2.*\['rng'\]\['cpu'\]"):
            load_sharded(tmp_path, {"w": torch.zeros(2, 3), "n": 0, "rng": fdp.rng_state(group)}, group)
        with pytest.raises(fdp.CheckpointError, match="strict_world_size=True"):
            load_sharded(tmp_path / "no-rng", {"w": torch.zeros(2, 3)}, group, strict_world_size=True)
        return load_sharded(tmp_path / "no-rng", {"w": torch.zeros(2, 3)}, group)["w"].sum().item()

    assert fdp.testing.run(on_two, 2) == [6.0, 6.0]
    with pytest.raises(fdp.CheckpointError, match="no sharded checkpoint at .*nowhere"):
        load_sharded(tmp_path / "nowhere", like)
    fdp.save(tmp_path / "one.pt", like)
    with pytest.raises(fdp.CheckpointError, match="one written by fdp.save"):
        load_sharded(tmp_path / "one.pt", like)


def test_what_cannot_be_saved_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    def gap(group):  # rank 1 holds nothing: elements 5:10 are on no rank
        save_sharded(tmp_path / "gap", {"t": Shard.of(torch.zeros(10), [(0, 5)] if group.rank == 0 else [])}, group)

    with pytest.raises(fdp.CheckpointError, match=r"leaf \['t'\] \(shape \(10,\)\): no rank holds its elements 5:10"):
        fdp.testing.run(gap, 2)

    def disagree(group):
        save_sharded(tmp_path / "disagree", {"t": torch.zeros(3 + group.rank)}, group)

    with pytest.raises(fdp.ReplicaMismatchError, match=r"leaf \['t'\] has shape \(3,\) tensor float32 on rank 0 but \(4,\) .* on rank 1"):
        fdp.testing.run(disagree, 2)

    def one_bad_leaf(group):
        save_sharded(tmp_path / "bad", {"t": object() if group.rank == 1 else torch.zeros(1)}, group)

    with pytest.raises(fdp.CheckpointError, match=r"could not save .*bad: rank 1: leaf \['t'\] is a object"):
        fdp.testing.run(one_bad_leaf, 2)

    def sharded_state(group):
        params = {"w": torch.zeros(8)}
        step = fdp.Reducer(params, group, shard=True).grad_and_update(lambda p: p["w"].sum(), fdp.optim.sgd(0.1))
        save_sharded(tmp_path / "state", {"opt": step.init(params)}, group)

    with pytest.raises(fdp.CheckpointError, match="step.state_to_shards"):
        fdp.testing.run(sharded_state, 2)
    assert sorted(os.listdir(tmp_path)) == ["bad", "disagree", "gap"] and not any(
        os.listdir(tmp_path / d) for d in ("bad", "disagree", "gap")), "something was written"
    with pytest.raises(fdp.CheckpointError, match="fdp.save_sharded"):
        fdp.save(tmp_path / "x.pt", {"t": Shard.whole(torch.zeros(1))})


# ------------------------------------------------------------------- memory


def peak_growth(fn):
    """(bytes this process's peak resident set grew by while ``fn`` ran, fn's result)."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")
    base = status("VmRSS:")
    out = fn()
    return status("VmHWM:") - base, out


LEAVES, NUMEL = 8, 1 << 20  # 8 leaves of 4 MiB: a 32 MiB state


def memory(group, folder):
    """Every rank holds a quarter of each leaf; it saves, then loads other ranges (half a
    quarter further: each piece it reads is partly needed)."""
    # A warm-up on a tiny tree: a process's first tensor.numpy() costs about 5 MiB, once.
    warm = os.path.join(folder, "warm-up")
    save_sharded(warm, {"w": Shard.of(torch.zeros(8), cut(8, group.size, group.rank))}, group)
    load_sharded(warm, {"w": torch.zeros(8)}, group)
    folder = os.path.join(folder, "state")
    per = NUMEL // group.size
    mine = [(group.rank * per, (group.rank + 1) * per)]
    tree = {f"w{i}": Shard((NUMEL,), torch.float32, mine, torch.arange(*mine[0], dtype=torch.float32) + i)
            for i in range(LEAVES)}
    saving, _ = peak_growth(lambda: save_sharded(folder, tree, group))
    # (tree stays: freed, its memory would be reused by the load and hide what the load allocates)
    lo = group.rank * per + per // 2
    ranges = [(lo, lo + per)] if lo + per <= NUMEL else [(0, lo + per - NUMEL), (lo, NUMEL)]
    like = {f"w{i}": Shard((NUMEL,), torch.float32, ranges, torch.empty(per)) for i in range(LEAVES)}
    loading, got = peak_growth(lambda: load_sharded(folder, like, group))
    want = torch.cat([torch.arange(a, b, dtype=torch.float32) for a, b in ranges])
    right = all(torch.equal(got[f"w{i}"].data, want + i) for i in range(LEAVES))
    return saving, loading, right


@pytest.mark.slow  # (memory of a large state)
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_saving_and_loading_hold_a_ranks_part_and_one_leaf_never_the_state(tmp_path):
    """A 32 MiB state on 4 gloo ranks: saving writes from the Shards' own memory (no copy),
    loading allocates this rank's part (8 MiB) and at most a piece or two besides; a gather
    would hold the whole 32 MiB. Each rank's peak resident memory is measured in its own
    process, forked from a fresh interpreter (ranks forked from this one would inherit its
    heap, whose free space depends on the tests that ran before)."""
    state, leaf = LEAVES * NUMEL * 4, NUMEL * 4
    code = ("import json, sys; sys.path.insert(0, 'tests'); import fdp.testing; "
            "from test_sharded_checkpoint import memory; "
            f"print(json.dumps(fdp.testing.run(memory, 4, backend='gloo', timeout=120, args=({str(tmp_path)!r},))))")
    # Every tensor of 64 KiB or more its own mmap, unmapped when freed: the resident set then
    # follows what is allocated (fdp's own malloc setting keeps freed memory for reuse, and
    # glibc's default threshold moves), not where the heap happened to have room.
    env = procs.clean_env(FDP_MALLOC="os", MALLOC_MMAP_THRESHOLD_="65536")
    done = procs.run([sys.executable, "-c", code], timeout=240, env=env, cwd=procs.ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    print("peak growth per rank (MiB), saving / loading:",
          [(round(s / 2**20, 2), round(ld / 2**20, 2)) for s, ld, _ in results])
    for rank, (saving, loading, right) in enumerate(results):
        assert right, f"rank {rank} loaded the wrong elements"
        assert saving < leaf, f"rank {rank}: saving grew the peak by {saving / 2**20:.1f} MiB"
        assert loading < state / 4 + leaf, f"rank {rank}: loading grew the peak by {loading / 2**20:.1f} MiB"


def shards_kept_across_steps(group, folder):
    """state_to_shards taken after step 1 and saved after step 3: every field of the saved state
    is step 3's (it mixed step 1's count with step 3's moments)."""
    apply, params, buffers = fdp.functionalize(mlp(seed=5))
    opt = fdp.optim.inject_hyperparams(fdp.optim.adamw)(lr=1e-2)
    step = fdp.Reducer(params, group, shard=True, **CAPS).grad_and_update(loss_of(apply, buffers), opt)
    state, p = step.init(params), dict(params)
    p, state, _ = step(p, state, *batch(group.rank, 0))
    shards = step.state_to_shards(state, p)
    for i in (1, 2):
        p, state, _ = step(p, state, *batch(group.rank, i))
    fdp.save_sharded(folder, {"opt": shards})
    got = fdp.load_sharded(folder, {"opt": step.state_to_shards(step.init(p), p)})
    return step.state_to_tree(step.state_from_shards(got["opt"], p), p), step.state_to_tree(state, p)


def test_state_to_shards_reads_one_moment_even_when_saved_steps_later(tmp_path):
    for rank, (loaded, live) in enumerate(fdp.testing.run(shards_kept_across_steps, 2, args=(str(tmp_path / "c"),))):
        a, b = fdp._tree.leaves(loaded), fdp._tree.leaves(live)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank}"


def partial_loads(group, folder):
    """A training checkpoint (params as Shards, the optimizer state, a step count, per-rank RNG
    states) saved on this world; only the params loaded back, on this world or as whole tensors."""
    w = torch.arange(24.0).view(4, 6)
    lo, hi = cut(24, group.size, group.rank)[0]
    save_sharded(folder, {"params": {"w": Shard.of(w, [(lo, hi)])}, "opt": {"m": torch.ones(3)}, "step": 5,
                          "rng": fdp.rng_state()}, group)
    out = {}
    try:
        load_sharded(folder, {"params": {"w": torch.zeros(4, 6)}}, group)
    except fdp.CheckpointError as e:
        out["strict"] = str(e)
    out["whole"] = load_sharded(folder, {"params": {"w": torch.zeros(4, 6)}}, group, partial=True)
    out["mine"] = load_sharded(folder, {"params": {"w": Shard.of(torch.zeros(4, 6), [(lo, hi)])}, "step": 0},
                               group, partial=True)
    try:
        load_sharded(folder, {"params": {"w": torch.zeros(4, 6), "b": torch.zeros(2)}}, group, partial=True)
    except fdp.CheckpointError as e:
        out["missing"] = str(e)
    return out


def test_partial_loads_read_only_the_leaves_asked_for(tmp_path):
    """As DCP and orbax do: the params of a training checkpoint for evaluation or export,
    without a like for the optimizer state; on another world size too, since the per-rank
    RNG states are not asked for. A leaf asked for that the checkpoint lacks is still refused."""
    out = fdp.testing.run(partial_loads, 2, args=(str(tmp_path),))
    for o in out:
        assert "which the train state lacks (to load part of a checkpoint, pass partial=True)" in o["strict"], o
        assert torch.equal(o["whole"]["params"]["w"], torch.arange(24.0).view(4, 6))
        assert o["mine"]["step"] == 5
        assert "has no leaf ['params']['b']" in o["missing"], o["missing"]
    (lo, hi), = cut(24, 2, 1)
    assert torch.equal(out[1]["mine"]["params"]["w"].data, torch.arange(float(lo), float(hi)))
    # on one rank (the checkpoint holds per-rank RNG states of two): only the params
    one = load_sharded(tmp_path, {"params": {"w": torch.zeros(4, 6)}}, partial=True)
    assert torch.equal(one["params"]["w"], torch.arange(24.0).view(4, 6))
    with pytest.raises(fdp.CheckpointError, match="per-rank state"):
        load_sharded(tmp_path, {"params": {"w": torch.zeros(4, 6)}, "rng": fdp.rng_state()}, partial=True)
