#!/usr/bin/env python3
"""What the agent itself costs the host: its CPU (% of one core) and memory under a stated event mix.

The agent runs alone in a process of its own (bench/_agent_host.py: Agent(cfg).start() and its loop,
as `mcp-agent run` does, default settings unless --watch says otherwise, the control socket served),
so its CPU is that process's utime+stime from /proc/PID/stat, split by thread (/proc/PID/task/*/stat,
named by the Python thread each one is), and its memory is /proc/PID/smaps_rollup (RSS, PSS, anonymous).
Each event mix runs with the probes detached (the agent's threads still run: polling, the 1 s tick,
metric export) and attached, interleaved by rounds (order reversed every other round):
  idle         nothing but the host's own background
  marked       ~1,000 marked requests/s (bench/loops.c: 100 begin+end pairs from C every 100 ms)
  faults       a page-fault storm (mmap / touch / munmap 64 MiB, one CPU)
  switches     a context-switch storm (two processes ping-pong through pipes, one CPU)
  churn        ~100 short processes/s (fork + exec /bin/true)
  cuda         cuLaunchKernel in a loop into the test libcuda (tests/c/fake_libcuda.c, 20 us of work
               per launch; "detached" pauses the launch uprobes too, the governor duty-cycles them)
  memcg        memcg reclaim: a writer in a 64 MiB memory cgroup writes 512 MiB files back to back
Targets (issue 7): <= 2% of a core, <= 150 MB RSS. `--profile` adds a cProfile of the pipeline loop,
the metric reader and the CUDA finder for the whole run.

    sudo .venv/bin/python bench/bench_footprint.py [--quick] [--rounds N] [--seconds S] [--watch gpu,all]
                                                   [--mixes idle,marked,...] [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

MIXES = ("idle", "marked", "faults", "switches", "churn", "cuda", "memcg")
PIN_CPU = 1
CUDA_WORK_NS = 20000
TARGET_CPU_PCT, TARGET_RSS_MB = 2.0, 150.0
THREAD_LABELS = (  # Python thread name prefix -> what it is
    ("agent-", "pipeline: ring buffer, tick"),
    ("OtelBatchSpan", "span export"),
    ("OtelPeriodicExportingMetricReader", "metric export"),
    ("mcp-cuda-duty", "cuda: duty cycle"),
    ("mcp-cuda", "cuda: libcuda finder"),
    ("mcp-control", "control socket"),
)


def thread_label(name: str) -> str:
    for prefix, label in THREAD_LABELS:
        if name.startswith(prefix):
            return label
    return name


class Host:
    """bench/_agent_host.py in a child process."""

    def __init__(self, watch: str | None, profile: str | None):
        cmd = [c.agent_python(), str(c.BENCH / "_agent_host.py")] + (["--watch", watch] if watch else [])
        cmd += ["--profile", profile] if profile else []
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(c.REPO))
        self.info = self._read(timeout_hint="start")
        self.pid = self.p.pid

    def _read(self, timeout_hint: str = "") -> dict:
        while True:  # the agent may print notes on stdout before its answer
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"agent host died ({timeout_hint})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, *cmd) -> dict:
        self.p.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.p.stdin.flush()
        return self._read(cmd[0])

    def close(self) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


class Mixes:
    """The workloads; each runs for `secs` and returns what it did (events, per second)."""

    def __init__(self, secs: float, host: Host, tmp: str, wanted: list[str]):
        self.secs, self.host, self.tmp = secs, host, tmp
        self.binary = c.build_loops()
        self.driver = self.memcg = self.writer = None
        if "cuda" in wanted:
            import bench_cuda

            lib, drv = bench_cuda.build()
            self.driver = bench_cuda.Driver(drv, lib)
            self.driver.do("sym cuGraphLaunch 1")  # a CUDA call: the process is a GPU process now
            got = host.ask("cuda_scan", self.driver.pid)
            if not got.get("libs"):
                print("  note: the agent has no CUDA probes here; the cuda mix runs without them")
        if "memcg" in wanted:
            import bench_reclaim

            self.memcg, kind = bench_reclaim.make_memcg(f"mcp-bench-fp-{os.getpid()}")
            self.writer = bench_reclaim.Worker()
            self.writer.ask("join", os.path.join(self.memcg, "cgroup.procs"))
            self.wfile = os.path.join("/var/tmp", f"mcp-bench-fp-{os.getpid()}.bin")
            self.rid = 1 << 41

    def run(self, mix: str) -> dict:
        s = self.secs
        if mix == "idle":
            time.sleep(s)
            return {}
        if mix == "marked":
            t0 = time.monotonic()
            c.loops(self.binary, "marker", 100, max(1, int(s * 10)), 100000)
            return {"requests_per_s": 100 * max(1, int(s * 10)) / (time.monotonic() - t0)}
        if mix == "faults":
            pages, wall, minflt, _ = c.loops(self.binary, "faults", s, 64, 0, PIN_CPU)
            return {"faults_per_s": minflt / wall}
        if mix == "switches":
            _, wall, switches, _ = c.loops(self.binary, "pingpong", s, 0, PIN_CPU)
            return {"switches_per_s": switches / wall}
        if mix == "churn":
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < s:
                subprocess.run(["/bin/true"])
                n += 1
                time.sleep(max(0.0, t0 + n / 100 - time.monotonic()))
            return {"processes_per_s": n / (time.monotonic() - t0)}
        if mix == "cuda":
            if self.driver is None:
                return {}
            iters, ns = self.driver.do(f"loop {int(s * 1000)} {CUDA_WORK_NS}")
            return {"launches_per_s": iters / s}
        if mix == "memcg":
            mib, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < s:
                self.rid += 2
                try:
                    self.writer.ask("write", self.wfile, 512, 0, self.rid, "00-4bf92f3577b34da6a3ce929d0e0e4736-"
                                    "00f067aa0ba902b7-01")
                finally:
                    if os.path.exists(self.wfile):
                        os.unlink(self.wfile)
                mib += 512
            return {"mib_per_s": mib / (time.monotonic() - t0)}
        raise ValueError(mix)

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
        if self.writer is not None:
            self.writer.close()
        if self.memcg is not None:
            import bench_reclaim

            bench_reclaim.remove_memcg(self.memcg)


def measure(host: Host, mixes: Mixes, mix: str) -> dict:
    t0, w0 = c.thread_ticks(host.pid), time.monotonic()
    did = mixes.run(mix)
    t1, wall = c.thread_ticks(host.pid), time.monotonic() - w0
    names = host.ask("threads")
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for tid, (comm, u, s) in t1.items():
        _, u0, s0 = t0.get(tid, (comm, 0, 0))
        label = thread_label(names.get(str(tid), f"({comm})"))
        per[label][0] += (u - u0) / c.HZ
        per[label][1] += (s - s0) / c.HZ
    mem = c.proc_mem_kb(host.pid)
    return {"wall_s": wall, "cpu_s": sum(u + s for u, s in per.values()), "user_s": sum(u for u, _ in per.values()),
            "threads": {k: v for k, v in per.items()}, "rss_mb": mem["Rss"] / 1024, "pss_mb": mem["Pss"] / 1024,
            "anon_mb": mem.get("Anonymous", 0) / 1024, **did}


def run_watch(watch: str | None, wanted: list[str], rounds: int, secs: float, profile: str | None,
              guard: c.Guard, tmp: str) -> dict:
    host = Host(watch, profile)
    guard.exclude = {host.pid}
    label = watch or "default (gpu)"
    start_mem = c.proc_mem_kb(host.pid)
    print(f"  agent --watch {label}: pid {host.pid}, {len(host.info['probes'])} tracepoints"
          f"{', CUDA uprobes' if host.info.get('cuda') else ''}; RSS {start_mem['Rss'] / 1024:.0f} MB, "
          f"PSS {start_mem['Pss'] / 1024:.0f} MB after start", flush=True)
    res: dict[tuple[str, str], list[dict]] = defaultdict(list)
    mixes = Mixes(secs, host, tmp, wanted)
    try:
        time.sleep(2.0)  # the first ticks, the first metric export's set-up
        for r in range(rounds):
            guard.before()
            for mix in wanted:
                for cond in (("detached", "attached") if r % 2 == 0 else ("attached", "detached")):
                    host.ask("attach" if cond == "attached" else "detach")
                    time.sleep(0.3)
                    res[(mix, cond)].append(measure(host, mixes, mix))
            guard.after()
            print(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{m} {100 * res[(m, 'attached')][-1]['cpu_s'] / res[(m, 'attached')][-1]['wall_s']:.1f}%"
                for m in wanted), flush=True)
        stats = host.ask("stats")
    finally:
        mixes.close()
        host.close()
    out = {"watch": label, "start_rss_mb": start_mem["Rss"] / 1024, "start_pss_mb": start_mem["Pss"] / 1024,
           "start_anon_mb": start_mem.get("Anonymous", 0) / 1024, "session": stats, "mixes": {}}
    for mix in wanted:
        o = {}
        for cond in ("detached", "attached"):
            xs = guard.pick(res[(mix, cond)])
            wall = sum(x["wall_s"] for x in xs)
            threads: dict[str, float] = defaultdict(float)
            for x in xs:
                for k, (u, s) in x["threads"].items():
                    threads[k] += u + s
            o[cond] = {"cpu_pct": 100 * sum(x["cpu_s"] for x in xs) / wall,
                       "user_pct": 100 * sum(x["user_s"] for x in xs) / wall,
                       "cpu_pct_max_round": max(100 * x["cpu_s"] / x["wall_s"] for x in xs),
                       "threads_pct": {k: 100 * v / wall for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
                                       if v},
                       "rss_mb_max": max(x["rss_mb"] for x in xs), "pss_mb_max": max(x["pss_mb"] for x in xs),
                       "anon_mb_max": max(x["anon_mb"] for x in xs),
                       **{k: c.med(x[k] for x in xs) for k in xs[0] if k.endswith("_per_s")}}
        out["mixes"][mix] = o
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of 2 s windows, default watch only (~45 s)")
    ap.add_argument("--rounds", type=int, help="rounds; default 2, --quick 1")
    ap.add_argument("--seconds", type=float, help="seconds per window; default 3, --quick 2")
    ap.add_argument("--watch", help="agents to run, comma-separated process.watch modes; default gpu,all "
                                    "(--quick: gpu); gpu is the agent's default")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"default {','.join(MIXES)}")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the pipeline loop, the metric reader and the CUDA finder")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    c.require_root()
    c.ensure_project_python()
    rounds = a.rounds or (1 if a.quick else 2)
    secs = a.seconds or (2.0 if a.quick else 3.0)
    watches = (a.watch or ("gpu" if a.quick else "gpu,all")).split(",")
    wanted = [m for m in a.mixes.split(",") if m]
    bad = [m for m in wanted if m not in MIXES]
    if bad:
        sys.exit(f"error: unknown mix {bad[0]!r} (known: {', '.join(MIXES)})")
    warn = c.other_load_warning()
    if warn:
        print(warn)
    print(f"bench_footprint: {rounds} rounds of {secs:g} s windows per mix and condition; mixes {', '.join(wanted)}; "
          f"kernel {os.uname().release}, {os.cpu_count()} CPUs", flush=True)
    guard = c.Guard(10.0 if a.quick else 30.0)
    results = {"machine": c.machine(), "rounds": rounds, "seconds": secs, "agents": []}
    summary = []
    with tempfile.TemporaryDirectory(prefix="mcp-bench-fp-") as tmp:
        for w in watches:
            prof = os.path.join(tmp, f"profile-{w}.txt") if a.profile else None
            o = run_watch(None if w == "gpu" else w, wanted, rounds, secs, prof, guard, tmp)
            results["agents"].append(o)
            rows = []
            for mix, d in o["mixes"].items():
                de, at = d["detached"], d["attached"]
                rate = next((f"{v:,.0f} {k[:-6].replace('_', ' ')}/s" for k, v in at.items()
                             if k.endswith("_per_s")), "")
                top = ", ".join(f"{k} {v:.1f}" for k, v in list(at["threads_pct"].items())[:3])
                rows.append([mix, rate, f"{de['cpu_pct']:.2f}", f"{at['cpu_pct']:.2f}",
                             f"{at['cpu_pct_max_round']:.1f}",
                             f"{at['user_pct']:.2f}", f"{at['rss_mb_max']:.0f}", f"{at['pss_mb_max']:.0f}",
                             "yes" if at["cpu_pct"] <= TARGET_CPU_PCT and at["rss_mb_max"] <= TARGET_RSS_MB else "NO",
                             top])
                summary.append({"what": f"agent CPU, watch {o['watch']}, {mix}{' (' + rate + ')' if rate else ''}",
                                "unit": "% core", "none": de["cpu_pct"], "agent": at["cpu_pct"], "added": None,
                                "ratio": None, "spread": f"RSS {at['rss_mb_max']:.0f} MB"})
            c.print_table(f"agent --watch {o['watch']}: CPU % of one core (all rounds together), probes detached / "
                          f"attached; memory: the highest reading (MB); targets <= {TARGET_CPU_PCT:g}% and "
                          f"<= {TARGET_RSS_MB:.0f} MB RSS",
                          ["mix", "rate", "detached %", "attached %", "max round", "user %", "RSS", "PSS", "met",
                           "busiest threads (attached, %)"], rows)
            print(f"  after start: RSS {o['start_rss_mb']:.0f} MB, PSS {o['start_pss_mb']:.0f} MB, anonymous "
                  f"{o['start_anon_mb']:.0f} MB; session: {o['session']}")
            if prof and os.path.exists(prof):
                text = open(prof).read()
                o["profile"] = text
                print(f"\n  cProfile, watch {o['watch']} (whole run, cumulative):\n" + "\n".join(
                    "    " + ln for ln in text.splitlines() if ln.strip())[:12000])
    if guard.note():
        print(guard.note())
    results["warning"] = guard.note()
    results["summary"] = summary
    c.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
