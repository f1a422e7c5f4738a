"""The agent's one pipeline: probe -> decode -> join -> telemetry, and its threads.

One thread (the caller's) polls the BPF ring buffer and, once a second, reads the aggregate maps,
ends idle requests and refreshes the watch set. Export runs on the OTel SDK's own threads behind
bounded queues, so reading BPF never waits on a collector. Nothing else here does I/O for telemetry.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import sys
import threading
import time
from dataclasses import dataclass

from ..cuda import capability as cuda
from . import discovery, kernel, loader, probes
from ..reclaim import memstat
from ..requests import owners
from ..config import Config
from .decode import Counters, DecodeError, Kswapd, ProcExit, ReclaimStall, ReqBegin, ReqEnd, TpRaw, counters_from, decode
from ..gpuhealth.capability import GpuHealth
from .identity import ProcessRegistry, container_from_cgroup_path
from ..requests.join import RequestJoiner
from ..pcie.links import RecordError
from ..reclaim.rule import KswapdTracker, StormDetector, Thresholds, Window
from ..telemetry.snapshot import SnapshotBuilder
from .records import C, KERNEL_STATS
from ..telemetry.otel import AgentHealth, Telemetry
from .timebase import Timebase
from ..exporters import Exporters, build_exporters

log = logging.getLogger("mcp_hostagent")

WATCH_SCAN_S = 5.0  # between rounds of the watch scan
# One pass of the watch scan reads /proc for at most this long, then sleeps WATCH_GAP_S: a host whose
# users made /proc/PID/maps huge slows the scan's rounds, not the agent (docs/SECURITY.md, starving).
WATCH_PASS_S = 0.05
WATCH_GAP_S = 0.45  # (<= 10% of a core while a round lasts)
# records read from req_events between updates of req_flow[CONSUMED] inside one poll (a map write)
REQ_READ_TELL_EVERY = 64
TICK_STEP_LOG_S = 60.0  # a failing tick step is logged at most this often (and counted always)
EXPIRY_SCAN_S = 5.0
EXITED_KEEP_S = 30.0
IDENTITY_TTL_S = 1.0
# The map read's rows (metrics, `top`) revalidate an identity that has not changed for this long only
# this often: every watched process's lookup every tick was ~1% of a core with --watch all and ~100
# processes (kernel threads, without a command line, are described afresh on every lookup), and
# metrics go out every 10 s. A young or just exec'd process is still checked every IDENTITY_TTL_S.
ROW_IDENTITY_TTL_S = 5.0
LOST_LOG_INTERVAL_S = 30.0  # ring-buffer losses: counted always, a log line at most this often
STEP_TYPE = cuda.EV_GPU_STEP.to_bytes(2, "little")  # zero-touch GPU step records, decoded by cuda.py  # keep an exited process's final counters for a couple of metric exports


class StartError(RuntimeError):
    """The agent cannot start; the message is one line with a hint."""


@dataclass
class StartReport:
    headers: str
    tracefs: list[str]
    compile_s: float
    plan: probes.ProbePlan
    sinks: list[str]
    sources: list  # gpuhealth.SourceStatus: NVML, Xid, PCIe sysfs, netlink


CLK_TCK = os.sysconf("SC_CLK_TCK")
RT = {name[len("MCP_RT_"):].lower(): v for name, v in C.items() if name.startswith("MCP_RT_") and name != "MCP_RT_MAX"}


def bpf_settings(cfg: Config) -> dict[str, int]:
    return {
        "MCP_MAX_OPEN_PER_PID": cfg.requests_max_open_per_pid,
        "MCP_MAX_BEGINS_PER_S": cfg.requests_max_begins_per_s_per_pid,
        "MCP_WATCH_ALL": cfg.process_watch == "all",
        "MCP_STALL_THRESHOLD_NS": int(cfg.reclaim_stall_threshold_ms * 1e6),
        **owners.bpf_settings(cfg),
    }


def cgroup_attrs(path: str) -> dict:
    ref = container_from_cgroup_path(path)
    attrs = {"mcp.cgroup.path": path}
    if ref and ref.container_id:
        attrs["container.id"] = ref.container_id
    if ref and ref.pod_uid:
        attrs["k8s.pod.uid"] = ref.pod_uid
    return attrs


def storm_thresholds(cfg: Config) -> Thresholds:
    return Thresholds(cfg.reclaim_storm_kswapd_ratio, cfg.reclaim_storm_direct_ms_per_s,
                      cfg.reclaim_storm_memcg_ms_per_s, 1, cfg.reclaim_storm_close_windows)


def prepare_kernel(cfg: Config) -> tuple[kernel.HeaderChoice, list[str]]:
    if os.geteuid() != 0:
        raise StartError("mcp-agent must run as root (BPF, tracefs); HINT: sudo mcp-agent ...")
    try:
        mounted = kernel.ensure_tracefs()
        hc = kernel.find_kernel_headers(cfg.kernel_headers, link_modules=cfg.kernel_link_modules_build)
    except kernel.KernelSetupError as e:
        raise StartError(str(e)) from e
    if hc.bcc_kernel_source:
        os.environ["BCC_KERNEL_SOURCE"] = hc.bcc_kernel_source
    return hc, mounted


def raise_nofile() -> None:
    """Soft RLIMIT_NOFILE up to the hard one: probes, maps and followed libraries hold fds, and EMFILE
    in the middle of an attach is a failure no user should be able to cause by mapping files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError):  # a container's hard limit may not be ours to reach
            pass


class Agent:
    def __init__(self, cfg: Config, exporters: Exporters | None = None, progress=None, proc_root: str = "/proc",
                 nvml_module=None, sysfs_root: str = "/sys"):
        self.cfg = cfg
        self.progress = progress
        self.proc_root = proc_root
        self.joiner = RequestJoiner()
        # one Counter for every user-space rejection reason: the joiner's and decode's
        self.health = AgentHealth(rejected=self.joiner.rejected)
        self.registry = ProcessRegistry(proc_root=proc_root, command_line=cfg.process_command_line)
        self.timebase = Timebase()
        self._exporters = exporters
        self.loaded: list[loader.Loaded] = []
        self.bpf = None
        self.telemetry: Telemetry | None = None
        self.plan: probes.ProbePlan | None = None
        self._exited: dict[int, tuple[float, dict, Counters]] = {}
        self._attrs_cache: dict[int, tuple[float, dict, float]] = {}  # pid -> (checked, attrs, same since)
        self.cuda: cuda.CudaProbes | None = None
        self.kswapd = KswapdTracker()
        self.proc_rows: dict[int, tuple[dict, Counters]] = {}  # the last map read, for the snapshots
        self.snapshots = SnapshotBuilder(proc_root, to_wall=self.timebase.to_wall_ns,  # `mcp-agent top`
                                         busy_util_pct=cfg.pcie_busy_util_pct)
        self.storms: dict[str, StormDetector] = {"host": StormDetector("host", storm_thresholds(cfg))}
        self._win_start = time.monotonic_ns()
        self._win_prev: dict = {}
        self._cg_totals: dict[str, list[int]] = {}  # cgroup path -> [direct_ns, memcg_ns]
        self.gpu = GpuHealth(enabled=cfg.gpu_enabled, nic=cfg.nic_enabled, sample_period_s=cfg.gpu_sample_period_s,
                             slow_period_s=cfg.gpu_slow_period_s, busy_util_pct=cfg.pcie_busy_util_pct,
                             nvml_module=nvml_module, sysfs_root=sysfs_root)
        self._next_expiry = 0.0
        self._last_error_log = 0.0
        self._lost_log = (float("-inf"), 0)  # (when, kernel losses then) of the last loss line
        self._stopped = False
        self._watch_written: set[int] = set()  # pids _refresh_watch put in watch_tgid
        self._watch_stop = threading.Event()
        self._watch_thread: threading.Thread | None = None
        self._step_logged: dict[str, float] = {}  # tick step -> when its failure was last logged
        self._req_read = self._req_read_told = 0  # records read from req_events; the last count written

    # ---- start / stop ----
    def start(self) -> StartReport:
        cfg = self.cfg
        raise_nofile()
        hc, mounted = prepare_kernel(cfg)
        self.plan = probes.plan(cfg.probes_disable)
        try:
            allow = owners.allowed_owners(cfg)
        except owners.OwnerError as e:
            raise StartError(str(e)) from None
        exporters = self._exporters or build_exporters(
            cfg.export_jsonl_path or None, cfg.export_otlp_endpoint, cfg.export_otlp_protocol,
            console_stream=sys.stdout if cfg.export_console else None)
        self.loaded = loader.load(self.plan, bpf_settings(cfg), self.progress)
        if self.loaded:  # before any probe sees a marker (the maps exist from the load on)
            owners.write_allow(self.loaded[0].bpf, allow)
        if self.loaded and any(s.spec.program == "cuda.bpf.c" and s.state == probes.ATTACHED
                               for s in self.plan.statuses.values()):
            # uprobes per libcuda inode, the NVIDIA ioctl programs and the launch-probe governor
            self.cuda = cuda.CudaProbes(self.loaded[0].bpf, self.plan, budget=cfg.cuda_overhead_budget,
                                        auto_watch=cfg.process_watch == "gpu", device_globs=cfg.cuda_device_globs,
                                        slice_s=cfg.cuda_duty_slice_s, proc_root=self.proc_root,
                                        max_libraries=cfg.cuda_max_libraries)
            self.cuda.start()
        self.health.compile_s = sum(x.compile_s for x in self.loaded)
        self.health.probes = {n: s.state for n, s in self.plan.statuses.items()}
        missing = self.plan.missing()
        reasons = "; ".join(dict.fromkeys(s.reason for s in missing))  # one compile error, not one per probe
        if cfg.probes_strict and missing:
            self.detach()
            raise StartError(f"--strict: probes missing: {', '.join(s.spec.name for s in missing)}: {reasons}")
        if not self.loaded:
            raise StartError(f"no BPF program loaded: {reasons}")
        self.bpf = self.loaded[0].bpf
        self.telemetry = Telemetry(service_name=cfg.service_name, exporters=exporters, timebase=self.timebase,
                                   health=self.health, max_queue_size=cfg.export_max_queue_size,
                                   metric_interval_s=cfg.export_metric_interval_s)
        xid_probe = self.plan.statuses.get("gpu_xid")
        for src in self.gpu.start(bpf_xid=xid_probe is not None and xid_probe.state == probes.ATTACHED):
            self.health.probes[src.name] = src.state
            self.health.source_reasons[src.name] = src.reason
        self.telemetry.watch_gpus(self.gpu)
        self.bpf[b"events"].open_ring_buffer(self._on_event)
        self.bpf[b"req_events"].open_ring_buffer(self._on_req_event)
        if cfg.process_watch != "all":
            # the first round whole, so the processes already running are watched when start returns;
            # the later ones on a thread of their own, in budgeted passes, off the ring-buffer thread
            self._refresh_watch(discovery.WatchScan(self.proc_root, budget_s=float("inf")))
            self._watch_thread = threading.Thread(target=self._watch_loop, name="mcp-watch", daemon=True)
            self._watch_thread.start()
        self.tick()
        self._reclaim_window()  # baseline of the reclaim totals: the first window counts from here
        return StartReport(hc.description, mounted, self.health.compile_s, self.plan, exporters.describe(),
                           list(self.gpu.sources.values()))

    def detach(self) -> None:
        if self.cuda is not None:  # its uprobes and tracepoint fds go before the BPF object
            self.cuda.stop()
            self.cuda = None
        for x in self.loaded:
            # Each tracepoint detach waits for an RCU grace period (~75 ms here); bcc's cleanup()
            # does them one by one, ~1.5 s for 20 probes. In parallel they share the grace periods.
            tps = [s.spec.tracepoint.encode() for s in self.plan.statuses.values()
                   if s.spec.kind in probes.TRACEPOINT_KINDS and s.state == probes.ATTACHED] if self.plan else []
            threads = [threading.Thread(target=self._detach_tp, args=(x.bpf, tp)) for tp in tps]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            x.bpf.cleanup()
        self.loaded = []
        self.bpf = None

    @staticmethod
    def _detach_tp(bpf, tp: bytes) -> None:
        try:
            bpf.detach_tracepoint(tp)
        except Exception:  # not attached (its attach failed): cleanup() has nothing to do for it either
            pass

    def stop(self, timeout_s: float = 3.0) -> bool:
        """Drain the ring buffer, detach, flush. True if the exporters flushed within timeout_s."""
        if self._stopped:
            return True
        self._stopped = True
        self._watch_stop.set()
        if self._watch_thread is not None:
            self._watch_thread.join(2.0)  # a pass ends within WATCH_PASS_S plus one bounded read
        if self.bpf is not None:
            self.bpf.ring_buffer_consume()
            self._read_maps()
        self.detach()
        self.gpu.stop()
        if self.telemetry is None:
            return True
        t = threading.Thread(target=self.telemetry.shutdown, args=(timeout_s,), daemon=True)
        t.start()
        t.join(timeout_s + 0.5)
        return not t.is_alive()

    # ---- the loop ----
    def run(self, stop: threading.Event, on_tick=None, duration_s: float | None = None) -> None:
        deadline = time.monotonic() + duration_s if duration_s else None
        next_tick = time.monotonic() + self.cfg.status_interval_s
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            self.poll(100)
            if time.monotonic() >= next_tick:
                self.tick()
                if on_tick:
                    on_tick(self)
                next_tick = time.monotonic() + self.cfg.status_interval_s

    def poll(self, timeout_ms: int = 100) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)
        self._tell_consumed()

    def _tell_consumed(self) -> None:
        if self._req_read != self._req_read_told:
            # the kernel compares it with what it reserved: the reader's lag (enum mcp_req_flow)
            self.bpf[b"req_flow"][ctypes.c_int(C["MCP_FLOW_CONSUMED"])] = ctypes.c_uint64(self._req_read)
            self._req_read_told = self._req_read

    def _on_req_event(self, ctx, data, size) -> int:
        self._req_read += 1
        if self._req_read - self._req_read_told >= REQ_READ_TELL_EVERY:
            self._tell_consumed()  # within a long poll too: a stale count reads as lag, and refuses begins
        return self._on_event(ctx, data, size)

    def tick(self) -> None:
        """The periodic work, step by step. A step that fails (a map write refused, EMFILE, a /proc
        file that changed shape under it) is counted in mcp.agent.errors and logged at most once a
        minute; the other steps and the ring buffer go on: nothing a local user can make the kernel
        or /proc answer may end the agent."""
        now = time.monotonic()
        if now >= self._next_expiry:
            self._step("expire", self._expire)
            self._next_expiry = now + min(EXPIRY_SCAN_S, self.cfg.requests_idle_expiry_s / 2)
        self._step("read_maps", self._read_maps)
        if self.telemetry is not None:
            self._step("gpu", lambda: self._link_episodes(self.gpu.tick()))
        if time.monotonic_ns() - self._win_start >= self.cfg.reclaim_window_s * 1e9:
            self._step("reclaim_window", self._reclaim_window)
        self._step("snapshot", lambda: self.snapshots.on_tick(self))

    def _step(self, where: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- counted and logged; the agent must outlive it
            self._survived(where, e)

    def _survived(self, where: str, e: BaseException) -> None:
        self.health.errors[where] += 1
        now = time.monotonic()
        if now - self._step_logged.get(where, float("-inf")) >= TICK_STEP_LOG_S:
            self._step_logged[where] = now
            log.warning("%s failed (%s: %s); counted in mcp.agent.errors, going on", where, type(e).__name__, e)

    # ---- reclaim windows ----
    def _reclaim_window(self) -> None:
        """Close one storm-rule window: kernel totals, kswapd intervals and /proc context -> detectors."""
        b = self.bpf
        if b is None or self.telemetry is None:
            return
        now, w0 = time.monotonic_ns(), self._win_start
        self._win_start = now
        secs = (now - w0) / 1e9
        prev = self._win_prev
        totals = [sum(v) for _, v in sorted(b[b"reclaim_totals"].items(), key=lambda kv: kv[0].value)]
        vm = memstat.read_vmstat(self.proc_root)
        cpu = memstat.kswapd_cpu_ticks(self.proc_root)
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
        host = Window(w0, now, max(ratios.values(), default=0.0), d["direct_ns"], d["memcg_ns"], context)
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
                self.telemetry.storm_open(act[1], {} if scope == "host" else cgroup_attrs(scope))
            elif act and act[0] == "close":
                self.telemetry.storm_close(act[1])
        for scope in [s for s, det in self.storms.items() if s != "host" and det.episode is None and not det.hot_run]:
            del self.storms[scope]
        self.kswapd.forget_before(now - int(600e9))
        self.telemetry.set_reclaim(self._reclaim_snapshot(totals, vm, cpu, prev["cpu"], secs, ratios, psi))

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
        """The cgroup whose memory limit the task is charged to: v1's memory controller path where
        the host mounts it (hybrid layout), else the v2 path."""
        info = self.registry.cgroups.for_pid(tgid)
        if info is None:
            return "unknown"
        return info.v1_paths.get("memory") or info.v2_path or "unknown"

    def _reclaim_snapshot(self, totals, vm, cpu, cpu_prev, secs, ratios, psi) -> dict:
        t = {name: totals[i] for name, i in RT.items()}
        hist = {}
        for k, v in self.bpf[b"stall_hist"].items():
            if v.value:
                kind, slot = divmod(k.value, 64)
                hist[(("direct", "memcg")[kind], 1 << slot)] = v.value
        snap = {
            "stall_ns": [(t["direct_ns"], {"mcp.reclaim.kind": "direct"}), (t["memcg_ns"], {"mcp.reclaim.kind": "memcg"})],
            "stalls": [(n, {"mcp.reclaim.kind": k, "mcp.stall.le_ns": le}) for (k, le), n in sorted(hist.items())],
            "pages": [(t[f"{op}_{who}"], {"mcp.reclaim.by": who, "mcp.reclaim.op": "scanned" if op == "scan" else "reclaimed"})
                      for who in ("kswapd", "direct", "memcg") for op in ("scan", "steal")],
            "kswapd_ratio": [(r, {"mcp.numa.node": n}) for n, r in sorted(ratios.items())],
            "kswapd_cpu": [((cpu[n] - cpu_prev.get(n, cpu[n])) / CLK_TCK / max(secs, 1e-9), {"mcp.numa.node": n})
                           for n in sorted(cpu)],
            "psi": [(v.get("avg10", 0.0), {"mcp.psi.kind": k, "mcp.psi.scope": "host"}) for k, v in psi.items()],
            "storm_active": [(int(det.episode is not None), {"mcp.storm.scope": s}) for s, det in self.storms.items()],
            "cgroup_stall_ns": [(v, {**cgroup_attrs(p), "mcp.reclaim.kind": k})
                                for p, tot in self._cg_totals.items() for k, v in zip(("direct", "memcg"), tot)],
            "host_faults": [(vm.get("pgfault", 0) - vm.get("pgmajfault", 0), {"mcp.fault.type": "minor"}),
                            (vm.get("pgmajfault", 0), {"mcp.fault.type": "major"})],
        }
        return snap

    # ---- ring buffer ----
    def _on_event(self, ctx, data, size) -> int:
        try:
            raw = ctypes.string_at(data, size)
            rec = cuda.decode_step(raw) if raw[:2] == STEP_TYPE else decode(raw)
        except DecodeError as e:
            self.health.rejected[f"decode_{e.reason}"] += 1
            return 0
        try:
            self._handle(rec)
        except Exception:  # one bad record must not stop the reader; counted and logged at most every 30 s
            self.health.user_lost += 1
            if time.monotonic() - self._last_error_log > 30:
                self._last_error_log = time.monotonic()
                log.exception("handling %s failed (counted in mcp.agent.events.lost{where=user})", type(rec).__name__)
        return 0

    def _handle(self, rec) -> None:
        if isinstance(rec, ReqBegin):
            self.joiner.on_begin(rec)
            self._proc_attrs(rec.hdr.tgid, rec.hdr.comm)  # while it surely lives
        elif isinstance(rec, ReqEnd):
            self._emit(self.joiner.on_end(rec))
            if rec.reason == "thread_exit" and rec.hdr.tid == rec.hdr.tgid:
                # the process is exiting: without a proc_stats entry it sends no PROC_EXIT, and a
                # process started at its pid within IDENTITY_TTL_S would get this one's identity
                self.registry.forget(rec.hdr.tgid)
                self._attrs_cache.pop(rec.hdr.tgid, None)
        elif isinstance(rec, ReclaimStall):
            self.joiner.on_stall(rec)
        elif isinstance(rec, Kswapd):
            (self.kswapd.wake if rec.awake else self.kswapd.sleep)(rec.nid, rec.hdr.ts_ns)
        elif isinstance(rec, TpRaw):  # GPU and PCIe health tracepoints (health.bpf.c)
            try:
                self._link_episodes(self.gpu.on_tp_raw(rec))
            except RecordError:
                self.health.rejected["tracepoint_record"] += 1
        elif isinstance(rec, cuda.GpuStep):
            self.telemetry.emit_gpu_step(rec, self._proc_attrs(rec.hdr.tgid, rec.hdr.comm))
        elif isinstance(rec, ProcExit):
            for fr in self.joiner.on_proc_exit(rec):
                self._emit(fr)
            attrs = self._proc_attrs(rec.hdr.tgid, rec.hdr.comm)
            self._exited[rec.hdr.tgid] = (time.monotonic() + EXITED_KEEP_S, attrs, rec.counters)
            self.registry.forget(rec.hdr.tgid)
            self._attrs_cache.pop(rec.hdr.tgid, None)

    def _link_episodes(self, episodes) -> None:
        for ep in episodes:
            self.telemetry.link_episode(ep)
            self.snapshots.on_link_episode(ep)

    def _proc_attrs(self, pid: int, comm: bytes = b"", ttl_s: float = IDENTITY_TTL_S) -> dict:
        """Identity attributes, looked up (psutil, /proc) at most once per IDENTITY_TTL_S per pid: a
        lookup costs ~150 us, and a serving process ends hundreds of requests a second. Process exit
        drops the entry (PROC_EXIT, or the main thread's exit inside a request), and the registry's
        (pid, start time) check catches pid reuse at the next refresh."""
        now = time.monotonic()
        hit = self._attrs_cache.get(pid)
        if hit is not None and now - hit[0] < (ttl_s if now - hit[2] >= ttl_s else IDENTITY_TTL_S):
            return hit[1]
        attrs = self.registry.attributes(self.registry.lookup(pid, comm))
        if len(self._attrs_cache) >= 8192:
            self._attrs_cache.clear()
        self._attrs_cache[pid] = (now, attrs, hit[2] if hit is not None and hit[1] == attrs else now)
        return attrs

    def _emit(self, fr) -> None:
        extra = {}
        if self.health.probes.get("kswapd_wake") == "attached":
            extra["mcp.reclaim.kswapd_overlap_ns"] = self.kswapd.active_ns(fr.begin_ns, fr.end_ns)
        extra.update(self.gpu.request_attributes(fr.tgid, fr.begin_ns, fr.end_ns))
        extra.update({f"mcp.finding.{k}": v for k, v in cuda.findings(fr.counters, fr.end_ns - fr.begin_ns).items()})
        self.telemetry.emit_request(fr, self._proc_attrs(fr.tgid, fr.comm), extra,
                                    gpu_bdfs=set(self.gpu.gpus_of(fr.tgid).values()),
                                    events=self.gpu.events_between(fr.tgid, fr.begin_ns, fr.end_ns))
        self.snapshots.on_request(fr)

    # ---- maps ----
    def _read_maps(self) -> None:
        b = self.bpf
        if b is None:
            return
        totals = {}
        for k, v in b[b"stats"].items():
            label = KERNEL_STATS.get(k.value)
            if label:
                totals[label] = sum(v)
        self.health.kernel_stats = totals
        lost, (at, logged) = self.health.kernel_lost(), self._lost_log
        if lost > logged and time.monotonic() - at >= LOST_LOG_INTERVAL_S:
            self._lost_log = (time.monotonic(), lost)
            log.warning("ring buffer full: %d records lost in the kernel (%d since start), counted in "
                        "mcp.agent.events.lost{mcp.where=kernel}; next report in %.0f s at the earliest",
                        lost - logged, lost, LOST_LOG_INTERVAL_S)
        rows = {}
        table, gone = b[b"proc_stats"], []
        for k, v in table.items():
            pid = k.value
            if pid in self._exited:
                # With watch=all a dead task's last sched_switch re-creates the entry its exit probe
                # deleted (post-exit counts: a switch or two). Left there, every process that ever
                # exited stays in the map (up to MCP_MAX_PROCS, then live ones go uncounted), is looked
                # up and exported every tick: agent CPU grew with the host's process churn. The exit
                # record's counters stand; the remnant goes once /proc says the process is gone.
                if not os.path.exists(f"{self.proc_root}/{pid}"):
                    gone.append(k)
                continue
            rows[pid] = (self._proc_attrs(pid, ttl_s=ROW_IDENTITY_TTL_S), counters_from(v))
        for k in gone:
            try:
                del table[k]
            except KeyError:
                pass
        now = time.monotonic()
        for pid, (until, attrs, c) in list(self._exited.items()):
            if now > until:
                del self._exited[pid]
            elif pid not in rows:
                rows[pid] = (attrs, c)
        self.proc_rows = rows
        if self.telemetry:
            self.telemetry.set_process_counters(rows, self._proc_faults(rows))
            if self.cuda is not None:
                # distinct libcuda files not followed (agent/libtrust.py, cuda.max_libraries)
                self.health.rejected["libcuda_refused"] = self.cuda.refused_total
                self.health.errors["cuda"] = self.cuda.error_count
                self.telemetry.set_cuda(self.cuda.governor_status(), self.cuda.ioctl_rows(), self.cuda.hist_rows())

    def _proc_faults(self, rows: dict) -> dict[int, tuple[int, int]]:
        """pid -> (minflt, majflt) from /proc/PID/stat: the kernel's own split of major and minor
        faults, which exceptions:page_fault_user does not give (no kprobes here)."""
        out = {}
        for pid in rows:
            try:
                with open(f"{self.proc_root}/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[pid] = (int(fields[7]), int(fields[9]))
            except (OSError, IndexError, ValueError):  # exited since the map read
                continue
        return out

    def _watch_loop(self) -> None:
        scan = discovery.WatchScan(self.proc_root, budget_s=WATCH_PASS_S, stop=self._watch_stop)
        while not self._watch_stop.is_set():
            try:
                done = self._refresh_watch(scan)
            except Exception as e:  # noqa: BLE001 -- the next round tries again
                self._survived("watch_scan", e)
                done = True
            self._watch_stop.wait(WATCH_SCAN_S if done else WATCH_GAP_S)

    def _refresh_watch(self, scan: discovery.WatchScan) -> bool:
        """One pass of `scan`; when it completes a round, watch_tgid gets that round's set. True then."""
        cfg = self.cfg
        before = scan.result
        want = discovery.watch_set(self.proc_root, cfg.process_pids, cfg.process_comms,
                                   gpu=cfg.process_watch == "gpu", scan=scan)
        b = self.bpf  # once: stop() may clear it meanwhile
        if want is before or b is None:
            return False
        table = b[b"watch_tgid"]
        follow = set()
        for pid in want:
            try:
                table[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
                follow.add(pid)
            except Exception as e:  # noqa: BLE001 -- watch_tgid full (E2BIG): counted, the rest still go in
                self._survived("watch_map_full", e)
        # A process that exited between the /proc walk and this write got an entry after its exit
        # had cleared it in the kernel: nothing else would remove it. Each refresh removes ours of
        # processes now gone (zombies included) and keeps following the rest.
        for pid in self._watch_written - follow:
            if self._pid_gone(pid):
                table.pop(ctypes.c_uint32(pid), None)
            else:
                follow.add(pid)
        self._watch_written = follow
        return True

    def _pid_gone(self, pid: int) -> bool:
        try:
            with open(f"{self.proc_root}/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
        except (OSError, IndexError):
            return True

    def _expire(self) -> None:
        b = self.bpf
        if b is None:
            return
        idle_ns = int(self.cfg.requests_idle_expiry_s * 1e9)
        now_ns = time.monotonic_ns()
        reqs, tgids = b[b"req_by_tid"], b[b"tgid_state"]
        live = set()
        for k, st in list(reqs.items()):
            key = (st.tgid, k.value)
            if now_ns - st.begin_ns < idle_ns:
                live.add(key)
                continue
            try:
                del reqs[k]
            except KeyError:  # ended by the kernel meanwhile
                continue
            ts = tgids.get(ctypes.c_uint32(st.tgid))
            if ts is not None and ctypes.c_int32(ts.open).value > 0:
                ts.open -= 1
                owners.update_existing(tgids, ctypes.c_uint32(st.tgid), ts)
                owners.release_open(b, ts)
            self._emit(self.joiner.on_expired(st.tgid, k.value, st.request_id, st.begin_ns, now_ns,
                                              counters_from(st.c)))
        self.joiner.drop_orphans(now_ns - idle_ns, live)

    # ---- reporting ----
    def status_line(self) -> str:
        h, s = self.health, self.telemetry.stats.snapshot() if self.telemetry else {}
        c = self.plan.counts() if self.plan else {}
        rejected = sum(self.telemetry.rejected().values()) if self.telemetry else 0
        return (f"probes {c.get('attached', 0)}/{len(self.plan.statuses) if self.plan else 0} | "
                f"requests {sum(h.requests.values())} open {len(self.joiner.open)} | "
                f"spans exported {s.get('spans_exported', 0)} dropped "
                f"{s.get('spans_dropped_queue', 0) + s.get('spans_failed', 0)} | "
                f"lost kernel {h.kernel_lost()} user {h.user_lost} | rejected {rejected}")
