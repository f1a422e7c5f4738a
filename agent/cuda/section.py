"""The CUDA capability's part of `top`'s snapshot: launch, context-switch, sync and NVIDIA ioctl rates
per process, a request's CUDA counts, and the context-switch-heavy finding."""

from __future__ import annotations

from ..telemetry.snapshot import ProcRow, Section, Tick, deltas, finding
from .steps import FINDING_SHARES
from .symbols import LAUNCH_CALLS

RATES = ("cu_ctx_ops", "cu_ctx_ns", "cu_sync_ns", "nv_ioctls", *LAUNCH_CALLS)
# "Context-switch heavy": CUDA context push/pop/set time of at least the share of wall time that
# makes a request span's cuda.ctx_switch_heavy finding (5%: 50 ms per second, summed over the
# process's threads), one rule for both. Cleared (hysteresis) below half of it.
CTX_HEAVY_MS_PER_S = FINDING_SHARES["cuda.ctx_switch_heavy"][1] * 1000


class CudaSection(Section):
    def __init__(self):
        self._heavy: set[int] = set()  # pids found heavy, until below half the rule
        self._seen: set[int] = set()  # pids of this tick's rows
        self._new: list[tuple[int, str, float, float | None]] = []  # (pid, command, ms/s, us each)

    def process(self, row: ProcRow) -> dict:
        d = deltas(row, RATES)
        self._seen.add(row.pid)
        if d is None:
            self._heavy.discard(row.pid)
            return {}
        out = {"launches_per_s": sum(d[f] for f in LAUNCH_CALLS) / row.dt_s,
               "ctx_switch_us": d["cu_ctx_ns"] / d["cu_ctx_ops"] / 1e3 if d["cu_ctx_ops"] else None,
               "sync_ms_per_s": d["cu_sync_ns"] / 1e6 / row.dt_s, "ioctls_per_s": d["nv_ioctls"] / row.dt_s}
        ctx = d["cu_ctx_ns"] / 1e6 / row.dt_s
        was = row.pid in self._heavy
        if ctx >= CTX_HEAVY_MS_PER_S or (was and ctx >= CTX_HEAVY_MS_PER_S / 2):
            if not was:
                self._heavy.add(row.pid)
                self._new.append((row.pid, row.command, ctx, out["ctx_switch_us"]))
        else:
            self._heavy.discard(row.pid)
        return out

    def findings(self, tick: Tick) -> list:
        out = [finding(tick.wall_ns, "ctx_switch_heavy", str(pid),
                       f"CUDA context switches heavy: pid {pid} ({cmd}) {ms:.0f} ms/s"
                       + (f", {us:.1f} us each" if us else ""))
               for pid, cmd, ms, us in self._new]
        self._new = []
        self._heavy &= self._seen  # a process gone from the rows is not heavy any more
        self._seen = set()
        return out

    def request(self, fr, span) -> dict:
        c = fr.counters
        return {"launches": sum(getattr(c, f) for f in LAUNCH_CALLS), "ctx_ops": c.cu_ctx_ops,
                "ctx_ms": c.cu_ctx_ns / 1e6, "sync_ms": c.cu_sync_ns / 1e6, "ioctls": c.nv_ioctls}
