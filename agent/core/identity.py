"""Who is who: pid -> process, cgroup, container and pod identity for every span and metric.

Sources: /proc (through psutil, whose /proc root is overridable) and cgroupfs; no BPF here. The one
kernel fact it leans on: bpf_get_current_cgroup_id() returns the kernfs node id of the task's cgroup v2
directory, which on 64-bit kernels is that directory's inode number, so a walk of the cgroup2 mount maps
ids to paths. OS races (a process gone, a cgroup removed mid-walk) end here as None or a minimal record.
Not thread-safe: the agent's thread owns a resolver and a registry.
"""

from __future__ import annotations

import os
import posixpath
import re
import threading
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Callable

import psutil

from ..redact import command_line as _command_line

# --- hostile text ------------------------------------------------------------------------------

# Escaped, by Unicode general category: Cc (C0, DEL, C1), Cf (format: bidi embeddings, overrides,
# isolates and marks such as U+202E, zero-width U+200B..U+200F, U+2060.., U+FEFF, tags: they can make a
# terminal or a trace UI show text other than the bytes, or two different names look the same), Zl and
# Zp (U+2028, U+2029), and Cs (lone surrogates: psutil decodes /proc with surrogateescape, and a
# surrogate would make the OTLP encoder raise). One rule for every name that leaves the agent (span
# resources, metric labels, events, `top`): top/text.py escapes only what a terminal adds (Cn, Co).
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_MARKER = "…"


def escaped(ch: str) -> bool:
    return unicodedata.category(ch) in ESCAPED_CATEGORIES


def escape_char(ch: str) -> str:
    cp = ord(ch)
    if 0xDC80 <= cp <= 0xDCFF:  # a raw byte carried by surrogateescape: show the byte
        cp -= 0xDC00
    return f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def sanitize_text(value: bytes | str, max_len: int = 256) -> str:
    """Printable, bounded text: control, format (bidi, zero-width) and line/paragraph separator
    characters (ESCAPED_CATEGORIES) as \\xNN / \\uNNNN / \\UNNNNNNNN, at most max_len chars, ending in
    "…" when cut. Invalid UTF-8 bytes come out as \\xNN, as errors="backslashreplace" would write
    them; decoding through surrogateescape instead keeps an escape from being cut in half."""
    if max_len <= 0:
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        # A character takes at most 4 bytes, so this prefix still decodes to more than max_len chars.
        value = bytes(value[: 4 * (max_len + 1)]).decode("utf-8", "surrogateescape")
    text = value[: max_len + 1]
    # isprintable() is False for every escaped category (and for a few kept: Zs but SP, Co, Cn)
    out_text = text if text.isprintable() else "".join(escape_char(c) if escaped(c) else c for c in text)
    if len(out_text) <= max_len:
        return out_text
    out, used = [], 0
    for ch in text:
        piece = escape_char(ch) if escaped(ch) else ch
        if used + len(piece) >= max_len:
            break
        out.append(piece)
        used += len(piece)
    return "".join(out) + _MARKER


# --- /proc/PID/cgroup and container ids ----------------------------------------------------------


@dataclass(frozen=True)
class CgroupInfo:
    """One /proc/PID/cgroup: the v2 path ("0::") and each v1 controller's path."""

    v2_path: str | None = None
    v1_paths: dict[str, str] = field(default_factory=dict)
    # read from an exiting task (PF_EXITING): its v1 lines then say "/" whatever its cgroup was
    # (kernel/cgroup/cgroup.c proc_cgroup_show(): "on traditional hierarchies, all zombie tasks show
    # up as belonging to the root cgroup"); the v2 line stays true
    exiting: bool = False

    def paths(self) -> list[str]:
        """Distinct paths in the order container detection tries them: v2, v1 memory, cpu, the rest."""
        order = [self.v2_path, self.v1_paths.get("memory"), self.v1_paths.get("cpu"), *self.v1_paths.values()]
        return list(dict.fromkeys(p for p in order if p))

    @property
    def primary_path(self) -> str | None:
        """The path that says most: the first non-root one (on hybrid hosts v2 is often "/")."""
        paths = self.paths()
        return next((p for p in paths if p != "/"), paths[0] if paths else None)


def parse_proc_cgroup(text: str) -> CgroupInfo:
    """Parse "hierarchy-id:controllers:path" lines; malformed lines are skipped."""
    v2_path, v1_paths = None, {}
    for line in text.splitlines():
        hierarchy, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2 and hierarchy.isdigit() and path.startswith("/")):
            continue
        if hierarchy == "0" and not controllers:
            v2_path = path
        else:
            for controller in filter(None, controllers.split(",")):
                v1_paths[controller] = path
    return CgroupInfo(v2_path, v1_paths)


@dataclass(frozen=True)
class ContainerRef:
    container_id: str | None  # None: the pod is known, the container is not (e.g. CRI-O's conmon)
    runtime: str  # docker | containerd | cri-o | podman | unknown
    pod_uid: str | None = None


# "crio-conmon-<id>.scope" holds CRI-O's monitor, not the container: "conmon-..." is not 64 hex, so
# it does not match. The cgroupfs driver names a container by its bare id, whatever the runtime.
_SCOPE = re.compile(r"(docker|cri-containerd|crio|libpod|nerdctl)-([0-9a-f]{64})(?:\.scope)?")
_RUNTIMES = {
    "docker": "docker", "cri-containerd": "containerd", "nerdctl": "containerd", "crio": "cri-o", "libpod": "podman",
}
_BARE_ID = re.compile(r"[0-9a-f]{64}")
_POD_SYSTEMD = re.compile(r"kubepods(?:-[a-z]+)?-pod([0-9a-f_]+)\.slice")  # uid dashes become "_"
_POD_CGROUPFS = re.compile(r"pod([0-9a-f][0-9a-f-]+)")


def container_from_cgroup_path(path: str) -> ContainerRef | None:
    """Container and pod named by one cgroup path, or None for a host cgroup (a systemd service).

    The innermost match wins (kind, docker-in-docker), and a container counts only below its pod, so a
    kind node's own container is not reported as the container of the pod that runs inside it."""
    container_id = runtime = pod_uid = None
    in_kubepods, parent = False, ""
    for seg in path.split("/"):
        m = _POD_SYSTEMD.fullmatch(seg) or (in_kubepods and _POD_CGROUPFS.fullmatch(seg))
        if m:
            pod_uid, container_id, runtime = m[1].replace("_", "-"), None, None
        elif m := _SCOPE.fullmatch(seg):
            container_id, runtime = m[2], _RUNTIMES[m[1]]
        elif _BARE_ID.fullmatch(seg):
            container_id, runtime = seg, "docker" if parent == "docker" else "unknown"
        in_kubepods = in_kubepods or seg.startswith("kubepods")
        parent = seg
    if container_id is None and pod_uid is None:
        return None
    return ContainerRef(container_id, runtime or "unknown", pod_uid)


def container_from_cgroup(info: CgroupInfo) -> ContainerRef | None:
    """First container found along info.paths(): v2 first, then v1 memory, cpu, any."""
    return next(filter(None, map(container_from_cgroup_path, info.paths())), None)


# --- cgroup id -> path ---------------------------------------------------------------------------

_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, backslash as \ooo


def _unescape(field_text: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), field_text)


def cgroup2_mounts(mountinfo: str) -> list[tuple[str, str]]:
    """(mount point, root inside the hierarchy) of each cgroup2 mount in a /proc/PID/mountinfo."""
    found = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and len(fields) >= 5 and right.split()[:1] == ["cgroup2"]:
            found.append((_unescape(fields[4]), _unescape(fields[3])))
    return found


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


PF_EXITING = 0x4  # include/linux/sched.h: set at the start of do_exit()


class CgroupResolver:
    """cgroup v2 id (what bpf_get_current_cgroup_id() returns) -> cgroup path; pid -> CgroupInfo.

    Paths read like /proc/PID/cgroup's "0::" line. A miss re-walks the hierarchy, at most once per
    min_rescan_interval_s, so a flood of ids of dead cgroups cannot turn into a flood of walks."""

    def __init__(
        self,
        cgroup_root: str = "/sys/fs/cgroup",
        proc_root: str = "/proc",
        *,
        min_rescan_interval_s: float = 5.0,
        max_dirs: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._cgroup_root = cgroup_root
        self._proc_root = proc_root
        self._min_rescan_s = min_rescan_interval_s
        self._max_dirs = max_dirs
        self._clock = clock
        self._paths: dict[int, str] = {}
        self._walked_at: float | None = None

    def path_for_id(self, cgroup_id: int) -> str | None:
        path = self._paths.get(cgroup_id)
        if path is None and (self._walked_at is None or self._clock() - self._walked_at >= self._min_rescan_s):
            self._paths = self._walk()
            self._walked_at = self._clock()
            path = self._paths.get(cgroup_id)
        return path

    def for_pid(self, pid: int) -> CgroupInfo | None:
        try:
            with open(f"{self._proc_root}/{pid}/cgroup", encoding="utf-8", errors="surrogateescape") as f:
                info = parse_proc_cgroup(f.read())
        except OSError:  # ENOENT or ESRCH: the process is gone
            return None
        try:
            with open(f"{self._proc_root}/{pid}/stat", "rb") as f:
                flags = int(f.read().rsplit(b")", 1)[1].split()[6])  # field 9
        except (OSError, ValueError, IndexError):  # gone since: it may have been exiting at the read above
            flags = PF_EXITING
        return replace(info, exiting=True) if flags & PF_EXITING else info

    def v2_dir(self, path: str) -> str | None:
        """Directory of a cgroup v2 path (as /proc/PID/cgroup shows it) under the cgroup2 mount."""
        mount = self._mount()
        if mount is None:
            return None
        top, root = mount
        rel = posixpath.relpath(path, root) if _is_under(path, root) else None
        return None if rel is None else posixpath.normpath(posixpath.join(top, rel))

    def _mount(self) -> tuple[str, str] | None:
        try:
            with open(f"{self._proc_root}/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                mounts = cgroup2_mounts(f.read())
        except OSError:
            mounts = []
        # Hybrid hosts mount cgroup2 at <root>/unified, v2-only hosts at <root>; a bind mount of a
        # subtree (root != "/") sees less, so the mount with the shortest root goes first.
        mounts = [m for m in mounts if _is_under(m[0], self._cgroup_root)] or mounts
        if mounts:
            return min(mounts, key=lambda m: (len(m[1]), len(m[0])))
        for top in (self._cgroup_root, posixpath.join(self._cgroup_root, "unified")):
            if os.path.exists(posixpath.join(top, "cgroup.controllers")):  # only cgroup2 has this file
                return top, "/"
        return None

    def _walk(self) -> dict[int, str]:
        mount = self._mount()
        if mount is None:
            return {}
        top, root = mount
        try:
            found = {os.stat(top).st_ino: posixpath.normpath(root)}
        except OSError:
            return {}
        stack = [(top, posixpath.normpath(root))]
        while stack and len(found) < self._max_dirs:
            dirpath, cgpath = stack.pop()
            try:
                with os.scandir(dirpath) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False) and len(found) < self._max_dirs:
                            child = posixpath.join(cgpath, entry.name)
                            found[entry.inode()] = child  # readdir's d_ino: kernfs gives the node id
                            stack.append((entry.path, child))
            except OSError:  # the cgroup was removed while we walked
                continue
        return found


# --- processes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    start_time_ns: int  # wall clock; 0 when unknown (the process was gone before we looked)
    comm: str
    exe_name: str | None = None
    command_line: str | None = None
    owner: str | None = None  # user name, or the uid as a string when it has no name
    cgroup_path: str | None = None
    container_id: str | None = None
    pod_uid: str | None = None
    container_runtime: str | None = None
    cgroup: CgroupInfo | None = None  # as read when described (a live process's, unless it was exiting)


_PSUTIL_ROOT_LOCK = threading.Lock()


def _start_time_ns(proc: psutil.Process) -> int:
    # create_time() is btime + starttime ticks / CLK_TCK as a float; a tick is 10 ms, so rounding to
    # the millisecond is exact and keeps the (pid, start) key stable from one read to the next.
    return round(proc.create_time() * 1000) * 1_000_000


def _open_process(pid: int, proc_root: str) -> tuple[psutil.Process, int]:
    if proc_root == psutil.PROCFS_PATH:
        proc = psutil.Process(pid)
        return proc, _start_time_ns(proc)
    # psutil takes its /proc root from a module global: a Process captures it when built, but
    # create_time() reads btime from {root}/stat when called, so both happen under the swap.
    with _PSUTIL_ROOT_LOCK:
        saved, psutil.PROCFS_PATH = psutil.PROCFS_PATH, proc_root
        try:
            proc = psutil.Process(pid)
            return proc, _start_time_ns(proc)
        finally:
            psutil.PROCFS_PATH = saved


def _unless_denied(getter: Callable[[], object]):
    try:
        return getter()
    except psutil.AccessDenied:  # an unprivileged agent still gets the rest
        return None


def _iso8601(ns: int) -> str:
    secs, rest = divmod(ns, 1_000_000_000)
    stamp = datetime.fromtimestamp(secs, timezone.utc).replace(microsecond=rest // 1000)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class ProcessRegistry:
    """pid -> ProcessInfo, cached per (pid, start time) so a reused pid never gets the old record."""

    def __init__(self, proc_root: str = "/proc", resolver: CgroupResolver | None = None, max_entries: int = 8192,
                 command_line: str = "redacted"):
        self._proc_root = proc_root
        # the process.command_line setting: argv is where credentials get passed (redact.redact_argv)
        self.command_line_mode = command_line
        self._resolver = resolver or CgroupResolver(proc_root=proc_root)
        self.cgroups = self._resolver
        self._max_entries = max_entries
        self._cache: OrderedDict[int, ProcessInfo] = OrderedDict()

    def lookup(self, pid: int, comm_hint: bytes | str | None = None) -> ProcessInfo:
        try:
            proc, start_ns = _open_process(pid, self._proc_root)
            cached = self._cache.get(pid)
            # exec keeps the pid and start time but changes comm and args; and for a moment inside
            # exec (after the new mm is in place, before create_elf_tables() sets arg_start) the
            # cmdline reads empty: a record without one is looked at again rather than trusted
            if (cached is not None and cached.start_time_ns == start_ns
                    and (cached.command_line is not None or self.command_line_mode == "off")
                    and cached.comm == sanitize_text(proc.name())):
                self._cache.move_to_end(pid)
                return cached
            info = self._describe(proc, start_ns)
        except (psutil.Error, OSError):  # NoSuchProcess, ZombieProcess, AccessDenied, raw ENOENT/ESRCH
            if isinstance(comm_hint, bytes):  # BPF's comm is a NUL-padded char[16]
                comm_hint = comm_hint.split(b"\0", 1)[0]
            comm = sanitize_text(comm_hint or "")
            return ProcessInfo(pid, 0, comm, exe_name=comm or None)
        self._cache[pid] = info
        self._cache.move_to_end(pid)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
        return info

    def forget(self, pid: int) -> None:
        self._cache.pop(pid, None)

    def cached(self, pid: int) -> ProcessInfo | None:
        """The description kept for pid, if any (no /proc read: the process may be gone)."""
        return self._cache.get(pid)

    def _describe(self, proc: psutil.Process, start_ns: int) -> ProcessInfo:
        with proc.oneshot():
            comm = sanitize_text(proc.name())
            exe = _unless_denied(proc.exe)
            args = _unless_denied(proc.cmdline)
            owner = _unless_denied(proc.username)
        cgroup = self._resolver.for_pid(proc.pid)
        container = container_from_cgroup(cgroup) if cgroup else None
        cgroup_path = cgroup.primary_path if cgroup else None
        return ProcessInfo(
            pid=proc.pid,
            start_time_ns=start_ns,
            comm=comm,
            exe_name=sanitize_text(posixpath.basename(exe)) if exe else comm or None,
            command_line=sanitize_text(_command_line(args, self.command_line_mode) or "", 1024) or None,
            owner=sanitize_text(owner) if owner else None,
            cgroup_path=sanitize_text(cgroup_path, 1024) if cgroup_path else None,
            container_id=container.container_id if container else None,
            pod_uid=container.pod_uid if container else None,
            container_runtime=container.runtime if container else None,
            cgroup=cgroup,
        )

    @staticmethod
    def attributes(info: ProcessInfo) -> dict[str, str | int]:
        """OpenTelemetry semantic-convention attributes (plus hostagent.cgroup.path); unknowns are left out."""
        attrs = {
            "process.pid": info.pid,
            "process.executable.name": info.exe_name,
            "process.command_line": info.command_line,
            "process.owner": info.owner,
            "process.creation.time": _iso8601(info.start_time_ns) if info.start_time_ns else None,
            "container.id": info.container_id,
            "k8s.pod.uid": info.pod_uid,
            "container.runtime": info.container_runtime if info.container_runtime != "unknown" else None,
            "hostagent.cgroup.path": info.cgroup_path,
        }
        return {k: v for k, v in attrs.items() if v is not None and v != ""}
