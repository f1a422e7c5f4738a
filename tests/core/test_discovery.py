"""core/discovery.py: a GPU process is found by the identity of the file it maps (an NVIDIA character
device, a trusted libcuda), never by the text of a path in /proc/PID/maps; the agent never watches
itself. Fixture /proc trees hold real device nodes (os.mknod, as root); the attacker is a real process
of user nobody."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcp_hostagent.core import discovery, procscan
from mcp_hostagent.cuda.finder import trusted_libcuda

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, setuid)")

UVM_MAJOR = 240  # a dynamically allocated major, as /proc/devices lists nvidia-uvm's
BLOCK_MAJOR = 241  # named nvidia*, but a block driver's
DEVICES = (f"Character devices:\n  1 mem\n  4 /dev/vc/0\n{UVM_MAJOR} nvidia-uvm\n 10 misc\n"
           f"\nBlock devices:\n  8 sd\n{BLOCK_MAJOR} nvidia-blk\n")
PID0 = 4_100_000  # fixture pids: no real process's (own_pids() reads the real /proc)


def line(path: str, st: os.stat_result | None = None, rng: str = "7f0000000000-7f0000001000") -> str:
    """A maps line as the kernel writes it: dev (hex major:minor) and inode of the mapped file."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}" if st else "00:00"
    return f"{rng} rw-s 00000000 {dev} {st.st_ino if st else 0}{' ' * 20}{path}\n"


class Tree:
    """A /proc laid out for the scan: devices, and per pid maps, comm and a `root` symlink to a
    directory where /dev nodes are made."""

    def __init__(self, base: Path, devices: str = DEVICES):
        self.proc = base / "proc"
        self.root = base / "root"
        (self.root / "dev").mkdir(parents=True)
        self.proc.mkdir()
        (self.proc / "devices").write_text(devices)

    def node(self, name: str, major: int | None, minor: int = 0) -> os.stat_result:
        """root/dev/<name>: a char device (major, minor), or a plain file for major None."""
        p = self.root / "dev" / name
        if major is None:
            p.write_bytes(b"\0" * 4096)
        else:
            os.mknod(p, 0o666 | 0o020000, os.makedev(major, minor))
        return os.lstat(p)

    def pid(self, pid: int, maps: str, comm: str = "worker", root: Path | None = None) -> int:
        d = self.proc / str(pid)
        d.mkdir()
        (d / "maps").write_text(maps)
        (d / "comm").write_text(comm + "\n")
        (d / "root").symlink_to(root or self.root)
        return pid

    def gpu(self, pid: int, **kw) -> bool:
        return discovery.is_gpu_process(pid, str(self.proc), **kw)


@pytest.fixture
def tree(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root (mknod)")
    return Tree(tmp_path)


# ---- NVIDIA majors ---------------------------------------------------------------------------------

def test_majors_are_195_and_the_character_drivers_named_nvidia(tmp_path):
    (tmp_path / "devices").write_text(DEVICES)
    assert discovery.nvidia_majors(str(tmp_path)) == {195, UVM_MAJOR}  # not the block driver's
    assert discovery.nvidia_majors(str(tmp_path / "none")) == {195}
    assert 1 not in discovery.nvidia_majors("/proc")  # the real file parses (no driver here: {195})


# ---- device identity decides -------------------------------------------------------------------------

@needs_root
@pytest.mark.parametrize("case, expect", [
    ("nvidia0: char 195", True),
    ("nvidia-uvm: char of the major /proc/devices lists", True),
    ("nvidia1: plain file", False),
    ("nvidia2: char 1:3, another driver", False),
    ("nvidia-blk: char of a block driver's nvidia* major", False),
    ("swapped: the mapped plain file's inode, a real node at the path now", False),
    ("another node: nvidia-uvm's inode, nvidia0 at the path", False),
    ("outside /dev: a real node, its path not /dev/nvidia*", False),
    ("text only: ~/dev/nvidia0, a plain file", False),
])
def test_device_identity_decides(tree, tmp_path, case, expect):
    real = tree.node("nvidia0", 195)
    uvm = tree.node("nvidia-uvm", UVM_MAJOR)
    plain = tree.node("nvidia1", None)
    other = tree.node("nvidia2", 1, 3)
    blk = tree.node("nvidia-blk", BLOCK_MAJOR)
    (tree.root / "opt").mkdir()
    os.mknod(tree.root / "opt" / "nvidia0", 0o666 | 0o020000, os.makedev(195, 0))
    outside = os.lstat(tree.root / "opt" / "nvidia0")
    (tree.root / "home").mkdir()
    (tree.root / "home" / "nvidia0").write_bytes(b"x")
    home = os.lstat(tree.root / "home" / "nvidia0")
    maps = {
        "nvidia0: char 195": line("/dev/nvidia0", real),
        "nvidia-uvm: char of the major /proc/devices lists": line("/dev/nvidia-uvm", uvm),
        "nvidia1: plain file": line("/dev/nvidia1", plain),
        "nvidia2: char 1:3, another driver": line("/dev/nvidia2", other),
        "nvidia-blk: char of a block driver's nvidia* major": line("/dev/nvidia-blk", blk),
        "swapped: the mapped plain file's inode, a real node at the path now": line("/dev/nvidia0", plain),
        "another node: nvidia-uvm's inode, nvidia0 at the path": line("/dev/nvidia0", uvm),
        "outside /dev: a real node, its path not /dev/nvidia*": line("/opt/nvidia0", outside),
        "text only: ~/dev/nvidia0, a plain file": line("/home/dev/nvidia0", home),
    }[case]
    pid = tree.pid(PID0, "00400000-00401000 r-xp 00000000 08:01 12 /usr/bin/x\n" + maps)
    assert tree.gpu(pid) is expect
    assert (pid in discovery.watch_set(str(tree.proc), gpu=True)) is expect


@needs_root
def test_a_major_counts_only_while_proc_devices_lists_it(tmp_path):
    t = Tree(tmp_path, devices="Character devices:\n  1 mem\n")  # nvidia-uvm not loaded
    pid = t.pid(PID0, line("/dev/nvidia-uvm", t.node("nvidia-uvm", UVM_MAJOR)))
    assert not t.gpu(pid)
    (t.proc / "devices").write_text(DEVICES)
    assert t.gpu(pid)


@needs_root
def test_a_deleted_node_is_looked_at_through_map_files(tree):
    real = tree.node("nvidia0", 195)
    rng = "7f0000000000-7f0000001000"
    pid = tree.pid(PID0, line("/dev/nvidia0 (deleted)", real, rng))
    os.unlink(tree.root / "dev" / "nvidia0")
    assert not tree.gpu(pid)  # no map_files (the agent without CAP_SYS_ADMIN): not counted
    (tree.proc / str(pid) / "map_files").mkdir()
    os.mknod(tree.root / "kept", 0o666 | 0o020000, os.makedev(195, 0))  # a stand-in the link reaches
    (tree.proc / str(pid) / "map_files" / rng).symlink_to(tree.root / "kept")
    kept = os.lstat(tree.root / "kept")
    (tree.proc / str(pid) / "maps").write_text(line("/dev/nvidia0 (deleted)", kept, rng))
    assert tree.gpu(pid)


@needs_root
def test_a_container_s_dev_is_its_own(tree, tmp_path):
    """The node is looked for under the process's root: the host's real /dev/nvidia0 does not make a
    process whose own /dev/nvidia0 is a plain file a GPU process, even with the host node's identity
    in its maps line; its own real node does."""
    host = tree.node("nvidia0", 195)
    ctr = tmp_path / "ctr"
    (ctr / "dev").mkdir(parents=True)
    (ctr / "dev" / "nvidia0").write_bytes(b"x")
    a = tree.pid(PID0, line("/dev/nvidia0", host), root=ctr)
    assert not tree.gpu(a)
    os.unlink(ctr / "dev" / "nvidia0")
    os.mknod(ctr / "dev" / "nvidia0", 0o666 | 0o020000, os.makedev(195, 1))
    (tree.proc / str(a) / "maps").write_text(line("/dev/nvidia0", os.lstat(ctr / "dev" / "nvidia0")))
    assert tree.gpu(a)


@needs_root
def test_checks_per_process_are_bounded(tree, monkeypatch):
    """Distinct candidates: MAX_CANDIDATES checks, then not a GPU process this round; 60,000 lines of
    one plain file: one."""
    real = tree.node("nvidia0", 195)
    fakes = [tree.node(f"nvidia{i}", None) for i in range(1, 40)]
    many = tree.pid(PID0, "".join(line(f"/dev/nvidia{i}", st) for i, st in enumerate(fakes, 1))
                    + line("/dev/nvidia0", real))
    one = tree.pid(PID0 + 1, line("/dev/nvidia1", fakes[0]) * 60_000)
    first = tree.pid(PID0 + 2, line("/dev/nvidia0", real) + line("/dev/nvidia1", fakes[0]) * 100)
    calls = []
    check = discovery._nvidia_node
    monkeypatch.setattr(discovery, "_nvidia_node", lambda *a: calls.append(a[0]) or check(*a))
    assert not tree.gpu(many) and len(calls) == discovery.MAX_CANDIDATES
    calls.clear()
    assert not tree.gpu(one) and len(calls) == 1
    calls.clear()
    assert tree.gpu(first) and len(calls) == 1


@needs_root
def test_a_negative_verdict_never_blinds_another_process(tree):
    """A process that maps the real node and then swaps the path in its own namespace fails the
    check; a process after it in the round that maps the same node is still found, and a found
    (dev, inode) is not checked again in the round."""
    real = tree.node("nvidia0", 195)
    tree.node("nvidia1", None)
    swapped = tree.pid(PID0, line("/dev/nvidia1", real))  # the real node's inode, a plain file at the path
    legit = tree.pid(PID0 + 1, line("/dev/nvidia0", real))
    again = tree.pid(PID0 + 2, line("/dev/nvidia0", real))
    scan = discovery.WatchScan(str(tree.proc), budget_s=float("inf"))
    got = discovery.watch_set(str(tree.proc), gpu=True, scan=scan)
    assert got == {legit, again}
    # the same inode under any path, once found this round: that process maps that node
    v = {(os.major(real.st_dev), os.minor(real.st_dev), real.st_ino)}
    assert tree.gpu(swapped, verified=v)


# ---- libcuda: the finder's trust check -----------------------------------------------------------------

@needs_root
def test_libcuda_counts_only_when_the_finder_trusts_it(tree, tmp_path):
    lib = tmp_path / "lib" / "libcuda.so.1"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF" + b"\0" * 4092)
    os.chmod(lib, 0o644)
    pid = tree.pid(PID0, line(str(lib), os.stat(lib)).replace("rw-s", "r-xp"))
    assert tree.gpu(pid, lib_trusted=trusted_libcuda)
    assert not tree.gpu(pid)  # no check handed in: libcuda lines count for nothing
    os.chmod(lib, 0o666)  # writable by others
    assert not tree.gpu(pid, lib_trusted=trusted_libcuda)
    os.chmod(lib, 0o644)
    os.chown(lib, 65534, 65534)  # nobody's
    assert not tree.gpu(pid, lib_trusted=trusted_libcuda)


# ---- a real unprivileged attacker ---------------------------------------------------------------------

ATTACK = r"""
import mmap, os, sys, time
paths = ["dev/nvidia0", "libcuda.so.1"] + (["/dev/nvidia0", "/dev/nvidiactl"] if sys.argv[1] == "userns" else [])
os.makedirs("dev", exist_ok=True)
keep = []
for p in paths:
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    fd = os.open(p, os.O_RDWR)
    keep.append(mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
print("ready", os.getpid(), sys.argv[1], flush=True)
time.sleep(120)
"""


@pytest.fixture
def attacker():
    """A process of nobody, not a child of this one (own_pids() would leave it out for that alone),
    mapping plain files it made: ./dev/nvidia0, ./libcuda.so.1 in a directory only it can write, and
    (in a user and mount namespace of its own, where it mounts a tmpfs on /dev) /dev/nvidia0 and
    /dev/nvidiactl."""
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"):
        pytest.skip("needs root, setpriv, unshare")
    d = tempfile.mkdtemp(prefix="mcp-attacker-", dir="/tmp")
    os.chown(d, 65534, 65534)
    os.chmod(d, 0o700)
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    script = os.path.join(d, "attack.py")
    Path(script).write_text(ATTACK)
    os.chmod(script, 0o644)
    as_nobody = f"setpriv --reuid=65534 --regid=65534 --clear-groups"
    inner = (f"cd {d} && ({as_nobody} unshare -Urm sh -c 'mount -t tmpfs none /dev && exec {py} -I -S {script} userns' "
             f"|| exec {as_nobody} {py} -I -S {script} plain)")
    sh = subprocess.Popen(["sh", "-c", f"({inner}) </dev/null 2>/dev/null & "], stdout=subprocess.PIPE, text=True)
    sh.wait(10)  # the attacker is reparented: not a child of this process
    ready = sh.stdout.readline().split()
    assert ready and ready[0] == "ready", ready
    pid = int(ready[1])
    try:
        yield SimpleNamespace(pid=pid, dir=d, userns=ready[2] == "userns")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sh.stdout.close()
        shutil.rmtree(d, ignore_errors=True)


@needs_root
def test_a_real_unprivileged_attacker_with_nvidia_and_libcuda_paths_is_not_watched(attacker, tmp_path):
    pid = attacker.pid
    assert pid not in discovery.own_pids()
    maps = procscan.read_maps(pid).decode()
    # what the path text alone (the old check) would have watched
    assert f"{attacker.dir}/dev/nvidia0" in maps and f"{attacker.dir}/libcuda.so.1" in maps
    assert procscan.maps_contains(pid, (b"libcuda.so", b"/dev/nvidia"))
    if attacker.userns:  # a plain /dev/nvidia0 at the very path a real one has
        assert " /dev/nvidia0\n" in maps and " /dev/nvidiactl\n" in maps
    assert not discovery.is_gpu_process(pid, lib_trusted=trusted_libcuda)
    assert pid not in discovery.watch_set(gpu=True, lib_trusted=trusted_libcuda)
    # the same check, the same maps plus one line of a real NVIDIA node: watched
    t = Tree(tmp_path)
    t.pid(pid, maps + line("/dev/nvidia0", t.node("nvidia0", 195)))
    assert t.gpu(pid, lib_trusted=trusted_libcuda)
    assert pid in discovery.watch_set(str(t.proc), gpu=True, lib_trusted=trusted_libcuda)


# ---- never the agent itself -------------------------------------------------------------------------

@needs_root
def test_the_agent_is_never_watched(tree):
    """Its own pid is left out, named by pid or comm or mapping an NVIDIA node; another child of the
    agent's process (what an in-process agent's test runs) is not the agent's."""
    real = tree.node("nvidia0", 195)
    me = os.getpid()
    comm = Path(f"/proc/{me}/comm").read_text().strip()
    other = subprocess.Popen(["sleep", "30"])
    try:
        for pid in (me, other.pid, PID0):
            tree.pid(pid, line("/dev/nvidia0", real), comm=comm)
        assert discovery.own_pids() == {me}
        proc = str(tree.proc)
        assert discovery.watch_set(proc, gpu=True) == {PID0, other.pid}
        # named by pid or by comm, GPU filter off: still not
        assert discovery.watch_set(proc, pids=(me,), comms=(comm,), gpu=False) == {PID0, other.pid}
        assert me not in discovery.watch_set(pids=(me,), comms=(comm,), gpu=True)  # the real /proc
    finally:
        other.kill()
        other.wait()


class _Table(dict):
    def __setitem__(self, k, v):
        super().__setitem__(k.value, v.value)

    def pop(self, k, default=None):
        return super().pop(k.value, default)


@needs_root
def test_watcher_writes_the_gpu_processes_with_the_libcuda_check_it_was_handed(tree, tmp_path):
    lib = tmp_path / "lib" / "libcuda.so.1"
    lib.parent.mkdir()
    lib.write_bytes(b"\0" * 4096)
    os.chmod(lib, 0o644)
    dev = tree.pid(PID0, line("/dev/nvidia0", tree.node("nvidia0", 195)))
    cuda = tree.pid(PID0 + 1, line(str(lib), os.stat(lib)))
    tree.pid(PID0 + 2, line("/dev/nvidia1", tree.node("nvidia1", None)))
    tree.pid(os.getpid(), line("/dev/nvidia0", os.lstat(tree.root / "dev" / "nvidia0")))
    bpf = {b"watch_tgid": _Table(), b"watch_bits": _Table()}
    cfg = SimpleNamespace(process_pids=(), process_comms=(), process_watch="gpu")
    w = discovery.Watcher(cfg, str(tree.proc), lambda: bpf, lambda where, e: None, trusted_libcuda)
    assert w.refresh(discovery.WatchScan(str(tree.proc), budget_s=float("inf"), lib_trusted=w.lib_trusted))
    assert set(bpf[b"watch_tgid"]) == {dev, cuda}


# ---- procscan.maps_lines ------------------------------------------------------------------------------

def test_maps_lines_across_reads_and_the_limit(tmp_path):
    (tmp_path / "1").mkdir()
    body = [f"{i:012x}-{i + 1:012x} r--p 00000000 08:01 {i} /usr/lib/lib{i}.so\n" for i in range(5000)]
    for i in range(0, 5000, 137):
        body[i] = body[i].replace(f"/usr/lib/lib{i}.so", f"/dev/nvidia{i}")
    text = "".join(body)
    (tmp_path / "1" / "maps").write_text(text)
    want = [ln.encode() for ln in text.splitlines() if "/dev/nvidia" in ln]
    assert list(procscan.maps_lines(1, (b"/dev/nvidia",), str(tmp_path))) == want
    limit = text.index("/dev/nvidia4110") + 3  # cuts that line: dropped, not half-read
    assert list(procscan.maps_lines(1, (b"/dev/nvidia",), str(tmp_path), limit)) == want[:30]
    assert list(procscan.maps_lines(2, (b"/dev/nvidia",), str(tmp_path))) == []  # gone
