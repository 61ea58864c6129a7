"""Files that are whole or absent: the one atomic write every component uses; and the
one bounded read of a small file a user names (`read_regular_file`).

A reader (a resuming worker, the launcher averaging the saved models, a benchmark waiting
for a peer's address) must never find half a file under a final name, whenever the
writer dies. `write_atomically` writes a hidden partial file next to the final one,
flushes and fsyncs it, renames it over the final name (os.replace: atomic on POSIX, the
two names being in one directory) and fsyncs the directory, so that the rename itself
survives a crash of the machine.

Shared plumbing on the ground floor: the worker, the coordinator, the CLI and the
benchmarks import it, so it imports no other Ripples module and no torch. A caller that
saves tensors passes a writer: `write_atomically(path, lambda f: torch.save(state, f))`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def partial_path(path: Path) -> Path:
    """Where `write_atomically` writes `path`'s content before the rename: beside it,
    hidden (a leading dot, so listings of final names skip it) and named after it, so
    that writers of different files in one directory never share a partial file. One
    writer per final name at a time: every caller writes a file of its own (per rank,
    per step). A partial file a killed writer left is overwritten by the next write of
    the same name (`NumberedFiles.drop_partials` in worker/checkpoint.py removes them)."""
    return path.with_name(f".{path.name}.partial")


def write_atomically(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write `data` under `path`, whole or not at all, and durably.

    Creates `path`'s directory if needed. If writing fails (the writer raises, the disk
    is full), the partial file is removed and `path` keeps what it held before (nothing,
    or the previous complete file).

    Args:
        path: The final name.
        data: The file's bytes, or a callable that writes them into the open binary
            file it is given (e.g. `lambda f: torch.save(state, f)`).

    Raises:
        OSError: the file or its directory could not be written; whatever the writer
            callable raised.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        with open(partial, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
              (stat.S_ISSOCK, "a socket"))
"""What a path that is no regular file is, for the refusal."""


def read_regular_file(path: str | os.PathLike[str], limit: int, *, what: str) -> bytes:
    """The bytes of a small regular file, read without ever blocking: the one bounded read
    of a file a user names (token, certificate and key files, topology files, config
    files).

    The file is opened non-blocking (opening a FIFO would otherwise wait for a writer)
    and refused unless it is a regular file (a FIFO, a device or a directory could block
    the read or never end) of at most `limit` bytes; the read stops there too (a file
    that grows meanwhile, or one whose size the system does not report, as /proc's).

    Args:
        path: the file.
        limit: the most bytes accepted.
        what: what the file is, for the error ("topology file").

    Raises:
        ValueError: one line naming `what` and `path` and what to fix.
    """
    def refuse_unless_regular(mode: int) -> None:
        for test, kind in FILE_KINDS:
            if test(mode):
                raise ValueError(f"the {what} {path} is {kind}, not a regular file: give a "
                                 "regular file")

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise ValueError(f"cannot read the {what} {path}: {err.strerror}") from None
    try:
        refuse_unless_regular(os.fstat(fd).st_mode)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise ValueError(f"cannot read the {what} {path}: {err.strerror}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ValueError(f"the {what} {path} is over {limit:,} bytes: is it the right file?")
    return b"".join(chunks)
