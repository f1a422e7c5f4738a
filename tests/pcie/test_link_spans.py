"""agent/pcie/telemetry.py LinkEpisodeSpans: LinkJudge's episode records (agent/pcie/episodes.py) ->
span calls on a recording fake telemetry (open / event / close / forget), the closed episodes kept for
later requests (KEEP_CLOSED), active(), and the evidence (links and events) a request's window gets."""

from __future__ import annotations

import pytest

from mcp_hostagent.pcie import telemetry as T
from mcp_hostagent.pcie.episodes import LinkEpisode
from mcp_hostagent.telemetry.spec import EventSpec, LinkSpec, SpanSpec

GPU0, GPU1 = "0000:17:00.0", "0000:65:00.0"
BRIDGE = "0000:16:00.0"


class FakeTelemetry:
    """Telemetry's span calls, recorded."""

    def __init__(self):
        self.calls: list[tuple] = []

    def open(self, key, spec):
        self.calls.append(("open", key, spec))

    def event(self, key, name, t_ns, attrs):
        self.calls.append(("event", key, name, t_ns, attrs))

    def close(self, key, attrs, end_ns):
        self.calls.append(("close", key, attrs, end_ns))

    def forget(self, key):
        self.calls.append(("forget", key))


def ep(event, episode_id=1, gpu=GPU0, start_ns=1_000, end_ns=None, t_ns=None, causes=("width_drop",),
       to_width=8, aer=()) -> LinkEpisode:
    """A LinkEpisode as LinkJudge._record makes it (end_ns only on the closing record)."""
    return LinkEpisode(event=event, episode_id=episode_id, gpu_bdf=gpu, link_bdf=BRIDGE, causes=causes,
                       from_gen=5, from_width=16, to_gen=5, to_width=to_width, ref_gen=5, ref_width=16,
                       aer_delta=aer, aer_devices=(BRIDGE,) if aer else (), start_ns=start_ns, end_ns=end_ns,
                       t_ns=start_ns if t_ns is None else t_ns, busy=True)


def attrs(episode_id=1, gpu=GPU0, causes=("width_drop",), to_width=8, aer=()) -> dict:
    a = {"hostagent.pcie.episode_id": episode_id, "hostagent.pcie.gpu_bdf": gpu, "hostagent.pcie.link_bdf": BRIDGE,
         "hostagent.pcie.causes": list(causes), "hostagent.pcie.from_gen": 5, "hostagent.pcie.from_width": 16,
         "hostagent.pcie.to_gen": 5, "hostagent.pcie.to_width": to_width, "hostagent.pcie.ref_gen": 5, "hostagent.pcie.ref_width": 16}
    if aer:
        a["hostagent.pcie.aer_devices"] = [BRIDGE]
        a.update({f"hostagent.pcie.aer.{k}": v for k, v in aer})
    return a


def spans_of(*episodes):
    tel = FakeTelemetry()
    spans = T.LinkEpisodeSpans(tel)
    for e in episodes:
        spans.on_episode(e)
    return spans, tel


# ---- on_episode: the span calls ----

def test_opened_updated_closed():
    aer = (("correctable", 3),)
    spans, tel = spans_of(
        ep("opened", start_ns=1_000),
        ep("updated", start_ns=1_000, t_ns=2_000, causes=("width_drop", "aer_errors"), aer=aer),
        ep("closed", start_ns=1_000, t_ns=5_000, end_ns=5_000, to_width=16))
    assert tel.calls == [
        ("open", ("pcie", 1), SpanSpec("hostagent.pcie.link_episode", 1_000, None, attrs())),
        ("event", ("pcie", 1), "hostagent.pcie.link_update", 2_000, attrs(causes=("width_drop", "aer_errors"), aer=aer)),
        ("close", ("pcie", 1), attrs(to_width=16), 5_000),
    ]
    assert spans.episodes == {1: [GPU0, 1_000, 5_000]}


def test_opened_only_opens():
    spans, tel = spans_of(ep("opened", episode_id=7, gpu=GPU1, start_ns=300))
    assert tel.calls == [("open", ("pcie", 7), SpanSpec("hostagent.pcie.link_episode", 300, None,
                                                        attrs(episode_id=7, gpu=GPU1)))]
    assert spans.episodes == {7: [GPU1, 300, None]}


def test_an_update_of_an_episode_not_seen_opens_it_first():
    # e.g. telemetry attached after the judge opened it: the span starts at the episode's start
    spans, tel = spans_of(ep("updated", episode_id=3, start_ns=100, t_ns=900))
    assert tel.calls == [
        ("open", ("pcie", 3), SpanSpec("hostagent.pcie.link_episode", 100, None, attrs(episode_id=3))),
        ("event", ("pcie", 3), "hostagent.pcie.link_update", 900, attrs(episode_id=3)),
    ]
    assert spans.episodes == {3: [GPU0, 100, None]}


def test_a_close_of_an_episode_not_seen_opens_and_closes_it():
    spans, tel = spans_of(ep("closed", episode_id=4, start_ns=100, t_ns=900, end_ns=800))
    assert tel.calls == [
        ("open", ("pcie", 4), SpanSpec("hostagent.pcie.link_episode", 100, None, attrs(episode_id=4))),
        ("close", ("pcie", 4), attrs(episode_id=4), 800),
    ]
    assert spans.episodes == {4: [GPU0, 100, 800]}


def test_a_close_without_end_ends_at_its_record_time():
    spans, tel = spans_of(ep("opened"), ep("closed", t_ns=4_000, end_ns=None))
    assert tel.calls[-1] == ("close", ("pcie", 1), attrs(), 4_000)
    assert spans.episodes[1] == [GPU0, 1_000, 4_000]


def test_episodes_are_keyed_by_id():
    spans, tel = spans_of(ep("opened", episode_id=1, gpu=GPU0, start_ns=10),
                          ep("opened", episode_id=2, gpu=GPU1, start_ns=20),
                          ep("closed", episode_id=1, gpu=GPU0, start_ns=10, t_ns=30, end_ns=30))
    assert [(c[0], c[1]) for c in tel.calls] == [("open", ("pcie", 1)), ("open", ("pcie", 2)), ("close", ("pcie", 1))]
    assert spans.episodes == {1: [GPU0, 10, 30], 2: [GPU1, 20, None]}


# ---- KEEP_CLOSED and active() ----

def test_closed_episodes_beyond_keep_closed_are_forgotten_oldest_first():
    assert T.KEEP_CLOSED == 32
    tel = FakeTelemetry()
    spans = T.LinkEpisodeSpans(tel)
    spans.on_episode(ep("opened", episode_id=100, gpu=GPU1, start_ns=0))  # stays open throughout
    for i in range(1, T.KEEP_CLOSED + 1):
        spans.on_episode(ep("opened", episode_id=i, start_ns=i * 10))
        spans.on_episode(ep("closed", episode_id=i, start_ns=i * 10, t_ns=i * 10 + 5, end_ns=i * 10 + 5))
    assert not [c for c in tel.calls if c[0] == "forget"]  # exactly KEEP_CLOSED closed: all kept
    assert (len(spans.episodes), spans.active()) == (T.KEEP_CLOSED + 1, 1)
    for i in range(T.KEEP_CLOSED + 1, T.KEEP_CLOSED + 3):
        spans.on_episode(ep("opened", episode_id=i, start_ns=i * 10))
        assert spans.active() == 2
        spans.on_episode(ep("closed", episode_id=i, start_ns=i * 10, t_ns=i * 10 + 5, end_ns=i * 10 + 5))
    assert [c for c in tel.calls if c[0] == "forget"] == [("forget", ("pcie", 1)), ("forget", ("pcie", 2))]
    # each forget right after the close that pushed the count over
    assert [c[0] for c in tel.calls[-3:]] == ["open", "close", "forget"]
    assert sorted(spans.episodes) == [*range(3, T.KEEP_CLOSED + 3), 100]
    assert spans.active() == 1 and spans.episodes[100] == [GPU1, 0, None]


@pytest.mark.parametrize("events,active", [
    ([], 0),
    ([ep("opened", 1)], 1),
    ([ep("opened", 1), ep("opened", 2)], 2),
    ([ep("opened", 1), ep("updated", 1, t_ns=2_000), ep("opened", 2)], 2),
    ([ep("opened", 1), ep("opened", 2), ep("closed", 1, t_ns=3_000, end_ns=3_000)], 1),
    ([ep("opened", 1), ep("closed", 1, t_ns=3_000, end_ns=3_000)], 0),
])
def test_active(events, active):
    spans, _ = spans_of(*events)
    assert spans.active() == active


# ---- evidence: links to the episodes of the request's GPUs that overlap its window ----

def link(episode_id, bdf, t_ns) -> LinkSpec:
    return LinkSpec(("pcie", episode_id), {"hostagent.link.type": "pcie_link_episode", "hostagent.pcie.gpu_bdf": bdf},
                    EventSpec("hostagent.pcie.link_episode", t_ns, {"hostagent.pcie.gpu_bdf": bdf}), (None, "hostagent.pcie.span_id"))


@pytest.fixture
def two_gpus():
    """GPU0: episode 1 closed over [1000, 2000], episode 3 open since 5000; GPU1: episode 2 open since 1500."""
    spans, _ = spans_of(ep("opened", 1, GPU0, 1_000), ep("opened", 2, GPU1, 1_500),
                        ep("closed", 1, GPU0, 1_000, t_ns=2_000, end_ns=2_000), ep("opened", 3, GPU0, 5_000))
    return spans


@pytest.mark.parametrize("t0,t1,bdfs,links", [
    (1_200, 1_800, {GPU0}, [link(1, GPU0, 1_200)]),  # inside the closed one: the event at the request's start
    (500, 1_200, {GPU0}, [link(1, GPU0, 1_000)]),  # starts before it: the event at the episode's start
    (1_900, 2_500, {GPU0}, [link(1, GPU0, 1_900)]),  # ends after it: still overlaps
    (2_000, 4_000, {GPU0}, []),  # from the closed episode's end on: nothing
    (2_500, 4_000, {GPU0}, []),  # after its end, before the open one
    (0, 1_000, {GPU0}, []),  # ends as the episode starts: no overlap
    (4_000, 6_000, {GPU0}, [link(3, GPU0, 5_000)]),  # the open one
    (10**12, 10**12 + 1, {GPU0}, [link(3, GPU0, 10**12)]),  # an open episode overlaps any later window
    (1_200, 1_800, {GPU1}, [link(2, GPU1, 1_500)]),  # the other GPU's own episode only
    (4_000, 6_000, {GPU1}, [link(2, GPU1, 4_000)]),
    (1_200, 6_000, {GPU0, GPU1}, [link(1, GPU0, 1_200), link(2, GPU1, 1_500), link(3, GPU0, 5_000)]),
    (1_200, 6_000, set(), []),  # a request on no GPU
    (1_200, 6_000, {"0000:b3:00.0"}, []),  # a GPU without episodes
])
def test_evidence(two_gpus, t0, t1, bdfs, links):
    ev = two_gpus.evidence(t0, t1, bdfs)
    assert ev.links == tuple(links)
    assert (ev.attributes, ev.events) == ({}, ())


def test_evidence_of_a_forgotten_episode_is_gone():
    tel = FakeTelemetry()
    spans = T.LinkEpisodeSpans(tel)
    for i in range(1, T.KEEP_CLOSED + 2):
        spans.on_episode(ep("opened", episode_id=i, start_ns=i * 10))
        spans.on_episode(ep("closed", episode_id=i, start_ns=i * 10, t_ns=i * 10 + 5, end_ns=i * 10 + 5))
    assert spans.evidence(0, 16, {GPU0}).links == ()  # episode 1 [10, 15] forgotten
    assert spans.evidence(0, 26, {GPU0}).links == (link(2, GPU0, 20),)


def test_a_long_episode_that_closes_last_is_kept_and_still_linked():
    """Trimmed by their end, not their start: an episode open for long that closes after KEEP_CLOSED
    short ones is the one a request ending now overlaps; the oldest-ending short one goes instead."""
    tel = FakeTelemetry()
    spans = T.LinkEpisodeSpans(tel)
    spans.on_episode(ep("opened", episode_id=1, start_ns=0))
    for i in range(2, T.KEEP_CLOSED + 2):
        spans.on_episode(ep("opened", episode_id=i, start_ns=i * 10))
        spans.on_episode(ep("closed", episode_id=i, start_ns=i * 10, t_ns=i * 10 + 5, end_ns=i * 10 + 5))
    spans.on_episode(ep("closed", episode_id=1, start_ns=0, t_ns=10_000, end_ns=10_000))
    assert [c for c in tel.calls if c[0] == "forget"] == [("forget", ("pcie", 2))]
    assert [ln.key for ln in spans.evidence(9_000, 11_000, {GPU0}).links] == [("pcie", 1)]
