"""The CUDA subset: runs only where a GPU is present (CI on this machine has none).

NCCL in a world of one (this process), Triton kernels on device memory, and the stream
ordering the Reducer relies on: bucket fill -> NCCL all-reduce -> gradients used on the
caller's stream. `python -m fdp.bench gpu` is the prepared, longer GPU check.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import batch, cnn, mlp

import fdp
from fdp import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@pytest.fixture
def nccl_world():
    assert not dist.is_initialized()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield fdp.Group.from_process_group(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hook", [None, fdp.hooks.bf16_compress])
def test_reducer_grad_on_cuda_equals_local_grads(nccl_world, hook):
    model = mlp(width=256, seed=1).cuda()
    apply, params, buffers = fdp.functionalize(model)
    reducer = fdp.Reducer(params, nccl_world, comm_hook=hook, bucket_cap_mb=0.05, first_bucket_cap_mb=0.05)
    x, y = (t.cuda() for t in batch(0, n=64))

    def loss_fn(p):
        return F.cross_entropy(apply(p, buffers, x)[0], y)

    for _ in range(3):  # buffers, streams and allocator reuse across steps
        grads = reducer.grad(loss_fn)(params)
        ref = torch.func.grad(loss_fn)(params)
        for k in ref:
            want = ref[k] if hook is None else ref[k].bfloat16().float()
            assert grads[k].device.type == "cuda"
            assert torch.equal(grads[k], want), k
    assert reducer.last_step.timeline.buckets[0].launch < reducer.last_step.timeline.backward_end


def test_batchnorm_step_on_cuda(nccl_world):
    apply, params, buffers = fdp.functionalize(cnn(seed=2).cuda())
    params, buffers = fdp.broadcast((params, buffers), group=nccl_world)
    reducer = fdp.Reducer(params, nccl_world)
    opt = fdp.optim.adamw(lr=1e-3)
    state = opt.init(params)
    x, y = (t.cuda() for t in batch(0, n=8, shape=(3, 8, 8)))

    def loss_fn(p, b):
        out, b = apply(p, b, x)
        return F.cross_entropy(out, y), b

    grads, buffers = reducer.grad(loss_fn, has_aux=True)(params, buffers)
    buffers = fdp.sync_buffers(buffers, group=nccl_world)
    params, state = opt.update(grads, state, params)
    fdp.assert_replicas_equal((params, buffers), nccl_world)
    assert all(v.is_cuda for v in params.values())


@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernels_on_cuda_match_the_torch_path_bitwise(dst):
    if kernels.select(torch.device("cuda")) != "triton":
        pytest.skip(reason="triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    srcs = [torch.randn(s, generator=g, device="cuda") for s in [(3,), (17, 5), (), (0,), (1000,), (64, 33)]]
    srcs.append(torch.randn(8, 6, generator=g, device="cuda").t())  # strided
    n = sum(t.numel() for t in srcs)
    a = kernels.flatten(srcs, torch.empty(n, dtype=dst, device="cuda"), scale=1 / 3, impl="triton")
    b = kernels.flatten(srcs, torch.empty(n, dtype=dst, device="cuda"), scale=1 / 3, impl="torch")
    assert torch.equal(a, b)
    outs_a = [torch.empty_like(t) for t in srcs]
    outs_b = [torch.empty_like(t) for t in srcs]
    kernels.unflatten(a, outs_a, impl="triton")
    kernels.unflatten(a, outs_b, impl="torch")
    assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))


def test_sharded_fused_step_on_nccl_runs_the_native_collectives_and_equals_the_unsharded(nccl_world):
    # A world of one still issues NCCL's reduce_scatter_tensor and all_gather_into_tensor
    # (the native path of fdp/_shard.py), so this checks their layout on device memory.
    apply, params, buffers = fdp.functionalize(mlp(width=256, seed=3).cuda())
    x, y = (t.cuda() for t in batch(0, n=64))

    def loss_fn(p):
        return F.cross_entropy(apply(p, buffers, x)[0], y)

    out = []
    for shard in (False, True):
        reducer = fdp.Reducer(params, nccl_world, shard=shard, bucket_cap_mb=0.05, first_bucket_cap_mb=0.05)
        step = reducer.grad_and_update(loss_fn, fdp.optim.adamw(lr=1e-3, weight_decay=0.1))
        state, p = step.init(params), {k: v.clone() for k, v in params.items()}
        for _ in range(3):
            p, state, _ = step(p, state)
        out.append(p)
    for k in out[0]:
        assert out[1][k].is_cuda and torch.equal(out[0][k], out[1][k]), k
