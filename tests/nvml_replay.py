"""A pynvml stand-in that answers from what tests/fixtures/gpu/record_h200.py recorded on an H200.

Every value it returns was returned by the real NVML there (or is the recorded NVML error code, raised
as pynvml's own NVMLError). Each GPU replays the recorded samples in order: a sampling round starts with
nvmlDeviceGetUtilizationRates, which moves that GPU to its next sample, and every other call of the
round answers from the same sample. Tests steer it with next_sample[gpu], hooks[(name, gpu)] (a callable
that replaces the call: to sleep, hang or raise) and tput_sleep_s (nvmlDeviceGetPcieThroughput blocked
~20 ms on the H200). gpus=2 replays the recorded GPU as two (the second with a derived UUID and bus id),
so one GPU can fail while the other runs.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml  # the real binding: its NVMLError classes; importing it needs no libnvidia-ml

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


def load(name: str):
    with open(FIXTURES / name) as f:
        return json.load(f)


def ns(value):
    if isinstance(value, dict):
        return SimpleNamespace(**{k: ns(v) for k, v in value.items()})
    if isinstance(value, list):
        return [ns(v) for v in value]
    return value


class Handle:
    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"Handle({self.index})"


class ReplayNvml:
    NVMLError = pynvml.NVMLError
    NVML_CLOCK_SM, NVML_CLOCK_MEM = pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, gpus: int = 1, stream=None, host=None, xid=None):
        self.stream = stream or load("nvml_stream.json")
        self.host = host or load("host.json")
        self.xid = xid or load("xid.json")
        self.samples = self.stream["samples"]
        self.gpus = gpus
        self.next_sample = [0] * gpus
        self.current = [0] * gpus
        self.hooks: dict[tuple[str, int], object] = {}
        self.tput_sleep_s = 0.0
        self.log: list[tuple[float, str, int]] = []  # (monotonic s, call, gpu)
        self._lock = threading.Lock()
        self.init_error: int | None = None
        self._xid_queue = [e for e in self.xid["events"] if "value" in e]
        self.handles = [Handle(i) for i in range(gpus)]  # one object per GPU, as NVML's handles are stable

    # ---- plumbing ----
    def static(self, gpu: int, key: str):
        rec = self.host["gpus"][0][key]
        value = rec["value"]
        if gpu and key == "nvmlDeviceGetUUID":
            value = value[:-1] + str(gpu)
        if gpu and key == "nvmlDeviceGetPciInfo":
            value = dict(value, busId=value["busId"][:-4] + f"{6 + gpu:02x}.0", device=6 + gpu)
        return value

    def answer(self, name: str, key: str, handle: Handle, *args):
        gpu = handle.index
        with self._lock:
            self.log.append((time.monotonic(), name, gpu))
            if name == "nvmlDeviceGetUtilizationRates":
                self.current[gpu] = self.next_sample[gpu] % len(self.samples)
                self.next_sample[gpu] += 1
            idx = self.current[gpu]
        hook = self.hooks.get((name, gpu))
        if hook is not None:
            return hook(handle, *args)
        return self.recorded(gpu, key)

    def recorded(self, gpu: int, key: str):
        """The recorded answer to `key` in the GPU's current sample (what a hook returns to pass through)."""
        rec = self.samples[self.current[gpu]]["gpus"][0]["calls"][key]
        if "error" in rec:
            raise pynvml.NVMLError(rec["error"])
        return ns(rec["value"])

    # ---- init and handles ----
    def nvmlInit(self):
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlDeviceGetCount(self):
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.handles[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        hook = self.hooks.get(("nvmlDeviceGetHandleByUUID", -1))
        if hook is not None:
            return hook(uuid)
        for i in range(self.gpus):
            if self.static(i, "nvmlDeviceGetUUID") == uuid:
                return self.handles[i]
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, h):
        return self.static(h.index, "nvmlDeviceGetUUID")

    def nvmlDeviceGetPciInfo(self, h):
        return ns(self.static(h.index, "nvmlDeviceGetPciInfo"))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self.static(h.index, "nvmlDeviceGetMaxPcieLinkGeneration")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self.static(h.index, "nvmlDeviceGetMaxPcieLinkWidth")

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return self.static(h.index, "nvmlDeviceGetSupportedEventTypes")

    # ---- per-round calls ----
    def nvmlDeviceGetUtilizationRates(self, h):
        return self.answer("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetUtilizationRates", h)

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        key = "nvmlDeviceGetMemoryInfo/v2" if version else "nvmlDeviceGetMemoryInfo"
        return self.answer("nvmlDeviceGetMemoryInfo", key, h, version)

    def nvmlDeviceGetClockInfo(self, h, clock):
        key = {0: "/GRAPHICS", 1: "/SM", 2: "/MEM"}[clock]
        return self.answer("nvmlDeviceGetClockInfo", "nvmlDeviceGetClockInfo" + key, h, clock)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self.answer("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperature/GPU", h, sensor)

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        if self.tput_sleep_s:
            time.sleep(self.tput_sleep_s)
        key = {0: "/TX", 1: "/RX"}[counter]
        return self.answer("nvmlDeviceGetPcieThroughput", "nvmlDeviceGetPcieThroughput" + key, h, counter)

    def nvmlDeviceGetProcessUtilization(self, h, ts):
        return self.answer("nvmlDeviceGetProcessUtilization", "nvmlDeviceGetProcessUtilization", h, ts)


_PLAIN = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
          "nvmlDeviceGetPowerUsage", "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
          "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetComputeRunningProcesses")
for _name in _PLAIN:
    setattr(ReplayNvml, _name, (lambda n: lambda self, h: self.answer(n, n, h))(_name))


class XidReplay(ReplayNvml):
    """Adds the NVML event calls: nvmlEventSetWait first delivers the Xid recorded on the H200 (an MMU
    fault, Xid 31, caused on purpose), then answers NVML_ERROR_TIMEOUT after waiting, as the driver did."""

    def nvmlEventSetCreate(self):
        return object()

    def nvmlDeviceRegisterEvents(self, h, types, evset):
        hook = self.hooks.get(("nvmlDeviceRegisterEvents", h.index))
        if hook is not None:
            return hook(h, types, evset)
        return None

    def nvmlEventSetFree(self, evset):
        return None

    def nvmlEventSetWait(self, evset, timeout_ms):
        with self._lock:
            rec = self._xid_queue.pop(0) if self._xid_queue else None
        if rec is None:
            time.sleep(min(timeout_ms, 50) / 1000)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        v = rec["value"]
        return SimpleNamespace(device=self.handles[v["device_index"]], eventType=v["eventType"],
                               eventData=v["eventData"],
                               gpuInstanceId=v["gpuInstanceId"], computeInstanceId=v["computeInstanceId"])
