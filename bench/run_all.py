#!/usr/bin/env python3
"""Run every bench/bench_*.py in turn, then print one summary table.

    sudo .venv/bin/python bench/run_all.py [--quick] [--only NAME ...] [--json PATH]   (or: sudo make bench)

The hot-path benchmarks (marker, faults, cuda, reclaim) interleave their conditions and report ratios
measured side by side in one run; startup, latency and footprint time the agent itself (start and stop,
event-to-span latency, its CPU and memory). docs/PERFORMANCE.md explains each method; this script only
sequences them and collects their --json results. Needs root: the benchmarks load BPF programs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402


def fmt(v, spec: str | None = None) -> str:
    if v is None or v == "":
        return "-"
    if not isinstance(v, (int, float)):
        return str(v)
    return (spec or ("{:,.0f}" if abs(v) >= 1000 else "{:.4g}")).format(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs: about four minutes in all")
    ap.add_argument("--only", action="append", help="run only this bench (e.g. marker); repeatable")
    ap.add_argument("--json", help="also write every benchmark's results, by name, to this file")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("error: bench/run_all.py must run as root (the benchmarks load BPF programs); "
                 "HINT: sudo .venv/bin/python bench/run_all.py")
    c.ensure_project_python()
    benches = sorted(c.BENCH.glob("bench_*.py"))
    if a.only:
        benches = [b for b in benches if b.stem[len("bench_"):] in a.only]
    if not benches:
        sys.exit("error: no bench/bench_*.py matched")
    m = c.machine()
    print(f"run_all: {len(benches)} benchmarks{' (quick)' if a.quick else ''}; {m['date']}, kernel {m['kernel']}, "
          f"{m['cpus']} CPUs, commit {m['commit'] or '?'}", flush=True)
    summary, failed, warnings, everything = [], [], [], {}
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mcp-bench-") as tmp:
        for b in benches:
            out = Path(tmp) / f"{b.stem}.json"
            cmd = [sys.executable, str(b), "--json", str(out)] + (["--quick"] if a.quick else [])
            print(f"\n=== {b.name} ===", flush=True)
            t0 = time.monotonic()
            rc = subprocess.run(cmd, cwd=str(c.REPO)).returncode
            secs = time.monotonic() - t0
            if rc != 0 or not out.exists():
                failed.append(f"{b.name} (exit {rc})")
                continue
            res = json.loads(out.read_text())
            everything[b.stem[len("bench_"):]] = {**res, "seconds": secs}
            for row in res.get("summary", []):
                summary.append([b.stem[len("bench_"):], row["what"], row["unit"], fmt(row["none"]), fmt(row["agent"]),
                                fmt(row["added"], "{:,.0f}"), fmt(row["ratio"], "{:.3f}"), fmt(row["spread"])])
            if res.get("warning"):
                warnings.append(f"{b.stem[len('bench_'):]}: {res['warning']}")
            print(f"({b.name}: {secs:.0f} s)")
    c.print_table(f"summary ({time.monotonic() - t_all:.0f} s; baseline: no agent, or probes detached; ratio = "
                  "agent / baseline, median of per-round ratios; added: ns per call, or the storm's CPU ns per event)",
                  ["bench", "what", "unit", "baseline", "agent", "added ns", "ratio", "spread"], summary)
    for w in warnings:
        print(w)
    c.write_json(a.json, {"machine": m, "quick": a.quick, "benches": everything, "failed": failed})
    if failed:
        print("FAILED: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
