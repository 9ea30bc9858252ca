"""The collectives of a compiled step on gloo (``fdp/_comm/traced.py``): fdp's point-to-point
all-gather, reduce-scatter and all-to-all, against torch's own collectives on the same data.

They give what torch's give (the gather bit for bit; the reduce-scatter the sum of the parts
in the eager step's order: this rank's own part, then the peers' in rank order), eagerly, in
a graph of the ``aot_eager`` backend, and compiled by Inductor, which must hold a
reduce-scatter's input (never reuse its buffer) until the wait: the peers read it until then.
"""

import pytest
import torch
from compiling import import_compilers

import fdp
from fdp._comm.traced import traced_all_gather, traced_all_to_all, traced_reduce_scatter

pytestmark = pytest.mark.compile


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def _gathered(t, group):
    funcol = _funcol()
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # (torch 2.13 names)
    return funcol.wait_tensor(gather(t, 0, group.process_group))


def _data(group, n, dtype):
    g = torch.Generator().manual_seed(100 + group.rank)
    return torch.randn(group.size * n, generator=g).to(dtype)


def _in_eager_order(group, flat, n):
    """This rank's part of the sum of every rank's ``flat``: its own part first, then the
    peers' in rank order (what the eager step's exchange adds)."""
    every = _gathered(flat, group).view(group.size, -1)
    me = group.rank
    out = every[me, me * n:(me + 1) * n].clone()
    for j in range(group.size):
        if j != me:
            out = out + every[j, me * n:(me + 1) * n]
    return out


def _eager_case(group, dtype):
    n = 1000
    flat = _data(group, n, dtype)
    shard = flat[:n] * (group.rank + 1)
    gathered = traced_all_gather(shard, group, tag=3)
    expected = _gathered(shard, group)
    reduced = traced_reduce_scatter(flat, group, tag=2)
    return (torch.equal(gathered, expected), torch.equal(reduced, _in_eager_order(group, flat, n)),
            reduced.dtype == dtype, flat.equal(_data(group, n, dtype)))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fdps_gloo_gather_and_reduce_scatter_give_what_torchs_give(world, dtype):
    """Called eagerly (the ops run outside a graph too): the gather is torch's, bit for bit;
    the reduce-scatter is the sum in the eager step's order; the input is left as it was."""
    for got in fdp.testing.run(_eager_case, world, backend="gloo", timeout=120, args=(dtype,)):
        assert got == (True, True, True, True)


def _all_to_all_case(group, dtype):
    """Uneven parts, one of them empty (rank 0 sends rank 1 nothing), against torch's
    ``all_to_all_single`` on the same data."""
    import torch.distributed as dist

    w, me = group.size, group.rank
    sizes = [[(i + 2 * j + 1) % 4 for j in range(w)] for i in range(w)]  # sizes[i][j]: from rank i to rank j
    sizes[0][1] = 0
    in_sizes, out_sizes = sizes[me], [sizes[i][me] for i in range(w)]
    g = torch.Generator().manual_seed(7 + me)
    flat = torch.randn(sum(in_sizes), generator=g).to(dtype)
    got = traced_all_to_all(flat, out_sizes, in_sizes, group)
    expected = flat.new_empty(sum(out_sizes))
    dist.all_to_all_single(expected, flat, out_sizes, in_sizes, group=group.process_group)
    return torch.equal(got, expected), got.dtype == dtype, got.numel() == sum(out_sizes)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fdps_gloo_all_to_all_gives_what_torchs_gives(world, dtype):
    """fdp's all-to-all (clipping's straddling leaves, Muon's owners in a compiled step on
    gloo: an op Inductor's C++ wrapper can call, which torch's cannot) is torch's, bit for bit,
    with uneven and empty parts."""
    for got in fdp.testing.run(_all_to_all_case, world, backend="gloo", timeout=120, args=(dtype,)):
        assert got == (True, True, True)


def _compiled_case(group, backend):
    """A gather, compute, a reduce-scatter of a buffer that dies at its launch, then compute
    that allocates a buffer of the same size before the wait: Inductor would reuse the dead
    buffer if it did not hold it for the collective."""
    import torch._dynamo

    torch._dynamo.reset()
    n = 4096

    def step(shard, w):
        full = traced_all_gather(shard, group, tag=1)
        flat = (full * w).sin()  # (dead once the reduce-scatter is launched)
        got = traced_reduce_scatter(flat, group, tag=0)
        other = (w * 3.0).cos()  # (the same size: a buffer Inductor may take from flat)
        return got * 2.0, other.sum()

    g = torch.Generator().manual_seed(group.rank)
    shard, w = torch.randn(n, generator=g), torch.randn(group.size * n, generator=torch.Generator().manual_seed(7))
    # (Inductor's caches off: the code is this torch's lowering of these ops, not a cached one)
    options = {"fx_graph_cache": False} if backend == "inductor" else None
    compiled = torch.compile(step, fullgraph=True, backend=backend, options=options)
    from fdp import _internals

    (got, other), code = _internals.inductor_code(lambda: compiled(shard, w)) if backend == "inductor" else (
        compiled(shard, w), [])
    # torch's collectives on the same values, with the same compiler

    def reference(shard, w):
        full = _gathered(shard, group)
        flat = (full * w).sin()
        return _in_eager_order(group, flat, n) * 2.0, (w * 3.0).cos().sum()

    want, want_other = torch.compile(reference, fullgraph=True, backend=backend, options=options)(shard, w)
    return torch.equal(got, want), torch.equal(other, want_other), [line.strip() for src in code
                                                                     for line in src.splitlines()]


def _held_until_wait(lines):
    """In Inductor's code: fdp's reduce-scatter, and its input buffer let go (``del``) only
    after the wait of its output."""
    import re

    launch = next(i for i, line in enumerate(lines) if "torch.ops.fdp.reduce_scatter_tensor.default(" in line)
    out, inp = re.match(r"(buf\d+) = torch\.ops\.fdp\.reduce_scatter_tensor\.default\((buf\d+),", lines[launch]).groups()
    waited = next(i for i, line in enumerate(lines) if line == f"torch.ops._c10d_functional.wait_tensor.default({out})")
    let_go = [i for i, line in enumerate(lines) if re.search(rf"\bdel {inp}\b", line)]
    return launch < waited and bool(let_go) and min(let_go) > waited


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_fdps_gloo_collectives_equal_torchs_and_inductor_holds_their_input(backend):
    import_compilers()
    for same, same_other, lines in fdp.testing.run(_compiled_case, 2, backend="gloo", timeout=300, args=(backend,)):
        assert same and same_other
        if backend == "inductor":  # Inductor's code calls fdp's ops, lowered as its own collectives
            assert any("torch.ops.fdp.all_gather_into_tensor.default(" in line for line in lines)
            assert _held_until_wait(lines), "\n".join(lines)


def _missing_peer(group):
    if group.rank == 0:
        try:
            traced_all_gather(torch.ones(8), group, tag=5)
        except Exception as e:  # noqa: BLE001 - what the user would see
            return str(e)
        return "no error"
    return None


def test_a_peer_that_never_gathers_fails_the_wait_with_a_message_naming_the_collective():
    """Rank 1 never issues the gather: rank 0's wait raises within the group's timeout, naming
    the collective and the rank (no hang)."""
    got = fdp.testing.run(_missing_peer, 2, backend="gloo", timeout=20)
    assert "all-gather of a compiled step's bucket (tag 5)" in got[0] and "rank 0 of 2" in got[0], got[0]
