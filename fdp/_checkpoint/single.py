"""Checkpoints of a whole train state: ``save`` and ``load`` (RNG states: ``_rng.py``).

A train state is any pytree: params, buffers, optimizer-state NamedTuples, the step, RNG
states, user metadata. ``save`` writes it as one file holding a flat mapping
``{leaf path: tensor or plain value}`` (paths as ``fdp._tree`` formats them, e.g.
``['opt'].exp_avg['fc.weight']``) plus the format, its version and the world size. No custom
object is ever pickled, so ``load`` reads it with ``torch.load(weights_only=True)`` and
rebuilds the tree from the structure of ``like``, the freshly initialised train state.

Why one file, written by rank 0: in data parallelism the train state is replicated, so one
writer holds all of it (per-rank RNG states are gathered into it first). A single file can be
replaced atomically with one ``os.replace``: a reader, or a job restarted after a crash, sees
the old checkpoint or the new one, never a mix. A state sharded over the ranks (the fused
step's with ``Reducer(shard=True)``) is either gathered first (``step.state_to_tree``) or
written without a gather by ``fdp.save_sharded`` (``sharded.py``, which says why not
``torch.distributed.checkpoint``).

Format version 2 adds a CRC32 of every leaf (a tensor's bytes, a plain value's repr), checked
at load: ``torch.load`` does not check the zip records' own CRCs, so a flipped bit in a
tensor record loaded silently. Version 2 also records which leaves are
per-rank state (``fdp.rng_state`` trees), so that only those tie a checkpoint to its world
size. Version 1 files still load, without the content check (they hold no checksums).
"""

from __future__ import annotations

import ast
import os
import re
from typing import Any

import torch

from .. import _tree
from .._comm.agree import count_ranks
from .._comm.group import Group, resolve
from .._errors import CheckpointError
from .._shard import Shard
from .files import write_atomically
from .leaves import PLAIN, check_loaded, crc32, per_rank_paths, refuse_meta, refuse_unsaveable

__all__ = ["load", "save"]

FORMAT = "fdp.checkpoint"
VERSION = 2
READS = (1, 2)  # version 1: no checksums, no per-rank record

PathLike = str | os.PathLike


def save(path: PathLike, tree: Any, group: Group | Any | None = None) -> None:
    """Write ``tree`` to ``path`` atomically; a collective over ``group``.

    Rank 0 writes the file (its tree; the others' trees are not read): to a temporary file
    in the same folder, flushed and fsynced, then ``os.replace``-d onto ``path``, and the
    folder is fsynced so the rename survives a power loss. The other ranks wait for it in a
    barrier that carries the group's timeout, and every rank returns only once the file is
    in place. If the write fails, the previous file at ``path`` is untouched, the temporary
    file is removed, and every rank raises. Temporary files that an earlier writer left
    behind when it was killed (``.<name>.<12 hex digits>.tmp`` beside ``path``) are removed
    first, so two jobs must not write the same ``path`` at the same time. Each leaf's CRC32
    is stored with it and checked by ``load``.

    Args:
      path: the checkpoint file; its folder must exist and, for ``load`` on every rank, be
        visible to every rank (a shared filesystem).
      tree: any pytree whose leaves are tensors or ``bool``/``int``/``float``/``str``.
        Tensors are stored on the CPU.
      group: the ranks that take part (default: the world, or a world of one).

    Raises:
      CheckpointError: on every rank if rank 0 could not write the file (a leaf of another
        type, a missing folder, a full disk or file-size limit...); rank 0's error names the
        cause (for a full disk: the space needed and the space left). On every rank, before
        anything is written, for a sharded ``FusedState`` (save ``step.state_to_tree``).
      CollectiveError: a rank did not reach the barrier within the group's timeout.

    Example:
      >>> params = {"w": torch.ones(2)}
      >>> opt = fdp.optim.adamw(lr=1e-3)
      >>> state = {"params": params, "opt": opt.init(params), "step": 3, "rng": fdp.rng_state()}
      >>> fdp.save("ckpt.pt", state)
    """
    group = resolve(group)
    path = os.fspath(path)
    refuse_unsaveable(tree, "fdp.save")  # on every rank, before any collective: each holds slices
    error: Exception | None = None
    if group.rank == 0:
        try:
            payload = _payload(tree, group.size)
            write_atomically(path, lambda f: torch.save(payload, f), lambda: _nbytes(payload))
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
    # The barrier: rank 0 reports whether the file is in place; nobody returns before it is.
    if count_ranks(error is not None, group, f"fdp.save({path!r})"):
        if error is not None:
            raise CheckpointError(f"fdp.save: could not write {path}: {error}") from error
        raise CheckpointError(f"fdp.save: rank 0 could not write {path} (see rank 0's error)")


def load(
    path: PathLike, like: Any = None, group: Group | Any | None = None, *,
    strict_world_size: bool | None = None, partial: bool = False
) -> Any:
    """Read a checkpoint written by ``save`` into a tree shaped like ``like``.

    Every rank reads the file itself (no communication). The file is read with
    ``torch.load(weights_only=True)``, so it cannot run code. Every leaf's CRC32 is checked
    against the one ``save`` stored (files of format version 1, written before checksums,
    load without this check). Its leaf paths must be those of ``like``, and each leaf must
    match: a tensor with the same shape and dtype (it is placed on the device of ``like``'s
    tensor), or a plain value of the same type.

    Without ``like`` the file is read for inspection: the same checks (weights-only,
    checksums), no world-size check, and the values come back on the CPU as nested dicts
    keyed by dict key, index or NamedTuple field (``ckpt["opt"]["exp_avg"]["fc.bias"]``),
    since the file records paths, not types. To resume, load with ``like``.

    Args:
      path: a file written by ``save``.
      like: a train state with the structure to rebuild (NamedTuples included), e.g. the
        freshly initialised one; its values are not used. ``None``: inspection (above).
      group: the ranks that will use the state (default: the world, or a world of one).
      strict_world_size: whether the checkpoint must come from a world of ``group.size``
        ranks. ``None`` (default): only if it holds per-rank state (``fdp.rng_state``
        trees, one row per rank, which do not carry over to another size) or is a version-1
        file (which does not record it); params, buffers and optimizer state load into any
        world. ``True``: always (e.g. for per-rank values of your own). ``False``: never.
      partial: load only the leaves ``like`` has, leaving the checkpoint's others unread
        (``{"params": like_params}`` from a training checkpoint, for evaluation or export);
        the world-size check then looks at those leaves only. Every leaf of ``like`` must
        still be in the checkpoint. Default: the two trees must have the same leaves.

    Returns:
      A tree with ``like``'s structure and the checkpoint's values (plain tensors).

    Raises:
      CheckpointError: the file is missing, truncated, corrupt or not an fdp checkpoint
        (the message names the file); a leaf's bytes do not match their checksum (names the
        leaf); the file asks to unpickle a Python object (names the refused global); it was
        written by a different world size and holds per-rank state (names both sizes and
        the leaf); or it does not match ``like`` (names the first differing leaf path and
        both values).

    Example:
      >>> fdp.save("ckpt.pt", {"w": torch.ones(2), "step": 3, "rng": fdp.rng_state()})
      >>> like = {"w": torch.zeros(2), "step": 0, "rng": fdp.rng_state()}  # e.g. a fresh train state
      >>> state = fdp.load("ckpt.pt", like)
      >>> state["w"], state["step"]
      (tensor([1., 1.]), 3)
      >>> fdp.set_rng_state(state["rng"])
      >>> fdp.load("ckpt.pt")["w"]  # no like: nested dicts, for a look inside
      tensor([1., 1.])
    """
    group = resolve(group)
    path = os.fspath(path)
    saved = _read(path)
    if like is None:
        return _nested(path, saved["leaves"])
    per_rank = saved.get("per_rank")  # None in version 1: unknown
    paths, leaves, treedef = _tree.flatten_with_paths(like)
    known = set(paths)
    if partial and per_rank:
        per_rank = [p for p in per_rank if p in known]
    if saved["world_size"] != group.size and strict_world_size is not False:
        if strict_world_size or per_rank is None or per_rank:
            held = (f"it holds per-rank state ({', '.join(per_rank[:3])})" if per_rank else
                    "its format (version 1) does not record whether it holds per-rank state"
                    if per_rank is None else "strict_world_size=True")
            raise CheckpointError(
                f"fdp.load: {path} was written by a world of {saved['world_size']} ranks, but this "
                f"world has {group.size}, and {held} (pass strict_world_size=False to load it "
                "anyway; per-rank state such as RNG states will not fit)"
            )
    values = saved["leaves"]
    refuse_meta(paths, leaves, "fdp.load")
    for p in paths:
        if p not in values:
            raise CheckpointError(f"fdp.load: {path} has no leaf {p}, which the train state has")
    for p in values:
        if p not in known and not partial:
            raise CheckpointError(f"fdp.load: {path} has a leaf {p}, which the train state lacks (to load "
                                  "part of a checkpoint, pass partial=True)")
    out = [_match(path, p, values[p], want) for p, want in zip(paths, leaves)]
    loaded = _tree.unflatten(treedef, out)
    check_loaded(loaded, like, f"fdp.load: {path}")
    return loaded


# ------------------------------------------------------------------------------- helpers


def _nested(path: str, values: dict[str, Any]) -> Any:
    """The flat ``{leaf path: value}`` of a file as nested dicts. A path is what
    ``_tree.paths`` wrote (optree's ``codify``: ``['opt'].exp_avg['fc.bias']``, ``[0]``), so
    it parses as the subscripts and attributes of a Python expression."""
    if list(values) == ["<root>"]:
        return values["<root>"]
    root: dict[Any, Any] = {}
    for p, value in values.items():
        try:
            node = ast.parse("x" + p, mode="eval").body
            keys = []
            while isinstance(node, ast.Subscript | ast.Attribute):
                keys.append(ast.literal_eval(node.slice) if isinstance(node, ast.Subscript) else node.attr)
                node = node.value
        except (SyntaxError, ValueError) as e:
            raise CheckpointError(f"fdp.load: {path} has a leaf path {p!r} that is not fdp's format") from e
        where = root
        for key in reversed(keys[1:]):
            where = where.setdefault(key, {})
        where[keys[0]] = value
    return root


def _payload(tree: Any, world_size: int) -> dict[str, Any]:
    paths, leaves, _ = _tree.flatten_with_paths(tree)
    if len(set(paths)) != len(paths):
        raise CheckpointError(f"fdp.save: two leaves share a path in {paths}")
    out: dict[str, Any] = {}
    for p, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            out[p] = _compact_cpu(leaf)
        elif type(leaf) in PLAIN:
            out[p] = leaf
        elif isinstance(leaf, Shard):
            raise CheckpointError(
                f"fdp.save: leaf {p} is an fdp.Shard (one rank's part of a tensor), and fdp.save "
                "writes rank 0's tree alone; save a tree of Shards with fdp.save_sharded"
            )
        else:
            raise CheckpointError(
                f"fdp.save: leaf {p} is a {type(leaf).__name__}; a checkpoint holds tensors "
                "and bool/int/float/str values only (so it loads with weights_only=True)"
            )
    return {"format": FORMAT, "version": VERSION, "world_size": world_size,
            "torch": str(torch.__version__), "leaves": out,
            "crc32": {p: crc32(v) for p, v in out.items()},
            "per_rank": per_rank_paths(tree)}


def _nbytes(payload: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in payload["leaves"].values() if isinstance(v, torch.Tensor))


def _compact_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        return t.cpu()  # a fresh, compact copy
    # torch.save writes a tensor's whole storage: a view of a big buffer would write all of it.
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _read(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise CheckpointError(f"fdp.load: no checkpoint at {path}")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "manifest.json")):
            raise CheckpointError(f"fdp.load: {path} is a sharded checkpoint (a folder fdp.save_sharded wrote); read "
                                  "it with fdp.load_sharded(path, like)")
        raise CheckpointError(f"fdp.load: {path} is a folder, not a checkpoint file written by fdp.save")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a bad file
        raise CheckpointError(
            f"fdp.load: cannot read {path}: it is truncated, corrupt, or not a checkpoint "
            f"written by fdp.save ({_reason(e)})"
        ) from e
    if not (isinstance(saved, dict) and saved.get("format") == FORMAT):
        raise CheckpointError(f"fdp.load: {path} is not a checkpoint written by fdp.save")
    version = saved.get("version")
    if version not in READS:
        raise CheckpointError(
            f"fdp.load: {path} has format version {version}; this fdp reads versions "
            f"{', '.join(map(str, READS))}"
        )
    leaves = saved.get("leaves")
    if not isinstance(leaves, dict) or not isinstance(saved.get("world_size"), int):
        raise CheckpointError(f"fdp.load: {path} is damaged (no leaves or world size)")
    if version >= 2:
        sums, per_rank = saved.get("crc32"), saved.get("per_rank")
        if not isinstance(sums, dict) or sums.keys() != leaves.keys() or not isinstance(per_rank, list):
            raise CheckpointError(f"fdp.load: {path} is damaged (its checksums do not list its leaves)")
        for p, value in leaves.items():
            got = crc32(value)
            if got != sums[p]:
                raise CheckpointError(
                    f"fdp.load: {path}: leaf {p} is corrupt: its bytes have CRC32 {got:08x}, but "
                    f"fdp.save recorded {sums[p]:08x} (the file changed after it was written)"
                )
    return saved


def _reason(e: Exception) -> str:
    """The useful line of torch.load's error (its weights_only advice does not apply here)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    # torch 2.13 words a refused global "Trying to load unsupported GLOBAL posix.system whose
    # module posix is blocked." or "Unsupported global: GLOBAL __main__.Foo was not an allowed
    # global by default..." (older: after "WeightsUnpickler error:").
    for ln in lines:
        found = re.search(r"GLOBAL\s+([\w.]+)", ln)
        if found:
            return (f"{type(e).__name__}: it asks to unpickle the Python global {found.group(1)}, "
                    f"which weights_only loading refuses (fdp.save never writes one): {ln}")
    marker = "WeightsUnpickler error:"
    for i, ln in enumerate(lines):
        if marker in ln:
            rest = ln.split(marker, 1)[1].strip() or (lines[i + 1] if i + 1 < len(lines) else "")
            return f"{type(e).__name__}: weights_only unpickler refused it: {rest}"
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _match(path: str, leaf_path: str, got: Any, want: Any) -> Any:
    """The saved value of one leaf, checked against the train state's and placed like it."""
    where = f"fdp.load: {path}: leaf {leaf_path}"
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise CheckpointError(f"{where} is a {type(got).__name__} ({got!r}), expected a tensor")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckpointError(
                f"{where} has shape {tuple(got.shape)} and dtype {got.dtype} in the checkpoint, "
                f"shape {tuple(want.shape)} and dtype {want.dtype} in the train state"
            )
        return got.to(want.device)
    if type(got) is not type(want):
        shown = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
        raise CheckpointError(
            f"{where} is {shown} ({type(got).__name__}) in the checkpoint, "
            f"{want!r} ({type(want).__name__}) in the train state"
        )
    return got
