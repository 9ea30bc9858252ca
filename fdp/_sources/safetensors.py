"""HF-style safetensors checkpoints: read range by range (``fdp.safetensors_params``, a
``ParamSource``), written unit by unit (``fdp.save_safetensors``).

The format is a little-endian u64 header length, a JSON header naming each tensor's dtype,
shape and byte range in the data that follows, then the data, row-major. A leaf's element
range ``a:z`` is therefore one contiguous byte range of one file: a rank of a fully sharded
step reads only the bytes of its slices. A folder holds one ``model.safetensors``, or several
``model-0000k-of-0000n.safetensors`` and a ``model.safetensors.index.json`` mapping each name
to its file, as ``transformers``' ``save_pretrained`` writes them (and ``from_pretrained``
reads them).

Written from ``fdp.ShardedParams``, every rank gathers one unit at a time and rank 0 writes it
(so rank 0 holds its slices plus one unit); each file is written atomically (a temporary
file, fsynced, renamed) and the index last, and an error on rank 0 is raised on every rank.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import _tree
from .._checkpoint.files import write_atomically
from .._comm.agree import count_ranks
from .._comm.group import Group, resolve
from .._errors import CheckpointError
from .._shard import Shard
from .._units.params import ShardedParams
from .trees import name_of, whole_tree

__all__ = ["SafetensorsParams", "save_safetensors", "safetensors_params"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}


def _names(names: Mapping[str, str] | Callable[[str], str] | None) -> Callable[[str], str]:
    if names is None:
        return lambda k: k
    if callable(names):
        return names
    return lambda k: names.get(k, k)


class SafetensorsParams:
    """Params read from HF-style safetensors files, only the element ranges asked for
    (``fdp.safetensors_params``). Pass it to a fully sharded step's ``step.shard(source)``
    (each rank reads its slices' bytes), or read whole trees with ``materialize``.

    Attributes:
      path: the file or folder it reads.
      tensors: per name in the files, ``(file, dtype, shape, first byte)``.
    """

    def __init__(self, path: str | os.PathLike, names: Mapping[str, str] | Callable[[str], str] | None = None) -> None:
        self.path = os.fspath(path)
        self._name = _names(names)
        files = self._files()
        self.tensors: dict[str, tuple[str, torch.dtype, tuple[int, ...], int]] = {}
        for file in files:
            with open(file, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise CheckpointError(f"fdp.safetensors_params: {file} is not a safetensors file (too short)")
                (n,) = struct.unpack("<Q", head)
                try:
                    header = json.loads(f.read(n))
                except (ValueError, UnicodeDecodeError) as e:
                    raise CheckpointError(f"fdp.safetensors_params: {file} has no readable header: {e}") from e
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in DTYPES:
                    raise CheckpointError(f"fdp.safetensors_params: {name!r} in {file} has dtype {entry['dtype']}, "
                                          f"which fdp does not read (it reads {sorted(DTYPES)})")
                begin, _ = entry["data_offsets"]
                self.tensors[name] = (file, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + n + begin)

    def _files(self) -> list[str]:
        p = self.path
        if os.path.isfile(p):
            return [p]
        if not os.path.isdir(p):
            raise FileNotFoundError(f"fdp.safetensors_params: no file or folder {p}")
        index = os.path.join(p, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return [os.path.join(p, f) for f in dict.fromkeys(weight_map.values())]
        found = sorted(f for f in os.listdir(p) if f.endswith(".safetensors"))
        if not found:
            raise FileNotFoundError(f"fdp.safetensors_params: {p} holds no {INDEX} and no *.safetensors file")
        return [os.path.join(p, f) for f in found]

    # ------------------------------------------------------------------ reading (ParamSource)
    def read(self, leaves: Sequence[tuple[Any, tuple[int, ...], torch.dtype]], ranges: Sequence[tuple[int, int]],
             device: torch.device) -> list[Shard]:
        """Elements ``a:z`` of each leaf, as ``fdp.Shard`` s on ``device`` in the leaf's dtype
        (cast from the file's, as ``from_pretrained`` casts to the model's)."""
        out = []
        for (key, shape, dtype), (a, z) in zip(leaves, ranges):
            name = self._name(name_of(key))
            if name not in self.tensors:
                raise KeyError(f"fdp.safetensors_params: {name_of(key)!r} is not in {self.path}"
                               + (f" (looked up as {name!r})" if name != name_of(key) else "")
                               + "; map the params' keys to the files' names with names=")
            file, fdtype, fshape, start = self.tensors[name]
            if tuple(fshape) != tuple(shape):
                raise ValueError(f"fdp.safetensors_params: {name!r} is {list(fshape)} in {file}, the params' "
                                 f"{name_of(key)!r} is {list(shape)}")
            data = torch.empty(z - a, dtype=fdtype)
            size = data.element_size()
            with open(file, "rb") as f:
                f.seek(start + a * size)
                got = f.readinto(memoryview(data.view(torch.uint8).numpy()))
            if got != (z - a) * size:
                raise CheckpointError(f"fdp.safetensors_params: {file} ends inside {name!r} (truncated?)")
            out.append(Shard(tuple(shape), dtype, ((a, z),) if z > a else (), data.to(device=device, dtype=dtype)))
        return out

    def materialize(self, tree: Any, device: torch.device | str | None = None) -> Any:
        """``tree``'s leaves (by key; their shapes and dtypes, meta tensors will do) read whole
        onto ``device`` (default: the tree's device; the current CUDA device, else the CPU,
        for meta leaves)."""
        return whole_tree(self, tree, device, "fdp.safetensors_params")

    def __repr__(self) -> str:
        return f"fdp.SafetensorsParams({self.path!r}, {len(self.tensors)} tensors)"


def safetensors_params(path: str | os.PathLike,
                       names: Mapping[str, str] | Callable[[str], str] | None = None) -> SafetensorsParams:
    """Params from HF-style safetensors files, read range by range: no rank holds more than
    it asks for.

    With a model built on the meta device::

        params = step.shard(fdp.safetensors_params("gpt2-folder"))   # shard="params": this rank's bytes
        params = fdp.safetensors_params("gpt2-folder").materialize(params)  # whole leaves

    Args:
      path: a ``.safetensors`` file, or a folder holding ``model.safetensors.index.json``
        (and the files it names) or ``*.safetensors`` files (``save_pretrained``'s output).
      names: the files' name for a params key, when they differ (a dict, or a function of
        the key; default: the same names, which ``fdp.functionalize`` of the HF model gives).

    Raises:
      FileNotFoundError: no such file or folder, or a folder with no safetensors files.
      CheckpointError: a file that is not safetensors, or is truncated.
      KeyError, ValueError: (when read) a key not in the files, or of another shape.
    """
    return SafetensorsParams(path, names)


# ---------------------------------------------------------------------------- writing
def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    return struct.pack("<Q", len(raw)) + raw


def _units_of(params: Any, buffers: Any) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...], int]],
                                                   Iterator[dict[str, torch.Tensor]]]:
    """Every tensor to write as (name, dtype, shape, bytes), in the order they arrive, and an
    iterator of dicts of them as they arrive: one per unit for ``ShardedParams`` (each gathered
    when asked for: a collective), then the buffers; a whole tree at once otherwise."""
    def named(tree: Any) -> dict[str, torch.Tensor]:
        if tree is None:
            return {}
        leaves, treedef = _tree.flatten(tree)
        return dict(zip(map(name_of, _tree.keys(treedef)), leaves))

    extra = named(buffers)
    tail = [(k, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for k, t in extra.items()]
    if not isinstance(params, ShardedParams):
        whole = {**named(params), **extra}
        return [(k, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for k, t in whole.items()], iter([whole])
    plan, keys = params.units.plan, params.units.keys
    entries = [(name_of(keys[i]), plan.slots[i].dtype, tuple(plan.slots[i].shape),
                plan.slots[i].numel * plan.slots[i].dtype.itemsize) for b in plan.buckets for i in b.leaves]

    def gathered() -> Iterator[dict[str, torch.Tensor]]:
        for unit in params.full_by_unit():
            yield {name_of(k): v for k, v in unit.items()}
        yield extra

    return entries + tail, gathered()


def save_safetensors(path: str | os.PathLike, params: Any, buffers: Any = None, *,
                     names: Mapping[str, str] | Callable[[str], str] | None = None,
                     max_shard_size: int = 5 * 2**30, metadata: Mapping[str, str] | None = None,
                     group: Group | Any | None = None) -> list[str]:
    """Write params (and buffers) as HF-style safetensors into the folder ``path``, as
    ``save_pretrained`` does: ``model.safetensors``, or files of at most ``max_shard_size``
    bytes and ``model.safetensors.index.json``; ``from_pretrained`` and
    ``fdp.safetensors_params`` read them.

    A collective over the ranks: rank 0 writes. ``fdp.ShardedParams`` are gathered one unit
    at a time (every rank takes part; rank 0 holds its slices plus one unit, never the whole
    model); a whole tree is rank 0's own (the others' are not read). Each file is written
    atomically and the index last; every rank returns once the files are in place.

    Args:
      path: the folder (made if missing).
      params: a dict of tensors (``fdp.functionalize``'s keys: the HF model's own names) or
        ``fdp.ShardedParams``.
      buffers: more tensors to write beside them (persistent buffers), or None.
      names: the name to write for a key, when it differs (a dict, or a function of the key).
      max_shard_size: the most bytes of tensors per file (a tensor larger than it gets a
        file of its own).
      metadata: strings stored in every file's ``__metadata__`` (beside ``format: pt``).
      group: the ranks (default: those of ``ShardedParams``, else the world).

    Returns:
      The files written (folder-relative names), the index last if there is one.

    Raises:
      CheckpointError: on every rank, if rank 0 could not write (names the cause).
    """
    rename = _names(names)
    if isinstance(params, ShardedParams):
        group = params.units.group if group is None else resolve(group)
    else:
        group = resolve(group)
    collective = isinstance(params, ShardedParams)
    listed, source = _units_of(params, buffers)
    entries = [(rename(k), dt, shape, nb) for k, dt, shape, nb in listed]
    seen: set[str] = set()
    for name, *_ in entries:
        if name in seen:
            raise ValueError(f"fdp.save_safetensors: two tensors would be written as {name!r}")
        seen.add(name)
    # Files in order of the units: each file is filled as its units arrive.
    files: list[list[int]] = [[]]
    size = 0
    for j, (_, _, _, nb) in enumerate(entries):
        if files[-1] and size + nb > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(j)
        size += nb
    n = len(files)
    file_names = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    folder = os.fspath(path)
    writer = group.rank == 0
    error: BaseException | None = None
    pending: dict[str, torch.Tensor] = {}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if writer:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            error = e
    for k, members in enumerate(files):
        mine = [entries[j] for j in members]
        wanted = {name for name, *_ in mine}

        def fill(upto: set[str] = wanted) -> None:
            while not upto <= pending.keys():
                unit = next(source)  # (a collective for ShardedParams: every rank asks in turn)
                pending.update({rename(key): t for key, t in unit.items()})

        if not writer or error is not None:
            fill()
            for name in wanted:
                pending.pop(name, None)
            continue

        def write(sink: Any, mine: list = mine) -> None:
            sink.write(_header([(nm, dt, sh, nb) for nm, dt, sh, nb in mine], meta))
            for name, _, _, _ in mine:
                if name not in pending:
                    fill({name})
                t = pending.pop(name).detach().to("cpu").contiguous()
                sink.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else b"")

        try:
            write_atomically(os.path.join(folder, file_names[k]), write, lambda mine=mine: sum(e[3] for e in mine))
        except Exception as e:  # noqa: BLE001 - reported to every rank below; the gathers go on
            error = e
            fill()
            for name in wanted:
                pending.pop(name, None)
    for _ in source:  # (the buffers' item, and any unit not yet asked for)
        pass
    if writer and error is None and n > 1:
        index = {"metadata": {"total_size": sum(e[3] for e in entries)},
                 "weight_map": {entries[j][0]: file_names[k] for k, members in enumerate(files) for j in members}}
        try:
            write_atomically(os.path.join(folder, INDEX), lambda sink: sink.write(json.dumps(index, indent=2).encode()),
                             lambda: 1 << 16)
        except Exception as e:  # noqa: BLE001
            error = e
    if (collective or group.size > 1) and count_ranks(error is not None, group, f"fdp.save_safetensors({folder!r})"):
        if error is not None:
            raise CheckpointError(f"fdp.save_safetensors: could not write {folder}: {error}") from error
        raise CheckpointError(f"fdp.save_safetensors: rank 0 could not write {folder} (see rank 0's error)")
    if error is not None:
        raise CheckpointError(f"fdp.save_safetensors: could not write {folder}: {error}") from error
    return file_names + ([INDEX] if n > 1 else [])
