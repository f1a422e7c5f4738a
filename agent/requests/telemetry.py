"""The requests capability's metrics: its kernel counters per watched process (core/processes.py rows).
The request span and hostagent.request.duration are the core's request path (core/request.py)."""

from __future__ import annotations

from ..telemetry.spec import Instrument


def process_instruments(processes) -> list[Instrument]:
    p = processes.per_process
    return [
        Instrument("hostagent.process.user_faults", "counter", "{fault}",
                   "user page faults (exceptions:page_fault_user)", p(lambda c: [(c.faults, {})])),
        Instrument("process.context_switches", "counter", "{context_switch}", "context switches (sched:sched_switch)",
                   p(lambda c: [(c.vcsw, {"process.context_switch.type": "voluntary"}),
                                (c.ivcsw, {"process.context_switch.type": "involuntary"})])),
        Instrument("hostagent.process.offcpu.time", "counter", "s",
                   "time the process's threads spent switched out (sleeping or waiting for a CPU)",
                   p(lambda c: [(c.offcpu_ns / 1e9, {})])),
        Instrument("hostagent.process.runqueue.wait.time", "counter", "s",
                   "time the process's threads were runnable but not running: preempted, or woken and not yet"
                   " on a CPU (schedstat's run delay, for the threads the agent follows)",
                   p(lambda c: [(c.offcpu_runnable_ns / 1e9, {"hostagent.runqueue.wait": "preempted"}),
                                (c.wakeup_wait_ns / 1e9, {"hostagent.runqueue.wait": "wakeup"})])),
        Instrument("hostagent.process.page_cache.added", "counter", "By",
                   "bytes the process's threads added to the page cache (filemap:mm_filemap_add_to_page_cache): "
                   "reads and file faults the cache missed, readahead included, and new pages of buffered writes",
                   p(lambda c: [(c.pagecache_added_bytes, {})])),
    ]
