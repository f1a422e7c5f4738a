"""Real BPF: offcpu_runnable_ns, the part of off-CPU time a thread spent switched out while runnable
(preempted: waiting for a CPU), which top shows as WAIT%. Sleeping adds to offcpu_ns, not to it; a
thread sharing its CPU with a busy loop is preempted and waits. The kernel's own figure is the run
delay in /proc/PID/schedstat: every wait on a run queue, wake-ups included, so ours is at most that."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from test_bpf_requests import Child, child  # noqa: F401  (child: the fixture)

pytestmark = pytest.mark.bpf
MS = 1_000_000
SLACK = 5 * MS  # intervals open at a reading: switched out before it, back in after


def run_delay(pid) -> int:
    """ns the task waited on a run queue (/proc/PID/schedstat, CONFIG_SCHED_INFO); pid may be "PID/task/TID"."""
    try:
        return int(open(f"/proc/{pid}/schedstat").read().split()[1])
    except (OSError, IndexError):
        pytest.skip("no /proc/PID/schedstat (CONFIG_SCHED_INFO)")


def all_threads_run_delay(pid: int) -> int:
    """The process's run delay: proc_stats sums every thread, /proc/PID/schedstat is the leader's."""
    return sum(run_delay(f"{pid}/task/{tid}") for tid in os.listdir(f"/proc/{pid}/task"))


def counters(agent, pid: int) -> tuple[int, int]:
    c = agent.agent.bpf[b"proc_stats"][ctypes.c_uint32(pid)]
    return c.offcpu_ns, c.offcpu_runnable_ns


def watched(agent, child) -> None:
    child.do("begin 301", "end 301")  # marking puts the process in the kernel's watch set
    agent.wait_spans(1, **{"process.pid": child.pid})


def test_sleeping_is_off_cpu_but_not_waiting(agent, child):
    watched(agent, child)
    off0, run0 = counters(agent, child.pid)
    rd0 = run_delay(child.pid)
    child.do("sleep 20 5")
    off1, run1 = counters(agent, child.pid)
    rd1 = run_delay(child.pid)
    assert off1 - off0 >= 20 * 5 * MS * 0.9, (off1 - off0)
    assert run1 - run0 <= (rd1 - rd0) + SLACK, (run1 - run0, rd1 - rd0)
    assert run1 - run0 < (off1 - off0) / 10, (run1 - run0, off1 - off0)


def test_a_preempted_thread_waits(agent, child):
    watched(agent, child)
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(child.pid, {cpu})
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        child.do("spin 20")  # both on the CPU now
        off0, run0 = counters(agent, child.pid)
        rd0 = run_delay(child.pid)
        child.do("spin 400")
        off1, run1 = counters(agent, child.pid)
        rd1 = run_delay(child.pid)
    finally:
        hog.kill()
        hog.wait()
    waited = run1 - run0
    assert waited >= 50 * MS, (waited, off1 - off0, rd1 - rd0)  # about half of 400 ms, shared with the hog
    assert waited <= off1 - off0  # a part of off-CPU time
    assert waited <= (rd1 - rd0) + SLACK, (waited, rd1 - rd0)


def test_run_queue_wait_after_wakeups_completes_the_kernels_run_delay(agent, child):
    """Sleeping 2 ms at a time at nice 19 beside two busy loops on one CPU: a woken thread of that
    weight does not preempt them, so each wake-up waits on the run queue. The preempted part and the
    part after wake-ups together are the run delay the kernel's schedstat counts for the threads
    (the same interval: enqueued -> on a CPU)."""
    watched(agent, child)
    cpu = min(os.sched_getaffinity(0))
    for tid in os.listdir(f"/proc/{child.pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})
        os.setpriority(os.PRIO_PROCESS, int(tid), 19)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for h in hogs:
            os.sched_setaffinity(h.pid, {cpu})
        child.do("spin 20")
        c0 = agent.agent.bpf[b"proc_stats"][ctypes.c_uint32(child.pid)]
        w0, n0, r0 = c0.wakeup_wait_ns, c0.wakeups, c0.offcpu_runnable_ns
        rd0 = all_threads_run_delay(child.pid)
        child.do("sleep 100 2")
        c1 = agent.agent.bpf[b"proc_stats"][ctypes.c_uint32(child.pid)]
        rd1 = all_threads_run_delay(child.pid)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    wake, n, runnable = c1.wakeup_wait_ns - w0, c1.wakeups - n0, c1.offcpu_runnable_ns - r0
    # A wake-up per sleep, but for the few sleeps preempted between arming their timer and switching
    # out (behind two busy loops, at nice 19): still queued, their timer's wake-up (ttwu_runnable) finds
    # them runnable and off the CPU as preempted, and that wait is in offcpu_runnable_ns instead.
    assert n >= 90, n
    ours, kernel = wake + runnable, rd1 - rd0
    assert wake >= 100 * MS, (wake, n, kernel)  # ~1-10 ms a wake-up behind two busy loops
    assert 0.9 * kernel <= ours <= 1.1 * kernel, (wake, runnable, kernel)
