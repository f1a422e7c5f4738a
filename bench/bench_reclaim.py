#!/usr/bin/env python3
"""What the agent costs a workload under memory pressure: memcg reclaim and a kswapd storm.

Two real pressure workloads, each run by a long-lived child process (a serving-process stand-in,
every storm inside one marked request), with and without the agent, interleaved by rounds:
  memcg   the child sits in a memory cgroup limited to 64 MiB (v1 `memory.limit_in_bytes` where the
          host mounts v1, else v2 `memory.max`) and writes a file of --memcg-mib MiB (default 512) in
          1 MiB write()s: its dirty page cache must be written back before memcg reclaim can free it,
          so the writer stalls in reclaim. Throughput: MiB/s of the write loop after the first 128
          MiB (from there on every page comes from reclaiming the cgroup's own; the first ones are
          fresh guest memory, whose cost depends on the host). The file is deleted after each storm.
  kswapd  /proc/sys/vm/min_free_kbytes is raised to ~80% of MemFree + 800 MiB (at most 90% of it),
          as tests/reclaim/test_bpf_reclaim.py does, and the child streams a 64 GiB sparse file (128 KiB
          read()s, as cat does: clean page cache at memory speed) for a fixed time: kswapd wakes and
          reclaims behind it. Throughput: MiB/s read. Before each storm kswapd is left to stop
          scanning, and woken with a short memcg reclaim if it had given up on the node
          (node_unreclaimable); the file's cache is dropped after each storm, at least 2.5 s before
          the next (1 s with --quick). min_free_kbytes is restored right after the storm, and again in a finally that
          covers Ctrl-C and SIGTERM; the benchmark will not start if it is already over 2% of memory.
The agent (watch=all) is started once, in this process; "agent" is every probe attached, as
`mcp-agent run` leaves it (see _common.ToggledAgent). Reported: the median of per-round throughput
ratios (agent / no agent) and their spread; the storm's own CPU per MiB; the agent's CPU (its threads'
utime+stime) during the storms, % of one core, next to the same threads' idle during the no-agent
storms; what the agent produced (storm episodes opened, reclaim-stall spans, request spans linked
to an episode); the reclaim the kernel did per storm (/proc/vmstat) and kswapd's CPU, to show what
pressure each condition saw; and, from one pass with kernel.bpf_stats_enabled, how often each of our
programs ran during a storm and for how long.

    sudo .venv/bin/python bench/bench_reclaim.py [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

MEMCG_LIMIT = 64 << 20
V1_MEMORY = "/sys/fs/cgroup/memory"
MIN_FREE = "/proc/sys/vm/min_free_kbytes"
SPARSE_SIZE = 64 << 30
MEMCG_HEAD = 128  # MiB written before the memcg writer's clock starts
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

# The child: one command per line on stdin, one line of numbers back ("bytes seconds cpu_seconds").
WORKER = r"""
import os, resource, signal, sys, time
from mcp_hostagent import marker
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent cleans up; stdin EOF ends this process
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
def write(path, mib, head, rid, tp):
    chunk = b"x" * (1 << 20)
    marker.begin(rid, tp)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for i in range(mib):
            if i == head:  # timed from here: the cgroup is full, every page now comes through reclaim
                t0, c0 = time.monotonic(), cpu()
            os.write(fd, chunk)
    finally:
        os.close(fd)
    t1, c1 = time.monotonic(), cpu()
    marker.end(rid)
    return (mib - head) << 20, t1 - t0, c1 - c0
def read(path, secs, rid, tp):
    buf = bytearray(128 << 10)
    n = 0
    marker.begin(rid, tp)
    t0, c0 = time.monotonic(), cpu()
    with open(path, "rb", buffering=0) as f:
        while time.monotonic() - t0 < secs:
            got = f.readinto(buf)
            if not got:
                break
            n += got
    t1, c1 = time.monotonic(), cpu()
    marker.end(rid)
    return n, t1 - t0, c1 - c0
marker.end(0)  # warm the marker's code path
for line in sys.stdin:
    cmd, *a = line.split()
    if cmd == "join":
        with open(a[0], "w") as f:
            f.write(str(os.getpid()))
        res = (0,)
    elif cmd == "write":
        res = write(a[0], int(a[1]), int(a[2]), int(a[3]), a[4])
    elif cmd == "read":
        res = read(a[0], float(a[1]), int(a[2]), a[3])
    else:
        sys.exit("unknown command " + cmd)
    print(" ".join(str(x) for x in res), flush=True)
"""


class Worker:
    def __init__(self):
        self.proc = subprocess.Popen([c.agent_python(), "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=str(c.REPO))
        self.pid = self.proc.pid

    def ask(self, *cmd) -> list[float]:
        self.proc.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died on {cmd}")
        return [float(x) for x in line.split()]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# ---- the memory cgroup and the kernel's view ----

def v2_root() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            x = line.split()
            if x[x.index("-") + 1] == "cgroup2" and os.path.exists(os.path.join(x[4], "cgroup.controllers")):
                with open(os.path.join(x[4], "cgroup.controllers")) as g:
                    if "memory" in g.read().split():
                        return x[4]
    return None


def make_memcg(name: str) -> tuple[str, str]:
    """A memory cgroup limited to 64 MiB: (its path, which version)."""
    if os.path.isdir(V1_MEMORY):
        path = os.path.join(V1_MEMORY, name)
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(MEMCG_LIMIT))
        return path, "v1 memory.limit_in_bytes"
    root = v2_root()
    if root is None:
        sys.exit("error: no cgroup memory controller (neither v1 nor v2) on this host")
    with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
        f.write("+memory")
    path = os.path.join(root, name)
    os.mkdir(path)
    with open(os.path.join(path, "memory.max"), "w") as f:
        f.write(str(MEMCG_LIMIT))
    return path, "v2 memory.max"


def remove_memcg(path: str) -> None:
    for _ in range(50):  # its tasks must be gone first
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    print(f"  warning: could not remove {path}")


VM_KEYS = ("pgscan_kswapd", "pgsteal_kswapd", "pgscan_direct", "pgsteal_direct", "pgsteal_file", "pgsteal_anon",
           "allocstall_normal", "allocstall_movable", "allocstall_dma32")


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        d = dict(line.split() for line in f)
    return {k: int(d.get(k, 0)) for k in VM_KEYS}


def meminfo_kb(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def read_min_free() -> int:
    with open(MIN_FREE) as f:
        return int(f.read().strip())


def write_min_free(kb: int) -> None:
    with open(MIN_FREE, "w") as f:
        f.write(str(kb))


def kswapd_quiet(max_s: float = 5.0) -> bool:
    """Wait until kswapd stops scanning (pgscan_kswapd still for 0.3 s): every storm starts alike."""
    deadline = time.monotonic() + max_s
    last = vmstat()["pgscan_kswapd"]
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = vmstat()["pgscan_kswapd"]
        if now == last:
            return True
        last = now
    return False


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def span_counter():
    from opentelemetry.sdk.trace import SpanProcessor

    class SpanCounter(SpanProcessor):
        """On the agent's tracer provider: spans started / ended by name, storm scopes, linked requests."""

        def __init__(self):
            self.started = collections.Counter()
            self.ended = collections.Counter()
            self.storm_scopes = collections.Counter()
            self.linked_requests = 0

        def on_start(self, span, parent_context=None) -> None:
            self.started[span.name] += 1
            if span.name == "hostagent.reclaim_storm":
                scope = (span.attributes or {}).get("hostagent.storm.scope", "?")
                self.storm_scopes["host" if scope == "host" else "cgroup"] += 1

        def on_end(self, span) -> None:
            self.ended[span.name] += 1
            if span.name == "hostagent.request" and any(lk.attributes.get("hostagent.link.type") == "reclaim_storm"
                                                  for lk in span.links):
                self.linked_requests += 1

    return SpanCounter()


# ---- one storm ----

def node_hopeless() -> bool:
    """/proc/zoneinfo's node_unreclaimable: kswapd gave up on the node after MAX_RECLAIM_RETRIES runs
    that reclaimed nothing, and wakeup_kswapd() leaves it asleep until some reclaim makes progress."""
    with open("/proc/zoneinfo") as f:
        return any(line.split()[-1] == "1" for line in f if "node_unreclaimable" in line)


def kswapd_pids() -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().startswith("kswapd"):
                        out.append(int(pid))
            except OSError:
                continue
    return out


def cpu_ticks(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                x = f.read().rsplit(")", 1)[1].split()
            total += int(x[11]) + int(x[12])
        except OSError:
            continue
    return total / c.HZ


class Storms:
    def __init__(self, worker_w: Worker, worker_r: Worker, memcg_mib: int, kswapd_s: float, wfile: str, sparse: str,
                 min_free_orig: int, gap_s: float):
        self.ww, self.wr = worker_w, worker_r
        self.gap_s = gap_s
        self.memcg_mib, self.kswapd_s = memcg_mib, kswapd_s
        self.wfile, self.sparse = wfile, sparse
        self.min_free_orig = min_free_orig
        self.rid = 1 << 40
        self.kswapd_pids = kswapd_pids()
        self.last_drop = 0.0
        self.revived = 0

    def _write(self, mib: int, head: int) -> list[float]:
        self.rid += 2
        try:
            return self.ww.ask("write", self.wfile, mib, head, self.rid, TP)
        finally:
            if os.path.exists(self.wfile):
                os.unlink(self.wfile)

    def memcg(self) -> dict:
        """Writes memcg_mib MiB; timed after the first MEMCG_HEAD MiB, once the cgroup is full and
        every new page comes from reclaiming the cgroup's own (so the host's side of fresh guest
        memory, see docs/PERFORMANCE.md, is out of the number)."""
        vm0 = vmstat()
        with c.Phase() as ph:
            nbytes, secs, cpu = self._write(self.memcg_mib, MEMCG_HEAD)
        return self._row(nbytes, secs, cpu, ph, vm0, vmstat(), 0.0)

    def kswapd(self, ag: c.ToggledAgent | None) -> dict:
        quiet = kswapd_quiet()
        revived = node_hopeless()
        if revived:  # reclaim progress anywhere resets kswapd's failure count: a short memcg reclaim
            self._write(128, 0)
            self.revived += 1
        # every storm starts from free memory freed >= gap_s ago: the host has taken most of it back by
        # then (free page reporting waits 2 s), so each starts alike (docs/PERFORMANCE.md)
        time.sleep(max(0.0, self.last_drop + self.gap_s - time.monotonic()))
        if read_min_free() != self.min_free_orig:
            raise RuntimeError(f"{MIN_FREE} changed under us ({read_min_free()}, was {self.min_free_orig}): "
                               "someone else is raising it; stopping")
        free_kb = meminfo_kb("MemFree")
        raised = min(int(free_kb * 0.8) + (800 << 10), int(free_kb * 0.9))
        self.rid += 2
        vm0, k0 = vmstat(), cpu_ticks(self.kswapd_pids)
        try:
            write_min_free(raised)
            with c.Phase() as ph:
                nbytes, secs, cpu = self.wr.ask("read", self.sparse, self.kswapd_s, self.rid, TP)
        finally:
            write_min_free(self.min_free_orig)
        vm1, k1 = vmstat(), cpu_ticks(self.kswapd_pids)
        gave_up = node_hopeless()
        drop_cache(self.sparse)
        self.last_drop = time.monotonic()
        if ag is not None:  # the agent must see kswapd go back to sleep before its probes are detached
            deadline = time.monotonic() + 5
            while ag.agent.caps["reclaim"].kswapd.awake_since and time.monotonic() < deadline:
                time.sleep(0.05)
        row = self._row(nbytes, secs, cpu, ph, vm0, vm1, k1 - k0)
        row.update(min_free_kb=raised, mem_free_kb=free_kb, kswapd_was_quiet=quiet, revived=revived,
                   kswapd_gave_up=gave_up)
        return row

    @staticmethod
    def _row(nbytes, secs, cpu, ph, vm0, vm1, kswapd_cpu_s) -> dict:
        d = {k: vm1[k] - vm0[k] for k in VM_KEYS}
        return {"mib_s": nbytes / secs / (1 << 20), "mib": nbytes / (1 << 20), "secs": secs,
                "cpu_ms_per_mib": 1e3 * cpu / (nbytes / (1 << 20)), "agent_cpu_s": ph.cpu_s, "wall_s": ph.wall_s,
                "steal_mib": (d["pgsteal_file"] + d["pgsteal_anon"]) * 4 / 1024,
                "steal_kswapd_mib": d["pgsteal_kswapd"] * 4 / 1024, "kswapd_cpu_s": kswapd_cpu_s,
                "allocstall": d["allocstall_normal"] + d["allocstall_movable"] + d["allocstall_dma32"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (~30 s; full ~1.5-2 min)")
    ap.add_argument("--rounds", type=int, help="rounds of (no agent, agent); default 10, --quick 4")
    ap.add_argument("--memcg-mib", type=int, default=512, help="MiB the memcg writer writes per storm (default 512)")
    ap.add_argument("--kswapd-s", type=float, help="seconds of each kswapd storm; default 1.2, --quick 0.8")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    c.require_root()
    c.ensure_project_python()
    rounds = a.rounds or (4 if a.quick else 10)
    kswapd_s = a.kswapd_s or (0.8 if a.quick else 1.2)
    # SIGTERM as an exception too, so that the finally blocks (min_free_kbytes, cgroup, files) run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    guard = c.Guard(10.0 if a.quick else 30.0)
    guard.before()  # a reclaim test running now may have raised min_free_kbytes itself
    min_free_orig = read_min_free()
    if min_free_orig * 1024 > 0.02 * meminfo_kb("MemTotal") * 1024:
        sys.exit(f"error: {MIN_FREE} is {min_free_orig} kB, over 2% of memory: raised by another run? "
                 "Restore it (or wait for that run) first")
    warn = c.other_load_warning()
    if warn:
        print(warn)
    tag = f"mcp-bench-{os.getpid()}"
    wfile, sparse = f"/var/tmp/{tag}-memcg.bin", f"/var/tmp/{tag}-sparse.bin"
    cg_path, cg_kind = make_memcg(tag)
    print(f"bench_reclaim: {rounds} rounds; memcg: {a.memcg_mib} MiB written per storm in a 64 MiB cgroup "
          f"({cg_kind}); kswapd: {kswapd_s}s of streaming a sparse file under a raised min_free_kbytes "
          f"(now {min_free_orig} kB); kernel {os.uname().release}", flush=True)
    res: dict[tuple[str, str], list[dict]] = {}
    counter = span_counter()
    ww = wr = None
    try:
        with open(sparse, "wb") as f:
            f.truncate(SPARSE_SIZE)
        ww, wr = Worker(), Worker()
        ww.ask("join", os.path.join(cg_path, "cgroup.procs"))
        storms = Storms(ww, wr, a.memcg_mib, kswapd_s, wfile, sparse, min_free_orig, 1.0 if a.quick else 2.5)
        with c.ToggledAgent("all") as ag:
            ag.agent.telemetry.tracer_provider.add_span_processor(counter)
            # one storm of each, not timed: the first kswapd storm also evicts the host's other page cache
            storms.memcg()
            storms.kswapd(None)
            for r in range(rounds):
                guard.before()
                order = ("none", "agent") if r % 2 == 0 else ("agent", "none")
                kinds = ("memcg", "kswapd") if r % 2 == 0 else ("kswapd", "memcg")
                for cond in order:
                    agent = ag if cond == "agent" else None
                    if agent:
                        ag.attach()
                    try:
                        for kind in kinds:
                            row = storms.memcg() if kind == "memcg" else storms.kswapd(agent)
                            res.setdefault((kind, cond), []).append(row)
                    finally:
                        ag.detach()
                guard.after()
                m0, m1 = res[("memcg", "none")][-1]["mib_s"], res[("memcg", "agent")][-1]["mib_s"]
                k0, k1 = res[("kswapd", "none")][-1]["mib_s"], res[("kswapd", "agent")][-1]["mib_s"]
                print(f"  round {r + 1}/{rounds}: memcg writer {m0:,.0f} -> {m1:,.0f} MiB/s; "
                      f"kswapd reader {k0:,.0f} -> {k1:,.0f} MiB/s", flush=True)
            # the programs' own run time during one storm of each (a separate pass: the statistics
            # cost two clock reads per run)
            prog = {}
            with c.bpf_run_stats(), ag.attached():
                for kind in ("memcg", "kswapd"):
                    before = ag.prog_runs()
                    row = storms.memcg() if kind == "memcg" else storms.kswapd(ag)
                    prog[kind] = (c.runs_delta(before, ag.prog_runs()), row["wall_s"])
            # open episodes close after 3 quiet windows: give them the time (probes detached, windows quiet)
            deadline = time.monotonic() + 5
            while ag.agent.caps["reclaim"].open_storms() and time.monotonic() < deadline:
                time.sleep(0.2)
            c.wait_idle(2.0)
            session = ag.stats()
            still_open = len(ag.agent.caps["reclaim"].open_storms())
    finally:
        for w in (ww, wr):
            if w is not None:
                w.close()
        if read_min_free() != min_free_orig:
            write_min_free(min_free_orig)
        for p in (wfile, sparse):
            if os.path.exists(p):
                os.unlink(p)
        remove_memcg(cg_path)
    print(f"  {MIN_FREE} restored: {read_min_free()} kB")

    results = {"machine": c.machine(), "rounds": rounds, "memcg_mib": a.memcg_mib, "kswapd_s": kswapd_s,
               "memcg_kind": cg_kind, "unclean_rounds": guard.clean.count(False), "warning": guard.note(),
               "agent_session": session}
    all_res = res
    res = {k: guard.pick(v) for k, v in res.items()}
    rows, out = [], {}
    for kind, label in (("memcg", "memcg: writer in a 64 MiB cgroup"), ("kswapd", "kswapd: sparse-file reader")):
        base, ag_rows = res[(kind, "none")], res[(kind, "agent")]
        ratios = [x["mib_s"] / b["mib_s"] for x, b in zip(ag_rows, base)]
        cpu_ratios = [x["cpu_ms_per_mib"] / b["cpu_ms_per_mib"] for x, b in zip(ag_rows, base)]
        pct = lambda xs: 100 * sum(x["agent_cpu_s"] for x in xs) / sum(x["wall_s"] for x in xs)  # noqa: E731
        o = {"none_mib_s": c.med(x["mib_s"] for x in base), "agent_mib_s": c.med(x["mib_s"] for x in ag_rows),
             "ratio": c.med(ratios), "ratio_spread": c.spread(ratios),
             "none_cpu_ms_per_mib": c.med(x["cpu_ms_per_mib"] for x in base),
             "agent_cpu_ms_per_mib": c.med(x["cpu_ms_per_mib"] for x in ag_rows),
             "cpu_ratio": c.med(cpu_ratios), "cpu_ratio_spread": c.spread(cpu_ratios),
             "agent_cpu_pct": pct(ag_rows), "agent_idle_cpu_pct": pct(base),
             "agent_cpu_pct_max_round": max(100 * x["agent_cpu_s"] / x["wall_s"] for x in ag_rows),
             "storm_s": c.med(x["secs"] for x in ag_rows + base),
             "steal_mib_none": c.med(x["steal_mib"] for x in base),
             "steal_mib_agent": c.med(x["steal_mib"] for x in ag_rows),
             "steal_kswapd_mib_none": c.med(x["steal_kswapd_mib"] for x in base),
             "steal_kswapd_mib_agent": c.med(x["steal_kswapd_mib"] for x in ag_rows),
             "allocstall_none": c.med(x["allocstall"] for x in base),
             "allocstall_agent": c.med(x["allocstall"] for x in ag_rows)}
        if kind == "kswapd":
            every = all_res[(kind, "agent")] + all_res[(kind, "none")]
            # kswapd's own rate: MiB reclaimed per second of kswapd CPU (the vmscan probes run in its context)
            eff = [(x["steal_kswapd_mib"] / x["kswapd_cpu_s"]) if x["kswapd_cpu_s"] else None for x in ag_rows]
            eff0 = [(x["steal_kswapd_mib"] / x["kswapd_cpu_s"]) if x["kswapd_cpu_s"] else None for x in base]
            eff_r = [a_ / b_ if a_ and b_ else None for a_, b_ in zip(eff, eff0)]
            o.update(min_free_kb=c.med(x["min_free_kb"] for x in every),
                     storms_after_busy_kswapd=sum(not x["kswapd_was_quiet"] for x in every),
                     storms_revived=sum(x["revived"] for x in every),
                     kswapd_gave_up_none=sum(x["kswapd_gave_up"] for x in base),
                     kswapd_gave_up_agent=sum(x["kswapd_gave_up"] for x in ag_rows),
                     kswapd_cpu_s_none=c.med(x["kswapd_cpu_s"] for x in base),
                     kswapd_cpu_s_agent=c.med(x["kswapd_cpu_s"] for x in ag_rows),
                     kswapd_mib_per_cpu_s_none=c.med(eff0), kswapd_mib_per_cpu_s_agent=c.med(eff),
                     kswapd_eff_ratio=c.med(eff_r), kswapd_eff_ratio_spread=c.spread(eff_r))
        out[kind] = o
        rows.append([label, f"{o['none_mib_s']:,.0f}", f"{o['agent_mib_s']:,.0f}", o["ratio"], o["ratio_spread"],
                     f"{o['none_cpu_ms_per_mib']:.3f}", f"{o['agent_cpu_ms_per_mib']:.3f}", o["cpu_ratio"],
                     f"{o['agent_cpu_pct']:.1f} ({o['agent_cpu_pct_max_round']:.0f})",
                     f"{o['agent_idle_cpu_pct']:.1f}"])
    results.update(out)
    c.print_table("throughput (median over rounds; ratio = agent / no agent, median of per-round ratios); "
                  "CPU = the storm's own CPU time per MiB",
                  ["storm", "none MiB/s", "agent MiB/s", "ratio", "spread", "CPU ms/MiB none", "agent", "CPU ratio",
                   "agent CPU % (max)", "idle %"], rows)
    print("  agent CPU %: the agent's threads during the agent storms, all rounds together (the highest round), "
          "% of one core; idle %: the same threads during the no-agent storms (probes detached: polling, ticks)")
    rows = []
    for kind in ("memcg", "kswapd"):
        o = out[kind]
        rows.append([kind, f"{o['storm_s']:.2f}", f"{o['steal_mib_none']:,.0f} / {o['steal_mib_agent']:,.0f}",
                     f"{o['steal_kswapd_mib_none']:,.0f} / {o['steal_kswapd_mib_agent']:,.0f}",
                     f"{o['allocstall_none']:.0f} / {o['allocstall_agent']:.0f}"])
    c.print_table("the pressure, per storm, from /proc/vmstat (median; no agent / agent)",
                  ["storm", "seconds", "MiB reclaimed", "by kswapd", "allocstall"], rows)
    k = out["kswapd"]
    print(f"  kswapd storms: kswapd CPU {k['kswapd_cpu_s_none']:.2f} / {k['kswapd_cpu_s_agent']:.2f} s per storm, "
          f"{k['kswapd_mib_per_cpu_s_none']:,.0f} / {k['kswapd_mib_per_cpu_s_agent']:,.0f} MiB reclaimed per kswapd "
          f"CPU second (ratio {k['kswapd_eff_ratio']:.3f}, {k['kswapd_eff_ratio_spread']}); kswapd gave up on the node "
          f"(node_unreclaimable) in {k['kswapd_gave_up_none']} / {k['kswapd_gave_up_agent']} storms; "
          f"{k['storms_revived']} storms began with a memcg write to wake it; min_free_kbytes raised to "
          f"~{k['min_free_kb'] / 1024 / 1024:.1f} GiB")
    produced = {"storm_episodes_opened": counter.started["hostagent.reclaim_storm"],
                "storm_episodes_by_scope": dict(counter.storm_scopes),
                "storm_episodes_closed": counter.ended["hostagent.reclaim_storm"], "still_open": still_open,
                "stall_spans": counter.ended["hostagent.reclaim.stall"], "request_spans": counter.ended["hostagent.request"],
                "requests_linked_to_a_storm": counter.linked_requests,
                "storms_in_agent_rounds": sum(len(all_res[(k, "agent")]) for k in ("memcg", "kswapd")) + 2}
    results["produced"] = produced
    results["per_round"] = {f"{k}:{cond}": v for (k, cond), v in all_res.items()}
    print(f"  the agent produced: {produced['storm_episodes_opened']} storm episodes "
          f"({', '.join(f'{v} {k}' for k, v in produced['storm_episodes_by_scope'].items()) or 'none'}; "
          f"{produced['storm_episodes_closed']} closed), {produced['stall_spans']} reclaim-stall spans, "
          f"{produced['request_spans']} request spans ({produced['requests_linked_to_a_storm']} linked to an episode) "
          f"from {produced['storms_in_agent_rounds']} storms with probes attached (statistics pass included); "
          f"records lost: {session['lost_kernel'] + session['lost_user']}")
    rows = []
    results["bpf_prog"] = {}
    for kind, (d, wall) in prog.items():
        results["bpf_prog"][kind] = {"wall_s": wall, **{tp: {"runs": n, "ns_per_run": t} for tp, (n, t) in d.items()}}
        for tp, (n, t) in sorted(d.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            rows.append([kind, tp, f"{n:,}", f"{t:.0f}", f"{100 * n * t / 1e9 / wall:.3f}"])
    c.print_table("the agent's BPF programs during one storm of each (kernel.bpf_stats_enabled)",
                  ["storm", "program", "runs", "ns/run", "% of a core"], rows)
    if guard.note():
        print(guard.note())
    results["summary"] = [
        {"what": "memcg storm: writer MiB/s (64 MiB cgroup)", "unit": "MiB/s", "none": out["memcg"]["none_mib_s"],
         "agent": out["memcg"]["agent_mib_s"], "added": None, "ratio": out["memcg"]["ratio"],
         "spread": out["memcg"]["ratio_spread"]},
        {"what": "kswapd storm: reader MiB/s", "unit": "MiB/s", "none": out["kswapd"]["none_mib_s"],
         "agent": out["kswapd"]["agent_mib_s"], "added": None, "ratio": out["kswapd"]["ratio"],
         "spread": out["kswapd"]["ratio_spread"]},
        {"what": "agent CPU during memcg storms", "unit": "% core", "none": out["memcg"]["agent_idle_cpu_pct"],
         "agent": out["memcg"]["agent_cpu_pct"], "added": None, "ratio": None, "spread": ""},
        {"what": "agent CPU during kswapd storms", "unit": "% core", "none": out["kswapd"]["agent_idle_cpu_pct"],
         "agent": out["kswapd"]["agent_cpu_pct"], "added": None, "ratio": None, "spread": ""},
    ]
    c.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
