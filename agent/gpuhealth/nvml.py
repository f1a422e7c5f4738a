"""GPU health from NVML: one wrapper for every call and a sampler (NVML's Xid events: xid.py).

Source: libnvidia-ml through nvidia-ml-py (`pynvml`, injectable so tests pass a module that replays
samples recorded on an H200); no BPF. The agent's thread never calls NVML: it reads immutable snapshots that
the sampler's threads publish (nvitop's habit), so a slow or hung NVML call cannot stall it.

Driver facts relied on (seen on an H200, driver 580.159, tests/fixtures/gpu/):
- nvmlDeviceGetPcieThroughput blocks ~20 ms (it samples the link for 20 ms); the other per-period calls
  take 2 us - 0.35 ms, nvmlDeviceGetProcessUtilization ~1.5-3 ms. Throughput gets its own slower cadence.
- nvidia-smi's memory.used is nvmlDeviceGetMemoryInfo_v2's `used`, which excludes the driver's reserved
  memory (~615 MiB there); v1's `used` includes it. v2 first, v1 as the fallback.
- nvmlDeviceGetProcessUtilization answers NOT_FOUND when no process ran since the timestamp given.
- NVML utilisation is an average over the driver's last sample window (1/6 s - 1 s) before the call.
- NVML writes PCI bus ids with an 8-digit domain ("00000000:00:06.0"); sysfs uses 4 digits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

from ..core.topology import link_capacity_bytes_s, normalize_bdf
from . import nvlink
from .nvlink import NvLinkState

log = logging.getLogger(__name__)

NA = None  # a field NVML does not give on this GPU/driver

# nvmlReturn_t values (nvml.h), so a fake module need not define them.
NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, TIMEOUT = 3, 4, 6, 10
LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, FUNCTION_NOT_FOUND, GPU_IS_LOST, RESET_REQUIRED = 12, 9, 13, 15, 16
NO_DATA, ARGUMENT_VERSION_MISMATCH = 21, 25
_NA_CODES = {NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, NO_DATA, FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH}
_SKIP_AFTER = {NOT_SUPPORTED, FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH, NO_PERMISSION}  # ask once per GPU

# nvmlClocksEventReason* bits (nvml.h); nvidia-smi -q lists the same names under "Clocks Event Reasons".
THROTTLE_REASONS = (
    (0x001, "gpu_idle"), (0x002, "applications_clocks_setting"), (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"), (0x010, "sync_boost"), (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"), (0x080, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"),
)
PCIE_TX, PCIE_RX = 0, 1  # nvmlPcieUtilCounter_t
CLOCK_SM, CLOCK_MEM = 1, 2  # nvmlClockType_t
MEMORY_V2 = 0x02000028  # nvmlMemory_v2: sizeof(nvmlMemory_v2_t) | 2 << 24


def decode_throttle_reasons(mask: int | None) -> tuple[str, ...]:
    """Clock event/throttle bitmask -> names, lowest bit first; unknown bits as "unknown_0x...".
    0 means the clocks run unrestricted; None (NA) decodes to ()."""
    if not mask:
        return ()
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in THROTTLE_REASONS)
    return tuple(names + ([f"unknown_{rest:#x}"] if rest else []))




# --- the wrapper ---------------------------------------------------------------------------------


class NvmlError(RuntimeError):
    """An NVML call that failed for a reason other than "not supported here": the GPU is down."""

    def __init__(self, call: str, code: int | None, text: str):
        super().__init__(f"{call}: {text}" + (f" (NVML error {code})" if code is not None else ""))
        self.call, self.code = call, code
        self.lost = code in (GPU_IS_LOST, RESET_REQUIRED)


class Nvml:
    """Every NVML call goes through call(): lazy nvmlInit, NA for what the GPU or driver does not
    support, "function not found" (absent in libnvidia-ml or in pynvml) logged once per function.
    NVML absent: available is False and reason says why, and call() raises NvmlError."""

    def __init__(self, module=None):
        self._module = module
        self._lock = threading.Lock()
        self.available: bool | None = None  # None until the first call
        self.reason: str | None = None
        self.na_calls: dict[str, str] = {}  # "name[/variant]" or "name[/variant]@gpuN" -> why it reads NA
        self._logged: set[str] = set()
        self._warned = False

    @property
    def module(self):
        self.init()
        return self._module

    def init(self, quiet: bool = False) -> bool:
        """quiet: leave the "unavailable" warning to the next caller (the warm-up thread runs before the
        load, whose own error must stay the only line a failed start prints)."""
        with self._lock:
            if self.available is None:
                self._init()
            if not self.available and not quiet and not self._warned:
                self._warned = True
                log.warning("NVML unavailable: %s; GPU sampling off", self.reason)
            return self.available

    def _init(self) -> None:
        try:
            if self._module is None:
                import pynvml  # nvidia-ml-py

                self._module = pynvml
            self._module.nvmlInit()
            self.available = True
        except ImportError as e:
            self.available, self.reason = False, f"nvidia-ml-py not importable ({e})"
        except Exception as e:  # noqa: BLE001 - NVMLError and anything a broken install raises
            code = getattr(e, "value", None)
            hint = {LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found: no NVIDIA driver on this host?",
                    DRIVER_NOT_LOADED: "NVIDIA kernel driver not loaded"}.get(code, f"nvmlInit failed: {e}")
            self.available, self.reason = False, hint

    def call(self, name: str, *args, na_key: str | None = None, variant: str = ""):
        """pynvml.<name>(*args); NA when not supported. na_key (e.g. "gpu0") scopes "not supported" so
        that the call is skipped for that GPU from then on; variant names calls whose arguments pick
        what is asked (a clock, a struct version), so that one unsupported variant skips only itself."""
        if not self.init():
            raise NvmlError(name, None, f"NVML unavailable: {self.reason}")
        sig = f"{name}/{variant}" if variant else name
        key = f"{sig}@{na_key}" if na_key else sig
        if key in self.na_calls or sig in self.na_calls:
            return NA
        fn = getattr(self._module, name, None)
        if fn is None:
            return self._na(sig, "function not found in pynvml")
        try:
            return fn(*args)
        except self._module.NVMLError as e:
            code = getattr(e, "value", None)
            if code == FUNCTION_NOT_FOUND:
                return self._na(sig, "function not found in libnvidia-ml")
            if code in _NA_CODES:
                if code in _SKIP_AFTER:
                    self.na_calls[key] = str(e)
                return NA
            raise NvmlError(name, code, str(e)) from None

    def raw(self, name: str, *args):
        """pynvml.<name>(*args) where None is a valid answer: every NVML error raises NvmlError (code set)."""
        if not self.init():
            raise NvmlError(name, None, f"NVML unavailable: {self.reason}")
        fn = getattr(self._module, name, None)
        if fn is None:
            raise NvmlError(name, FUNCTION_NOT_FOUND, "function not found in pynvml")
        try:
            return fn(*args)
        except self._module.NVMLError as e:
            raise NvmlError(name, getattr(e, "value", None), str(e)) from None

    def _na(self, sig: str, why: str):
        self.na_calls[sig] = why
        if sig not in self._logged:
            self._logged.add(sig)
            log.info("NVML %s: %s; reported as NA", sig, why)
        return NA

    def call_first(self, names: Iterable[tuple[str, tuple]], na_key: str | None = None):
        """The first of several spellings that answers (newer API first)."""
        for name, args in names:
            value = self.call(name, *args, na_key=na_key)
            if value is not NA:
                return value
        return NA


# --- samples -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # host pid, as BPF sees it
    used_memory_bytes: int | None
    sm_util_pct: int | None = None  # from nvmlDeviceGetProcessUtilization, when the driver gives it
    mem_util_pct: int | None = None


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment. t_ns is CLOCK_MONOTONIC (bpf_ktime_get_ns's clock); utilisation is an
    average over (window_start_ns, t_ns]; memory, clocks, link state are instantaneous at t_ns."""

    index: int
    uuid: str | None
    pci_bus_id: str | None  # sysfs spelling, "0000:00:06.0"
    t_ns: int
    window_start_ns: int
    up: bool = True
    down_reason: str | None = None
    util_gpu_pct: int | None = None
    util_mem_pct: int | None = None
    mem_used_bytes: int | None = None  # excludes driver-reserved memory, as nvidia-smi's memory.used
    mem_total_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    throttle_mask: int | None = None
    throttle_reasons: tuple[str, ...] = ()
    power_mw: int | None = None
    temperature_c: int | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_replay_count: int | None = None
    pcie_tx_kbytes_s: int | None = None  # slow cadence: value of the last throughput read, taken at pcie_tput_t_ns
    pcie_rx_kbytes_s: int | None = None
    pcie_tput_t_ns: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    nvlink: NvLinkState | None = None  # slow cadence, as the throughput; None: no NVLink (or not read yet)


@dataclass(frozen=True)
class GpuAggregate:
    """The samples of one GPU that overlap a span, folded for span attributes."""

    index: int
    uuid: str | None
    pci_bus_id: str | None
    samples: int
    util_gpu_mean_pct: float | None
    util_gpu_max_pct: int | None
    util_mem_mean_pct: float | None
    util_mem_max_pct: int | None
    mem_used_max_bytes: int | None
    sm_clock_min_mhz: int | None
    sm_clock_max_mhz: int | None
    mem_clock_min_mhz: int | None
    throttle_reasons: tuple[str, ...]
    power_max_mw: int | None
    temperature_max_c: int | None
    pcie_gen_min: int | None
    pcie_width_min: int | None
    pcie_replays: int | None  # increase of the replay counter across the samples
    process_mem_max_bytes: int | None = None  # for the pid asked about
    process_sm_util_mean_pct: float | None = None
    nvlink_active_min: int | None = None  # links up, fewest in the window
    nvlink_down_max: int | None = None  # links seen up before and not then, most in the window
    nvlink_errors: int | None = None  # increase of the data-link error counters (all kinds) across the window
    # NVML's PCIe throughput reads (each over its own 20 ms) taken inside the window, most of each way
    pcie_rx_max_bytes_s: float | None = None  # receive: host to GPU (a model's weights being copied in)
    pcie_tx_max_bytes_s: float | None = None
    pcie_capacity_min_bytes_s: float | None = None  # per direction, at the lowest gen x width seen

    def attributes(self, prefix: str = "hostagent.gpu") -> dict[str, object]:
        """Span attributes; NA fields are left out."""
        ratio = lambda pct: None if pct is None else round(pct / 100, 4)  # noqa: E731
        rx, cap = self.pcie_rx_max_bytes_s, self.pcie_capacity_min_bytes_s
        hz = lambda mhz: None if mhz is None else mhz * 1_000_000  # noqa: E731
        names = {  # base units, as the metrics: ratio, By, Hz, W, Cel
            "index": self.index, "uuid": self.uuid, "pci_bus_id": self.pci_bus_id, "samples": self.samples,
            "utilization.mean": ratio(self.util_gpu_mean_pct), "utilization.max": ratio(self.util_gpu_max_pct),
            "memory.utilization.mean": ratio(self.util_mem_mean_pct),
            "memory.utilization.max": ratio(self.util_mem_max_pct),
            "memory.usage.max": self.mem_used_max_bytes, "sm_clock.min": hz(self.sm_clock_min_mhz),
            "sm_clock.max": hz(self.sm_clock_max_mhz), "memory_clock.min": hz(self.mem_clock_min_mhz),
            "throttle_reasons": list(self.throttle_reasons) or None,
            "power.max": None if self.power_max_mw is None else self.power_max_mw / 1000,
            "temperature.max": self.temperature_max_c, "pcie.gen_min": self.pcie_gen_min,
            "pcie.width_min": self.pcie_width_min, "pcie.replays": self.pcie_replays,
            "process.memory.usage.max": self.process_mem_max_bytes,
            "process.utilization.mean": ratio(self.process_sm_util_mean_pct),
            "nvlink.links.active.min": self.nvlink_active_min, "nvlink.links.down.max": self.nvlink_down_max,
            "nvlink.errors": self.nvlink_errors,
            "pcie.receive.max": rx, "pcie.transmit.max": self.pcie_tx_max_bytes_s, "pcie.capacity.min": cap,
            "pcie.receive.utilization.max": round(rx / cap, 4) if rx is not None and cap else None,
        }
        return {f"{prefix}.{k}": v for k, v in names.items() if v is not None}


def _vals(samples, attr):
    return [v for v in (getattr(s, attr) for s in samples) if v is not None]


def aggregate_samples(samples: list[GpuSample], pid: int | None = None,
                      window: tuple[int, int] | None = None) -> GpuAggregate | None:
    """Fold the up samples of one GPU (oldest first). Pure. window: (t0_ns, t1_ns), for the
    throughput reads, which samples carry on between reads: only those taken inside it count."""
    samples = [s for s in samples if s.up]
    if not samples:
        return None
    mean = lambda xs: round(sum(xs) / len(xs), 2) if xs else None  # noqa: E731
    opt = lambda f, xs: f(xs) if xs else None  # noqa: E731
    replays = _vals(samples, "pcie_replay_count")
    reasons: dict[str, None] = {}
    for s in samples:
        reasons.update(dict.fromkeys(s.throttle_reasons))
    procs = [p for s in samples for p in s.processes if p.pid == pid] if pid is not None else []
    last = samples[-1]
    util, mem_util = _vals(samples, "util_gpu_pct"), _vals(samples, "util_mem_pct")
    sm_clock = _vals(samples, "sm_clock_mhz")
    return GpuAggregate(
        index=last.index, uuid=last.uuid, pci_bus_id=last.pci_bus_id, samples=len(samples),
        util_gpu_mean_pct=mean(util), util_gpu_max_pct=opt(max, util),
        util_mem_mean_pct=mean(mem_util), util_mem_max_pct=opt(max, mem_util),
        mem_used_max_bytes=opt(max, _vals(samples, "mem_used_bytes")),
        sm_clock_min_mhz=opt(min, sm_clock), sm_clock_max_mhz=opt(max, sm_clock),
        mem_clock_min_mhz=opt(min, _vals(samples, "mem_clock_mhz")), throttle_reasons=tuple(reasons),
        power_max_mw=opt(max, _vals(samples, "power_mw")), temperature_max_c=opt(max, _vals(samples, "temperature_c")),
        pcie_gen_min=opt(min, _vals(samples, "pcie_gen")), pcie_width_min=opt(min, _vals(samples, "pcie_width")),
        pcie_replays=replays[-1] - replays[0] if len(replays) > 1 else None,
        process_mem_max_bytes=opt(max, _vals(procs, "used_memory_bytes")),
        process_sm_util_mean_pct=mean(_vals(procs, "sm_util_pct")),
        **_nvlink_fields([s.nvlink for s in samples if s.nvlink is not None]),
        **_pcie_fields(samples, window),
    )


def _pcie_fields(samples: list[GpuSample], window: tuple[int, int] | None) -> dict:
    reads = {s.pcie_tput_t_ns: s for s in samples if s.pcie_tput_t_ns is not None
             and (window is None or window[0] <= s.pcie_tput_t_ns <= window[1])}.values()
    rx = [s.pcie_rx_kbytes_s * 1024 for s in reads if s.pcie_rx_kbytes_s is not None]  # NVML's KB: 1,024 bytes
    tx = [s.pcie_tx_kbytes_s * 1024 for s in reads if s.pcie_tx_kbytes_s is not None]
    cap = [c for c in (link_capacity_bytes_s(s.pcie_gen, s.pcie_width) for s in samples) if c]
    return {"pcie_rx_max_bytes_s": max(rx, default=None), "pcie_tx_max_bytes_s": max(tx, default=None),
            "pcie_capacity_min_bytes_s": round(min(cap), 1) if cap else None}


def _nvlink_fields(nv: list[NvLinkState]) -> dict:
    if not nv:
        return {}
    reads = list({n.t_ns: n for n in nv}.values())  # the fast samples between two reads repeat one
    errs = [sum(v for _, v in n.errors) for n in reads if n.errors]
    return {"nvlink_active_min": min(len(n.active) for n in nv), "nvlink_down_max": max(len(n.down) for n in nv),
            "nvlink_errors": errs[-1] - errs[0] if len(errs) > 1 else None}


# --- one GPU -------------------------------------------------------------------------------------


class _Gpu:
    """One GPU's handle and sampling state; used only by its own worker thread (plus the watchdog's
    reads of busy_since/in_call)."""

    def __init__(self, nvml: Nvml, index: int):
        self.nvml, self.index = nvml, index
        self.key = f"gpu{index}"
        self.handle = None
        self.uuid: str | None = None
        self.pci_bus_id: str | None = None
        self.gen_max = self.width_max = None
        self.last_t_ns: int | None = None
        self.last_proc_ts_us = 0
        self.tput: tuple[int | None, int | None, int | None] = (None, None, None)
        self.nvlink: NvLinkState | None = None
        self.nvlink_memo = nvlink.Memo()
        self.busy_since: int | None = None  # monotonic ns when the current NVML round started
        self.in_call = ""

    def q(self, name: str, *args, variant: str = ""):
        self.in_call = name
        return self.nvml.call(name, self.handle, *args, na_key=self.key, variant=variant)

    def open(self) -> None:
        """(Re)acquire the handle, by UUID when known so a re-enumeration cannot swap GPUs."""
        self.in_call = "nvmlDeviceGetHandleByIndex"
        if self.uuid:
            self.in_call = "nvmlDeviceGetHandleByUUID"
            self.handle = self.nvml.call("nvmlDeviceGetHandleByUUID", self.uuid)
        else:
            self.handle = self.nvml.call("nvmlDeviceGetHandleByIndex", self.index)
        if self.handle is NA:
            raise NvmlError(self.in_call, None, "no handle")
        uuid = self.q("nvmlDeviceGetUUID")
        self.uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        pci = self.q("nvmlDeviceGetPciInfo")
        self.pci_bus_id = normalize_bdf(getattr(pci, "busId", None)) if pci is not NA else None
        self.gen_max = self.q("nvmlDeviceGetMaxPcieLinkGeneration")
        self.width_max = self.q("nvmlDeviceGetMaxPcieLinkWidth")

    def sample(self, t_ns: int, period_ns: int, process_util: bool) -> GpuSample:
        nv = self.nvml
        util = self.q("nvmlDeviceGetUtilizationRates")
        mem = self.q("nvmlDeviceGetMemoryInfo", getattr(nv.module, "nvmlMemory_v2", MEMORY_V2), variant="v2")
        reserved = getattr(mem, "reserved", None) if mem is not NA else None
        if mem is NA:
            mem = self.q("nvmlDeviceGetMemoryInfo")  # v1: used includes the reserved memory
        mask = nv.call_first((("nvmlDeviceGetCurrentClocksEventReasons", (self.handle,)),
                              ("nvmlDeviceGetCurrentClocksThrottleReasons", (self.handle,))), na_key=self.key)
        procs = self.q("nvmlDeviceGetComputeRunningProcesses") or []
        putil = {}
        if process_util and procs:
            for s in self.q("nvmlDeviceGetProcessUtilization", self.last_proc_ts_us) or []:
                self.last_proc_ts_us = max(self.last_proc_ts_us, s.timeStamp)
                if s.pid not in putil or s.timeStamp >= putil[s.pid].timeStamp:
                    putil[s.pid] = s
        processes = tuple(sorted((GpuProcess(
            pid=p.pid, used_memory_bytes=p.usedGpuMemory,
            sm_util_pct=_pct(getattr(putil.get(p.pid), "smUtil", None)),
            mem_util_pct=_pct(getattr(putil.get(p.pid), "memUtil", None))) for p in procs), key=lambda p: p.pid))
        tx, rx, tput_t = self.tput
        sample = GpuSample(
            index=self.index, uuid=self.uuid, pci_bus_id=self.pci_bus_id, t_ns=t_ns,
            window_start_ns=self.last_t_ns if self.last_t_ns is not None else t_ns - period_ns,
            util_gpu_pct=getattr(util, "gpu", None), util_mem_pct=getattr(util, "memory", None),
            mem_used_bytes=getattr(mem, "used", None), mem_total_bytes=getattr(mem, "total", None),
            mem_reserved_bytes=reserved,
            sm_clock_mhz=self.q("nvmlDeviceGetClockInfo", CLOCK_SM, variant="sm"),
            mem_clock_mhz=self.q("nvmlDeviceGetClockInfo", CLOCK_MEM, variant="mem"),
            throttle_mask=mask, throttle_reasons=decode_throttle_reasons(mask),
            power_mw=self.q("nvmlDeviceGetPowerUsage"), temperature_c=self.q("nvmlDeviceGetTemperature", 0),
            pcie_gen=self.q("nvmlDeviceGetCurrPcieLinkGeneration"), pcie_gen_max=self.gen_max,
            pcie_width=self.q("nvmlDeviceGetCurrPcieLinkWidth"), pcie_width_max=self.width_max,
            pcie_replay_count=self.q("nvmlDeviceGetPcieReplayCounter"),
            pcie_tx_kbytes_s=tx, pcie_rx_kbytes_s=rx, pcie_tput_t_ns=tput_t, processes=processes,
            nvlink=self.nvlink,
        )
        self.last_t_ns = t_ns
        return sample

    def sample_slow(self, t_ns: int) -> None:
        # NVLink first: its calls never raise, so a throughput failure cannot cost it its read
        self.nvlink = nvlink.read(self._ask, getattr(self.nvml.module, "NVML_NVLINK_MAX_LINKS", nvlink.MAX_LINKS),
                                  self.nvlink_memo, t_ns)
        self.tput = (self.q("nvmlDeviceGetPcieThroughput", PCIE_TX, variant="tx"),
                     self.q("nvmlDeviceGetPcieThroughput", PCIE_RX, variant="rx"), t_ns)

    def _ask(self, name: str, *args, variant: str = ""):
        """q() with NVML errors as NA (None): NVLink is optional; a link past the GPU's last one
        answers INVALID_ARGUMENT."""
        try:
            return self.q(name, *args, variant=variant)
        except NvmlError:
            return NA


def _pct(v):
    return None if v is None or v > 100 else v  # NVML_VALUE_NOT_AVAILABLE (0xffffffff) -> NA


# --- the sampler ---------------------------------------------------------------------------------


class NvmlSampler:
    """A worker thread per GPU samples every period_s (PCIe throughput every slow_period_s, after the
    fast sample so it never delays it); a watchdog thread marks a GPU down when its NVML round runs past
    call_timeout_s. A GPU down (lost, hung, failing) is retried with exponential backoff; the others go
    on. Readers get immutable GpuSamples: snapshot(), samples_between(), aggregate()."""

    def __init__(self, module=None, *, nvml: Nvml | None = None, period_s: float = 1.0, slow_period_s: float = 10.0,
                 call_timeout_s: float = 2.0, history: int = 900, backoff_initial_s: float = 1.0,
                 backoff_max_s: float = 60.0, process_util: bool = True, clock: Callable[[], int] = time.monotonic_ns):
        self.nvml = nvml or Nvml(module)
        self.period_ns = int(period_s * 1e9)
        self.slow_period_ns = int(slow_period_s * 1e9) if slow_period_s > 0 else 0
        self.timeout_ns = int(call_timeout_s * 1e9)
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.process_util = process_util
        self._clock = clock
        self._history_len = history
        self._lock = threading.Lock()
        self._latest: Mapping[int, GpuSample] = MappingProxyType({})
        self._history: dict[int, deque[GpuSample]] = {}
        self._gpus: dict[int, _Gpu] = {}
        self._down_gen: dict[int, int] = {}  # bumped by the watchdog: a hung round's late result is dropped
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.rounds: dict[int, int] = {}  # completed fast rounds per GPU
        self.reason: str | None = None

    # ---- lifecycle ----
    def _setup(self) -> bool:
        if self._gpus:
            return True
        if not self.nvml.init():
            self.reason = self.nvml.reason
            return False
        try:
            count = self.nvml.call("nvmlDeviceGetCount") or 0
        except NvmlError as e:
            self.reason = str(e)
            return False
        for i in range(count):
            self._gpus[i] = _Gpu(self.nvml, i)
            self._history[i] = deque(maxlen=self._history_len)
            self._down_gen[i] = 0
            self.rounds[i] = 0
        return True

    def start(self) -> bool:
        """False (and reason set) when NVML is absent: no thread starts, snapshot() stays empty."""
        if not self._setup():
            return False
        for gpu in self._gpus.values():
            self._threads.append(threading.Thread(target=self._worker, args=(gpu,), name=f"mcp-nvml-gpu{gpu.index}",
                                                  daemon=True))
        self._threads.append(threading.Thread(target=self._watchdog, name="mcp-nvml-watchdog", daemon=True))
        for t in self._threads:
            t.start()
        return True

    def stop(self, timeout_s: float = 2.0) -> bool:
        """True when every thread ended within timeout_s (a thread stuck in NVML is abandoned: daemon)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def sample_once(self) -> Mapping[int, GpuSample]:
        """One round over every GPU in the caller's thread, slow calls included (tests, a doctor
        command). Not to be mixed with start()."""
        if self._setup():
            for gpu in self._gpus.values():
                self._round(gpu, self._clock(), slow=bool(self.slow_period_ns))
        return self._latest

    @property
    def available(self) -> bool:
        return bool(self.nvml.available)

    # ---- readers ----
    def snapshot(self) -> Mapping[int, GpuSample]:
        """gpu index -> latest GpuSample (up or down): an immutable mapping, replaced, never mutated."""
        return self._latest

    def samples_between(self, gpu: int, t0_ns: int, t1_ns: int) -> list[GpuSample]:
        """Up samples of one GPU whose window (window_start_ns, t_ns] overlaps [t0_ns, t1_ns], oldest first.
        A span shorter than a period still gets the sample whose window holds it, once that exists."""
        with self._lock:
            hist = list(self._history.get(gpu, ()))
        return [s for s in hist if s.t_ns >= t0_ns and s.window_start_ns < t1_ns]

    def aggregate(self, gpu: int, t0_ns: int, t1_ns: int, pid: int | None = None) -> GpuAggregate | None:
        return aggregate_samples(self.samples_between(gpu, t0_ns, t1_ns), pid, (t0_ns, t1_ns))

    def gpus_for_pid(self, pid: int) -> list[int]:
        """GPUs where NVML lists pid as a compute process (the join key for request spans)."""
        return sorted(i for i, s in self._latest.items() if any(p.pid == pid for p in s.processes))

    def gpu_status(self) -> dict[int, tuple[str, str | None]]:
        return {i: ("up" if s.up else "down", s.down_reason) for i, s in self._latest.items()}

    # ---- threads ----
    def _publish(self, sample: GpuSample, history: bool) -> None:
        with self._lock:
            latest = dict(self._latest)
            latest[sample.index] = sample
            self._latest = MappingProxyType(latest)
            if history:
                self._history[sample.index].append(sample)

    def _down(self, gpu: _Gpu, reason: str, t_ns: int) -> None:
        prev = self._latest.get(gpu.index)
        if prev is not None and not prev.up and prev.down_reason == reason:
            return
        log.warning("GPU %d (%s) down: %s", gpu.index, gpu.pci_bus_id or "?", reason)
        self._publish(GpuSample(gpu.index, gpu.uuid, gpu.pci_bus_id, t_ns, t_ns, up=False, down_reason=reason), False)

    def _round(self, gpu: _Gpu, t_ns: int, slow: bool) -> bool:
        """One sampling round of one GPU; False when it is (or has just been marked) down."""
        gen = self._down_gen[gpu.index]
        gpu.busy_since = t_ns
        reason = None
        try:
            if gpu.handle is None:
                gpu.open()
            sample = gpu.sample(t_ns, self.period_ns, self.process_util)
        except NvmlError as e:
            reason = f"{'lost' if e.lost else 'failed'}: {e}"
        except Exception as e:  # noqa: BLE001 - a broken binding must not kill the thread
            reason = f"failed: {gpu.in_call}: {e!r}"
        gpu.busy_since = None
        if reason or gen != self._down_gen[gpu.index]:  # failed, or the watchdog gave up on this round
            if reason:
                self._down(gpu, reason, t_ns)
            gpu.handle, gpu.last_t_ns = None, None
            return False
        self._publish(sample, True)
        self.rounds[gpu.index] += 1
        if slow:
            gpu.busy_since = self._clock()
            tput = {}
            try:
                gpu.sample_slow(gpu.busy_since)
                tx, rx, tt = gpu.tput
                tput = {"pcie_tx_kbytes_s": tx, "pcie_rx_kbytes_s": rx, "pcie_tput_t_ns": tt}
            except Exception as e:  # noqa: BLE001 - throughput is optional; the GPU stays up
                gpu.tput = (None, None, None)
                log.debug("GPU %d throughput: %s", gpu.index, e)
            if gen == self._down_gen[gpu.index]:
                self._publish(replace(sample, nvlink=gpu.nvlink, **tput), False)
            gpu.busy_since = None
        return True

    def _worker(self, gpu: _Gpu) -> None:
        backoff = 0.0
        next_ns = next_slow_ns = self._clock()
        while not self._stop.is_set():
            t_ns = self._clock()
            slow = bool(self.slow_period_ns) and t_ns >= next_slow_ns
            if self._round(gpu, t_ns, slow):
                if slow:
                    next_slow_ns = t_ns + self.slow_period_ns
                backoff = 0.0
                next_ns += self.period_ns
                now = self._clock()
                if next_ns <= now:  # overran (or slept through) whole periods: keep the phase, skip the missed
                    next_ns += ((now - next_ns) // self.period_ns + 1) * self.period_ns
            else:
                backoff = min(self.backoff_max_s, backoff * 2 if backoff else self.backoff_initial_s)
                next_ns = self._clock() + int(backoff * 1e9)
            self._stop.wait(max(0.0, (next_ns - self._clock()) / 1e9))

    def _watchdog(self) -> None:
        tick = min(self.timeout_ns, self.period_ns) / 4e9
        while not self._stop.wait(tick):
            now = self._clock()
            for gpu in self._gpus.values():
                since = gpu.busy_since
                if since is not None and now - since > self.timeout_ns:
                    gen = self._down_gen[gpu.index]
                    self._down_gen[gpu.index] = gen + 1
                    gpu.busy_since = None  # reported once; the worker re-arms it when the call returns
                    self._down(gpu, f"hung: {gpu.in_call} did not return within {self.timeout_ns / 1e9:g} s", now)
