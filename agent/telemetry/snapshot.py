"""What `mcp-agent top` shows, as one immutable Snapshot built per agent tick.

The agent feeds a SnapshotBuilder on its own thread: on_request(fr) for each finished request,
on_tick(state) after each map read (per-process counters, kswapd, storms, NVML's latest samples).
Readers on any other thread (the TUI, the control socket) call latest(): a frozen object replaced
whole each tick, never mutated, so reading it takes no lock and never waits on BPF or NVML. NVML
is read only through the sampler's published snapshot() (its own threads make the calls), so a hung
GPU call cannot stall a tick either.

Rates are differences of the kernel's cumulative per-process counters (proc_stats) between two
readings, over the monotonic time between them; a process's first reading has no rate yet. Request
latency percentiles are nearest-rank over the requests that ended in the last LATENCY_WINDOW_S.
Every string that came from a process (comm, command line, cgroup path) is sanitised here, and the
renderer sanitises again, since a snapshot may arrive over the socket.
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
from ..cuda.steps import FINDING_SHARES
from ..nic.netlink import NIC_FLAP_WINDOW_S, NIC_FLAPPING
from ..numa import capability as numa
from ..pcie.episodes import LINK_BUSY_UTIL_PCT, link_degraded
from ..reclaim import memstat

log = logging.getLogger("mcp_hostagent")

SCHEMA = 1
LATENCY_WINDOW_S = 10.0  # p50/p99 over requests that ended this recently
RECENT_REQUESTS = 32  # finished requests kept per process for the expanded view
MAX_DURATIONS = 4096  # per process, within the latency window
MAX_PIDS = 1024  # processes with request history kept (LRU)
MAX_FINDINGS = 64
PROC_HISTORY_S = 60.0  # a process with no counters keeps its request history this long

# "Context-switch heavy": CUDA context push/pop/set time of at least the share of wall time that
# makes a request span's cuda.ctx_switch_heavy finding (5%: 50 ms per second, summed over the
# process's threads), one rule for both. Cleared (hysteresis) below half of it.
CTX_HEAVY_MS_PER_S = FINDING_SHARES["cuda.ctx_switch_heavy"][1] * 1000
MAX_NICS = 256  # interfaces listed in a snapshot (a node with many pods has a veth per pod)

LAUNCH_FIELDS = ("cu_launch", "cu_launch_ptsz", "cu_launch_ex", "cu_launch_ex_ptsz", "cu_graph_launch")


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
class TickState:
    """What the agent hands the builder once a tick: plain state of the capabilities, read here on the
    agent's thread only (nothing in it is mutated while the builder reads it)."""

    proc_rows: Mapping = field(default_factory=dict)  # pid -> (identity attributes, cumulative Counters)
    kswapd: Any = None  # reclaim.rule.KswapdTracker
    open_storms: tuple = ()  # reclaim.rule.Episode, open
    gpu: Any = None  # gpuhealth.GpuHealth: NVML sampler and sources, Xid events and counts
    nvml: Any = None  # an NVML sampler when there is no GpuHealth (tests, fixtures)
    pcie: Any = None  # pcie.Pcie: the last sysfs snapshot of the GPUs' links (last_pcie)
    nic: Any = None  # nic.Nic: drained link events, the watcher's links, its source state
    to_wall: Any = None  # kernel-monotonic ns -> wall ns
    agent: AgentView = field(default_factory=AgentView)


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


# --- pure helpers --------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of an ascending list; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _c(counters, name: str) -> int:
    return getattr(counters, name, 0) or 0


def counter_rates(prev, cur, dt_s: float) -> dict[str, float | None]:
    """Per-second rates between two cumulative Counters readings of one process. A counter that went
    backwards (pid reused, the kernel entry re-created) means no rate, not a negative one."""
    keys = ("launches_per_s", "ctx_switch_us", "sync_ms_per_s", "ioctls_per_s", "faults_per_s",
            "reclaim_ms_per_s", "offcpu_pct", "wait_pct")
    if prev is None or dt_s <= 0:
        return dict.fromkeys(keys)
    d = {}
    for name in ("faults", "offcpu_ns", "offcpu_runnable_ns", "wakeup_wait_ns", "direct_reclaim_ns", "memcg_reclaim_ns", "cu_ctx_ops", "cu_ctx_ns",
                 "cu_sync_ns", "nv_ioctls", *LAUNCH_FIELDS):
        d[name] = _c(cur, name) - _c(prev, name)
        if d[name] < 0:
            return dict.fromkeys(keys)
    return {
        "launches_per_s": sum(d[f] for f in LAUNCH_FIELDS) / dt_s,
        "ctx_switch_us": d["cu_ctx_ns"] / d["cu_ctx_ops"] / 1e3 if d["cu_ctx_ops"] else None,
        "sync_ms_per_s": d["cu_sync_ns"] / 1e6 / dt_s,
        "ioctls_per_s": d["nv_ioctls"] / dt_s,
        "faults_per_s": d["faults"] / dt_s,
        "reclaim_ms_per_s": (d["direct_reclaim_ns"] + d["memcg_reclaim_ns"]) / 1e6 / dt_s,
        "offcpu_pct": d["offcpu_ns"] / 1e9 / dt_s * 100,
        "wait_pct": (d["offcpu_runnable_ns"] + d["wakeup_wait_ns"]) / 1e9 / dt_s * 100,
    }


def ctx_ms_per_s(prev, cur, dt_s: float) -> float:
    if prev is None or dt_s <= 0:
        return 0.0
    return max(0, _c(cur, "cu_ctx_ns") - _c(prev, "cu_ctx_ns")) / 1e6 / dt_s


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo `Name:   123 kB` lines -> bytes (HugePages_* counts stay counts)."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def short_command(command_line: str) -> str:
    """`/usr/bin/python3 -m vllm ...` -> `python3 -m vllm ...`: the path of argv[0] says least."""
    m = re.match(r"'([^']*)'(?=\s|$)", command_line)
    if m:  # shlex.join quoted argv[0] (a space or an escaped control character in it): keep it quoted
        base = m.group(1).rsplit("/", 1)[-1]
        return (shlex.quote(base) if base else m.group(0)) + command_line[m.end():]
    head, sep, rest = command_line.partition(" ")
    base = head.rsplit("/", 1)[-1] if not head.startswith("'") else head
    return (base or head) + sep + rest


def request_view(fr, wall_ns: int) -> RequestView:
    c = fr.counters
    return RequestView(
        pid=fr.tgid, tid=fr.tid, request_id=f"{fr.request_id:016x}", end_reason=fr.end_reason,
        error=bool(fr.is_error), traceparent=fr.traceparent_state, end_wall_ns=wall_ns,
        duration_ms=max(0, fr.end_ns - fr.begin_ns) / 1e6, faults=_c(c, "faults"), vcsw=_c(c, "vcsw"),
        ivcsw=_c(c, "ivcsw"), offcpu_ms=_c(c, "offcpu_ns") / 1e6,
        reclaim_ms=(_c(c, "direct_reclaim_ns") + _c(c, "memcg_reclaim_ns")) / 1e6, stalls=len(fr.stalls),
        launches=sum(_c(c, f) for f in LAUNCH_FIELDS), ctx_ops=_c(c, "cu_ctx_ops"), ctx_ms=_c(c, "cu_ctx_ns") / 1e6,
        sync_ms=_c(c, "cu_sync_ns") / 1e6, ioctls=_c(c, "nv_ioctls"))


def _lo(a, b):
    return b if a is None else a if b is None else min(a, b)


def _hi(a, b):
    return b if a is None else a if b is None else max(a, b)


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
    """Fed by the agent's thread only (on_request, on_tick, on_pcie, on_link_episode); on_xid may be
    called from NVML's event thread. latest() and latest_json() from any thread."""

    def __init__(self, proc_root: str = "/proc", sys_root: str = "/sys", source: str = "local",
                 to_wall=None, clock=time.monotonic_ns, wall=time.time_ns, busy_util_pct: float = LINK_BUSY_UTIL_PCT):
        """to_wall: the agent's kernel-monotonic -> wall conversion (Timebase.to_wall_ns).
        busy_util_pct: the pcie.busy_util_pct setting (link_degraded)."""
        self.proc_root, self.sys_root, self.source = proc_root, sys_root, source
        self.busy_util_pct = busy_util_pct
        self._to_wall = to_wall
        self._clock, self._wall = clock, wall
        self._hist: OrderedDict[int, _ProcHistory] = OrderedDict()
        self._prev: dict[int, tuple[int, object]] = {}  # pid -> (reading mono ns, Counters)
        self._prev_tick_ns: int | None = None
        self._findings: deque[Finding] = deque(maxlen=MAX_FINDINGS)
        self._storms: dict[int, object] = {}  # id(episode) -> open Episode seen last tick
        self._ctx_heavy: set[int] = set()
        self._degraded: dict[str, str] = {}  # GPU key -> why, last tick
        self._episodes: dict[str, object] = {}  # GPU bdf -> open pcie.LinkEpisode
        self._pcie = None
        self._xids: deque = deque(maxlen=1024)  # from another thread: drained in on_tick
        self._xid_seen: set[int] = set()
        self._xid_by_gpu: dict[int | str, list[int]] = {}  # gpu -> [count, last xid]
        self._nic_last = None  # the newest netlink.LinkEvent taken from Nic.nic_events
        self._nic_down: dict[str, int] = {}  # interface -> wall ns its carrier went away
        self._nic_flaps: dict[str, deque] = {}  # interface -> monotonic ns of carrier comebacks
        self._nodes = numa.nodes(sys_root)
        self._seq = 0
        self._latest = Snapshot(source=source, t_wall_ns=wall(), host=HostView(hostname=socket.gethostname(),
                                                                               kernel=os.uname().release))
        self.errors = 0
        self._last_error_log = 0.0
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
    def on_request(self, fr, ctx=None) -> None:
        h = self._history(fr.tgid)
        if not h.comm and fr.comm:
            h.comm = sanitize_text(bytes(fr.comm).split(b"\0", 1)[0], 64)
        h.recent.append(request_view(fr, self._to_wall(fr.end_ns) if self._to_wall else self._wall()))
        h.ends.append((fr.end_ns, max(0, fr.end_ns - fr.begin_ns)))
        h.total += 1
        h.since_tick += 1
        h.last_seen_ns = self._clock()

    def on_pcie(self, snap) -> None:
        """The latest pcie.PcieSnapshot (sysfs link state and AER counters of GPUs and their bridges)."""
        self._pcie = snap

    def on_link_episode(self, ep) -> None:
        """A pcie.LinkEpisode from the downtraining rule: open ones mark their GPU degraded."""
        if ep.event == "closed":
            self._episodes.pop(ep.gpu_bdf, None)
        else:
            self._episodes[ep.gpu_bdf] = ep

    def _nic_events(self, nic, to_wall) -> None:
        """Findings from the LinkEvents the NIC capability drained since the last tick (a bounded deque, fed on
        this thread: the ones after the newest seen are new; all of them when that one has left)."""
        events = list(getattr(nic, "nic_events", ()) or ())
        new = []
        for ev in reversed(events):
            if ev is self._nic_last:
                break
            new.append(ev)
        if events:
            self._nic_last = events[-1]
        set_down = set()
        for ev in reversed(new):
            name = sanitize_text(ev.ifname, 64)
            t = to_wall(ev.t_ns)
            if ev.kind == "admin_down":
                set_down.add((ev.ifname, ev.t_ns))  # one message: said with its carrier_down
            elif ev.kind == "carrier_down":
                self._nic_down[name] = t
                how = " (set down)" if (ev.ifname, ev.t_ns) in set_down else ""
                self._find(t, "nic_carrier_down", name,
                           f"NIC {name} carrier down{how}, operstate {ev.operstate or '?'}")
            elif ev.kind == "carrier_up":
                down_at = self._nic_down.pop(name, None)
                if not ev.flaps_in_window and down_at is None:
                    continue  # a new interface coming up (a pod's veth), not a link coming back
                q = self._nic_flaps.setdefault(name, deque(maxlen=64))
                q.append(ev.t_ns)
                n = ev.flaps_in_window or 1
                speed = f" at {ev.speed_mbps} Mb/s" if ev.speed_mbps else ""
                after = f" after {max(0, t - down_at) / 1e9:.1f}s" if down_at is not None else ""
                text = (f"carrier up{speed}{after}; {n} flap{'s' if n > 1 else ''} in "
                        f"{NIC_FLAP_WINDOW_S:.0f}s")
                if n >= NIC_FLAPPING:
                    self._find(t, "nic_flapping", name, f"NIC {name} flapping: {text}")
                else:
                    self._find(t, "nic_carrier_up", name, f"NIC {name} {text}")
            elif ev.kind == "speed_change":
                lower = (ev.speed_mbps or 0) < (ev.prev_speed_mbps or 0)
                self._find(t, "nic_speed_down" if lower else "nic_speed_up", name,
                           f"NIC {name} speed {ev.prev_speed_mbps or '?'} -> {ev.speed_mbps or '?'} Mb/s")
            elif ev.kind == "removed":
                self._nic_down.pop(name, None)
                self._nic_flaps.pop(name, None)

    def _nics(self, nic, now: int) -> tuple[NicView, ...]:
        watcher = getattr(nic, "nics", None)
        if watcher is None:
            return ()
        out = []
        for st in sorted(watcher.links().values(), key=lambda x: x.ifname)[:MAX_NICS]:
            name = sanitize_text(st.ifname, 64)
            q = self._nic_flaps.get(name, ())
            flaps = sum(1 for t in q if now - t <= NIC_FLAP_WINDOW_S * 1e9)
            out.append(NicView(name=name, admin_up=st.admin_up, carrier=st.carrier,
                               operstate=sanitize_text(st.operstate, 16), speed_mbps=st.speed_mbps, flaps=flaps,
                               down_since_wall_ns=self._nic_down.get(name) if not st.carrier else None))
        return tuple(out)

    def on_xid(self, ev) -> None:
        """An nvml.XidEvent (safe from the watcher's thread: deque.append is atomic)."""
        self._xids.append(ev)

    def on_tick(self, state: "TickState") -> None:
        """Build and publish the next snapshot from the agent's state after a map read. A failure
        keeps the previous snapshot and is logged at most every 30 s: the view must not stop the agent."""
        try:
            self._build(state)
        except Exception:
            self.errors += 1
            if time.monotonic() - self._last_error_log > 30:
                self._last_error_log = time.monotonic()
                log.exception("building the top snapshot failed (%d so far)", self.errors)

    def _build(self, state: "TickState") -> None:
        now = self._clock()
        dt = (now - self._prev_tick_ns) / 1e9 if self._prev_tick_ns else 0.0
        self._prev_tick_ns = now
        wall = self._wall()
        gh = state.gpu  # gpuhealth.GpuHealth: NVML sampler, Xid watcher
        nvml = state.nvml or getattr(gh, "sampler", None)
        if getattr(state.pcie, "last_pcie", None) is not None:
            self._pcie = state.pcie.last_pcie
        if gh is not None:
            recent = list(getattr(gh, "xids", ()))  # a bounded deque of XidEvents: take the new ones
            seen = {id(e) for e in recent}
            self._xids.extend(e for e in recent if id(e) not in self._xid_seen)
            self._xid_seen = seen
        samples = {}
        if nvml is not None and hasattr(nvml, "snapshot"):
            try:
                samples = dict(nvml.snapshot())
            except Exception:  # a sampler in a bad state must not cost the tick
                samples = {}
        host = self._host(state, dt, samples, nvml, wall)
        rows = state.proc_rows or {}
        procs = self._processes(rows, now, dt, samples, nvml, wall)
        containers = self._containers(procs, now)
        recent = tuple(r for pid in (p.pid for p in procs) if pid in self._hist
                       for r in reversed(self._hist[pid].recent))
        self._seq += 1
        self._latest = Snapshot(
            source=self.source, seq=self._seq, t_wall_ns=wall, interval_s=round(dt, 3), host=host,
            processes=tuple(procs), containers=tuple(containers), findings=tuple(reversed(self._findings)),
            requests=recent, agent=state.agent)

    # ---- parts ----
    def _history(self, pid: int) -> _ProcHistory:
        h = self._hist.get(pid)
        if h is None:
            h = self._hist[pid] = _ProcHistory()
            while len(self._hist) > MAX_PIDS:
                self._hist.popitem(last=False)
        self._hist.move_to_end(pid)
        return h

    def _find(self, wall: int, kind: str, subject: str, text: str) -> None:
        self._findings.append(Finding(wall, kind, sanitize_text(subject, 128), sanitize_text(text, 256)))

    def _host(self, state, dt, samples, nvml, wall) -> HostView:
        mem = parse_meminfo(memstat.read_text(f"{self.proc_root}/meminfo"))
        psi = memstat.read_psi(f"{self.proc_root}/pressure/memory")
        kt = state.kswapd
        kswapd = []
        if kt is not None:
            now = self._clock()
            for n in sorted(self._nodes | kt.nodes()):
                active = kt.active_ns(now - int(dt * 1e9), now, n) / (dt * 1e9) * 100 if dt > 0 else 0.0
                kswapd.append(KswapdView(n, n in kt.awake_since, round(min(active, 100.0), 1)))
        opened = list(state.open_storms)
        self._storm_findings(state, opened, wall)
        gpus = self._gpus(samples, wall)
        xid_total = None
        xw = getattr(state.gpu, "xid", None)
        if xw is not None and isinstance(getattr(xw, "counts", None), dict):
            xid_total = sum(xw.counts.values())
        elif self._xid_by_gpu:
            xid_total = sum(v[0] for v in self._xid_by_gpu.values())
        gh, nic = state.gpu, state.nic
        if nic is not None:
            self._nic_events(nic, self._wall_of(state, wall))
        nic_src = getattr(nic, "sources", {}).get("nic_netlink")
        if nic is None:
            nic_state = "not wired"
        elif nic_src is None or nic_src.state == "attached":
            nic_state = "ok"
        else:
            nic_state = sanitize_text(f"{nic_src.state}: {nic_src.reason}", 160)
        src = getattr(gh, "sources", {}).get("nvml")
        if samples:
            nvml_state = "ok"
        elif src is not None and src.state != "attached":
            nvml_state = sanitize_text(f"{src.state}: {src.reason}", 160)
        elif nvml is None:
            nvml_state = "not wired"
        else:
            nvml_state = sanitize_text(getattr(nvml, "reason", None) or "no samples yet", 160)
        return HostView(
            hostname=sanitize_text(socket.gethostname(), 64), kernel=os.uname().release,
            mem_total_bytes=mem.get("MemTotal"), mem_available_bytes=mem.get("MemAvailable"),
            swap_total_bytes=mem.get("SwapTotal"), swap_free_bytes=mem.get("SwapFree"),
            psi_some_avg10=psi.get("some", {}).get("avg10"), psi_full_avg10=psi.get("full", {}).get("avg10"),
            kswapd=tuple(kswapd), storm=bool(opened),
            storm_scopes=tuple(sanitize_text(e.scope, 128) for e in opened), gpus=gpus, xid_total=xid_total,
            nvml=nvml_state, nics=self._nics(nic, self._clock()) if nic is not None else (), nic=nic_state)

    def _wall_of(self, state, wall: int):
        """Kernel-monotonic ns -> wall ns (CLOCK_MONOTONIC: BPF timestamps and netlink events alike)."""
        return self._to_wall or state.to_wall or (lambda ns: wall)

    def _storm_findings(self, state, opened, wall) -> None:
        to_wall = self._wall_of(state, wall)
        now_open = {id(e): e for e in opened}
        for k, e in now_open.items():
            if k not in self._storms:
                self._find(to_wall(e.start_ns), "reclaim_storm_open", e.scope, f"reclaim storm opened: {e.scope}")
        for k, e in self._storms.items():
            if k not in now_open:
                secs = max(0, e.end_ns - e.start_ns) / 1e9 if e.closed else 0
                self._find(to_wall(e.end_ns) if e.closed else wall, "reclaim_storm_close", e.scope,
                           f"reclaim storm closed: {e.scope} after {secs:.0f}s, peak direct "
                           f"{e.peak_direct_ms_per_s:.0f} ms/s, memcg {e.peak_memcg_ms_per_s:.0f} ms/s, "
                           f"kswapd {e.peak_kswapd_ratio * 100:.0f}%")
        self._storms = now_open

    def _gpus(self, samples: Mapping, wall: int) -> tuple[GpuView, ...]:
        while self._xids:
            ev = self._xids.popleft()
            key = ev.gpu_index if ev.gpu_index is not None else (ev.pci_bus_id or "?")
            rec = self._xid_by_gpu.setdefault(key, [0, 0])
            rec[0] += 1
            rec[1] = ev.xid
            self._find(wall, "xid", f"gpu{key}", f"Xid {ev.xid} on GPU {key}")
        pcie = self._pcie
        links = getattr(pcie, "links", {}) or {}
        paths = getattr(pcie, "paths", {}) or {}
        out, seen_bdf = [], set()
        for i, s in sorted(samples.items()):
            seen_bdf.add(s.pci_bus_id)
            out.append(self._gpu_view(i, s, links, paths))
        for n, bdf in enumerate(sorted(b for b in paths if b not in seen_bdf)):  # no NVML: sysfs alone
            out.append(self._gpu_view(len(samples) + n, None, links, paths, bdf))
        degraded = {}
        for g in out:
            key = g.bus_id or f"gpu{g.index}"
            if g.link_degraded:
                degraded[key] = g.link_why or ""
                if key not in self._degraded:
                    self._find(wall, "link_degraded", key, f"PCIe link downtrained on GPU {g.index} ({key}): "
                               f"Gen{g.link_gen or '?'} x{g.link_width or '?'} of Gen{g.link_gen_max or '?'} "
                               f"x{g.link_width_max or '?'}: {g.link_why}")
        for key in self._degraded:
            if key not in degraded:
                self._find(wall, "link_restored", key, f"PCIe link back at its maximum: {key}")
        self._degraded = degraded
        return tuple(out)

    def _gpu_view(self, index, s, links, paths, bdf=None) -> GpuView:
        bdf = bdf or (s.pci_bus_id if s is not None else None)
        link = links.get(bdf) if bdf else None
        gen = gen_max = width = width_max = None
        if s is not None:
            gen, gen_max, width, width_max = s.pcie_gen, s.pcie_gen_max, s.pcie_width, s.pcie_width_max
        if link is not None and link.present:
            # NVML's view and sysfs's (read this tick) may differ by a poll: the lower current state
            # and the higher maximum, so neither hides a downtrain the other saw
            gen, width = _lo(gen, link.gen), _lo(width, link.width)
            gen_max, width_max = _hi(gen_max, link.max_gen), _hi(width_max, link.max_width)
        aer = [0, 0, 0]
        have_aer = False
        for dev in (bdf, *paths.get(bdf, ())) if bdf else ():
            st = links.get(dev)
            if st is not None and st.aer is not None:
                have_aer = True
                for j, kind in enumerate(("correctable", "nonfatal", "fatal")):
                    aer[j] += st.aer.total(kind)
        util = s.util_gpu_pct if s is not None else None
        why = link_degraded(gen, gen_max, width, width_max, util, self.busy_util_pct)
        ep = self._episodes.get(bdf) if bdf else None
        if ep is not None:
            why = ", ".join(ep.causes) or why or "episode open"
        if link is not None and not link.present:
            why = "device gone from the bus"
        xid = self._xid_by_gpu.get(index) or (self._xid_by_gpu.get(bdf) if bdf else None)
        power = s.power_mw / 1000 if s is not None and s.power_mw is not None else None
        return GpuView(
            index=index, uuid=s.uuid if s else None, bus_id=bdf, up=s.up if s else True,
            down_reason=sanitize_text(s.down_reason, 120) if s and s.down_reason else None,
            util_pct=util, mem_util_pct=s.util_mem_pct if s else None,
            mem_used_bytes=s.mem_used_bytes if s else None, mem_total_bytes=s.mem_total_bytes if s else None,
            sm_clock_mhz=s.sm_clock_mhz if s else None, mem_clock_mhz=s.mem_clock_mhz if s else None,
            throttle=tuple(s.throttle_reasons) if s else (), power_w=_r(power, 1),
            temperature_c=s.temperature_c if s else None, link_gen=gen, link_gen_max=gen_max, link_width=width,
            link_width_max=width_max, link_degraded=why is not None, link_why=why,
            replay_count=s.pcie_replay_count if s else None,
            aer_correctable=aer[0] if have_aer else None, aer_nonfatal=aer[1] if have_aer else None,
            aer_fatal=aer[2] if have_aer else None, xid_count=xid[0] if xid else None,
            last_xid=xid[1] if xid else None)

    def _processes(self, rows: Mapping, now: int, tick_dt: float, samples, nvml, wall) -> list[ProcView]:
        cutoff = now - int(LATENCY_WINDOW_S * 1e9)
        out, prev = [], self._prev
        self._prev = {}
        heavy = set()
        gpus_for = getattr(nvml, "gpus_for_pid", None) if samples else None
        pids = list(rows) + [p for p, h in self._hist.items()
                             if p not in rows and h.total and now - h.last_seen_ns < PROC_HISTORY_S * 1e9]
        for pid in pids:
            attrs, counters = rows.get(pid, ({}, None))
            h = self._hist.get(pid)
            p = prev.get(pid)
            dt = (now - p[0]) / 1e9 if p else 0.0
            rates = counter_rates(p[1] if p else None, counters, dt) if counters is not None else \
                counter_rates(None, None, 0)
            if counters is not None:
                self._prev[pid] = (now, counters)
                if h is not None:
                    h.last_seen_ns = now
            ctx = ctx_ms_per_s(p[1] if p else None, counters, dt) if counters is not None else 0.0
            if ctx >= CTX_HEAVY_MS_PER_S or (pid in self._ctx_heavy and ctx >= CTX_HEAVY_MS_PER_S / 2):
                heavy.add(pid)
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
            ctr = attrs.get("container.id")
            gpus = ()
            if gpus_for is not None:
                try:
                    gpus = tuple(gpus_for(pid))
                except Exception:
                    gpus = ()
            view = ProcView(
                pid=pid, command=sanitize_text(short_command(cmdline) if cmdline else name, 256),
                name=sanitize_text(name, 64), command_line=sanitize_text(cmdline, 1024) if cmdline else None,
                container_id=sanitize_text(ctr, 64) if ctr else None,
                pod_uid=sanitize_text(attrs["k8s.pod.uid"], 64) if attrs.get("k8s.pod.uid") else None,
                gpus=gpus, marked=bool(h and h.total), req_per_s=_r(req_s), p50_ms=_r(p50, 3), p99_ms=_r(p99, 3),
                requests_total=h.total if h else 0, **{k: _r(v) for k, v in rates.items()})
            out.append(view)
            if pid in heavy and pid not in self._ctx_heavy:
                self._find(wall, "ctx_switch_heavy", str(pid),
                           f"CUDA context switches heavy: pid {pid} ({view.command}) {ctx:.0f} ms/s"
                           + (f", {view.ctx_switch_us:.1f} us each" if view.ctx_switch_us else ""))
        self._ctx_heavy = heavy
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
