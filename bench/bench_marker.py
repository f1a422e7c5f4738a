#!/usr/bin/env python3
"""What a request marker costs the serving thread, with and without the agent attached.

Measured side by side, interleaved by rounds (no agent / agent, then agent / no agent, ...):
  - a begin+end pair from Python (mcp_hostagent.marker.begin/end, ctypes) and from C (bench/loops.c,
    ioctl(-1, MCP_MARK_CMD, &m) with the struct from bpf/mcp_records.h);
  - the floor: one getppid() round trip into the kernel, from Python and C;
  - an ioctl that is not a marker (FIONREAD on a pipe): the agent's sys_enter_ioctl program runs on
    every ioctl of the host, and any syscall tracepoint puts every syscall on the traced slow path.
Markers go in batches (C 1000 pairs, Python 500) with 100 ms pauses: 10,000 begins/s at most, under
the agent's default cap of 20,000 begins/s per process, and little enough for the ring buffer to
drain, so that every pair takes the full path (map update + two ring buffer records). The agent's
lost counter is reported to show that it did.

Then a flood: C pairs back to back for a moment, the agent at its default cap: what a runaway
marker loop costs, and that the agent sheds it (rejected, lost) instead of falling over.

    sudo .venv/bin/python bench/bench_marker.py [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

GETPPID_BATCH = 20000


def py_pairs(batch: int, nbatch: int, pause_s: float) -> list[float]:
    from mcp_hostagent import marker
    out = []
    rid = marker.new_request_id() & ~((1 << 32) - 1)
    for _ in range(nbatch):
        t0 = time.perf_counter_ns()
        for i in range(batch):
            marker.begin(rid + i)
            marker.end(rid + i)
        out.append((time.perf_counter_ns() - t0) / batch)
        rid += batch
        time.sleep(pause_s)
    return out


def py_getppid(batch: int, nbatch: int) -> list[float]:
    getppid = os.getppid
    out = []
    for _ in range(nbatch):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            getppid()
        out.append((time.perf_counter_ns() - t0) / batch)
    return out


def measure(binary: str, agent: c.AgentProc | None, nbatch: int) -> dict[str, float]:
    """One condition: the median over batches (the first batch, cold, is dropped) of each metric."""
    m: dict[str, float] = {}
    pairs = 0
    with c.Phase(agent) as ph:
        m["py_pair"] = c.med(py_pairs(500, nbatch + 1, 0.1)[1:])
        m["c_pair"] = c.med(c.loops(binary, "marker", 1000, nbatch + 1, 100000)[1:])
        pairs += 500 * (nbatch + 1) + 1000 * (nbatch + 1)
    if agent:
        m["agent_cpu_us_per_pair"] = ph.cpu_pct / 100 * ph.wall_s / pairs * 1e6
        m["agent_cpu_pct"] = ph.cpu_pct
    m["py_getppid"] = c.med(py_getppid(GETPPID_BATCH, nbatch))
    m["c_getppid"] = c.med(c.loops(binary, "getppid", GETPPID_BATCH, nbatch))
    m["c_ioctl"] = c.med(c.loops(binary, "ioctl", GETPPID_BATCH, nbatch))
    return m


ROWS = [  # key, label
    ("py_pair", "marker pair, Python (ctypes)"),
    ("c_pair", "marker pair, C"),
    ("py_getppid", "floor: getppid(), Python"),
    ("c_getppid", "floor: getppid(), C"),
    ("c_ioctl", "other ioctl (FIONREAD on a pipe), C"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (~20 s)")
    ap.add_argument("--rounds", type=int, help="rounds of (no agent, agent); default 5, --quick 3")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    c.require_root()
    c.ensure_project_python()
    rounds = a.rounds or (3 if a.quick else 5)
    nbatch = 4 if a.quick else 8
    flood_s = 0.3 if a.quick else 0.5
    warn = c.other_load_warning()
    if warn:
        print(warn)
    binary = c.build_loops()
    print(f"bench_marker: {rounds} rounds, {nbatch} batches per condition; kernel {os.uname().release}")

    base: list[dict] = []
    agent: list[dict] = []
    sessions: list[dict] = []
    for r in range(rounds):
        order = ("none", "agent") if r % 2 == 0 else ("agent", "none")
        for cond in order:
            if cond == "none":
                base.append(measure(binary, None, nbatch))
            else:
                with c.AgentProc(watch="marked") as ag:
                    agent.append(measure(binary, ag, nbatch))
                sessions.append(ag.stopped)
        print(f"  round {r + 1}/{rounds}: C pair {base[-1]['c_pair']:.0f} -> {agent[-1]['c_pair']:.0f} ns, "
              f"Python pair {base[-1]['py_pair']:.0f} -> {agent[-1]['py_pair']:.0f} ns", flush=True)

    results = {"machine": c.machine(), "rounds": rounds, "rows": []}
    rows = []
    for key, label in ROWS:
        ratios = [b[key] / a_[key] for a_, b in zip(base, agent)]
        added = [b[key] - a_[key] for a_, b in zip(base, agent)]
        row = {"key": key, "label": label, "none_ns": c.med(x[key] for x in base),
               "agent_ns": c.med(x[key] for x in agent), "added_ns": c.med(added),
               "ratio": c.med(ratios), "ratio_spread": c.spread(ratios)}
        results["rows"].append(row)
        rows.append([label, row["none_ns"], row["agent_ns"], row["added_ns"], row["ratio"], row["ratio_spread"]])
    c.print_table("cost per call, ns (median over rounds; ratio = agent / no agent, median of per-round ratios)",
                  ["what", "no agent", "agent", "added", "ratio", "ratio spread"], rows)
    lost = sum(s.get("lost_kernel", 0) + s.get("lost_user", 0) for s in sessions)
    reqs = sum(s.get("requests", 0) for s in sessions)
    cpu_us = c.med(x["agent_cpu_us_per_pair"] for x in agent)
    results.update(requests_seen=reqs, lost=lost, agent_cpu_us_per_pair=cpu_us,
                   agent_cpu_pct=c.med(x["agent_cpu_pct"] for x in agent))
    print(f"  agent: {reqs} requests ended in {len(sessions)} sessions, {lost} records lost; agent CPU "
          f"{cpu_us:.1f} us per request (user+system, all its threads; "
          f"{results['agent_cpu_pct']:.0f}% of a core while 10k requests/s arrive)")

    # the flood: back-to-back pairs from C, the agent at its default begin cap
    flood = {"none": [], "agent": []}
    stats = {}
    for r in range(2):
        for cond in (("none", "agent") if r == 0 else ("agent", "none")):
            if cond == "none":
                flood["none"].append(c.loops(binary, "flood", flood_s)[1])
            else:
                with c.AgentProc(watch="marked") as ag:
                    with c.Phase(ag) as ph:
                        pairs, ns = c.loops(binary, "flood", flood_s)
                    flood["agent"].append(ns)
                stats = dict(ag.stopped, pairs=int(pairs), agent_cpu_pct=ph.cpu_pct)
    fr = [b / a_ for a_, b in zip(flood["none"], flood["agent"])]
    results["flood"] = {"none_ns": c.med(flood["none"]), "agent_ns": c.med(flood["agent"]),
                        "ratio": c.med(fr), "ratio_spread": c.spread(fr), "last_session": stats}
    print(f"\nflood ({flood_s}s of back-to-back C pairs, default cap 20,000 begins/s per process): "
          f"{results['flood']['none_ns']:.0f} -> {results['flood']['agent_ns']:.0f} ns per pair, ratio "
          f"{results['flood']['ratio']:.2f} ({results['flood']['ratio_spread']}); last agent session: "
          f"{stats.get('pairs')} pairs, {stats.get('requests')} requests ended, {stats.get('rejected')} rejected, "
          f"{stats.get('lost_kernel')} lost in the kernel, agent CPU {stats.get('agent_cpu_pct', 0):.0f}% of a core")
    c.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
