"""``python -m fdp.bench overlap``: how much compute Inductor schedules between each collective's
launch and its wait in a compiled fused step, with its default scheduling, with its
compute/communication reordering, and with fdp's pass (docs/compile.md).

A GPT (``--layers`` blocks of width ``--width``, tied head) with AdamW, the fused step of
``Reducer(shard=...)`` (``--shard``: ``True`` or ``params``) with small buckets (several
collectives), compiled by ``step.compile()`` with Inductor on 2 gloo ranks, four times (``HOW``):
Inductor's defaults (``schedule=False``), its ``reorder_for_compute_comm_overlap`` with the
passes torch 2.13's ``inductor/config.py`` recommends, fdp's pass (``fdp/_comm/schedule.py``,
``step.compile()``'s default), and both. Inductor's generated code of the step (rank 0's) is
read (its Python wrapper: ``cpp_wrapper=False``): the collectives (``torch.ops._c10d_functional.*``,
and on gloo fdp's ``torch.ops.fdp.*``) in the order they are issued, each
paired with its ``wait_tensor``, and the kernels issued between the two (the compute a
collective can overlap). Reported: the compile time, the kernels in the step, and per
collective the kernels between its launch and its wait.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

import fdp

from . import zoo

VOCAB, CONTEXT = 256, 32
REORDER = {"reorder_for_compute_comm_overlap": True,
           "reorder_for_compute_comm_overlap_passes": ["reorder_communication_preserving_peak_memory",
                                                       "sink_waits_iterative",
                                                       "reorder_communication_preserving_peak_memory"]}
# How each run compiles: Inductor's defaults (fdp's pass off), its reordering passes, fdp's pass
# (step.compile()'s default), both.
# Each with Inductor's Python wrapper (its code is what is read here; step.compile() compiles it
# to C++ on CPU by default, which calls the same kernels in the same order).
PYTHON = {"cpp_wrapper": False}
HOW = {"inductor": {"schedule": False, "options": PYTHON},
       "reordered": {"schedule": False, "options": {**REORDER, **PYTHON}},
       "fdp": {"options": PYTHON}, "fdp+reorder": {"options": {**REORDER, **PYTHON}}}
_COLLECTIVE = re.compile(r"torch\.ops\.(?:_c10d_functional|fdp)\.(\w+)\.default\(")
_KERNEL = re.compile(r"^(\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|aten\.\w+)\(")


def schedule(code: str) -> tuple[list[tuple[str, int]], int]:
    """``([(collective, kernels between its launch and its wait), ...], kernels in all)``
    from Inductor's generated code (launches paired with waits in order)."""
    pending: list[tuple[str, int]] = []
    pairs, kernels = [], 0
    for line in (raw.strip() for raw in code.splitlines()):
        m = _COLLECTIVE.search(line)
        if m and m.group(1) == "wait_tensor":
            if pending:
                name, at = pending.pop(0)
                pairs.append((name, kernels - at))
        elif m:
            pending.append((m.group(1), kernels))
        elif _KERNEL.match(line):
            kernels += 1
    return pairs, kernels


def rank(group: fdp.Group, cfg: argparse.Namespace, how: str) -> dict:
    from .._internals import dynamo_reset, inductor_code

    dynamo_reset()
    torch.manual_seed(0)
    net = zoo.GPT(VOCAB, CONTEXT, cfg.width, cfg.layers, heads=4, nanogpt_init=False)
    apply, params, _ = fdp.functionalize(net)
    shard = True if cfg.shard == "True" else "params"
    units = {"units": fdp.units(net, zoo.GPTBlock)} if shard == "params" else {}
    reducer = fdp.Reducer(params, group, shard=shard, bucket_cap_mb=cfg.bucket_cap_mb,
                          first_bucket_cap_mb=cfg.bucket_cap_mb / 2, **units)
    step = reducer.grad_and_update(
        lambda p, x, y: F.cross_entropy(apply(p, {}, x)[0].view(-1, VOCAB), y.reshape(-1)), fdp.optim.adamw(lr=1e-3))
    state = step.init(params)
    p = step.shard(params) if shard == "params" else params
    compiled = step.compile(**HOW[how])
    g = torch.Generator().manual_seed(group.rank)
    data = torch.randint(VOCAB, (4, CONTEXT + 1), generator=g)
    t0 = time.perf_counter()
    _, codes = inductor_code(lambda: compiled(p, state, data[:, :-1], data[:, 1:]))
    pairs, kernels = schedule("\n".join(codes))
    return {"compile_s": time.perf_counter() - t0, "kernels": kernels, "pairs": pairs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--shard", choices=("True", "params"), default="True")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bucket-cap-mb", type=float, default=0.5)
    cfg = p.parse_args(argv)
    for how in HOW:
        r: dict[str, Any] = fdp.testing.run(rank, 2, backend="gloo", timeout=1800, args=(cfg, how))[0]
        between = [n for _, n in r["pairs"]]
        kinds = sorted({name for name, _ in r["pairs"]})
        print(f"{how:9}: compiled in {r['compile_s']:.1f} s, {r['kernels']} kernels, "
              f"{len(between)} collectives ({', '.join(kinds)}); kernels between launch and wait: {between} "
              f"(total {sum(between)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
