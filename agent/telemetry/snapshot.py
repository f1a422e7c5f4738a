"""What `mcp-agent top` shows, as one immutable Snapshot built per agent tick, composed from one
section per capability (each capability's section.py: its host fields, its GPU fields, the rates of
its kernel counters, its part of a request's row, its findings).

The agent feeds a SnapshotBuilder on its own thread: on_request(fr, span) for each finished request,
on_tick(rows, agent) after each map read (the per-process counters, core/processes.py). Readers on
any other thread (the TUI, the control socket) call latest(): a frozen object replaced whole each
tick, never mutated, so reading it takes no lock and never waits on BPF or NVML. A section reads only
what its capability already keeps (NVML through its sampler's published snapshot: a hung GPU call
cannot stall a tick), and a section that fails costs its own fields for that tick, counted in
`errors`, never the snapshot.

Rates are differences of the kernel's cumulative per-process counters (proc_stats) between two
readings, over the monotonic time between them; a process's first reading has no rate yet. Request
latency percentiles are nearest-rank over the requests that ended in the last LATENCY_WINDOW_S.
Every string that came from a process (comm, command line, cgroup path) is sanitised here or in its
section, and the renderer sanitises again, since a snapshot may arrive over the socket.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shlex
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..core.identity import sanitize_text

log = logging.getLogger("mcp_hostagent")

SCHEMA = 1
LATENCY_WINDOW_S = 10.0  # p50/p99 over requests that ended this recently
RECENT_REQUESTS = 32  # finished requests kept per process for the expanded view
MAX_DURATIONS = 4096  # per process, within the latency window
MAX_PIDS = 1024  # processes with request history kept (LRU)
MAX_FINDINGS = 64
PROC_HISTORY_S = 60.0  # a process with no counters keeps its request history this long
SECTION_LOG_S = 30.0  # a failing section is logged at most this often (and counted always)


# --- the model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuView:
    index: int = 0
    uuid: str | None = None
    bus_id: str | None = None
    up: bool = True
    down_reason: str | None = None
    util_pct: float | None = None
    mem_util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    throttle: tuple[str, ...] = ()
    power_w: float | None = None
    temperature_c: int | None = None
    link_gen: int | None = None
    link_gen_max: int | None = None
    link_width: int | None = None
    link_width_max: int | None = None
    link_degraded: bool = False
    link_why: str | None = None  # the rule or the episode's causes when degraded
    replay_count: int | None = None
    aer_correctable: int | None = None  # summed over the GPU and the bridges on its path
    aer_nonfatal: int | None = None
    aer_fatal: int | None = None
    xid_count: int | None = None
    last_xid: int | None = None


@dataclass(frozen=True)
class KswapdView:
    node: int = 0
    awake: bool = False
    active_pct: float = 0.0  # share of the last tick it was awake


@dataclass(frozen=True)
class NicView:
    """One network interface as the netlink watcher last saw it."""

    name: str = ""
    admin_up: bool = False
    carrier: bool = False
    operstate: str = ""
    speed_mbps: int | None = None
    flaps: int = 0  # carrier comebacks seen within NIC_FLAP_WINDOW_S
    down_since_wall_ns: int | None = None  # the carrier went away while watched and is not back


@dataclass(frozen=True)
class HostView:
    hostname: str = ""
    kernel: str = ""
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_free_bytes: int | None = None
    psi_some_avg10: float | None = None  # memory PSI, % (None: kernel without PSI)
    psi_full_avg10: float | None = None
    kswapd: tuple[KswapdView, ...] = ()
    storm: bool = False
    storm_scopes: tuple[str, ...] = ()
    gpus: tuple[GpuView, ...] = ()
    xid_total: int | None = None
    nvml: str | None = None  # "ok", or why there are no GPU figures
    nics: tuple[NicView, ...] = ()
    nic: str | None = None  # "ok", or why there are no NIC figures


@dataclass(frozen=True)
class ProcView:
    """One process, or (pid None) one container's processes summed."""

    pid: int | None = None
    command: str = ""  # argv[0]'s basename and the arguments, as a person would type it
    name: str = ""  # executable name (or comm)
    command_line: str | None = None
    container_id: str | None = None
    pod_uid: str | None = None
    processes: int = 1
    gpus: tuple[int, ...] = ()
    marked: bool = False  # has ended at least one marked request while we watched
    req_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    requests_total: int = 0
    launches_per_s: float | None = None
    ctx_switch_us: float | None = None
    sync_ms_per_s: float | None = None
    ioctls_per_s: float | None = None
    faults_per_s: float | None = None
    reclaim_ms_per_s: float | None = None
    offcpu_pct: float | None = None  # off-CPU time as % of one core (threads summed: may pass 100)
    wait_pct: float | None = None  # the part of it runnable, waiting for a CPU (preempted): top's WAIT%


@dataclass(frozen=True)
class RequestView:
    pid: int = 0
    tid: int = 0
    request_id: str = ""
    end_reason: str = ""
    error: bool = False
    traceparent: str = ""
    end_wall_ns: int = 0
    duration_ms: float = 0.0
    faults: int = 0
    vcsw: int = 0
    ivcsw: int = 0
    offcpu_ms: float = 0.0
    reclaim_ms: float = 0.0
    stalls: int = 0
    launches: int = 0
    ctx_ops: int = 0
    ctx_ms: float = 0.0
    sync_ms: float = 0.0
    ioctls: int = 0


@dataclass(frozen=True)
class Finding:
    t_wall_ns: int = 0
    # reclaim_storm_open | reclaim_storm_close | link_degraded | link_restored | ctx_switch_heavy | xid |
    # nic_carrier_down | nic_carrier_up | nic_flapping | nic_speed_down | nic_speed_up
    kind: str = ""
    subject: str = ""  # scope, GPU, pid, or interface
    text: str = ""


@dataclass(frozen=True)
class AgentView:
    probes_attached: int = 0  # live: tracepoints attached, libcuda uprobe families armed or duty-cycled
    probes_total: int = 0
    lost_kernel: int = 0
    lost_user: int = 0
    requests_total: int = 0
    open_requests: int = 0


@dataclass(frozen=True)
class Snapshot:
    schema: int = SCHEMA
    source: str = "local"  # local (this process runs the probes) | socket (a running agent's)
    seq: int = 0
    t_wall_ns: int = 0
    interval_s: float = 0.0
    host: HostView = field(default_factory=HostView)
    processes: tuple[ProcView, ...] = ()
    containers: tuple[ProcView, ...] = ()
    findings: tuple[Finding, ...] = ()  # newest first
    requests: tuple[RequestView, ...] = ()  # recent finished requests, newest first per process
    agent: AgentView = field(default_factory=AgentView)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Snapshot":
        return _load(cls, d)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Snapshot":
        return cls.from_dict(json.loads(text))

    def with_source(self, source: str) -> "Snapshot":
        return dataclasses.replace(self, source=source)

    def requests_of(self, pid: int) -> list[RequestView]:
        return [r for r in self.requests if r.pid == pid]


_NESTED = {
    (Snapshot, "host"): HostView, (Snapshot, "processes"): ProcView, (Snapshot, "containers"): ProcView,
    (Snapshot, "findings"): Finding, (Snapshot, "requests"): RequestView, (Snapshot, "agent"): AgentView,
    (HostView, "kswapd"): KswapdView, (HostView, "gpus"): GpuView, (HostView, "nics"): NicView,
}


def _load(cls, d: Any):
    """A dataclass from its asdict() form: unknown keys ignored (a newer agent), lists -> tuples."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(d).__name__}")
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        sub = _NESTED.get((cls, f.name))
        if sub is not None and isinstance(v, (list, tuple)):
            v = tuple(_load(sub, x) for x in v)
        elif sub is not None:
            v = _load(sub, v)
        elif isinstance(v, list):
            v = tuple(v)
        kw[f.name] = v
    return cls(**kw)




# --- what a capability contributes ---------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """What a section is told at each tick."""

    now_ns: int  # monotonic
    dt_s: float  # since the previous tick (0 on the first)
    wall_ns: int
    to_wall: Any  # kernel-monotonic ns -> wall ns
    gpus: tuple = ()  # GpuView, merged from every section (findings() only)


@dataclass(frozen=True)
class ProcRow:
    """One process as a section sees it: the counters of this reading and of the last one."""

    pid: int
    command: str  # sanitised, for findings' text
    prev: Any  # decode.Counters of the previous reading, None on the first
    cur: Any  # decode.Counters now
    dt_s: float  # between the two readings (0 without a previous one)


class Section:
    """A capability's part of the snapshot. Every method is optional; each returns fields of the views
    above by name (or findings), and a field no section fills keeps its default."""

    def host(self, tick: Tick) -> dict:
        return {}

    def gpus(self, tick: Tick) -> dict:
        """GPU PCI address -> GpuView fields (`index` where the section numbers GPUs)."""
        return {}

    def process(self, row: ProcRow) -> dict:
        return {}

    def process_gpus(self, pid: int) -> tuple[int, ...]:
        return ()

    def request(self, fr, span) -> dict:
        """RequestView fields of a finished request (span: the SpanSpec it became)."""
        return {}

    def findings(self, tick: Tick) -> list:
        """Findings since the last tick."""
        return []


def deltas(row: ProcRow, fields) -> dict | None:
    """Each field's increase since the last reading; None without one, or when a counter went backwards
    (pid reused, the kernel entry re-created): no rate, not a negative one."""
    if row.prev is None or row.dt_s <= 0:
        return None
    d = {f: getattr(row.cur, f) - getattr(row.prev, f) for f in fields}
    return None if any(v < 0 for v in d.values()) else d


def finding(wall: int, kind: str, subject: str, text: str) -> "Finding":
    return Finding(wall, kind, sanitize_text(subject, 128), sanitize_text(text, 256))


# --- pure helpers --------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of an ascending list; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def short_command(command_line: str) -> str:
    """`/usr/bin/python3 -m vllm ...` -> `python3 -m vllm ...`: the path of argv[0] says least."""
    m = re.match(r"'([^']*)'(?=\s|$)", command_line)
    if m:  # shlex.join quoted argv[0] (a space or an escaped control character in it): keep it quoted
        base = m.group(1).rsplit("/", 1)[-1]
        return (shlex.quote(base) if base else m.group(0)) + command_line[m.end():]
    head, sep, rest = command_line.partition(" ")
    base = head.rsplit("/", 1)[-1] if not head.startswith("'") else head
    return (base or head) + sep + rest


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


# --- the builder ---------------------------------------------------------------------------------


@dataclass
class _ProcHistory:
    comm: str = ""
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))  # RequestView
    ends: deque = field(default_factory=lambda: deque(maxlen=MAX_DURATIONS))  # (end_mono_ns, dur_ns)
    total: int = 0
    since_tick: int = 0
    last_seen_ns: int = 0


class SnapshotBuilder:
    """Fed by the agent's thread only (on_request, on_tick); latest() and latest_json() from any thread."""

    def __init__(self, sections=(), source: str = "local", to_wall=None, clock=time.monotonic_ns,
                 wall=time.time_ns):
        """sections: the capabilities' Section objects, in the registry's order; to_wall: the agent's
        kernel-monotonic -> wall conversion (Timebase.to_wall_ns)."""
        self.sections = list(sections)
        self.source = source
        self._to_wall = to_wall
        self._clock, self._wall = clock, wall
        self._hist: OrderedDict[int, _ProcHistory] = OrderedDict()
        self._prev: dict[int, tuple[int, object]] = {}  # pid -> (reading mono ns, Counters)
        self._prev_tick_ns: int | None = None
        self._findings: deque[Finding] = deque(maxlen=MAX_FINDINGS)
        self._seq = 0
        self._latest = Snapshot(source=source, t_wall_ns=wall(), host=HostView(hostname=socket.gethostname(),
                                                                               kernel=os.uname().release))
        self.errors = 0
        self._logged: dict[str, float] = {}
        self._json_lock = threading.Lock()
        self._json: tuple[int, bytes] | None = None

    # ---- readers (any thread) ----
    def latest(self) -> Snapshot:
        return self._latest

    def latest_json(self) -> bytes:
        """The latest snapshot as one JSON line, serialised once per snapshot for every client."""
        snap = self._latest
        with self._json_lock:
            if self._json is None or self._json[0] != snap.seq:
                self._json = (snap.seq, snap.to_json().encode() + b"\n")
            return self._json[1]

    # ---- feeds ----
    def on_request(self, fr, span=None, ctx=None) -> None:
        h = self._history(fr.tgid)
        if not h.comm and fr.comm:
            h.comm = sanitize_text(bytes(fr.comm).split(b"\0", 1)[0], 64)
        fields = {}
        for sec in self.sections:
            fields.update(self._ask(sec, "request", {}, fr, span))
        wall = self._to_wall(fr.end_ns) if self._to_wall else self._wall()
        h.recent.append(RequestView(
            pid=fr.tgid, tid=fr.tid, request_id=f"{fr.request_id:016x}", end_reason=fr.end_reason,
            error=bool(fr.is_error), traceparent=fr.traceparent_state, end_wall_ns=wall,
            duration_ms=max(0, fr.end_ns - fr.begin_ns) / 1e6, **_known(RequestView, fields)))
        h.ends.append((fr.end_ns, max(0, fr.end_ns - fr.begin_ns)))
        h.total += 1
        h.since_tick += 1
        h.last_seen_ns = self._clock()

    def on_tick(self, rows: Mapping, agent: "AgentView" = None) -> None:
        """Build and publish the next snapshot. rows: pid -> (identity attributes, cumulative Counters)."""
        now, wall = self._clock(), self._wall()
        dt = (now - self._prev_tick_ns) / 1e9 if self._prev_tick_ns is not None else 0.0
        self._prev_tick_ns = now
        tick = Tick(now, dt, wall, self._to_wall or (lambda ns: wall))
        gpus = self._gpus(tick)
        tick = dataclasses.replace(tick, gpus=gpus)
        host = {"hostname": sanitize_text(socket.gethostname(), 64), "kernel": os.uname().release, "gpus": gpus}
        for sec in self.sections:
            host.update(self._ask(sec, "host", {}, tick))
        procs = self._processes(rows or {}, now, dt)
        for sec in self.sections:
            for f in self._ask(sec, "findings", [], tick):
                self._findings.append(f)
        containers = self._containers(procs, now)
        recent = tuple(r for pid in (p.pid for p in procs) if pid in self._hist
                       for r in reversed(self._hist[pid].recent))
        self._seq += 1
        self._latest = Snapshot(
            source=self.source, seq=self._seq, t_wall_ns=wall, interval_s=round(dt, 3),
            host=HostView(**_known(HostView, host)), processes=tuple(procs), containers=tuple(containers),
            findings=tuple(reversed(self._findings)), requests=recent, agent=agent or AgentView())

    # ---- parts ----
    def _ask(self, sec, what: str, empty, *args):
        """One section's answer; a failure costs its part of this tick only, counted and logged at most
        every SECTION_LOG_S: the view must not stop the agent."""
        try:
            return getattr(sec, what)(*args)
        except Exception:  # noqa: BLE001 -- counted
            self.errors += 1
            key = f"{type(sec).__name__}.{what}"
            if time.monotonic() - self._logged.get(key, float("-inf")) > SECTION_LOG_S:
                self._logged[key] = time.monotonic()
                log.exception("snapshot section %s failed (counted; the snapshot goes on)", key)
            return empty

    def _gpus(self, tick: Tick) -> tuple[GpuView, ...]:
        """Every section's fields of each GPU, by PCI address; GPUs a section numbered come first, by
        index, then those only sysfs knows (no NVML), numbered after them."""
        by: dict[str, dict] = {}
        for sec in self.sections:
            for key, fields in self._ask(sec, "gpus", {}, tick).items():
                by.setdefault(key, {}).update(fields)
        numbered = sorted((f for f in by.items() if f[1].get("index") is not None), key=lambda kv: kv[1]["index"])
        rest = sorted(k for k, f in by.items() if f.get("index") is None)
        out = [GpuView(**_known(GpuView, {"bus_id": k, **f})) for k, f in numbered]
        for n, k in enumerate(rest):
            out.append(GpuView(**_known(GpuView, {"bus_id": k, **by[k], "index": len(numbered) + n})))
        return tuple(out)

    def _history(self, pid: int) -> _ProcHistory:
        h = self._hist.get(pid)
        if h is None:
            h = self._hist[pid] = _ProcHistory()
            while len(self._hist) > MAX_PIDS:
                self._hist.popitem(last=False)
        self._hist.move_to_end(pid)
        return h

    def _processes(self, rows: Mapping, now: int, tick_dt: float) -> list[ProcView]:
        cutoff = now - int(LATENCY_WINDOW_S * 1e9)
        out, prev = [], self._prev
        self._prev = {}
        pids = list(rows) + [p for p, h in self._hist.items()
                             if p not in rows and h.total and now - h.last_seen_ns < PROC_HISTORY_S * 1e9]
        for pid in pids:
            attrs, counters = rows.get(pid, ({}, None))
            h = self._hist.get(pid)
            p = prev.get(pid)
            if counters is not None:
                self._prev[pid] = (now, counters)
                if h is not None:
                    h.last_seen_ns = now
            req_s = p50 = p99 = None
            if h is not None:
                while h.ends and h.ends[0][0] < cutoff:
                    h.ends.popleft()
                durs = sorted(d / 1e6 for _, d in h.ends)
                p50, p99 = percentile(durs, 50), percentile(durs, 99)
                # requests ended since the last tick; on the first tick, the latency window's average
                req_s = h.since_tick / tick_dt if tick_dt > 0 else len(h.ends) / LATENCY_WINDOW_S
                h.since_tick = 0
            name = attrs.get("process.executable.name") or (h.comm if h else "") or ""
            cmdline = attrs.get("process.command_line")
            command = sanitize_text(short_command(cmdline) if cmdline else name, 256)
            fields: dict = {}
            if counters is not None:
                row = ProcRow(pid, command, p[1] if p else None, counters, (now - p[0]) / 1e9 if p else 0.0)
                for sec in self.sections:
                    fields.update(self._ask(sec, "process", {}, row))
            gpus: tuple = ()
            for sec in self.sections:
                gpus = gpus or tuple(self._ask(sec, "process_gpus", (), pid))
            ctr = attrs.get("container.id")
            out.append(ProcView(
                pid=pid, command=command, name=sanitize_text(name, 64),
                command_line=sanitize_text(cmdline, 1024) if cmdline else None,
                container_id=sanitize_text(ctr, 64) if ctr else None,
                pod_uid=sanitize_text(attrs["k8s.pod.uid"], 64) if attrs.get("k8s.pod.uid") else None,
                gpus=gpus, marked=bool(h and h.total), req_per_s=_r(req_s), p50_ms=_r(p50, 3), p99_ms=_r(p99, 3),
                requests_total=h.total if h else 0,
                **{k: _r(v) if isinstance(v, float) else v for k, v in _known(ProcView, fields).items()}))
        for pid in [p for p, h in self._hist.items() if p not in rows and now - h.last_seen_ns > PROC_HISTORY_S * 1e9]:
            del self._hist[pid]
        return out

    def _containers(self, procs: list[ProcView], now: int) -> list[ProcView]:
        groups: dict[str, list[ProcView]] = {}
        for p in procs:
            groups.setdefault(p.container_id or "", []).append(p)
        cutoff = now - int(LATENCY_WINDOW_S * 1e9)
        out = []
        for cid, members in groups.items():
            durs = sorted(d / 1e6 for p in members if p.pid in self._hist
                          for t, d in self._hist[p.pid].ends if t >= cutoff)

            def total(attr):
                vals = [getattr(p, attr) for p in members if getattr(p, attr) is not None]
                return _r(sum(vals)) if vals else None

            ctx = [p.ctx_switch_us for p in members if p.ctx_switch_us is not None]
            out.append(ProcView(
                pid=None, command=f"{len(members)} process{'es' if len(members) > 1 else ''}",
                container_id=cid or None, pod_uid=next((p.pod_uid for p in members if p.pod_uid), None),
                processes=len(members), gpus=tuple(sorted({g for p in members for g in p.gpus})),
                marked=any(p.marked for p in members), req_per_s=total("req_per_s"),
                p50_ms=_r(percentile(durs, 50), 3), p99_ms=_r(percentile(durs, 99), 3),
                requests_total=sum(p.requests_total for p in members), launches_per_s=total("launches_per_s"),
                ctx_switch_us=_r(max(ctx)) if ctx else None, sync_ms_per_s=total("sync_ms_per_s"),
                ioctls_per_s=total("ioctls_per_s"), faults_per_s=total("faults_per_s"),
                reclaim_ms_per_s=total("reclaim_ms_per_s"), offcpu_pct=total("offcpu_pct"),
                wait_pct=total("wait_pct")))
        return out


def _known(view, fields: dict) -> dict:
    """The fields a view has (a section's others are its own business: a newer capability's)."""
    names = _FIELDS.get(view)
    if names is None:
        names = _FIELDS[view] = {f.name for f in dataclasses.fields(view)}
    return {k: v for k, v in fields.items() if k in names}


_FIELDS: dict = {}
