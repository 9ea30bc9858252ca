"""Checkpoints of a whole train state: ``save``, ``load``, ``rng_state``, ``set_rng_state``.

A train state is any pytree: params, buffers, optimizer-state NamedTuples, the step, RNG
states, user metadata. ``save`` writes it as one file holding a flat mapping
``{leaf path: tensor or plain value}`` (paths as ``fdp._tree`` formats them, e.g.
``['opt'].exp_avg['fc.weight']``) plus the format, its version and the world size. No custom
object is ever pickled, so ``load`` reads it with ``torch.load(weights_only=True)`` and
rebuilds the tree from the structure of ``like``, the freshly initialised train state.

Why one file, written by rank 0, rather than ``torch.distributed.checkpoint`` (DCP): in data
parallelism the train state is replicated, so one writer holds all of it (per-rank RNG states
are gathered into it first) and there is nothing to shard. A single file can be replaced
atomically with one ``os.replace``: a reader, or a job restarted after a crash, sees the old
checkpoint or the new one, never a mix. DCP is built for sharded state (every rank writes its
shards and a metadata file into a directory, which is not replaced in one atomic step), and
its default load planner reads non-tensor values with ``torch.load(weights_only=False)``
(torch 2.13, ``default_planner.py``), which would unpickle arbitrary objects. For sharded
(FSDP/TP) state, DCP is the right tool; fdp's state is not sharded.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch

from . import _comm, _tree
from ._errors import CheckpointError
from ._group import Group, resolve

__all__ = ["load", "rng_state", "save", "set_rng_state"]

FORMAT = "fdp.checkpoint"
VERSION = 1
# Plain values a checkpoint may hold besides tensors: all load under weights_only=True.
# (None is not a leaf: optree treats it as an empty subtree, so it round-trips as structure.)
_PLAIN = (bool, int, float, str)

PathLike = str | os.PathLike


def save(path: PathLike, tree: Any, group: Group | Any | None = None) -> None:
    """Write ``tree`` to ``path`` atomically; a collective over ``group``.

    Rank 0 writes the file (its tree; the others' trees are not read): to a temporary file
    in the same folder, flushed and fsynced, then ``os.replace``-d onto ``path``, and the
    folder is fsynced so the rename survives a power loss. The other ranks wait for it in a
    barrier that carries the group's timeout, and every rank returns only once the file is
    in place. If the write fails, the previous file at ``path`` is untouched, the temporary
    file is removed, and every rank raises.

    Args:
      path: the checkpoint file; its folder must exist and, for ``load`` on every rank, be
        visible to every rank (a shared filesystem).
      tree: any pytree whose leaves are tensors or ``bool``/``int``/``float``/``str``.
        Tensors are stored on the CPU.
      group: the ranks that take part (default: the world, or a world of one).

    Raises:
      CheckpointError: on every rank if rank 0 could not write the file (a leaf of another
        type, a missing folder, a full disk...); rank 0's error names the cause.
      CollectiveError: a rank did not reach the barrier within the group's timeout.

    Example:
      >>> fdp.save("/tmp/ckpt.pt", {"w": torch.ones(2), "step": 3, "rng": fdp.rng_state()})
    """
    group = resolve(group)
    path = os.fspath(path)
    error: Exception | None = None
    if group.rank == 0:
        try:
            _write_atomically(path, _payload(tree, group.size))
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
    # The barrier: rank 0 reports whether the file is in place; nobody returns before it is.
    if _comm.count_ranks(error is not None, group, f"fdp.save({path!r})"):
        if error is not None:
            raise CheckpointError(f"fdp.save: could not write {path}: {error}") from error
        raise CheckpointError(f"fdp.save: rank 0 could not write {path} (see rank 0's error)")


def load(
    path: PathLike, like: Any, group: Group | Any | None = None, *, strict_world_size: bool = True
) -> Any:
    """Read a checkpoint written by ``save`` into a tree shaped like ``like``.

    Every rank reads the file itself (no communication). The file is read with
    ``torch.load(weights_only=True)``, so it cannot run code. Its leaf paths must be those of
    ``like``, and each leaf must match: a tensor with the same shape and dtype (it is placed
    on the device of ``like``'s tensor), or a plain value of the same type.

    Args:
      path: a file written by ``save``.
      like: a train state with the structure to rebuild (NamedTuples included), e.g. the
        freshly initialised one; its values are not used.
      group: the ranks that will use the state (default: the world, or a world of one).
      strict_world_size: require the checkpoint to come from a world of ``group.size``
        ranks (per-rank state such as RNG states does not carry over to another size).

    Returns:
      A tree with ``like``'s structure and the checkpoint's values (plain tensors).

    Raises:
      CheckpointError: the file is missing, truncated, corrupt or not an fdp checkpoint
        (the message names the file); it was written by a different world size (names both
        sizes); or it does not match ``like`` (names the first differing leaf path and both
        values).

    Example:
      >>> like = {"w": torch.zeros(2), "step": 0, "rng": fdp.rng_state()}
      >>> state = fdp.load("/tmp/ckpt.pt", like)
      >>> state["w"], state["step"]
      (tensor([1., 1.]), 3)
      >>> fdp.set_rng_state(state["rng"])
    """
    group = resolve(group)
    path = os.fspath(path)
    saved = _read(path)
    if strict_world_size and saved["world_size"] != group.size:
        raise CheckpointError(
            f"fdp.load: {path} was written by a world of {saved['world_size']} ranks, but this "
            f"world has {group.size} (pass strict_world_size=False to load it anyway; per-rank "
            "state such as RNG states will not fit)"
        )
    values = saved["leaves"]
    paths, leaves, treedef = _tree.flatten_with_paths(like)
    for p in paths:
        if p not in values:
            raise CheckpointError(f"fdp.load: {path} has no leaf {p}, which the train state has")
    known = set(paths)
    for p in values:
        if p not in known:
            raise CheckpointError(f"fdp.load: {path} has a leaf {p}, which the train state lacks")
    out = [_match(path, p, values[p], want) for p, want in zip(paths, leaves)]
    return _tree.unflatten(treedef, out)


def rng_state(group: Group | Any | None = None) -> dict[str, torch.Tensor]:
    """Every rank's random-number-generator states, gathered; a collective over ``group``.

    Returns the same tree on every rank, ready to save: ``{"cpu": uint8[world, n]}`` with
    each rank's ``torch.get_rng_state()``, plus ``"cuda": uint8[world, devices, m]`` with
    each rank's ``torch.cuda.get_rng_state_all()`` when CUDA is initialised. Restore with
    ``set_rng_state``, which picks this rank's row.

    Args:
      group: the ranks (default: the world, or a world of one).

    Returns:
      ``{"cpu": Tensor[, "cuda": Tensor]}`` of CPU tensors, indexed by rank on dim 0.

    Raises:
      CheckpointError: the ranks disagree on whether CUDA is initialised or on the shape of
        their RNG states.
      CollectiveError: a rank did not join within the group's timeout.

    Example:
      >>> fdp.rng_state()["cpu"].shape  # a world of one
      torch.Size([1, 5056])
    """
    group = resolve(group)
    what = "fdp.rng_state"
    cpu = torch.get_rng_state()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.stack(torch.cuda.get_rng_state_all())
    # Ranks must agree on what they gather (all_gather needs equal shapes everywhere).
    header = [cpu.numel(), *(cuda.shape if cuda is not None else (0, 0))]
    headers = _comm.all_gather(torch.tensor(header, device=group.device), group, what).tolist()
    if any(h != headers[0] for h in headers):
        raise CheckpointError(
            f"fdp.rng_state: ranks disagree on their RNG states (per rank [cpu bytes, cuda "
            f"devices, cuda bytes]: {headers}); initialise CUDA on every rank or on none"
        )
    out = {"cpu": _comm.all_gather(cpu.to(group.device), group, what).cpu()}
    if cuda is not None:
        out["cuda"] = _comm.all_gather(cuda.to(group.device), group, what).cpu()
    return out


def set_rng_state(state: Mapping[str, torch.Tensor], group: Group | Any | None = None) -> None:
    """Restore this rank's RNG states from ``rng_state``'s tree (no communication).

    Args:
      state: the tree ``rng_state`` returned (typically loaded from a checkpoint).
      group: the ranks (default: the world, or a world of one); this rank's row is restored.

    Raises:
      CheckpointError: the state was gathered in a world of another size, it holds CUDA
        states but this process cannot restore them (no CUDA, another device count), or it
        is not a tree ``rng_state`` made.

    Example:
      >>> saved = fdp.rng_state()
      >>> a = torch.rand(2)
      >>> fdp.set_rng_state(saved)
      >>> torch.equal(torch.rand(2), a)
      True
    """
    group = resolve(group)
    cpu = state.get("cpu") if isinstance(state, Mapping) else None
    if not isinstance(cpu, torch.Tensor) or cpu.dim() != 2 or cpu.dtype != torch.uint8:
        raise CheckpointError("fdp.set_rng_state: expected the dict fdp.rng_state() returns")
    if cpu.shape[0] != group.size:
        raise CheckpointError(
            f"fdp.set_rng_state: the RNG states are from a world of {cpu.shape[0]} ranks, "
            f"but this world has {group.size}"
        )
    cuda = state.get("cuda")
    if cuda is not None:
        if not torch.cuda.is_available() or torch.cuda.device_count() != cuda.shape[1]:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise CheckpointError(
                f"fdp.set_rng_state: the state holds RNG states of {cuda.shape[1]} CUDA "
                f"devices, but this process has {have}"
            )
        torch.cuda.set_rng_state_all(list(cuda[group.rank].cpu()))
    torch.set_rng_state(cpu[group.rank].cpu().clone())


# ------------------------------------------------------------------------------- helpers


def _payload(tree: Any, world_size: int) -> dict[str, Any]:
    paths, leaves, _ = _tree.flatten_with_paths(tree)
    if len(set(paths)) != len(paths):
        raise CheckpointError(f"fdp.save: two leaves share a path in {paths}")
    out: dict[str, Any] = {}
    for p, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            out[p] = _compact_cpu(leaf)
        elif type(leaf) in _PLAIN:
            out[p] = leaf
        else:
            raise CheckpointError(
                f"fdp.save: leaf {p} is a {type(leaf).__name__}; a checkpoint holds tensors "
                "and bool/int/float/str values only (so it loads with weights_only=True)"
            )
    return {"format": FORMAT, "version": VERSION, "world_size": world_size,
            "torch": str(torch.__version__), "leaves": out}


def _compact_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        return t.cpu()  # a fresh, compact copy
    # torch.save writes a tensor's whole storage: a view of a big buffer would write all of it.
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _write_atomically(path: str, payload: dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        # os.open honours the umask (tempfile.mkstemp would force mode 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    if os.name == "nt":  # pragma: no cover - folders cannot be opened for fsync on Windows
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some network/FUSE filesystems do not support it
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _read(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise CheckpointError(f"fdp.load: no checkpoint at {path}")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a bad file
        raise CheckpointError(
            f"fdp.load: cannot read {path}: it is truncated, corrupt, or not a checkpoint "
            f"written by fdp.save ({_reason(e)})"
        ) from e
    if not (isinstance(saved, dict) and saved.get("format") == FORMAT):
        raise CheckpointError(f"fdp.load: {path} is not a checkpoint written by fdp.save")
    if saved.get("version") != VERSION:
        raise CheckpointError(
            f"fdp.load: {path} has format version {saved.get('version')}; this fdp reads "
            f"version {VERSION}"
        )
    if not isinstance(saved.get("leaves"), dict) or not isinstance(saved.get("world_size"), int):
        raise CheckpointError(f"fdp.load: {path} is damaged (no leaves or world size)")
    return saved


def _reason(e: Exception) -> str:
    """The useful line of torch.load's error (its weights_only advice does not apply here)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
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
