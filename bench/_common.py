"""Shared by the benchmarks: root check, the native loops, the agent as a subprocess, statistics.

Every benchmark compares conditions side by side in one run, interleaved by rounds (A B, B A, A B ...),
and reports the median of the per-round ratios with their spread: absolute times in these VMs drift by
tens of percent between minutes, ratios taken seconds apart much less.

The agent runs as a subprocess (`python -m mcp_hostagent run`), as in production: its Python threads
do not share the benchmark's GIL, and its CPU time is read from /proc/PID/stat.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
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

class AgentProc:
    """`mcp-agent run` as a subprocess; `with AgentProc(watch="all") as a:` waits until the probes are attached."""

    def __init__(self, watch: str = "all", env: dict[str, str] | None = None, ready_timeout_s: float = 90.0):
        self.watch = watch
        self.extra_env = env or {}
        self.ready_timeout_s = ready_timeout_s
        self.lines: list[str] = []
        self.stopped: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._dir = tempfile.mkdtemp(prefix="mcp-bench-")

    def __enter__(self) -> "AgentProc":
        env = {k: v for k, v in os.environ.items() if not k.startswith("MCP_AGENT_")}
        env.update(self.extra_env)
        cmd = [agent_python(), "-m", "mcp_hostagent", "run", "--watch", self.watch,
               "--jsonl", os.path.join(self._dir, "telemetry.jsonl"), "--no-status", "--strict"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=self._dir)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._kill()
                tail = " | ".join(self.lines[-5:])
                raise RuntimeError(f"agent did not start (watch={self.watch}): {tail or 'no output'}")
        if not any(re.search(r"probes \d+ attached, 0 missing", ln) for ln in self.lines):
            self._kill()
            raise RuntimeError("agent started without all its probes: " + " | ".join(self.lines[-5:]))
        time.sleep(0.3)  # its first tick (map reads, watch scan) is start-up, not steady state
        return self

    def _read(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            if "mark requests:" in line:
                self._ready.set()

    def cpu_s(self) -> float:
        """utime + stime of the agent process (all its threads), in seconds."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / HZ

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self._kill()
        time.sleep(0.05)  # the reader thread takes the last line
        last = next((ln for ln in reversed(self.lines) if ln.startswith("stopped:")), "")
        for key, pat in (("requests", r"requests (\d+)"), ("lost_kernel", r"lost kernel (\d+)"),
                         ("lost_user", r"user (\d+)"), ("rejected", r"rejected (\d+)"),
                         ("spans_dropped", r"dropped (\d+)")):
            m = re.search(pat, last)
            if m:
                self.stopped[key] = int(m.group(1))


class Phase:
    """Wall time and agent CPU over a block: `with Phase(agent) as ph: ...; ph.cpu_pct`."""

    def __init__(self, agent: AgentProc | None):
        self.agent = agent
        self.cpu_pct: float | None = None
        self.wall_s = 0.0

    def __enter__(self) -> "Phase":
        self._t0 = time.monotonic()
        self._c0 = self.agent.cpu_s() if self.agent else 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.monotonic() - self._t0
        if self.agent:
            self.cpu_pct = 100.0 * (self.agent.cpu_s() - self._c0) / self.wall_s


# ---- statistics and output ----

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def spread(xs) -> str:
    xs = [x for x in xs if x is not None]
    return f"{min(xs):.3g}..{max(xs):.3g}" if xs else "-"


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
    return {"kernel": u.release, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M %Z")}
