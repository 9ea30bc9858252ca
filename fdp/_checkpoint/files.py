"""Writing checkpoint files so that they survive a crash: atomic replacement, fsync, and the
errors of a full disk.

A file that must appear whole or not at all (``fdp.save``'s checkpoint, a sharded
checkpoint's manifest) is written to a temporary file in the same folder, flushed and
fsynced, ``os.replace``-d onto its name, and the folder is fsynced so that the rename
survives a power loss. A writer killed before the rename leaves a temporary file
``.<name>.<12 hex digits>.tmp``, which the next write of that name removes.

A failed write names its cause: torch.save's zip writer, for one, turns a failed write into
"enforce fail at inline_container.cc ... unexpected pos" (torch 2.13), which hides a full
disk; ``Sink`` keeps the OSError and ``explain`` words it with the space needed and left.
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["Sink", "explain", "fsync_folder", "remove_quietly", "write_atomically"]


class Sink:
    """A file to write to, remembering the first OSError of a write (see the module docstring)."""

    def __init__(self, f: Any):
        self.f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


# What a writer cannot say by itself: the file system refused the bytes.
SPACE = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
         errno.EFBIG: "the file-size limit is reached (ulimit -f, or the file system's)"}


def write_atomically(path: str, write: Callable[[Sink], None], need: Callable[[], int]) -> None:
    """Write ``path`` whole or not at all: ``write(sink)`` fills a temporary file beside it,
    which then replaces ``path``. ``need()``: the bytes the file takes, for the message of a
    full disk. On any failure the temporary file is removed and ``path`` is untouched."""
    folder = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    _remove_orphans(folder, name)
    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    sink = None
    try:
        # os.open honours the umask (tempfile.mkstemp would force mode 0600).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            sink = Sink(f)
            write(sink)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        remove_quietly(tmp)
        worded = explain(e, sink, tmp, need, "the previous checkpoint, if any, is untouched")
        if worded is not None:
            raise worded from e
        raise
    fsync_folder(folder)


def explain(e: BaseException, sink: Sink | None, where: str, need: Callable[[], int], after: str) -> OSError | None:
    """An OSError that says why writing ``where`` failed when the disk is full (or a quota or
    size limit is reached): the space ``need()`` asks for and the space left. None for any
    other failure."""
    cause = _os_error(e, sink)
    if cause is None or cause.errno not in SPACE:
        return None
    folder = os.path.dirname(os.path.abspath(where))
    return OSError(cause.errno, f"{SPACE[cause.errno]}: {os.strerror(cause.errno)} while writing {where}; "
                   f"the checkpoint needs about {_mib(need())} and {_free(folder)} ({after})")


def _os_error(e: BaseException, sink: Sink | None) -> OSError | None:
    """The OSError behind a failed write: the exception's context chain or the sink's record."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return sink.error if sink is not None else None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _free(folder: str) -> str:
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # no statvfs on Windows
        return "the free space is unknown"
    return f"{_mib(st.f_bavail * st.f_frsize)} is free there"


def _remove_orphans(folder: str, name: str) -> None:
    """Remove temporary files of earlier writes of ``name`` whose writer was killed."""
    pattern = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{12}}\.tmp")
    for entry in os.listdir(folder):
        if pattern.fullmatch(entry):
            remove_quietly(os.path.join(folder, entry))


def remove_quietly(path: str) -> None:
    """Remove ``path`` if it is there (another cleaner may have got there first)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_folder(folder: str) -> None:
    """Make the folder's entries (a new or renamed file) survive a power loss."""
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
