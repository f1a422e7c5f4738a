"""Reclaim: kswapd intervals, the storm rule per scope (host, each memory cgroup), storm spans, a
request's stalls as its child spans, OOM kills, and the host reclaim metrics (bpf/reclaim.bpf.c; the
rule itself is rule.py, pure).

Once a window (reclaim.window_s) the kernel's totals (reclaim_totals, reclaim_by_tgid, stall_hist),
kswapd's intervals and the kernel's own accounting in /proc (vmstat, PSI, kswapd CPU) become one
Window per scope for the detectors; an episode is a span from open to close, and request spans
that overlap it link to it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import replace

from ..core.capability import Capability, Evidence
from ..core.decode import Route
from ..telemetry.spec import EventSpec, LinkSpec
from . import memstat, oom, records, telemetry as T
from .records import C
from .rule import Episode, KswapdTracker, StormDetector, Thresholds, Window, in_reclaim
from .section import ReclaimSection

CLK_TCK = os.sysconf("SC_CLK_TCK")
RT = {name[len("MCP_RT_"):].lower(): v for name, v in C.items() if name.startswith("MCP_RT_") and name != "MCP_RT_MAX"}
MAX_STALLS_PER_REQUEST = 64  # child spans per request; the counters on the request span still sum all
MAX_STALLED_REQUESTS = 4096  # requests with stalls waiting for their END (an END lost: the oldest go)
KEEP_CLOSED_STORMS = 32  # closed episodes kept for request spans that end later and overlap them
MAX_RECENT_REQUESTS = 100_000  # finished requests kept for the storm that may yet open over them
MAX_STORM_LINKS = 128  # the SDK's default link limit per span (OTEL_SPAN_LINK_COUNT_LIMIT)
KEEP_OOM_KILLS = 256  # recent kills, for the requests that end after them


def storm_thresholds(cfg) -> Thresholds:
    return Thresholds(cfg.reclaim_storm_kswapd_ratio, cfg.reclaim_storm_direct_ms_per_s,
                      cfg.reclaim_storm_memcg_ms_per_s, 1, cfg.reclaim_storm_close_windows)


class Reclaim(Capability):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.cfg = cfg = ctx.cfg
        self.telemetry = None  # start()
        self.registry = getattr(ctx.processes, "registry", None)  # core.identity.ProcessRegistry: a task's memory cgroup
        self.proc_root = ctx.proc_root
        self.kswapd_attached = True
        self.kswapd = KswapdTracker()
        self.kswapd_pids = memstat.KswapdThreads(ctx.proc_root)
        # a request's stalls over the threshold, (tgid, tid, request id) -> [ReclaimStall], in order:
        # the kernel tied each to the thread's open marked request (request_id != 0)
        self.stalls: OrderedDict[tuple, list] = OrderedDict()
        self.storms: dict[str, StormDetector] = {"host": StormDetector("host", storm_thresholds(cfg))}
        self.episodes: list[tuple[int, Episode]] = []  # (span key number, episode): open ones and recent closed
        self._n = 0
        self._win_start = time.monotonic_ns()
        self._win_prev: dict = {}
        self._cg_totals: dict[str, list[int]] = {}  # cgroup path -> [direct_ns, memcg_ns]
        self.last_rows: dict = {}
        # finished requests of the last windows: (span context, tgid, begin, end, stalled in reclaim)
        self.recent: deque = deque(maxlen=MAX_RECENT_REQUESTS)
        self.victims: dict[int, set] = {}  # storm span key number -> span ids of the requests it links to
        self._paths: dict[int, str] = {}  # tgid -> memory cgroup path, for this window's scope checks
        self.oom_kills: deque = deque(maxlen=KEEP_OOM_KILLS)  # (victim tgid, OomKill)
        self.oom_counts: Counter = Counter()  # scope -> kills since start
        self._mem_total = oom.mem_total_bytes(ctx.proc_root)

    @property
    def bpf(self):
        return self.ctx.bpf

    def start(self) -> list:
        self.telemetry = self.ctx.telemetry
        self.kswapd_attached = self.ctx.attached("kswapd_wake")
        try:  # the kswapd threads, found once off the agent's thread (its ticks walk no /proc)
            threading.Thread(target=self.kswapd_pids.find, name="mcp-kswapd-find", daemon=True).start()
        except RuntimeError:  # no thread (TasksMax): learnt from the kswapd records alone
            pass
        self.close_window()  # the baseline of the reclaim totals: the first window counts from here
        return []

    def routes(self) -> dict[int, Route]:
        handlers = {C["MCP_EV_KSWAPD"]: self.on_kswapd, C["MCP_EV_RECLAIM_STALL"]: self.on_stall}
        return {t: r.with_handlers(handlers[t]) for t, r in records.DECODERS.items()}

    def raw(self, kind: int, rec, t_ns: int) -> None:
        self.on_oom(rec, t_ns)  # its one raw kind: oom:mark_victim

    def instruments(self):
        return [*T.INSTRUMENTS, *T.process_instruments(self.ctx.processes)]

    def section(self):
        return ReclaimSection(self.kswapd, self.open_storms, self.ctx.proc_root, self.ctx.sysfs_root)

    def on_stall(self, rec: records.ReclaimStall) -> None:
        """A stall the kernel tied to the thread's open request: a child span of that request's."""
        if not rec.request_id:
            return
        key = (rec.hdr.tgid, rec.hdr.tid, rec.request_id)
        lst = self.stalls.get(key)
        if lst is None:
            lst = self.stalls[key] = []
            while len(self.stalls) > MAX_STALLED_REQUESTS:
                self.stalls.popitem(last=False)
                self.ctx.health.rejected["stall_spans_orphaned"] += 1
        if len(lst) < MAX_STALLS_PER_REQUEST:
            lst.append(rec)
        else:
            self.ctx.health.rejected["stall_spans_truncated"] += 1

    def on_kswapd(self, rec: records.Kswapd) -> None:
        (self.kswapd.wake if rec.awake else self.kswapd.sleep)(rec.nid, rec.hdr.ts_ns)
        self.kswapd_pids.learn(rec.nid, rec.hdr.tid, rec.hdr.comm)

    def open_storms(self) -> list[Episode]:
        return [ep for _, ep in self.episodes if not ep.closed]

    # ---- evidence for a request's window ----
    def evidence(self, fr) -> Evidence:
        """Links to the storms already decided whose reclaim the request overlapped, in its scope. A
        storm decided later (its windows end after the request) links to the request itself
        (on_request, _link_victims): both directions say the same thing, whichever came first."""
        attrs = {}
        if self.kswapd_attached:
            attrs["hostagent.reclaim.kswapd.overlap.time"] = self.kswapd.active_ns(fr.begin_ns, fr.end_ns) / 1e9
        links = tuple(
            LinkSpec(("storm", n), {"hostagent.link.type": "reclaim_storm", "hostagent.storm.scope": ep.scope},
                     EventSpec("hostagent.reclaim_storm", max(fr.begin_ns, ep.start_ns), {"hostagent.storm.scope": ep.scope}),
                     ("hostagent.storm.trace_id", "hostagent.storm.span_id"))
            for n, ep in self.episodes if self._hit(ep, fr.tgid, fr.begin_ns, fr.end_ns))
        stalls = self.stalls.pop((fr.tgid, fr.tid, fr.request_id), ())
        return Evidence(attrs, links, children=tuple(T.stall_span(st) for st in stalls)) + self.oom_evidence(fr)

    # ---- OOM kills (oom.py; oom:mark_victim's raw copy, decoded by the core with its format) ----
    def on_oom(self, kill: oom.OomKill, t_ns: int) -> list:
        """A kill: its scope from the victim's memory cgroup limit (the trigger's when the victim is
        gone already), kept for the requests it ended or shared a cgroup with, and counted."""
        tgid = self._tgid_of(kill.victim)
        info = self._cgroup_at_kill(kill, tgid)
        scope, path = "unknown", "unknown"
        if info is not None:
            v2 = self.registry.cgroups.v2_dir(info.v2_path) if info.v2_path else None
            limited = oom.memcg_limited(oom.limit_files(v2, info.v1_paths.get("memory")), self._mem_total)
            scope = "unknown" if limited is None else "memcg" if limited else "host"
            path = memory_path(info)
        kill = replace(kill, scope=scope, ts_ns=t_ns)
        # the victim's memory cgroup, read now: by the time a neighbour's request ends the victim is gone
        self.oom_kills.append((tgid, path, kill))
        self.oom_counts[scope] += 1
        return []

    def _cgroup_at_kill(self, kill: oom.OomKill, tgid: int):
        """The victim's cgroups, else the trigger's (the allocating task: in a memcg OOM, of the same
        cgroup). The kill is read after the victim got SIGKILL, and an exiting task's v1 lines say "/"
        (CgroupInfo.exiting): where memory is a v1 controller its cgroups are then those this agent read
        when it described the process alive; None when neither task gives a true reading. A wrong "/"
        would make a memcg kill read as the host's."""
        if self.registry is None:
            return None
        for pid in (kill.victim, kill.trigger):
            info = self.registry.cgroups.for_pid(pid) if pid else None
            if info is None:
                continue
            if not (info.exiting and "memory" in info.v1_paths):
                return info
            known = self.registry.cached(tgid if pid == kill.victim else self._tgid_of(pid))
            if known is not None and known.cgroup is not None and not known.cgroup.exiting:
                return known.cgroup
        return None

    def _tgid_of(self, tid: int) -> int:
        """The victim is a task holding the mm, not always the thread group's leader."""
        try:
            with open(f"{self.proc_root}/{tid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Tgid:"):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return tid

    def oom_evidence(self, fr) -> Evidence:
        """The kills during the request: its own process killed (the span says so), or a neighbour in
        its memory cgroup (memcg scope) or anywhere (host scope): an event each."""
        attrs, events = {}, []
        for tgid, path, k in self.oom_kills:
            if not fr.begin_ns <= k.ts_ns <= fr.end_ns:
                continue
            own = tgid == fr.tgid
            if own:
                attrs["hostagent.oom.killed"] = True
            elif k.scope == "memcg" and path != self._path_of(fr.tgid):
                continue
            events.append(EventSpec("hostagent.oom_kill", k.ts_ns, {**k.attributes(), "hostagent.oom.own_process": own}))
        return Evidence(attrs, (), tuple(events))

    def on_request(self, fr, span, ctx) -> None:
        """Each finished request, with its span's context: kept for the storms decided after it."""
        c = fr.counters
        self.recent.append((ctx, fr.tgid, fr.begin_ns, fr.end_ns, bool(c.direct_reclaims or c.memcg_reclaims)))

    def _hit(self, ep: Episode, tgid: int, t0: int, t1: int) -> bool:
        """A victim: the request overlapped the episode's reclaim (its hot windows), in its scope: any
        request for a host storm; for a cgroup storm, one of a process charged to that memory cgroup
        (read when first needed in a window; a process gone by then is not matched)."""
        if not in_reclaim(ep, t0, t1):
            return False
        return ep.scope == "host" or self._path_of(tgid) == ep.scope

    def _path_of(self, tgid: int) -> str:
        """The process's memory cgroup, read once per window (self._paths, cleared at each close)."""
        path = self._paths.get(tgid)
        if path is None:
            path = self._paths[tgid] = self._memory_cgroup(tgid)
        return path

    def _link_victims(self, n: int, ep: Episode) -> None:
        """Links from the storm's span (open under ("storm", n)) to the finished requests it hit."""
        seen = self.victims.setdefault(n, set())
        for ctx, tgid, t0, t1, stalled in self.recent:
            if ctx is None or ctx.span_id in seen or not self._hit(ep, tgid, t0, t1):
                continue
            seen.add(ctx.span_id)
            if len(seen) <= MAX_STORM_LINKS:
                self.telemetry.add_link(("storm", n), ctx, {"hostagent.link.type": "reclaim_storm_victim",
                                                            "hostagent.request.reclaim_stalled": stalled})

    # ---- windows ----
    def tick(self) -> None:
        if time.monotonic_ns() - self._win_start >= self.cfg.reclaim_window_s * 1e9:
            self.close_window()

    def close_window(self) -> None:
        """Close one storm-rule window: kernel totals, kswapd intervals and /proc context -> detectors."""
        b = self.bpf
        now, w0 = time.monotonic_ns(), self._win_start
        self._win_start = now
        secs = (now - w0) / 1e9
        prev = self._win_prev
        totals = [sum(v) for _, v in sorted(b[b"reclaim_totals"].items(), key=lambda kv: kv[0].value)]
        vm = memstat.read_vmstat(self.proc_root)
        cpu = self.kswapd_pids.cpu_ticks()
        psi = memstat.read_psi(f"{self.proc_root}/pressure/memory")
        by_tgid = {k.value: (v.direct_reclaim_ns, v.memcg_reclaim_ns) for k, v in b[b"reclaim_by_tgid"].items()}
        self._win_prev = {"totals": totals, "vm": vm, "cpu": cpu, "tgid": by_tgid}
        if not prev:
            return  # the first window only sets the baseline
        d = {name: totals[i] - prev["totals"][i] for name, i in RT.items()}
        dvm = {k: vm.get(k, 0) - prev["vm"].get(k, 0) for k in memstat.VMSTAT_KEYS}
        for n, ticks in cpu.items():
            if ticks > prev["cpu"].get(n, ticks):
                self.kswapd.assume_awake(n, w0)
        nodes = self.kswapd.nodes() | set(cpu)
        ratios = {n: self.kswapd.active_ns(w0, now, n) / max(now - w0, 1) for n in nodes}
        context = {k: v for k, v in dvm.items() if v}
        context["allocstall"] = memstat.allocstall(vm) - memstat.allocstall(prev["vm"])
        for kind in ("some", "full"):
            if kind in psi:
                context[f"psi_{kind}_avg10"] = psi[kind].get("avg10", 0.0)
        # host scope: global reclaim only (kswapd, direct); memcg stalls are their cgroups' own storms
        host = Window(w0, now, max(ratios.values(), default=0.0), d["direct_ns"], 0, context)
        windows = {"host": host}
        for path, (dn, mn) in self._cgroup_deltas(by_tgid, prev["tgid"]).items():
            windows[path] = Window(w0, now, 0.0, dn, mn, self._cgroup_psi(path))
        for scope in list(self.storms):  # open episodes need their quiet windows to close
            windows.setdefault(scope, Window(w0, now))
        for scope, w in windows.items():
            det = self.storms.get(scope)
            if det is None:
                if not (w.direct_stall_ns or w.memcg_stall_ns):
                    continue
                det = self.storms[scope] = StormDetector(scope, storm_thresholds(self.cfg))
            act = det.feed(w)
            if act and act[0] == "open":
                self._open(act[1])
            elif act and act[0] == "close":
                self._close(act[1])
        for scope in [s for s, det in self.storms.items() if s != "host" and det.episode is None and not det.hot_run]:
            del self.storms[scope]
        for n, ep in self.episodes:
            if not ep.closed:
                self._link_victims(n, ep)
        self._paths.clear()
        keep_ns = int((self.cfg.reclaim_storm_close_windows + 3) * self.cfg.reclaim_window_s * 1e9)
        oldest_open = min((ep.start_ns for _, ep in self.episodes if not ep.closed), default=now)
        while self.recent and self.recent[0][3] < min(now - keep_ns, oldest_open):
            self.recent.popleft()
        self.kswapd.forget_before(now - int(600e9))
        t = {name: totals[i] for name, i in RT.items()}
        kswapd_cpu = {n: (cpu[n] - prev["cpu"].get(n, cpu[n])) / CLK_TCK / max(secs, 1e-9) for n in cpu}
        self.last_rows = T.window_rows(t, self._stall_hist(), ratios, kswapd_cpu, psi,
                                       {s: det.episode is not None for s, det in self.storms.items()},
                                       self._cg_totals, vm)
        self.last_rows["hostagent.oom.kills"] = [(n, {"hostagent.oom.scope": sc}) for sc, n in sorted(self.oom_counts.items())]
        self.telemetry.publish(self.last_rows)

    def _open(self, ep: Episode) -> None:
        self._n += 1
        self.telemetry.open(("storm", self._n), T.storm_span(ep))
        self.episodes.append((self._n, ep))

    def _close(self, ep: Episode) -> None:
        for n, e in self.episodes:
            if e is ep:
                self._link_victims(n, ep)
                victims = len(self.victims.pop(n, ()))
                self.telemetry.close(("storm", n), {**T.episode_attributes(ep), "hostagent.storm.victims": victims},
                                     max(ep.end_ns, ep.start_ns))
        # the oldest by their end: a long episode that just closed is the one a request may still overlap
        closed = sorted(((n, e) for n, e in self.episodes if e.closed), key=lambda ne: ne[1].end_ns)
        for n, e in closed[:-KEEP_CLOSED_STORMS]:
            self.episodes.remove((n, e))
            self.telemetry.forget(("storm", n))

    def stop(self) -> None:
        """An episode still open at exit is exported, marked unfinished."""
        if self.telemetry is None:
            return
        for n, ep in self.episodes:
            if not ep.closed:
                self._link_victims(n, ep)
                self.telemetry.close(("storm", n), {**T.episode_attributes(ep), "hostagent.storm.unfinished": True,
                                                    "hostagent.storm.victims": len(self.victims.pop(n, ()))}, None)

    def _stall_hist(self) -> dict:
        hist = {}
        for k, v in self.bpf[b"stall_hist"].items():
            if v.value:
                kind, slot = divmod(k.value, 64)
                hist[(("direct", "memcg")[kind], slot)] = v.value
        return hist

    def _cgroup_deltas(self, now: dict, before: dict) -> dict[str, tuple[int, int]]:
        """Per-tgid reclaim stall deltas summed by the task's cgroup path (v2, else v1 memory)."""
        out: dict[str, list[int]] = {}
        for tgid, (dn, mn) in now.items():
            b = before.get(tgid, (0, 0))
            if (dn - b[0]) <= 0 and (mn - b[1]) <= 0:
                continue
            path = self._memory_cgroup(tgid)
            acc = out.setdefault(path, [0, 0])
            acc[0] += dn - b[0]
            acc[1] += mn - b[1]
            tot = self._cg_totals.setdefault(path, [0, 0])
            tot[0] += dn - b[0]
            tot[1] += mn - b[1]
        return {p: (a[0], a[1]) for p, a in out.items()}

    def _cgroup_psi(self, path: str) -> dict:
        """The cgroup's own memory PSI (cgroup v2 memory.pressure; v1 has none)."""
        d = self.registry.cgroups.v2_dir(path)
        psi = memstat.read_psi(f"{d}/memory.pressure") if d else {}
        return {f"psi_{k}_avg10": v.get("avg10", 0.0) for k, v in psi.items()}

    def _memory_cgroup(self, tgid: int) -> str:
        """A live process's memory cgroup (memory_path); "unknown" once it is gone."""
        info = self.registry.cgroups.for_pid(tgid)
        return "unknown" if info is None else memory_path(info)


def memory_path(info) -> str:
    """The cgroup whose memory limit a task is charged to: v1's memory controller path where the host
    mounts it (hybrid layout), else the v2 path."""
    return info.v1_paths.get("memory") or info.v2_path or "unknown"
