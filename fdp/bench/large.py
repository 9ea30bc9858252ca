"""``python -m fdp.bench large``: the large-model recipe, fdp beside FSDP2 (and DDP where it fits).

A LLaMA-style decoder (``zoo.Llama``: RMSNorm, RoPE, SwiGLU, a head tied to the embedding),
trained on gloo ranks from the same start on the same batches by:

  fdp     built on the meta device and initialised unit by unit (``fdp.deferred_init``),
          ``Reducer(shard="params", units=<the decoder layers>, param_dtype=torch.bfloat16)``,
          activation checkpointing at each layer's call, a ``partition`` of Muon (the layers'
          matrices) and AdamW (the rest), each under ``ema``, after ``clip_by_global_norm``;
          two micro-batches per step (``step.accumulate``), each reduce-scattered as it goes
          and its sum kept sharded (``reduce_micro_batches=True``);
  fsdp2   built on meta, ``fully_shard`` on each layer and the model with
          ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``to_empty`` and each
          param's values written shard by shard (the same values as fdp's), the same
          checkpointing, ``torch.optim.Muon`` + ``AdamW``, ``clip_grad_norm_``, an EMA of the
          local shards (``torch._foreach_lerp_``), gradient sync on every micro-batch (its
          default);
  ddp     the whole model in fp32 without checkpointing, ``no_sync`` on the first micro-batch,
          the same torch optimizers and clipping (the memory reference).

``--whole-sums``: fdp and FSDP2 keep the micro-batches' sum whole until the step instead
(fdp's default ``reduce_micro_batches=False``; FSDP2's ``set_requires_gradient_sync(False)``
on the first micro-batch): one reduce-scatter per step, one whole set of gradients held.

Two phases:

* **memory** (``--mem-width``/``--mem-layers``): each kind in a fresh world; every allocation
  of 64 KiB or more is its own mapping (glibc's ``M_MMAP_THRESHOLD``), so resident memory is
  memory in use. Per rank, the peak while the model is built and its params initialised
  (from nothing: for fdp and FSDP2 no rank ever holds the whole model; every kind's
  optimizer state is made at its first step, as torch.optim's), and the peak over
  ``--mem-steps`` steps after that, both less the process's memory before; the largest over
  the ranks.
* **time** (``--width``/``--layers``): one world, the kinds interleaved step by step, warm-up
  excluded; the median step per kind and its ratio to FSDP2's. After the run fdp's params are
  compared with FSDP2's (the same recipe: equal to rounding, FSDP2's clipping norm and its
  Newton-Schulz on DTensors round differently) and DDP's (fp32 compute: further off).
"""

from __future__ import annotations

import argparse
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
from torch import nn

import fdp

from . import zoo
from .rss import reset_peak_rss, rss
from .table import Table, ratio, render

KINDS = ("fdp", "fsdp2", "ddp")
VOCAB, CONTEXT, DECAY = 256, 64, 0.99


def batch(step: int, micro: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 4096 + micro * 1024 + rank)
    data = torch.randint(VOCAB, (size, CONTEXT + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def labeller(cfg: argparse.Namespace) -> Any:
    def hidden(key: str, p: torch.Tensor) -> str:
        """Muon for the decoder layers' matrices, AdamW for the rest (embedding, norms)."""
        return "muon" if cfg.muon and p.dim() == 2 and key.startswith("blocks") else "adamw"
    return hidden


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))


def meta_model(cfg: argparse.Namespace, width: int, layers: int, checkpointing: bool) -> zoo.Llama:
    with torch.device("meta"):
        return zoo.Llama(VOCAB, width, layers, cfg.heads, checkpointing)


class Kind:
    """One kind's replica and its step (two micro-batches)."""

    def __init__(self, kind: str, group: fdp.Group, cfg: argparse.Namespace, width: int, layers: int) -> None:
        self.kind, self.group, self.cfg = kind, group, cfg
        # Every kind's values come from this source, module by module (never the whole model).
        source = fdp.deferred_init(meta_model(cfg, width, layers, False), seed=0)
        getattr(self, f"_build_{kind}")(source, width, layers)

    # ------------------------------------------------------------------ fdp
    def _build_fdp(self, source: fdp.DeferredInit, width: int, layers: int) -> None:
        net = meta_model(self.cfg, width, layers, checkpointing=True)
        apply, params, _ = fdp.functionalize(net)
        apply = apply.with_constants(source.materialize(apply.constants))
        opt = fdp.optim.partition(labeller(self.cfg), {
            "muon": fdp.optim.ema(fdp.optim.muon(lr=0.02), decay=DECAY),
            "adamw": fdp.optim.ema(fdp.optim.adamw(lr=3e-3, weight_decay=0.1), decay=DECAY)})
        if self.cfg.clip:
            opt = fdp.optim.chain(fdp.optim.clip_by_global_norm(1.0), opt)

        def loss_fn(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss_of(apply(p, {}, x)[0], y)

        reducer = fdp.Reducer(params, self.group, shard="params", units=fdp.units(net, zoo.LlamaBlock),
                              param_dtype=torch.bfloat16, reduce_micro_batches=not self.cfg.whole_sums)
        self.step_fn = reducer.grad_and_update(loss_fn, opt, donate=True)  # (updated in place, as FSDP2's)
        self.params = self.step_fn.shard(source)
        self.state: Any = None  # (made at the first step, as torch.optim makes its state)

    def _step_fdp(self, t: int) -> None:
        rank, size = self.group.rank, self.cfg.batch
        if self.state is None:
            self.state = self.step_fn.init(self.params)
        self.step_fn.accumulate(self.params, *batch(t, 0, rank, size))
        self.params, self.state, _ = self.step_fn(self.params, self.state, *batch(t, 1, rank, size))

    def _named_fdp(self) -> dict[str, torch.Tensor]:
        return dict(self.params.full())

    # ------------------------------------------------------------------ torch's
    def _torch_optimizers(self, named: dict[str, torch.Tensor]) -> None:
        hidden = labeller(self.cfg)
        muon = [p for k, p in named.items() if hidden(k, p) == "muon"]
        rest = [p for k, p in named.items() if hidden(k, p) == "adamw"]
        self.opts = ([torch.optim.Muon(muon, lr=0.02)] if muon else []) + [
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.1)]

    def _build_fsdp2(self, source: fdp.DeferredInit, width: int, layers: int) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import distribute_tensor

        net = meta_model(self.cfg, width, layers, checkpointing=True)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = torch.distributed.device_mesh.DeviceMesh.from_group(self.group.process_group, "cpu")
        for block in net.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        self.module = fully_shard(net, mesh=mesh, mp_policy=policy)
        net.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in net.named_parameters():  # one param whole at a time, this rank's shard kept
                whole = source.read([(name, tuple(p.shape), p.dtype)], [(0, p.numel())], torch.device("cpu"))[0]
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements).to_local())
                del whole
            for m in net.modules():
                if isinstance(m, zoo.Rotary):
                    m.reset_parameters()
        named = dict(net.named_parameters())
        self._torch_optimizers(named)
        self.ema: list[torch.Tensor] | None = None

    def _step_fsdp2(self, t: int) -> None:
        rank, size, net = self.group.rank, self.cfg.batch, self.module
        net.set_requires_gradient_sync(not self.cfg.whole_sums)
        loss_of(net(batch(t, 0, rank, size)[0]), batch(t, 0, rank, size)[1]).backward()
        net.set_requires_gradient_sync(True)
        x, y = batch(t, 1, rank, size)
        loss_of(net(x), y).backward()
        self._torch_update(net.parameters())
        local = [p.to_local() for p in net.parameters()]
        if self.ema is None:  # (AveragedModel's first update copies)
            self.ema = [t.detach().clone() for t in local]
        else:
            torch._foreach_lerp_(self.ema, local, 1 - DECAY)

    def _torch_update(self, params: Any) -> None:
        if self.cfg.clip:
            torch.nn.utils.clip_grad_norm_(list(params), 1.0)
        for opt in self.opts:
            opt.step()
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)

    def _named_fsdp2(self) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().detach().clone() for k, v in self.module.named_parameters()}

    def _build_ddp(self, source: fdp.DeferredInit, width: int, layers: int) -> None:
        with torch.device("cpu"):
            net = zoo.Llama(VOCAB, width, layers, self.cfg.heads, checkpointing=False)
        _, params, _ = fdp.functionalize(net)
        with torch.no_grad():
            for k, v in source.materialize(params, device="cpu").items():
                params[k].copy_(v)
        self.module = nn.parallel.DistributedDataParallel(net, process_group=self.group.process_group)
        self._torch_optimizers(dict(net.named_parameters()))

    def _step_ddp(self, t: int) -> None:
        rank, size, net = self.group.rank, self.cfg.batch, self.module
        with net.no_sync():
            x, y = batch(t, 0, rank, size)
            loss_of(net(x), y).backward()
        x, y = batch(t, 1, rank, size)
        loss_of(net(x), y).backward()
        self._torch_update(net.parameters())

    def _named_ddp(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.module.named_parameters()}

    # ------------------------------------------------------------------ the kinds alike
    def step(self, t: int) -> None:
        getattr(self, f"_step_{self.kind}")(t)

    def named(self) -> dict[str, torch.Tensor]:
        return getattr(self, f"_named_{self.kind}")()


def _map_each_tensor() -> None:
    """Every allocation of 64 KiB or more its own mapping, returned to the OS when freed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def memory_rank(group: fdp.Group, cfg: argparse.Namespace, kind: str) -> dict:
    torch.set_num_threads(cfg.threads)
    _map_each_tensor()
    Kind(kind, group, cfg, 16, 1).step(0)  # imports and one-time setup are not the model's memory
    gc.collect()
    base = rss()[0]
    if not reset_peak_rss():
        return {"init_mib": None, "step_mib": None}
    k = Kind(kind, group, cfg, cfg.mem_width, cfg.mem_layers)
    gc.collect()
    init = rss()[1] - base
    reset_peak_rss()
    for t in range(cfg.mem_steps):
        k.step(t)
    return {"init_mib": init / 2**20, "step_mib": (rss()[1] - base) / 2**20}


def time_rank(group: fdp.Group, cfg: argparse.Namespace) -> dict:
    torch.set_num_threads(cfg.threads)
    kinds = {kind: Kind(kind, group, cfg, cfg.width, cfg.layers) for kind in cfg.kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    order = list(kinds)
    for t in range(cfg.warmup + cfg.steps):
        for kind in order:
            fdp.pmean({"x": torch.zeros(1)}, group)  # every rank starts each kind's step together
            t0 = time.perf_counter()
            kinds[kind].step(t)
            if t >= cfg.warmup:
                times[kind].append(time.perf_counter() - t0)
        order = order[1:] + order[:1]
    mine = kinds["fdp"].named()
    diffs = {}
    for kind, k in kinds.items():
        if kind != "fdp":
            theirs = k.named()
            diffs[kind] = (max(float((mine[n] - theirs[n]).abs().max()) for n in mine),
                           sum(torch.equal(mine[n], theirs[n]) for n in mine), len(mine))
    params_m = sum(p.numel() for p in mine.values()) / 1e6
    return {"ms": {k: statistics.median(v) * 1000 for k, v in times.items()}, "diffs": diffs, "params_m": params_m}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fdp.bench large", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--width", type=int, default=256, help="the timing model's width")
    p.add_argument("--layers", type=int, default=4, help="the timing model's decoder layers")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mem-width", type=int, default=512, help="the memory model's width")
    p.add_argument("--mem-layers", type=int, default=12, help="the memory model's decoder layers")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mem-steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--no-muon", dest="muon", action="store_false", help="AdamW for every param")
    p.add_argument("--no-clip", dest="clip", action="store_false", help="no clipping")
    p.add_argument("--whole-sums", action="store_true",
                   help="fdp and FSDP2 keep the micro-batches' sum whole (no sync before the last micro-batch)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    cfg = p.parse_args(argv)
    cfg.kinds = tuple(k for k in cfg.kinds.split(",") if k)
    if not set(cfg.kinds) <= set(KINDS) or "fdp" not in cfg.kinds:
        p.error(f"--kinds must include fdp and come from {list(KINDS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, Any] = {"config": vars(cfg)}
    tables: list[Table] = []
    if not cfg.no_memory:
        os.environ["FDP_MALLOC"] = "os"  # (see _map_each_tensor)
        mem = {}
        for kind in cfg.kinds:
            per_rank = fdp.testing.run(memory_rank, cfg.world_size, backend="gloo", timeout=cfg.timeout,
                                       args=(cfg, kind))
            mem[kind] = {f: (None if any(r[f] is None for r in per_rank) else max(r[f] for r in per_rank))
                         for f in ("init_mib", "step_mib")}
        os.environ.pop("FDP_MALLOC", None)
        results["memory"] = mem
        net = zoo.Llama(VOCAB, cfg.mem_width, cfg.mem_layers, cfg.heads)
        whole = sum(p.numel() * 4 for p in net.parameters()) / 2**20
        unit = sum(p.numel() * 4 for p in net.blocks[0].parameters()) / 2**20
        mem_table = Table(f"memory: {whole:.0f} MiB of fp32 params ({unit:.1f} MiB per layer), {cfg.world_size} "
                          f"ranks, 2 x {cfg.batch}x{CONTEXT} per step; init bound params/world + one layer = "
                          f"{whole / cfg.world_size + unit:.0f} MiB",
                          ["kind", "init MiB", "step MiB", "step x ddp", "step x fsdp2"])
        for kind in cfg.kinds:
            m = mem[kind]
            if m["step_mib"] is None:
                mem_table.row(kind, "n/a")
                mem_table.note(f"({kind}: no /proc/self/clear_refs here)")
                continue
            mem_table.row(kind, f"{m['init_mib']:.1f}", f"{m['step_mib']:.1f}",
                          *(ratio(m["step_mib"], mem[o]["step_mib"] if o in mem else None) for o in ("ddp", "fsdp2")))
        tables.append(mem_table)
    if not cfg.no_time:
        r = fdp.testing.run(time_rank, cfg.world_size, backend="gloo", timeout=cfg.timeout, args=(cfg,))[0]
        results["time"] = r
        ms = r["ms"]
        time_table = Table(f"time: {r['params_m']:.2f} M params, {cfg.world_size} ranks, 2 x {cfg.batch}x{CONTEXT} per "
                           f"step, {cfg.steps} steps (interleaved, after {cfg.warmup} warm-up)",
                           ["kind", "ms", "x fsdp2", "max |diff| to fsdp2", "params == fsdp2's"],
                           text=["params == fsdp2's"])
        for kind in cfg.kinds:
            d = r["diffs"].get(kind)
            time_table.row(kind, f"{ms[kind]:.1f}", ratio(ms[kind], ms.get("fsdp2")),
                           *(("", "") if d is None else (f"{d[0]:.2e}", f"{d[1]}/{d[2]}")))
        tables.append(time_table)
    print(render(tables))
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
