"""The reclaim-storm episode rule (agent/reclaim/rule.py, docs/TELEMETRY.md), fed windows by hand: the
thresholds, open after open_windows hot windows, the half-threshold hysteresis, close after
close_windows quiet windows, the episode's bounds and peaks. And KswapdTracker's interval sums."""

from __future__ import annotations

import pytest

from mcp_hostagent.reclaim.rule import KswapdTracker, StormDetector, Thresholds, Window
from mcp_hostagent.telemetry.spec import Log2Buckets

S = 1_000_000_000  # one window: 1 s in ns
MS = 1_000_000


def win(i: int, kswapd: float = 0.0, direct_ms: float = 0.0, memcg_ms: float = 0.0, **context) -> Window:
    """The i-th one-second window with those signals (ms of stall in it = ms per s)."""
    return Window(i * S, (i + 1) * S, kswapd, int(direct_ms * MS), int(memcg_ms * MS), dict(context))


def run(det: StormDetector, windows) -> list[tuple[str, int, int]]:
    """(verdict, start s, end s) per window fed; ("-", 0, 0) for None."""
    out = []
    for w in windows:
        r = det.feed(w)
        out.append(("-", 0, 0) if r is None else (r[0], r[1].start_ns // S, r[1].end_ns // S))
    return out


@pytest.mark.parametrize("signal, below, at", [
    ("kswapd", 0.49, 0.5),       # share of the window kswapd is awake
    ("direct_ms", 9.9, 10.0),    # direct-reclaim stall, ms per s
    ("memcg_ms", 9.9, 10.0),     # memcg-reclaim stall, ms per s
])
def test_each_signal_opens_at_its_threshold_not_below(signal, below, at):
    det = StormDetector("host")
    assert det.feed(win(0, **{signal: below})) is None
    verdict, ep = det.feed(win(1, **{signal: at}))
    assert verdict == "open" and ep.start_ns == 1 * S and ep.scope == "host"


def test_rates_are_per_second_of_the_window():
    det = StormDetector("host")
    half = Window(0, S // 2, 0.0, 5 * MS, 0)  # 5 ms in half a second: 10 ms/s
    assert det.feed(half)[0] == "open"


def test_open_windows_hot_in_a_row_and_the_episode_starts_at_the_first():
    det = StormDetector("host", Thresholds(open_windows=3))
    got = run(det, [win(0, direct_ms=20), win(1, direct_ms=20), win(2), win(3, direct_ms=20), win(4, direct_ms=20),
                    win(5, direct_ms=20)])
    # the quiet window 2 resets the run: 3, 4, 5 open it, starting at 3
    assert got == [("-", 0, 0)] * 5 + [("open", 3, 0)]
    assert det.episode.windows == 3


def test_closes_after_three_quiet_windows_ending_at_the_last_hot_one():
    det = StormDetector("host")
    got = run(det, [win(0, kswapd=0.9), win(1, kswapd=0.8), win(2), win(3), win(4)])
    assert got == [("open", 0, 0), ("update", 0, 0), ("update", 0, 0), ("update", 0, 0), ("close", 0, 2)]
    assert det.episode is None


def test_hysteresis_a_window_over_half_the_threshold_keeps_it_open():
    det = StormDetector("host")
    # 6 ms/s is below the threshold (10) but above half of it: not quiet, not hot
    got = run(det, [win(0, direct_ms=12), win(1, direct_ms=6), win(2), win(3, direct_ms=6), win(4), win(5), win(6)])
    assert [g[0] for g in got] == ["open", "update", "update", "update", "update", "update", "close"]
    # the end is the last window at or over the threshold, not the last one over half of it
    assert got[-1] == ("close", 0, 1)


def test_quiet_count_restarts_on_a_warm_window():
    det = StormDetector("host", Thresholds(close_windows=2))
    got = run(det, [win(0, memcg_ms=50), win(1), win(2, memcg_ms=5), win(3), win(4)])
    assert [g[0] for g in got] == ["open", "update", "update", "update", "close"]


def test_peaks_and_totals():
    det = StormDetector("/kubepods/pod1")
    det.feed(win(0, kswapd=0.6, direct_ms=3, pgscan_direct=100, psi_some_avg10=4.0))
    det.feed(win(1, kswapd=0.2, direct_ms=40, memcg_ms=12, pgscan_direct=50, psi_some_avg10=9.5))
    det.feed(win(2, psi_some_avg10=1.0))
    ep = det.episode
    assert ep.windows == 3 and ep.scope == "/kubepods/pod1"
    assert (ep.peak_kswapd_ratio, ep.peak_direct_ms_per_s, ep.peak_memcg_ms_per_s) == (0.6, 40.0, 12.0)
    assert ep.totals == {"pgscan_direct": 150}  # counters summed
    assert ep.peaks == {"psi_some_avg10": 9.5}  # PSI: the highest


def test_a_new_episode_after_a_close():
    det = StormDetector("host", Thresholds(close_windows=1))
    got = run(det, [win(0, kswapd=1.0), win(1), win(2, kswapd=1.0), win(3)])
    assert got == [("open", 0, 0), ("close", 0, 1), ("open", 2, 0), ("close", 2, 3)]


def test_kswapd_intervals_clip_to_the_window_and_sum_nodes():
    k = KswapdTracker()
    k.wake(0, 1 * S)
    k.sleep(0, 3 * S)
    k.wake(1, 2 * S)  # still awake
    assert k.active_ns(0, 4 * S, nid=0) == 2 * S
    assert k.active_ns(2 * S, 4 * S, nid=0) == 1 * S
    assert k.active_ns(0, 4 * S, nid=1) == 2 * S  # awake to the end of the window
    assert k.active_ns(0, 4 * S) == 4 * S
    assert k.nodes() == {0, 1}


def test_kswapd_assumed_awake_only_when_never_seen():
    k = KswapdTracker()
    assert k.assume_awake(0, 5 * S) is True
    assert k.active_ns(5 * S, 6 * S, 0) == S
    assert k.assume_awake(0, 6 * S) is False  # seen now: its records say the truth from here
    k.sleep(0, 7 * S)
    assert k.active_ns(0, 10 * S, 0) == 2 * S
    k2 = KswapdTracker()
    k2.wake(3, S)
    k2.sleep(3, 2 * S)
    assert k2.assume_awake(3, 5 * S) is False


def test_repeated_wake_keeps_the_first():
    k = KswapdTracker()
    k.wake(0, 1 * S)
    k.wake(0, 2 * S)  # a second wake while awake: the interval began at the first
    k.sleep(0, 3 * S)
    assert k.active_ns(0, 10 * S) == 2 * S
    k.forget_before(4 * S)
    assert k.active_ns(0, 10 * S) == 0


class _Tel:
    """Telemetry's span calls, recorded (Reclaim hands it plain data only)."""

    def __init__(self):
        self.calls = []

    def open(self, key, spec):
        self.calls.append(("open", key, spec.name, spec.attributes))

    def close(self, key, attrs, end_ns):
        self.calls.append(("close", key, attrs.get("hostagent.storm.windows"), end_ns))

    def forget(self, key):
        self.calls.append(("forget", key))

    def add_link(self, key, ctx, attrs):
        self.calls.append(("link", key, ctx, attrs["hostagent.request.reclaim_stalled"]))
        return True


def _reclaim(kswapd_attached=True):
    from conftest import unstarted_agent

    rc = unstarted_agent().caps["reclaim"]
    rc.telemetry, rc.registry, rc.kswapd_attached = _Tel(), None, kswapd_attached
    return rc


def test_request_evidence_links_exactly_the_episodes_its_window_overlaps():
    from types import SimpleNamespace

    from mcp_hostagent.reclaim.rule import Episode

    rc = _reclaim()
    closed = Episode("host", 1_000, hot=[(1_000, 2_000)])
    rc._open(closed)
    closed.end_ns, closed.closed = 2_000, True
    rc._close(closed)
    cg = Episode("/sys/fs/cgroup/job", 5_000, hot=[(5_000, 6_000)])  # open: its quiet windows after 6_000
    rc._open(cg)
    assert [c[0] for c in rc.telemetry.calls] == ["open", "close", "open"]
    assert rc.telemetry.calls[2][3] == {"hostagent.storm.scope": "/sys/fs/cgroup/job", "hostagent.cgroup.path": "/sys/fs/cgroup/job"}
    assert rc.open_storms() == [cg]
    rc._paths.update({7: "/sys/fs/cgroup/job", 8: "/sys/fs/cgroup/other"})  # the processes' memory cgroups

    def links(t0, t1, tgid=7):
        ev = rc.evidence(SimpleNamespace(begin_ns=t0, end_ns=t1, tgid=tgid, tid=tgid, request_id=0))
        return [(ln.key, ln.attributes["hostagent.storm.scope"], ln.event.t_ns) for ln in ev.links]

    assert links(1_500, 1_800) == [(("storm", 1), "host", 1_500)]
    assert links(500, 1_200) == [(("storm", 1), "host", 1_000)]  # the event at the episode's start
    assert links(2_000, 4_000) == []  # after the closed episode's end, before the open one
    assert links(4_000, 6_000) == [(("storm", 2), "/sys/fs/cgroup/job", 5_000)]
    assert links(4_000, 6_000, tgid=8) == []  # a cgroup storm is its cgroup's, not the neighbours'
    assert links(6_000, 7_000) == []  # begun after its last hot window: not its victim, open or not
    assert links(0, 1_000) == []  # ends as the episode starts: no overlap
    rc.kswapd.wake(0, 1_000)
    rc.kswapd.sleep(0, 1_400)
    # kswapd awake 1_000..1_400 ns, the request 1_200..2_000: 200 ns together, in seconds
    assert rc.evidence(SimpleNamespace(begin_ns=1_200, end_ns=2_000, tgid=7, tid=7, request_id=0)).attributes == {
        "hostagent.reclaim.kswapd.overlap.time": 200 / 1e9}
    assert _reclaim(kswapd_attached=False).evidence(SimpleNamespace(begin_ns=0, end_ns=9, tgid=7, tid=7, request_id=0)).attributes == {}


def test_a_storm_links_to_the_requests_that_ended_before_it_was_decided():
    """A storm opens after its first hot window closes: requests that stalled in that window ended
    before anyone knew. The storm's span links to them (and to later ones) when it is decided: to
    exactly those that overlapped its hot windows, in its scope, each once."""
    from types import SimpleNamespace

    from mcp_hostagent.core.decode import Counters
    from mcp_hostagent.reclaim.rule import Episode

    rc = _reclaim()
    rc._paths.update({7: "/cg/job", 8: "/cg/other"})

    def fin(name, tgid, t0, t1, stalled=False):
        rc.on_request(SimpleNamespace(tgid=tgid, begin_ns=t0, end_ns=t1,
                                      counters=Counters(memcg_reclaims=int(stalled))), None, SimpleNamespace(span_id=name))

    fin(1, 7, 100, 900, stalled=True)  # inside the first hot window, ended before the storm opened
    fin(2, 8, 100, 900)  # same time, another cgroup
    fin(3, 7, 10, 90)  # before it
    ep = Episode("/cg/job", 100, hot=[(100, 1_000)])
    rc._open(ep)
    rc._link_victims(1, ep)
    fin(4, 7, 1_500, 1_600)  # in a window the storm finds hot later
    fin(5, 7, 2_500, 2_600)  # in a quiet window after it
    ep.hot.append((1_000, 2_000))
    rc._link_victims(1, ep)
    ep.end_ns, ep.closed = 2_000, True
    rc._close(ep)
    assert [c[2:] for c in rc.telemetry.calls if c[0] == "link"] == [(SimpleNamespace(span_id=1), True),
                                                                     (SimpleNamespace(span_id=4), False)]
    assert rc.telemetry.calls[-1][0] == "close" and rc.victims == {}


def test_closed_episodes_beyond_the_kept_number_are_forgotten_and_open_ones_close_unfinished():
    from mcp_hostagent.reclaim.capability import KEEP_CLOSED_STORMS
    from mcp_hostagent.reclaim.rule import Episode

    rc = _reclaim()
    for i in range(KEEP_CLOSED_STORMS + 2):
        ep = Episode("host", i * 10)
        rc._open(ep)
        ep.end_ns, ep.closed = i * 10 + 5, True
        rc._close(ep)
    assert [c for c in rc.telemetry.calls if c[0] == "forget"] == [("forget", ("storm", 1)), ("forget", ("storm", 2))]
    assert len(rc.episodes) == KEEP_CLOSED_STORMS
    last = Episode("host", 10_000)
    rc._open(last)
    rc.telemetry.calls.clear()
    rc.stop()
    assert rc.telemetry.calls == [("close", ("storm", KEEP_CLOSED_STORMS + 3), 0, None)]


# ---- reclaim telemetry (agent/reclaim/telemetry.py): window rows, storm spans, episode attributes ----

POD_UID = "1234abcd-5678-90ef-1234-567890abcdef"
CTR = "0123456789abcdef" * 4
POD_CG = (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice"
          f"/cri-containerd-{CTR}.scope")
POD_ONLY_CG = f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_UID.replace('-', '_')}.slice"
HOST_CG = "/system.slice/batch.service"


@pytest.mark.parametrize("path,attrs", [
    (POD_CG, {"hostagent.cgroup.path": POD_CG, "container.id": CTR, "k8s.pod.uid": POD_UID}),
    (POD_ONLY_CG, {"hostagent.cgroup.path": POD_ONLY_CG, "k8s.pod.uid": POD_UID}),
    (HOST_CG, {"hostagent.cgroup.path": HOST_CG}),
])
def test_cgroup_attrs(path, attrs):
    from mcp_hostagent.reclaim.telemetry import cgroup_attrs

    assert cgroup_attrs(path) == attrs


def test_window_rows():
    from mcp_hostagent.reclaim.telemetry import window_rows

    t = {"direct_ns": 5_000, "directs": 2, "memcg_ns": 700, "memcgs": 1, "kswapd_wakeups": 3,
         "scan_kswapd": 100, "steal_kswapd": 90, "scan_direct": 40, "steal_direct": 30, "scan_memcg": 8,
         "steal_memcg": 6}
    hist = {("memcg", 20): 1, ("direct", 22): 4, ("direct", 21): 2}  # (kind, log2 slot) -> stalls
    psi = {"some": {"avg10": 1.5, "avg60": 0.5, "avg300": 0.1, "total": 999}, "full": {"avg60": 0.2}}
    rows = window_rows(t, hist, {1: 0.25, 0: 0.5}, {1: 0.1, 0: 0.02}, psi, {"host": True, POD_CG: False},
                       {POD_CG: [1_000, 2_000], HOST_CG: [0, 5]}, {"pgfault": 1_000, "pgmajfault": 30, "pswpin": 7})
    pod = {"hostagent.cgroup.path": POD_CG, "container.id": CTR, "k8s.pod.uid": POD_UID}
    assert rows == {
        "hostagent.reclaim.stall.time": [(5_000 / 1e9, {"hostagent.reclaim.kind": "direct"}),
                                         (700 / 1e9, {"hostagent.reclaim.kind": "memcg"})],
        # one kernel-bucketed histogram per kind, its slots as the kernel counted them
        "hostagent.reclaim.stall.duration": [(Log2Buckets({21: 2, 22: 4}), {"hostagent.reclaim.kind": "direct"}),
                                             (Log2Buckets({20: 1}), {"hostagent.reclaim.kind": "memcg"})],
        "hostagent.reclaim.pages": [(100, {"hostagent.reclaim.by": "kswapd", "hostagent.reclaim.op": "scanned"}),
                              (90, {"hostagent.reclaim.by": "kswapd", "hostagent.reclaim.op": "reclaimed"}),
                              (40, {"hostagent.reclaim.by": "direct", "hostagent.reclaim.op": "scanned"}),
                              (30, {"hostagent.reclaim.by": "direct", "hostagent.reclaim.op": "reclaimed"}),
                              (8, {"hostagent.reclaim.by": "memcg", "hostagent.reclaim.op": "scanned"}),
                              (6, {"hostagent.reclaim.by": "memcg", "hostagent.reclaim.op": "reclaimed"})],
        "hostagent.reclaim.kswapd.utilization": [(0.5, {"hostagent.numa.node": 0}), (0.25, {"hostagent.numa.node": 1})],
        "hostagent.reclaim.kswapd.cpu.utilization": [(0.02, {"hostagent.numa.node": 0}), (0.1, {"hostagent.numa.node": 1})],
        "hostagent.memory.pressure.avg10": [(0.015, {"hostagent.psi.kind": "some", "hostagent.psi.scope": "host"}),
                                 (0.0, {"hostagent.psi.kind": "full", "hostagent.psi.scope": "host"})],
        "hostagent.reclaim.storm.active": [(1, {"hostagent.storm.scope": "host"}), (0, {"hostagent.storm.scope": POD_CG})],
        "hostagent.cgroup.reclaim.stall.time": [(1_000 / 1e9, {**pod, "hostagent.reclaim.kind": "direct"}),
                                                (2_000 / 1e9, {**pod, "hostagent.reclaim.kind": "memcg"}),
                                                (0.0, {"hostagent.cgroup.path": HOST_CG, "hostagent.reclaim.kind": "direct"}),
                                                (5 / 1e9, {"hostagent.cgroup.path": HOST_CG, "hostagent.reclaim.kind": "memcg"})],
        "system.paging.faults": [(970, {"system.paging.fault.type": "minor"}),
                                 (30, {"system.paging.fault.type": "major"})],
    }
    # times in seconds (floats), counts stay integers
    assert all(isinstance(v, float) for v, _ in rows["hostagent.reclaim.stall.time"] + rows["hostagent.cgroup.reclaim.stall.time"])
    assert all(isinstance(v, int) for v, _ in rows["system.paging.faults"] + rows["hostagent.reclaim.pages"])
    assert [type(v) for v, _ in rows["hostagent.reclaim.storm.active"]] == [int, int]  # 1 / 0, not True / False


def test_window_rows_of_a_quiet_host_without_psi_or_vmstat():
    from mcp_hostagent.reclaim.telemetry import window_rows

    t = dict.fromkeys(("direct_ns", "memcg_ns", "scan_kswapd", "steal_kswapd", "scan_direct", "steal_direct",
                       "scan_memcg", "steal_memcg"), 0)
    rows = window_rows(t, {}, {}, {}, {}, {}, {}, {})
    assert rows == {
        "hostagent.reclaim.stall.time": [(0.0, {"hostagent.reclaim.kind": "direct"}), (0.0, {"hostagent.reclaim.kind": "memcg"})],
        "hostagent.reclaim.stall.duration": [],
        "hostagent.reclaim.pages": [(0, {"hostagent.reclaim.by": by, "hostagent.reclaim.op": op})
                              for by in ("kswapd", "direct", "memcg") for op in ("scanned", "reclaimed")],
        "hostagent.reclaim.kswapd.utilization": [],
        "hostagent.reclaim.kswapd.cpu.utilization": [],
        "hostagent.memory.pressure.avg10": [],
        "hostagent.reclaim.storm.active": [],
        "hostagent.cgroup.reclaim.stall.time": [],
        "system.paging.faults": [(0, {"system.paging.fault.type": "minor"}), (0, {"system.paging.fault.type": "major"})],
    }


@pytest.mark.parametrize("scope,attrs", [
    ("host", {"hostagent.storm.scope": "host"}),  # host-wide: no cgroup attributes
    (POD_CG, {"hostagent.storm.scope": POD_CG, "hostagent.cgroup.path": POD_CG, "container.id": CTR, "k8s.pod.uid": POD_UID}),
    (HOST_CG, {"hostagent.storm.scope": HOST_CG, "hostagent.cgroup.path": HOST_CG}),
])
def test_storm_span_opens_at_the_start_with_the_scope_attributes(scope, attrs):
    from mcp_hostagent.reclaim.rule import Episode
    from mcp_hostagent.reclaim.telemetry import storm_span
    from mcp_hostagent.telemetry.spec import SpanSpec

    ep = Episode(scope, 7 * S, end_ns=9 * S, windows=2, peak_kswapd_ratio=0.9, closed=True)
    assert storm_span(ep) == SpanSpec("hostagent.reclaim_storm", 7 * S, None, attrs)


def test_episode_attributes():
    from mcp_hostagent.reclaim.rule import Episode
    from mcp_hostagent.reclaim.telemetry import episode_attributes

    ep = Episode("host", 0, end_ns=3 * S, windows=3, peak_kswapd_ratio=0.123456, peak_direct_ms_per_s=12.34567,
                 peak_memcg_ms_per_s=0.0004, totals={"pgscan_direct": 100, "allocstall": 4},
                 peaks={"psi_some_avg10": 12.5, "psi_full_avg10": 0.0}, closed=True)
    assert episode_attributes(ep) == {
        "hostagent.storm.scope": "host", "hostagent.storm.windows": 3, "hostagent.storm.peak.kswapd.utilization": 0.1235,
        # stall ms per s of window -> s per s (a ratio), rounded to 6 places; PSI percent -> ratio
        "hostagent.storm.peak.direct_stall.ratio": 0.012346, "hostagent.storm.peak.memcg_stall.ratio": 0.0,
        "hostagent.storm.pgscan_direct": 100, "hostagent.storm.allocstall": 4,
        "hostagent.storm.peak.psi_some_avg10": 0.125, "hostagent.storm.peak.psi_full_avg10": 0.0}


def test_episode_attributes_of_a_detected_cgroup_episode():
    from mcp_hostagent.reclaim.telemetry import episode_attributes

    det = StormDetector(POD_CG)
    det.feed(win(0, memcg_ms=25, pgscan_direct=10, psi_some_avg10=4.0))
    det.feed(win(1, memcg_ms=12.5, kswapd=0.3, pgscan_direct=5, psi_some_avg10=6.25))
    assert episode_attributes(det.episode) == {
        "hostagent.storm.scope": POD_CG, "hostagent.storm.windows": 2, "hostagent.storm.peak.kswapd.utilization": 0.3,
        "hostagent.storm.peak.direct_stall.ratio": 0.0, "hostagent.storm.peak.memcg_stall.ratio": 0.025,
        "hostagent.storm.pgscan_direct": 15, "hostagent.storm.peak.psi_some_avg10": 0.0625}


def test_a_long_storm_that_closes_last_is_kept_for_the_requests_it_overlapped():
    from types import SimpleNamespace

    from mcp_hostagent.reclaim.capability import KEEP_CLOSED_STORMS
    from mcp_hostagent.reclaim.rule import Episode

    rc = _reclaim()
    long = Episode("host", 0, hot=[(0, 10_000)])
    rc._open(long)
    for i in range(KEEP_CLOSED_STORMS):
        short = Episode(f"/cg/{i}", 100 + i * 10, hot=[(100 + i * 10, 105 + i * 10)])
        rc._open(short)
        short.end_ns, short.closed = 105 + i * 10, True
        rc._close(short)
    long.end_ns, long.closed = 10_000, True
    rc._close(long)
    assert [c for c in rc.telemetry.calls if c[0] == "forget"] == [("forget", ("storm", 2))]  # the first short one
    links = rc.evidence(SimpleNamespace(begin_ns=9_000, end_ns=11_000, tgid=1, tid=1, request_id=0)).links
    assert [ln.key for ln in links] == [("storm", 1)]


def test_oom_events_reach_the_victim_and_its_memory_cgroup_neighbours_only():
    """A memcg kill is an event on requests of processes in the victim's memory cgroup (its path kept
    from the kill: the victim is gone by then), an attribute too on the victim's own; a host kill on
    every overlapping request; none outside the kill's time."""
    from types import SimpleNamespace

    from mcp_hostagent.reclaim.oom import OomKill

    rc = _reclaim()
    rc._paths.update({7: "/cg/job", 8: "/cg/job", 9: "/cg/other"})
    rc.oom_kills.append((7, "/cg/job", OomKill(7, "python", 1, 0, 0, 0, ts_ns=500, scope="memcg")))
    rc.oom_kills.append((99, "/", OomKill(99, "hog", 1, 0, 0, 0, ts_ns=800, scope="host")))

    def ev(tgid, t0, t1):
        e = rc.oom_evidence(SimpleNamespace(tgid=tgid, begin_ns=t0, end_ns=t1))
        return e.attributes, [(x.attributes["hostagent.oom.victim.pid"], x.attributes["hostagent.oom.own_process"])
                              for x in e.events]

    assert ev(7, 400, 600) == ({"hostagent.oom.killed": True}, [(7, True)])
    assert ev(8, 400, 600) == ({}, [(7, False)])  # same memory cgroup
    assert ev(9, 400, 600) == ({}, [])  # another cgroup: a memcg kill is not its business
    assert ev(9, 700, 900) == ({}, [(99, False)])  # a host kill reaches everyone
    assert ev(8, 100, 200) == ({}, [])


def _stat(pid: int, flags: int) -> str:
    # /proc/PID/stat: pid (comm) state ppid pgrp session tty_nr tpgid flags ... (field 9: flags)
    return f"{pid} (py thon) S 1 {pid} {pid} 0 -1 {flags} 0 0 0 0\n"


@pytest.mark.parametrize("victim_flags,cached,trigger,want_path,want_scope", [
    # alive at the read: its own lines
    (0x400000, False, None, "/job", "memcg"),
    # exiting (PF_EXITING 0x4), its v1 line says "/" (the kernel's zombie placeholder): the agent's
    # reading of it alive stands in, or nothing, never a host kill for a memcg one
    (0x400004, True, None, "/job", "memcg"),
    (0x400004, False, None, "unknown", "unknown"),
    # exiting and never described, but the allocating task (another process of the cgroup) alive
    (0x400004, False, 31, "/job", "memcg"),
])
def test_an_oom_victim_read_while_it_exits_is_not_put_in_the_root_cgroup(tmp_path, monkeypatch, victim_flags, cached,
                                                                       trigger, want_path, want_scope):
    """On a host with v1 controllers (this VM's memory controller is v1) /proc/PID/cgroup of a task past
    the start of do_exit() names "/" for every v1 hierarchy: CI saw the kill of a process in a
    64 MiB memcg read as "/" when the agent handled the record after the victim began to exit."""
    from mcp_hostagent.core.identity import CgroupResolver, ProcessRegistry, parse_proc_cgroup
    from mcp_hostagent.reclaim.oom import OomKill

    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (cg / "memory" / "job").mkdir(parents=True)
    (cg / "memory" / "job" / "memory.limit_in_bytes").write_text(str(64 << 20))
    (cg / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))

    def task(pid, flags, memory_path):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"5:memory:{memory_path}\n0::/\n")
        (proc / str(pid) / "stat").write_text(_stat(pid, flags))
        (proc / str(pid) / "status").write_text(f"Name:\tpython\nTgid:\t{pid}\n")

    task(30, victim_flags, "/" if victim_flags & 0x4 else "/job")
    if trigger:
        task(trigger, 0x400000, "/job")
    registry = ProcessRegistry(str(proc), CgroupResolver(str(cg), str(proc)))
    if cached:  # described at its BEGIN, alive
        from mcp_hostagent.core.identity import ProcessInfo
        registry._cache[30] = ProcessInfo(30, 1, "python", cgroup=parse_proc_cgroup("5:memory:/job\n0::/\n"))
    rc = _reclaim()
    rc.registry, rc.proc_root, rc._mem_total = registry, str(proc), 1 << 34
    from mcp_hostagent.reclaim import oom

    limit_files = oom.limit_files
    monkeypatch.setattr(oom, "limit_files", lambda v2, v1: limit_files(v2, v1, str(cg)))
    rc.on_oom(OomKill(30, "python", 1, 0, 0, 0, trigger=trigger or 30), 500)
    ((tgid, path, kill),) = rc.oom_kills
    assert (tgid, path, kill.scope) == (30, want_path, want_scope)
