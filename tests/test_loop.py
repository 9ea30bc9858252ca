"""The loop users write: a nanoGPT-style trainer with tied weights, a decay mask,
warm-up + cosine, clipping and 4 micro-batches, on 2 gloo ranks: fdp's recommended fused step
(``step.accumulate`` for the first micro-batches), the pure and sharded fused steps and the
plain path give DDP + ``no_sync`` + ``clip_grad_norm_`` + torch.optim.AdamW's params bit for
bit, in fp32 and under bf16 autocast (``python -m fdp.bench loop`` times the same loop)."""

import pytest

import fdp
from fdp.bench import loop


@pytest.mark.slow  # (the whole loop beside DDP)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_nanogpt_loop_equals_ddp_bit_for_bit(autocast):
    cfg = {"kinds": ("ddp", "fused", "fused-pure", "sharded", "plain"), "steps": 6, "warmup": 0, "micro": 4,
           "batch_size": 4, "autocast": autocast}
    results = fdp.testing.run(loop.run, 2, backend="gloo", args=(cfg,), timeout=300)
    for rank, res in enumerate(results):
        assert res["leaves"] == 28, "the model has 28 leaves (wte tied to the head, kept once)"
        for kind, same in res["identical"].items():
            assert same == res["leaves"], (
                f"rank {rank}: {kind} has {same} of {res['leaves']} leaves identical with DDP's "
                f"(max relative difference {res['max_rel'][kind]:.3g})")


def test_the_bench_reports_every_kind_and_its_ratio(capsys):
    assert loop.main(["--steps", "2", "--warmup", "0", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert set(rows) == set(loop.KINDS), out
    for kind, cells in rows.items():
        total, ratio = float(cells[1]), float(cells[3])
        assert total > 0 and ratio > 0, (kind, cells)
        if kind != "ddp":
            assert cells[4] == "28/28", (kind, cells)
