"""The docs' recipes, run as written on 2 gloo ranks and compared with torch's own DDP.

Each test takes a snippet from the Markdown itself (found by a line it contains), so the
doc cannot drift from what is checked here.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from models import batch, init_
from test_docs import code_blocks
from torch import nn

import fdp

DOCS = Path(__file__).resolve().parent.parent / "docs"


def doc_block(name: str, containing: str) -> str:
    """The ```python block of docs/<name> that contains ``containing``."""
    blocks = [code for info, _, code in code_blocks((DOCS / name).read_text())
              if info == "python" and containing in code]
    assert len(blocks) == 1, f"docs/{name}: {len(blocks)} python blocks contain {containing!r}"
    return blocks[0]


def bn_net() -> nn.Module:
    return init_(nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)), seed=2)


def accumulation_vs_ddp(group, steps=3, lr=0.1):
    """concepts.md's 2-micro-batch accumulation, against DDP with no_sync on the first."""
    snippet = doc_block("concepts.md", "accumulate=acc")
    # (micro_loss, the loss over k = 2, is defined in the block before, beside the fused step)
    micro_loss = doc_block("concepts.md", "def micro_loss").split("\n\n")[0]
    ddp = nn.parallel.DistributedDataParallel(bn_net(), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    apply, params, buffers = fdp.functionalize(bn_net())
    reducer = fdp.Reducer(params, group, bucket_cap_mb=0.002, first_bucket_cap_mb=0.002)

    def loss_fn(params, buffers, x, y):
        out, buffers = apply(params, buffers, x)
        return F.cross_entropy(out, y), buffers

    for step in range(steps):
        x, y = batch(group.rank, step, n=16)
        opt.zero_grad()
        with ddp.no_sync():
            (F.cross_entropy(ddp(x[:8]), y[:8]) / 2).backward()
        (F.cross_entropy(ddp(x[8:]), y[8:]) / 2).backward()
        opt.step()

        ns = {"torch": torch, "fdp": fdp, "loss_fn": loss_fn, "reducer": reducer,
              "params": params, "buffers": buffers, "x": x, "y": y}
        exec(micro_loss, ns)
        exec(snippet, ns)  # ends with its sync_buffers: buffers are rank 0's
        buffers = ns["buffers"]
        params = {k: p.clone().add_(ns["grads"][k], alpha=-lr) for k, p in params.items()}
    ref = ddp.module.state_dict()
    return params, buffers, {k: v.clone() for k, v in ref.items()}


def test_concepts_accumulation_snippet_equals_ddp_no_sync_with_batchnorm():
    res = fdp.testing.run(accumulation_vs_ddp, 2, backend="gloo")
    for rank, (params, buffers, ref) in enumerate(res):
        for k, v in params.items():
            assert torch.equal(v, ref[k]), f"rank {rank}, param {k!r}: the doc's accumulation differs from DDP's"
        # The doc syncs at the end of a step; DDP at the start of the next one, so after the
        # last step DDP's rank 1 still holds its own statistics: compare with rank 0's.
        for k, v in buffers.items():
            assert torch.equal(v, res[0][2][k]), f"rank {rank}, buffer {k!r}: differs from DDP's rank 0"
