"""fdp.psum / fdp.pmean: pytrees of tensors and Python numbers, summed or averaged over ranks."""

import pytest
import torch

import fdp

BACKENDS = ["threads", "gloo"]


def metrics(group):
    r = group.rank
    tree = {
        "loss": torch.tensor(1.5 + r),                          # fp32 0-d
        "per_class": torch.arange(3, dtype=torch.float64) * (r + 1),
        "half": torch.full((2,), 2.0 * (r + 1), dtype=torch.float16),
        "correct": torch.tensor([r, 2 * r], dtype=torch.int32),
        "seen": 10 + r,                                         # Python int
        "lr": 0.5 * (r + 1),                                    # Python float
        "nested": [True, (torch.tensor([r % 2 == 0]), None)],   # bools count
    }
    return fdp.psum(tree, group), fdp.pmean(tree, group), fdp.pmean(7.0, group)


@pytest.mark.parametrize("backend", BACKENDS)
def test_psum_and_pmean_over_tensors_and_python_numbers(backend):
    n = 3
    for rank, (s, m, scalar) in enumerate(fdp.testing.run(metrics, n, backend=backend)):
        where = f"rank {rank}"
        assert torch.equal(s["loss"], torch.tensor(1.5 * n + 3.0)), where
        assert torch.equal(s["per_class"], torch.arange(3, dtype=torch.float64) * 6), where
        assert s["half"].dtype == torch.float16 and torch.equal(s["half"], torch.full((2,), 12.0, dtype=torch.float16))
        # integer tensors sum in int64 and come back int64 (torch.sum's promotion): no wrap
        assert s["correct"].dtype == torch.int64 and s["correct"].tolist() == [3, 6], where
        assert s["seen"] == 33 and type(s["seen"]) is int, where
        assert s["lr"] == 3.0 and type(s["lr"]) is float, where
        assert s["nested"][0] == 3 and s["nested"][1][0].tolist() == [2] and s["nested"][1][1] is None, where
        torch.testing.assert_close(m["loss"], torch.tensor(2.5))
        # each share is rounded to fp16 once (1/3 is inexact), as the Reducer's buckets are
        torch.testing.assert_close(m["half"], torch.full((2,), 4.0, dtype=torch.float16))
        assert m["correct"].dtype == torch.float64 and m["correct"].tolist() == [1.0, 2.0], where
        assert m["seen"] == 11.0 and type(m["seen"]) is float, where
        assert scalar == 7.0, where


def test_world_of_one_returns_the_same_types():
    s, m, scalar = metrics(fdp.Group.single("cpu"))
    assert s["seen"] == 10 and type(s["seen"]) is int
    assert m["seen"] == 10.0 and type(m["seen"]) is float
    assert m["correct"].is_floating_point() and torch.equal(s["loss"], torch.tensor(1.5))
    assert scalar == 7.0
    loss = torch.tensor(2.0, requires_grad=True) * 3
    out = fdp.pmean({"loss": loss})  # group=None outside torchrun: a world of one
    assert not out["loss"].requires_grad and out["loss"].item() == 6.0


def test_bad_leaves_and_layouts_are_named():
    with pytest.raises(TypeError, match=r"\['name'\] is a str"):
        fdp.psum({"name": "x"})

    def different(group):
        return fdp.pmean({"a": torch.zeros(group.rank + 1)}, group)

    with pytest.raises(fdp.ReplicaMismatchError, match=r"\['a'\] has shape"):
        fdp.testing.run(different, 2)
