"""What the compile tests share: whether this torch's dynamo traces fdp (probed once, in a
forked process, when a test first asks), and the compiler imports made once in this process.

Every test that compiles does it in a forked rank (``fdp.testing.run(..., backend="gloo")``):
compiling in the pytest process would start autograd's worker threads on CUDA builds of
torch, and every later fork-based gloo test would then fail. Each forked child would also
import the compilers afresh (torch._dynamo, AOTAutograd, Inductor: 2-3 s of CPU each, both
ranks at once on a 2-core machine); imported here first, before the forks, the children
inherit them. The imports start no thread, so forking after them is safe.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fdp
import fdp.testing


@functools.cache
def import_compilers(inductor: bool = False) -> None:
    """Import torch._dynamo and AOTAutograd (what the ``eager`` and ``aot_eager`` backends
    load) into this process, once; with ``inductor``, Inductor's compiler too (0.8 s more, and
    a bigger process to fork afterwards: only for the tests that compile with it)."""
    import torch._dynamo  # noqa: F401
    import torch._functorch.aot_autograd  # noqa: F401

    if inductor:
        import torch._inductor.compile_fx  # noqa: F401


def in_child(fn):
    """``fn()`` in a forked process (a world of one), its result returned here."""
    import_compilers()
    return fdp.testing.run(lambda group: fn(), 1, backend="gloo", timeout=300)[0]


def _dynamo_traces_fdp() -> tuple[bool, str]:
    """Whether this torch's dynamo traces what fdp calls under compile without a graph break,
    and if not, why: ``torch.func.functional_call`` with a module (torch 2.4 puts it in the
    graph as an opaque call: "Unsupported: ... NNModuleVariable") and optree's own flatten in
    fdp's namespace (torch 2.5-2.9 break the graph on "optree C/C++ function ... flatten",
    their polyfills covering only torch's own namespace; 2.10-2.12 trace it, but trip on
    optree 0.20's ``sys.version_info`` comparison). docs/compile.md has the measured table."""
    import optree

    lin = torch.nn.Linear(2, 2)

    def probe(x):
        leaves, _ = optree.tree_flatten({"b": x, "a": x * 2}, namespace=fdp._tree.NAMESPACE)
        return torch.func.functional_call(lin, {"weight": leaves[1], "bias": leaves[0][0]}, (x,))

    try:
        torch.compile(probe, fullgraph=True, backend="eager")(torch.ones(2, 2))
        return True, ""
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        torch._dynamo.reset()


def on_thread_ranks(fn, world: int = 2, args: tuple = ()):
    """``fn(group, *args)`` on ``world`` thread ranks (fdp.testing's threaded group), in a
    forked process: the compiling threads start there, not in this one (see above). Returns
    each rank's result."""
    import_compilers()

    def child(group):
        torch.distributed.destroy_process_group()  # (the forked world of one: thread ranks need no default group)
        torch._dynamo.reset()  # (once, before the ranks: both compile into dynamo's one cache)
        return fdp.testing.run(fn, world, backend="threads", timeout=300, args=args)

    return fdp.testing.run(child, 1, backend="gloo", timeout=600)[0]


@functools.cache
def dynamo_traces_fdp() -> tuple[bool, str]:
    """``(whether dynamo traces fdp here, why not)``: the probe, run once in a forked child."""
    return in_child(_dynamo_traces_fdp)


def skip_unless_dynamo_traces_fdp() -> None:
    """Skip the calling test where this torch's dynamo cannot trace fdp (see the probe)."""
    traces, why_not = dynamo_traces_fdp()
    if not traces:
        pytest.skip(f"dynamo in torch {torch.__version__} cannot trace fdp's functional_call and "
                    f"optree calls ({why_not}); see docs/compile.md")
