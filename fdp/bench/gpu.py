"""``python -m fdp.bench gpu``: the prepared GPU check (one GPU, a few minutes, no setup).

Runs a list of sections in order; each prints a compact summary and passes or fails:

  step      a world of one over NCCL: reducer.grad on an 8x1024 MLP equals the local
            gradient bit for bit over 3 steps; step times against torch.func.grad.
  kernels   fdp.kernels on CUDA: the Triton kernels bit for bit against the torch path on
            random layouts (every dtype pair, scales, 0-d/empty/strided/unaligned leaves,
            bf16 rounding ties, NaN and Inf), then ``fdp.bench kernels`` timings for
            impl=triton and impl=torch and the Triton flatten bandwidth against a
            device-to-device copy and ``torch.cat``.

Exit status: 0 when every correctness check passed, 1 when one failed, 2 when there is no
CUDA GPU (nothing is checked). Timings are reported, never fatal. Add a section by writing
``def check_x(device, args) -> Section`` and appending ``("x", check_x)`` to ``SECTIONS``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Section:
    """What one section found: whether its correctness checks passed, and what to print."""

    name: str
    ok: bool
    lines: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# ----------------------------------------------------------------------------- kernels
def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of ``a`` and ``b`` differ: NaN must meet NaN (any payload), every
    other element must be bit-identical (-0.0 differs from 0.0). A shape or dtype mismatch
    counts as every element."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return max(a.numel(), b.numel(), 1)
    nan_a, nan_b = a.isnan(), b.isnan()
    ia, ib = (x.contiguous().view(_INT_VIEW[x.element_size()]) for x in (a, b))
    return int(((nan_a != nan_b) | ((ia != ib) & ~nan_a)).sum())


def _values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random values over many magnitudes with NaN, +-Inf, -0.0, subnormals and huge ones."""
    x = torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, shape, generator=g).double())
    flat = x.view(-1)
    if flat.numel() >= 8:
        flat[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 7e4, 3.4e38, 1 + 2**-8],
                                dtype=torch.float64)
        flat.copy_(flat[torch.randperm(flat.numel(), generator=g)])
    return x.to(dtype).to(device)


def _layout(g: torch.Generator, dtype: torch.dtype, device: torch.device, n_leaves: int) -> list[torch.Tensor]:
    """Leaves of one dtype: 0-d, empty, odd sizes, multi-block sizes, strided and unaligned."""
    from fdp import kernels  # (after main has settled TRITON_INTERPRET)

    block = kernels.block_size()
    leaves = []
    for _ in range(n_leaves):
        kind = int(torch.randint(0, 7, (), generator=g))
        if kind == 0:
            t = _values((), dtype, g, device)
        elif kind == 1:
            t = _values((0, 3), dtype, g, device)
        elif kind == 2:  # transposed: strided
            t = _values((int(torch.randint(2, 40, (), generator=g)), 7), dtype, g, device).t()
        elif kind == 3:  # an unaligned view, several blocks long
            t = _values((2 * block + 9,), dtype, g, device)[int(torch.randint(1, 8, (), generator=g)):]
        else:
            t = _values((int(torch.randint(1, 3000, (), generator=g)),), dtype, g, device)
        leaves.append(t)
    return leaves


def kernel_correctness(device: torch.device, seed: int = 0) -> tuple[int, int, list[str]]:
    """Triton against torch on ``device``: flatten over every dtype pair and several scales,
    unflatten with and without casts, and fp32 -> bf16 rounding at every kind of boundary.

    Returns:
      (checks run, checks failed, a line per failure).
    """
    from fdp import kernels

    g = torch.Generator().manual_seed(seed)
    runs, failures = 0, []
    scales = (None, 0.5, 1.0, 3.0, -0.0, float(torch.rand((), generator=g)) * 7 - 3)
    for i, (src_dtype, out_dtype) in enumerate((s, o) for s in FLOATS for o in FLOATS):
        leaves = _layout(g, src_dtype, device, 6)
        n = sum(t.numel() for t in leaves)
        for scale in (scales[i % len(scales)], scales[(i + 3) % len(scales)]):
            got = kernels.flatten(leaves, torch.full((n,), 5.0, dtype=out_dtype, device=device), scale=scale, impl="triton")
            want = kernels.flatten(leaves, torch.full((n,), 7.0, dtype=out_dtype, device=device), scale=scale, impl="torch")
            # ... and the torch path on CPU, so that both device paths cannot agree on a wrong answer.
            cpu = kernels.flatten([t.cpu() for t in leaves], torch.empty(n, dtype=out_dtype), scale=scale, impl="torch")
            runs += 1
            if bad := bits_differ(got, want) + bits_differ(got.cpu(), cpu):
                failures.append(f"flatten {src_dtype} -> {out_dtype} scale={scale}: {bad}/{n} elements differ")
    for flat_dtype in FLOATS:
        flat_src = _values((5000,), flat_dtype, g, device)
        out_dtypes = [FLOATS[int(torch.randint(0, 4, (), generator=g))] for _ in range(5)]
        shapes = [(), (0,), (7, 33), (3, 111), (4321,)]
        n = sum(torch.Size(s).numel() for s in shapes)
        flat = flat_src[1 : 1 + n]  # unaligned on purpose
        results = {}
        for impl in ("triton", "torch"):
            outs = [torch.zeros(s, dtype=d, device=device) for s, d in zip(shapes, out_dtypes)]
            outs[3] = torch.zeros(111, 3, dtype=out_dtypes[3], device=device).t()  # strided output
            kernels.unflatten(flat, outs, impl=impl)
            results[impl] = outs
        for a, b in zip(results["triton"], results["torch"]):
            runs += 1
            if bad := bits_differ(a, b):
                failures.append(f"unflatten {flat_dtype} -> {a.dtype} {tuple(a.shape)}: {bad} elements differ")
    # fp32 patterns around bf16 rounding boundaries: ties to even and odd, carries into the
    # exponent and into Inf, subnormals, signed zeros, NaNs.
    base = torch.tensor([0x3F800000, 0x3F810000, 0x7F7F0000, 0x00010000, 0x80010000, 0xBF7F0000])
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0000, 0x0001])
    special = torch.tensor([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF, 1])
    x = torch.cat([(base[:, None] | low[None, :]).reshape(-1), special]).to(torch.int32).view(torch.float32).to(device)
    for scale in (None, 0.5):
        got = kernels.flatten([x], torch.empty(x.numel(), dtype=torch.bfloat16, device=device), scale=scale, impl="triton")
        want = (x if scale is None else x * scale).to(torch.bfloat16)
        runs += 1
        if bad := bits_differ(got, want):
            failures.append(f"bf16 rounding boundaries scale={scale}: {bad}/{x.numel()} differ")
    return runs, len(failures), failures


def check_kernels(device: torch.device, args: argparse.Namespace) -> Section:
    """The kernels section: correctness (fatal), then timings and bandwidth (reported)."""
    from . import kernels as bench

    sec = Section("kernels", ok=True)
    t0 = time.perf_counter()
    runs, failed, failures = kernel_correctness(device, args.seed)
    sec.ok = failed == 0
    sec.lines.append(f"triton vs torch on {device}: {runs - failed}/{runs} checks bit-identical "
                     f"({time.perf_counter() - t0:.1f} s, compiles included)")
    sec.lines += [f"  FAIL {f}" for f in failures[:10]]
    sec.data["correctness"] = {"runs": runs, "failed": failed, "failures": failures}
    for impl in ("triton", "torch"):
        rows = []
        for case in bench.CASES:
            rows += bench.run_case(case, device, impl, args.reps, args.warmup)
        sec.lines.append(f"timings, impl={impl} (ratio to a copy of the same bytes; host overhead included):")
        sec.lines += ["  " + line for line in bench.format_rows(rows).splitlines()]
        sec.data[f"timings_{impl}"] = rows
    bw = bench.run_bandwidth(device, args.reps, args.warmup)
    sec.lines.append("Triton flatten bandwidth (read + write bytes; 100 fp32 leaves; 10 calls per timing):")
    sec.lines += ["  " + line for line in bench.format_bandwidth(bw).splitlines()]
    sec.data["bandwidth"] = bw
    return sec


# ----------------------------------------------------------------------------- step
def check_step(device: torch.device, args: argparse.Namespace) -> Section:
    """A world of one over NCCL: ``reducer.grad`` on an 8x1024 MLP equals the local gradient
    bit for bit (fatal), across steps (buffers, streams and the allocator reused); then
    timings of the overlapped step against a plain ``torch.func.grad`` step (reported)."""
    import statistics

    import torch.distributed as dist
    import torch.nn.functional as F

    import fdp

    from .zoo import MLP

    sec = Section("step", ok=True)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        group = fdp.Group.from_process_group(dist.group.WORLD)
        torch.manual_seed(args.seed)
        apply, params, buffers = fdp.functionalize(MLP().to(device))
        reducer = fdp.Reducer(params, group, bucket_cap_mb=4, first_bucket_cap_mb=1)
        x = torch.randn(64, 1024, device=device)
        y = torch.randint(0, 10, (64,), device=device)

        def loss_fn(p):
            return F.cross_entropy(apply(p, buffers, x)[0], y)

        grad_fn, local = reducer.grad(loss_fn), torch.func.grad(loss_fn)
        bad = 0
        for _ in range(3):
            got, want = grad_fn(params), local(params)
            bad += sum(int(not torch.equal(got[k], want[k])) for k in want)
        sec.ok = bad == 0
        sec.lines.append(f"reducer.grad == torch.func.grad on {len(params)} leaves x 3 steps: "
                         f"{'bit-identical' if bad == 0 else f'{bad} leaves differ'}")

        def timed(fn: Callable[[], Any]) -> float:
            ts = []
            for _ in range(args.warmup + args.reps):
                torch.cuda.synchronize(device)
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize(device)
                ts.append(time.perf_counter() - t)
            return statistics.median(ts[args.warmup:]) * 1e3

        ms_fdp, ms_local = timed(lambda: grad_fn(params)), timed(lambda: local(params))
        tl = reducer.last_step.timeline
        sec.lines.append(f"step: fdp {ms_fdp:.2f} ms, torch.func.grad {ms_local:.2f} ms "
                         f"({len(reducer.plan.buckets)} buckets; host timeline: backward ends "
                         f"{tl.backward_end * 1e3:.2f} ms, first launch {tl.buckets[0].launch * 1e3:.2f} ms)")
        sec.data = {"fdp_ms": ms_fdp, "func_grad_ms": ms_local, "bad_leaves": bad}
    finally:
        if owns:
            dist.destroy_process_group()
    return sec


SECTIONS: list[tuple[str, Callable[[torch.device, argparse.Namespace], Section]]] = [
    ("kernels", check_kernels),
    ("step", check_step),
]


def main(argv: list[str] | None = None) -> int:
    """Run the GPU check.

    Args:
      argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
      0 all correctness checks passed, 1 one failed (or a section crashed), 2 no CUDA GPU.
    """
    p = argparse.ArgumentParser(prog="python -m fdp.bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", choices=[n for n, _ in SECTIONS], default=[n for n, _ in SECTIONS])
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per row (default 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the random correctness cases")
    p.add_argument("--json", metavar="PATH", help="also write every section's results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fdp.bench gpu: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing was checked.")
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # The interpreter would run on host copies of device memory: compile for the GPU.
        if "fdp.kernels._triton" in sys.modules:
            print("fdp.bench gpu: TRITON_INTERPRET is set and the Triton kernels are already built for the "
                  "interpreter; unset it and rerun.")
            return 1
        del os.environ["TRITON_INTERPRET"]
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"fdp.bench gpu on {torch.cuda.get_device_name(device)}; torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    results, ok = [], True
    for name, fn in SECTIONS:
        if name not in args.sections:
            continue
        t0 = time.perf_counter()
        try:
            sec = fn(device, args)
        except Exception:  # a crashed section is a failed one; the others still run
            sec = Section(name, ok=False, lines=traceback.format_exc().rstrip().splitlines())
        sec.seconds = time.perf_counter() - t0
        ok &= sec.ok
        results.append(sec)
        print(f"[{'PASS' if sec.ok else 'FAIL'}] {name} ({sec.seconds:.1f} s)")
        for line in sec.lines:
            print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"name": s.name, "ok": s.ok, "seconds": s.seconds, "data": s.data} for s in results], f,
                      indent=2, default=str)
    print("all correctness checks passed" if ok else "a correctness check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
