"""The agent's own footprint (bench/bench_footprint.py, bench_latency.py): no state that grows with the
host's process churn, and the span export schedule that keeps a span's latency under a second."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time

import pytest

from mcp_hostagent.core.decode import Counters
from mcp_hostagent.exporters import build_exporters
from mcp_hostagent.exporters.files import metrics_path
from mcp_hostagent.core.processes import Processes
from mcp_hostagent.requests import telemetry as requests_t
from mcp_hostagent.telemetry.otel import SPAN_SCHEDULE_DELAY_MS, Telemetry, span_schedule_delay_ms
from mcp_hostagent.core.timebase import Timebase


def test_span_schedule_delay_default_and_the_sdk_variable():
    assert span_schedule_delay_ms({}) == SPAN_SCHEDULE_DELAY_MS <= 500
    assert span_schedule_delay_ms({"OTEL_BSP_SCHEDULE_DELAY": "200"}) == 200
    for bad in ("", "soon", "0", "-5"):
        assert span_schedule_delay_ms({"OTEL_BSP_SCHEDULE_DELAY": bad}) == SPAN_SCHEDULE_DELAY_MS


def _points(path: str, name: str) -> list[dict]:
    last = [ln for ln in open(metrics_path(path)).read().splitlines() if "resourceMetrics" in ln][-1]
    return [dp for rm in json.loads(last)["resourceMetrics"] for sm in rm["scopeMetrics"] for m in sm["metrics"]
            if m["name"] == name for dp in m["sum"]["dataPoints"]]


def test_processes_that_went_leave_no_metric_state(tmp_path):
    """3,000 short-lived processes, 100 per export, and one that lives throughout: past the SDK's 2,000
    attribute sets per instrument, no process may be merged into an overflow point, and the long-lived
    one keeps its series (same start time)."""
    path = str(tmp_path / "t.jsonl")
    t = Telemetry(service_name="t", exporters=build_exporters(path, None), timebase=Timebase(), metric_interval_s=3600)
    procs = Processes()
    procs.on_gone = t.forget_processes
    t.declare([*procs.instruments(), *requests_t.process_instruments(procs)])  # the per-process rows' own and requests'
    zero = Counters(*[0] * len(dataclasses.fields(Counters)))
    starts = set()
    try:
        for gen in range(30):
            rows = {pid: ({"process.pid": pid, "process.command_line": f"/bin/true {pid}"},
                          dataclasses.replace(zero, faults=pid)) for pid in range(gen * 100 + 1, gen * 100 + 101)}
            rows[99999] = ({"process.pid": 99999}, dataclasses.replace(zero, faults=gen))
            procs.set_rows(rows, {})
            t.meter_provider.force_flush()
            pts = _points(path, "hostagent.process.user_faults")
            assert not [p for p in pts if any(a["key"] == "otel.metric.overflow" for a in p.get("attributes", []))]
            assert len(pts) == 101
            starts |= {p["startTimeUnixNano"] for p in pts
                       if {"key": "process.pid", "value": {"intValue": "99999"}} in p["attributes"]}
        assert len(starts) == 1
    finally:
        t.shutdown(1.0)


@pytest.mark.bpf
def test_watch_all_keeps_no_dead_process_in_the_map(make_agent):
    """With watch=all a dead task's last context switch re-creates the proc_stats entry its exit probe
    deleted; the pipeline removes it, keeping the exit record's counters for a while."""
    a = make_agent(process__watch="all")
    pids = []
    for _ in range(40):
        p = subprocess.Popen(["/bin/true"])
        p.wait()
        pids.append(p.pid)
    table = a.agent.bpf[b"proc_stats"]
    deadline = time.monotonic() + 5
    while True:  # both are the pipeline's tick's work (status.interval_s): wait for that tick
        left = [k.value for k in table.keys() if k.value in pids]
        if (not left and set(pids) <= set(a.agent.processes.rows)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"{len(left)} of {len(pids)} exited processes still in proc_stats"
    assert set(pids) <= set(a.agent.processes.rows), "exited processes' final counters are kept for a while"
