"""Real BPF: bytes a request and its process added to the page cache (filemap:mm_filemap_add_to_page_cache,
bpf/requests.bpf.c), the model-load evidence that a request read or mapped a file the cache did not
hold. The kernel's own figure for it is /proc/PID/io read_bytes: the bytes the process made the
storage layer read, readahead included, which for a file dropped from the cache are the pages
inserted for it. Both are compared while the child is blocked between its steps."""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile

import pytest

from test_bpf_requests import TP, child  # noqa: F401  (child: the fixture)
from test_process_io import _drop as drop, _proc_io as read_bytes

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(not os.path.exists("/proc/self/io"),
                                 reason="kernel without CONFIG_TASK_IO_ACCOUNTING: no /proc/PID/io to compare with")]
SIZE = 16 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
ATTR = "hostagent.page_cache.added.size"


@pytest.fixture
def weights():
    """A file beside this one (the checkout's filesystem, on a block device: pages of a tmpfs, which
    /tmp can be, are not added this way), written, synced and dropped from the page cache."""
    d = tempfile.mkdtemp(prefix=".page-cache-", dir=os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(d, "weights.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(SIZE))
    drop(path)
    yield path
    shutil.rmtree(d, ignore_errors=True)


def proc_added(agent, pid: int) -> int:
    return agent.agent.bpf[b"proc_stats"][ctypes.c_uint32(pid)].pagecache_added_bytes


def span_of(agent, child, rid: int):
    (span,) = agent.wait_spans(1, **{"process.pid": child.pid, "hostagent.request.id": f"{rid:016x}"})
    return span


def close(ours: int, kernel: int) -> bool:
    # the interpreter's own steps around the command read nothing new; a few pages of slack for a
    # page the kernel inserted and then found already there (a raced readahead), counted by neither
    return abs(ours - kernel) <= 4 * PAGE


def test_a_read_the_cache_missed_counts_what_the_storage_layer_read(agent, child, weights):
    child.do("begin 701", "end 701")  # watched from here: its process counters are kept
    agent.wait_spans(1, **{"process.pid": child.pid})
    io0, p0 = read_bytes(child.pid), proc_added(agent, child.pid)
    child.do(f"begin 702 {TP}", f"read {weights}", "end 702")
    io1, p1 = read_bytes(child.pid), proc_added(agent, child.pid)
    got = span_of(agent, child, 702).attributes[ATTR]
    assert io1 - io0 >= SIZE, (io0, io1)
    assert close(got, io1 - io0), (got, io1 - io0)
    assert close(p1 - p0, io1 - io0), (p1 - p0, io1 - io0)
    # the same file again, now cached: nothing added, and the attribute is left off
    child.do(f"begin 703 {TP}", f"read {weights}", "end 703")
    assert ATTR not in span_of(agent, child, 703).attributes
    assert read_bytes(child.pid) == io1


def test_file_faults_of_a_mapped_load_count_their_readahead(agent, child, weights):
    io0 = read_bytes(child.pid)
    child.do(f"begin 704 {TP}", f"mapread {weights}", "end 704")
    io1 = read_bytes(child.pid)
    got = span_of(agent, child, 704).attributes[ATTR]
    assert io1 - io0 >= SIZE // 2, (io0, io1)  # readahead windows: the faults read most of it
    assert close(got, io1 - io0), (got, io1 - io0)
