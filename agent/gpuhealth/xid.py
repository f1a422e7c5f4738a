"""NVIDIA Xid errors from both sources: the nvidia:nvidia_dev_xid tracepoint's raw record (decode_xid ->
XidRecord, pure) and NVML's event API (XidWatcher, on its own thread); both become XidEvents.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..core.tracefs import RecordError, TpField, TracepointFormat, decode_captured
from ..core.topology import normalize_bdf
from .nvml import NA, TIMEOUT, Nvml, NvmlError

XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError: eventData is the Xid number

_XID_TASK = re.compile(r"^pid=(\d+), name=([^,]*), ")


@dataclass(frozen=True)
class XidRecord:
    dev: str  # PCI address as the driver writes it ("0000:00:06.0")
    error_code: int  # the Xid
    msg: str
    pid: int  # common_pid: the task that ran the tracepoint (often the driver's irq thread)
    truncated: bool = False  # msg was cut at the end of the BPF copy

    @property
    def process(self) -> tuple[int, str] | None:
        """The faulting process (pid, name) where msg names it. The kernel log's line for an MMU
        fault starts "pid=574, name=python3, channel ..."; driver 580's tracepoint msg left that part
        out (tests/fixtures/gpu/xid.json), so this is None there."""
        m = _XID_TASK.match(self.msg)
        return (int(m[1]), m[2]) if m else None


# The layout recorded on the H200 host (driver 580.159.04), the default when no format file is at hand.
NVIDIA_DEV_XID_FORMAT = TracepointFormat("nvidia_dev_xid", None, (
    TpField("common_type", "unsigned short", 0, 2, False, False),
    TpField("common_flags", "unsigned char", 2, 1, False, False),
    TpField("common_preempt_count", "unsigned char", 3, 1, False, False),
    TpField("common_pid", "int", 4, 4, True, False),
    TpField("dev", "char[]", 8, 4, False, True),
    TpField("error_code", "u32", 12, 4, False, False),
    TpField("msg", "char[]", 16, 4, False, True),
))


def decode_xid(raw: bytes, fmt: TracepointFormat = NVIDIA_DEV_XID_FORMAT, captured: bool = False) -> XidRecord:
    """A raw nvidia:nvidia_dev_xid record -> XidRecord. Pure."""
    rec, cut = decode_captured(raw, fmt, captured)
    try:
        return XidRecord(str(rec["dev"]), int(rec["error_code"]), str(rec["msg"]), int(rec.get("common_pid", 0)),
                         truncated="msg" in cut or "dev" in cut)
    except (KeyError, ValueError, TypeError) as e:
        raise RecordError(f"{fmt.name}: field {e} missing or not a number") from None


# --- NVML's Xid events ----------------------------------------------------------------------------


@dataclass(frozen=True)
class XidEvent:
    t_ns: int  # CLOCK_MONOTONIC when NVML delivered it
    gpu_index: int | None
    uuid: str | None
    pci_bus_id: str | None
    xid: int
    source: str = "nvml"  # nvml | bpf (the nvidia:nvidia_dev_xid tracepoint, decode_xid above)
    msg: str | None = None  # the driver's text (tracepoint only)
    pid: int | None = None  # the faulting process, where the driver's text names it


class XidWatcher:
    """NVML Xid events (nvmlEventTypeXidCriticalError) on their own thread: nvmlEventSetWait blocks up
    to wait_ms, so stop() returns within about that. Degrades with a reason where the driver cannot
    deliver them. Where the driver has the nvidia:nvidia_dev_xid tracepoint, the agent's gpu_xid BPF
    probe delivers Xids (with the driver's text) and this watcher is not started: it is the fallback.
    An H200 on driver 580 delivered a deliberate Xid 31 through both."""

    def __init__(self, module=None, *, nvml: Nvml | None = None, wait_ms: int = 500, max_events: int = 1024,
                 on_event: Callable[[XidEvent], None] | None = None, clock: Callable[[], int] = time.monotonic_ns):
        self.nvml = nvml or Nvml(module)
        self.wait_ms = wait_ms
        self.on_event = on_event
        self._clock = clock
        self._events: deque[XidEvent] = deque(maxlen=max_events)
        self.counts: dict[int, int] = {}  # xid -> count, for hostagent.gpu.xid metrics
        self.state = "stopped"
        self.reason: str | None = None
        self.unregistered: dict[int, str] = {}  # gpu index -> why it gets no Xid events
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set = None
        self._handles: list[tuple[int, object, str | None, str | None]] = []

    def start(self) -> bool:
        if not self.nvml.init():
            self.state, self.reason = "degraded", self.nvml.reason
            return False
        try:
            self._set = self.nvml.raw("nvmlEventSetCreate")
            for i in range(self.nvml.call("nvmlDeviceGetCount") or 0):
                h = self.nvml.call("nvmlDeviceGetHandleByIndex", i)
                supported = self.nvml.call("nvmlDeviceGetSupportedEventTypes", h, na_key=f"gpu{i}")
                if supported is not NA and not supported & XID_EVENT:
                    self.unregistered[i] = "Xid events not in nvmlDeviceGetSupportedEventTypes"
                    continue
                try:
                    self.nvml.raw("nvmlDeviceRegisterEvents", h, XID_EVENT, self._set)
                except NvmlError as e:
                    self.unregistered[i] = str(e)
                    continue
                uuid = self.nvml.call("nvmlDeviceGetUUID", h)
                pci = self.nvml.call("nvmlDeviceGetPciInfo", h)
                self._handles.append((i, h, uuid.decode() if isinstance(uuid, bytes) else uuid,
                                      normalize_bdf(getattr(pci, "busId", None))))
        except NvmlError as e:
            self.state, self.reason = "degraded", f"NVML events unavailable: {e}"
            return False
        if not self._handles:
            self.state, self.reason = "degraded", "no GPU accepts Xid events: " + "; ".join(
                f"gpu{i}: {r}" for i, r in self.unregistered.items())
            return False
        self.state = "running"
        self._thread = threading.Thread(target=self._run, name="mcp-nvml-xid", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float | None = None) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s if timeout_s is not None else self.wait_ms / 1000 + 1.0)
            if self._thread.is_alive():
                return False
        if self._set is not None:
            try:
                self.nvml.raw("nvmlEventSetFree", self._set)
            except NvmlError:
                pass
            self._set = None
        self.state = "stopped"
        return True

    def drain(self) -> list[XidEvent]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def _device_of(self, handle):
        addr = _address(handle)
        found = ((i, u, b) for i, h, u, b in self._handles if h is handle or _address(h) == addr)
        return next(found, (None, None, None))

    def _run(self) -> None:
        errors = 0
        while not self._stop.is_set():
            try:
                data = self._module_wait()
            except NvmlError as e:
                errors += 1
                backoff = min(60.0, 0.5 * 2 ** min(errors, 7))
                self.reason = f"nvmlEventSetWait: {e}; retry in {backoff:g} s"
                self._stop.wait(backoff)
                continue
            errors = 0
            if data is None:
                continue
            if getattr(data, "eventType", XID_EVENT) & XID_EVENT:
                index, uuid, bdf = self._device_of(getattr(data, "device", None))
                ev = XidEvent(self._clock(), index, uuid, bdf, int(data.eventData))
                self.counts[ev.xid] = self.counts.get(ev.xid, 0) + 1
                self._events.append(ev)
                if self.on_event:
                    self.on_event(ev)

    def _module_wait(self):
        """One nvmlEventSetWait; None on its timeout (NVML_ERROR_TIMEOUT is how it says "nothing")."""
        try:
            return self.nvml.module.nvmlEventSetWait(self._set, self.wait_ms)
        except self.nvml.module.NVMLError as e:
            if getattr(e, "value", None) == TIMEOUT:
                return None
            raise NvmlError("nvmlEventSetWait", getattr(e, "value", None), str(e)) from None


def _address(handle):
    """An NVML handle's address: the event's device and our handle are different ctypes objects."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
