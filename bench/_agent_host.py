"""The agent alone in a process of its own, for bench_footprint.py: its CPU and memory are the process's.

    python bench/_agent_host.py [--watch MODE] [--profile OUT]

Starts the agent as `mcp-agent run` does (bench/_common.py ToggledAgent: Agent(cfg).start() and the
Agent.run loop on a thread, default settings, telemetry to a JSONL file) plus the control socket the
CLI serves, then answers one JSON line per command on stdin; the main thread only waits on stdin:
    attach | detach          every tracepoint of ours, and the CUDA launch uprobes (paused / resumed)
    threads                  {native thread id: Python thread name}
    cuda_scan PID            attach the CUDA uprobes to the libcuda PID maps, as the agent's finder does
    stats                    the agent's counters
With --profile, the pipeline loop, the metric reader's collections and the CUDA finder's passes run
under cProfile; the statistics go to OUT when stdin closes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402


def profiled(fn, prof: cProfile.Profile):
    def wrapper(*args, **kw):
        prof.enable()
        try:
            return fn(*args, **kw)
        finally:
            prof.disable()
    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--watch", default=None, help="process.watch (default: the agent's default)")
    ap.add_argument("--profile")
    a = ap.parse_args()
    from mcp_hostagent import control
    from mcp_hostagent.cuda import probeset as cuda_mod

    ag = c.ToggledAgent(a.watch)
    profs: dict[str, cProfile.Profile] = {}
    if a.profile:  # each wrapped function runs in one thread only: a cProfile per thread
        ag.agent.run = profiled(ag.agent.run, profs.setdefault("pipeline thread", cProfile.Profile()))
        cuda_mod.CudaProbes.service_finder = profiled(cuda_mod.CudaProbes.service_finder,
                                                      profs.setdefault("cuda finder thread", cProfile.Profile()))
    with ag:
        if a.profile:
            for r in ag.agent.telemetry.readers:
                r.collect = profiled(r.collect, profs.setdefault("metric reader thread", cProfile.Profile()))
        sock = os.path.join(tempfile.mkdtemp(prefix="mcp-bench-ctl-"), "ctl.sock")
        srv = control.serve(ag.agent.snapshots, lambda s: None, sock)
        ag.attach()  # as `run` leaves it
        cuda = ag.agent.caps["cuda"].probes
        governor = cuda.governor if cuda is not None else False
        print(json.dumps({"ready": True, "pid": os.getpid(), "probes": ag.probe_names(),
                          "other_probes": ag.other_probes, "cuda": cuda is not None}), flush=True)
        for line in sys.stdin:
            cmd, *args = line.split()
            out: dict = {"ok": True}
            if cmd == "attach":
                ag.attach()
                if cuda is not None:
                    cuda.pause(False)
                    cuda.governor = governor
            elif cmd == "detach":
                ag.detach()
                if cuda is not None:
                    # paused with the governor on, the finder's next control time stays in the past
                    # and its thread wakes every 2 ms (agent/cuda/capability.py service_finder): off meanwhile
                    cuda.governor = False
                    cuda.pause(True)
            elif cmd == "threads":
                out = {str(t.native_id): t.name for t in threading.enumerate()}
            elif cmd == "cuda_scan":
                out = {"libs": len(cuda.scan_pid(int(args[0]))) if cuda is not None else 0}
            elif cmd == "stats":
                out = {**ag.stats(), "proc_rows": len(ag.agent.processes.rows)}
            else:
                out = {"error": f"unknown command {cmd!r}"}
            print(json.dumps(out), flush=True)
        if srv is not None:
            srv.stop()
    if a.profile:
        with open(a.profile, "w") as f:
            for name, p in profs.items():
                f.write(f"===== {name}\n")
                pstats.Stats(p, stream=f).sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
