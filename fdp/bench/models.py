"""``python -m fdp.bench``: fdp beside torch DDP on the same models, data and process group.

For each model, every rank trains the same per-rank data through these steps, interleaved
step by step (the order rotates) in one process group, warm-up excluded:

  local      the gradient (fdp's engine: autograd on detached leaves) and the optimizer,
             no communication: the floor;
  ddp        torch ``DistributedDataParallel``: forward, ``backward()``, ``torch.optim.SGD``;
  fdp        ``reducer.grad``: all-reduce overlapped with the backward;
  fdp-after  ``Reducer(overlap=False).grad``: the same engine, the whole gradient first, then
             the bucketed all-reduce (what overlap buys is fdp-after minus fdp);
  func-ar    ``torch.func.grad`` to completion, then ``reducer.all_reduce``: the functional
             step written by hand (torch.func's own wrapping costs show here);
  fused      ``reducer.grad_and_update`` with ``donate=True``: params, grads and optimizer state
             in flat buckets, each bucket's update as soon as its all-reduce lands;
  fused-pure the same, pure (the new params in a second set of flat buffers);
  sharded    the fused step of ``Reducer(shard=True)``, donated: each rank updates and keeps
             1/world of the optimizer state (reduce-scatter, slice update, all-gather);
  compiled   (``--compiled``) ``torch.compile(fullgraph=True)`` of the ``func-ar`` step:
             collectives inside the graph.

Every step includes the optimizer (``--optim``: SGD with momentum 0.9, AdamW, or Muon on the
2-D params with AdamW on the rest; in place for both libraries; torch.optim's own
``SGD``/``AdamW``/``Muon`` for DDP) and, for
models with BatchNorm, the buffer synchronisation (DDP's per-forward broadcast; fdp's
``sync_buffers``). Reported per model and step kind: the median step time, its ratio to
DDP's, the exposed communication (median step minus median local step), the CPU time per
step of the rank's threads other than the one running the step ("comm cpu": gloo's workers,
which on a machine with no spare core take that time from the backward), the minor page
faults per step (``getrusage``: memory the allocator took from the kernel) and the peak memory
of the step, measured separately per kind in a fresh world (peak RSS over the RSS before the
first step on CPU; ``max_memory_allocated`` on CUDA), and the optimizer state one rank
holds ("opt MiB").

Runs by itself (it forks its own 2-rank gloo world on 127.0.0.1) or under torchrun.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fdp

from .rss import reset_peak_rss, rss
from .table import Table, ratio, render
from .zoo import MODELS, loss

KINDS = ("local", "ddp", "fdp", "fdp-after", "func-ar", "fused", "fused-pure", "sharded")
FUSED = ("fused", "fused-pure", "sharded")
LR = 0.01


class _MuonAndAdamW:
    """torch.optim.Muon on the 2-D params and AdamW on the others, stepped together (the
    usual pairing, as DDP users write it)."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        self.opts = [torch.optim.Muon([p for p in params if p.dim() == 2], lr=LR * 0.2),
                     torch.optim.AdamW([p for p in params if p.dim() != 2], lr=LR * 0.1, weight_decay=0.01)]

    @property
    def state(self) -> dict:
        return {k: v for o in self.opts for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def make_optimizers(cfg: argparse.Namespace, donate: bool = True) -> tuple[Callable, Any]:
    """(torch.optim factory for DDP's parameters, the fdp optimizer with the same numbers)."""
    if getattr(cfg, "optim", "sgd") == "muon":
        return (_MuonAndAdamW, fdp.optim.partition(
            lambda key, p: "muon" if p.dim() == 2 else "adamw",
            {"muon": fdp.optim.muon(lr=LR * 0.2, donate=donate),
             "adamw": fdp.optim.adamw(lr=LR * 0.1, weight_decay=0.01, donate=donate)}))
    if getattr(cfg, "optim", "sgd") == "adamw":
        return (lambda ps: torch.optim.AdamW(ps, lr=LR * 0.1, weight_decay=0.01),
                fdp.optim.adamw(lr=LR * 0.1, weight_decay=0.01, donate=donate))
    return (lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
            fdp.optim.sgd(lr=LR, momentum=0.9, donate=donate))


# ----------------------------------------------------------------------------- steps
class Steps:
    """The step kinds for one model, each with its own replica of the same weights."""

    def __init__(self, name: str, group: fdp.Group, cfg: argparse.Namespace,
                 kinds: tuple[str, ...] = KINDS, n_layers: int | None = None) -> None:
        make, data = MODELS[name]
        if n_layers is not None:  # a small stand-in of the same kind (warm-up)
            make = functools.partial(make, n_layers)
        self.name, self.group = name, group
        device = group.device
        torch.manual_seed(0)
        template = make().to(device)
        g = torch.Generator().manual_seed(100 + group.rank)
        self.batches = [tuple(t.to(device) for t in data(g)) for _ in range(4)]
        self.i = 0

        if "ddp" in kinds:  # DDP with torch.optim.SGD
            ddp_model = make().to(device)
            ddp_model.load_state_dict(template.state_dict())
            self.ddp = nn.parallel.DistributedDataParallel(ddp_model, bucket_cap_mb=cfg.bucket_cap_mb)
            if cfg.hook != "allreduce":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                ddp_hook = {"bf16_compress": _ddp_bf16, "fp16_compress": default_hooks.fp16_compress_hook}[cfg.hook]
                self.ddp.register_comm_hook(group.process_group, ddp_hook)
            self.ddp_opt = make_optimizers(cfg)[0](self.ddp.parameters())

        # fdp: one functional replica per kind (so no kind sees another's updates)
        self.apply, _, _ = fdp.functionalize(template)
        self.state: dict[str, Any] = {}
        for kind in kinds:
            if kind != "ddp":
                params = {k: v.detach().clone() for k, v in template.named_parameters()}
                buffers = {k: v.clone() for k, v in template.named_buffers()}
                if kind != "local":  # what DDP's constructor does, as fdp's users do it
                    params, buffers = fdp.broadcast((params, buffers), group=group)
                opt = make_optimizers(cfg, donate=kind != "fused-pure")[1]
                self.state[kind] = [params, buffers, None, opt]
        self.has_buffers = any(True for _ in template.buffers())
        params = {k: v.detach() for k, v in template.named_parameters()}
        # DDP's first bucket is 1 MiB only when the cap is left at its default
        first_cap = 1 if cfg.bucket_cap_mb == 25 else cfg.bucket_cap_mb
        self.reducer = fdp.Reducer(params, group, bucket_cap_mb=cfg.bucket_cap_mb,
                                   first_bucket_cap_mb=first_cap, comm_hook=getattr(fdp.hooks, cfg.hook))

        def loss_fn(params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
            out, new_buffers = self.apply(params, buffers, x)
            return loss(name, out, y), new_buffers

        self.loss_fn = loss_fn
        self.grad_fn = self.reducer.grad(loss_fn, has_aux=True)
        self.fused: dict[str, Any] = {}
        for kind in FUSED:
            if kind in kinds:
                st = self.state[kind]
                reducer = self.reducer if kind != "sharded" else fdp.Reducer(
                    params, group, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_cap_mb=first_cap,
                    comm_hook=getattr(fdp.hooks, cfg.hook), shard=True)
                self.fused[kind] = reducer.grad_and_update(loss_fn, st[3], has_aux=True,
                                                           donate=kind != "fused-pure")
        for kind, st in self.state.items():
            st[2] = self.fused[kind].init(st[0]) if kind in self.fused else st[3].init(st[0])
        self.func_grad = torch.func.grad(loss_fn, has_aux=True)
        after = fdp.Reducer(params, group, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_cap_mb=first_cap,
                            comm_hook=getattr(fdp.hooks, cfg.hook), overlap=False) if "fdp-after" in kinds else None
        self.after_grad = after.grad(loss_fn, has_aux=True) if after else None
        if "compiled" in kinds:
            if self.has_buffers:  # sync_buffers skips its cross-rank check inside the graph
                fdp.assert_same_shapes(self.state["compiled"][1], group)
            self.compiled = torch.compile(self._func_ar_step, fullgraph=True)

    def _local_grad(self, params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss, buffers = self.loss_fn(leaves, buffers, x, y)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return dict(zip(leaves, grads)), buffers

    def _func_ar_step(self, params: dict, buffers: dict, opt_state: Any, x: torch.Tensor, y: torch.Tensor,
                      opt: Any) -> tuple:
        grads, buffers = self.func_grad(params, buffers, x, y)
        grads = self.reducer.all_reduce(grads)
        if self.has_buffers:
            buffers = fdp.sync_buffers(buffers, group=self.group)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, buffers, opt_state

    def state_mib(self, kind: str) -> float:
        """The optimizer state this rank holds for ``kind`` (MiB)."""
        state = self.ddp_opt.state if kind == "ddp" else self.state[kind][2]
        return sum(t.numel() * t.element_size() for t in _tensors(state)) / 2**20

    def batch(self) -> tuple:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b

    def run(self, kind: str) -> None:
        x, y = self.batch()
        if kind == "ddp":
            self.ddp_opt.zero_grad(set_to_none=False)
            loss(self.name, self.ddp(x), y).backward()
            self.ddp_opt.step()
            return
        params, buffers, opt_state, opt = self.state[kind]
        if kind in ("func-ar", "compiled"):
            step = self.compiled if kind == "compiled" else self._func_ar_step
            self.state[kind] = [*step(params, buffers, opt_state, x, y, opt), opt]
            return
        if kind in self.fused:
            params, opt_state, (_, buffers) = self.fused[kind](params, opt_state, buffers, x, y)
            if self.has_buffers:
                buffers = fdp.sync_buffers(buffers, group=self.group)
            self.state[kind] = [params, buffers, opt_state, opt]
            return
        if kind == "fdp":
            grads, buffers = self.grad_fn(params, buffers, x, y)
        elif kind == "fdp-after":
            grads, buffers = self.after_grad(params, buffers, x, y)
        else:
            grads, buffers = self._local_grad(params, buffers, x, y)
        if self.has_buffers and kind != "local":
            buffers = fdp.sync_buffers(buffers, group=self.group)
        params, opt_state = opt.update(grads, opt_state, params)
        self.state[kind] = [params, buffers, opt_state, opt]


def _tensors(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


def _ddp_bf16(state: Any, bucket: Any) -> Any:
    # DDP refuses bf16_compress_hook off CUDA by its name only; gloo reduces bf16 fine.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _sync(group: fdp.Group) -> None:
    if group.device.type == "cuda":
        torch.cuda.synchronize()
    if group.process_group is not None:
        dist.barrier(group=group.process_group)


def time_model(name: str, group: fdp.Group, cfg: argparse.Namespace, kinds: tuple[str, ...]) -> dict:
    steps = Steps(name, group, cfg, kinds)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    faults: dict[str, list[int]] = {k: [] for k in kinds}
    others: dict[str, list[float]] = {k: [] for k in kinds}
    exposed: list[float] = []
    for i in range(cfg.warmup + cfg.steps):
        order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]  # rotate: no kind always first
        for kind in order:
            _sync(group)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            c0 = time.thread_time()
            t = time.perf_counter()
            steps.run(kind)
            if group.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if i >= cfg.warmup:
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                times[kind].append(dt)
                faults[kind].append(r1.ru_minflt - r0.ru_minflt)
                # CPU time of every thread but this one (gloo's, any intra-op pool's)
                cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
                others[kind].append(cpu - (time.thread_time() - c0))
                if kind == "fdp":
                    exposed.append(steps.reducer.last_step.timeline.exposed_comm)
    # every rank's view; rank 0's is reported (all ranks waited at the same barriers)
    out = {k: statistics.median(v) * 1000 for k, v in times.items()}
    out["iqr"] = {k: [q * 1000 for q in statistics.quantiles(v, n=4)[::2]] for k, v in times.items() if len(v) > 1}
    out["faults"] = {k: statistics.median(v) for k, v in faults.items() if v}
    out["other_cpu"] = {k: statistics.median(v) * 1000 for k, v in others.items() if v}
    out["state_mib"] = {k: steps.state_mib(k) for k in kinds}
    out["fdp_timeline_exposed"] = statistics.median(exposed) * 1000 if exposed else None
    out["buckets"] = len(steps.reducer.plan.buckets)
    out["leaves"] = len(steps.reducer.plan.slots)
    out["mbytes"] = sum(b.nbytes for b in steps.reducer.plan.buckets) / 2**20
    return out


def memory_model(name: str, kind: str, group: fdp.Group, cfg: argparse.Namespace) -> float | None:
    """Peak memory (MiB) that `kind` adds: a fresh world running this kind only.

    Measured from before the model is built to the peak over its construction (model,
    replica, optimizer state, DDP's or fdp's buffers) and four steps, so state that one
    library allocates up front and the other during its steps is counted for both.
    """
    # Build and step a tiny model of every kind first: the imports and one-time setup both
    # libraries do (DDP's constructor imports torch._dynamo, ~100 MiB of resident modules)
    # must not count as the model's memory.
    warm = argparse.Namespace(**{**vars(cfg), "bucket_cap_mb": 25})
    tiny = Steps("tiny1000", group, warm, kinds=KINDS, n_layers=2)
    for k in KINDS:
        tiny.run(k)
    del tiny
    import gc

    gc.collect()
    if group.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        if not reset_peak_rss():
            return None
        base = rss()[0]
    steps = Steps(name, group, cfg, kinds=(kind,))
    for _ in range(4):
        _sync(group)
        steps.run(kind)
    if group.device.type == "cuda":
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return (rss()[1] - base) / 2**20


# ----------------------------------------------------------------------------- driver
def _per_rank(group: fdp.Group, cfg: argparse.Namespace) -> dict:
    torch.set_num_threads(cfg.threads)
    results: dict[str, Any] = {"models": {}, "sweep": {}}
    for name in cfg.models:
        torch.compiler.reset()
        results["models"][name] = time_model(name, group, cfg, cfg.kinds)
    if cfg.sweep:
        for cap in cfg.sweep_caps:
            sub = argparse.Namespace(**{**vars(cfg), "bucket_cap_mb": cap})
            r = time_model(cfg.sweep_model, group, sub, ("ddp", "fdp"))
            results["sweep"][cap] = {"ddp": r["ddp"], "fdp": r["fdp"], "buckets": r["buckets"]}
    return results


def _memory_rank(group: fdp.Group, cfg: argparse.Namespace, name: str, kind: str) -> float | None:
    torch.set_num_threads(cfg.threads)
    return memory_model(name, kind, group, cfg)


def _launch(fn: Callable, cfg: argparse.Namespace, *extra: Any) -> list:
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        group = fdp.init()
        return [fn(group, cfg, *extra)]
    # DDP's constructor imports torch._dynamo: imported here once, every forked world has it
    # (instead of importing it afresh, about a second per world; it starts no thread).
    import torch._dynamo  # noqa: F401
    return fdp.testing.run(fn, cfg.world_size, backend="gloo", timeout=cfg.timeout, args=(cfg, *extra))


def table(results: dict, cfg: argparse.Namespace) -> str:
    world = cfg.world_size if "RANK" not in os.environ else int(os.environ.get("WORLD_SIZE", cfg.world_size))
    main = Table(f"models: one step of each kind, {world} ranks, median of {cfg.steps} steps (interleaved, after "
                 f"{cfg.warmup} warm-up); exposed = ms - local's", [
                     "model", "step", "ms", "x ddp", "exposed ms", "comm cpu", "faults", "peak MiB", "opt MiB"], keys=2)
    for name, r in results["models"].items():
        for kind in cfg.kinds:
            ms = r[kind]
            mem = r.get("memory", {}).get(kind)
            faults = r.get("faults", {}).get(kind)
            other = r.get("other_cpu", {}).get(kind)
            main.row(name, kind, f"{ms:.2f}", ratio(ms, r["ddp"]), "" if kind == "local" else f"{ms - r['local']:.2f}",
                     "" if other is None else f"{other:.2f}", "" if faults is None else f"{faults:.0f}",
                     "" if mem is None else f"{mem:.1f}", f"{r.get('state_mib', {}).get(kind, 0):.2f}")
        tl = r["fdp_timeline_exposed"]
        main.note(f"({name}: {r['leaves']} leaves, {r['mbytes']:.1f} MiB in {r['buckets']} buckets"
                  + ("" if tl is None else f"; fdp timeline exposed comm {tl:.2f} ms") + ")")
    tables = [main]
    if results.get("sweep"):
        sweep = Table(f"bucket cap sweep ({cfg.sweep_model})", ["cap MiB", "buckets", "ddp ms", "fdp ms", "x ddp"])
        for cap, r in results["sweep"].items():
            sweep.row(f"{cap}", f"{r['buckets']}", f"{r['ddp']:.2f}", f"{r['fdp']:.2f}", ratio(r["fdp"], r["ddp"]))
        tables.append(sweep)
    return render(tables)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    ncols = 2 if results.get("sweep") else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4), dpi=110, squeeze=False)
    ax = axes[0][0]
    kinds = results["config"]["kinds"]
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        vals = [results["models"][m][kind] / results["models"][m]["ddp"] for m in models]
        ax.bar([i + (j - (len(kinds) - 1) / 2) * width for i in range(len(models))], vals, width, label=kind)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("step time / DDP's (lower is better)")
    ax.legend(fontsize=8)
    ax.set_title("median step time relative to DDP")
    if results.get("sweep"):
        ax = axes[0][1]
        caps = list(results["sweep"])
        for kind in ("ddp", "fdp"):
            ax.plot(caps, [results["sweep"][c][kind] for c in caps], "o-", label=kind)
        ax.set_xscale("log")
        ax.set_xlabel("bucket cap (MiB)")
        ax.set_ylabel("median step (ms)")
        ax.legend()
        ax.set_title("bucket cap sweep")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn,tiny1000,transformer",
                   help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--steps", type=int, default=20, help="timed steps per kind (medians)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--world-size", type=int, default=2, help="ranks to fork when not under torchrun")
    p.add_argument("--hook", default="allreduce", choices=["allreduce", "bf16_compress", "fp16_compress"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--optim", default="sgd", choices=["sgd", "adamw", "muon"],
                   help="the optimizer of every kind (torch.optim's for DDP, fdp.optim's for fdp)")
    p.add_argument("--kinds", default=None, help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    p.add_argument("--compiled", action="store_true",
                   help="also time the torch.compile(fullgraph=True) step (compiles per model: slow)")
    p.add_argument("--sweep", action="store_true", help="also time bucket caps 0.25 .. 100 MiB")
    p.add_argument("--sweep-model", default="mlp")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG chart here")
    p.add_argument("--timeout", type=float, default=1800)
    cfg = p.parse_args(argv)
    cfg.models = [m for m in cfg.models.split(",") if m]
    unknown = [m for m in cfg.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    cfg.sweep_caps = [0.25, 1, 5, 25, 100]
    kinds = tuple(k for k in cfg.kinds.split(",") if k) if cfg.kinds else KINDS
    bad = [k for k in kinds if k not in KINDS]
    if bad or not {"local", "ddp"} <= set(kinds):
        p.error(f"--kinds must include local and ddp and come from {list(KINDS)}; got {list(kinds)}")
    cfg.kinds = kinds + (("compiled",) if cfg.compiled else ())
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))

    results = _launch(_per_rank, cfg)[0]
    results["config"] = dict(vars(cfg))
    if not cfg.no_memory:
        for name in cfg.models:
            results["models"][name]["memory"] = {
                kind: _launch(_memory_rank, cfg, name, kind)[0] for kind in cfg.kinds
            }
    results["torch"] = torch.__version__
    under_torchrun = "RANK" in os.environ
    if not under_torchrun or int(os.environ["RANK"]) == 0:
        print(table(results, cfg))
        if cfg.json:
            with open(cfg.json, "w") as f:
                json.dump(results, f, indent=2, default=str)
        if cfg.plot:
            plot(results, cfg.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
