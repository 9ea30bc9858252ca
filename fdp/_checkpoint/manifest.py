"""The sharded checkpoint format: a folder of per-rank data files and a JSON manifest.

::

    ckpt/
      manifest.json                              the commit marker, written last (os.replace)
      data-<save id>-rank00000.safetensors       rank 0's pieces
      data-<save id>-rank00001.safetensors       rank 1's pieces ...

Each data file is a safetensors file (an 8-byte little-endian header length, a JSON header
naming each piece's dtype, shape and byte range, then the raw bytes, row-major, little-endian
as the machine's): one 1-D tensor per *piece*, a run of elements ``start:stop`` of one leaf's
flattening, named ``<leaf path>@<start>``. Any safetensors reader can list and read them;
fdp does not parse these headers at all: the manifest is the one source of truth. A dtype
safetensors has no name for is stored as ``U8`` bytes (the manifest says what they are).

``manifest.json``::

    {"format": "fdp.sharded_checkpoint", "version": 2, "world_size": 4, "save_id": "...",
     "torch": "2.13.0", "files": [{"name": "data-...-rank00000.safetensors", "bytes": 4096}, ...],
     "piece": ["file", "offset", "start", "stop", "crc32"],
     "leaves": [{"path": "['opt'].exp_avg['fc.weight']", "kind": "shard", "shape": [3, 4],
                 "dtype": "float32", "pieces": [[0, 136, 0, 6, 2818363478], [1, 88, 6, 12, 19282712]]},
                {"path": "['step']", "kind": "plain", "type": "int", "value": 5}, ...],
     "crc32": 3735928559}

``crc32``, the last field, is the CRC32 of every byte of the file before its line (the text
up to and including ``]``): a flipped byte anywhere in the manifest, a plain value's
included, is named at load (the pieces' own CRC32s cover the data files). Version 1 (fdp
before it) had no ``crc32``; such a manifest is still read.

A leaf's ``kind``: ``shard`` (parts written by the ranks that hold them), ``tensor`` (a
replicated tensor, written once by rank 0), ``per_rank`` (a tensor of per-rank rows, an
``RngState``'s: tied to the world size), ``plain`` (a bool/int/float/str, in the manifest
itself). A piece is ``[file, offset, start, stop, crc32]``: the file's index in ``files``
(the rank that wrote it), the piece's absolute byte offset in it, its element range, and the
CRC32 of its bytes. A leaf's pieces cover its elements exactly once, in order.

Where ranks hold the same elements (the replicas of a 2-D mesh), ``plan`` has them written
once: each element by the rank whose range reaches it first (sorted by start, then rank).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch

from .._errors import CheckpointError
from .leaves import PLAIN

__all__ = ["FORMAT", "MANIFEST", "VERSION", "FileLayout", "Leaf", "LeafMeta", "Manifest", "Piece",
           "data_name", "dtype_of", "encode", "is_data_file", "plan", "read"]

FORMAT = "fdp.sharded_checkpoint"
VERSION = 2
_CRC_FIELD = b',\n"crc32": '
MANIFEST = "manifest.json"
KINDS = ("shard", "tensor", "per_rank", "plain")
_DATA = re.compile(r"data-([0-9a-f]{12})-rank\d{5,}\.safetensors")

# torch dtype -> safetensors dtype name (https://github.com/huggingface/safetensors, "Format")
_ST_NAMES = {getattr(torch, t): n for t, n in (
    ("bool", "BOOL"), ("uint8", "U8"), ("int8", "I8"), ("int16", "I16"), ("uint16", "U16"), ("int32", "I32"),
    ("uint32", "U32"), ("int64", "I64"), ("uint64", "U64"), ("float16", "F16"), ("bfloat16", "BF16"),
    ("float32", "F32"), ("float64", "F64"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
) if hasattr(torch, t)}


def data_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-rank{rank:05d}.safetensors"


def is_data_file(name: str, save_id: str | None = None) -> bool:
    """Whether ``name`` is a data file of a save (of ``save_id``, or of any)."""
    m = _DATA.fullmatch(name)
    return m is not None and (save_id is None or m.group(1) == save_id)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_of(name: Any) -> torch.dtype | None:
    """The torch dtype a manifest names (``"float32"``), or None for a name that is not one."""
    dt = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    return dt if isinstance(dt, torch.dtype) else None


# ---------------------------------------------------------------------------------- saving
class LeafMeta(NamedTuple):
    """What one rank says about one leaf when saving: its path, kind, the whole tensor's
    shape and dtype (a plain value: ``()`` and its type's name) and the element ranges it holds."""

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    ranges: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def agreed(self) -> tuple[str, tuple[int, ...], str]:
        """What every rank must agree on (not the ranges), as ``verify_layout`` compares it."""
        return self.path, self.shape, f"{self.kind} {self.dtype}"


def plan(metas: list[LeafMeta], held: list[list[tuple[int, int, int]]], where: str) -> list[list[tuple[int, int, int]]]:
    """Per leaf, its pieces ``(rank, start, stop)`` sorted by start: each element written once,
    by the rank whose range reaches it first (sorted by start, then rank). ``held``: per rank,
    the ``(leaf, start, stop)`` ranges it holds; the same on every rank, and so is the plan.
    Raises ``CheckpointError`` when no rank holds some elements of a leaf."""
    spans: list[list[tuple[int, int, int]]] = [[] for _ in metas]
    for r, ranges in enumerate(held):
        for j, a, b in ranges:
            spans[j].append((a, r, b))
    out = []
    for meta, leaf_spans in zip(metas, spans):
        pieces, reach = [], 0
        for a, r, b in sorted(leaf_spans):
            if a > reach:
                raise CheckpointError(f"{where}: leaf {meta.path} (shape {meta.shape}): no rank holds its elements "
                                      f"{reach}:{a} (the ranks' Shards must cover the whole tensor)")
            if b > reach:
                pieces.append((r, reach, b))
                reach = b
        if meta.kind != "plain" and reach < meta.numel:
            raise CheckpointError(f"{where}: leaf {meta.path} (shape {meta.shape}): no rank holds its elements "
                                  f"{reach}:{meta.numel} (the ranks' Shards must cover the whole tensor)")
        out.append(pieces)
    return out


@dataclass
class FileLayout:
    """One rank's data file: its safetensors ``header`` (the bytes before the data), and per
    piece ``(leaf, start, stop, absolute byte offset)`` in file order; ``size``: its length."""

    header: bytes
    pieces: list[tuple[int, int, int, int]]
    size: int


def layout(metas: list[LeafMeta], pieces: list[list[tuple[int, int, int]]], rank: int, save_id: str) -> FileLayout:
    """Rank ``rank``'s data file: its pieces of every leaf, in leaf order (``plan``'s pieces)."""
    mine = [(j, a, b) for j, ps in enumerate(pieces) for r, a, b in ps if r == rank]
    entries: dict[str, Any] = {"__metadata__": {"format": FORMAT, "save_id": save_id, "rank": str(rank)}}
    rel, at = [], 0
    for j, a, b in mine:
        dt = dtype_of(metas[j].dtype)
        nbytes = (b - a) * dt.itemsize
        name = _ST_NAMES.get(dt)
        shape = [b - a] if name is not None else [nbytes]
        entries[f"{metas[j].path}@{a}"] = {"dtype": name or "U8", "shape": shape, "data_offsets": [at, at + nbytes]}
        rel.append(at)
        at += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    header = struct.pack("<Q", len(text)) + text
    return FileLayout(header, [(j, a, b, len(header) + o) for (j, a, b), o in zip(mine, rel)], len(header) + at)


def encode(metas: list[LeafMeta], values: list[Any], world_size: int, save_id: str, files: list[FileLayout],
           crcs: list[list[int]]) -> bytes:
    """The manifest's bytes (``values``: rank 0's leaves, for the plain ones; ``crcs``: per
    rank, its pieces' CRC32s in file order)."""
    per_leaf: list[list[list[int]]] = [[] for _ in metas]
    for r, f in enumerate(files):
        for (j, a, b, offset), crc in zip(f.pieces, crcs[r]):
            per_leaf[j].append([r, offset, a, b, crc])
    leaves = []
    for meta, value, pieces in zip(metas, values, per_leaf):
        if meta.kind == "plain":
            leaves.append({"path": meta.path, "kind": "plain", "type": meta.dtype, "value": value})
        else:
            leaves.append({"path": meta.path, "kind": meta.kind, "shape": list(meta.shape), "dtype": meta.dtype,
                           "pieces": sorted(pieces, key=lambda p: p[2])})
    head = {"format": FORMAT, "version": VERSION, "world_size": world_size, "save_id": save_id,
            "torch": str(torch.__version__),
            "files": [{"name": data_name(save_id, r), "bytes": f.size} for r, f in enumerate(files)],
            "piece": ["file", "offset", "start", "stop", "crc32"]}
    # One line per field and per leaf: readable, and diffable between two saves.
    lines = [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    body = ",\n".join(json.dumps(leaf) for leaf in leaves)
    text = ("{\n" + "\n".join(lines) + '\n"leaves": [\n' + body + "\n]").encode()
    return text + _CRC_FIELD + str(zlib.crc32(text)).encode() + b"}\n"


# --------------------------------------------------------------------------------- loading
class Piece(NamedTuple):
    file: int
    offset: int
    start: int
    stop: int
    crc32: int


@dataclass
class Leaf:
    """One leaf of a manifest (``dtype``/``shape``/``pieces`` for tensors, ``value`` for plain ones)."""

    path: str
    kind: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    pieces: tuple[Piece, ...] = ()
    value: Any = None

    @cached_property
    def starts(self) -> list[int]:
        return [p.start for p in self.pieces]

    def overlapping(self, a: int, b: int) -> list[Piece]:
        """The pieces holding any of elements ``a:b``, in order."""
        i = max(0, bisect_right(self.starts, a) - 1)
        out = []
        for p in self.pieces[i:]:
            if p.start >= b:
                break
            if p.stop > a:
                out.append(p)
        return out


@dataclass
class Manifest:
    world_size: int
    save_id: str
    files: list[tuple[str, int]]  # per rank: (file name, its length in bytes)
    leaves: dict[str, Leaf]        # by path, in tree order


def read(folder: str, who: str) -> Manifest:
    """The manifest of the checkpoint in ``folder``, checked (types, dtypes, each leaf's pieces
    covering its elements once, each inside its file); ``CheckpointError`` naming what is wrong."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        hint = " (a file: one written by fdp.save? read it with fdp.load)" if os.path.isfile(folder) else ""
        raise CheckpointError(f"{who}: no sharded checkpoint at {folder}{hint}")
    try:
        with open(path, "rb") as f:
            data = f.read()
        raw = json.loads(data)
    except FileNotFoundError:
        raise CheckpointError(f"{who}: no sharded checkpoint at {folder}: it has no {MANIFEST} (a save that "
                              "never completed leaves none)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{who}: cannot read {path}: {e}") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"{who}: {path} is not the manifest of a checkpoint written by fdp.save_sharded")
    if raw.get("version") not in (1, VERSION):
        raise CheckpointError(f"{who}: {path} has format version {raw.get('version')!r}; this fdp reads versions 1 "
                              f"to {VERSION}")
    if raw["version"] >= 2:
        at = data.rfind(_CRC_FIELD)
        crc = raw.get("crc32")
        if at < 0 or type(crc) is not int or zlib.crc32(data[:at]) != crc:
            raise CheckpointError(
                f"{who}: {path} is damaged: its bytes do not match the CRC32 it was written with "
                f"({'no crc32 field' if at < 0 or type(crc) is not int else f'{zlib.crc32(data[:at])} != {crc}'}): "
                "it was edited or corrupted after the save")
    try:
        return _parse(raw)
    except _Damaged as e:
        raise CheckpointError(f"{who}: {path} is damaged: {e}") from None


class _Damaged(Exception):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Damaged(what)


def _int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _parse(raw: dict) -> Manifest:
    world, save_id, files = raw.get("world_size"), raw.get("save_id"), raw.get("files")
    _need(_int(world) and world >= 1 and isinstance(save_id, str), "no world size or save id")
    _need(isinstance(files, list) and len(files) == world, f"it lists {len(files) if isinstance(files, list) else 'no'} "
          f"data files for a world of {world}")
    names = []
    for r, f in enumerate(files):
        _need(isinstance(f, dict) and is_data_file(f.get("name", ""), save_id) and _int(f.get("bytes")),
              f"its file entry {r} ({f!r}) is not a data file of save {save_id}")
        names.append((f["name"], f["bytes"]))
    leaves: dict[str, Leaf] = {}
    _need(isinstance(raw.get("leaves"), list), "no leaves")
    for e in raw["leaves"]:
        _need(isinstance(e, dict) and isinstance(e.get("path"), str) and e.get("kind") in KINDS, f"a leaf entry {e!r}")
        p = e["path"]
        _need(p not in leaves, f"leaf {p} appears twice")
        if e["kind"] == "plain":
            _need(e.get("type") in [t.__name__ for t in PLAIN] and type(e.get("value")).__name__ == e["type"],
                  f"leaf {p}: a plain value {e.get('value')!r} of type {e.get('type')!r}")
            leaves[p] = Leaf(p, "plain", value=e["value"])
            continue
        dt, shape, pieces = dtype_of(e.get("dtype")), e.get("shape"), e.get("pieces")
        _need(dt is not None, f"leaf {p}: dtype {e.get('dtype')!r} is not a torch dtype")
        _need(isinstance(shape, list) and all(_int(d) for d in shape), f"leaf {p}: shape {shape!r}")
        _need(isinstance(pieces, list), f"leaf {p}: no pieces")
        numel, reach, out = 1, 0, []
        for d in shape:
            numel *= d
        for q in pieces:
            _need(isinstance(q, list) and len(q) == 5 and all(_int(v) for v in q), f"leaf {p}: piece {q!r}")
            piece = Piece(*q)
            _need(piece.file < world, f"leaf {p}: piece {q} names file {piece.file} of {world}")
            _need(piece.start == reach and piece.start < piece.stop <= numel,
                  f"leaf {p}: piece {q} does not continue at element {reach} of {numel} (pieces must cover the "
                  "leaf once, in order)")
            end = piece.offset + (piece.stop - piece.start) * dt.itemsize
            name, size = names[piece.file]
            _need(end <= size, f"leaf {p}: piece {q} ends at byte {end}, outside {name} ({size} bytes)")
            reach = piece.stop
            out.append(piece)
        _need(reach == numel, f"leaf {p}: its pieces cover {reach} of its {numel} elements")
        leaves[p] = Leaf(p, e["kind"], tuple(shape), dt, tuple(out))
    return Manifest(world, save_id, names, leaves)
