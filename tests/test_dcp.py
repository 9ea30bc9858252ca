"""torch.distributed.checkpoint (DCP) and the fused step's state, on 2 gloo ranks, with DCP's
real ``save`` and ``load``.

A sharded ``FusedState`` (``Reducer(shard=True)``) holds this rank's slices; DCP sees a
tuple as one object, which it would pickle from one rank and load on every rank. So DCP
refuses it, wherever it sits in the state dict, on every rank, naming the key, the rank and
what to save instead. What the message says works: ``step.state_to_tree`` saved through DCP
and loaded back resumes the run bit for bit. An unsharded ``FusedState`` (the same on
every rank) still saves and loads through DCP.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from models import batch, ce_loss, mlp

import fdp


def trained(group, shard: bool, steps: int = 3, seed: int = 0):
    apply, params, buffers = fdp.functionalize(mlp(seed=seed))
    opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(1e-2))
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.0005, shard=shard)
    step = reducer.grad_and_update(ce_loss(apply), opt, has_aux=True)
    opt_state = step.init(params)
    for s in range(steps):
        params, opt_state, _ = step(params, opt_state, buffers, *batch(group.rank, s))
    return apply, buffers, opt, step, params, opt_state


def refusals(group, folder: str) -> dict:
    _, _, _, step, params, opt_state = trained(group, shard=True)
    assert opt_state.sharded
    out = {}
    for name, state_dict in {"top": {"params": params, "opt": opt_state},
                             "nested": {"train": {"opt": opt_state}, "params": params}}.items():
        try:
            dcp.save(state_dict, checkpoint_id=os.path.join(folder, name))
            out[name] = "saved"
        except dcp.api.CheckpointException as e:  # (a BaseException): every rank's failure, with its message
            out[name] = str(e)
    return out


def test_dcp_refuses_a_sharded_fused_state_at_any_depth_on_every_rank(tmp_path):
    results = fdp.testing.run(refusals, 2, backend="gloo", timeout=120, args=(str(tmp_path),))
    for rank, out in enumerate(results):
        for name, key in (("top", "opt"), ("nested", "train.opt")):
            msg = out[name]
            assert msg != "saved", f"rank {rank}: DCP saved a sharded state ({name})"
            for part in (f"cannot save {key!r}", "sharded over 2 ranks", "step.state_to_tree(opt_state, params)",
                         "step.state_from_tree"):
                assert part in msg, f"rank {rank}, {name}: {part!r} not in {msg}"
        # DCP reports every rank's failure; each rank named its own slice.
        assert "shard rank 0" in out["top"] and "shard rank 1" in out["top"], out["top"]


def resumed_through_dcp(group, folder: str) -> dict:
    apply, buffers, opt, step, params, opt_state = trained(group, shard=True, steps=6)
    straight = {k: v.clone() for k, v in params.items()}

    apply, buffers, opt, step, params, opt_state = trained(group, shard=True, steps=3)
    path = os.path.join(folder, "ckpt")
    dcp.save({"params": params, "opt": step.state_to_tree(opt_state, params)}, checkpoint_id=path)

    # A new "process": other weights, a fresh state; DCP loads into the per-leaf layout.
    apply, buffers, opt, step, params, opt_state = trained(group, shard=True, steps=0, seed=1)
    like = {"params": {k: v.clone() for k, v in params.items()}, "opt": opt.init(params)}
    dcp.load(like, checkpoint_id=path)
    params, opt_state = like["params"], step.state_from_tree(like["opt"], like["params"])
    for s in range(3, 6):
        params, opt_state, _ = step(params, opt_state, buffers, *batch(group.rank, s))

    # An unsharded FusedState (the same on every rank) goes through DCP as it is.
    _, _, _, ustep, uparams, ustate = trained(group, shard=False)
    upath = os.path.join(folder, "unsharded")
    dcp.save({"opt": ustate}, checkpoint_id=upath)
    _, _, _, _, _, fresh = trained(group, shard=False, steps=0, seed=1)
    loaded = {"opt": fresh}
    dcp.load(loaded, checkpoint_id=upath)
    same = (torch.equal(loaded["opt"].step, ustate.step)
            and all(torch.equal(a, b) for f in ustate.buffers for a, b in zip(loaded["opt"].buffers[f], ustate.buffers[f])))
    return {"straight": straight, "resumed": {k: v.clone() for k, v in params.items()}, "unsharded": same}


def test_state_to_tree_through_dcp_resumes_a_sharded_run_bit_for_bit(tmp_path):
    results = fdp.testing.run(resumed_through_dcp, 2, backend="gloo", timeout=120, args=(str(tmp_path),))
    for rank, res in enumerate(results):
        for k, want in res["straight"].items():
            assert torch.equal(res["resumed"][k], want), (
                f"rank {rank}: params[{k!r}] after 3 steps, dcp.save/dcp.load of state_to_tree and 3 more "
                "steps differs from 6 uninterrupted steps")
        assert res["unsharded"], f"rank {rank}: an unsharded FusedState did not come back through DCP"
