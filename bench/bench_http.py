#!/usr/bin/env python3
"""What the zero-code HTTP probes cost every socket syscall, for processes the agent does not watch
and for those it does.

Every read, recvfrom, write, sendto, writev, sendmsg and close on the host passes the http_* syscall
tracepoints (bpf/http.bpf.c). A process not watched pays a hash lookup at each entry and exit; a
watched one also has its read arguments saved and its data's first 4 bytes compared with the HTTP
methods (writes only inside a request). Measured: a write()+read() pair of 64 bytes through a
socketpair from C (bench/loops.c rw), side by side, interleaved by rounds, in two agent sessions:
process.watch = marked (the loop is not watched) and = all (it is), each under three conditions: no
agent; the agent less its HTTP probes (any syscall tracepoint, the marker's included, already puts
every syscall on the kernel's traced slow path); the whole agent. The HTTP probes' cost is the last
two's difference: four program runs per pair (enter and exit of each call). Beside them, empty
programs on the same four tracepoints: what any program there costs (the tracepoint's own tax).

    sudo .venv/bin/python bench/bench_http.py [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as c  # noqa: E402

BATCH = 20000


HTTP_TPS = [f"syscalls:sys_{side}_{call}" for call in ("read", "recvfrom", "write", "sendto", "writev", "sendmsg")
            for side in ("enter", "exit")] + ["syscalls:sys_enter_close"]


def without_http(ag) -> None:
    """The agent attached, less its HTTP probes: any syscall tracepoint already puts every syscall of
    the host on the kernel's traced slow path (the marker's sys_enter_ioctl does), so this is the
    baseline that isolates what the HTTP programs themselves add."""
    for bpf, tp, _ in ag._probes:
        if tp in HTTP_TPS:
            bpf.detach_tracepoint(tp.encode())


EMPTY = "int empty(void *ctx) { return 0; }"


class EmptyProbes:
    """Empty programs on the four tracepoints the loop hits (enter and exit of write and read): the
    tracepoint tax alone, without any of our work, measured beside ours."""

    TPS = ("syscalls:sys_enter_write", "syscalls:sys_exit_write", "syscalls:sys_enter_read", "syscalls:sys_exit_read")

    def __init__(self):
        from bcc import BPF

        self.b = BPF(text=EMPTY)

    def __enter__(self):
        for tp in self.TPS:
            self.b.attach_tracepoint(tp=tp, fn_name="empty")
        return self

    def __exit__(self, *exc):
        for tp in self.TPS:
            self.b.detach_tracepoint(tp)


def session(binary: str, watch: str, rounds: int, nbatch: int, guard) -> dict:
    got = {"none": [], "empty": [], "agent_no_http": [], "agent": []}
    order = list(got)
    with c.ToggledAgent(watch=watch) as ag:
        empty = EmptyProbes()  # after the agent's start, which points bcc at the kernel headers
        for r in range(rounds):
            guard.before()
            for cond in (order if r % 2 == 0 else order[::-1]):
                if cond == "none":
                    got[cond].append(c.med(c.loops(binary, "rw", BATCH, nbatch)))
                    continue
                if cond == "empty":
                    with empty:
                        got[cond].append(c.med(c.loops(binary, "rw", BATCH, nbatch)))
                    continue
                with ag.attached():
                    if cond == "agent_no_http":
                        without_http(ag)
                    got[cond].append(c.med(c.loops(binary, "rw", BATCH, nbatch)))
                    if cond == "agent_no_http":  # attached() detaches them all again
                        for bpf, tp, fn in ag._probes:
                            if tp in HTTP_TPS:
                                bpf.attach_tracepoint(tp=tp.encode(), fn_name=fn.encode())
            guard.after()
            print(f"  {watch}: round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in got.items())
                  + " ns per write+read", flush=True)
    got = {k: guard.pick(v) for k, v in got.items()}
    http = [a / b for b, a in zip(got["agent_no_http"], got["agent"])]
    whole = [a / b for b, a in zip(got["none"], got["agent"])]
    tax = [e - b for b, e in zip(got["none"], got["empty"])]
    return {"none_ns": c.med(got["none"]), "empty_ns": c.med(got["empty"]), "tax_ns": c.med(tax),
            "agent_no_http_ns": c.med(got["agent_no_http"]),
            "agent_ns": c.med(got["agent"]),
            "http_added_ns": c.med([a - b for b, a in zip(got["agent_no_http"], got["agent"])]),
            "http_ratio": c.med(http), "http_ratio_spread": c.spread(http),
            "agent_ratio": c.med(whole), "agent_ratio_spread": c.spread(whole)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (~30 s)")
    ap.add_argument("--rounds", type=int, help="rounds of (no agent, agent) per session; default 10, --quick 4")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    c.require_root()
    c.ensure_project_python()
    rounds = a.rounds or (4 if a.quick else 10)
    nbatch = 3 if a.quick else 5
    warn = c.other_load_warning()
    if warn:
        print(warn)
    binary = c.build_loops()
    print(f"bench_http: {rounds} rounds per session, {nbatch} batches of {BATCH} pairs; kernel {os.uname().release}")
    guard = c.Guard(10.0 if a.quick else 30.0)
    rows = {"unwatched": session(binary, "marked", rounds, nbatch, guard),
            "watched": session(binary, "all", rounds, nbatch, guard)}
    c.print_table("write()+read() of 64 bytes, ns (median over rounds); HTTP probes = agent / agent less its HTTP probes",
                  ["process", "no agent", "empty probes", "agent less HTTP", "agent", "empty per syscall",
                   "HTTP added per syscall", "HTTP ratio", "spread", "agent / none"],
                  [[k, r["none_ns"], r["empty_ns"], r["agent_no_http_ns"], r["agent_ns"], r["tax_ns"] / 2,
                    r["http_added_ns"] / 2, r["http_ratio"], r["http_ratio_spread"], r["agent_ratio"]]
                   for k, r in rows.items()])
    if guard.note():
        print(guard.note())
    results = {"machine": c.machine(), "rounds": rounds, "warning": guard.note(), "rows": rows,
               "summary": [{"what": f"write+read pair, {k} process: HTTP probes", "unit": "ns/pair",
                            "none": r["agent_no_http_ns"], "agent": r["agent_ns"], "added": r["http_added_ns"],
                            "ratio": r["http_ratio"], "spread": r["http_ratio_spread"]} for k, r in rows.items()]}
    c.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
