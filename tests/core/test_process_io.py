"""process.disk.io and process.paging.faults (agent/core/processes.py) against the kernel's own
accounting: a child process reads, then maps and touches, a file whose pages were dropped from the
page cache, so the storage layer reads it (what a model load from disk does). The figures the agent
exports for the child must be /proc/PID/io's read_bytes and /proc/PID/stat's majflt, and must have
grown by the file's size and by about one major fault per readahead window."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mcp_hostagent.core.decode import Counters
from mcp_hostagent.core.processes import Processes

SIZE = 32 << 20

CHILD = r"""
import mmap, os, sys
path = sys.argv[1]
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()
with open(path, "rb") as f:  # read(): storage reads, no faults on the file
    while f.read(1 << 20):
        pass
sys.stdout.write("read\n"); sys.stdout.flush()
sys.stdin.readline()
fd = os.open(path, os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
s = sum(m[i] for i in range(0, len(m), 4096))  # one touch per page: major faults where not cached
sys.stdout.write(f"mapped {s}\n"); sys.stdout.flush()
sys.stdin.readline()
"""


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _proc_io(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["read_bytes"])


def _majflt(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[9])


def _exported(procs: Processes, pid: int) -> dict:
    procs.set_rows({pid: ({"process.pid": pid}, Counters())}, *procs._proc_accounting({pid: None}))
    out = {}
    for inst in procs.instruments():
        if inst.name in ("process.disk.io", "process.paging.faults"):
            for v, a in inst.read():
                if a.get("process.pid") == pid:
                    out[(inst.name, a.get("disk.io.direction") or a.get("process.paging.fault_type"))] = v
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="kernel without CONFIG_TASK_IO_ACCOUNTING: no /proc/PID/io")
def test_storage_reads_and_major_faults_of_a_process_match_the_kernel(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("reading another process's /proc/PID/io needs root (ptrace access); CI runs as root")
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(SIZE))
    _drop(str(path))
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        procs = Processes()
        before = _exported(procs, p.pid)
        assert before[("process.disk.io", "read")] == _proc_io(p.pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline() == "read\n"
        after_read = _exported(procs, p.pid)
        # the kernel's figure, and at least the file (readahead may fetch a little past nothing: the file ends)
        assert after_read[("process.disk.io", "read")] == _proc_io(p.pid)
        assert after_read[("process.disk.io", "read")] - before[("process.disk.io", "read")] >= SIZE
        _drop(str(path))
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().startswith("mapped")
        after_map = _exported(procs, p.pid)
        assert after_map[("process.paging.faults", "major")] == _majflt(p.pid)
        # readahead maps several pages per major fault: fewer faults than pages, but some
        assert after_map[("process.paging.faults", "major")] - after_read[("process.paging.faults", "major")] >= 1
        assert after_map[("process.disk.io", "read")] - after_read[("process.disk.io", "read")] >= SIZE // 2
    finally:
        p.stdin.write("go\n")
        p.stdin.flush()
        p.wait(10)
