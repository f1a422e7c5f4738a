"""agent/cuda/coverage.py: when a duty-cycled launch probe was on, and what that makes of a request's
count (exact, estimate, unknown). The real probes' version: tests/cuda/test_bpf_cuda.py
test_duty_cycled_request_counts_are_exact_estimated_or_absent_never_a_false_zero."""

import pytest

from mcp_hostagent.cuda.coverage import OnLog, apply
from mcp_hostagent.cuda.telemetry import coverage_attributes
from mcp_hostagent.core.decode import Counters


def test_closed_interval_surely_from_return_to_detach_call_maybe_from_attach_call():
    log = OnLog()
    log.on("k", 10.0, 10.5)  # attach called at 10, returned at 10.5
    log.closing("k", 12.0)  # detach called at 12
    log.off("k", 12.3)  # its release returned at 12.3: not counting since 12
    assert log.covered("k", 10.5, 12.0, now=20) == (1.5, 1.5)
    assert log.covered("k", 9.0, 13.0, now=20) == (1.5, 2.0)
    assert log.covered("k", 12.0, 12.3, now=20) == (0.0, 0.0)  # inside the release: nothing counted
    assert log.covered("k", 0.0, 9.0, now=20) == (0.0, 0.0)


def test_open_interval_runs_to_now_and_stops_at_a_detach_in_progress():
    log = OnLog()
    log.on("k", 1.0, 1.1)
    assert log.covered("k", 2.0, 3.0, now=5.0) == (1.0, 1.0)
    log.closing("k", 2.5)  # a slow release under way: a request ending now is not covered to now
    assert log.covered("k", 2.0, 3.0, now=5.0) == (0.5, 0.5)
    log.forget("k")
    assert log.covered("k", 2.0, 3.0, now=5.0) == (0.0, 0.0)


def test_several_intervals_add_up_and_old_ones_go():
    log = OnLog()
    for t in (0.0, 1.0, 2.0):
        log.on("k", t, t)
        log.closing("k", t + 0.25)
        log.off("k", t + 0.3)
    assert log.covered("k", 0.0, 3.0, now=9) == (0.75, 0.75)
    log.on("k", 500.0, 500.0)
    log.closing("k", 501.0)
    log.off("k", 501.0)  # KEEP_S later: the first three are gone
    assert log.covered("k", 0.0, 3.0, now=600) == (0.0, 0.0)


@pytest.mark.parametrize("cov, hits, want, cov_of", [
    ({}, 40, 40, {}),  # not duty-cycled in the window: exact
    ({"a": (1.0, 1.0)}, 40, 40, {}),
    ({"a": (0.0, 0.0)}, 0, None, {"a": 0.0}),  # never on: unknown, not 0
    ({"a": (0.0, 0.0)}, 3, None, {"a": 0.0}),
    ({"a": (0.0, 1.0)}, 40, None, {"a": 0.0}),  # inside an attach call: maybe counted, maybe not
    ({"a": (0.4, 0.6)}, 20, 40, {"a": 0.5}),  # estimate: hits / mean of the shares
    ({"a": (0.4, 0.6)}, 0, 0, {"a": 0.5}),  # an estimate of 0, labelled
])
def test_apply(cov, hits, want, cov_of):
    assert apply({"a": hits}, cov) == ({"a": want}, cov_of)


def test_coverage_attributes_label_each_symbol_and_leave_unknowns_off():
    c = Counters(cu_launch=20, cu_launch_ex=7)
    assert coverage_attributes(c, {}) == {}
    got = coverage_attributes(c, {"cu_launch": (0.4, 0.6), "cu_launch_ex": (1.0, 1.0)})
    # the exact symbol keeps its counter value (set by the request span) and gets no coverage
    assert got == {"hostagent.cuda.launches.cuLaunchKernel": 40, "hostagent.cuda.coverage.cuLaunchKernel": 0.5}
    got = coverage_attributes(Counters(cu_launch_ex=7), {"cu_launch": (0.0, 0.0), "cu_launch_ex": (0.5, 0.5)})
    assert got == {"hostagent.cuda.launches.cuLaunchKernel": None,  # dropped by telemetry: unknown
                   "hostagent.cuda.coverage.cuLaunchKernel": 0.0,
                   "hostagent.cuda.launches.cuLaunchKernelEx": 14, "hostagent.cuda.coverage.cuLaunchKernelEx": 0.5}


# ---- steps.OutlierGate: which GPU steps become spans ----
from mcp_hostagent.cuda.steps import OutlierGate  # noqa: E402


def test_gate_spans_only_outliers_after_warmup():
    g = OutlierGate(min_s=0.05, per_s=10)
    t = 0.0
    for _ in range(OutlierGate.WARMUP):
        t += 0.01
        assert not g.admit(1, 0.2, t)  # the first steps set the mean, however long
    for _ in range(100):
        t += 0.01
        assert not g.admit(1, 0.001, t)  # the mean falls to ~1 ms
    assert not g.admit(1, 0.03, t + 0.01)  # 30x the mean but under min_s
    assert g.admit(1, 0.08, t + 2)  # long and an outlier
    assert not g.admit(1, 0.08, t + 2.5)  # at most one a second per process
    assert g.admit(1, 0.5, t + 3.1)


def test_gate_host_wide_cap():
    g = OutlierGate(min_s=0.0, per_s=2)
    t = 0.0
    for pid in range(1, 11):
        for _ in range(OutlierGate.WARMUP):
            g.admit(pid, 0.001, t)
    admitted = sum(g.admit(pid, 1.0, t + 0.001 * pid) for pid in range(1, 11))
    assert admitted == 2  # two tokens, ten processes with an outlier at once
    assert sum(g.admit(pid, 1.0, t + 5 + 0.001 * pid) for pid in range(1, 11)) == 2  # refilled to the cap
