"""HF-style safetensors in and out of fdp: fully sharded params written unit by unit (read back
by ``transformers``' ``from_pretrained``), read range by range into a fully sharded step on
another world size, or whole; the trained params run through the module itself (HF's
``generate``) with ``apply.bound``."""

import json
import os

import pytest
import torch
from hf_models import MODELS, batch, lm_loss
from trees import assert_trees_equal

import fdp


def trained_gpt2(group):
    """GPT-2 trained 2 steps fully sharded, its module then moved to meta: ``(the module,
    apply, buffers, the ShardedParams)``."""
    model, block = MODELS["gpt2"]()
    apply, params, buffers = fdp.functionalize(model)
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(model, block)).grad_and_update(
        lm_loss(apply, buffers), fdp.optim.adamw(lr=1e-2))
    state = step.init(params)
    params = step.shard(params)
    model.to("meta")
    for i in range(2):
        params, state, _ = step(params, state, *batch(group.rank, i))
    return model, apply, buffers, params


def trained(group, folder, max_shard_size):
    """GPT-2 trained 2 steps fully sharded, written to ``folder``; returns the whole params."""
    *_, params = trained_gpt2(group)
    files = fdp.save_safetensors(folder, params, max_shard_size=max_shard_size, metadata={"step": "2"})
    return files, params.full()


def meta_gpt2():
    with torch.device("meta"):
        model, block = MODELS["gpt2"]()
    return model, block


def read_sharded(group, folder):
    """A meta-built GPT-2 whose fully sharded params are read from ``folder`` (each rank its
    bytes), on this world size."""
    model, block = meta_gpt2()
    apply, params, buffers = fdp.functionalize(model)
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(model, block)).grad_and_update(
        lm_loss(apply, buffers), fdp.optim.adamw(lr=1e-2))
    return step.shard(fdp.safetensors_params(folder)).full()


@pytest.mark.parametrize("max_shard_size", [4000, 5 * 2**30])
def test_fully_sharded_params_written_unit_by_unit_load_in_transformers_and_back_at_another_world_size(
        tmp_path, max_shard_size):
    from transformers import AutoModelForCausalLM
    folder = str(tmp_path / "gpt2")
    (files, want), _ = fdp.testing.run(trained, 2, args=(folder, max_shard_size))
    if max_shard_size == 4000:
        assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
        with open(os.path.join(folder, files[-1])) as f:
            index = json.load(f)
        assert set(index["weight_map"]) == set(want)
    else:
        assert files == ["model.safetensors"]
    assert sorted(os.listdir(folder)) == sorted(files)  # no temporary files left

    MODELS["gpt2"]()[0].config.save_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for key, t in want.items():
        assert torch.equal(hf[key], t), key

    for rank, got in enumerate(fdp.testing.run(read_sharded, 3, args=(folder,))):
        assert_trees_equal(got, want, f"read on 3 ranks, rank {rank}")
    model, _ = meta_gpt2()
    _, params, _ = fdp.functionalize(model)
    assert_trees_equal(fdp.safetensors_params(folder).materialize(params, device="cpu"), want, "whole")


def test_a_whole_tree_round_trips_with_names_and_casts_to_the_params_dtype(tmp_path):
    params = {"a.weight": torch.randn(3, 4), "b": torch.arange(5.0, dtype=torch.float64)}
    buffers = {"stats": torch.tensor([1, 2, 3])}
    files = fdp.save_safetensors(tmp_path, params, buffers, names={"a.weight": "renamed"})
    assert files == ["model.safetensors"]
    src = fdp.safetensors_params(tmp_path / "model.safetensors", names={"a.weight": "renamed"})
    assert set(src.tensors) == {"renamed", "b", "stats"}
    got = src.materialize({**params, **buffers})
    assert_trees_equal(got, {**params, **buffers}, "round trip")
    as_f32 = src.materialize({"b": torch.empty(5, dtype=torch.float32, device="meta")}, device="cpu")
    assert as_f32["b"].dtype == torch.float32 and torch.equal(as_f32["b"], torch.arange(5.0))


def test_missing_names_other_shapes_and_truncated_files_are_named(tmp_path):
    fdp.save_safetensors(tmp_path, {"w": torch.ones(4, 4)})
    src = fdp.safetensors_params(tmp_path)
    with pytest.raises(KeyError, match="'v' is not in .*names="):
        src.materialize({"v": torch.empty(4, 4, device="meta")}, device="cpu")
    with pytest.raises(ValueError, match=r"'w' is \[4, 4\] in .*'w' is \[2, 8\]"):
        src.materialize({"w": torch.empty(2, 8, device="meta")}, device="cpu")
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(fdp.CheckpointError, match="ends inside 'w'"):
        fdp.safetensors_params(tmp_path).materialize({"w": torch.empty(4, 4, device="meta")}, device="cpu")
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(fdp.CheckpointError, match="not a safetensors file"):
        fdp.safetensors_params(tmp_path)
    with pytest.raises(FileNotFoundError):
        fdp.safetensors_params(tmp_path / "nothing")


def fails_on_rank_0(group, folder):
    model, block = MODELS["gpt2"]()
    apply, params, buffers = fdp.functionalize(model)
    step = fdp.Reducer(params, group, shard="params", units=fdp.units(model, block)).grad_and_update(
        lm_loss(apply, buffers), fdp.optim.sgd(lr=0.1))
    sharded = step.shard(params)
    try:
        fdp.save_safetensors(folder, sharded, max_shard_size=4000)
    except fdp.CheckpointError as e:
        after = sharded.full()  # the gathers went on in step: the ranks are still in lockstep
        return str(e), len(after)
    return None


def test_a_write_that_fails_on_rank_0_is_raised_on_every_rank_and_nothing_hangs(tmp_path):
    folder = tmp_path / "a-file"
    folder.write_text("not a folder")
    got = fdp.testing.run(fails_on_rank_0, 2, args=(str(folder),), timeout=60)
    assert "could not write" in got[0][0] and "rank 0 could not write" in got[1][0]
    assert got[0][1] == got[1][1] > 0


def generate(group):
    """GPT-2 trained fully sharded, then HF's generate run on the module with the sharded
    params bound (every rank the same calls), beside the whole params."""
    model, apply, buffers, params = trained_gpt2(group)
    prompt = batch(0, 0)[0][:1, :4]
    with apply.eval().bound(params, buffers) as m:
        sharded = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert all(t.is_meta for t in model.parameters())  # the module's own tensors are back
    whole = params.full()
    with torch.no_grad(), apply.eval().bound(whole, buffers) as m:
        plain = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return sharded, plain, whole


def test_generate_runs_on_the_module_with_fully_sharded_params_bound():
    from transformers import GPT2LMHeadModel
    results = fdp.testing.run(generate, 2)
    sharded, plain, whole = results[0]
    assert torch.equal(sharded, plain) and torch.equal(results[1][0], sharded)
    ref = GPT2LMHeadModel(MODELS["gpt2"]()[0].config)
    ref.load_state_dict(whole, strict=False)
    with torch.no_grad():
        want = ref.eval().generate(batch(0, 0)[0][:1, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(sharded, want)
