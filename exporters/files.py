"""Appending to a file only the agent controls: the JSONL exporter's files (exporters/jsonl.py) and
`mcp-agent run`'s check of them before any probe loads. No OpenTelemetry here: the CLI imports this
on its path to the first attached probe, the exporters themselves later."""

from __future__ import annotations

import errno
import os
import stat


def _makedirs(path: str, mode: int) -> None:
    # os.makedirs applies `mode` to the leaf only (Python >= 3.7); every directory we create gets it.
    if not path or os.path.isdir(path):
        return
    _makedirs(os.path.dirname(path), mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass


class UnsafeFileError(OSError):
    """The JSONL path is not one only the agent controls; str() is one line saying why."""

    def __str__(self) -> str:
        return self.args[0]


# What the agent creates: 0640 (0600 under a stricter umask). More than that for group or others, or
# any special bit, means someone else made the file or can read what goes into it.
_FILE_MODE = 0o640
_FILE_EXTRA = 0o7777 & ~_FILE_MODE & ~0o100


def _check_dirs(path: str, euid: int) -> None:
    """Every directory above path, as written and as resolved, must be root's or ours and not writable
    by group or others unless sticky (/tmp): else its other writers can swap what the path names."""
    seen = set()
    lexical = os.path.dirname(os.path.abspath(path))
    for start in (lexical, os.path.realpath(lexical)):
        d = start
        while True:
            if d not in seen:
                seen.add(d)
                st = os.stat(d)
                if st.st_uid not in (0, euid):
                    raise UnsafeFileError(f"directory {d} is owned by uid {st.st_uid}, who could replace the "
                                          "file; HINT: use a directory of root's")
                if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                    raise UnsafeFileError(f"directory {d} is writable by group or others (mode "
                                          f"{stat.S_IMODE(st.st_mode):04o}) and not sticky; HINT: chmod go-w")
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent


def _check_file(st: os.stat_result, path: str, euid: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{path} is not a regular file")
    if st.st_uid != euid:
        raise UnsafeFileError(f"{path} is owned by uid {st.st_uid}, not the agent's ({euid}); not writing to it")
    if st.st_mode & _FILE_EXTRA:
        raise UnsafeFileError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, more than 0640; HINT: chmod 0640")
    if st.st_nlink != 1:
        raise UnsafeFileError(f"{path} has {st.st_nlink} hard links; not writing through them")


def _open_append(path: str) -> tuple[int, os.stat_result]:
    """An fd to append to path, created 0640 if missing, or UnsafeFileError (OSError for the rest).

    O_NOFOLLOW: a symlink at the path (planted in a directory others can write, such as /tmp) is
    refused, not written through to its target. O_NONBLOCK: a FIFO there cannot block the export
    thread in open(). The checks are of the file opened (fstat), not of the path a moment later."""
    euid = os.geteuid()
    _check_dirs(path, euid)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                     | os.O_NOCTTY | os.O_NONBLOCK, _FILE_MODE)
    except OSError as e:
        # ELOOP, or EACCES from kernels that check a sticky directory's links before O_NOFOLLOW
        if e.errno in (errno.ELOOP, errno.EACCES) and os.path.islink(path):
            raise UnsafeFileError(f"{path} is a symbolic link; not following it") from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader
            raise UnsafeFileError(f"{path} is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        _check_file(st, path, euid)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def metrics_path(path: str | os.PathLike) -> str:
    """Where metrics go beside the spans' file: `telemetry.jsonl` -> `telemetry.metrics.jsonl` (one
    signal per file, so a reader of either needs no filter)."""
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.metrics{ext or '.jsonl'}"


def check_jsonl_path(path: str | os.PathLike) -> None:
    """At start: UnsafeFileError (one line) unless path and its metrics file are safe to append to;
    creates them (0640)."""
    path = os.fspath(path)
    _makedirs(os.path.dirname(path), 0o750)
    for p in (path, metrics_path(path)):
        fd, _ = _open_append(p)
        os.close(fd)
