"""The requests capability's part of `top`'s snapshot: the rates of its counters per process (faults,
off-CPU time and the part of it spent waiting for a CPU) and a request's own counts."""

from __future__ import annotations

from ..telemetry.snapshot import ProcRow, Section, deltas

RATES = ("faults", "offcpu_ns", "offcpu_runnable_ns", "wakeup_wait_ns")


class RequestsSection(Section):
    def process(self, row: ProcRow) -> dict:
        d = deltas(row, RATES)
        if d is None:
            return {}
        return {"faults_per_s": d["faults"] / row.dt_s, "offcpu_pct": d["offcpu_ns"] / 1e9 / row.dt_s * 100,
                "wait_pct": (d["offcpu_runnable_ns"] + d["wakeup_wait_ns"]) / 1e9 / row.dt_s * 100}

    def request(self, fr, span) -> dict:
        c = fr.counters
        return {"faults": c.faults, "vcsw": c.vcsw, "ivcsw": c.ivcsw, "offcpu_ms": c.offcpu_ns / 1e6}
