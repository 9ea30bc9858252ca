"""Sharded checkpoints without a gather: ``save_sharded`` and ``load_sharded``.

``fdp.save`` writes rank 0's tree, so a state sharded over the ranks must first be gathered
onto every rank (``step.state_to_tree``: the whole optimizer state in each rank's memory).
``save_sharded`` has every rank write its own parts instead: a leaf that is an ``fdp.Shard``
is written by the ranks that hold it, each its own element ranges; a replicated tensor
(buffers, a step count) once, by rank 0. ``load_sharded`` has every rank read the element
ranges it asks for, so a checkpoint saved on 4 ranks loads on 2, 3 or 1, into the sharded
step, the unsharded one, or the plain per-leaf layout (ask for whole tensors).

The format (``manifest.py``): a folder with one safetensors data file per rank and a JSON
manifest naming every leaf's path, kind, shape and dtype and its pieces (file, byte offset,
element range, CRC32). Why this and not ``torch.distributed.checkpoint`` (DCP), torch
2.13: its ``FileSystemReader.read_metadata`` reads the ``.metadata`` file with
``pickle.load``, and its default load planner reads non-tensor values with
``torch.load(weights_only=False)``: loading a checkpoint would unpickle whatever the folder
holds. Its data files have fixed names (``__0_0.distcp``), so a save over a checkpoint
overwrites it in place: a crash mid-save leaves the old metadata over partly new data.
And it reshards DTensor boxes (offsets per dim), where a flat bucket slice starts and ends
inside rows. DCP's Hugging Face reader avoids pickle, but builds its metadata from every
``*.safetensors`` file in the folder, so a crashed save's files would mix in. What is kept
from the existing formats: safetensors data files (any safetensors tool reads a rank's
pieces), plus a JSON manifest that fdp alone reads (``json.loads``: it makes dicts, lists,
strings and numbers, never objects).

Atomic: data files are named with a per-save id (``data-<id>-rank00003.safetensors``) and
never overwrite the previous save's; the manifest is written last, by rank 0, after every
rank has fsynced its file (their CRCs gathered in one all-gather are the barrier), through a
temporary file and ``os.replace``. The manifest is the commit: a reader, or a job restarted
after a crash mid-save, sees the previous complete checkpoint or the new one. The previous
save's files (and files of saves that crashed) are removed only after the commit.

What the ranks exchange is integers only (no pickle on either path): each rank's verdict and
rank 0's save id, a digest of the leaves' paths, kinds, shapes and dtypes (``verify_layout``:
the ranks must agree on the tree), every rank's ``(leaf, start, stop)`` ranges (so that every
rank plans the same pieces: ``manifest.plan``), and after the writes each piece's CRC32.

Memory: saving writes each piece from the Shard's own memory (a device tensor is copied to
the CPU one piece at a time); loading reads each piece with one seek and ``readinto``
straight into the destination, or, for a piece only partly needed, into a buffer of that
piece, whose checksum is checked before its elements are copied. Peak: this rank's part of
the state plus one leaf (measured: docs/measurements.md, "Sharded checkpoints: memory").
"""

from __future__ import annotations

import os
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import torch

from .. import _tree
from .._comm import collectives as comm
from .._comm.agree import count_ranks, verify_layout, which_ranks
from .._comm.group import Group, resolve
from .._errors import CheckpointError, ReplicaMismatchError
from .._shard import Shard
from . import manifest
from .files import Sink, explain, fsync_folder, remove_quietly, write_atomically
from .leaves import (
    PLAIN,
    check_loaded,
    per_rank_paths,
    refuse_meta,
    refuse_unsaveable,
    tensor_bytes,
)
from .manifest import FileLayout, LeafMeta, Manifest

__all__ = ["load_sharded", "save_sharded"]

PathLike = str | os.PathLike
SAVE = "fdp.save_sharded"
LOAD = "fdp.load_sharded"


def save_sharded(path: PathLike, tree: Any, group: Group | Any | None = None) -> None:
    """Write ``tree`` to the folder ``path``, every rank its own parts; a collective over ``group``.

    No gather: a leaf that is an ``fdp.Shard`` is written by the ranks that hold it, each its
    own element ranges (one data file per rank; elements that several ranks hold, as the
    replicas of a 2-D mesh do, are written once); a tensor is replicated state (buffers, a
    step count) and is written once, by rank 0; a ``bool``/``int``/``float``/``str`` goes
    into the manifest (rank 0's). Per-rank RNG states (``fdp.rng_state()``) are written by
    rank 0 (they hold every rank's row) and tie the checkpoint to its world size. The ranks
    must agree on the tree's structure, each leaf's kind, shape and dtype (checked with the
    metadata, not the values), and their Shards must cover every element of each leaf.

    Atomic: each rank's data file has a new name per save; rank 0 writes the manifest last
    (through ``os.replace``), after every rank has fsynced its file. A reader, or a job
    restarted after a crash mid-save, sees the previous complete checkpoint or the new one,
    never a mix; the previous save's files are removed only after the new one is committed.
    Every rank returns once the checkpoint is in place. Two jobs must not save to the same
    ``path`` at the same time, and ``load_sharded`` on every rank needs a filesystem that
    every rank sees.

    Args:
      path: a folder (made if missing); a checkpoint already there is replaced.
      tree: any pytree whose leaves are ``fdp.Shard``s, tensors or plain values, e.g.
        ``{"params": params, "opt": step.state_to_shards(opt_state, params), "step": n}``.
      group: the ranks that take part (default: the world, or a world of one).

    Raises:
      CheckpointError: on every rank, naming the rank and its cause, if any rank could not
        write its part (a leaf of another type, a Shard leaving elements of a leaf on no
        rank, a full disk...): the previous checkpoint at ``path`` is untouched. Also, before
        anything is written, for a sharded ``FusedState`` (save ``step.state_to_shards``).
      ReplicaMismatchError: on every rank, when the ranks' trees differ (a leaf's path,
        kind, shape or dtype), naming the first differing leaf and the ranks.
      CollectiveError: a rank did not take part within the group's timeout.

    Example:
      >>> params = {"w": torch.arange(6.0)}
      >>> fdp.save_sharded("ckpt", {"params": params, "step": 3})
      >>> fdp.load_sharded("ckpt", {"params": {"w": fdp.Shard.of(torch.zeros(6), [(2, 4)])}, "step": 0})
      {'params': {'w': Shard(shape=(6,), dtype=torch.float32, ranges=[(2, 4)], data=<2 elements on cpu>)}, 'step': 3}
    """
    group = resolve(group)
    folder = os.fspath(path)
    what = f"{SAVE}({folder!r})"
    # 1. This rank's leaves, described (no collective yet: a failure here is reported below).
    error: BaseException | None = None
    metas: list[LeafMeta] = []
    values: list[Any] = []
    try:
        metas, values = _describe(tree)
        if group.rank == 0:
            _make_folder(folder)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    # 2. Agree, with integers only: who failed, rank 0's save id, the structure (a digest), and
    #    every rank's element ranges (every rank plans the same pieces from them).
    held = [(j, a, b) for j, m in enumerate(metas) for a, b in m.ranges]
    head = torch.tensor([error is not None, len(held), int(uuid.uuid4().hex[:12], 16)], dtype=torch.int64)
    heads = comm.all_gather(head.to(group.device), group, f"{what}: the ranks' verdicts").cpu()
    if bool(heads[:, 0].any()):
        said = comm.all_gather_object(None if error is None else _said(error), group, f"{what}: the errors")
        raise _failure(error, [(r, s) for r, s in enumerate(said) if s is not None], group,
                       f"{SAVE}: could not save {folder}")
    save_id = f"{int(heads[0, 2]):012x}"
    verify_layout([m.agreed() for m in metas], group, what)
    everyone: list[list[tuple[int, int, int]]] = [[] for _ in range(group.size)]
    longest = int(heads[:, 1].max())
    if longest:
        ranges = torch.full((longest, 3), -1, dtype=torch.int64)
        if held:
            ranges[:len(held)] = torch.tensor(held, dtype=torch.int64)
        ranges = comm.all_gather(ranges.to(group.device), group, f"{what}: the ranks' element ranges").cpu()
        everyone = [[(j, a, b) for j, a, b in ranges[r].tolist() if j >= 0] for r in range(group.size)]
    pieces = manifest.plan(metas, everyone, f"{SAVE}: {folder}")
    # 3. This rank's data file.
    mine = manifest.layout(metas, pieces, group.rank, save_id)
    file = os.path.join(folder, manifest.data_name(save_id, group.rank))
    crcs: list[int] = []
    try:
        crcs = _write_file(file, mine, lambda j, a, b: _elements(values[j], a, b))
        fsync_folder(folder)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
        remove_quietly(file)
    # 4. The barrier: every rank's verdict and its pieces' CRCs (one all-gather of integers).
    counts = [0] * group.size
    for ps in pieces:
        for r, _, _ in ps:
            counts[r] += 1
    row = torch.zeros(1 + max(counts, default=0), dtype=torch.int64)
    row[0] = error is not None
    row[1:1 + len(crcs)] = torch.tensor(crcs, dtype=torch.int64)
    rows = comm.all_gather(row.to(group.device), group, f"{what}: the data files' checksums").cpu()
    if bool(rows[:, 0].any()):
        remove_quietly(file)
        said = comm.all_gather_object(None if error is None else _said(error), group, f"{what}: the errors")
        raise _failure(error, [(r, s) for r, s in enumerate(said) if s is not None], group,
                       f"{SAVE}: could not write {folder}")
    # 5. Rank 0 commits: the manifest, then the previous save's files go.
    if group.rank == 0:
        try:
            files = [mine if r == 0 else manifest.layout(metas, pieces, r, save_id) for r in range(group.size)]
            data = manifest.encode(metas, values, group.size, save_id, files,
                                   [rows[r, 1:1 + counts[r]].tolist() for r in range(group.size)])
            write_atomically(os.path.join(folder, manifest.MANIFEST), lambda f: f.write(data), lambda: len(data))
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
            for r in range(group.size):
                remove_quietly(os.path.join(folder, manifest.data_name(save_id, r)))
        else:
            _remove_other_saves(folder, save_id)
    if count_ranks(error is not None, group, f"{what}: the commit"):
        if error is not None:
            raise CheckpointError(f"{SAVE}: could not commit {folder} on rank 0: {error}") from error
        raise CheckpointError(f"{SAVE}: rank 0 could not commit {folder} (see rank 0's error); the previous "
                              "checkpoint, if any, is untouched")


def load_sharded(path: PathLike, like: Any, group: Group | Any | None = None, *,
                 strict_world_size: bool | None = None, partial: bool = False) -> Any:
    """Read a checkpoint written by ``save_sharded``: each rank the ranges ``like`` asks for.

    ``like`` has the saved tree's structure; each of its leaves says what this rank wants:
    an ``fdp.Shard`` gets a new Shard with the same ranges and the saved elements (only
    those are read), a tensor gets the whole leaf in its shape (the plain per-leaf layout,
    or an unsharded step's state), a plain value gets the saved value. Ranges are global
    element ranges, so the checkpoint reshards into any world size: a save on 4 ranks loads
    on 2, 3 or 1 rank, or into whole tensors. Each rank reads only the byte ranges it needs
    (a seek and a ``readinto`` straight into the result, per piece) and checks each piece
    it reads against its CRC32. Nothing is unpickled: the manifest is JSON and the data raw
    bytes. A collective only to agree at the end: if any rank fails, every rank raises.

    Args:
      path: a folder written by ``save_sharded``.
      like: a tree with the checkpoint's structure whose leaves are Shards, tensors or plain
        values, e.g. ``{"params": params, "opt": step.state_to_shards(step.init(params),
        params), "step": 0}``; only the Shards' ranges, and every leaf's shape, dtype and
        device, are used. Loaded tensors are placed on ``like``'s devices.
      group: the ranks that load (default: the world, or a world of one).
      strict_world_size: whether the checkpoint must come from a world of ``group.size``
        ranks: ``None`` (default) only if it holds per-rank state (``fdp.rng_state()``),
        ``True`` always, ``False`` never (as in ``fdp.load``).
      partial: load only the leaves ``like`` has (``{"params": like_params}`` from a
        training checkpoint, for evaluation or export): the others are not read, nor looked
        at by the world-size check. Every leaf of ``like`` must still be in the checkpoint.
        Default: the two trees must have the same leaves.

    Returns:
      A tree with ``like``'s structure and the checkpoint's values.

    Raises:
      CheckpointError: on every rank (the failing rank names the cause, the others name the
        failing rank): no checkpoint at ``path``; a damaged manifest or data file (a piece
        outside its file, a flipped bit: names the leaf, the piece and the rank that wrote
        it); a leaf ``like`` lacks or has in addition, or of another shape, dtype or type;
        per-rank state from another world size.

    Example:
      >>> fdp.save_sharded("ckpt", {"w": fdp.Shard.whole(torch.arange(4.0)), "n": 2})
      >>> fdp.load_sharded("ckpt", {"w": torch.zeros(4), "n": 0})
      {'w': tensor([0., 1., 2., 3.]), 'n': 2}
    """
    group = resolve(group)
    folder = os.fspath(path)
    where = f"{LOAD}: {folder} (rank {group.rank})"
    error: BaseException | None = None
    out = None
    try:
        out = _load(folder, like, group, strict_world_size, where, partial)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    failed = which_ranks(error is not None, group, f"{LOAD}({folder!r})")
    if failed:
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"{where}: {type(error).__name__}: {error}") from error
        raise CheckpointError(f"{LOAD}: rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
                              f"could not load {folder} (see {'their' if len(failed) > 1 else 'its'} error); "
                              f"rank {group.rank} stops too")
    return out


# ------------------------------------------------------------------------------- saving


def _describe(tree: Any) -> tuple[list[LeafMeta], list[Any]]:
    """This rank's leaves: their descriptions and their values (Shards, tensors, plain)."""
    refuse_unsaveable(tree, SAVE)
    paths, leaves, _ = _tree.flatten_with_paths(tree)
    if len(set(paths)) != len(paths):
        raise CheckpointError(f"{SAVE}: two leaves share a path in {paths}")
    per_rank = set(per_rank_paths(tree))
    metas = []
    for p, leaf in zip(paths, leaves):
        if isinstance(leaf, Shard):
            metas.append(LeafMeta(p, "shard", leaf.shape, manifest.dtype_name(leaf.dtype), leaf.ranges))
        elif isinstance(leaf, torch.Tensor):
            whole = ((0, leaf.numel()),) if leaf.numel() else ()
            metas.append(LeafMeta(p, "per_rank" if p in per_rank else "tensor", tuple(leaf.shape),
                                  manifest.dtype_name(leaf.dtype), whole))
        elif type(leaf) in PLAIN:
            metas.append(LeafMeta(p, "plain", (), type(leaf).__name__, ()))
        else:
            raise CheckpointError(f"{SAVE}: leaf {p} is a {type(leaf).__name__}; a sharded checkpoint holds "
                                  "fdp.Shards, tensors and bool/int/float/str values only")
    return metas, leaves


def _said(error: BaseException) -> str:
    """An error as another rank shows it (fdp's own messages without their ``fdp.save_sharded: ``)."""
    text = str(error)
    if isinstance(error, CheckpointError):
        return text.removeprefix(f"{SAVE}: ")
    return f"{type(error).__name__}: {text}"


def _failure(error: BaseException | None, failed: list[tuple[int, str]], group: Group, head: str) -> Exception:
    """The error every rank raises when some failed: this rank's own (naming the folder and
    the rank), or the failed ranks'."""
    if isinstance(error, ReplicaMismatchError):
        return error
    if error is not None:
        err = CheckpointError(f"{head} (rank {group.rank}): {_said(error)}")
        err.__cause__ = error
        return err
    shown = "; ".join(f"rank {r}: {s}" for r, s in failed[:4])
    return CheckpointError(f"{head}: {shown} (rank {group.rank} stops too; the previous checkpoint, if any, "
                           "is untouched)")


def _make_folder(folder: str) -> None:
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(f"{SAVE}: {folder} is a file, not a folder (a checkpoint of fdp.save?); a sharded "
                              "checkpoint is a folder")
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        fsync_folder(os.path.dirname(os.path.abspath(folder)))


def _elements(value: Any, a: int, b: int) -> torch.Tensor:
    """Elements ``a:b`` of a leaf's flattening, from this rank's Shard or tensor (a view)."""
    if isinstance(value, Shard):
        for lo, hi, data in value.pieces():
            if lo <= a and b <= hi:
                return data[a - lo:b - lo]
        raise AssertionError(f"elements {a}:{b} are not in {value}")  # (plan gives each rank its own)
    return value.detach().reshape(-1)[a:b]


def _write_file(file: str, layout: FileLayout, elements: Callable[[int, int, int], torch.Tensor]) -> list[int]:
    """Write one rank's data file, a piece at a time; returns the pieces' CRC32s."""
    crcs = []
    sink = None
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            sink = Sink(f)
            sink.write(layout.header)
            for j, a, b, _ in layout.pieces:
                data = tensor_bytes(elements(j, a, b).cpu())  # (a device tensor: one piece on the CPU)
                crcs.append(zlib.crc32(data))
                sink.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        worded = explain(e, sink, file, lambda: layout.size, "the previous checkpoint is untouched")
        if worded is not None:
            raise worded from e
        raise
    return crcs


def _remove_other_saves(folder: str, save_id: str) -> None:
    """The previous save's data files, and those of saves that crashed (after the commit)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if manifest.is_data_file(name) and not manifest.is_data_file(name, save_id):
            try:
                remove_quietly(os.path.join(folder, name))
            except OSError:  # (a later save tries again)
                pass


# ------------------------------------------------------------------------------ loading


def _load(folder: str, like: Any, group: Group, strict_world_size: bool | None, where: str,
          partial: bool = False) -> Any:
    paths, leaves, treedef = _tree.flatten_with_paths(like)
    refuse_meta(paths, leaves, where)
    saved = manifest.read(folder, where)
    known = set(paths)
    for p in paths:
        if p not in saved.leaves:
            raise CheckpointError(f"{where}: the checkpoint has no leaf {p}, which the train state has")
    for p in saved.leaves:
        if p not in known and not partial:
            raise CheckpointError(f"{where}: the checkpoint has a leaf {p}, which the train state lacks (to load "
                                  "part of a checkpoint, pass partial=True)")
    if saved.world_size != group.size and strict_world_size is not False:
        per_rank = [p for p, leaf in saved.leaves.items() if leaf.kind == "per_rank" and p in known]
        if strict_world_size or per_rank:
            held = f"it holds per-rank state ({', '.join(per_rank[:3])})" if per_rank else "strict_world_size=True"
            raise CheckpointError(
                f"{where}: the checkpoint was written by a world of {saved.world_size} ranks, but this world has "
                f"{group.size}, and {held} (pass strict_world_size=False to load it anyway; per-rank state such "
                "as RNG states will not fit)")
    reader = _Reader(folder, saved, where)
    try:
        out = [_read_leaf(saved.leaves[p], want, reader, where) for p, want in zip(paths, leaves)]
    finally:
        reader.close()
    loaded = _tree.unflatten(treedef, out)
    check_loaded(loaded, like, where)
    return loaded


def _read_leaf(leaf: manifest.Leaf, want: Any, reader: _Reader, where: str) -> Any:
    at = f"{where}: leaf {leaf.path}"
    if isinstance(want, Shard | torch.Tensor):
        if leaf.kind == "plain":
            raise CheckpointError(f"{at} is {leaf.value!r} ({type(leaf.value).__name__}) in the checkpoint, a "
                                  f"{type(want).__name__} in the train state")
        shape = want.shape if isinstance(want, Shard) else tuple(want.shape)
        if shape != leaf.shape or want.dtype != leaf.dtype:
            raise CheckpointError(f"{at} has shape {leaf.shape} and dtype {leaf.dtype} in the checkpoint, shape "
                                  f"{shape} and dtype {want.dtype} in the train state")
        if isinstance(want, Shard):
            data = torch.empty(want.data.numel(), dtype=leaf.dtype)
            reader.fill(leaf, want.ranges, data)
            return Shard(want.shape, want.dtype, want.ranges, data.to(want.device))
        data = torch.empty(want.numel(), dtype=leaf.dtype)
        reader.fill(leaf, ((0, data.numel()),) if data.numel() else (), data)
        return data.view(want.shape).to(want.device)
    if type(want) not in PLAIN:
        raise CheckpointError(f"{at}: the train state's leaf is a {type(want).__name__}; like's leaves must be "
                              "fdp.Shards, tensors or bool/int/float/str values")
    if leaf.kind != "plain" or type(leaf.value) is not type(want):
        shown = (f"a tensor of shape {leaf.shape}" if leaf.kind != "plain" else
                 f"{leaf.value!r} ({type(leaf.value).__name__})")
        raise CheckpointError(f"{at} is {shown} in the checkpoint, {want!r} ({type(want).__name__}) in the "
                              "train state")
    return leaf.value


class _Reader:
    """The data files of one checkpoint, opened as needed; reads pieces into tensors."""

    def __init__(self, folder: str, saved: Manifest, where: str) -> None:
        self.folder, self.saved, self.where = folder, saved, where
        self.open: dict[int, Any] = {}

    def close(self) -> None:
        for f in self.open.values():
            f.close()

    def _file(self, i: int) -> Any:
        f = self.open.get(i)
        if f is not None:
            return f
        name, size = self.saved.files[i]
        file = os.path.join(self.folder, name)
        try:
            f = open(file, "rb", buffering=0)  # noqa: SIM115 - kept open for the load, closed by close()
        except FileNotFoundError:
            raise CheckpointError(f"{self.where}: its data file {file} (written by rank {i}) is missing: removed "
                                  "by a newer save while this load read the manifest, or not on a filesystem every "
                                  "rank sees") from None
        self.open[i] = f
        got = os.fstat(f.fileno()).st_size
        if got != size:
            raise CheckpointError(f"{self.where}: its data file {file} (written by rank {i}) has {got} bytes, the "
                                  f"manifest says {size}: truncated or changed after it was written")
        return f

    def fill(self, leaf: manifest.Leaf, ranges: tuple[tuple[int, int], ...], out: torch.Tensor) -> None:
        """``out`` (CPU, 1-D) := the leaf's elements ``ranges``, concatenated: each piece wholly
        needed read straight into ``out``, a piece partly needed read whole into a buffer
        (checked, then its needed elements copied), never more than one piece at a time."""
        at, held = 0, None
        for a, b in ranges:
            for piece in leaf.overlapping(a, b):
                lo, hi = max(a, piece.start), min(b, piece.stop)
                dest = out[at + lo - a:at + hi - a]
                if (lo, hi) == (piece.start, piece.stop):
                    self._read(leaf, piece, dest)
                    continue
                if held is None or held[0] != piece:
                    held = None  # (freed before the next one is made: one piece at a time)
                    buf = torch.empty(piece.stop - piece.start, dtype=out.dtype)
                    self._read(leaf, piece, buf)
                    held = (piece, buf)
                dest.copy_(held[1][lo - piece.start:hi - piece.start])
            at += b - a

    def _read(self, leaf: manifest.Leaf, piece: manifest.Piece, dest: torch.Tensor) -> None:
        """One piece, whole, into ``dest`` (one seek, ``readinto``), checked against its CRC32."""
        f = self._file(piece.file)
        buf = dest.view(torch.uint8).numpy() if dest.numel() else memoryview(bytearray())
        f.seek(piece.offset)
        got = 0
        while got < len(buf):
            n = f.readinto(memoryview(buf)[got:])
            if not n:
                raise CheckpointError(f"{self.where}: leaf {leaf.path}: piece {piece.start}:{piece.stop} ends past "
                                      f"the end of {self.saved.files[piece.file][0]} (written by rank {piece.file})")
            got += n
        crc = zlib.crc32(buf)
        if crc != piece.crc32:
            raise CheckpointError(
                f"{self.where}: leaf {leaf.path} is corrupt: its elements {piece.start}:{piece.stop} in "
                f"{self.saved.files[piece.file][0]} (written by rank {piece.file}) have CRC32 {crc:08x}, but "
                f"{SAVE} recorded {piece.crc32:08x} (the file changed after it was written)")
