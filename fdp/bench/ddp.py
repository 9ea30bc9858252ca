"""DDP as the benchmarks run it, eagerly and compiled two ways (``bench loop`` and ``bench
sharded`` time each beside fdp's kinds):

  ddp                    ``DistributedDataParallel(model)``;
  ddp-compiled           DDP of the model compiled (nanoGPT's ``torch.compile(model)`` before
                         DDP): dynamo's DDPOptimizer splits the graph at DDP's bucket
                         boundaries, DDP's hooks all-reduce between the backward graphs;
  ddp-compiled-autograd  DDP under compiled autograd (``optimize_ddp="python_reducer"``: the
                         DDP module's forward one graph, each backward compiled with its
                         all-reduces; ``fdp._internals.ddp_compiled_autograd``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .. import _internals

KINDS = ("ddp", "ddp-compiled", "ddp-compiled-autograd")


def build(kind: str, model: nn.Module, process_group: Any, options: dict | None = None
          ) -> tuple[nn.Module, Any, Any]:
    """``(the DDP module, the forward to call, a function giving the context to run its
    forward and backward in)`` for ``kind`` (one of ``KINDS``); ``options``: ``torch.compile``'s
    ``options=`` for the compiled kinds."""
    given = {"options": dict(options)} if options else {}
    if kind == "ddp-compiled-autograd":
        ddp, running = _internals.ddp_compiled_autograd(model, process_group)
        return ddp, torch.compile(ddp, **given), running
    if kind == "ddp-compiled":
        model.compile(**given)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=process_group)
    return ddp, ddp, contextlib.nullcontext
