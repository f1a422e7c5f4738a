#!/usr/bin/env python3
"""What the CUDA probes cost a launching thread, on a stand-in libcuda (tests/c/fake_libcuda.c).

Measured side by side, interleaved by rounds (the order rotates each round), in one run:
  - the per-call cost of cuLaunchKernel (a 1 ns function) from a C loop (tests/c/cuda_driver.c `loop`):
    no probe / an empty bcc uprobe (`return 0`, the floor: the trap) / our cu_launch program (the
    process watched, unmarked thread: the full path) / ours inside a marked request. Target: ours
    <= 1.1x the floor, per call including the trap;
  - a launch-bound loop (WORK ns of spinning per launch, a PyTorch-op-like cadence) with the governor
    at a 2% budget (the default is 0.5%; 2% keeps the duty cycle measurable here) vs no probe: the slowdown (target: within budget), the duty cycle it chose,
    and its scaled launch count against the loop's own.
The agent's unit is compiled with only the cuda.bpf.c probes; agent/cuda/capability.py attaches them as the agent
does. The governor's windows hold a few duty cycles each (weight x 0.1 s); its scaled count is low by
about the probe's share of an attached slice, because this loop is launch-bound (agent/cuda/capability.py).

    sudo .venv/bin/python bench/bench_cuda.py [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

SRC = c.REPO / "tests" / "c"
WORK_NS = 20000  # launch-bound loop: spin per launch (PyTorch eager ops took 10-13 us each on the H200)


def build() -> tuple[str, str]:
    """The fake libcuda and the driver, compiled once per source version."""
    hdr = c.REPO / "bpf" / "mcp_records.h"
    srcs = [SRC / "fake_libcuda.c", SRC / "cuda_driver.c", hdr]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in srcs)).hexdigest()[:12]
    d = Path(tempfile.gettempdir()) / f"mcp-bench-cuda-{digest}"
    lib, drv = d / "libcuda.so.1", d / "cuda_driver"
    if not drv.exists():
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            sys.exit("error: no C compiler (gcc) found; HINT: apt-get install gcc")
        tmp = Path(tempfile.mkdtemp(prefix="mcp-bench-cuda-"))
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-fno-ipa-icf", "-o", str(tmp / lib.name),
                        str(SRC / "fake_libcuda.c"), "-lpthread"], check=True)
        subprocess.run([cc, "-O2", f"-I{hdr.parent}", "-o", str(tmp / drv.name), str(SRC / "cuda_driver.c"),
                        "-ldl", "-lpthread"], check=True)
        try:
            tmp.rename(d)
        except OSError:  # built meanwhile by another run
            shutil.rmtree(tmp, ignore_errors=True)
    return str(lib), str(drv)


class Driver:
    def __init__(self, drv: str, lib: str):
        self.p = subprocess.Popen([drv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.p.pid
        self.do(f"lib {lib}")

    def do(self, cmd: str) -> list[float]:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline().split()
        if not out or out[0] != "ok":
            raise RuntimeError(f"driver: {cmd!r} -> {out}")
        return [float(x) for x in out[1:]]

    def close(self) -> None:
        self.p.stdin.write("exit\n")
        self.p.stdin.flush()
        self.p.wait(10)


def load_cuda_unit():
    """The agent's unit with only the CUDA probes, as the agent compiles it."""
    from mcp_hostagent.core import kernel
    from mcp_hostagent.core import loader
    from mcp_hostagent.registry import UNIT
    from mcp_hostagent.core import probes

    kernel.ensure_tracefs()
    hc = kernel.find_kernel_headers()
    if hc.bcc_kernel_source:
        os.environ["BCC_KERNEL_SOURCE"] = hc.bcc_kernel_source
    plan = UNIT.plan(disabled=[p.name for p in UNIT.probes if p.program != "cuda.bpf.c"])
    loaded = loader.load(UNIT, plan, {})
    if not loaded:
        sys.exit(f"error: the CUDA unit did not load: {[s.reason for s in plan.missing()][:1]}")
    return loaded[0].bpf, plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (~40 s)")
    ap.add_argument("--rounds", type=int, help="rounds; default 8, --quick 3")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    c.require_root()
    c.ensure_project_python()
    from bcc import BPF

    from mcp_hostagent.cuda import probeset as cuda
    from mcp_hostagent.cuda import uprobes
    from mcp_hostagent.cuda.calibrate import calibrate_standin

    rounds = a.rounds or (3 if a.quick else 8)
    call_ms = 200 if a.quick else 400
    warn = c.other_load_warning()
    if warn:
        print(warn)
    lib, drv = build()
    bpf, plan = load_cuda_unit()
    cp = cuda.CudaProbes(bpf, plan, budget=0.02, governor=False)
    cp.start()
    empty = BPF(text="int empty(struct pt_regs *ctx) { return 0; }")
    # the floor attached the same way as ours (uprobe_multi link or perf event): the ratio compares programs
    empty_up = uprobes.attacher_for(empty, uprobes.attacher_for(bpf).mode)
    empty_h: list = []
    d = Driver(drv, lib)
    guard = c.Guard(10.0 if a.quick else 30.0)
    try:
        libs = cp.scan_pid(d.pid)
        cp.service()
        addr = libs[0].syms["cuLaunchKernel"].addr
        d.do("sym cuGraphLaunch 1")  # its first CUDA call puts it in the watch set (process.watch = gpu)
        print(f"bench_cuda: {rounds} rounds; kernel {os.uname().release}; per-call loops of {call_ms} ms; "
              f"uprobes: {empty_up.mechanism}")

        # ---- per-call cost: none / empty / ours / ours in a request ----
        conds = ["none", "empty", "ours", "ours_marked"]
        rounds_per: list[dict[str, float]] = []
        for r in range(rounds):
            guard.before()
            m: dict[str, float] = {}
            for cond in conds[r % 4:] + conds[:r % 4]:
                cp.pause(cond not in ("ours", "ours_marked"))
                if cond == "empty":
                    empty_h.append(empty_up.attach("empty", lib, addr))
                if cond == "ours_marked":
                    d.do("begin 4242")
                m[cond] = d.do(f"loop {call_ms} 0")[1]
                if cond == "ours_marked":
                    d.do("end 4242")
                if cond == "empty":
                    while empty_h:
                        empty_up.detach(empty_h.pop())
            guard.after()
            rounds_per.append(m)
            print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{k} {m[k]:.0f}" for k in conds) + " ns/call",
                  flush=True)
        per = {k: [m[k] for m in guard.pick(rounds_per)] for k in conds}

        # ---- the programs' own run time (kernel.bpf_stats_enabled: kept out of the timed rounds) ----
        def prog_stats(b, fn: bytes) -> tuple[int, int]:
            with open(f"/proc/self/fdinfo/{b.funcs[fn].fd}") as f:
                t = f.read()
            return tuple(int(re.search(rf"{k}:\s*(\d+)", t).group(1)) for k in ("run_time_ns", "run_cnt"))

        run_ns: dict[str, float] = {}
        with c.bpf_run_stats():
            for cond, b, fn in (("ours", bpf, b"cu_launch"), ("ours_marked", bpf, b"cu_launch"),
                                ("empty", empty, b"empty")):
                cp.pause(cond == "empty")
                if cond == "empty":
                    empty_h.append(empty_up.attach("empty", lib, addr))
                d.do("begin 4343") if cond == "ours_marked" else None
                t0, n0 = prog_stats(b, fn)
                d.do(f"loop {call_ms} 0")
                t1, n1 = prog_stats(b, fn)
                d.do("end 4343") if cond == "ours_marked" else None
                run_ns[cond] = (t1 - t0) / max(1, n1 - n0)
                if cond == "empty":
                    while empty_h:
                        empty_up.detach(empty_h.pop())
        print(f"  program run time per hit (bpf_stats): ours {run_ns['ours']:.0f} ns, in a request "
              f"{run_ns['ours_marked']:.0f} ns, empty {run_ns['empty']:.0f} ns", flush=True)

        # ---- the governor on a launch-bound loop ----
        cp.pause(True)
        cp.governor = True
        cp.calibration = calibrate_standin(bpf, lib)
        cp.slice_s = 0.1  # >> the ~10 ms an attach takes (traps without counting meanwhile)
        cp.pause(False)
        d.do(f"loop 2000 {WORK_NS}")  # the governor measures the rate and picks its weight
        win_ms = 3000 if a.quick else 6000
        gguard = c.Guard(guard.budget_s)
        gov_rounds: list[dict] = []
        for r in range(max(2, rounds // 2)):
            gguard.before()
            g: dict = {}
            for cond in (("none", "governed") if r % 2 == 0 else ("governed", "none")):
                cp.pause(cond == "none")
                c0 = bpf[b"proc_stats"][ctypes.c_uint32(d.pid)].cu_launch
                iters, ns = d.do(f"loop {win_ms} {WORK_NS}")
                g[cond] = ns
                if cond == "governed":
                    est = bpf[b"proc_stats"][ctypes.c_uint32(d.pid)].cu_launch - c0
                    g["estimate_error"], g["weight"] = est / iters - 1, cp.weights["cu_launch"]
            gguard.after()
            gov_rounds.append(g)
            print(f"  governor round {r + 1}: none {g['none']:.0f}, governed {g['governed']:.0f} ns/launch, "
                  f"weight {g['weight']}, estimate {g['estimate_error']:+.1%}", flush=True)
        gov = {k: [g[k] for g in gguard.pick(gov_rounds)] for k in ("none", "governed", "estimate_error", "weight")}
        status = cp.governor_status()
    finally:
        d.close()
        cp.stop()
        while empty_h:
            empty_up.detach(empty_h.pop())
        empty.cleanup()

    unclean = guard.clean.count(False) + gguard.clean.count(False)
    results = {"machine": c.machine(), "rounds": rounds, "unclean_conditions": unclean, "per_call": per,
               "uprobes": empty_up.mode,
               "program_run_ns": run_ns,
               "governor": gov, "governor_status": status, "calibration": cp.calibration.__dict__}
    rows, summary = [], []
    for cond, label in (("empty", "empty uprobe (the floor)"), ("ours", "our cu_launch program"),
                        ("ours_marked", "our cu_launch, in a marked request")):
        ratios = [b / n for n, b in zip(per["none"], per[cond])]
        rows.append([label, c.med(per["none"]), c.med(per[cond]), c.med(per[cond]) - c.med(per["none"]),
                     c.med(ratios), c.spread(ratios)])
        summary.append({"what": f"cuLaunchKernel call, {label}", "unit": "ns/call", "none": c.med(per["none"]),
                        "agent": c.med(per[cond]), "added": c.med(per[cond]) - c.med(per["none"]),
                        "ratio": c.med(ratios), "spread": c.spread(ratios)})
    vs_floor = [o / e for o, e in zip(per["ours"], per["empty"])]
    vs_floor_m = [o / e for o, e in zip(per["ours_marked"], per["empty"])]
    c.print_table("cost per cuLaunchKernel call, ns (median over rounds; ratio = with / without, per round)",
                  ["what", "no probe", "probe", "added", "ratio", "spread"], rows)
    print(f"  ours / empty uprobe, per call with the trap: {c.med(vs_floor):.3f} ({c.spread(vs_floor)}); "
          f"in a request {c.med(vs_floor_m):.3f} ({c.spread(vs_floor_m)}); target <= 1.1")
    extra = run_ns["ours"] - run_ns["empty"]
    print(f"  from the programs' run times: ours adds {extra:.0f} ns to the empty uprobe's call "
          f"({c.med(per['empty']):.0f} ns): {(c.med(per['empty']) + extra) / c.med(per['empty']):.3f}x the floor")
    slow = [g / n - 1 for n, g in zip(gov["none"], gov["governed"])]
    print(f"\ngovernor, launch-bound loop ({WORK_NS} ns of work per launch), budget {status['budget']:.0%}: "
          f"slowdown {c.med(slow):+.2%} ({c.spread(slow)}), weight {c.med(gov['weight']):.0f}, its own estimate "
          f"{status['overhead']:.2%}; scaled count vs the loop's {c.med(gov['estimate_error']):+.1%} "
          f"({c.spread(gov['estimate_error'])}); calibrated {cp.calibration.cost_ns:.0f} ns per hit")
    for note in (guard.note(), gguard.note()):
        if note:
            print(note)
    results["ours_over_empty"] = {"median": c.med(vs_floor), "spread": c.spread(vs_floor),
                                  "marked_median": c.med(vs_floor_m)}
    results["governor_slowdown"] = {"median": c.med(slow), "spread": c.spread(slow)}
    summary += [
        {"what": "our cu_launch / empty uprobe (target <= 1.1)", "unit": "ratio", "none": None, "agent": None,
         "added": None, "ratio": c.med(vs_floor), "spread": c.spread(vs_floor)},
        {"what": "BPF program run time per hit, ours vs empty (bpf_stats)", "unit": "ns/run",
         "none": run_ns["empty"], "agent": run_ns["ours"], "added": extra, "ratio": run_ns["ours"] / run_ns["empty"],
         "spread": ""},
        {"what": f"launch-bound loop, governor at {status['budget']:.0%} (weight {c.med(gov['weight']):.0f})",
         "unit": "ns/launch", "none": c.med(gov["none"]), "agent": c.med(gov["governed"]),
         "added": c.med(gov["governed"]) - c.med(gov["none"]), "ratio": 1 + c.med(slow), "spread": c.spread(slow)},
    ]
    results["summary"] = summary
    c.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
