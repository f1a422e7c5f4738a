"""The core: load the BPF programs, route each ring-buffer record by its type to the capabilities
that own it, and schedule their periodic work. The capabilities (requests, reclaim, cuda,
gpuhealth, pcie, nic, numa) do the rest; this file only wires them (what one needs of another is handed
to it here) and docs/ARCHITECTURE.md has one line per capability.

One thread (the caller's) polls the ring buffers and, once a tick, reads the maps and runs each
capability's tick step; the watch scan has a thread of its own. Export runs on the OTel SDK's
threads behind bounded queues, so reading BPF never waits on a collector.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import Config, ConfigError
from ..cuda.capability import Cuda
from ..cuda.finder import trusted_libcuda
from ..gpuhealth.capability import GpuHealth
from ..nic.capability import Nic
from ..numa.capability import Numa
from ..pcie.capability import Pcie
from ..pcie.records import AerRecord, LinkEventRecord
from ..reclaim.capability import Reclaim
from ..reclaim.oom import OomKill
from ..requests import owners
from ..requests.capability import Requests
from ..http import records as http_records
from ..http.capability import Http
from ..telemetry.snapshot import AgentView, SnapshotBuilder, TickState
from . import discovery, imports_behind, kernel, loader, probes
from . import records as R
from .decode import DecodeError, Route, decode
from .health import AgentHealth
from .processes import Processes
from .timebase import Timebase

if TYPE_CHECKING:  # imported in start(), after the attach: they import the OpenTelemetry SDK
    from ..exporters import Exporters
    from ..telemetry.otel import Telemetry

log = logging.getLogger("mcp_hostagent")

TICK_STEP_LOG_S = 60.0  # a failing tick step is logged at most this often (and counted always)
LOST_LOG_INTERVAL_S = 30.0  # ring-buffer losses: counted always, a log line at most this often
USER_LOST_LOG_S = 30.0


class StartError(RuntimeError):
    """The agent cannot start; the message is one line with a hint."""


@dataclass
class StartReport:
    headers: str
    tracefs: list[str]
    compile_s: float
    plan: probes.ProbePlan
    sinks: list[str]
    sources: list  # core.capability.SourceStatus: NVML, Xid, PCIe sysfs, netlink
    compile_processes: str = ""  # loader.Loaded.processes: "2 processes", or "1 process" and why


bpf_settings = loader.bpf_settings  # a name of this module's: tests replace it here


def prepare_kernel(cfg: Config) -> tuple[kernel.HeaderChoice, list[str]]:
    if os.geteuid() != 0:
        raise StartError("mcp-agent must run as root (BPF, tracefs); HINT: sudo mcp-agent ...")
    try:
        return kernel.prepare(cfg.kernel_headers, cfg.kernel_link_modules_build)
    except kernel.KernelSetupError as e:
        raise StartError(str(e)) from e


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
    """Not started, an Agent still decodes and handles the health tracepoints' records (gpuhealth,
    pcie: no BPF object needed); the other record types are routed once start() loaded the programs."""

    def __init__(self, cfg: Config, exporters: Exporters | None = None, progress=None,
                 proc_root: str = "/proc", nvml_module=None, sysfs_root: str = "/sys"):
        self.cfg = cfg
        self.progress = progress
        self.proc_root = proc_root
        self.health = AgentHealth()
        self.processes = Processes(proc_root, cfg.process_command_line)
        self.timebase = Timebase()
        self._exporters = exporters
        self.loaded: list[loader.Loaded] = []
        self.bpf = None
        self.plan: probes.ProbePlan | None = None
        self.telemetry: Telemetry | None = None
        self.snapshots = SnapshotBuilder(proc_root, to_wall=self.timebase.to_wall_ns,  # `mcp-agent top`
                                         busy_util_pct=cfg.pcie_busy_util_pct)
        # capabilities without a BPF object of their own to wait for
        self.gpu = GpuHealth(enabled=cfg.gpu_enabled, sample_period_s=cfg.gpu_sample_period_s,
                             slow_period_s=cfg.gpu_slow_period_s, nvml_module=nvml_module, rejected=self.health.rejected)
        self.pcie = Pcie(sysfs_root=sysfs_root, busy_util_pct=cfg.pcie_busy_util_pct, util=self.gpu.util_by_bdf,
                         gpus_of=self.gpu.gpus_of)
        self.pcie.episode_listeners.append(self.snapshots.on_link_episode)
        self.gpu.record_handlers.update({AerRecord: self.pcie.on_aer, LinkEventRecord: self.pcie.on_link_event})
        self.nic = Nic(enabled=cfg.nic_enabled, sysfs_root=sysfs_root)
        self.numa = Numa(gpu_processes=self.gpu.gpu_processes, sysfs_root=sysfs_root, proc_root=proc_root)
        self.cuda_cap = Cuda(processes=self.processes, health=self.health)
        self.routes: dict[int, Route] = self.gpu.routes()
        # made once the programs are loaded
        self.requests: Requests | None = None
        self.http: Http | None = None
        self.reclaim: Reclaim | None = None
        self.watcher: discovery.Watcher | None = None
        self._last_error_log = 0.0
        self._lost_log = (float("-inf"), 0)  # (when, kernel losses then) of the last loss line
        self._stopped = False
        self._step_logged: dict[str, float] = {}  # tick step -> when its failure was last logged

    @property
    def cuda(self):
        """The CUDA probes (libcuda uprobes, NVIDIA ioctl programs, governor), or None."""
        return self.cuda_cap.probes

    @cuda.setter
    def cuda(self, probes) -> None:  # tests run the agent with probes of their own settings
        self.cuda_cap.probes = probes

    # ---- start / stop ----
    def start(self) -> StartReport:
        cfg = self.cfg
        raise_nofile()
        hc, mounted = prepare_kernel(cfg)
        self.plan = probes.plan(cfg.probes_disable, off=probes.switched_off(cfg))
        try:
            allow = owners.allowed_owners(cfg)
        except owners.OwnerError as e:
            raise StartError(str(e)) from None
        self.gpu.warm()
        self.loaded = loader.load(self.plan, bpf_settings(cfg), self.progress)
        if self.loaded:  # before any probe sees a marker (the maps exist from the load on)
            owners.write_allow(self.loaded[0].bpf, allow)
            discovery.write_kernel_rules(self.loaded[0].bpf, cfg)
            self.cuda_cap.start(self.loaded[0].bpf, self.plan, cfg, self.proc_root)
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
        if cfg.nic_enabled:  # every probe attached: nothing of the load's left to share the GIL with
            imports_behind.after_load("pyroute2")
        imports_behind.wait()
        from .. import exporters as exporters_mod
        from ..telemetry.otel import Telemetry

        try:  # once nothing else can refuse the start: the Prometheus endpoint binds its port here
            exporters = self._exporters or exporters_mod.from_config(cfg)
        except ConfigError as e:
            self.detach()
            raise StartError(str(e)) from None
        tel = self.telemetry = Telemetry(service_name=cfg.service_name, exporters=exporters, timebase=self.timebase,
                                         max_queue_size=cfg.export_max_queue_size,
                                         metric_interval_s=cfg.export_metric_interval_s)
        self.processes.on_gone = tel.forget_processes
        self.reclaim = Reclaim(self.bpf, cfg, telemetry=tel, registry=self.processes.registry, proc_root=self.proc_root,
                               kswapd_attached=self.health.probes.get("kswapd_wake") == probes.ATTACHED)
        self.gpu.record_handlers[OomKill] = self.reclaim.on_oom  # decoded from health.bpf.c's copies
        self.pcie.attach_telemetry(tel)
        self.cuda_cap.attach_telemetry(tel)
        # a request's evidence, in the order its attributes, links and events are merged
        self.requests = Requests(self.bpf, idle_expiry_s=cfg.requests_idle_expiry_s, health=self.health,
                                 processes=self.processes, telemetry=tel,
                                 evidence=(self.reclaim.evidence, self.gpu.evidence, self.pcie.evidence,
                                           self.nic.evidence, self.numa.evidence, self.cuda_cap.evidence),
                                 listeners=(self.snapshots.on_request, self.reclaim.on_request))
        self.http = Http(self.bpf, finish=self.requests.finish, idle_expiry_s=cfg.requests_idle_expiry_s,
                         rejected=self.health.rejected, proc_root=self.proc_root,
                         sock_tracepoints=http_records.sock_tracepoints(cfg))
        self.cuda_cap.root_of = self.http.root_of  # a tree group's GPU steps (requests.group = tree)
        self.routes = self._route_table()
        imports_behind.wait_after_load()  # pyroute2, for the NIC watch
        sources = [*self.gpu.start(bpf_xid=self.health.probes.get("gpu_xid") == probes.ATTACHED),
                   *self.pcie.start(enabled=cfg.gpu_enabled), *self.nic.start(),
                   *self.numa.start(self.bpf, switch_attached=self.health.probes.get("sched_switch") == probes.ATTACHED,
                                    nvml_attached=getattr(self.gpu.sources.get("nvml"), "state", None) == "attached")]
        for src in sources:
            self.health.probes[src.name] = src.state
            self.health.source_reasons[src.name] = src.reason
        for cap in (self.processes, self.reclaim, self.cuda_cap, self.requests, self.gpu, self.pcie, self.nic):
            tel.declare(cap.instruments())
        tel.declare(self.health.instruments(exporters.stats))
        self.bpf[b"events"].open_ring_buffer(self._on_event)
        self.bpf[b"req_events"].open_ring_buffer(self.requests.counting(self._on_event))
        self.bpf[b"http_events"].open_ring_buffer(self.http.counting(self._on_event))
        if cfg.process_watch != "all":
            # a libcuda mapping makes a GPU process only if the CUDA finder's trust check passes: handed in
            # here, so that the core imports no capability
            self.watcher = discovery.Watcher(cfg, self.proc_root, lambda: self.bpf, self._survived, trusted_libcuda)
            self.watcher.start()
        self.tick()
        self.reclaim.close_window()  # baseline of the reclaim totals: the first window counts from here
        return StartReport(hc.description, mounted, self.health.compile_s, self.plan, exporters.describe(), sources,
                           "; ".join(x.processes for x in self.loaded))

    def _route_table(self) -> dict[int, Route]:
        """Record type -> its struct, builder and handlers: each capability's own records, plus the
        handlers of capabilities that consume another's (requests takes reclaim's stalls)."""
        caps = (self.gpu, self.requests, self.http, self.reclaim, self.cuda_cap)
        table = {t: r for cap in caps for t, r in cap.routes().items()}
        for cap in caps:
            for rtype, handler in getattr(cap, "handlers", dict)().items():
                table[rtype] = table[rtype].with_handlers(handler)
        return table

    def detach(self) -> None:
        self.cuda_cap.stop()  # its uprobes and tracepoint fds go before the BPF object
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
        if self.watcher is not None:
            self.watcher.stop()
        if self.bpf is not None:
            self.bpf.ring_buffer_consume()
            self._read_maps()
        self.detach()
        self.gpu.stop()
        self.nic.stop()
        if self.telemetry is None:
            return True
        self.reclaim.stop()
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
        self.requests.tell_consumed()

    def _on_event(self, ctx, data, size) -> int:
        try:
            rec, route = decode(ctypes.string_at(data, size), self.routes)
        except DecodeError as e:
            self.health.rejected[f"decode_{e.reason}"] += 1
            return 0
        try:
            for handle in route.handlers:
                handle(rec)
        except Exception:  # one bad record must not stop the reader; counted and logged at most every 30 s
            self.health.user_lost += 1
            if time.monotonic() - self._last_error_log > USER_LOST_LOG_S:
                self._last_error_log = time.monotonic()
                log.exception("handling %s failed (counted in hostagent.agent.events.lost{where=user})", type(rec).__name__)
        return 0

    def tick(self) -> None:
        """The periodic work, step by step. A step that fails (a map write refused, EMFILE, a /proc
        file that changed shape under it) is counted in hostagent.agent.errors and logged at most once a
        minute; the other steps and the ring buffer go on: nothing a local user can make the kernel
        or /proc answer may end the agent."""
        if self.bpf is None:
            return
        self.timebase.refresh()  # a wall-clock step (NTP, a VM restored) reaches span times within a tick
        self._step("expire", self.requests.tick)
        self._step("http", self.http.tick)
        self._step("read_maps", self._read_maps)
        self._step("gpu", self._gpu_tick)
        self._step("numa", self.numa.tick)
        self._step("reclaim_window", self.reclaim.tick)
        self._step("snapshot", lambda: self.snapshots.on_tick(self.tick_state()))

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
            log.warning("%s failed (%s: %s); counted in hostagent.agent.errors, going on", where, type(e).__name__, e)

    # ---- maps ----
    def _read_maps(self) -> None:
        b = self.bpf
        if b is None:
            return
        totals = {}
        for k, v in b[b"stats"].items():
            label = R.KERNEL_STATS.get(k.value)
            if label:
                totals[label] = sum(v)
        self.health.kernel_stats = totals
        lost, (at, logged) = self.health.kernel_lost(), self._lost_log
        if lost > logged and time.monotonic() - at >= LOST_LOG_INTERVAL_S:
            self._lost_log = (time.monotonic(), lost)
            log.warning("ring buffer full: %d records lost in the kernel (%d since start), counted in "
                        "hostagent.agent.events.lost{hostagent.where=kernel}; next report in %.0f s at the earliest",
                        lost - logged, lost, LOST_LOG_INTERVAL_S)
        self.processes.read(b)
        self.cuda_cap.publish()

    def _gpu_tick(self) -> None:
        """GPU health, PCIe links and NIC events: one step, as before they were capabilities apart."""
        self.gpu.tick()
        self.pcie.tick()
        self.nic.tick()

    # ---- reporting ----
    def tick_state(self) -> TickState:
        """The plain state the top snapshot is built from, once a tick."""
        h = self.health
        return TickState(
            proc_rows=self.processes.rows, kswapd=self.reclaim.kswapd if self.reclaim else None,
            open_storms=self.reclaim.open_storms() if self.reclaim else [], gpu=self.gpu, pcie=self.pcie,
            nic=self.nic, to_wall=self.timebase.to_wall_ns, agent=AgentView(
                probes_attached=self.plan.live() if self.plan else 0,  # attached, armed, duty-cycled
                probes_total=len(self.plan.statuses) if self.plan else 0,
                lost_kernel=h.kernel_lost(), lost_user=h.user_lost, requests_total=sum(h.requests.values()),
                open_requests=len(self.requests.joiner.open) if self.requests else 0))

    def status_line(self) -> str:
        h, s = self.health, self.telemetry.stats.snapshot() if self.telemetry else {}
        return (f"probes {self.plan.live() if self.plan else 0}/{len(self.plan.statuses) if self.plan else 0} | "
                f"requests {sum(h.requests.values())} open {len(self.requests.joiner.open) if self.requests else 0} | "
                f"spans exported {s.get('spans_exported', 0)} dropped "
                f"{s.get('spans_dropped_queue', 0) + s.get('spans_failed', 0)} | "
                f"lost kernel {h.kernel_lost()} user {h.user_lost} | rejected {sum(h.all_rejected().values())}")
