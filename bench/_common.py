"""Shared by the benchmarks: root check, the native loops, the toggled agent, statistics, output.

Every benchmark compares conditions side by side in one run, interleaved by rounds (A B, B A, A B ...),
and reports the median of the per-round ratios with their spread: absolute times in these VMs drift by
tens of percent between minutes, ratios taken seconds apart much less.

The agent runs in the benchmark's process with its tracepoints toggled between conditions (see
ToggledAgent); every workload runs in a child process.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
HZ = os.sysconf("SC_CLK_TCK")


def require_root() -> None:
    if os.geteuid() != 0:
        sys.exit(f"error: {Path(sys.argv[0]).name} must run as root (the agent loads BPF programs); "
                 f"HINT: sudo {sys.executable} {' '.join(sys.argv)}")


def ensure_project_python() -> None:
    """Re-run under the project's venv when this interpreter cannot import mcp_hostagent."""
    try:
        import mcp_hostagent  # noqa: F401
    except ImportError:
        py = agent_python()
        if os.path.realpath(py) == os.path.realpath(sys.executable):
            sys.exit("error: mcp_hostagent is not importable; HINT: sudo make setup, then use .venv/bin/python")
        os.execv(py, [py, *sys.argv])


def agent_python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


# ---- the native loops ----

def build_loops() -> str:
    """Compile bench/loops.c (with bpf/mcp_records.h) once per source version; the binary's path."""
    src = BENCH / "loops.c"
    hdr = REPO / "bpf" / "mcp_records.h"
    digest = hashlib.sha256(src.read_bytes() + hdr.read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"mcp-bench-loops-{digest}"
    if not out.exists():
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            sys.exit("error: no C compiler (gcc) found; HINT: apt-get install gcc")
        tmp = out.with_suffix(f".{os.getpid()}")
        subprocess.run([cc, "-O2", "-Wall", f"-I{hdr.parent}", str(src), "-o", str(tmp)], check=True)
        tmp.rename(out)
    return str(out)


def loops(binary: str, *args) -> list[float]:
    """Run one loops command; its stdout as numbers."""
    r = subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"loops {' '.join(map(str, args))} failed ({r.returncode}): {r.stderr.strip()}")
    return [float(x) for x in r.stdout.split()]


# ---- the agent ----

class ToggledAgent:
    """The agent, started in this process, whose tracepoints can be detached and attached in milliseconds.

    Starting an agent takes seconds (Python imports, LLVM); the noise of these VMs drifts over seconds
    too. So each agent is started once (compiled, maps created, its pipeline thread polling the ring
    buffer as `mcp-agent run` does) and the benchmark switches conditions by detaching and attaching its
    tracepoints: "no agent" is no program attached anywhere, "agent" is every probe attached, as `run`
    leaves it. Workloads run in child processes, so they never wait for this process's GIL; the agent's
    CPU time is that of this process's threads other than the main one (which only waits for children).

        with ToggledAgent("all") as ag:
            with ag.attached(): ...
    """

    def __init__(self, watch: str | None = "all", overrides: dict | None = None):
        from mcp_hostagent.config import load_config
        from mcp_hostagent.registry import make_agent as Agent

        self._dir = tempfile.mkdtemp(prefix="mcp-bench-")
        ov = {"export.jsonl_path": os.path.join(self._dir, "telemetry.jsonl"), "status.enabled": False,
              # the benchmarks' markers are one uid and cgroup: measure the accepted path, not the refusal
              "requests.max_begins_per_s_per_uid": 10_000_000, "requests.max_begins_per_s_per_cgroup": 10_000_000}
        if watch is not None:  # None: the default (process.watch = gpu)
            ov["process.watch"] = watch
        ov.update(overrides or {})
        self.watch = watch or "default"
        self.agent = Agent(load_config(None, env={}, overrides=ov))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._probes: list[tuple[object, str, str]] = []  # (bpf, tracepoint, fn_name)
        self.is_attached = False

    def __enter__(self) -> "ToggledAgent":
        rep = self.agent.start()
        loaded = self.agent.loaded
        self.other_probes = []
        for spec in self.agent.plan.enabled():  # the attached ones
            only = loaded[0].bpf if len(loaded) == 1 else None  # one compiled unit holds every probe
            bpf = next((x.bpf for x in loaded if x.program == spec.program), only)
            if spec.kind == "tracepoint" and bpf is not None:
                self._probes.append((bpf, spec.tracepoint, spec.fn_name))
            else:  # attached by its own module: stays attached in every condition
                self.other_probes.append(spec.name)
        if self.other_probes:
            print(f"  note: {', '.join(self.other_probes)} stay attached in every condition (not tracepoints)",
                  flush=True)
        if not any(tp == "syscalls:sys_enter_ioctl" for _, tp, _ in self._probes):
            self.__exit__(None, None, None)
            raise RuntimeError(f"agent started without its marker probe: {rep.plan.counts()}")
        self.is_attached = True
        self._thread = threading.Thread(target=self.agent.run, args=(self._stop,), daemon=True,
                                        name=f"agent-{self.watch}")
        self._thread.start()
        self.detach()
        return self

    def probe_names(self) -> list[str]:
        return [tp for _, tp, _ in self._probes]

    def detach(self) -> None:
        # Each detach waits for an RCU grace period (~75 ms here); in parallel they share them.
        if self.is_attached:
            threads = [threading.Thread(target=bpf.detach_tracepoint, args=(tp.encode(),))
                       for bpf, tp, _ in self._probes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if self.agent.caps["cuda"].probes is not None:  # its ioctl and exit programs are tracepoints too
                self.agent.caps["cuda"].probes.set_tracepoints(False)
            # with sched_switch off, each CPU's slot (requests.bpf.c slice_take) goes stale: a request's
            # edge would count the detached time as CPU time
            slots = self.agent.bpf[b"cpu_run"]
            slots[ctypes.c_int(0)] = slots.Leaf()  # every CPU's, zeroed
            self.is_attached = False

    def attach(self) -> None:
        if not self.is_attached:
            for bpf, tp, fn in self._probes:
                bpf.attach_tracepoint(tp=tp.encode(), fn_name=fn.encode())
            if self.agent.caps["cuda"].probes is not None:
                self.agent.caps["cuda"].probes.set_tracepoints(True)
            self.is_attached = True

    @contextlib.contextmanager
    def attached(self):
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def prog_runs(self) -> dict[str, tuple[int, int]]:
        """{tracepoint: (run_cnt, run_time_ns)} of each probe's program, from its fdinfo; both stay 0
        unless kernel.bpf_stats_enabled is on (see bpf_run_stats)."""
        out = {}
        for bpf, tp, fn in self._probes:
            with open(f"/proc/self/fdinfo/{bpf.funcs[fn.encode()].fd}") as f:
                info = dict(ln.split(":\t", 1) for ln in f.read().splitlines() if ":\t" in ln)
            out[tp] = (int(info.get("run_cnt", 0)), int(info.get("run_time_ns", 0)))
        return out

    def stats(self) -> dict[str, int]:
        h = self.agent.health
        return {"requests": sum(h.requests.values()), "lost_kernel": h.kernel_lost(), "lost_user": h.user_lost,
                **{k: v for k, v in h.kernel_stats.items() if v and k != "rb_lost"},
                **{f"user_{k}": v for k, v in h.rejected.items() if v}}

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        self.agent.stop(timeout_s=3.0)  # drains, then detaches whatever is still attached
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def bpf_run_stats():
    """kernel.bpf_stats_enabled on for the block: the kernel then times every BPF program run (two
    clock reads each, so it is kept out of the timed comparisons)."""
    path = "/proc/sys/kernel/bpf_stats_enabled"
    with open(path) as f:
        old = f.read().strip()
    with open(path, "w") as f:
        f.write("1")
    try:
        yield
    finally:
        with open(path, "w") as f:
            f.write(old)


def runs_delta(before: dict, after: dict) -> dict[str, tuple[int, float]]:
    """{tracepoint: (runs, ns per run)} between two prog_runs() snapshots, for programs that ran."""
    out = {}
    for tp, (n1, t1) in after.items():
        n0, t0 = before.get(tp, (0, 0))
        if n1 > n0:
            out[tp] = (n1 - n0, (t1 - t0) / (n1 - n0))
    return out


def agent_cpu_s() -> float:
    """CPU seconds (user + system) of this process's threads but the main one: the agent's pipeline
    thread and the exporters' threads."""
    total = 0
    me = os.getpid()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:  # thread gone
            continue
    return total / HZ


def wait_idle(max_s: float = 5.0) -> None:
    """Wait until the agent's threads stop burning CPU (its backlog handled), up to max_s."""
    deadline = time.monotonic() + max_s
    last = agent_cpu_s()
    while time.monotonic() < deadline:
        time.sleep(0.15)
        now = agent_cpu_s()
        if now - last <= 0.015:  # at most 10% of a core over the interval: idle polling, a tick
            return
        last = now


class Phase:
    """Wall time and the agent's CPU time over a block: `with Phase() as ph: ...; ph.cpu_pct, ph.cpu_s`.

    Threads that ended inside the block take their CPU time with them; the agent's threads live as
    long as the benchmark."""

    def __enter__(self) -> "Phase":
        self._t0 = time.monotonic()
        self._c0 = agent_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.monotonic() - self._t0
        self.cpu_s = agent_cpu_s() - self._c0
        self.cpu_pct = 100.0 * self.cpu_s / self.wall_s


# ---- statistics and output ----

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def spread(xs) -> str:
    xs = [x for x in xs if x is not None]
    return f"{min(xs):.3g}..{max(xs):.3g}" if xs else "-"


_TRACING_PROG_TYPES = {"2", "5", "17", "26"}  # kprobe (also uprobes), tracepoint, raw_tracepoint, tracing


def foreign_bpf(exclude: frozenset[int] = frozenset()) -> list[str]:
    """Other processes holding tracing BPF programs ("pid comm"): they would tax the no-agent baseline.

    bcc keeps each program's fd open while attached; /proc/PID/fdinfo/FD of a program shows prog_type.
    """
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in exclude or int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            hit = False
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:bpf-prog":
                        continue
                    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                        m = re.search(r"^prog_type:\s*(\d+)", f.read(), re.M)
                    if m and m.group(1) in _TRACING_PROG_TYPES:
                        hit = True
                        break
                except OSError:
                    continue
            if hit:
                with open(f"/proc/{pid}/comm") as f:
                    found.append(f"{pid} {f.read().strip()}")
        except OSError:
            continue
    return found


class Guard:
    """Keeps other BPF tracers out of the numbers: another process holding tracing programs (a test
    run, a second agent) taxes every condition, baseline included, and its markers reach our agent.

    Before a round, wait for them to go (from a budget shared by the whole benchmark); after it, a
    round that saw one at either end is unclean. Medians use the clean rounds when at least half are.
    """

    def __init__(self, wait_budget_s: float = 30.0):
        self.budget_s = wait_budget_s
        self._seen: list[str] = []
        self.clean: list[bool] = []
        self.exclude: set[int] = set()  # our own agents in processes of their own

    def before(self) -> None:
        self._seen = foreign_bpf(frozenset(self.exclude))
        if self._seen and self.budget_s > 0:
            print(f"  waiting for {', '.join(self._seen)} to release its BPF programs...", flush=True)
            t0 = time.monotonic()
            while self._seen and time.monotonic() - t0 < self.budget_s:
                time.sleep(0.5)
                self._seen = foreign_bpf(frozenset(self.exclude))
            self.budget_s -= time.monotonic() - t0

    def after(self) -> bool:
        seen = self._seen or foreign_bpf(frozenset(self.exclude))
        self.clean.append(not seen)
        if seen:
            print(f"  (round unclean: tracing BPF programs held by {', '.join(seen)})", flush=True)
        return not seen

    def pick(self, rows: list) -> list:
        """The clean rounds' rows, if at least half the rounds are clean; else all of them."""
        keep = [r for r, ok in zip(rows, self.clean) if ok]
        return keep if 2 * len(keep) >= len(rows) else rows

    def note(self) -> str:
        bad = self.clean.count(False)
        if not bad:
            return ""
        used = "left out" if 2 * (len(self.clean) - bad) >= len(self.clean) else "KEPT (too few clean rounds)"
        return f"warning: {bad} of {len(self.clean)} rounds ran beside another BPF tracer: {used}"


def other_load_warning(seconds: float = 0.5) -> str | None:
    """A warning when something else keeps the CPUs busy: it would blur every number here."""
    def busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)
    b0, t0 = busy()
    time.sleep(seconds)
    b1, t1 = busy()
    pct = 100.0 * (b1 - b0) / max(1, t1 - t0) * os.cpu_count()
    if pct > 15:
        return f"warning: the machine was {pct:.0f}% busy (of one core) before the benchmark; results are noisier"
    return None


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in header]] + [[c if isinstance(c, str) else f"{c:.4g}" for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def machine() -> dict:
    u = os.uname()
    git = ["git", "-C", str(REPO)]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(git + ["status", "--porcelain", "--", "agent", "bpf"], capture_output=True,
                                    text=True).stdout.strip())
    except OSError:
        head, dirty = "", False
    return {"kernel": u.release, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "commit": head + (" + uncommitted agent/bpf changes" if dirty else "")}


# ---- the agent as its own process (`mcp-agent run`) ----

def agent_cmd() -> list[str]:
    """The `mcp-agent` entry point of the project's venv (what systemd runs), else `python -m`."""
    exe = REPO / ".venv" / "bin" / "mcp-agent"
    return [str(exe)] if exe.exists() else [agent_python(), "-m", "mcp_hostagent"]


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without agent/OTel settings and with no config file: the defaults."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MCP_AGENT_", "OTEL_")) and k != "BCC_KERNEL_SOURCE"}
    env["MCP_AGENT_CONFIG"] = os.devnull
    env.update(extra)
    return env


def notify_socket(tag: str):
    """What systemd listens on for a Type=notify service (tests/notify_listener.py): READY=1 etc.,
    each datagram stamped with its arrival time (CLOCK_MONOTONIC, shared with the agent)."""
    sys.path.insert(0, str(REPO / "tests"))
    from notify_listener import NotifySocket

    return NotifySocket(f"@mcp-bench-{tag}-{os.getpid()}-{time.monotonic_ns()}")


def probe_fds(pid: int) -> tuple[int, int] | None:
    """(BPF link fds, perf-event fds) the process holds now; None once it is gone. Each attached probe
    holds one (a tracepoint or uprobe_multi link, or a perf event), so their sum reaching the count
    the agent keeps is when every probe is attached."""
    d = f"/proc/{pid}/fd"
    links = perf = 0
    try:
        names = os.listdir(d)
    except OSError:
        return None
    for fd in names:
        try:
            target = os.readlink(os.path.join(d, fd))
        except OSError:  # closed meanwhile
            continue
        links += "bpf_link" in target
        perf += "perf_event" in target
    return links, perf


def proc_mem_kb(pid: int | str = "self") -> dict[str, int]:
    """Rss, Pss and their anon / file split (kB) from /proc/PID/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Anonymous", "Private_Clean",
                     "Private_Dirty", "Shared_Clean"):
                out[k] = int(v.split()[0])
    return out


def thread_ticks(pid: int | str = "self") -> dict[int, tuple[str, int, int]]:
    """tid -> (comm, utime, stime) in clock ticks, for every thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
            x = rest.split()
            out[int(tid)] = (head.split("(", 1)[1], int(x[11]), int(x[12]))
        except (OSError, IndexError):  # thread gone
            continue
    return out


def pctl(xs, q: float) -> float:
    """The q-quantile (0..1) of xs, by linear interpolation between order statistics."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


class PyWorker:
    """bench/_pyworker.py in a child process: `w.ask("pairs", 250, 8, 0.1)` -> numbers."""

    def __enter__(self) -> "PyWorker":
        self.proc = subprocess.Popen([agent_python(), str(BENCH / "_pyworker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        return self

    def ask(self, *cmd) -> list[float]:
        self.proc.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"python worker died on {cmd}")
        return [float(x) for x in line.split()]

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)
