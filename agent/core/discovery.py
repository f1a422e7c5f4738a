"""Which processes get per-process counters: GPU processes, named pids and comms. Reads /proc only.

A GPU process maps an NVIDIA device node or a trusted libcuda, decided by the mapped file's identity,
never by the text of its path: any user can map plain files named ~/dev/nvidia0 or ~/libcuda.so.1 (or
/dev/nvidia0 itself, on a tmpfs in a user and mount namespace of their own), and watching them would
let that user fill the agent's per-process tables. Marked processes are added by the kernel itself
on their first request begin.

- A /proc/PID/maps line is "start-end perms offset dev inode path"; dev (hex major:minor) and inode
  are the mapped file's own, whatever its path says now: the st_dev of the filesystem holding it
  (devtmpfs, or a container's tmpfs, for a /dev node) and its st_ino. The path only says where to
  look; "/dev/nvidia" at its start (DEV_PREFIX) picks the candidates.
- A candidate is lstat'ed as the process sees it, through /proc/PID/root<path> (a container has a /dev
  of its own), and counts only if it is a character device (S_ISCHR) with an NVIDIA major
  (os.major(st_rdev)) and its (st_dev, st_ino) are the line's dev and inode. So a plain file, another
  driver's device, another node at that path and a path swapped since the mapping count for nothing.
  A deleted node is stat'ed through /proc/PID/map_files/<range>, the kernel's link to the mapped file
  (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE; without, it does not count).
- NVIDIA majors (nvidia_majors): 195 (nvidia, nvidiactl, nvidia-modeset: the kernel's
  Documentation/admin-guide/devices.txt, the driver's README) and the majors the kernel allocated to
  character drivers named nvidia* (nvidia-uvm, nvidia-caps, nvidia-nvswitch, nvidia-nvlink...), from
  the "Character devices:" section of /proc/devices, read once a scan round. Only root in the initial
  user namespace can make a device node (mknod of one is refused inside a user namespace).
- A libcuda.so* line counts only if the CUDA finder's trust check passes (cuda/finder.py
  trusted_libcuda over cuda/libtrust.py: a regular file, root's, not writable by group or others,
  reached through /proc/PID/root, still the inode mapped). The core imports no capability: agent.py
  hands that check in as `lib_trusted`; without one, libcuda lines count for nothing.

Why maps and not the fds: the maps read is the one the scan always did (bounded by procscan), a CUDA
process maps libcuda and its device nodes (nvidiactl, nvidia0, nvidia-uvm), and /proc/PID/fd would be
a second listing of up to 1M entries per process. Cost per process: that read, plus at most
MAX_CANDIDATES checks of distinct (dev, inode)s (a device: one lstat; a libcuda: one lstat per path
component), after which it is not a GPU process this round. A positive verdict is kept for the round
by (dev, inode), a negative one never: it may be the path's doing (swapped in its owner's mount
namespace) and must not hide another process that maps the same real node. Limits: /dev/nvidiactl is
usually 0666 and libcuda readable by all, so a user may still open or map the real ones and be
watched; what is refused is files a user made.

The agent never watches itself: its pid and its compile workers not yet reaped 
leave every watch set, named pids and comms included, so its own endpoints are never traced.
process.watch = all is the kernel's (MCP_WATCH_ALL in bpf/common.bpf.c), not this scan's: there the
agent is left out only where the kernel's watched()/watched_bit() leave its tgid out.

Any user's process is read here, so every read is bounded (procscan): the agent runs the scan on a
thread of its own in time-budgeted passes (WatchScan), never on the ring-buffer thread.
"""

from __future__ import annotations

import ctypes
import math
import os
import stat
import threading
from typing import Callable

from . import procscan

NVIDIA_MAJOR = 195  # nvidia0..N, nvidiactl (255), nvidia-modeset (254)
DEV_PREFIX = b"/dev/nvidia"
LIB_NAME = b"libcuda.so"
NEEDLES = (DEV_PREFIX, LIB_NAME)  # the pre-filter of maps lines; never evidence on its own
MAX_CANDIDATES = 16  # distinct (dev, inode)s checked per process per round
VERIFIED_KEPT = 4096  # positive verdicts kept per round
DEVICES_LIMIT = 64 << 10  # bytes of /proc/devices read (~1 KB on a typical host)

# (proc_root, pid, maps line) -> whether it maps a trusted libcuda (cuda/finder.py trusted_libcuda)
LibCheck = Callable[[str, int, str], bool]


def _read(path: str, limit: int = 4096) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:  # process gone or not ours to read: skip it this round
        return b""


def nvidia_majors(proc_root: str = "/proc") -> frozenset[int]:
    """195 and the majors /proc/devices lists for character drivers named nvidia*."""
    majors, chars = {NVIDIA_MAJOR}, False
    for line in _read(f"{proc_root}/devices", DEVICES_LIMIT).splitlines():
        if line.endswith(b":"):  # "Character devices:", "Block devices:"
            chars = line.strip() == b"Character devices:"
            continue
        parts = line.split()
        if chars and len(parts) == 2 and parts[0].isdigit() and parts[1].startswith(b"nvidia"):
            majors.add(int(parts[0]))
    return frozenset(majors)


def own_pids() -> set[int]:
    """This process and its compile workers: never watched. (Not every child: the processes an agent
    run in-process by a test starts are the watched ones.)"""
    return {os.getpid()}


def _fields(line: bytes):
    """(range, (major, minor, inode), path, deleted) of a file mapping's maps line, else None."""
    parts = line.split(None, 5)
    if len(parts) < 6:
        return None
    try:
        major, minor = (int(x, 16) for x in parts[3].split(b":"))
        inode = int(parts[4])
    except ValueError:
        return None
    path = parts[5]
    deleted = path.endswith(b" (deleted)")
    if deleted:
        path = path[: -len(b" (deleted)")]
    return (parts[0], (major, minor, inode), path, deleted) if inode else None


def _nvidia_node(pid: int, proc_root: str, rng: bytes, key: tuple, path: bytes, deleted: bool, majors) -> bool:
    """The mapped file is an NVIDIA character device: the node the process sees at path, still the
    (dev, inode) it maps; a deleted one through map_files."""
    try:
        if deleted:
            st = os.stat(os.fsencode(f"{proc_root}/{pid}/map_files/") + rng)
        else:
            st = os.lstat(os.fsencode(f"{proc_root}/{pid}/root") + path)
    except (OSError, ValueError):  # gone, not ours to see; ValueError: a NUL in a fixture's path
        return False
    return (stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) in majors
            and (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) == key)


def is_gpu_process(pid: int, proc_root: str = "/proc", majors: frozenset[int] | None = None,
                   lib_trusted: LibCheck | None = None, verified: set | None = None) -> bool:
    """Whether the process maps an NVIDIA device node or (with lib_trusted) a trusted libcuda, by the
    mapped file's identity (module docstring). verified: (major, minor, inode)s found so this round."""
    if majors is None:
        majors = nvidia_majors(proc_root)
    if verified is None:
        verified = set()
    tried: set[tuple] = set()
    lines = procscan.maps_lines(pid, NEEDLES, proc_root)
    try:
        for line in lines:
            f = _fields(line)
            if f is None:
                continue
            rng, key, path, deleted = f
            if key in verified:
                return True
            dev = path.startswith(DEV_PREFIX)
            lib = lib_trusted is not None and path.rsplit(b"/", 1)[-1].startswith(LIB_NAME)
            if key in tried or not (dev or lib):
                continue
            if len(tried) >= MAX_CANDIDATES:
                return False
            tried.add(key)
            if (_nvidia_node(pid, proc_root, rng, key, path, deleted, majors) if dev
                    else lib_trusted(proc_root, pid, line.decode(errors="replace"))):
                if len(verified) < VERIFIED_KEPT:
                    verified.add(key)
                return True
    finally:
        lines.close()  # stops the maps read here
    return False


class _Round:
    """What a round of the watch scan reads once: the NVIDIA majors, the agent's own pids, and the
    (dev, inode)s found to be NVIDIA nodes or trusted libcuda files."""

    def __init__(self, proc_root: str):
        self.majors = nvidia_majors(proc_root)
        self.own = own_pids()
        self.verified: set[tuple] = set()


class WatchScan:
    """A watch scan carried across time-budgeted passes: the walker's cursor and this round's finds."""

    def __init__(self, proc_root: str = "/proc", budget_s: float = 0.05, stop: threading.Event | None = None,
                 lib_trusted: LibCheck | None = None):
        self.walker = procscan.Walker(proc_root, budget_s, stop)
        self.lib_trusted = lib_trusted
        self.round: _Round | None = None  # made as a round begins
        self.found: set[int] = set()
        self.result: set[int] = set()  # the last complete round's


def watch_set(proc_root: str = "/proc", pids=(), comms=(), gpu: bool = True, scan: WatchScan | None = None,
              lib_trusted: LibCheck | None = None) -> set[int]:
    """The processes to watch, never the agent's own (own_pids). Without `scan`, one full walk of /proc
    (lib_trusted: as WatchScan's). With it, one budgeted pass of that scan: the set of its last complete
    round, a new object each time a round completes."""
    want_comms = {c.encode() if isinstance(c, str) else c for c in comms}
    if scan is None:
        scan = WatchScan(proc_root, budget_s=math.inf, lib_trusted=lib_trusted)
    if scan.round is None:
        scan.round = _Round(proc_root)
    rnd = scan.round
    if want_comms or gpu:
        def visit(pid: int) -> None:
            if pid in rnd.own:
                return
            if want_comms and _read(f"{proc_root}/{pid}/comm").rstrip(b"\n") in want_comms:
                scan.found.add(pid)
            elif gpu and is_gpu_process(pid, proc_root, rnd.majors, scan.lib_trusted, rnd.verified):
                scan.found.add(pid)

        if not scan.walker.walk(visit):
            return scan.result
    scan.result = (scan.found | {p for p in pids if os.path.isdir(f"{proc_root}/{p}")}) - own_pids()
    scan.found, scan.round = set(), None
    return scan.result


WATCH_SCAN_S = 5.0  # between rounds of the watch scan
# One pass of the watch scan reads /proc for at most this long, then sleeps WATCH_GAP_S: a host whose
# users made /proc/PID/maps huge slows the scan's rounds, not the agent (docs/SECURITY.md, starving).
WATCH_PASS_S = 0.05
WATCH_GAP_S = 0.45  # (<= 10% of a core while a round lasts)


WATCH_BITS_WORDS = 4194304 // 64  # bpf/common.bpf.c MCP_WATCH_BITS_WORDS: tgids up to PID_MAX_LIMIT


def write_bits(bpf, now: set[int], before: set[int]) -> None:
    """The watch set as the kernel's watch_bits bitmap (the HTTP probes' cheap test): the words
    whose pids changed, each rewritten whole from `now`."""
    bits = bpf[b"watch_bits"]
    for word in {p >> 6 for p in now ^ before if p < WATCH_BITS_WORDS * 64}:
        v = 0
        for p in now:
            if p >> 6 == word:
                v |= 1 << (p & 63)
        bits[ctypes.c_uint32(word)] = ctypes.c_uint64(v)


def write_kernel_rules(bpf, cfg) -> None:
    """What the kernel decides alone: never the agent itself (self_tgid), and process.comms for the
    exec check (watch_comms, bpf/requests.bpf.c process_exec). Written right after the load."""
    bpf[b"self_tgid"][ctypes.c_int(0)] = ctypes.c_uint32(os.getpid())
    table = bpf[b"watch_comms"]
    for comm in cfg.process_comms:
        raw = comm.encode() if isinstance(comm, str) else bytes(comm)
        key = table.Key()
        ctypes.memmove(ctypes.addressof(key), raw[:15], min(len(raw), 15))
        table[key] = ctypes.c_uint8(1)


def _parents(proc_root: str) -> dict[int, int]:
    """pid -> ppid of every process (/proc/PID/stat field 4: a fixed-size line no user can inflate)."""
    out = {}
    for pid in procscan.list_pids(proc_root):
        try:
            out[pid] = int(_read(f"{proc_root}/{pid}/stat").rsplit(b")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
    return out


def descendants(roots: set[int], parents: dict[int, int]) -> set[int]:
    """Every process below one of roots (parents: pid -> ppid), the agent itself never among them."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), list(roots)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out and c not in roots:
                out.add(c)
                todo.append(c)
    return out - own_pids()


def seed_trees(bpf, new: set[int], proc_root: str = "/proc") -> None:
    """requests.group = tree: each newly watched process roots a serving tree, unless an ancestor
    already serves in one, and the processes it started before it was watched (a front end's engine,
    started before the first request) join it; those it starts later join in the kernel (watch_fork).
    On the watch thread: one /proc pass of stat lines, only in a round that found new processes."""
    if not new:
        return
    table = bpf[b"tree_root"]
    roots = {k.value: v.value for k, v in table.items()}
    parents = _parents(proc_root)
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    for pid in sorted(new):
        if pid in roots:
            continue
        root, up, seen = pid, parents.get(pid), 0
        while up and seen < 64:  # the nearest ancestor in a tree gives its root
            if up in roots:
                root = roots[up]
                break
            up, seen = parents.get(up), seen + 1
        todo = [pid]
        while todo:
            p = todo.pop()
            if p not in roots:
                table[ctypes.c_uint32(p)] = ctypes.c_uint32(root)
                roots[p] = root
            todo.extend(children.get(p, ()))


class Watcher:
    """Keeps the kernel's watch_tgid map to the watch set: the first round whole at start (the processes
    already running are watched when start returns), the later ones on a thread of its own."""

    def __init__(self, cfg, proc_root: str, bpf_of, survived, lib_trusted: LibCheck | None = None):
        """bpf_of: () -> the BPF object or None once stopping; survived(where, exc): counts a failure;
        lib_trusted: whether a maps line maps a trusted libcuda (cuda/finder.py trusted_libcuda)."""
        self.cfg, self.proc_root, self.lib_trusted = cfg, proc_root, lib_trusted
        self._bpf_of, self._survived = bpf_of, survived
        self._written: set[int] = set()  # pids this watcher put in watch_tgid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.refresh(WatchScan(self.proc_root, budget_s=float("inf"), lib_trusted=self.lib_trusted))
        self._thread = threading.Thread(target=self._loop, name="mcp-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)  # a pass ends within WATCH_PASS_S plus one bounded read

    def _loop(self) -> None:
        scan = WatchScan(self.proc_root, budget_s=WATCH_PASS_S, stop=self._stop, lib_trusted=self.lib_trusted)
        while not self._stop.is_set():
            try:
                done = self.refresh(scan)
            except Exception as e:  # noqa: BLE001 -- the next round tries again
                self._survived("watch_scan", e)
                done = True
            self._stop.wait(WATCH_SCAN_S if done else WATCH_GAP_S)

    def refresh(self, scan: WatchScan) -> bool:
        """One pass of `scan`; when it completes a round, watch_tgid gets that round's set. True then."""
        cfg = self.cfg
        before = scan.result
        want = watch_set(self.proc_root, cfg.process_pids, cfg.process_comms, gpu=cfg.process_watch == "gpu", scan=scan)
        b = self._bpf_of()  # once: stop() may clear it meanwhile
        if want is before or b is None:
            return False
        parents = _parents(self.proc_root)
        want = want | descendants(want, parents)  # as the kernel's watch_fork does for later children
        table = b[b"watch_tgid"]
        follow = set()
        for pid in want:
            try:
                table[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
                follow.add(pid)
            except Exception as e:  # noqa: BLE001 -- watch_tgid full (E2BIG): counted, the rest still go in
                self._survived("watch_map_full", e)
        # A process that exited between the /proc walk and this write got an entry after its exit
        # had cleared it in the kernel: nothing else would remove it. Each refresh removes ours of
        # processes now gone (zombies included) and keeps following the rest.
        for pid in self._written - follow:
            if self._pid_gone(pid):
                table.pop(ctypes.c_uint32(pid), None)
            else:
                follow.add(pid)
        write_bits(b, follow, self._written)
        if getattr(cfg, "requests_group", "cgroup") == "tree":
            seed_trees(b, follow - self._written, self.proc_root)
        self._written = follow
        return True

    def _pid_gone(self, pid: int) -> bool:
        try:
            with open(f"{self.proc_root}/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
        except (OSError, IndexError):
            return True
