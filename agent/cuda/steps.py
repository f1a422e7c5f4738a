"""Zero-touch GPU steps and per-request CUDA findings (pure).

A GPU step is the ring-buffer record MCP_EV_GPU_STEP (bpf/cuda.bpf.c): one thread's CUDA driver calls
and NVIDIA ioctls between two sync returns, decoded here (build_step, through the core's table).
findings() names what dominated a request's wall time, for its span.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.decode import Counters, DecodeError, Header, Route, counters_from, decode
from . import records as R
from .symbols import LAUNCH_FIELDS

# ---- zero-touch GPU steps: ring-buffer record MCP_EV_GPU_STEP (pure decode) ----
EV_GPU_STEP = R.C["MCP_EV_GPU_STEP"]


@dataclass(frozen=True)
class GpuStep:
    hdr: Header  # the thread; hdr.ts_ns is the closing sync's return
    begin_ns: int  # previous sync return on the thread, or its first counted CUDA call
    sync_ns: int
    sync_kind: str  # "stream" | "ctx" | "event"
    counters: Counters  # cu_* and nv_* over the step, closing sync included

    @property
    def launches(self) -> int:
        c = self.counters
        return sum(getattr(c, f) for f in LAUNCH_FIELDS)


def build_step(rec: R.EvGpuStep, hdr: Header) -> GpuStep:
    kind = R.SYNC_KINDS.get(rec.sync_kind)
    if kind is None:
        raise DecodeError("bad_field", f"sync kind {rec.sync_kind}")
    return GpuStep(hdr, rec.begin_ns, rec.sync_ns, kind, counters_from(rec.c))


DECODERS = {EV_GPU_STEP: Route(R.EvGpuStep, build_step)}  # the capability adds the handlers


def decode_step(raw: bytes) -> GpuStep:
    return decode(raw, DECODERS)[0]


# ---- span findings (pure) ----
# Shares of a request's wall time past which its span gets a finding. A context push costs 8-15 us
# (the seeds' measurement): 5% of a 10 ms request is ~40 of them. A request mostly waiting in sync calls
# is GPU-bound, not host-bound: worth saying, not an error.
FINDING_SHARES = {"cuda.ctx_switch_heavy": ("cu_ctx_ns", 0.05), "cuda.sync_bound": ("cu_sync_ns", 0.5),
                  "nvidia.ioctl_heavy": ("nv_ioctl_ns", 0.1)}


def findings(c: Counters, duration_ns: int) -> dict[str, float]:
    """{finding: share of the request} for each share over its threshold (FINDING_SHARES)."""
    if duration_ns <= 0:
        return {}
    out = {}
    for name, (field_, share) in FINDING_SHARES.items():
        v = getattr(c, field_) / duration_ns
        if v >= share:
            out[name] = round(v, 4)
    return out


class OutlierGate:
    """Which GPU steps of unmarked processes become spans: every step goes to the step histograms, a
    span only for one that lasts >= min_s and >= FACTOR x its process's running mean (the first
    steps of a process set the mean), at most one per second per process and per_s host-wide (token
    buckets). An eager loop makes ~1,000 steps a second per process: one span each cost 13-17% of a
    core on the H200 (issue 14), and told nothing the histogram does not."""

    FACTOR = 4.0
    WARMUP = 8  # steps of a process before it can have an outlier
    ALPHA = 0.05  # the mean's weight of a new step
    MAX_PROCS = 4096

    def __init__(self, min_s: float, per_s: float):
        self.min_s, self.per_s = min_s, per_s
        self.tokens, self.t = per_s, None
        self._procs: dict[int, list] = {}  # pid -> [mean_s, steps, last span time]

    def admit(self, pid: int, dur_s: float, now: float) -> bool:
        st = self._procs.get(pid)
        if st is None:
            if len(self._procs) >= self.MAX_PROCS:
                self._procs.pop(next(iter(self._procs)))
            st = self._procs[pid] = [dur_s, 0, -1e18]
        mean, n = st[0], st[1]
        st[0], st[1] = (dur_s if n == 0 else mean + self.ALPHA * (dur_s - mean)), n + 1
        if self.t is not None:
            self.tokens = min(self.per_s, self.tokens + (now - self.t) * self.per_s)
        self.t = now
        if n < self.WARMUP or dur_s < self.min_s or dur_s < self.FACTOR * mean:
            return False
        if now - st[2] < 1.0 or self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        st[2] = now
        return True


# ---- GPU steps of a request's serving group (pure) ----
class StepLog:
    """Recent GPU steps by cgroup, so that a request can say what the batching engine beside it did
    while it was in flight (an engine process is in the front end's cgroup: its container or unit).
    Bounded: steps older than KEEP_NS, and past MAX_STEPS the oldest, are dropped."""

    KEEP_NS = 120 * 10**9
    MAX_STEPS = 65536

    def __init__(self) -> None:
        from collections import deque

        self._steps: deque = deque()  # (end_ns, begin_ns, cgroup_id, tgid, launches, sync_ns)

    def add(self, step: GpuStep) -> None:
        s = self._steps
        s.append((step.hdr.ts_ns, step.begin_ns, step.hdr.cgroup_id, step.hdr.tgid, step.launches, step.sync_ns))
        while s and (len(s) > self.MAX_STEPS or s[0][0] < step.hdr.ts_ns - self.KEEP_NS):
            s.popleft()

    def summary(self, member, t0_ns: int, t1_ns: int) -> dict:
        """Span attributes for the steps overlapping [t0, t1] of the group member(cgroup_id, tgid) says
        a step's thread is in; {} when none."""
        n = launches = sync_ns = 0
        longest = 0
        pids = set()
        for end, begin, cg, tgid, nl, sn in self._steps:
            if end <= t0_ns or begin >= t1_ns or not member(cg, tgid):
                continue
            n += 1
            launches += nl
            sync_ns += sn
            longest = max(longest, end - begin)
            pids.add(tgid)
        if not n:
            return {}
        return {"hostagent.request.gpu_steps.count": n, "hostagent.request.gpu_steps.duration.max": longest / 1e9,
                "hostagent.request.gpu_steps.launches": launches, "hostagent.request.gpu_steps.sync.time": sync_ns / 1e9,
                "hostagent.request.gpu_steps.processes": len(pids)}
