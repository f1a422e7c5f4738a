#!/usr/bin/env python3
"""What a request marker costs the serving thread, with and without the agent attached.

Measured side by side, interleaved by rounds (no agent / agent, then agent / no agent, ...; the agent
runs in this process, its tracepoints attached and detached between conditions, see _common.py):
  - a begin+end pair from Python (mcp_hostagent.marker.begin/end, ctypes) and from C (bench/loops.c,
    ioctl(-1, MCP_MARK_CMD, &m) with the struct from bpf/mcp_records.h);
  - the floor: one getppid() round trip into the kernel, from Python and C;
  - an ioctl that is not a marker (FIONREAD on a pipe): the agent's sys_enter_ioctl program runs on
    every ioctl of the host, and any syscall tracepoint puts every syscall on the traced slow path.
Markers go in batches (C 250 pairs, Python 125) with 50 ms pauses: 5,000 begins/s at most, under
the agent's default cap of 20,000 begins/s per process, and little enough for the agent to drain the
ring buffer, so that every pair takes the full path (map update + two ring buffer records). The
agent's lost counter is reported to show that it did, and its CPU time per request.

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
C_BATCH, PY_BATCH, PAUSE_S = 250, 125, 0.05  # at most 5,000 begins/s: under the cap, drained in time
CAP = 20000  # requests.max_begins_per_s_per_pid, default


def measure(binary: str, py: c.PyWorker, ag: c.ToggledAgent | None, nbatch: int) -> dict[str, float]:
    """One condition: the median over batches of each metric (the first marker batch, cold, is dropped)."""
    m: dict[str, float] = {}
    with c.Phase() as ph:
        # syscalls first: the agent is idle then, not handling the markers' records on the other CPU
        m["py_getppid"] = c.med(py.ask("getppid", GETPPID_BATCH, nbatch))
        m["c_getppid"] = c.med(c.loops(binary, "getppid", GETPPID_BATCH, nbatch))
        m["c_ioctl"] = c.med(c.loops(binary, "ioctl", GETPPID_BATCH, nbatch))
        m["py_pair"] = c.med(py.ask("pairs", PY_BATCH, nbatch + 1, PAUSE_S)[1:])
        m["c_pair"] = c.med(c.loops(binary, "marker", C_BATCH, nbatch + 1, int(PAUSE_S * 1e6))[1:])
        if ag:
            c.wait_idle()  # the agent's CPU for these requests is counted here, not in the next condition
    m["pairs"] = (PY_BATCH + C_BATCH) * (nbatch + 1)
    m["agent_cpu_s"], m["wall_s"] = ph.cpu_s, ph.wall_s
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
    ap.add_argument("--rounds", type=int, help="rounds of (no agent, agent); default 10, --quick 4")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    c.require_root()
    c.ensure_project_python()
    rounds = a.rounds or (4 if a.quick else 10)
    nbatch = 4 if a.quick else 6
    flood_s = 0.3 if a.quick else 0.5
    warn = c.other_load_warning()
    if warn:
        print(warn)
    binary = c.build_loops()
    print(f"bench_marker: {rounds} rounds, {nbatch} batches per condition; kernel {os.uname().release}")

    base: list[dict] = []
    agent: list[dict] = []
    guard = c.Guard(10.0 if a.quick else 30.0)
    with c.PyWorker() as py, c.ToggledAgent(watch="marked") as ag:
        for r in range(rounds):
            guard.before()
            for cond in (("none", "agent") if r % 2 == 0 else ("agent", "none")):
                if cond == "none":
                    base.append(measure(binary, py, None, nbatch))
                else:
                    with ag.attached():
                        agent.append(measure(binary, py, ag, nbatch))
            guard.after()
            print(f"  round {r + 1}/{rounds}: C pair {base[-1]['c_pair']:.0f} -> {agent[-1]['c_pair']:.0f} ns, "
                  f"Python pair {base[-1]['py_pair']:.0f} -> {agent[-1]['py_pair']:.0f} ns", flush=True)
        # the marker program's own run time, from the kernel's BPF statistics (a pass of its own: the
        # statistics cost two clock reads per run)
        prog = {}
        with c.bpf_run_stats(), ag.attached():
            for what, args in (("marker pairs, C", ("marker", C_BATCH, 2, int(PAUSE_S * 1e6))),
                               ("other ioctls, C", ("ioctl", GETPPID_BATCH, 2))):
                before = ag.prog_runs()
                c.loops(binary, *args)
                prog[what] = c.runs_delta(before, ag.prog_runs()).get("syscalls:sys_enter_ioctl", (0, float("nan")))
            c.wait_idle()
        time.sleep(0.5)  # let the agent finish the last records before its totals are taken
    session = ag.stats()

    results = {"machine": c.machine(), "rounds": rounds, "unclean_rounds": guard.clean.count(False),
               "warning": guard.note(), "rows": []}
    all_pairs = sum(x["pairs"] for x in agent)  # every round: the agent's counters cover them all
    base, agent = guard.pick(base), guard.pick(agent)
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
    results["bpf_prog_ns"] = {k: {"runs": n, "ns_per_run": t} for k, (n, t) in prog.items()}
    print("  sys_enter_ioctl program alone (kernel.bpf_stats_enabled): "
          + "; ".join(f"{k}: {t:.0f} ns per run ({n:,} runs)" for k, (n, t) in prog.items()))
    pairs = sum(x["pairs"] for x in agent)
    # CPU of the agent's threads over whole agent conditions (markers, then syscall loops), less what
    # the same threads burn in the no-agent conditions (idle polling, ticks, metric export)
    idle_cpu_s = sum(x["agent_cpu_s"] for x in base) / sum(x["wall_s"] for x in base)
    busy = sum(x["agent_cpu_s"] - idle_cpu_s * x["wall_s"] for x in agent)
    results.update(agent_session=session, pairs=pairs, agent_cpu_us_per_request=busy / pairs * 1e6,
                   agent_idle_cpu_pct=100 * idle_cpu_s)
    print(f"  agent: {all_pairs} pairs marked (+{2 * C_BATCH} in the statistics pass), "
          f"{session['requests']} requests ended, "
          f"{session['lost_kernel']} records lost in the kernel, {session['lost_user']} in user space; "
          f"agent CPU {busy / pairs * 1e6:.0f} us per request (its idle {100 * idle_cpu_s:.1f}% of a core taken off)")

    # the flood: back-to-back pairs from C, the agent at its default begin cap, in a session of its own
    flood: dict[str, list] = {"none": [], "agent": []}
    fguard = c.Guard(guard.budget_s)
    with c.ToggledAgent(watch="marked") as ag:
        for r in range(3):
            fguard.before()
            for cond in (("none", "agent") if r % 2 == 0 else ("agent", "none")):
                if cond == "none":
                    flood["none"].append(c.loops(binary, "flood", flood_s))
                else:
                    with ag.attached():
                        flood["agent"].append(c.loops(binary, "flood", flood_s))
                        c.wait_idle()  # the agent drains the ring buffer before the next condition
            fguard.after()
        time.sleep(0.5)
    fstats = ag.stats()
    fpairs = int(sum(x[0] for x in flood["agent"]))  # every round, as the agent's counters
    flood = {k: fguard.pick(v) for k, v in flood.items()}
    fr = [b[1] / a_[1] for a_, b in zip(flood["none"], flood["agent"])]
    results["flood"] = {"none_ns": c.med(x[1] for x in flood["none"]), "agent_ns": c.med(x[1] for x in flood["agent"]),
                        "ratio": c.med(fr), "ratio_spread": c.spread(fr), "pairs": fpairs, "agent_session": fstats}
    f = results["flood"]
    print(f"\nflood ({flood_s}s x 3 of back-to-back C pairs; cap {CAP:,} begins/s per process): "
          f"{f['none_ns']:.0f} -> {f['agent_ns']:.0f} ns per pair, ratio {f['ratio']:.2f} ({f['ratio_spread']})")
    print(f"  agent: {fpairs:,} pairs marked, {fstats['requests']:,} requests ended, "
          f"{fstats.get('begin_rate', 0):,} begins refused over the cap, "
          f"{fstats['lost_kernel']:,} records lost (ring buffer full); all counters: {fstats}")
    for note in (guard.note(), fguard.note() and "flood: " + fguard.note()):
        if note:
            print(note)
    results["warning"] = "; ".join(x for x in (guard.note(), fguard.note()) if x)
    results["summary"] = [
        {"what": r["label"], "unit": "ns/call", "none": r["none_ns"], "agent": r["agent_ns"],
         "added": r["added_ns"], "ratio": r["ratio"], "spread": r["ratio_spread"]} for r in results["rows"]
    ] + [
        {"what": "marker flood at the begin cap, C", "unit": "ns/pair", "none": f["none_ns"], "agent": f["agent_ns"],
         "added": f["agent_ns"] - f["none_ns"], "ratio": f["ratio"], "spread": f["ratio_spread"]},
        {"what": "agent CPU per marked request", "unit": "us", "none": None,
         "agent": results["agent_cpu_us_per_request"], "added": None, "ratio": None, "spread": ""},
    ]
    c.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
