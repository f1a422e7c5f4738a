"""The core: make the capabilities from their declarations, load the BPF unit they declare, route each
ring-buffer record by its type to the capability that owns it, run the request path, and schedule the
periodic work. It knows no capability by name (agent/registry.py lists them) and drives every one
through the one protocol of core/capability.py; docs/ARCHITECTURE.md draws it.

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
from ..telemetry.snapshot import AgentView, SnapshotBuilder
from . import discovery, imports_behind, kernel, loader, probes
from . import request as request_mod
from .capability import CapabilityError, Context
from .decode import TP_RAW, DecodeError, Route, decode
from .health import AgentHealth
from .processes import Processes
from .rawtp import RawDecoder
from .timebase import Timebase
from .tracefs import RecordError
from .unit import Unit

if TYPE_CHECKING:  # imported in start(), after the attach: they import the OpenTelemetry SDK
    from ..exporters import Exporters
    from ..telemetry.otel import Telemetry

log = logging.getLogger("mcp_hostagent")

TICK_STEP_LOG_S = 60.0  # a failing tick step is logged at most this often (and counted always)
LOST_LOG_INTERVAL_S = 30.0  # ring-buffer losses: counted always, a log line at most this often
USER_LOST_LOG_S = 30.0
RINGS = (b"events",)  # the core's own ring buffer (bpf/common.bpf.c); capabilities declare theirs
# an input the core itself uses: whether a maps line maps a libcuda whose process is a GPU process
LIBCUDA_TRUST = "watch.libcuda_trusted"


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
    compile_processes: str = ""  # loader.Loaded.processes: how the unit came (compiled, from the cache)


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
    """Made, not started, an Agent already routes and decodes records (the raw tracepoint copies need no
    BPF object of the agent's own); start() loads the programs and starts every capability."""

    def __init__(self, cfg: Config, capabilities, exporters: Exporters | None = None, progress=None,
                 proc_root: str = "/proc", sysfs_root: str = "/sys", **options):
        """capabilities: their Declarations, in the order they are driven (agent/registry.py);
        options: per-capability test hooks (gpuhealth's nvml_module)."""
        self.cfg = cfg
        self.progress = progress
        self.proc_root = proc_root
        self.unit = Unit(capabilities)
        self.health = AgentHealth()
        self.processes = Processes(proc_root, cfg.process_command_line)
        self.timebase = Timebase()
        self._exporters = exporters
        self.loaded: list[loader.Loaded] = []
        self.bpf = None
        self.plan: probes.ProbePlan | None = None
        self.telemetry: Telemetry | None = None
        self.ctx = Context(cfg, self.health, self.processes, self.timebase, proc_root, sysfs_root, options,
                           survived=self._survived)
        self.caps: dict[str, object] = {}  # name -> Capability, in the registry's order
        self._pairs = []  # (Declaration, Capability)
        for d in self.unit.declarations:
            cap = d.make()(self.ctx)
            self.caps[d.name] = cap
            self._pairs.append((d, cap))
            for name, fn in cap.provided().items():
                if name not in d.provides:
                    raise ValueError(f"capability {d.name} provides {name!r} without declaring it")
                self.ctx.inputs.provide(d.name, name, fn)
        for d in self.unit.declarations:
            for name in d.needs:
                if not self.ctx.inputs.has(name):
                    raise ValueError(f"capability {d.name} needs input {name!r}, which none provides")
        self.path = request_mod.RequestPath(self._pairs, self.processes, None, self.health)  # one writer per attribute
        self.ctx.finish = self.path.finish
        self.snapshots = SnapshotBuilder(  # `mcp-agent top`
            [s for s in (cap.section() for _, cap in self._pairs) if s is not None], to_wall=self.timebase.to_wall_ns)
        self.path.listeners.append(self.snapshots.on_request)
        self._raw_owner = {kind: cap for d, cap in self._pairs for kind in d.raw}
        self.raw = RawDecoder(self.unit.raw_kinds(), missing_why=self.unit.missing_why())
        self.routes: dict[int, Route] = self._route_table()
        self.kernel_stats_labels = self.unit.kernel_stats()
        self.health.activity = self.unit.activity_stats()
        self.watcher: discovery.Watcher | None = None
        self._last_error_log = 0.0
        self._lost_log = (float("-inf"), 0)  # (when, kernel losses then) of the last loss line
        self._stopped = False
        self._caps_stopped = False
        self._step_logged: dict[str, float] = {}  # tick step -> when its failure was last logged

    def _route_table(self) -> dict[int, Route]:
        """Record type -> its struct, builder and handlers: each capability's own records, the raw
        tracepoint copies (decoded here, handed to the capability that declared the kind)."""
        table = {t: r.with_handlers(self._on_raw) for t, r in TP_RAW.items()}
        for d, cap in self._pairs:
            for t, r in cap.routes().items():
                if t in table:
                    raise ValueError(f"record type {t} routed by both {d.name} and another")
                table[t] = r
        return table

    # ---- start / stop ----
    def start(self) -> StartReport:
        cfg = self.cfg
        raise_nofile()
        hc, mounted = prepare_kernel(cfg)
        self.plan = self.ctx.plan = self.unit.plan(cfg)
        try:
            for _, cap in self._pairs:
                cap.prepare()
        except CapabilityError as e:
            raise StartError(str(e)) from None
        self.loaded = loader.load(self.unit, self.plan, self.unit.settings(cfg), self.progress)
        if self.loaded:  # before any probe sees a record (the maps exist from the load on)
            self.bpf = self.ctx.bpf = self.loaded[0].bpf
            discovery.write_kernel_rules(self.bpf, cfg)
            for _, cap in self._pairs:
                cap.loaded()
        self.health.compile_s = sum(x.compile_s for x in self.loaded)
        self.health.probes = {n: s.state for n, s in self.plan.statuses.items()}
        missing = self.plan.missing()
        reasons = "; ".join(dict.fromkeys(s.reason for s in missing))  # one compile error, not one per probe
        if cfg.probes_strict and missing:
            self.detach()
            raise StartError(f"--strict: probes missing: {', '.join(s.spec.name for s in missing)}: {reasons}")
        if not self.loaded:
            raise StartError(f"no BPF program loaded: {reasons}")
        # every probe attached: nothing of the load's left to share the GIL with
        imports_behind.after_load(*(m for d in self.unit.declarations for m in d.imports_after_load(cfg)))
        imports_behind.wait()
        from .. import exporters as exporters_mod
        from ..telemetry.otel import Telemetry

        try:  # once nothing else can refuse the start: the Prometheus endpoint binds its port here
            exporters = self._exporters or exporters_mod.from_config(cfg)
        except ConfigError as e:
            self.detach()
            raise StartError(str(e)) from None
        tel = self.telemetry = self.ctx.telemetry = self.path.telemetry = Telemetry(
            service_name=cfg.service_name, exporters=exporters, timebase=self.timebase,
            max_queue_size=cfg.export_max_queue_size, metric_interval_s=cfg.export_metric_interval_s)
        self.processes.on_gone = tel.forget_processes
        imports_behind.wait_after_load()
        sources = [src for _, cap in self._pairs for src in cap.start()]
        for src in sources:
            self.health.probes[src.name] = src.state
            self.health.source_reasons[src.name] = src.reason
        tel.declare(self.processes.instruments())
        tel.declare(request_mod.INSTRUMENTS)
        for _, cap in self._pairs:
            tel.declare(cap.instruments())
        tel.declare(self.health.instruments(exporters.stats))
        for name in RINGS + tuple(r for d in self.unit.declarations for r in d.rings):
            cb = self._on_event
            for _, cap in self._pairs:
                cb = cap.ring(name, cb)
            self.bpf[name].open_ring_buffer(cb)
        if cfg.process_watch != "all":
            trusted = self.ctx.inputs.get(LIBCUDA_TRUST, None) if self.ctx.inputs.has(LIBCUDA_TRUST) else None
            self.watcher = discovery.Watcher(cfg, self.proc_root, lambda: self.bpf, self._survived, trusted)
            self.watcher.start()
        self.tick()
        return StartReport(hc.description, mounted, self.health.compile_s, self.plan, exporters.describe(), sources,
                           "; ".join(x.processes for x in self.loaded))

    def _stop_capabilities(self) -> None:
        """Each capability's stop, last first: before the BPF object goes (the uprobes and tracepoint
        fds a capability attached itself hold its programs)."""
        if self._caps_stopped:
            return
        self._caps_stopped = True
        for d, cap in reversed(self._pairs):
            try:
                cap.stop()
            except Exception as e:  # noqa: BLE001 -- stopping must finish for the others
                self._survived(f"stop_{d.name}", e)

    def detach(self) -> None:
        self._stop_capabilities()
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
        self.bpf = self.ctx.bpf = None

    @staticmethod
    def _detach_tp(bpf, tp: bytes) -> None:
        try:
            bpf.detach_tracepoint(tp)
        except Exception:  # not attached (its attach failed): cleanup() has nothing to do for it either
            pass

    def stop(self, timeout_s: float = 3.0) -> bool:
        """Drain the ring buffers, detach, flush. True if the exporters flushed within timeout_s."""
        if self._stopped:
            return True
        self._stopped = True
        if self.watcher is not None:
            self.watcher.stop()
        if self.bpf is not None:
            self.bpf.ring_buffer_consume()
            self._read_maps()
        self.detach()
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
        for _, cap in self._pairs:
            cap.polled()

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

    def _on_raw(self, rec) -> None:
        """A raw tracepoint copy: decoded with its event's run-time format, to the capability of its kind."""
        try:
            ev = self.raw.decode(rec)
        except RecordError:
            self.health.rejected["tracepoint_record"] += 1
            return
        owner = self._raw_owner.get(rec.kind)
        if owner is not None:
            owner.raw(rec.kind, ev, rec.hdr.ts_ns)  # bpf_ktime_get_ns(): CLOCK_MONOTONIC

    def tick(self) -> None:
        """The periodic work, step by step. A step that fails (a map write refused, EMFILE, a /proc
        file that changed shape under it) is counted in hostagent.agent.errors and logged at most once a
        minute; the other steps and the ring buffer go on: nothing a local user can make the kernel
        or /proc answer may end the agent."""
        if self.bpf is None:
            return
        self.timebase.refresh()  # a wall-clock step (NTP, a VM restored) reaches span times within a tick
        self._step("read_maps", self._read_maps)
        for d, cap in self._pairs:
            self._step(d.name, cap.tick)
        self._step("snapshot", lambda: self.snapshots.on_tick(self.processes.rows, self.agent_view()))

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
            label = self.kernel_stats_labels.get(k.value)
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

    # ---- reporting ----
    def in_flight(self) -> int:
        return sum(cap.in_flight() for _, cap in self._pairs)

    def agent_view(self) -> AgentView:
        h = self.health
        return AgentView(probes_attached=self.plan.live() if self.plan else 0,  # attached, armed, duty-cycled
                         probes_total=len(self.plan.statuses) if self.plan else 0, lost_kernel=h.kernel_lost(),
                         lost_user=h.user_lost, requests_total=sum(h.requests.values()), open_requests=self.in_flight())

    def status_line(self) -> str:
        h, s = self.health, self.telemetry.stats.snapshot() if self.telemetry else {}
        return (f"probes {self.plan.live() if self.plan else 0}/{len(self.plan.statuses) if self.plan else 0} | "
                f"requests {sum(h.requests.values())} open {self.in_flight()} | "
                f"spans exported {s.get('spans_exported', 0)} dropped "
                f"{s.get('spans_dropped_queue', 0) + s.get('spans_failed', 0)} | "
                f"lost kernel {h.kernel_lost()} user {h.user_lost} | rejected {sum(h.all_rejected().values())}")
