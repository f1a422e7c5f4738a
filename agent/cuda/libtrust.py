"""Which libcuda files the agent follows: only those no unprivileged user can have made or changed.

Any local user can map a file named libcuda.so from a directory of their own, so a path in
/proc/PID/maps says nothing about who wrote the file. The agent never loads or runs a library it
found in another process; it only reads symbols from it and attaches uprobes to it. Even that is
refused unless the file is root's and not writable by group or others, and every directory from
the process's root down to it is root's and not writable by others (sticky, world-writable
directories like /tmp excepted: there no other user can rename root's entries, as openssh's
secure_filename and sudo allow). So a refused file costs the agent one lstat per path component,
once per (device, inode), and nothing else.
"""

from __future__ import annotations

import os
import stat

TRUSTED_UID = 0


class Untrusted(Exception):
    """Why a library is refused: one line, no file contents."""


def check_file(st: os.stat_result, shown: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise Untrusted(f"{shown}: not a regular file")
    if st.st_uid != TRUSTED_UID:
        raise Untrusted(f"{shown}: owned by uid {st.st_uid}, not root")
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != 0):
        raise Untrusted(f"{shown}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def check_dir(st: os.stat_result, shown: str) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{shown}: not a directory")
    if st.st_uid != TRUSTED_UID:
        raise Untrusted(f"{shown}: directory owned by uid {st.st_uid}, not root")
    writable = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != 0)
    if writable and not st.st_mode & stat.S_ISVTX:
        raise Untrusted(f"{shown}: directory writable by others (mode {stat.S_IMODE(st.st_mode):04o})")


def check_path(root: str, path: str, dev: tuple[int, int], inode: int) -> None:
    """path (absolute, as /proc/PID/maps shows it: the kernel's d_path, no symlinks) under root (``/``
    or /proc/PID/root): every component lstat'ed, none a symlink, each directory and the file root's
    and not writable by others, and the file the (device, inode) the process maps. Raises Untrusted."""
    if not path.startswith("/"):
        raise Untrusted(f"{path!r}: not an absolute path")
    parts = [p for p in path.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise Untrusted(f"{path!r}: not a canonical path")
    cur = root.rstrip("/") or "/"
    try:
        # stat, not lstat: /proc/PID/root is a magic link to the process's root directory (a container's)
        check_dir(os.stat(cur), "/")
        for i, name in enumerate(parts):
            cur = os.path.join(cur, name)
            shown = "/" + "/".join(parts[: i + 1])
            st = os.lstat(cur)
            if stat.S_ISLNK(st.st_mode):
                raise Untrusted(f"{shown}: a symbolic link")
            if i < len(parts) - 1:
                check_dir(st, shown)
            else:
                check_file(st, shown)
                if st.st_ino != inode or (os.major(st.st_dev), os.minor(st.st_dev)) != dev:
                    raise Untrusted(f"{shown}: not the file the process maps (replaced since)")
    except OSError as e:
        raise Untrusted(f"{path}: {e.strerror}") from None


def check_open_file(path: str, shown: str, dev: tuple[int, int], inode: int) -> None:
    """A mapped file reached only through /proc/PID/map_files (deleted, or another inode behind
    overlayfs): no directory to check, so the file alone: root's, not writable by others. A user
    cannot make a root-owned file, and a hard link to one needs fs.protected_hardlinks off."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise Untrusted(f"{shown}: {e.strerror}") from None
    check_file(st, shown)
    if st.st_ino != inode or (os.major(st.st_dev), os.minor(st.st_dev)) != dev:
        raise Untrusted(f"{shown}: not the file the process maps")
