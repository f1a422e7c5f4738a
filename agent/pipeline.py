"""The agent's one pipeline: probe -> decode -> join -> telemetry, and its threads.

One thread (the caller's) polls the BPF ring buffer and, once a second, reads the aggregate maps,
ends idle requests and refreshes the watch set. Export runs on the OTel SDK's own threads behind
bounded queues, so reading BPF never waits on a collector. Nothing else here does I/O for telemetry.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

from . import discovery, kernel, loader, probes
from .config import Config
from .decode import Counters, DecodeError, ProcExit, ReqBegin, ReqEnd, counters_from, decode
from .identity import ProcessRegistry
from .join import RequestJoiner
from .records import KERNEL_STATS, ReqState, TgidState
from .telemetry import AgentHealth, Telemetry
from .timebase import Timebase
from mcp_hostagent.exporters import Exporters, build_exporters

log = logging.getLogger("mcp_hostagent")

WATCH_SCAN_S = 5.0
EXPIRY_SCAN_S = 5.0
EXITED_KEEP_S = 30.0  # keep an exited process's final counters for a couple of metric exports


class StartError(RuntimeError):
    """The agent cannot start; the message is one line with a hint."""


@dataclass
class StartReport:
    headers: str
    tracefs: list[str]
    compile_s: float
    plan: probes.ProbePlan
    sinks: list[str]


def bpf_settings(cfg: Config) -> dict[str, int]:
    return {
        "MCP_MAX_OPEN_PER_PID": cfg.requests_max_open_per_pid,
        "MCP_MAX_BEGINS_PER_S": cfg.requests_max_begins_per_s_per_pid,
        "MCP_WATCH_ALL": cfg.process_watch == "all",
    }


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


class Agent:
    def __init__(self, cfg: Config, exporters: Exporters | None = None, progress=None, proc_root: str = "/proc"):
        self.cfg = cfg
        self.progress = progress
        self.proc_root = proc_root
        self.joiner = RequestJoiner()
        # one Counter for every user-space rejection reason: the joiner's and decode's
        self.health = AgentHealth(rejected=self.joiner.rejected)
        self.registry = ProcessRegistry(proc_root=proc_root)
        self.timebase = Timebase()
        self._exporters = exporters
        self.loaded: list[loader.Loaded] = []
        self.bpf = None
        self.telemetry: Telemetry | None = None
        self.plan: probes.ProbePlan | None = None
        self._exited: dict[int, tuple[float, dict, Counters]] = {}
        self._next_watch = self._next_expiry = 0.0
        self._last_error_log = 0.0
        self._stopped = False

    # ---- start / stop ----
    def start(self) -> StartReport:
        cfg = self.cfg
        hc, mounted = prepare_kernel(cfg)
        self.plan = probes.plan(cfg.probes_disable)
        exporters = self._exporters or build_exporters(
            cfg.export_jsonl_path or None, cfg.export_otlp_endpoint, cfg.export_otlp_protocol,
            console_stream=sys.stdout if cfg.export_console else None)
        self.loaded = loader.load(self.plan, bpf_settings(cfg), self.progress)
        self.health.compile_s = sum(x.compile_s for x in self.loaded)
        self.health.probes = {n: s.state for n, s in self.plan.statuses.items()}
        if cfg.probes_strict and self.plan.missing():
            self.detach()
            names = ", ".join(f"{s.spec.name} ({s.reason})" for s in self.plan.missing())
            raise StartError(f"--strict: probes missing: {names}")
        if not self.loaded:
            raise StartError("no BPF program loaded: " + "; ".join(s.reason for s in self.plan.missing()))
        self.bpf = self.loaded[0].bpf
        self.telemetry = Telemetry(service_name=cfg.service_name, exporters=exporters, timebase=self.timebase,
                                   health=self.health, max_queue_size=cfg.export_max_queue_size,
                                   metric_interval_s=cfg.export_metric_interval_s)
        self.bpf[b"events"].open_ring_buffer(self._on_event)
        self.tick()
        return StartReport(hc.description, mounted, self.health.compile_s, self.plan, exporters.describe())

    def detach(self) -> None:
        for x in self.loaded:
            x.bpf.cleanup()
        self.loaded = []
        self.bpf = None

    def stop(self, timeout_s: float = 3.0) -> bool:
        """Drain the ring buffer, detach, flush. True if the exporters flushed within timeout_s."""
        if self._stopped:
            return True
        self._stopped = True
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

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_watch:
            self._refresh_watch()
            self._next_watch = now + WATCH_SCAN_S
        if now >= self._next_expiry:
            self._expire()
            self._next_expiry = now + min(EXPIRY_SCAN_S, self.cfg.requests_idle_expiry_s / 2)
        self._read_maps()

    # ---- ring buffer ----
    def _on_event(self, ctx, data, size) -> int:
        try:
            rec = decode(ctypes.string_at(data, size))
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
            self.registry.lookup(rec.hdr.tgid, rec.hdr.comm)  # while it surely lives
        elif isinstance(rec, ReqEnd):
            self._emit(self.joiner.on_end(rec))
        elif isinstance(rec, ProcExit):
            for fr in self.joiner.on_proc_exit(rec):
                self._emit(fr)
            attrs = self._proc_attrs(rec.hdr.tgid, rec.hdr.comm)
            self._exited[rec.hdr.tgid] = (time.monotonic() + EXITED_KEEP_S, attrs, rec.counters)
            self.registry.forget(rec.hdr.tgid)

    def _proc_attrs(self, pid: int, comm: bytes = b"") -> dict:
        return self.registry.attributes(self.registry.lookup(pid, comm))

    def _emit(self, fr) -> None:
        self.telemetry.emit_request(fr, self._proc_attrs(fr.tgid, fr.comm))

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
        rows = {}
        for k, v in b[b"proc_stats"].items():
            rows[k.value] = (self._proc_attrs(k.value), counters_from(v))
        now = time.monotonic()
        for pid, (until, attrs, c) in list(self._exited.items()):
            if now > until:
                del self._exited[pid]
            elif pid not in rows:
                rows[pid] = (attrs, c)
        if self.telemetry:
            self.telemetry.set_process_counters(rows)

    def _refresh_watch(self) -> None:
        cfg = self.cfg
        if cfg.process_watch == "all" or self.bpf is None:
            return
        want = discovery.watch_set(self.proc_root, cfg.process_pids, cfg.process_comms, gpu=cfg.process_watch == "gpu")
        table = self.bpf[b"watch_tgid"]
        for pid in want:
            table[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

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
            if ts is not None and ts.open > 0:
                ts.open -= 1
                tgids[ctypes.c_uint32(st.tgid)] = ts
            self._emit(self.joiner.on_expired(st.tgid, k.value, st.request_id, st.begin_ns, now_ns,
                                              counters_from(st.c)))
        self.joiner.drop_orphans(now_ns - idle_ns, live)

    # ---- reporting ----
    def status_line(self) -> str:
        h, s = self.health, self.telemetry.stats.snapshot() if self.telemetry else {}
        c = self.plan.counts() if self.plan else {}
        rejected = sum(self.telemetry._rejected().values()) if self.telemetry else 0
        return (f"probes {c.get('attached', 0)}/{len(self.plan.statuses) if self.plan else 0} | "
                f"requests {sum(h.requests.values())} open {len(self.joiner.open)} | "
                f"spans exported {s.get('spans_exported', 0)} dropped "
                f"{s.get('spans_dropped_queue', 0) + s.get('spans_failed', 0)} | "
                f"lost kernel {h.kernel_lost()} user {h.user_lost} | rejected {rejected}")
