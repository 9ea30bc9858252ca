"""``python -m fdp.bench sharded``: memory and step time of the ways to shard, side by side.

A GPT-style model (token and position embeddings, ``--layers`` pre-norm blocks of width
``--width``, a final LayerNorm and a head tied to the token embedding), trained with AdamW
(and ``--clip``: clipping at norm 1.0) on gloo ranks, each of these kinds from the same start
on the same batches:

  ddp     ``DistributedDataParallel`` + ``torch.optim.AdamW`` (every rank: params, ``.grad``,
          DDP's buckets, the whole AdamW state);
  zero2   fdp's fused step with ``Reducer(shard=True)`` (ZeRO-1/2: 1/world of AdamW's state);
  zero3   fdp's fused step with ``Reducer(shard="params", units=<the blocks>)`` (ZeRO-3:
          1/world of the params, gradients and state at rest; a block gathered while it runs);
  fsdp2   torch's ``fully_shard`` on each block and on the model + ``torch.optim.AdamW``;
  with ``--compiled``, each compiled with Inductor:
  zero2-compiled, zero3-compiled  the same fused steps as one graph (``step.compile()``);
  fsdp2-compiled  FSDP2 with each block's forward compiled (``block.compile()`` before
          ``fully_shard``, torchtitan's recipe: FSDP2's hooks stay eager around the graphs);
  ddp-compiled, ddp-compiled-autograd  DDP compiled two ways (of the model compiled:
          DDPOptimizer; under compiled autograd: ``fdp/bench/ddp.py``).
  A compiled kind's first step (its compilation) runs before the memory phase resets the peak.
  ``--cpp-wrapper``: every compiled kind with Inductor's C++ wrapper (the code calling the
  kernels compiled too, not run as Python; ``options={"cpp_wrapper": True}``: fdp's compiled
  kinds have it by default on CPU, ``step.compile()``'s); ``--python-wrapper``: fdp's compiled
  kinds with the Python wrapper (``step.compile(options={"cpp_wrapper": False})``).

Two phases:

* **memory** (``--mem-width``/``--mem-layers``, by default a model whose params, gradients
  and AdamW state are over 1 GB): each kind in a fresh world of its own. Every rank builds
  the whole model (as a DDP user does), a sharding kind shards it and drops the whole copy
  (and the heap's free pages go back to the OS: ``malloc_trim``); then the peak RSS is reset
  (``/proc/self/clear_refs``) and ``--mem-steps`` steps run. Every allocation of 64 KiB or
  more is its own mapping in this phase (glibc's ``M_MMAP_THRESHOLD``), so the resident
  memory is the memory in use, not what the heap kept of earlier steps.
  Reported per kind: the peak resident memory over the steps minus the process's memory
  before the model was built (the largest of the ranks'), and its ratio to DDP's; for zero3
  also the bound ``(params + grads + state) / world + the two largest units + the root``.
  With ``--tensors`` also, from a second world per kind, the peak of the live tensors over
  the same steps, counted from the profiler's allocation events since the kind was built
  (what ``torch.cuda.max_memory_allocated`` reads on a GPU: no compiled code, interpreter
  heap or allocator pages in it).
* **time** (``--width``/``--layers``): one world, every kind's replica, the kinds interleaved
  step by step (the order rotates), warm-up excluded; the median step per kind and its ratio
  to DDP's and to FSDP2's; zero3's exposed all-gather time (``Timeline.exposed_gather``).
  After the run every kind's params are compared with DDP's (bit for bit on two ranks
  without ``--clip``: FSDP2's clipping sums each rank's squares of its shards, another
  rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

import fdp

from .. import _internals
from . import ddp as ddp_kinds
from . import zoo
from .rss import reset_peak_rss, rss
from .table import Table, ratio, render

KINDS = ("ddp", "zero2", "zero3", "fsdp2")
COMPILED = ("zero2-compiled", "zero3-compiled", "fsdp2-compiled", "ddp-compiled", "ddp-compiled-autograd")


def eager_kind(kind: str) -> str:
    """The eager kind a compiled kind compiles."""
    return kind.removesuffix("-autograd").removesuffix("-compiled")
VOCAB, CONTEXT = 256, 32


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1024 + rank)
    data = torch.randint(VOCAB, (size, CONTEXT + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def model(width: int, layers: int) -> zoo.GPT:
    torch.manual_seed(0)
    return zoo.GPT(VOCAB, CONTEXT, width, layers, heads=8, nanogpt_init=False)


class Kind:
    """One kind's replica and its step."""

    def __init__(self, kind: str, group: fdp.Group, width: int, layers: int, clip: bool,
                 options: dict | None = None) -> None:
        self.kind, self.group, self.clip = kind, group, clip
        compiled = kind in COMPILED
        self.running: Any = contextlib.nullcontext
        net = model(width, layers)
        self.timeline: Any = None
        if kind in ddp_kinds.KINDS:
            self.module, self.forward, self.running = ddp_kinds.build(kind, net, group.process_group)
        kind = self.base = eager_kind(kind)
        if kind in ("ddp", "fsdp2"):
            if kind == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                for b in net.blocks:
                    if compiled:
                        b.compile()
                    fully_shard(b)
                self.module = self.forward = fully_shard(net)
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3, weight_decay=0.1)
            return
        apply, params, _ = fdp.functionalize(net)
        shard = {"zero2": True, "zero3": "params"}[kind]
        units = fdp.units(net, zoo.GPTBlock) if kind == "zero3" else None
        reducer = fdp.Reducer(params, group, shard=shard, units=units)
        opt = fdp.optim.adamw(lr=1e-3, weight_decay=0.1)
        if clip:
            opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), opt)

        def loss_fn(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(apply(p, {}, x)[0].view(-1, VOCAB), y.reshape(-1))

        self.step_fn = reducer.grad_and_update(loss_fn, opt, donate=True)
        self.run = self.step_fn.compile(**(options or {})) if compiled else self.step_fn
        self.state = self.step_fn.init(params)
        self.params = params
        if kind == "zero3":  # the whole copy goes: this rank keeps its slices only
            self.params = self.step_fn.shard(params)
            del params
        # The module's own copy of the params goes too (apply swaps in what it is given), as a
        # user does; DDP and FSDP2 hold theirs in the module.
        net.to("meta")

    def step(self, t: int, size: int) -> None:
        x, y = batch(t, self.group.rank, size)
        if self.base in ("ddp", "fsdp2"):
            with self.running():
                F.cross_entropy(self.forward(x).view(-1, VOCAB), y.reshape(-1)).backward()
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        self.params, self.state, _ = self.run(self.params, self.state, x, y)
        if self.run is self.step_fn:  # (a compiled step keeps no timeline: the profiler's trace has it)
            self.timeline = self.step_fn.last_step.timeline

    def named(self) -> dict[str, torch.Tensor]:
        if self.base == "ddp":
            return {k: v.detach().clone() for k, v in self.module.module.named_parameters()}
        if self.base == "fsdp2":
            return {k: v.full_tensor().detach().clone() for k, v in self.module.named_parameters()}
        p = self.params.full() if isinstance(self.params, fdp.ShardedParams) else self.params
        return {k: v.detach().clone() for k, v in p.items()}


def _warm(group: fdp.Group) -> None:
    """Every kind once on a tiny model: imports and one-time setup are not the model's memory."""
    for kind in KINDS:
        k = Kind(kind, group, 16, 1, False)
        k.step(0, 1)
    gc.collect()


def _trim() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``): what a kind frees
    while it is built (a sharding kind's whole copy of the model) must not count as its memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _map_each_tensor() -> None:
    """Every allocation of 64 KiB or more its own mapping, returned to the OS when freed
    (glibc's ``M_MMAP_THRESHOLD``, fixed): the resident memory is then the memory in use, not
    what the heap kept of earlier steps (the memory phase runs with ``FDP_MALLOC=os``)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def _compiler_warmed(group: fdp.Group, kind: str, clip: bool, options: dict) -> None:
    """One step of ``kind`` on a model of width 64 and one block, compiled: what compiling
    loads and keeps whatever the model (a compiled kind's base then includes it)."""
    tiny = Kind(kind, group, 64, 1, clip, options)
    tiny.step(0, 1)
    del tiny
    gc.collect()


def _compiler(cfg: argparse.Namespace) -> None:
    if cfg.cpp_wrapper:
        _internals.inductor_cpp_wrapper()


def _wrapper_note(cfg: argparse.Namespace) -> str:
    return (", Inductor's C++ wrapper" if cfg.cpp_wrapper else "") + (
        ", fdp's kinds with the Python wrapper" if cfg.python_wrapper else "")


def _options(cfg: argparse.Namespace) -> dict:
    """``step.compile``'s options for fdp's compiled kinds: ``--python-wrapper``'s."""
    return {"options": {"cpp_wrapper": False}} if cfg.python_wrapper else {}


def memory_rank(group: fdp.Group, cfg: argparse.Namespace, kind: str) -> dict:
    torch.set_num_threads(cfg.threads)
    _compiler(cfg)
    _map_each_tensor()
    _warm(group)
    if kind in COMPILED:
        # The compiler's own memory (Inductor, its imports and caches: over 200 MiB resident on
        # CPU) is not the step's: compile the same kind on a tiny model first, before the base
        _compiler_warmed(group, kind, cfg.clip, _options(cfg))
    _trim()
    base = rss()[0]
    k = Kind(kind, group, cfg.mem_width, cfg.mem_layers, cfg.clip, _options(cfg))
    first = 0
    if kind in COMPILED:  # its compilation is not the step's memory
        k.step(0, cfg.batch)
        first = 1
    _trim()
    if not reset_peak_rss():
        return {"peak_mib": None}
    for t in range(first, first + cfg.mem_steps):
        k.step(t, cfg.batch)
    out: dict[str, Any] = {"peak_mib": (rss()[1] - base) / 2**20}
    if kind == "zero3":
        # the bound: (params + grads + state) / world + the two largest units + the root (a unit
        # is gathered twice a step, the root's buckets once)
        timeline = k.timeline
        blocks = sorted(b.gather_nbytes for b in timeline.buckets if len(b.gathers) == 2)
        root = sum(b.gather_nbytes for b in timeline.buckets if len(b.gathers) == 1)
        whole = sum(b.nbytes for b in k.step_fn.plan.buckets)
        out["bound_mib"] = (4 * whole / group.size + sum(blocks[-2:]) + root) / 2**20
        out["gathered_mib"] = timeline.peak_gathered / 2**20
    return out


STEPS_MARK = "fdp.bench.sharded: the steps"


def tensor_rank(group: fdp.Group, cfg: argparse.Namespace, kind: str) -> dict:
    """``--tensors``: the peak of this rank's live tensors over the memory phase's steps, what
    ``torch.cuda.max_memory_allocated`` reads on a GPU (a compiled kind's code and guards, the
    interpreter's heap, the allocator's free pages are not tensors): the profiler's allocation
    events (``profile_memory``) from the moment the kind is built, through its sharding and
    compilation, summed in time order; the peak taken over the steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(cfg.threads)
    _compiler(cfg)
    _warm(group)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        k = Kind(kind, group, cfg.mem_width, cfg.mem_layers, cfg.clip, _options(cfg))
        first = 0
        if kind in COMPILED:
            k.step(0, cfg.batch)
            first = 1
        gc.collect()  # (what compiling left in reference cycles is not the step's: as memory_rank's _trim)
        with record_function(STEPS_MARK):
            for t in range(first, first + cfg.mem_steps):
                k.step(t, cfg.batch)
    events = prof.profiler.kineto_results.events()
    start = min(e.start_ns() for e in events if e.name() == STEPS_MARK)
    live = peak = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += e.nbytes()
        if e.start_ns() >= start:
            peak = max(peak, live)
    return {"tensor_mib": peak / 2**20}


def time_rank(group: fdp.Group, cfg: argparse.Namespace) -> dict:
    torch.set_num_threads(cfg.threads)
    _compiler(cfg)
    kinds = {kind: Kind(kind, group, cfg.width, cfg.layers, cfg.clip, _options(cfg)) for kind in cfg.kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    exposed: list[float] = []
    order = list(kinds)
    for t in range(cfg.warmup + cfg.steps):
        for kind in order:
            fdp.pmean({"x": torch.zeros(1)}, group)  # every rank starts each kind's step together
            t0 = time.perf_counter()
            kinds[kind].step(t, cfg.batch)
            if t >= cfg.warmup:
                times[kind].append(time.perf_counter() - t0)
                if kind == "zero3":
                    exposed.append(kinds[kind].timeline.exposed_gather)
            if t == 0:  # (a compiled kind compiles in its first step: out of the timed ones)
                fdp.pmean({"x": torch.zeros(1)}, group)
        order = order[1:] + order[:1]
    ref = kinds["ddp"].named() if "ddp" in kinds else None
    same = {}
    for kind, k in kinds.items():
        if ref is not None and kind != "ddp":
            got = k.named()
            same[kind] = sum(torch.equal(got[n], ref[n]) for n in ref), len(ref)
    return {"ms": {k: statistics.median(v) * 1000 for k, v in times.items()},
            "exposed_gather_ms": statistics.median(exposed) * 1000 if exposed else None, "same": same,
            "params_m": sum(p.numel() for p in model(cfg.width, cfg.layers).parameters()) / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench sharded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--width", type=int, default=256, help="the timing model's width")
    p.add_argument("--layers", type=int, default=4, help="the timing model's blocks")
    p.add_argument("--mem-width", type=int, default=512, help="the memory model's width")
    p.add_argument("--mem-layers", type=int, default=24,
                   help="the memory model's blocks (24 x 512: 1.2 GB of params, grads and AdamW state)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--clip", action="store_true", help="clip at global norm 1.0 in every kind")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--compiled", action="store_true",
                   help="add the compiled kinds not in --kinds (Inductor; minutes to compile)")
    wrapper = p.add_mutually_exclusive_group()
    wrapper.add_argument("--cpp-wrapper", action="store_true",
                         help="every compiled kind (fdp's and the peers') with Inductor's C++ wrapper "
                              "(options={'cpp_wrapper': True}; fdp's have it by default on CPU)")
    wrapper.add_argument("--python-wrapper", action="store_true",
                         help="fdp's compiled kinds with Inductor's Python wrapper "
                              "(step.compile(options={'cpp_wrapper': False}))")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--tensors", action="store_true",
                   help="also each kind's peak of live tensors over the memory phase's steps (profiler "
                        "allocation events, a second world per kind): what a GPU's max_memory_allocated reads")
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    cfg = p.parse_args(argv)
    given = tuple(k for k in cfg.kinds.split(",") if k)
    cfg.kinds = given + (tuple(k for k in COMPILED if k not in given) if cfg.compiled else ())
    if not set(cfg.kinds) <= set(KINDS + COMPILED) or "ddp" not in cfg.kinds:
        p.error(f"--kinds must include ddp and come from {list(KINDS + COMPILED)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, Any] = {"config": vars(cfg)}
    tables: list[Table] = []
    if not cfg.no_memory:
        os.environ["FDP_MALLOC"] = "os"  # (see _map_each_tensor; the timing phase keeps fdp's default)
        mem = {}
        for kind in cfg.kinds:
            per_rank = fdp.testing.run(memory_rank, cfg.world_size, backend="gloo", timeout=cfg.timeout,
                                       args=(cfg, kind))
            peaks = [r["peak_mib"] for r in per_rank]
            mem[kind] = {**per_rank[0], "peak_mib": None if None in peaks else max(peaks)}
            if cfg.tensors:
                mem[kind]["tensor_mib"] = max(r["tensor_mib"] for r in fdp.testing.run(
                    tensor_rank, cfg.world_size, backend="gloo", timeout=cfg.timeout, args=(cfg, kind)))
        os.environ.pop("FDP_MALLOC", None)
        results["memory"] = mem
        params_m = sum(p.numel() for p in model(cfg.mem_width, cfg.mem_layers).parameters()) / 1e6
        mem_table = Table(f"memory: {params_m:.1f} M params ({4 * params_m * 4 / 1024:.2f} GB of params, grads and "
                          f"AdamW state), {cfg.world_size} ranks, batch {cfg.batch}x{CONTEXT}"
                          + _wrapper_note(cfg),
                          ["kind", "peak MiB", "x ddp", *(["tensors MiB"] if cfg.tensors else []), "bound MiB",
                           "gathered MiB"])
        ddp_peak = mem["ddp"]["peak_mib"]
        for kind in cfg.kinds:
            m = mem[kind]
            if m["peak_mib"] is None:
                mem_table.row(kind, "n/a")
                mem_table.note(f"({kind}: no /proc/self/clear_refs here)")
                continue
            bound = ("", "") if "bound_mib" not in m else (f"{m['bound_mib']:.0f}", f"{m['gathered_mib']:.0f}")
            tensors = [f"{m['tensor_mib']:.0f}"] if cfg.tensors else []
            mem_table.row(kind, f"{m['peak_mib']:.0f}", ratio(m["peak_mib"], ddp_peak), *tensors, *bound)
        if any("bound_mib" in mem[k] for k in cfg.kinds):
            mem_table.note("(bound: state/world + 2 units + root; gathered: the most params held gathered at once)")
        if cfg.tensors:
            mem_table.note("(tensors: the peak of live tensors over the steps, from the kind's building on, the "
                           "profiler's allocation events: a GPU's max_memory_allocated; the largest of the ranks')")
        tables.append(mem_table)
    if not cfg.no_time:
        r = fdp.testing.run(time_rank, cfg.world_size, backend="gloo", timeout=cfg.timeout, args=(cfg,))[0]
        results["time"] = r
        ms = r["ms"]
        compiled = any(k in COMPILED for k in cfg.kinds)
        time_table = Table(f"time: {r['params_m']:.1f} M params, {cfg.world_size} ranks, batch {cfg.batch}x{CONTEXT}, "
                           f"{cfg.steps} steps (interleaved, after {cfg.warmup} warm-up)"
                           + _wrapper_note(cfg),
                           ["kind", "ms", "x ddp", "x fsdp2", *(["x eager", "x fsdp2-compiled"] if compiled else []),
                            "params == ddp's"], text=["params == ddp's"])
        for kind in cfg.kinds:
            same = r["same"].get(kind)
            against = [ratio(ms[kind], ms.get(eager_kind(kind)) if kind in COMPILED else None),
                       ratio(ms[kind], ms.get("fsdp2-compiled"))] if compiled else []
            time_table.row(kind, f"{ms[kind]:.1f}", ratio(ms[kind], ms["ddp"]), ratio(ms[kind], ms.get("fsdp2")),
                           *against, "" if same is None else f"{same[0]}/{same[1]}")
        if r["exposed_gather_ms"] is not None:
            time_table.note(f"(zero3: median all-gather wait not hidden by compute {r['exposed_gather_ms']:.2f} ms/step)")
        tables.append(time_table)
    print(render(tables))
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
