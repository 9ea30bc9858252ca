"""Optimizers on flat tensors: what a caller that keeps params, gradients and state in flat
buffers (the fused step's buckets) needs from an ``fdp.optim`` optimizer or chain.

``split_chain`` takes a chain apart into its gradient transforms and the optimizer whose
``LeafKernel`` runs per flat tensor, or says why it cannot be (a transform's declared
``reach`` decides where it may run), ``bound`` the optimizer an ``inject_hyperparams``
one runs as for a state's values; ``chunks`` cuts a long flat tensor into the pieces one
kernel call takes.
"""

from __future__ import annotations

import torch

from ._base import GradientTransform, Optimizer

# Elements per kernel call of a bucket's update. torch.optim's CPU kernels make several
# passes over their tensors (AdamW: about ten) and allocate temporaries of their size: over a
# whole 25 MiB bucket every pass streams from memory and each temporary is a fresh large
# block, while over chunks that fit in the cache the passes stay there (CUDA's
# multi_tensor_apply cuts its work into 65,536-element chunks for the same reason). Each
# chunk also costs the kernel's Python per tensor (about 25 us for AdamW): on a tree of five
# 512 x 512 matrices, 64K/128K/256K/512K/1M-element chunks measured 1.11-1.16, 1.05-1.07,
# 1.02-1.04, 1.03-1.08 and 1.04-1.09x torch.optim's per-leaf step (three interleaved runs
# each); the models' fused steps did not move between 128K and 256K. A bucket that fits in
# one chunk goes to the kernel as itself, and an unsharded step's "slice" is the flat tensor
# itself: no view per call (on that tree 1.018-1.027x before, 0.997-1.004x after). Figures in
# docs/measurements.md ("The fused step").
CHUNK = 256 * 1024


def chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` as ``CHUNK``-element views (itself when it fits in one)."""
    return [t] if t.numel() <= CHUNK else list(t.split(CHUNK))


def split_chain(opt: Optimizer, name: str, *, sharded: bool = False
                ) -> tuple[tuple[GradientTransform, ...], Optimizer]:
    """(gradient transforms, optimizer with a leaf kernel), or a ``TypeError`` saying why not."""
    if not isinstance(opt, Optimizer):
        raise TypeError(f"{name}: opt must be an fdp.optim optimizer or chain, got {type(opt).__name__}")
    transforms, optimizer = (tuple(opt.form.parts[:-1]), opt.form.parts[-1]) if opt.form.parts else ((), opt)
    if optimizer.form.unfused is not None:
        raise TypeError(f"{name}: {optimizer.form.unfused}")
    # An inject_hyperparams optimizer runs as the inner optimizer its state's values bind.
    inner = bound(optimizer)
    if inner.form.partition is not None and any(o.form.bind is not None for o in inner.form.partition.optimizers.values()):
        raise TypeError(
            f"{name}: an inject_hyperparams optimizer inside a partition label does not run in the fused step "
            "yet (its state keeps one set of values per step); inject the values of one optimizer at the end "
            "of the chain (chain(..., inject_hyperparams(adamw)(...))), give each label a new optimizer object "
            "when its values change (partition(labels, {'a': adamw(lr=lr_t), ...}): the step's buffers are "
            "reused), or use reducer.grad and opt.update")
    kernels = [inner.form.leaf_kernel] if inner.form.partition is None else [
        o.form.leaf_kernel for o in inner.form.partition.optimizers.values()]
    if any(k is None for k in kernels):
        which = "" if optimizer.form.partition is None else " (every label of a partition)"
        raise TypeError(
            f"{name}: the fused step runs an optimizer's kernel per bucket, so it needs one with a LeafKernel"
            f"{which}: sgd, adam, adamw, adagrad, rmsprop, nadam, radam, adamax, adadelta, lion, muon or "
            "frozen (or inject_hyperparams of one of them), optionally in a chain after gradient transforms; "
            "for others (adafactor, not element-wise; your own; a wrapper around inject_hyperparams) use "
            "reducer.grad and opt.update"
        )
    for i, t in enumerate(transforms):
        where = f"{name}: part {i} of the chain"
        if t.reach in ("element", "leaf") and t.apply is None:
            raise TypeError(
                f"{where} declares reach={t.reach!r} but no apply=: the fused step transforms the reduced "
                "buckets in place (GradientTransform(..., apply=...)); for a transform without one use "
                "reducer.grad and opt.update")
        if t.reach == "tree" and not t.is_global_scale:
            raise TypeError(
                f"{where} is a whole-tree transform (reach='tree') that is not a global scale: the fused step "
                "runs a whole-tree transform only as stats= and scale= (one factor from per-leaf statistics, as "
                "fdp.optim.clip_by_global_norm and fdp.optim.global_scale); declare reach='element' or 'leaf' "
                "if that is what it is, or use reducer.grad and opt.update")
        if sharded and t.reach == "leaf":
            raise TypeError(
                f"{where} declares reach='leaf': with shard=True each rank holds a slice of every bucket, "
                "and a slice cuts leaves, so a per-leaf transform cannot run there; use the unsharded fused "
                "step, or reducer.grad and opt.update")
    return transforms, optimizer


def bound(optimizer: Optimizer, hyperparams: dict | None = None) -> Optimizer:
    """``optimizer`` itself, or for an ``inject_hyperparams`` one the inner optimizer with
    ``hyperparams`` (a state's ``{name: value}``; None: the values it was made with) fixed."""
    return optimizer if optimizer.form.bind is None else optimizer.form.bind(hyperparams)
