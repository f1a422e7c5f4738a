"""The launch-probe governor's rules: rate estimates, who steers, the weights, and each probe's duty cycle.

Every control window the launch rate of each process is estimated per symbol from the (scaled) counts,
and host-wide for processes not watched (as one process) (window_rates); when the busiest process's
rate x cost (the calibration, calibrate.py) exceeds the budget, each busy cuLaunchKernel* symbol gets a
weight k (plan_weights): its probe is attached 1/k of the time and each hit counts k (the kernel reads
cu_config), the counters marked `sampled`. A symbol that is hardly called costs nothing and stays
attached and exact. Only GPU users steer the weights (steering).
Each (library, symbol) keeps an on-time credit: it earns 1/k per second, spends 1 per second while
attached; the probe goes on when a slice's worth is owed and off when the credit is spent (turn). So a
slow detach (a perf-event uprobe waits out an RCU-tasks grace period, ~0.1-0.2 s in these VMs,
serialised by the kernel; a uprobe_multi link a few ms) lengthens the next off-time instead of biasing
the count, and a weight change carries the credit over.
Each attach traps for its own duration (~10 ms) before the program counts: the weights are chosen for
the budget less that share of a slice (counted_budget).
The scaled counts assume the probe does not change the launch rate; a launch-bound thread runs slower
while attached, so its count is low by about its on-slice overhead share (governor_status()
`attached_overhead`).

Pure functions on rates and on one probe's SymState; CudaProbes (capability.py) holds the state, the
locks and the threads, reads the counters and attaches and detaches.
"""

from __future__ import annotations

import math
from typing import Callable

from .symbols import LAUNCH_FIELDS, SymState


def plan_weights(rates: dict[int, dict[str, float]], cost_ns: float, budget: float,
                 current: dict[str, int] | None = None, max_weight: int = 1000) -> dict[str, int]:
    """Weights per launch symbol so that every process's probe overhead stays within budget.

    rates: pid -> launch symbol -> hits/s (estimates of the true rate). A symbol is busy when some
    process calls it at a cost of at least budget/8; busy symbols share one weight k, chosen for the
    busiest process: k = its busy overhead / (budget - its overhead from the exact ones). The weight goes
    up at once and down only with 50% headroom, so that it does not flap at the edge."""
    current = current or {}
    c = cost_ns * 1e-9
    busy = {f for f in LAUNCH_FIELDS if any(r.get(f, 0.0) * c >= budget / 8 for r in rates.values())}
    need = 0.0
    for r in rates.values():
        duty = sum(r.get(f, 0.0) for f in busy) * c
        exact = sum(r.get(f, 0.0) for f in LAUNCH_FIELDS if f not in busy) * c
        need = max(need, duty / max(budget - exact, budget / 8))
    k = max(1, min(max_weight, math.ceil(need - 1e-9)))
    held = max((current.get(f, 1) for f in busy), default=1)
    if k < held and math.ceil(need * 1.5 - 1e-9) >= held:
        k = held
    return {f: (k if f in busy else 1) for f in LAUNCH_FIELDS}


def window_rates(prev: tuple[float, int, dict[int, dict[str, int]]], now: float, hits: int,
                 per: dict[int, dict[str, int]], old: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """Each process's launch rates per symbol over the window since prev = (time, host-wide hits, per
    process counts), from the counts now: hits (host-wide launch hits) and per (pid -> launch symbol ->
    count); averaged with the last estimate old. Needs now > prev's time."""
    dt = now - prev[0]
    rates = {p: {f: (n[f] - prev[2].get(p, n)[f]) / dt for f in LAUNCH_FIELDS} for p, n in per.items()}
    # counts are scaled in the kernel: estimates of the true rates; the rest of the host's hits are
    # of processes not watched, taken as one process calling the busiest symbol
    rest = max(0.0, (hits - prev[1]) / dt - sum(sum(r.values()) for r in rates.values()))
    if rest > 0:
        top = max(LAUNCH_FIELDS, key=lambda f: max((r[f] for r in rates.values()), default=0.0))
        rates[0] = {f: (rest if f == top else 0.0) for f in LAUNCH_FIELDS}
    # half of the last estimate: a window holds few duty cycles, its count is noisy
    return {p: {f: (r[f] + old[p][f]) / 2 if p in old else r[f] for f in LAUNCH_FIELDS}
            for p, r in rates.items()}


def steering(rates: dict[int, dict[str, float]], gpu_pids, auto_watch: bool) -> dict[int, dict[str, float]]:
    """The rates that set the shared weights. Only GPU users steer (gpu_pids: those with a /dev/nvidia*
    fd): a process that calls cuLaunchKernel without a context (no /dev/nvidia* fd: cuInit opens
    nvidiactl) would otherwise duty-cycle, and so blind, every real GPU process. The unwatched rest
    (pid 0) steers only where GPU processes are not watched (process.watch = marked: not auto_watch)."""
    return {p: r for p, r in rates.items() if (p in gpu_pids if p else not auto_watch)}


def counted_budget(budget: float, attach_s: float, slice_s: float) -> float:
    """The budget for the probes' counted time: each attach traps for attach_s before it counts."""
    return budget / (1 + attach_s / slice_s)


# ---- one launch probe's duty cycle ----
def account(st: SymState, k: int, now: float) -> None:
    """The on-time credit earned (1/k per second) and spent (1 per second attached) up to now."""
    st.credit += (now - st.last_t) * (1.0 / k - (1.0 if st.events else 0.0))
    st.credit = max(st.credit, -60.0)  # a debt from a long stall is paid back within a minute
    st.last_t = now


def account_off_until(st: SymState, k: int, t: float) -> None:
    """The attach call itself: off until its end (its events are set already)."""
    st.credit += (t - st.last_t) / k
    st.last_t = t


def turn(st: SymState, k: int, w: int, slice_s: float, now: float,
         attach: Callable[[], bool], detach: Callable[[], None]) -> float:
    """One launch probe's turn at now: attach or detach it if due; when its next turn is.

    k: the weight in force (1 with the governor off); w: the probe's weight in cu_config, at which its
    credit accrues. attach(): attach it, True when attached (st.on_since set); detach(): detach it."""
    nxt = now + 1.0
    t = nxt - 1.0
    account(st, w, t)
    if k == 1:
        st.credit = 0.0
        if not st.events:
            attach()
        return nxt
    if st.events:
        if st.credit <= 0:  # spent: off until a slice's worth is owed again
            detach()  # counting stops as the close begins (st.last_t)
            st.last_t = t
            nxt = min(nxt, t + (slice_s * (1 - 1 / k) - st.credit) * k)
        else:
            nxt = min(nxt, t + st.credit / (1 - 1 / k))
    else:
        owed = slice_s * (1 - 1 / k)
        if st.credit >= owed:
            if attach():
                account_off_until(st, w, st.on_since)
                nxt = min(nxt, st.on_since + st.credit / (1 - 1 / k))
        else:
            nxt = min(nxt, t + (owed - st.credit) * k)
    return nxt


CALIBRATIONS_KEPT = 5
RECALIBRATE_S = 60.0  # a calibration: ~0.5 s of the finder thread on the H200 (attach/detach waits), ~0.1 s of CPU


def charged_cost(costs: list[float], kept: int = CALIBRATIONS_KEPT) -> float:
    """The per-hit cost the weights are chosen by: the highest of the last `kept` calibrations. A trap's
    cost moves with the host's state between calibrations (the H200's starts: 330-1,070 ns; 20 runs
    here: 12.8-20.0 us, each run's rounds alike), and a low one would let the probes cost a multiple
    of the budget; a high one costs coverage, not time."""
    return max(costs[-kept:])
