"""fdp.save / fdp.load: atomic, weights_only checkpoints that resume training bit for bit."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from trees import assert_trees_equal

import fdp
import fdp._tree
import fdp.testing
from fdp import load, rng_state, save, set_rng_state
from fdp.optim import AdamWState, SGDState


def train_state(seed):
    """A full train state: params, buffers (an int64 counter), two optimizer states, step, rng,
    user metadata. ``seed`` changes every value, not the structure."""
    g = torch.Generator().manual_seed(seed)
    params = {"fc.weight": torch.randn(3, 4, generator=g), "fc.bias": torch.randn(3, generator=g)}
    buffers = {"bn.running_mean": torch.randn(3, generator=g),
               "bn.num_batches_tracked": torch.tensor(seed, dtype=torch.int64)}
    sgd, adamw = fdp.optim.sgd(0.1, momentum=0.9), fdp.optim.adamw(1e-2, amsgrad=True)
    sgd_state, adamw_state = sgd.init(params), adamw.init(params)
    for _ in range(seed % 3 + 1):  # a few steps so the states hold non-zero values
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        _, sgd_state = sgd.update(grads, sgd_state, params)
        params, adamw_state = adamw.update(grads, adamw_state, params)
    return {
        "params": params,
        "buffers": buffers,
        "opt": {"sgd": sgd_state, "adamw": adamw_state},
        "step": seed * 10,
        "rng": rng_state(),
        "meta": {"run": f"run-{seed}", "lr": 0.5 / (seed + 1), "resumed": bool(seed % 2)},
    }


def test_full_train_state_round_trips(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = train_state(seed=4)
    torch.manual_seed(4)  # rng_state() above and below must differ for the test to mean much
    save(path, state)
    fresh = train_state(seed=1)
    out = load(path, like=fresh)
    assert_trees_equal(out, state)
    assert isinstance(out["opt"]["sgd"], SGDState) and isinstance(out["opt"]["adamw"], AdamWState)
    assert out["buffers"]["bn.num_batches_tracked"].dtype == torch.int64
    assert os.listdir(tmp_path) == ["ckpt.pt"], "temporary files left behind"


def test_loaded_tensors_are_placed_on_the_devices_of_like(tmp_path):
    # (a meta like is refused: it would load tensors without data)
    save(tmp_path / "c.pt", {"w": torch.ones(2), "n": 3})
    out = load(tmp_path / "c.pt", like={"w": torch.empty(2, device="cpu"), "n": 0})
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], torch.ones(2)) and out["n"] == 3


def test_a_view_is_saved_without_its_whole_storage(tmp_path):
    big = torch.zeros(1_000_000)
    save(tmp_path / "c.pt", {"w": big[:4]})
    assert os.path.getsize(tmp_path / "c.pt") < 100_000
    assert torch.equal(load(tmp_path / "c.pt", like={"w": torch.empty(4)})["w"], torch.zeros(4))


def test_rng_state_restores_the_random_stream():
    state = rng_state()
    expected = torch.rand(5)
    torch.rand(100)
    set_rng_state(state)
    assert torch.equal(torch.rand(5), expected)


# --------------------------------------------------------------- resume on 2 gloo ranks

SAMPLES, PER_RANK_BATCH = 16, 4  # 2 ranks: 2 steps per epoch, so step 3 is mid-epoch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def fresh_state(group, model_seed):
    torch.manual_seed(model_seed)
    apply, params, buffers = fdp.functionalize(Net())
    opt = fdp.optim.adamw(lambda t: 0.05 * 0.9**t)
    # Each rank draws its own dropout masks from its own stream.
    torch.manual_seed(100 + group.rank + model_seed)
    state = {"params": params, "buffers": buffers, "opt": opt.init(params), "step": 0,
             "meta": {"run": "resume-test", "seed": 7}}
    return apply, opt, state


def batch(group, step):
    g = torch.Generator().manual_seed(42)
    x, y = torch.randn(SAMPLES, 4, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)
    per_step = PER_RANK_BATCH * group.size
    epoch, i = divmod(step, SAMPLES // per_step)
    perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + epoch))
    idx = perm[i * per_step:(i + 1) * per_step][group.rank::group.size]
    return x[idx], y[idx]


def train(group, apply, opt, state, steps):
    def loss_fn(params, buffers, x, y):
        out, new_buffers = apply(params, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    for _ in range(steps):
        x, y = batch(group, state["step"])
        grads, buffers = torch.func.grad(loss_fn, has_aux=True)(
            state["params"], state["buffers"], x, y)
        for g in grads.values():  # plain mean over ranks
            dist.all_reduce(g, group=group.process_group)
            g /= group.size
        params, opt_state = opt.update(grads, state["opt"], state["params"])
        state = {**state, "params": params, "buffers": buffers, "opt": opt_state,
                 "step": state["step"] + 1}
    return state


def resume_vs_uninterrupted(group, folder):
    apply, opt, state = fresh_state(group, model_seed=0)
    straight = train(group, apply, opt, state, 6)

    apply, opt, state = fresh_state(group, model_seed=0)
    state = train(group, apply, opt, state, 3)
    path = os.path.join(folder, "ckpt.pt")
    save(path, {**state, "rng": rng_state(group)}, group)

    # A new "process": other initial weights, another RNG position, then load into it.
    apply, opt, like = fresh_state(group, model_seed=1)
    loaded = load(path, {**like, "rng": rng_state(group)}, group)
    set_rng_state(loaded.pop("rng"), group)
    resumed = train(group, apply, opt, loaded, 3)
    return straight, resumed, rng_state(group)["cpu"]


def test_resume_after_3_steps_equals_6_uninterrupted_steps_on_2_gloo_ranks(tmp_path):
    results = fdp.testing.run(resume_vs_uninterrupted, 2, backend="gloo", timeout=60,
                              args=(str(tmp_path),))
    for rank, (straight, resumed, rngs) in enumerate(results):
        assert resumed["step"] == straight["step"] == 6
        assert not torch.equal(rngs[0], rngs[1]), "ranks should draw different dropout masks"
        for part in ("params", "opt"):
            paths, want, _ = fdp._tree.flatten_with_paths(straight[part])
            for path, a, b in zip(paths, fdp._tree.leaves(resumed[part]), want):
                assert torch.equal(a, b), f"rank {rank}: {part}{path} differs after resuming"
    for path, a, b in zip(fdp._tree.paths(fdp._tree.structure(results[0][0]["params"])),
                          fdp._tree.leaves(results[0][1]["params"]),
                          fdp._tree.leaves(results[1][1]["params"])):
        assert torch.equal(a, b), f"replicas differ at params{path}"


# ------------------------------------------------------------------ atomicity, collectives


def test_every_rank_returns_only_once_the_file_is_in_place(tmp_path):
    path = str(tmp_path / "c.pt")

    def step(group):
        save(path, {"rank0_writes": torch.full((2,), float(group.rank))}, group)
        return os.path.exists(path)

    assert fdp.testing.run(step, 3) == [True, True, True]
    assert torch.equal(load(path, {"rank0_writes": torch.empty(2)}, strict_world_size=False)
                       ["rank0_writes"], torch.zeros(2))


def test_a_failed_write_on_rank_0_raises_on_every_rank(tmp_path):
    path = str(tmp_path / "missing-folder" / "c.pt")

    def step(group):
        try:
            save(path, {"w": torch.ones(1)}, group)
        except fdp.CheckpointError as e:
            return str(e)
        return "returned"

    messages = fdp.testing.run(step, 2)
    assert "could not write" in messages[0] and path in messages[0], messages[0]
    assert "rank 0 could not write" in messages[1], messages[1]


def test_a_crash_between_write_and_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    save(path, {"w": torch.zeros(3), "step": 1})

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(fdp.CheckpointError, match="simulated crash"):
        save(path, {"w": torch.ones(3), "step": 2})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["c.pt"], "the temporary file was left behind"
    out = load(path, {"w": torch.empty(3), "step": 0})
    assert out["step"] == 1 and torch.equal(out["w"], torch.zeros(3))


def test_an_unsupported_leaf_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(fdp.CheckpointError, match=r"leaf \['cfg'\] is a object"):
        save(tmp_path / "c.pt", {"w": torch.ones(1), "cfg": object()})
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- bad files


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_file_gives_checkpoint_error_naming_it(tmp_path, damage):
    path = tmp_path / "c.pt"
    like = train_state(seed=2)
    save(path, like)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2],
                      "garbage": os.urandom(len(data)),
                      "empty": b""}[damage])
    with pytest.raises(fdp.CheckpointError, match=f"cannot read {path}"):
        load(path, like)


def test_a_torch_file_that_is_not_an_fdp_checkpoint_is_refused(tmp_path):
    torch.save({"w": torch.ones(1)}, tmp_path / "plain.pt")
    with pytest.raises(fdp.CheckpointError, match="not a checkpoint written by fdp.save"):
        load(tmp_path / "plain.pt", {"w": torch.ones(1)})


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(fdp.CheckpointError, match=f"no checkpoint at {tmp_path}"):
        load(tmp_path / "nope.pt", {})


@pytest.mark.parametrize("change,match", [
    (lambda s: s["params"].__setitem__("fc.bias", torch.zeros(4)),
     r"leaf \['params'\]\['fc.bias'\] has shape \(3,\) .* shape \(4,\)"),
    (lambda s: s["buffers"].__setitem__("bn.num_batches_tracked", torch.tensor(0.0)),
     r"leaf \['buffers'\]\['bn.num_batches_tracked'\] .*torch.int64 in the checkpoint.*torch.float32"),
    (lambda s: s["params"].__setitem__("fc2.weight", torch.zeros(1)),
     r"has no leaf \['params'\]\['fc2.weight'\]"),
    (lambda s: s["buffers"].pop("bn.running_mean"),
     r"has a leaf \['buffers'\]\['bn.running_mean'\], which the train state lacks"),
    (lambda s: s.__setitem__("step", 0.0),
     r"leaf \['step'\] is 40 \(int\) in the checkpoint, 0.0 \(float\)"),
    (lambda s: s.__setitem__("step", torch.zeros(())),
     r"leaf \['step'\] is a int \(40\), expected a tensor"),
])
def test_a_mismatch_with_the_train_state_names_the_leaf(tmp_path, change, match):
    save(tmp_path / "c.pt", train_state(seed=4))
    like = train_state(seed=4)
    change(like)
    with pytest.raises(fdp.CheckpointError, match=match):
        load(tmp_path / "c.pt", like)


def test_an_optimizer_state_of_another_kind_names_the_leaf(tmp_path):
    params = {"w": torch.ones(2)}
    save(tmp_path / "c.pt", {"opt": fdp.optim.sgd(0.1).init(params)})
    with pytest.raises(fdp.CheckpointError, match=r"\['opt'\].momentum_buffer\['w'\]"):
        load(tmp_path / "c.pt", {"opt": fdp.optim.sgd(0.1, momentum=0.9).init(params)})


def test_a_checkpoint_from_another_world_size_is_refused(tmp_path):
    path = str(tmp_path / "c.pt")

    def write(group):
        save(path, {"w": torch.ones(2), "rng": rng_state(group)}, group)

    fdp.testing.run(write, 2)
    like = {"w": torch.empty(2), "rng": rng_state()}
    with pytest.raises(fdp.CheckpointError, match="world of 2 ranks, but this world has 1"):
        load(path, like)
    like["rng"] = {"cpu": torch.empty(2, like["rng"]["cpu"].shape[1], dtype=torch.uint8)}
    loaded = load(path, like, strict_world_size=False)
    with pytest.raises(fdp.CheckpointError, match="world of 2 ranks, but this world has 1"):
        set_rng_state(loaded["rng"])


# ------------------------------------------------------------------ content checksums


def _flip_a_bit_in_the_largest_record(path):
    """Flip one bit in the middle of the biggest tensor record of torch.save's zip file."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_tensor_record_is_refused_naming_the_leaf(tmp_path):
    path = tmp_path / "c.pt"
    state = {"params": {"w": torch.randn(64, 64), "b": torch.randn(3)}, "step": 7}
    save(path, state)
    _flip_a_bit_in_the_largest_record(path)
    with pytest.raises(fdp.CheckpointError, match=r"leaf \['params'\]\['w'\].*corrupt"):
        load(path, like=state)


def test_a_version_1_checkpoint_without_checksums_still_loads(tmp_path):
    path = tmp_path / "v1.pt"
    torch.save({"format": "fdp.checkpoint", "version": 1, "world_size": 1, "torch": "2.13",
                "leaves": {"['w']": torch.ones(3), "['step']": 4}}, path)
    out = load(path, {"w": torch.zeros(3), "step": 0})
    assert torch.equal(out["w"], torch.ones(3)) and out["step"] == 4


# ------------------------------------------------------------------ world size


def test_a_checkpoint_without_per_rank_state_loads_into_another_world_size(tmp_path):
    path = str(tmp_path / "c.pt")
    state = {"params": {"w": torch.arange(3.0)}, "opt": fdp.optim.sgd(0.1).init({"w": torch.zeros(3)}), "step": 2}
    fdp.testing.run(lambda g: save(path, state, g), 2)
    out = load(path, state)  # a world of one: no strict_world_size=False needed
    assert torch.equal(out["params"]["w"], torch.arange(3.0)) and out["step"] == 2
    with pytest.raises(fdp.CheckpointError, match="world of 2 ranks, but this world has 1, and strict_world_size=True"):
        load(path, state, strict_world_size=True)


def test_a_loaded_rng_state_stays_per_rank_when_saved_again(tmp_path):
    first, second = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")

    def resave(group):
        save(first, {"rng": rng_state(group)}, group)
        save(second, load(first, {"rng": rng_state(group)}, group), group)

    fdp.testing.run(resave, 2)
    with pytest.raises(fdp.CheckpointError, match=r"per-rank state \(\['rng'\]\['cpu'\]\)"):
        load(second, {"rng": {"cpu": torch.empty(2, rng_state()["cpu"].shape[1], dtype=torch.uint8)}})


# ------------------------------------------------------------------ file-system faults


def forked(fn, *args) -> tuple[int, object]:
    """``fn(*args)`` in a forked child (process-wide settings stay there): (exit code, result)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        send.send(fn(*args))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    try:
        result = recv.recv() if recv.poll(120) else None
    except EOFError:  # it died without a result
        result = None
    proc.join(120)
    return proc.exitcode, result


def _save_killed_before_the_rename(path):
    # A writer killed (SIGKILL) after writing its temporary file, before the rename.
    import signal

    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    fdp.save(path, {"w": torch.ones(1000)})


def test_temporary_files_of_a_killed_writer_are_removed_by_the_next_save(tmp_path):
    path = tmp_path / "c.pt"
    (tmp_path / ".other.pt.0123456789ab.tmp").write_bytes(b"not ours")
    code, _ = forked(_save_killed_before_the_rename, str(path))
    assert code == -9, code
    orphans = [n for n in os.listdir(tmp_path) if n.startswith(".c.pt.")]
    assert len(orphans) == 1, os.listdir(tmp_path)
    save(path, {"w": torch.zeros(2)})
    assert sorted(os.listdir(tmp_path)) == [".other.pt.0123456789ab.tmp", "c.pt"]


def _save_past_a_file_size_limit(folder):
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    try:
        fdp.save(os.path.join(folder, "c.pt"), {"w": torch.zeros(1_000_000)})
        error = None
    except fdp.CheckpointError as e:
        error = str(e)
    return error, sorted(os.listdir(folder))


def test_a_file_size_limit_is_named_not_reported_as_an_unexpected_pos(tmp_path):
    code, (error, left) = forked(_save_past_a_file_size_limit, str(tmp_path))
    assert code == 0 and error is not None, (code, error)
    assert "the file-size limit is reached" in error and "needs about 3.8 MiB" in error, error
    assert "unexpected pos" not in error and left == [], (error, left)


FILL = """
import os, sys, torch, fdp
try:
    fdp.save(os.path.join(sys.argv[1], "c.pt"), {"w": torch.zeros(1_000_000)})
except fdp.CheckpointError as e:
    print(e)
print(sorted(os.listdir(sys.argv[1])))
"""


@pytest.mark.slow  # (fills a small file system)
@pytest.mark.multiprocess  # (a tiny tmpfs mounted in a new mount namespace, for a fresh python)
def test_a_full_disk_is_named_with_the_space_needed_and_left(tmp_path):
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("needs `unshare -rm` (user namespaces) to mount a tiny tmpfs")
    script = tmp_path / "fill.sh"
    mount = tmp_path / "tiny"
    mount.mkdir()
    script.write_text('mount -t tmpfs -o size=256k tmpfs "$1" && shift && exec "$@"\n')
    res = subprocess.run(["unshare", "-rm", "sh", str(script), str(mount), sys.executable, "-c", FILL, str(mount)],
                         capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(fdp.__file__)))
    assert "the disk is full: No space left on device" in res.stdout, (res.stdout, res.stderr[-2000:])
    assert "needs about 3.8 MiB" in res.stdout and "is free there" in res.stdout, res.stdout
    assert res.stdout.strip().endswith("[]"), "the temporary file was left behind"


def test_a_pickled_object_is_refused_naming_the_global(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    path = tmp_path / "evil.pt"
    torch.save({"format": "fdp.checkpoint", "version": 2, "world_size": 1, "leaves": {"['x']": Payload()}}, path)
    with pytest.raises(fdp.CheckpointError, match=r"unpickle the Python global (posix|nt)\.system"):
        load(path, {"x": 1})


def test_load_without_like_reads_the_checkpoint_for_inspection(tmp_path):
    params = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(1e-3))
    path = tmp_path / "ckpt.pt"
    fdp.save(path, {"params": params, "opt": opt.init(params), "step": 7, "layers": [torch.ones(1)],
                    "rng": fdp.rng_state()})
    ckpt = fdp.load(path)
    assert ckpt["step"] == 7 and torch.equal(ckpt["params"]["fc.weight"], params["fc.weight"])
    assert set(ckpt["opt"]["optimizer"]) == {"step", "exp_avg", "exp_avg_sq"}  # NamedTuple fields as keys
    assert torch.equal(ckpt["opt"]["optimizer"]["exp_avg"]["fc.bias"], torch.zeros(2))
    assert torch.equal(ckpt["layers"][0], torch.ones(1)) and "cpu" in ckpt["rng"]
    fdp.save(tmp_path / "one.pt", torch.arange(3.0))
    assert torch.equal(fdp.load(tmp_path / "one.pt"), torch.arange(3.0))
    (tmp_path / "bad.pt").write_bytes(path.read_bytes()[:-100])
    with pytest.raises(fdp.CheckpointError, match="truncated, corrupt"):  # the same checks as with like
        fdp.load(tmp_path / "bad.pt")


def test_a_meta_like_and_a_sharded_folder_given_to_load_are_named(tmp_path):
    fdp.save(tmp_path / "c.pt", {"w": torch.ones(2)})
    with pytest.raises(fdp.CheckpointError, match=r"like\['w'\] is on the meta device"):
        fdp.load(tmp_path / "c.pt", like={"w": torch.empty(2, device="meta")})
    fdp.save_sharded(tmp_path / "s", {"w": fdp.Shard.whole(torch.ones(2))})
    with pytest.raises(fdp.CheckpointError, match=r"like\['w'\] is on the meta device"):
        fdp.load_sharded(tmp_path / "s", {"w": torch.empty(2, device="meta")})
    with pytest.raises(fdp.CheckpointError, match="is a sharded checkpoint .* fdp.load_sharded"):
        fdp.load(tmp_path / "s")


def saved_training_state(group, path):
    fdp.save(path, {"params": {"w": torch.arange(6.0)}, "opt": {"m": torch.ones(6)}, "step": 3,
                    "rng": fdp.rng_state()}, group)


def test_a_partial_load_reads_the_leaves_asked_for_on_any_world(tmp_path):
    """The params of a training checkpoint (its optimizer state and per-rank RNG states from 2
    ranks left out), on one rank: partial=True; without it, the message says so."""
    path = str(tmp_path / "ckpt.pt")
    fdp.testing.run(saved_training_state, 2, args=(path,))
    like = {"params": {"w": torch.zeros(6)}}
    with pytest.raises(fdp.CheckpointError, match=r"has a leaf \['opt'\]\['m'\], which the train state lacks "
                                                  r"\(to load part of a checkpoint, pass partial=True\)"):
        fdp.load(path, like, strict_world_size=False)
    assert torch.equal(fdp.load(path, like, partial=True)["params"]["w"], torch.arange(6.0))
    with pytest.raises(fdp.CheckpointError, match="per-rank state"):
        fdp.load(path, {**like, "rng": fdp.rng_state()}, partial=True)
    with pytest.raises(fdp.CheckpointError, match=r"has no leaf \['params'\]\['b'\]"):
        fdp.load(path, {"params": {"w": torch.zeros(6), "b": torch.zeros(1)}}, partial=True)
