#!/usr/bin/env python3
"""What the zero-code HTTP probes cost every socket syscall, for processes the agent does not watch
and for those it does, on bytes that are no request and on requests the framing follows.

Every read, recvfrom, write, sendto, writev, sendmsg and close on the host passes the http_* syscall
tracepoints (bpf/http.bpf.c). A process not watched pays a hash lookup at each entry and exit; a
watched one also has its read arguments saved and its data's first 4 bytes compared with the HTTP
methods (writes only inside a request), and a followed connection's bytes go through the framing
(bpf/http.bpf.c: a tail-called program per step, a BEGIN and an END per request). Measured, from C
through a socketpair: a write()+read() pair of 64 bytes that are no request (bench/loops.c rw), and an
HTTP/1.1 exchange, a 191-byte request head read and a 78-byte response written (loops http, four
socket syscalls), side by side, interleaved by rounds, in two agent sessions:
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
            for side in ("enter", "exit")] + ["syscalls:sys_enter_close", "sock:sock_recv_length", "sock:sock_send_length"]
LOOPS = ("rw", "http")


def without_http(ag) -> None:
    """The agent attached, less its HTTP probes: any syscall tracepoint already puts every syscall of
    the host on the kernel's traced slow path (the marker's sys_enter_ioctl does), so this is the
    baseline that isolates what the HTTP programs themselves add."""
    for bpf, tp, _ in ag._probes:
        if tp in HTTP_TPS:
            bpf.detach_tracepoint(tp.encode())


EMPTY = "int empty(void *ctx) { return 0; }"


class EmptyProbes:
    """Empty programs on the six tracepoints the loops hit (enter and exit of write and read, the two
    sock: ones inside them): the tracepoint tax alone, without any of our work, measured beside ours."""

    TPS = ("syscalls:sys_enter_write", "syscalls:sys_exit_write", "syscalls:sys_enter_read", "syscalls:sys_exit_read",
           "sock:sock_recv_length", "sock:sock_send_length")

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
    """{loop: its row} for one agent session (watch: process.watch), every condition of every loop
    interleaved in each round."""
    conds = ["none", "empty", "agent_no_http", "agent"]
    got = {(lp, k): [] for lp in LOOPS for k in conds}
    # per-process begins unbounded: the loop's requests are followed, not refused by the rate (the
    # pressure rule still bounds what reaches the ring: its refusals are said below)
    with c.ToggledAgent(watch=watch, overrides={"requests.max_begins_per_s_per_pid": 10_000_000}) as ag:
        empty = EmptyProbes()  # after the agent's start, which points bcc at the kernel headers
        stats0 = dict(ag.agent.health.kernel_stats)
        for r in range(rounds):
            guard.before()
            order = [(lp, k) for lp in LOOPS for k in conds]
            for lp, cond in (order if r % 2 == 0 else order[::-1]):
                run = lambda: c.med(c.loops(binary, lp, BATCH, nbatch))  # noqa: E731
                if cond == "none":
                    got[lp, cond].append(run())
                    continue
                if cond == "empty":
                    with empty:
                        got[lp, cond].append(run())
                    continue
                with ag.attached():
                    if cond == "agent_no_http":
                        without_http(ag)
                    got[lp, cond].append(run())
                    if cond == "agent_no_http":  # attached() detaches them all again
                        for bpf, tp, fn in ag._probes:
                            if tp in HTTP_TPS:
                                bpf.attach_tracepoint(tp=tp.encode(), fn_name=fn.encode())
            guard.after()
            print(f"  {watch}: round {r + 1}/{rounds}: " + ", ".join(f"{lp} {k} {v[-1]:.0f}" for (lp, k), v in got.items())
                  + " ns per pair/exchange", flush=True)
        ag.agent._read_maps()
        stats = {k: v - stats0.get(k, 0) for k, v in ag.agent.health.kernel_stats.items()
                 if k.startswith(("http", "rb_http")) and v - stats0.get(k, 0)}
    out = {}
    for lp in LOOPS:
        g = {k: guard.pick(got[lp, k]) for k in conds}
        http = [a / b for b, a in zip(g["agent_no_http"], g["agent"])]
        whole = [a / b for b, a in zip(g["none"], g["agent"])]
        tax = [e - b for b, e in zip(g["none"], g["empty"])]
        out[lp] = {"none_ns": c.med(g["none"]), "empty_ns": c.med(g["empty"]), "tax_ns": c.med(tax),
                   "agent_no_http_ns": c.med(g["agent_no_http"]), "agent_ns": c.med(g["agent"]),
                   "http_added_ns": c.med([a - b for b, a in zip(g["agent_no_http"], g["agent"])]),
                   "http_ratio": c.med(http), "http_ratio_spread": c.spread(http),
                   "agent_ratio": c.med(whole), "agent_ratio_spread": c.spread(whole)}
    out["kernel_stats"] = stats
    return out


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
    sessions = {"unwatched": session(binary, "marked", rounds, nbatch, guard),
                "watched": session(binary, "all", rounds, nbatch, guard)}
    rows = {f"{w} {lp}": sessions[w][lp] for w in sessions for lp in LOOPS}
    # per syscall: a rw pair is two syscalls, an exchange four
    per = {lp: 2 if lp == "rw" else 4 for lp in LOOPS}
    c.print_table("ns per write()+read() pair (rw: 64 bytes, no request) and per HTTP exchange (http: four syscalls),"
                  " median over rounds; HTTP probes = agent / agent less its HTTP probes",
                  ["process, loop", "no agent", "empty probes", "agent less HTTP", "agent", "empty per syscall",
                   "HTTP added per syscall", "HTTP ratio", "spread", "agent / none"],
                  [[k, r["none_ns"], r["empty_ns"], r["agent_no_http_ns"], r["agent_ns"], r["tax_ns"] / per[k.split()[1]],
                    r["http_added_ns"] / per[k.split()[1]], r["http_ratio"], r["http_ratio_spread"], r["agent_ratio"]]
                   for k, r in rows.items()])
    for w, s_ in sessions.items():
        if s_["kernel_stats"]:
            print(f"  {w}: the HTTP path's kernel counts over the session: {s_['kernel_stats']}")
    if guard.note():
        print(guard.note())
    results = {"machine": c.machine(), "rounds": rounds, "warning": guard.note(), "rows": rows,
               "kernel_stats": {w: s_["kernel_stats"] for w, s_ in sessions.items()},
               "summary": [{"what": f"{k}: HTTP probes", "unit": "ns/" + ("pair" if k.endswith("rw") else "exchange"),
                            "none": r["agent_no_http_ns"], "agent": r["agent_ns"], "added": r["http_added_ns"],
                            "ratio": r["http_ratio"], "spread": r["http_ratio_spread"]} for k, r in rows.items()]}
    c.write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
