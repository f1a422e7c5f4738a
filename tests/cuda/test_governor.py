"""agent/cuda/governor.py's pure rules other than plan_weights (tests/cuda/test_cuda_decode.py has those):
the window's rate estimates, who steers, the counted budget, and one launch probe's duty cycle (its
credit accounting and its turns), with a fake SymState-holding probe and fake attach / detach."""

from __future__ import annotations

import pytest

from mcp_hostagent.cuda import governor as gov
from mcp_hostagent.cuda.symbols import LAUNCH_FIELDS, SYMBOLS, SymState

L, LP, LX, LXP = LAUNCH_FIELDS  # cu_launch, cu_launch_ptsz, cu_launch_ex, cu_launch_ex_ptsz


def counts(launch=0, ptsz=0, ex=0, ex_ptsz=0) -> dict[str, int]:
    """One process's counter row as CudaProbes._control reads it from proc_stats: every launch field."""
    return {L: launch, LP: ptsz, LX: ex, LXP: ex_ptsz}


def rates(launch=0.0, ptsz=0.0, ex=0.0, ex_ptsz=0.0) -> dict[str, float]:
    return {L: launch, LP: ptsz, LX: ex, LXP: ex_ptsz}


# ---- window_rates ----

@pytest.mark.parametrize("prev,now,hits,per,old,expected", [
    # one process, host hits all its own: no unwatched rest; no old estimate: the window's rate as is
    ((10.0, 1_000, {1: counts(100, 0, 50, 0)}), 12.0, 1_300, {1: counts(300, 0, 150, 0)}, {},
     {1: rates(100.0, 0.0, 50.0, 0.0)}),
    # averaged with the last estimate, field by field
    ((10.0, 1_000, {1: counts(100, 0, 50, 0)}), 12.0, 1_300, {1: counts(300, 0, 150, 0)},
     {1: rates(60.0, 8.0, 10.0, 0.0)},
     {1: rates(80.0, 4.0, 30.0, 0.0)}),
    # host hits beyond the watched processes' (250/s vs 150/s): the rest is pid 0, calling the busiest
    # symbol (cu_launch here); a process new in this window counts from its first count (rate 0)
    ((10.0, 1_000, {1: counts(100, 0, 50, 0)}), 12.0, 1_500,
     {1: counts(300, 0, 150, 0), 2: counts(40, 0, 0, 0)},
     {1: rates(60.0, 0.0, 10.0, 0.0)},
     {1: rates(80.0, 0.0, 30.0, 0.0), 2: rates(), 0: rates(100.0)}),
    # host hits below the watched sum (scaled counts are estimates): no rest, never a negative one
    ((0.0, 0, {1: counts()}), 2.0, 100, {1: counts(400)}, {}, {1: rates(200.0)}),
    # no process watched: all of the host's rate is the rest, on the first field (ties: the first)
    ((5.0, 100, {}), 7.0, 700, {}, {}, {0: rates(300.0)}),
    # the rest is averaged with its last estimate too
    ((5.0, 100, {}), 7.0, 700, {}, {0: rates(100.0, 0.0, 20.0, 0.0)}, {0: rates(200.0, 0.0, 10.0, 0.0)}),
    # a process gone since prev is not estimated (its old estimate is not carried over): its hits in
    # the host count (30/s) are the unwatched rest's
    ((0.0, 0, {1: counts(10), 2: counts(10)}), 1.0, 30, {1: counts(30)}, {2: rates(5.0)},
     {1: rates(20.0), 0: rates(10.0)}),
])
def test_window_rates(prev, now, hits, per, old, expected):
    assert gov.window_rates(prev, now, hits, per, old) == expected


def test_window_rates_rest_takes_the_busiest_single_process_field():
    # pids 1 and 2 call cu_launch at 300/s each (600/s together), pid 3 cu_launch_ex_ptsz at 400/s: the
    # unwatched 100/s go to the symbol of the busiest single process, the latter
    got = gov.window_rates((0.0, 0, {1: counts(), 2: counts(), 3: counts()}), 2.0, 2_200,
                           {1: counts(600), 2: counts(600), 3: counts(ex_ptsz=800)}, {})
    assert got == {1: rates(300.0), 2: rates(300.0), 3: rates(ex_ptsz=400.0), 0: rates(ex_ptsz=100.0)}


# ---- steering ----

RATES = {0: rates(500.0), 5: rates(100.0), 7: rates(9_000.0), 9: rates(ex=3.0)}


@pytest.mark.parametrize("gpu_pids,auto_watch,steer", [
    ({5: {3: 1}, 9: {4: 1}}, True, [5, 9]),  # _fds: pid -> fd -> device; pid 7 has no NVIDIA fd
    ({5: {3: 1}, 9: {4: 1}}, False, [0, 5, 9]),  # marked-only watching: the unwatched rest steers too
    ({}, True, []),
    ({}, False, [0]),
    ({0, 7}, True, [7]),  # pid 0 is the rest, never a GPU user, whatever the set holds
    ({0, 7}, False, [0, 7]),
])
def test_steering(gpu_pids, auto_watch, steer):
    got = gov.steering(RATES, gpu_pids, auto_watch)
    assert sorted(got) == steer
    assert all(got[p] is RATES[p] for p in got)  # the rates themselves, unchanged


# ---- counted_budget ----

@pytest.mark.parametrize("budget,attach_s,slice_s,expected", [
    (0.02, 0.0, 0.2, 0.02),  # an instant attach: the whole budget counts
    (0.03, 0.05, 0.2, 0.024),  # a quarter slice trapping: budget / 1.25
    (0.02, 0.2, 0.2, 0.01),  # a whole slice trapping: half
    (0.1, 0.3, 0.1, 0.025),
])
def test_counted_budget(budget, attach_s, slice_s, expected):
    assert gov.counted_budget(budget, attach_s, slice_s) == pytest.approx(expected, rel=1e-12, abs=0)


# ---- one probe's duty cycle: fakes ----

def sym_state(credit=0.0, last_t=0.0, attached=False, on_since=None) -> SymState:
    st = SymState(SYMBOLS[0], addr=0x1000, state="attached", last_t=last_t)
    st.credit = credit
    if attached:
        st.events = ["entry-handle"]
        st.on_since = on_since
    return st


class FakeProbe:
    """The attach / detach callbacks CudaProbes hands turn(): attaching sets events and on_since (the
    attach call's end, when counting starts: attach_delay after the turn), detaching clears them and
    adds the counted on-time to attached_s, as CudaProbes._attach / _detach do."""

    def __init__(self, st: SymState, clock: list[float], attach_delay: float = 0.0, attach_ok: bool = True):
        self.st, self.clock, self.attach_delay, self.attach_ok = st, clock, attach_delay, attach_ok
        self.calls: list[tuple[str, float]] = []

    def attach(self) -> bool:
        self.calls.append(("attach", self.clock[0]))
        if not self.attach_ok:
            return False
        self.st.events = ["entry-handle"]
        self.st.on_since = self.clock[0] + self.attach_delay
        return True

    def detach(self) -> None:
        self.calls.append(("detach", self.clock[0]))
        if self.st.on_since is not None:
            self.st.attached_s += self.clock[0] - self.st.on_since
            self.st.on_since = None
        self.st.events = []


# ---- account / account_off_until ----

@pytest.mark.parametrize("credit,last_t,attached,k,now,expected", [
    (0.0, 10.0, False, 4, 12.0, 0.5),  # off: earns 1/k per second
    (0.5, 10.0, True, 4, 12.0, -1.0),  # on: earns 1/k, spends 1 per second: 0.5 + 2 * (0.25 - 1)
    (0.0, 10.0, False, 1, 10.5, 0.5),  # k = 1 earns a second per second
    (0.0, 10.0, True, 1, 10.5, 0.0),  # ... and spends it attached
    (0.25, 10.0, True, 2, 10.0, 0.25),  # no time passed
    (0.0, 0.0, True, 2, 100.0, -50.0),  # a long stall on: a debt
    (0.0, 0.0, True, 2, 200.0, -60.0),  # ... of at most a minute's
    (-60.0, 0.0, True, 2, 10.0, -60.0),
])
def test_account(credit, last_t, attached, k, now, expected):
    st = sym_state(credit, last_t, attached)
    gov.account(st, k, now)
    assert (st.credit, st.last_t) == (expected, now)


@pytest.mark.parametrize("credit,last_t,attached,k,t,expected", [
    (0.5, 5.0, False, 4, 5.5, 0.625),  # the attach call's time is off-time: earns 1/k, spends nothing
    (0.5, 5.0, True, 4, 5.5, 0.625),  # its events are set already: still nothing spent
    (0.0, 5.0, True, 2, 5.25, 0.125),
    (-0.5, 5.0, True, 1, 6.0, 0.5),
])
def test_account_off_until(credit, last_t, attached, k, t, expected):
    st = sym_state(credit, last_t, attached)
    gov.account_off_until(st, k, t)
    assert (st.credit, st.last_t) == (expected, t)


# ---- turn: one decision each ----

SLICE = 0.25  # with k = 2 the owed slice is 0.125 s: binary fractions, exact arithmetic


@pytest.mark.parametrize("case,st_kw,k,w,now,delay,attach_ok,nxt,calls,credit,last_t,attached", [
    # governor off / weight 1: attach if off, credit zeroed, next turn in a second
    ("k1 off: attach", dict(credit=5.0, last_t=9.0), 1, 1, 10.0, 0.0, True, 11.0, [("attach", 10.0)], 0.0, 10.0, True),
    ("k1 on: stays", dict(credit=-3.0, last_t=9.0, attached=True, on_since=9.0), 1, 1, 10.0, 0.0, True,
     11.0, [], 0.0, 10.0, True),
    # the governor off with a weight in cu_config (w = 4): exact, attached; the credit is zeroed anyway
    ("k1 w4 off: attach", dict(credit=0.0, last_t=9.0), 1, 4, 10.0, 0.0, True, 11.0, [("attach", 10.0)], 0.0, 10.0, True),
    # on, credit left after this turn's spending: next turn when it is spent at the net rate 1 - 1/k
    ("on, credit left", dict(credit=0.5, last_t=10.0, attached=True, on_since=10.0), 2, 2, 10.5, 0.0, True,
     11.0, [], 0.25, 10.5, True),
    # on, credit far from spent: the next turn within a second all the same
    ("on, much credit", dict(credit=10.0, last_t=10.0, attached=True, on_since=10.0), 2, 2, 10.5, 0.0, True,
     11.5, [], 9.75, 10.5, True),
    # on, spent: detach; off until a slice's worth (0.125) is owed: (0.125 + 0.25 debt) * k
    ("on, spent", dict(credit=0.25, last_t=10.0, attached=True, on_since=10.0), 2, 2, 11.0, 0.0, True,
     11.75, [("detach", 11.0)], -0.25, 11.0, False),
    # on, exactly spent (credit 0): detach
    ("on, exactly spent", dict(credit=0.25, last_t=10.0, attached=True, on_since=10.0), 2, 2, 10.5, 0.0, True,
     10.75, [("detach", 10.5)], 0.0, 10.5, False),
    # off, less than a slice's worth owed: next turn when it will be ((0.125 - 0.0625) * k)
    ("off, not owed", dict(credit=0.0, last_t=10.0), 2, 2, 10.125, 0.0, True, 10.25, [], 0.0625, 10.125, False),
    # off, a slice's worth owed: attach; the attach call (0.25 s) is off-time; on until the credit is spent
    ("off, owed: attach", dict(credit=0.0, last_t=10.0), 2, 2, 10.25, 0.25, True,
     11.0, [("attach", 10.25)], 0.25, 10.5, True),
    # ... an instant attach: on for the credit / (1 - 1/k)
    ("off, owed: instant attach", dict(credit=0.0, last_t=10.0), 2, 2, 10.25, 0.0, True,
     10.5, [("attach", 10.25)], 0.125, 10.25, True),
    # ... the attach failed: nothing changes but the accounting; next turn in a second
    ("off, owed: attach fails", dict(credit=0.0, last_t=10.0), 2, 2, 10.25, 0.0, False,
     11.25, [("attach", 10.25)], 0.125, 10.25, False),
    # the credit accrues at the weight in cu_config (w), the cycle runs at k: a weight change mid-way
    ("off, w != k", dict(credit=0.0, last_t=10.0), 2, 4, 10.25, 0.0, True, 10.375, [], 0.0625, 10.25, False),
])
def test_turn(case, st_kw, k, w, now, delay, attach_ok, nxt, calls, credit, last_t, attached):
    st = sym_state(**st_kw)
    fake = FakeProbe(st, [now], delay, attach_ok)
    got = gov.turn(st, k, w, SLICE, now, fake.attach, fake.detach)
    assert got == pytest.approx(nxt, rel=0, abs=1e-12)
    assert fake.calls == calls
    assert st.credit == pytest.approx(credit, rel=0, abs=1e-12)
    assert st.last_t == pytest.approx(last_t, rel=0, abs=1e-12)
    assert bool(st.events) == attached


# ---- turn: the duty cycle over time ----

MIN_WAIT = 0.002  # CudaProbes._run: the duty cycler waits at least this long between turns


def run_cycle(k: int, slice_s: float, attach_delay: float, until: float):
    """Turns at the times turn() asks for (at least MIN_WAIT apart, as the duty cycler's thread runs
    them: a turn may ask for one at its own time when the credit is short by a rounding error), from a
    fresh probe (off, no credit) at t = 0. Returns the probe's calls, its counted on-time (from each
    attach's end to its detach) and the end time."""
    st = sym_state()
    clock = [0.0]
    fake = FakeProbe(st, clock, attach_delay)
    while clock[0] < until:
        clock[0] = max(gov.turn(st, k, k, slice_s, clock[0], fake.attach, fake.detach), clock[0] + MIN_WAIT)
    if st.on_since is not None:
        fake.detach()
    return fake.calls, st.attached_s, clock[0]


@pytest.mark.parametrize("k", [2, 4, 10])
@pytest.mark.parametrize("attach_delay", [0.0, 0.05])
def test_duty_cycle_counts_one_kth_of_the_time(k, attach_delay):
    """On 1/k of the time, however long each attach call traps (its time is off-time): each hit
    counted k times estimates the true count. A turn late by MIN_WAIT leaves the probe on a little
    longer; the debt lengthens the next off-period k times as much, so the share holds."""
    slice_s = 0.2
    calls, _, _ = run_cycle(k, slice_s, attach_delay, until=60.0)
    attaches = [t for c, t in calls if c == "attach"]
    detaches = [t for c, t in calls if c == "detach"]
    assert [c for c, _ in calls] == ["attach", "detach"] * len(attaches)  # strictly alternating
    # the first attach once a slice's worth is owed: slice * (1 - 1/k) at 1/k per second
    assert attaches[0] == pytest.approx(slice_s * (k - 1), abs=MIN_WAIT + 1e-9)
    # every on-period counts the credit owed plus what the attach call earned (d / k at 1 - 1/k net)
    on_periods = [d - (a + attach_delay) for a, d in zip(attaches, detaches)][:-1]
    planned_on = slice_s + attach_delay / (k - 1)
    assert all(planned_on - 1e-9 <= p <= planned_on + 2 * MIN_WAIT + 1e-9 for p in on_periods), on_periods
    # every off-period (detach to the next attach call) earns a slice's worth, and pays back a late turn
    off_periods = [a - d for d, a in zip(detaches, attaches[1:])]
    planned_off = slice_s * (k - 1)
    assert all(planned_off - 1e-9 <= p <= planned_off + (k + 1) * MIN_WAIT + 1e-9 for p in off_periods), off_periods
    # over whole cycles (attach call to the next one) the counted share is 1/k
    share = sum(on_periods) / (attaches[-1] - attaches[0])
    assert share == pytest.approx(1 / k, rel=0.01)


def test_slow_detach_lengthens_the_next_off_time_not_the_count():
    """A detach that returns late (an RCU grace period): counting stopped as it began (last_t), so the
    time it takes is off-time, and the next attach is planned from its start."""
    k, slice_s = 2, 0.25
    st = sym_state(credit=0.125, last_t=1.0, attached=True, on_since=0.75)
    clock = [1.5]
    fake = FakeProbe(st, clock)

    def slow_detach():
        fake.detach()
        clock[0] += 0.25  # the detach call returns a quarter second later

    # 0.5 s on at a net -0.5/s spends 0.25 of the 0.125 credit: -0.125, detach
    nxt = gov.turn(st, k, k, slice_s, 1.5, fake.attach, slow_detach)
    assert fake.calls == [("detach", 1.5)]
    assert (st.credit, st.last_t) == (-0.125, 1.5)  # counting stopped as the close began
    assert nxt == 2.0  # (0.125 owed + 0.125 debt) * k from the detach's start, not its end (1.75)
    # at that turn a slice's worth is owed again: attach, on for 0.125 / (1 - 1/2)
    clock[0] = nxt
    nxt2 = gov.turn(st, k, k, slice_s, nxt, fake.attach, fake.detach)
    assert fake.calls[-1] == ("attach", 2.0)
    assert (st.credit, st.last_t, st.on_since, nxt2) == (0.125, 2.0, 2.0, 2.25)


def test_charged_cost_is_the_highest_of_the_last_calibrations():
    """A calibration that came out low must not lower the cost the weights are chosen by while a
    recent one was higher (the H200's starts: 330-1,070 ns); the oldest leaves after CALIBRATIONS_KEPT."""
    assert gov.charged_cost([700.0]) == 700.0
    assert gov.charged_cost([1070.0, 330.0, 600.0]) == 1070.0
    history = [2000.0] + [500.0] * gov.CALIBRATIONS_KEPT
    assert gov.charged_cost(history) == 500.0  # the high one is older than the last CALIBRATIONS_KEPT
    assert gov.charged_cost(history[:-1]) == 2000.0


def test_a_recalibration_applies_its_cost_to_the_weights_at_once(monkeypatch):
    """The H200's figures (tests/fixtures/cuda/h200_toggled_overhead_long.json, gov_start / gov_end):
    129,350 launches/s at 651.7 ns a hit -> weight 18 at the default budget; the charged cost then
    rose to 1,078.9 ns, which needs 29, while the weight stayed 18 until a control window completed
    (none did in that run: each resumed window was shorter than one). No kernel: CudaProbes with the
    probe-state tests' stand-in bcc object, the calibration replaced."""
    from test_probe_states import FakeBpf, add_library, cuda_probes
    from mcp_hostagent.cuda import probeset as cap
    from mcp_hostagent.cuda.calibrate import Calibration

    class Config(dict):  # cu_config as _set_cfg writes it: ctypes keys and values
        def __setitem__(self, k, v):
            super().__setitem__(k.value, v.value)

    cfg = Config()
    monkeypatch.setattr(FakeBpf, "__getitem__", lambda self, name: cfg, raising=False)
    cp, _ = cuda_probes(attaching=True)
    add_library(cp, "attached")
    lib_ = next(iter(cp.libs.values()))
    costs = iter([651.7, 1078.9])
    monkeypatch.setattr(cap, "calibrate_standin", lambda *a, **k: Calibration(next(costs), 0.0, "stand-in", 11))
    cp.budget, cp.attach_s, cp.slice_s = 0.005, 0.0031, 0.2
    cp._fds = {778: {}}  # a GPU user: it steers
    cp.rates = {778: {f: (129350.1 if f == "cu_launch" else 0.0) for f in gov.LAUNCH_FIELDS}}
    cp._calibrate(lib_)
    assert cp.weights["cu_launch"] == 18, cp.weights
    cp._calibrate(lib_)
    assert cp.calibration.cost_ns == 1078.9
    assert cp.weights["cu_launch"] == 29, cp.weights
    assert cp.weights["cu_launch_ex"] == 1  # not called: exact
    assert cfg[cap.LAUNCH_CFG["cu_launch"]] == 29  # and the kernel's copy, which scales the hits
