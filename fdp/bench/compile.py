"""``python -m fdp.bench compile``: what ``torch.compile`` of a whole train step costs, and
what it does to dropout's random stream.

A character-level GPT (nanoGPT's layout, ~0.4M parameters: 4 blocks of width 88, 4 heads,
context 64, vocabulary 65, tied head, a causal mask registered ``persistent=False``, dropout
0.1) is trained with the step of docs/compile.md (``torch.func.grad`` + ``reducer.all_reduce``
+ ``fdp.sync_buffers`` + ``fdp.optim.adamw`` with a float lr) on 2 gloo ranks
(``fdp.testing.run``). Reported per rank: the first compiled call (the compile), the median of
the next steps, the median eager step, and, from the same seed, the loss of one eager and one
compiled step with dropout on and off. The whole thing runs twice, in fresh processes sharing
one Inductor cache folder: first cold (an empty folder), then warm (what a restarted job pays).

``--fused``: instead, the fused step (``reducer.grad_and_update`` with AdamW) unsharded,
``shard=True`` and ``shard="params"`` (one unit per block) through ``step.compile()``, on the same
GPT without dropout: per kind the first compiled call, cold and warm, and the median compiled
and eager steps (interleaved).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import fdp

VOCAB, CONTEXT = 65, 64


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(CONTEXT, CONTEXT)).bool(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        att = self.drop(att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, width: int = 88, depth: int = 4, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(CONTEXT, width)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(depth)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as nanoGPT

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def _measure(group: fdp.Group, cfg: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results: dict = {}
    for dropout in (0.1, 0.0):
        apply, params, buffers = fdp.functionalize(GPT(dropout=dropout))
        params, buffers = fdp.broadcast((params, buffers), group=group)
        reducer = fdp.Reducer(params, group)
        opt = fdp.optim.adamw(lr=1e-3, weight_decay=0.1)
        opt_state = opt.init(params)
        fdp.assert_same_shapes(buffers, group)

        def loss_fn(p, b, x, y):
            out, b = apply(p, b, x)  # noqa: B023 - this iteration's model
            return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)), b

        def train_step(params, buffers, opt_state, x, y):
            (grads, (loss, buffers)) = torch.func.grad_and_value(loss_fn, has_aux=True)(params, buffers, x, y)
            grads = reducer.all_reduce(grads)  # noqa: B023
            buffers = fdp.sync_buffers(buffers, group=group)
            params, opt_state = opt.update(grads, opt_state, params)  # noqa: B023
            return params, buffers, opt_state, loss

        g = torch.Generator().manual_seed(group.rank)
        x = torch.randint(0, VOCAB, (cfg.batch, CONTEXT), generator=g)
        y = torch.randint(0, VOCAB, (cfg.batch, CONTEXT), generator=g)
        state = (params, buffers, opt_state)
        compiled = torch.compile(train_step, fullgraph=True)
        torch.manual_seed(1)
        t0 = time.perf_counter()
        *_, loss_c = compiled(*state, x, y)
        compile_s = time.perf_counter() - t0
        torch.manual_seed(1)
        *_, loss_e = train_step(*state, x, y)
        results[f"loss eager, dropout {dropout}"] = loss_e.item()
        results[f"loss compiled, dropout {dropout}"] = loss_c.item()
        results[f"same loss bits, dropout {dropout}"] = float(torch.equal(loss_e, loss_c))
        # Dropout outside a torch.func transform (an eval-style forward left in train mode):
        # Inductor draws its own random numbers there (see docs/compile.md).
        if dropout:
            fwd = torch.compile(lambda p, b, x: apply(p, b, x)[0], fullgraph=True)  # noqa: B023
            torch.manual_seed(2)
            out_c = fwd(params, buffers, x)
            torch.manual_seed(2)
            out_e = apply(params, buffers, x)[0]
            results["same forward-only output bits, dropout 0.1"] = float(torch.equal(out_c, out_e))
        if dropout:
            times = {"compiled": [], "eager": []}
            for kind, step in (("compiled", compiled), ("eager", train_step)):
                s = state
                for _ in range(cfg.steps):
                    t0 = time.perf_counter()
                    *s, _ = step(*s, x, y)
                    times[kind].append(time.perf_counter() - t0)
            results["params"] = sum(p.numel() for p in params.values())
            results["first compiled call (s)"] = compile_s
            results["compiled step (ms)"] = 1e3 * statistics.median(times["compiled"])
            results["eager step (ms)"] = 1e3 * statistics.median(times["eager"])
        torch.compiler.reset()
    return results


FUSED_KINDS = {"fused": {}, "fused shard=True": {"shard": True}, 'fused shard="params"': {"shard": "params"}}


def _measure_fused(group: fdp.Group, cfg: argparse.Namespace) -> dict:
    """The fused step of each kind (``FUSED_KINDS``) through ``step.compile()`` (Inductor, fdp's
    collective scheduling) on the same GPT without dropout, with AdamW: the first compiled
    call (the compile), the median compiled and eager step after it."""
    torch.set_num_threads(1)
    results: dict = {}
    for kind, kw in FUSED_KINDS.items():
        torch.manual_seed(0)
        net = GPT(dropout=0.0)
        apply, params, buffers = fdp.functionalize(net)
        units = {"units": fdp.units(net, Block)} if kw.get("shard") == "params" else {}
        reducer = fdp.Reducer(params, group, **kw, **units)

        def loss_fn(p, x, y):
            return F.cross_entropy(apply(p, buffers, x)[0].reshape(-1, VOCAB), y.reshape(-1))  # noqa: B023

        step = reducer.grad_and_update(loss_fn, fdp.optim.adamw(lr=1e-3, weight_decay=0.1))
        opt_state = step.init(params)
        p = step.shard(params) if units else params
        g = torch.Generator().manual_seed(group.rank)
        x = torch.randint(0, VOCAB, (cfg.batch, CONTEXT), generator=g)
        y = torch.randint(0, VOCAB, (cfg.batch, CONTEXT), generator=g)
        compiled = step.compile()
        t0 = time.perf_counter()
        p, opt_state, _ = compiled(p, opt_state, x, y)
        results[f"{kind}: first compiled call (s)"] = time.perf_counter() - t0
        times: dict[str, list[float]] = {"compiled": [], "eager": []}
        for _ in range(cfg.steps):
            for how, run in (("compiled", compiled), ("eager", step)):  # (interleaved)
                t0 = time.perf_counter()
                p, opt_state, _ = run(p, opt_state, x, y)
                times[how].append(time.perf_counter() - t0)
        results[f"{kind}: compiled step (ms)"] = 1e3 * statistics.median(times["compiled"])
        results[f"{kind}: eager step (ms)"] = 1e3 * statistics.median(times["eager"])
        torch.compiler.reset()
    return results


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps after the first")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--fused", action="store_true",
                   help="the fused step of every kind through step.compile() instead of the plain step")
    cfg = p.parse_args(argv)
    import os

    with tempfile.TemporaryDirectory(prefix="fdp-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read by the forked ranks
        print(f"torch {torch.__version__}, {cfg.world} gloo ranks, batch {cfg.batch}x{CONTEXT}, "
              f"{os.cpu_count()} CPUs")
        for label in ("cold cache", "warm cache"):
            res = fdp.testing.run(_measure_fused if cfg.fused else _measure, cfg.world, backend="gloo", timeout=1800,
                                  args=(cfg,))
            print(f"{label}:")
            for key in res[0]:
                shown = ", ".join(f"{r[key]:.6g}" for r in res)
                print(f"  {key}: {shown}  (rank 0, rank 1{', ...' if cfg.world > 2 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
