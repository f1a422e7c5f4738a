#!/usr/bin/env python3
"""What the agent's high-rate probes cost: a page-fault storm, a context-switch storm and a page-cache storm.

Page faults (exceptions:page_fault_user runs on every user fault of the host): a child process
(bench/loops.c `faults`, pinned to one CPU) mmaps 64 MiB anonymous with MADV_NOHUGEPAGE, writes one
byte per 4 KiB page (one first-touch fault each) and munmaps, over and over; faults/s is the
throughput, checked against the kernel's minor-fault count. Conditions:
  a   no agent
  b0  agent --watch marked, the storm process not watched: the probe runs and finds nothing to count
  b   agent --watch all: per-process counters
  c   agent --watch all, the storm inside a marked request: per-request and per-process counters
Context switches (sched:sched_switch runs on every switch): two processes ping-pong one byte through
two pipes, pinned to one CPU: each round trip is two switches and nothing runs between them, the
highest switch rate one CPU can make. (Left to the scheduler on two CPUs the pair is bimodal, now on
one CPU, now on two with an IPI per wake-up, and its rate swings by 3x between runs here.)
Page-cache insertions (filemap:mm_filemap_add_to_page_cache runs on every page the host's page cache
gains): a child (bench/loops.c `pagecache`, pinned) drops a 32 MiB file beside this script from the
cache and reads it back, over and over; pages read per second is the throughput, checked against
/proc/self/io read_bytes. It is bound by this VM's virtual disk, so its ratios are noisier.

Both agents (watch=all, watch=marked) are started once, in this process, and their tracepoints are
attached only for the conditions that need them (see _common.ToggledAgent). Each round runs every
condition in turn, grouped by the agent it needs (the order reverses every round). Reported: the
median of per-round ratios to (a) and their spread; the added cost per event, 1/rate_x - 1/rate_a,
and the same from the storm's own CPU time; the agent's CPU (its threads' utime+stime) during the
storms, in % of one core; and, from one pass with kernel.bpf_stats_enabled, each program's own time.

    sudo .venv/bin/python bench/bench_faults.py [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

MIB = 64
PIN_CPU = 1  # the storms' CPU (fewer migrations, less spread); the agent and the rest may still run there

# name -> (agent --watch or None, loops arguments after the duration)
FAULTS = {
    "a": (None, ("faults", MIB, 0, PIN_CPU)),
    "b0": ("marked", ("faults", MIB, 0, PIN_CPU)),
    "b": ("all", ("faults", MIB, 0, PIN_CPU)),
    "c": ("all", ("faults", MIB, 1, PIN_CPU)),
}
SWITCHES = {
    "a": (None, ("pingpong", 0, PIN_CPU)),
    "b0": ("marked", ("pingpong", 0, PIN_CPU)),
    "b": ("all", ("pingpong", 0, PIN_CPU)),
    "c": ("all", ("pingpong", 1, PIN_CPU)),
}
PAGECACHE = {
    "a": (None, ("pagecache", "FILE", 0, PIN_CPU)),
    "b0": ("marked", ("pagecache", "FILE", 0, PIN_CPU)),
    "b": ("all", ("pagecache", "FILE", 0, PIN_CPU)),
    "c": ("all", ("pagecache", "FILE", 1, PIN_CPU)),
}
PAGECACHE_MIB = 32
LABELS = {
    "a": "a  no agent",
    "b0": "b0 agent, process not watched",
    "b": "b  agent, watch=all",
    "c": "c  agent, watch=all, in a request",
}


def run_storm(binary: str, seconds: float, args: tuple) -> dict:
    with c.Phase() as ph:
        events, wall, check, cpu = c.loops(binary, args[0], seconds, *args[1:])
    if args[0] == "faults" and not 0.98 * events <= check <= 1.05 * events:
        # the kernel's own count must agree: one minor fault per page touched, no THP
        raise RuntimeError(f"fault storm: {events:.0f} pages touched but {check:.0f} minor faults")
    if args[0] == "pagecache" and not 0.98 * events <= check <= 1.05 * events:
        # every page read must have come from the storage layer: dropped, not still cached
        raise RuntimeError(f"page-cache storm: {events:.0f} pages read but {check:.0f} read from storage")
    # check: faults, the kernel's minor fault count; switches, voluntary + involuntary of both processes;
    # pagecache, the pages the kernel read from storage
    return {"rate": check / wall, "cpu_ns": cpu / check * 1e9, "agent_cpu_s": ph.cpu_s, "wall_s": ph.wall_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (~25 s)")
    ap.add_argument("--rounds", type=int, help="rounds over all conditions; default 16, --quick 6")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    c.require_root()
    c.ensure_project_python()
    warn = c.other_load_warning()
    if warn:
        print(warn)
    binary = c.build_loops()
    # on the checkout's filesystem (a block device): a tmpfs file has no storage to drop it to
    scratch = tempfile.mkdtemp(prefix=".bench-pagecache-", dir=os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(scratch, "file.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(PAGECACHE_MIB << 20))
        os.fsync(f.fileno())
    try:
        return _run(a, binary, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(a, binary: str, path: str) -> int:
    rounds = a.rounds or (6 if a.quick else 16)
    fault_s = 0.12 if a.quick else 0.2
    switch_s = 0.1 if a.quick else 0.15
    print(f"bench_faults: {rounds} rounds; fault storms {fault_s}s of {MIB} MiB mmap/touch/munmap, "
          f"ping-pong {switch_s}s, page-cache reads {fault_s}s of a {PAGECACHE_MIB} MiB file; "
          f"kernel {os.uname().release}")

    work = [("faults", k, w, args, fault_s) for k, (w, args) in FAULTS.items()]
    work += [("switches", k, w, args, switch_s) for k, (w, args) in SWITCHES.items()]
    work += [("pagecache", k, w, tuple(path if x == "FILE" else x for x in args), fault_s)
             for k, (w, args) in PAGECACHE.items()]
    res: dict[tuple[str, str], list[dict]] = {}
    guard = c.Guard(10.0 if a.quick else 30.0)
    with c.ToggledAgent("all") as ag_all, c.ToggledAgent("marked") as ag_marked:
        agents = {None: None, "all": ag_all, "marked": ag_marked}
        # conditions grouped by the agent they need: a detach costs ~0.5 s (RCU grace periods)
        groups = [[x for x in work if x[2] == w] for w in agents]
        for r in range(rounds):
            guard.before()
            for items in (groups if r % 2 == 0 else [g[::-1] for g in groups[::-1]]):
                ag = agents[items[0][2]]
                with (ag.attached() if ag else contextlib.nullcontext()):
                    for kind, key, _, args, secs in items:
                        res.setdefault((kind, key), []).append(run_storm(binary, secs, args))
            guard.after()
            fa, fb = res[("faults", "a")][-1]["rate"], res[("faults", "b")][-1]["rate"]
            sa, sb = res[("switches", "a")][-1]["rate"], res[("switches", "b")][-1]["rate"]
            print(f"  round {r + 1}/{rounds}: faults/s {fa:,.0f} -> {fb:,.0f} (watch=all); "
                  f"switches/s {sa:,.0f} -> {sb:,.0f}", flush=True)
        stats = {"all": ag_all.stats(), "marked": ag_marked.stats()}
        # the programs' own run time, per run, from the kernel's BPF statistics (a separate pass:
        # the statistics cost two clock reads per run)
        prog = {}
        with c.bpf_run_stats():
            for kind, key, watch, args, secs in work:
                ag = agents[watch]
                if ag is None:
                    continue
                with ag.attached():
                    before = ag.prog_runs()
                    run_storm(binary, secs, args)
                    prog[(kind, key)] = c.runs_delta(before, ag.prog_runs())

    results = {"machine": c.machine(), "rounds": rounds, "unclean_rounds": guard.clean.count(False),
               "warning": guard.note(), "agent_sessions": stats}
    res = {k: guard.pick(v) for k, v in res.items()}
    for kind, table, unit in (("faults", FAULTS, "fault"), ("switches", SWITCHES, "switch"),
                              ("pagecache", PAGECACHE, "page")):
        rows, out = [], []
        for key in table:
            base_key = "a"
            xs, base = res[(kind, key)], res[(kind, base_key)]
            ratios = [x["rate"] / b["rate"] for x, b in zip(xs, base)]
            added = [(1 / x["rate"] - 1 / b["rate"]) * 1e9 for x, b in zip(xs, base)]
            added_cpu = [x["cpu_ns"] - b["cpu_ns"] for x, b in zip(xs, base)]
            row = {"key": key, "label": LABELS[key], "rate": c.med(x["rate"] for x in xs),
                   "ratio": c.med(ratios), "ratio_spread": c.spread(ratios),
                   "added_ns": None if key == base_key else c.med(added),
                   "cpu_ns": c.med(x["cpu_ns"] for x in xs),
                   "added_cpu_ns": None if key == base_key else c.med(added_cpu),
                   "added_cpu_spread": None if key == base_key else c.spread(added_cpu),
                   # over all of the condition's storms: one storm is too short for 10 ms CPU ticks
                   "agent_cpu_pct": None if key == base_key else
                   100 * sum(x["agent_cpu_s"] for x in xs) / sum(x["wall_s"] for x in xs)}
            out.append(row)
            dash = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
            rows.append([row["label"], f"{row['rate']:,.0f}", row["ratio"], row["ratio_spread"],
                         dash(row["added_ns"], "{:.0f}"), f"{row['cpu_ns']:.0f}", dash(row["added_cpu_ns"], "{:.0f}"),
                         dash(row["added_cpu_spread"], "{}"), dash(row["agent_cpu_pct"], "{:.1f}")])
        results[kind] = out
        c.print_table(f"{kind}: medians over rounds; ratio = rate / rate of no agent, per round; "
                      f"added = 1/rate - 1/rate(no agent), per round; CPU = the storm's own CPU time per {unit}",
                      ["condition", f"{unit}es/s" if unit == "switch" else f"{unit}s/s", "ratio", "spread",
                       "added ns", f"CPU ns/{unit}", "added CPU ns", "spread", "agent CPU %"], rows)
    print("  agent CPU %: the agent's threads during that condition's storms, all rounds together, % of one core")
    hot = {"faults": "exceptions:page_fault_user", "switches": "sched:sched_switch",
           "pagecache": "filemap:mm_filemap_add_to_page_cache"}
    rows = []
    results["bpf_prog_ns"] = {}
    for (kind, key), d in prog.items():
        runs, ns = d.get(hot[kind], (0, float("nan")))
        results["bpf_prog_ns"][f"{kind}:{key}"] = {tp: {"runs": n, "ns_per_run": t} for tp, (n, t) in d.items()}
        rows.append([f"{kind}: {LABELS[key][3:]}", hot[kind], f"{runs:,}", f"{ns:.0f}"])
    c.print_table("the agent's BPF programs alone: ns per run (kernel.bpf_stats_enabled, one storm each; "
                  "the tracepoint's own dispatch is not in it)", ["storm", "program", "runs", "ns/run"], rows)
    print(f"  agent sessions (requests ended, records lost): "
          + "; ".join(f"watch={w}: {st['requests']}, {st['lost_kernel'] + st['lost_user']}" for w, st in stats.items()))
    if guard.note():
        print(guard.note())
    results["summary"] = []
    for kind, unit in (("faults", "faults/s"), ("switches", "switches/s"), ("pagecache", "pages/s")):
        rows = results[kind]
        for r in rows[1:]:
            results["summary"].append({
                "what": f"{kind}: {r['label'][3:]}", "unit": unit, "none": rows[0]["rate"], "agent": r["rate"],
                "added": r["added_cpu_ns"], "ratio": r["ratio"], "spread": r["ratio_spread"]})
    c.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
