"""``python -m fdp.bench loop``: the loop users write, fdp beside DDP + torch.optim in one run.

A nanoGPT-style trainer: a 2-layer, 64-wide character GPT with tied embedding and head,
AdamW with weight decay on the 2-D weights only, a linear warm-up then cosine decay (the lr
set every step from nanoGPT's ``get_lr``), gradient clipping at norm 1.0, and 4 micro-batches
per step, the first 3 without communication. On 2 gloo ranks, each kind trains its own
replica from the same start on the same batches, interleaved step by step (the order
rotates; the ranks start each step together), and after the run every kind's params are
compared with DDP's:

  ddp       ``DistributedDataParallel`` with ``no_sync()`` for the first micro-batches,
            ``clip_grad_norm_``, ``torch.optim.AdamW`` with two param groups;
  fused     fdp's recommended loop: ``step.accumulate`` for the first micro-batches, then
            the fused step (``reducer.grad_and_update``) with
            ``chain(clip_by_global_norm, adamw(mask=, lr=schedule))``, ``donate=True``;
  fused-pure  the same, pure (``donate=False``, the default);
  sharded   the fused step of ``Reducer(shard=True)`` (ZeRO: 1/world of AdamW's state per rank);
  plain     ``fdp.local_grad`` for the first micro-batches (their gradients summed), then
            ``reducer.grad(..., accumulate=sum)`` + ``opt.update``;
  compiled  (``--compiled``) the plain loop with its two steps (a local micro-batch, the last
            micro-batch with the all-reduce and the update) each ``torch.compile``-d;
  compiled-fused, compiled-sharded  (``--compiled``) the fused and the sharded kinds with
            their step and accumulate each compiled as one graph (``step.compile()``);
  ddp-compiled, ddp-compiled-autograd  (``--compiled``) DDP compiled two ways (of the model
            compiled: DDPOptimizer; under compiled autograd: ``fdp/bench/ddp.py``), clipping
            and AdamW as ddp's.
  ``--cpp-wrapper``: every compiled kind with Inductor's C++ wrapper (the code calling the
  kernels compiled too, not run as Python; ``options={"cpp_wrapper": True}``: fdp's
  ``step.compile()`` kinds have it by default on CPU); ``--python-wrapper``: every compiled
  kind with the Python wrapper (``options={"cpp_wrapper": False}``, torch's default).
  ``--skip-module-guards``: every compiled kind compiled with
  ``options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}``: dynamo
  does not check the model's modules before each call (docs/compile.md, "Each call's cost").

Reported: per kind, the total time of the timed steps, the median step, the ratio of totals
to DDP's, and how many of the params are bit-identical with DDP's after the run (compiled
kernels may round differently: the compiled kind is shown, not required, to be identical).
Exits 1 if an eager kind is not bit-identical with DDP.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fdp

from .. import _internals
from . import ddp as ddp_kinds
from . import zoo
from .table import Table, ratio

KINDS = ("ddp", "fused", "fused-pure", "sharded", "plain")
COMPILED = ("compiled-fused", "compiled-sharded")  # (with "compiled" and PEERS: --compiled)
DDPS = ddp_kinds.KINDS
PEERS = DDPS[1:]  # DDP compiled two ways
FUSED = ("fused", "fused-pure", "sharded", *COMPILED)
VOCAB, BLOCK, WIDTH, LAYERS, HEADS = 32, 32, 64, 2, 4


def GPT() -> zoo.GPT:  # noqa: N802 - (the model's name, as nanoGPT calls it)
    """nanoGPT's model, small: tied embedding and head, nanoGPT's init."""
    return zoo.GPT(VOCAB, BLOCK, WIDTH, LAYERS, HEADS)


def get_lr(it: Any, peak: float = 3e-3, warmup: int = 10, total: int = 100, floor: float = 3e-4) -> Any:
    """nanoGPT's ``get_lr``: linear warm-up, cosine decay to ``floor``. Under torch.compile
    the optimizer calls it with the step count as a tensor: the same formula without Python
    branches then, so the compiled step neither breaks its graph nor recompiles between the
    phases (its lr may differ from the float one in the last bit)."""
    if isinstance(it, torch.Tensor):
        ratio = ((it - warmup) / (total - warmup)).clamp(0.0, 1.0)
        cosine = floor + 0.5 * (1.0 + torch.cos(math.pi * ratio)) * (peak - floor)
        return torch.where(it < warmup, peak * (it + 1) / (warmup + 1), cosine)
    if it < warmup:
        return peak * (it + 1) / (warmup + 1)
    if it > total:
        return floor
    ratio = (it - warmup) / (total - warmup)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


def batch(step: int, micro: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(((step * 64 + micro) * 1024) + rank)
    data = torch.randint(VOCAB, (size, BLOCK + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def decays(path: Any, p: torch.Tensor) -> bool:
    return p.dim() >= 2


class Loop:
    """One replica per kind of the same model, trained on the same batches."""

    def __init__(self, group: fdp.Group, kinds: tuple[str, ...], micro: int, batch_size: int, steps: int,
                 autocast: bool = False, compile_options: dict | None = None) -> None:
        self.group, self.kinds, self.k, self.bs = group, kinds, micro, batch_size
        given = {"options": dict(compile_options)} if compile_options else {}  # (torch.compile's, each compiled kind)
        # bf16 autocast of the forward (params, gradients and AdamW stay fp32), on both sides
        self.autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else _null
        torch.manual_seed(0)
        template = GPT()
        self.lr = lambda t: get_lr(t, total=steps)
        self.opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), fdp.optim.adamw(
            lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1, mask=decays))
        self.apply, _, _ = fdp.functionalize(template)
        k = micro

        def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with self.autocast():
                logits, _ = self.apply(params, {}, x)
            return F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1)) / k

        self.loss_fn = loss_fn
        self.state: dict[str, list[Any]] = {}
        # kind -> (the DDP module, its forward, its optimizer, the context of its steps)
        self.ddps: dict[str, tuple[nn.Module, Any, torch.optim.Optimizer, Any]] = {}
        for kind in kinds:
            if kind in DDPS:
                model = GPT()
                model.load_state_dict(template.state_dict())
                ddp, forward, running = ddp_kinds.build(kind, model, group.process_group, compile_options)
                named = list(model.named_parameters())
                opt = torch.optim.AdamW(
                    [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                     {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                    lr=self.lr(0), betas=(0.9, 0.95))
                self.ddps[kind] = (ddp, forward, opt, running)
                continue
            _, params, _ = fdp.functionalize(template)
            params = fdp.broadcast({n: t.detach().clone() for n, t in params.items()}, group=group)
            reducer = fdp.Reducer(params, group, shard=kind in ("sharded", "compiled-sharded"))
            if kind in FUSED:
                step = reducer.grad_and_update(loss_fn, self.opt, donate=kind != "fused-pure")
                run = step.compile(**given) if kind in COMPILED else step
                self.state[kind] = [params, step.init(params), run, reducer]
            else:
                self.state[kind] = [params, self.opt.init(params), None, reducer]
        if "compiled" in kinds:
            reducer = self.state["compiled"][3]
            opt = self.opt

            def local(params: dict, x: torch.Tensor, y: torch.Tensor, acc: dict | None) -> dict:
                g = torch.func.grad(loss_fn)(params, x, y)
                return g if acc is None else {n: acc[n] + g[n] for n in g}

            def last(params: dict, opt_state: Any, x: torch.Tensor, y: torch.Tensor, acc: dict) -> tuple:
                g = torch.func.grad(loss_fn)(params, x, y)
                g = reducer.all_reduce({n: acc[n] + g[n] for n in g})
                return opt.update(g, opt_state, params)

            self.compiled_local = torch.compile(local, **given)
            self.compiled_last = torch.compile(last, **given)

    def step(self, kind: str, t: int) -> None:
        k, rank, bs = self.k, self.group.rank, self.bs
        batches = [batch(t, m, rank, bs) for m in range(k)]
        if kind in DDPS:
            model, forward, opt, running = self.ddps[kind]
            for g in opt.param_groups:
                g["lr"] = self.lr(t)
            with running():
                for m, (x, y) in enumerate(batches):
                    ctx = model.no_sync() if m < k - 1 else _null()
                    with ctx:
                        with self.autocast():
                            logits = forward(x)
                        (F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1)) / k).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return
        st = self.state[kind]
        params, opt_state, step, reducer = st
        if kind in FUSED:
            for x, y in batches[:-1]:
                step.accumulate(params, x, y)  # (compiled kinds: compiled.accumulate, in a graph)
            st[0], st[1], _ = step(params, opt_state, *batches[-1])
            return
        if kind == "plain":
            local = fdp.local_grad(self.loss_fn)
            acc = None
            for x, y in batches[:-1]:
                g = local(params, x, y)
                acc = g if acc is None else {n: acc[n] + g[n] for n in g}
            grads = reducer.grad(self.loss_fn, accumulate=acc)(params, *batches[-1])
            st[0], st[1] = self.opt.update(grads, opt_state, params)
            return
        acc = None  # compiled
        for x, y in batches[:-1]:
            acc = self.compiled_local(params, x, y, acc)
        st[0], st[1] = self.compiled_last(params, opt_state, *batches[-1], acc)

    def params(self, kind: str) -> dict[str, torch.Tensor]:
        if kind in DDPS:
            return {n: p.detach().clone() for n, p in self.ddps[kind][0].module.named_parameters()}
        return {n: t.detach().clone() for n, t in self.state[kind][0].items()}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def run(group: fdp.Group, cfg: dict) -> dict:
    """Every kind's step times and params after ``cfg["steps"]`` steps (warm-up excluded)."""
    torch.set_num_threads(1)
    if cfg.get("cpp_wrapper"):
        _internals.inductor_cpp_wrapper()
    kinds = tuple(cfg["kinds"])
    options: dict[str, Any] = {}
    if cfg.get("skip_module_guards"):
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    if cfg.get("python_wrapper"):
        options["cpp_wrapper"] = False
    loop = Loop(group, kinds, cfg["micro"], cfg["batch_size"], cfg["steps"], cfg.get("autocast", False),
                options or None)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    first: dict[str, float] = {}  # each kind's first step (a compiled kind's compilation)
    for t in range(cfg["warmup"] + cfg["steps"]):
        order = kinds[t % len(kinds):] + kinds[:t % len(kinds)]  # rotate: no kind always runs first
        for kind in order:
            # every rank starts each kind's step together (as ``bench sharded``): a rank's lag
            # at the end of one kind's step is not timed as the next kind's wait
            fdp.pmean({"x": torch.zeros(1)}, loop.group)
            t0 = time.perf_counter()
            loop.step(kind, t)
            if t >= cfg["warmup"]:
                times[kind].append(time.perf_counter() - t0)
            elif t == 0:
                first[kind] = time.perf_counter() - t0
    ref = loop.params("ddp") if "ddp" in kinds else None
    out: dict[str, Any] = {"times": times, "identical": {}, "leaves": 0, "first": first}
    if ref is not None:
        out["leaves"] = len(ref)
        for kind in kinds:
            if kind != "ddp":
                got = loop.params(kind)
                out["identical"][kind] = sum(torch.equal(got[n], ref[n]) for n in ref)
                out.setdefault("max_rel", {})[kind] = max(
                    float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)) for n in ref)
    return out


def report(results: list[dict], kinds: tuple[str, ...], title: str = "nanoGPT-style loop") -> tuple[str, bool]:
    """The table (rank 0's numbers; the step time is the slowest rank's) and whether every
    eager kind was bit-identical with DDP on every rank (compiled kinds are shown, not required)."""
    times = {k: [max(r["times"][k][i] for r in results) for i in range(len(results[0]["times"][k]))] for k in kinds}
    ddp_total = sum(times["ddp"]) if "ddp" in times else None
    table = Table(title, ["kind", "total s", "median ms", "x ddp", "identical to ddp"])
    ok = True
    for k in kinds:
        total, med = sum(times[k]), statistics.median(times[k]) * 1e3
        same = "" if k == "ddp" else f"{min(r['identical'][k] for r in results)}/{results[0]['leaves']}"
        if k not in ("ddp", "compiled", *COMPILED, *PEERS) and results[0]["leaves"] and any(
                r["identical"][k] != r["leaves"] for r in results):
            ok = False
        table.row(k, f"{total:.3f}", f"{med:.2f}", ratio(total, ddp_total), same)
    firsts = [f"{k} {max(r['first'].get(k, 0.0) for r in results):.1f} s" for k in kinds if "compiled" in k]
    if firsts:
        table.note("(first step, the compilation, slowest rank: " + ", ".join(firsts) + ")")
    return table.render(), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per rank")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--compiled", action="store_true", help="add the compiled kinds (plain loop, fused, sharded)")
    p.add_argument("--autocast", action="store_true", help="bf16 autocast of the forward, on every side")
    wrapper = p.add_mutually_exclusive_group()
    wrapper.add_argument("--cpp-wrapper", action="store_true",
                         help="every compiled kind (fdp's and DDP's) with Inductor's C++ wrapper "
                              "(options={'cpp_wrapper': True}; fdp's step.compile() kinds have it by default on CPU)")
    wrapper.add_argument("--python-wrapper", action="store_true",
                         help="every compiled kind with Inductor's Python wrapper (options={'cpp_wrapper': False})")
    p.add_argument("--skip-module-guards", action="store_true",
                   help="every compiled kind (fdp's and DDP's) compiled with options={'guard_filter_fn': "
                        "torch.compiler.skip_guard_on_all_nn_modules_unsafe}: dynamo does not check the model's "
                        "modules before each call")
    p.add_argument("--json", default=None, help="also write the raw results here")
    a = p.parse_args(argv)
    if a.skip_module_guards and not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        p.error(f"--skip-module-guards: torch {torch.__version__} has no "
                "torch.compiler.skip_guard_on_all_nn_modules_unsafe (torch 2.9 and later have it)")
    kinds = tuple(a.kinds.split(",")) + (("compiled", *COMPILED, *PEERS) if a.compiled else ())
    cfg = {"kinds": kinds, "steps": a.steps, "warmup": a.warmup, "micro": a.micro, "batch_size": a.batch_size,
           "autocast": a.autocast, "cpp_wrapper": a.cpp_wrapper, "python_wrapper": a.python_wrapper,
           "skip_module_guards": a.skip_module_guards}
    results = fdp.testing.run(run, a.world, backend="gloo", args=(cfg,), timeout=3600)
    table, ok = report(results, kinds, (
        f"nanoGPT-style loop: {LAYERS} layers x {WIDTH} wide, tied head, {a.micro} micro-batches of "
        f"{a.batch_size} x {BLOCK} tokens per rank, clip 1.0, AdamW (decay mask), warm-up + cosine; "
        f"{a.world} gloo ranks, {a.steps} steps" + (", bf16 autocast" if a.autocast else "")
        + (", Inductor's C++ wrapper" if a.cpp_wrapper else "")
        + (", Inductor's Python wrapper" if a.python_wrapper else "")
        + (", the modules' guards skipped" if a.skip_module_guards else "")))
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
