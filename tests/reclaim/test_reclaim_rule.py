"""The reclaim-storm episode rule (agent/reclaim/rule.py, docs/TELEMETRY.md), fed windows by hand: the
thresholds, open after open_windows hot windows, the half-threshold hysteresis, close after
close_windows quiet windows, the episode's bounds and peaks. And KswapdTracker's interval sums."""

from __future__ import annotations

import pytest

from mcp_hostagent.reclaim.rule import KswapdTracker, StormDetector, Thresholds, Window

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
        self.calls.append(("close", key, attrs.get("mcp.storm.windows"), end_ns))

    def forget(self, key):
        self.calls.append(("forget", key))


def _reclaim(kswapd_attached=True):
    from mcp_hostagent.config import load_config
    from mcp_hostagent.reclaim.capability import Reclaim

    return Reclaim(None, load_config(None, env={}, overrides={}), telemetry=_Tel(), registry=None,
                   kswapd_attached=kswapd_attached)


def test_request_evidence_links_exactly_the_episodes_its_window_overlaps():
    from types import SimpleNamespace

    from mcp_hostagent.reclaim.rule import Episode

    rc = _reclaim()
    closed = Episode("host", 1_000)
    rc._open(closed)
    closed.end_ns, closed.closed = 2_000, True
    rc._close(closed)
    cg = Episode("/sys/fs/cgroup/job", 5_000)
    rc._open(cg)
    assert [c[0] for c in rc.telemetry.calls] == ["open", "close", "open"]
    assert rc.telemetry.calls[2][3] == {"mcp.storm.scope": "/sys/fs/cgroup/job", "mcp.cgroup.path": "/sys/fs/cgroup/job"}
    assert rc.open_storms() == [cg]

    def links(t0, t1):
        ev = rc.evidence(SimpleNamespace(begin_ns=t0, end_ns=t1))
        return [(ln.key, ln.attributes["mcp.storm.scope"], ln.event.t_ns) for ln in ev.links]

    assert links(1_500, 1_800) == [(("storm", 1), "host", 1_500)]
    assert links(500, 1_200) == [(("storm", 1), "host", 1_000)]  # the event at the episode's start
    assert links(2_000, 4_000) == []  # after the closed episode's end, before the open one
    assert links(4_000, 6_000) == [(("storm", 2), "/sys/fs/cgroup/job", 5_000)]
    assert links(0, 1_000) == []  # ends as the episode starts: no overlap
    rc.kswapd.wake(0, 1_000)
    rc.kswapd.sleep(0, 1_400)
    assert rc.evidence(SimpleNamespace(begin_ns=1_200, end_ns=2_000)).attributes == {"mcp.reclaim.kswapd_overlap_ns": 200}
    assert _reclaim(kswapd_attached=False).evidence(SimpleNamespace(begin_ns=0, end_ns=9)).attributes == {}


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
