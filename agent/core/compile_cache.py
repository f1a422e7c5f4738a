"""The compiled unit kept on disk: a later start with the same unit, flags, bcc, kernel, header tree
and tracepoint formats makes the maps from their description (core/mapset.py) and loads the kept
programs instead of running LLVM (core/loader.py).

An entry is the unit's programs' instructions, naming the compiling process's map fds by table name
(rewritten to the new maps at each load: loader._rebind_maps, so it holds no fd or address of the
process that compiled it), and the maps' description. The kernel's verifier checks every program at
load as for a fresh compile. The key covers what a compile reads: the unit's text and flags, bcc's
version and library, the kernel release and build, the header tree bcc uses (its generated config's
size and mtime), the headers the unit includes, the format of each tracepoint it attaches to (bcc
builds TRACEPOINT_PROBE's args struct from it), the maps' description format and the possible CPUs.
Anything else that changed is caught where it matters: a program that no longer loads drops the
entry, and the unit compiles again.

Who can write here can choose the BPF programs a root agent loads: the directory must be a real
directory owned by this uid and writable by no one else, every directory above it changeable by
root or this uid alone (or sticky), entries regular files of this uid; otherwise the cache is not
used and the start-up banner says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import time

from .kernel import DEBUGFS, TRACEFS

ENV = "MCP_HOSTAGENT_COMPILE_CACHE"  # a directory, or "off"
DEFAULT_DIR = "/var/cache/mcp-hostagent/bpf"
MAX_ENTRIES = 8  # units kept (settings, kernels, versions); older ones dropped
TRACEFS_ROOTS = (TRACEFS, f"{DEBUGFS}/tracing")  # where bcc reads formats


class CacheError(Exception):
    """The cache cannot be used (unsafe or unusable directory): said once in the banner."""


def directory() -> str | None:
    d = os.environ.get(ENV, DEFAULT_DIR)
    return None if d in ("", "off", "0") else d


def _safe_dir(path: str, create: bool) -> None:
    """path, and every directory above it, can be changed by this uid or root alone: otherwise
    someone could swap a directory on the way between this check and an open (a sticky directory
    such as /tmp is fine above one of ours: others cannot rename or remove what is in it)."""
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise CacheError(f"{path}: {e.strerror}") from None
    path = os.path.abspath(path)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise CacheError(f"{path}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{path}: not a directory (a symlink is refused)")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise CacheError(f"{path}: must be owned by uid {os.geteuid()} and writable by no one else "
                         f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
    up = os.path.dirname(path)
    while True:
        try:
            st = os.stat(up)
        except OSError as e:
            raise CacheError(f"{up}: {e.strerror}") from None
        if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise CacheError(f"{up}: a directory above the cache that others can change "
                             f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
        if up == os.path.dirname(up):
            return
        up = os.path.dirname(up)


def _stat_id(path: str) -> list:
    try:
        st = os.stat(path)
        return [os.path.realpath(path), st.st_size, st.st_mtime_ns]
    except OSError:
        return [path, None]


def _format(tracepoint: str) -> str | None:
    cat, _, ev = tracepoint.partition(":")
    for root in TRACEFS_ROOTS:
        try:
            with open(os.path.join(root, "events", cat, ev, "format")) as f:
                return f.read()
        except OSError:
            continue
    return None


def _headers(cflags: list[str]) -> dict[str, str]:
    """Each header in the -I directories (bpf/: mcp_records.h): the unit includes them."""
    out = {}
    for f in cflags:
        if f.startswith("-I"):
            d = f[2:]
            for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
                if name.endswith(".h"):
                    with open(os.path.join(d, name), "rb") as fh:
                        out[os.path.join(d, name)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def key(text: str, cflags: list[str], tracepoints: list[str], extra: dict | None = None) -> str:
    """The hex digest naming a part's reply: everything its compile reads (the module docstring),
    and extra (the maps' description: its format and the possible CPUs). OSError: a file it must
    read cannot be."""
    import bcc

    uname = os.uname()
    tree = os.environ.get("BCC_KERNEL_SOURCE") or f"/lib/modules/{uname.release}/build"
    ident = {
        "text": hashlib.sha256(text.encode()).hexdigest(),
        "included": _headers(cflags),
        "cflags": list(cflags),
        "bcc": [getattr(bcc, "__version__", "?"), _stat_id(_libbcc_path())],
        "kernel": [uname.release, uname.version, uname.machine, sys.byteorder],
        "headers": [_stat_id(tree), _stat_id(os.path.join(tree, "include", "generated", "autoconf.h"))],
        "formats": {tp: _format(tp) for tp in sorted(set(tracepoints))},
        **({"extra": extra} if extra else {}),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _libbcc_path() -> str:
    """libbcc's file as loaded (ctypes names it by soname only)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                x = line.split()
                if len(x) >= 6 and os.path.basename(x[5]).startswith("libbcc.so"):
                    return x[5]
    except OSError:
        pass
    return "libbcc.so.0"


def get(path: str, k: str) -> dict | None:
    """The reply stored under k, or None (none, or not ours: an unsafe entry is removed)."""
    if not os.path.lexists(path):
        return None
    _safe_dir(path, create=False)
    f = os.path.join(path, k + ".json")
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO would block the start
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CacheError(f"{f}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise CacheError(f"{f}: not a regular file of uid {os.geteuid()} writable by it alone")
        try:
            entry = json.loads(fh.read())
        except (ValueError, OSError):
            entry = None
    if not isinstance(entry, dict) or entry.get("key") != k or not isinstance(entry.get("reply"), dict):
        drop(path, k)
        return None
    return entry["reply"]


def put(path: str, k: str, reply: dict) -> None:
    """Store reply under k (written to a new file, then renamed over), keeping MAX_ENTRIES."""
    _safe_dir(path, create=True)
    tmp = os.path.join(path, f".{k}.{os.getpid()}.{os.urandom(4).hex()}.tmp")  # pids repeat across namespaces
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise CacheError(f"{path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": k, "reply": reply}, fh)
        os.rename(tmp, os.path.join(path, k + ".json"))
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CacheError(f"{path}: {e.strerror}") from None
    _trim(path)


def _trim(path: str) -> None:
    """Keep the MAX_ENTRIES newest entries; temporary files an agent killed mid-write left, after an hour."""
    try:
        names = os.listdir(path)
    except OSError:  # stored; the trim waits for the next put
        return
    entries, old = [], []
    for name in names:
        try:
            st = os.lstat(os.path.join(path, name))
        except OSError:
            continue
        if name.endswith(".json"):
            entries.append((st.st_mtime_ns, name))
        elif name.endswith(".tmp") and st.st_mtime_ns < (time.time() - 3600) * 1e9:
            old.append(name)
    for name in [n for _, n in sorted(entries)[:-MAX_ENTRIES]] + old:
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass


def drop(path: str, k: str) -> None:
    try:
        os.unlink(os.path.join(path, k + ".json"))
    except OSError:
        pass
