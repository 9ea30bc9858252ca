"""fdp.init and fdp.Group."""

import re
import textwrap

import pytest
import torch
import torch.distributed as dist
from procs import clean_env, run, torchrun

import fdp
import fdp.testing


def test_init_without_torchrun_is_a_world_of_one(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    g = fdp.init()
    assert (g.rank, g.size, g.local_rank, g.is_main) == (0, 1, 0, True)
    assert g.process_group is None
    assert not dist.is_initialized()  # no rendezvous happened
    assert fdp.init() == g  # idempotent


def test_group_from_process_group_and_mesh():
    def body(group):
        from torch.distributed.device_mesh import init_device_mesh

        a = fdp.Group.from_process_group(group.process_group)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = fdp.Group.from_mesh(mesh, "dp")
        tp = fdp.Group.from_mesh(mesh, 1)
        return (a.rank, a.size, a.device.type, dp.rank, dp.size, tp.rank, tp.size)

    out = fdp.testing.run(body, 4, backend="gloo", timeout=60)
    # mesh [[0, 1], [2, 3]]: dp groups are columns, tp groups are rows
    assert out == [(0, 4, "cpu", 0, 2, 0, 2), (1, 4, "cpu", 0, 2, 1, 2),
                   (2, 4, "cpu", 1, 2, 0, 2), (3, 4, "cpu", 1, 2, 1, 2)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_init_under_torchrun(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import torch, fdp
        g = fdp.init(timeout=30)
        assert fdp.init().process_group is g.process_group   # idempotent
        t = torch.tensor([g.rank + 1.0])
        torch.distributed.all_reduce(t)
        print(f"RESULT rank={g.rank} size={g.size} local={g.local_rank} main={g.is_main} "
              f"backend={g.backend} sum={t.item():g}", flush=True)
    """))
    proc = run(torchrun(2, str(script)), timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two ranks share one stdout pipe, so lines may run together
    lines = sorted(re.findall(r"RESULT [^\n]*?sum=\d+", proc.stdout))
    assert lines == [
        "RESULT rank=0 size=2 local=0 main=True backend=gloo sum=3",
        "RESULT rank=1 size=2 local=1 main=False backend=gloo sum=3",
    ]


def test_group_timeout_is_used():
    def body(group):
        return group.timeout.total_seconds()

    assert fdp.testing.run(body, 2, backend="gloo", timeout=10) == [8.0, 8.0]
    assert torch.device("cpu") == fdp.testing.run(lambda g: g.device, 1)[0]


def sampled(group) -> list[int]:
    """The documented form: the group's numbers, no process group needed."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    ds = TensorDataset(torch.arange(20))
    sampler = DistributedSampler(ds, num_replicas=group.size, rank=group.rank, seed=0)
    sampler.set_epoch(1)
    return [int(i) for (batch,) in DataLoader(ds, batch_size=4, sampler=sampler) for i in batch]


def test_distributed_sampler_with_the_groups_numbers_runs_in_a_world_of_one_and_on_two_ranks(monkeypatch):
    from torch.utils.data.distributed import DistributedSampler

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    group = fdp.init()
    assert group.size == 1
    with pytest.raises(ValueError, match="process group"):  # what the docs warn about
        DistributedSampler(list(range(20)))
    assert sorted(sampled(group)) == list(range(20))
    for backend in ("threads", "gloo"):
        ranks = fdp.testing.run(sampled, 2, backend=backend, timeout=120)
        assert len(ranks[0]) == len(ranks[1]) == 10 and not set(ranks[0]) & set(ranks[1]), backend
        assert sorted(ranks[0] + ranks[1]) == list(range(20))
        assert ranks[0] != sorted(ranks[0]), "set_epoch's shuffle did not reach the ranks"
