#!/usr/bin/env python3
"""Measure the smallest capability set mcp-agent needs, by running it with each one removed.

    sudo .venv/bin/python packaging/captest.py                  # print the table (markdown)
    sudo .venv/bin/python packaging/captest.py --write docs/SECURITY.md --json captest.json

The agent must run as uid 0 (it checks), so each run is root with a reduced capability set: setpriv
(util-linux) clears the inheritable and ambient sets and cuts the bounding set, and root's
permitted/effective sets after exec are then exactly the bounding set -- what systemd does with
User=root and CapabilityBoundingSet=. Each set gets:

  * a real `mcp-agent run --duration 3 --jsonl none --no-status` (probes attached / missing and
    why, sources, control socket, exit status), and
  * a checker (this file, --check) that tries, one by one, the privileged operations behind the agent's
    features: BPF map and tracepoint-program load, perf_event_open of a tracepoint and of a uprobe
    (bcc's attach path), mounting tracefs, reading /proc/PID/{maps,exe,fd,root,map_files} of other
    users' and of fully privileged processes (GPU discovery, identity, CUDA library lookup), raising
    RLIMIT_MEMLOCK, rtnetlink link events, files of other users.

Sets: everything root has here; the eight candidates of issue 7; the candidates minus each one in
turn; the smallest set found; and, in a private mount namespace without tracefs (a host where nothing
mounted it), the smallest set with and without CAP_SYS_ADMIN.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

CANDIDATES = ["bpf", "perfmon", "sys_resource", "dac_read_search", "sys_ptrace", "sys_admin", "net_admin",
              "dac_override"]
# broadest first: each covers part of what the later ones grant
GREEDY_ORDER = ["sys_admin", "dac_override", "net_admin", "sys_resource", "dac_read_search", "sys_ptrace", "perfmon",
                "bpf"]
CAP_BITS = {"dac_override": 1, "dac_read_search": 2, "net_admin": 12, "sys_ptrace": 19, "sys_admin": 21,
            "sys_resource": 24, "perfmon": 38, "bpf": 39, "checkpoint_restore": 40}
AGENT_ARGS = ["run", "--duration", "3", "--jsonl", "none", "--no-status"]
TRACEFS = "/sys/kernel/tracing"

# ---- the checker: runs under the reduced set ---------------------------------------------------------

libc = ctypes.CDLL(None, use_errno=True)
SYS = {"x86_64": {"bpf": 321, "perf_event_open": 298}, "aarch64": {"bpf": 280, "perf_event_open": 241}}[os.uname().machine]


def _err(rc: int) -> str:
    return "ok" if rc >= 0 else os.strerror(ctypes.get_errno()).split(":")[0] + f" ({_errname(ctypes.get_errno())})"


def _errname(e: int) -> str:
    import errno
    return errno.errorcode.get(e, str(e))


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def check_map_create() -> str:
    attr = ctypes.create_string_buffer(struct.pack("IIIII", 27, 0, 0, 4096, 0), 128)  # BPF_MAP_TYPE_RINGBUF
    fd = libc.syscall(SYS["bpf"], 0, attr, 128)
    r = _err(fd)
    _close(fd)
    return r


def check_prog_load() -> str:
    insns = struct.pack("<BBhi", 0xB7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)  # r0 = 0; exit
    ibuf, lic = ctypes.create_string_buffer(insns), ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("IIQQ", attr, 0, 5, 2, ctypes.addressof(ibuf), ctypes.addressof(lic))  # BPF_PROG_TYPE_TRACEPOINT
    fd = libc.syscall(SYS["bpf"], 5, attr, 128)
    r = _err(fd)
    _close(fd)
    return r


def _perf_open(type_: int, config: int, config1: int = 0, config2: int = 0, sample_raw: bool = True) -> str:
    attr = ctypes.create_string_buffer(128)
    # type, size, config, sample_period, sample_type, read_format, flags(bits), wakeup_events, bp_type, config1, config2
    struct.pack_into("IIQQQQQIIQQ", attr, 0, type_, 128, config, 1, (1 << 10) if sample_raw else 0, 0,
                     1 << 0, 1, 0, config1, config2)  # disabled=1
    fd = libc.syscall(SYS["perf_event_open"], attr, -1, 0, -1, 8)  # pid -1, cpu 0 (what bcc does), CLOEXEC
    r = _err(fd)
    _close(fd)
    return r


def check_perf_tracepoint() -> str:
    try:
        with open(f"{TRACEFS}/events/sched/sched_switch/id") as f:
            tp = int(f.read())
    except OSError as e:
        return f"cannot read the tracepoint id: {e.strerror}"
    return _perf_open(2, tp)  # PERF_TYPE_TRACEPOINT


def check_perf_uprobe(target: str) -> str:
    try:
        with open("/sys/bus/event_source/devices/uprobe/type") as f:
            pmu = int(f.read())
    except OSError:
        return "no uprobe PMU"
    path = ctypes.create_string_buffer(target.encode())
    return _perf_open(pmu, 0, ctypes.addressof(path), 0, sample_raw=False)


def check_mount_tracefs() -> str:
    d = tempfile.mkdtemp(prefix="captest-tracefs-")
    try:
        rc = libc.mount(b"none", d.encode(), b"tracefs", 0, None)
        r = _err(rc)
        if rc == 0:
            libc.umount2(d.encode(), 2)  # MNT_DETACH
        return r
    finally:
        os.rmdir(d)


def _try(fn) -> str:
    try:
        fn()
        return "ok"
    except OSError as e:
        return f"{e.strerror} ({_errname(e.errno)})"


def check_proc(pid: int) -> dict[str, str]:
    def first_map_file():
        name = sorted(os.listdir(f"/proc/{pid}/map_files"))[0]
        os.readlink(f"/proc/{pid}/map_files/{name}")

    return {
        "maps": _try(lambda: open(f"/proc/{pid}/maps").read(1)),
        "exe": _try(lambda: os.readlink(f"/proc/{pid}/exe")),
        "fd": _try(lambda: os.listdir(f"/proc/{pid}/fd")),
        "fd0": _try(lambda: os.readlink(f"/proc/{pid}/fd/0")),
        "root": _try(lambda: os.listdir(f"/proc/{pid}/root/")),
        "map_files": _try(first_map_file),
    }


def check_memlock() -> str:
    import resource
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        return "ok"
    except (OSError, ValueError) as e:
        return f"{e}"


def check_netlink() -> str:
    def f():
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
        try:
            s.bind((0, 1))  # RTMGRP_LINK
        finally:
            s.close()
    return _try(f)


def run_checks(args) -> dict:
    out = {
        "caps_effective": open("/proc/self/status").read().split("CapEff:")[1].split()[0],
        "bpf_map_create": check_map_create(),
        "bpf_prog_load_tracepoint": check_prog_load(),
        "perf_event_open_tracepoint": check_perf_tracepoint(),
        "perf_event_open_uprobe": check_perf_uprobe(args.uprobe_target),
        "tracefs_uprobe_events_open": _try(lambda: os.close(os.open(f"{TRACEFS}/uprobe_events", os.O_WRONLY | os.O_APPEND))),
        "mount_tracefs": check_mount_tracefs(),
        "memlock_unlimited": check_memlock(),
        "netlink_link_events": check_netlink(),
        "read_other_users_0600_file": _try(lambda: open(args.private_file).read(1)),
        "list_other_users_0700_dir": _try(lambda: os.listdir(args.private_dir)),
        "run_dir_write": _try(lambda: os.rmdir(tempfile.mkdtemp(dir=args.run_dir))),
    }
    for label, pid in (("proc_other_uid", args.other_pid), ("proc_root_fullcaps", args.root_pid)):
        for k, v in check_proc(pid).items():
            out[f"{label}_{k}"] = v
    return out


# ---- the driver: runs with every capability ---------------------------------------------------------

def setpriv(caps: list[str]) -> list[str]:
    bset = ",".join(["-all"] + [f"+{c}" for c in caps])
    return ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", f"--bounding-set={bset}", "--"]


def parse_run(r: subprocess.CompletedProcess) -> dict:
    err = r.stderr
    m = re.search(r"probes (\d+) attached, (\d+) missing, (\d+) disabled", err)
    src = re.search(r"^  sources:  (.*)$", err, re.M)
    ctl = re.search(r"^  control:  (.*)$", err, re.M)
    return {
        "rc": r.returncode,
        "attached": int(m.group(1)) if m else 0,
        "missing": int(m.group(2)) if m else 0,
        "missing_lines": re.findall(r"^  missing:  (.*)$", err, re.M),
        "error": next((ln for ln in err.splitlines() if ln.startswith("mcp-agent: error:")), ""),
        "warnings": [ln for ln in err.splitlines() if ": WARNING: " in ln and "NVML unavailable" not in ln],
        "sources": src.group(1) if src else "",
        "control": ctl.group(1) if ctl else "",
        "traceback": "Traceback" in err,
        "stderr_tail": err.strip().splitlines()[-3:],
    }


def agent_env(sock: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCP_AGENT_", "OTEL_")) and k != "BCC_KERNEL_SOURCE"}
    env.update(MCP_AGENT_CONFIG=os.devnull, MCP_AGENT_CONTROL_SOCKET=sock, MCP_AGENT_GPU_ENABLED="true")
    return env


def measure(caps: list[str], fixtures: dict, no_tracefs: bool = False) -> dict:
    sock = f"/run/mcp-hostagent/captest-{os.getpid()}.sock"
    agent = [*setpriv(caps), sys.executable, "-m", "mcp_hostagent", *AGENT_ARGS]
    check = [*setpriv(caps), sys.executable, os.path.abspath(__file__), "--check",
             "--other-pid", str(fixtures["other_pid"]), "--root-pid", str(fixtures["root_pid"]),
             "--private-file", fixtures["private_file"], "--private-dir", fixtures["private_dir"],
             "--run-dir", "/run/mcp-hostagent", "--uprobe-target", fixtures["uprobe_target"]]
    if no_tracefs:  # a private mount namespace in which nothing mounted tracefs/debugfs
        unmount = ("for m in /sys/kernel/debug/tracing /sys/kernel/tracing /sys/kernel/debug; do "
                   "while mountpoint -q $m; do umount -l $m || break; done; done; exec \"$@\"")
        wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", unmount, "sh"]
        agent, check = wrap + agent, wrap + check
    t0 = time.monotonic()
    r = subprocess.run(agent, env=agent_env(sock), capture_output=True, text=True, timeout=120)
    res = parse_run(r)
    res["seconds"] = round(time.monotonic() - t0, 1)
    if no_tracefs:  # the checks need tracefs; these runs are about the agent's own mount
        res["checks"] = {}
    else:
        c = subprocess.run(check, capture_output=True, text=True, timeout=60)
        res["checks"] = json.loads(c.stdout) if c.returncode == 0 else {"checker_failed": c.stderr.strip()[-300:]}
    res["caps"] = caps
    res["no_tracefs"] = no_tracefs
    return res


def fixtures(tmp: str) -> tuple[dict, list]:
    """Processes and files the checker looks at: one process of another user, one fully privileged
    root process, a 0600 file and a 0700 directory of another user, a file to put a uprobe on."""
    nobody = 65534
    other = subprocess.Popen(["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups", "sleep", "600"])
    root = subprocess.Popen(["sleep", "600"])
    pf, pd = os.path.join(tmp, "private-file"), os.path.join(tmp, "private-dir")
    with open(pf, "w") as f:
        f.write("secret\n")
    os.mkdir(pd)
    for p, mode in ((pf, 0o600), (pd, 0o700)):
        os.chown(p, nobody, nobody)
        os.chmod(p, mode)
    os.chmod(tmp, 0o755)
    target = os.path.join(tmp, "uprobe-target")
    shutil.copy("/bin/true", target)
    time.sleep(0.2)
    return ({"other_pid": other.pid, "root_pid": root.pid, "private_file": pf, "private_dir": pd,
             "uprobe_target": target}, [other, root])


CHECK_WHY = {  # check -> (feature of the agent, what the kernel asks for)
    "bpf_map_create": ("every BPF map (ring buffer, hashes)", "bpf(BPF_MAP_CREATE): CAP_BPF"),
    "bpf_prog_load_tracepoint": ("every probe program", "bpf(BPF_PROG_LOAD) of a tracing type: CAP_BPF + CAP_PERFMON"),
    "perf_event_open_tracepoint": ("attaching each tracepoint (bcc: perf_event_open pid=-1 per CPU, PERF_SAMPLE_RAW)",
                                   "system-wide perf events with perf_event_paranoid > -1: CAP_PERFMON"),
    "perf_event_open_uprobe": ("CUDA uprobes on libcuda.so, bcc's first way: the uprobe PMU",
                               "perf_uprobe_event_init: CAP_SYS_ADMIN (not CAP_PERFMON)"),
    "tracefs_uprobe_events_open": ("CUDA uprobes, bcc's fallback without CAP_SYS_ADMIN: a probe written to "
                                   "tracefs uprobe_events, then perf_event_open of its id (CAP_PERFMON)",
                                   "write access to tracefs (root's; no capability)"),
    "mount_tracefs": ("mounting tracefs/debugfs when the host has not", "mount(2): CAP_SYS_ADMIN"),
    "memlock_unlimited": ("bcc raises RLIMIT_MEMLOCK only if a map create fails with EPERM (kernels < 5.11)",
                          "raising a hard rlimit: CAP_SYS_RESOURCE"),
    "netlink_link_events": ("NIC link events (rtnetlink RTMGRP_LINK)", "none"),
    "read_other_users_0600_file": ("-- (the agent reads only root's files and world-readable /proc, /sys)",
                                   "CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH"),
    "list_other_users_0700_dir": ("--", "CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH"),
    "run_dir_write": ("kernel-src header farm and control socket in /run/mcp-hostagent (root's)", "none (owner)"),
    "proc_other_uid_maps": ("GPU process discovery (libcuda / /dev/nvidia* in /proc/PID/maps), CUDA library lookup",
                            "ptrace READ access to another uid: CAP_SYS_PTRACE, or CAP_PERFMON (perf tools read maps)"),
    "proc_other_uid_exe": ("process.executable.* attributes", "ptrace access: CAP_SYS_PTRACE"),
    "proc_other_uid_fd": ("NVIDIA fd table for nvidia_ioctl: listing /proc/PID/fd",
                          "directory 0500 owned by the process's uid: CAP_DAC_READ_SEARCH (or CAP_DAC_OVERRIDE)"),
    "proc_other_uid_fd0": ("NVIDIA fd table: readlink /proc/PID/fd/N",
                           "ptrace access (CAP_SYS_PTRACE) and search in the 0500 directory (CAP_DAC_READ_SEARCH)"),
    "proc_other_uid_root": ("libcuda.so inside containers (/proc/PID/root/<path>)", "ptrace access: CAP_SYS_PTRACE"),
    "proc_other_uid_map_files": ("a deleted libcuda.so (/proc/PID/map_files)",
                                 "CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE (and ptrace access)"),
    "proc_root_fullcaps_maps": ("the same for root processes with more capabilities than the agent",
                                "ptrace: caller's permitted set must cover the target's, else CAP_SYS_PTRACE "
                                "(or CAP_PERFMON for maps)"),
    "proc_root_fullcaps_exe": ("process.executable.* of such root processes", "the same: CAP_SYS_PTRACE"),
    "proc_root_fullcaps_root": ("libcuda.so in containers whose processes hold capabilities the agent lacks",
                                "the same: CAP_SYS_PTRACE"),
}


def summarize(results: dict, base_key: str) -> list[str]:
    """Markdown: one row per run, then one row per failing check with the capability it needs."""
    base = results[base_key]
    lines = ["| run | capabilities | exit | probes attached | agent output that changed | checks that fail |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, r in results.items():
        changed = []
        if r["error"]:
            changed.append(r["error"].replace("mcp-agent: error: ", "error: ")[:160])
        if r["missing_lines"]:
            first = re.sub(r" \(HINT: .*", "", r["missing_lines"][0])
            more = len(r["missing_lines"]) - 1
            changed.append(f"missing {first}" + (f" (and {more} more probes alike)" if more else ""))
        if r["sources"] != base["sources"]:
            changed.append("sources: " + r["sources"][:160])
        if r["control"] != base["control"]:
            changed.append("control: " + r["control"][:120])
        changed += [w[:160] for w in r["warnings"]]
        if r["traceback"]:
            changed.append("TRACEBACK")
        fails = [k for k, v in r["checks"].items() if k != "caps_effective" and v != "ok"
                 and base["checks"].get(k) == "ok"]
        caps = "all of root's" if key == "all" else " ".join("CAP_" + c.upper() for c in r["caps"])
        lines.append(f"| {key} | {caps} | {r['rc']} | {r['attached']} | {'; '.join(changed) or 'same as all'}"
                     f" | {', '.join(fails) or '-'} |")
    return [ln.replace("\n", " ") for ln in lines]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--other-pid", type=int)
    ap.add_argument("--root-pid", type=int)
    ap.add_argument("--private-file")
    ap.add_argument("--private-dir")
    ap.add_argument("--run-dir")
    ap.add_argument("--uprobe-target")
    ap.add_argument("--write", help="replace the measured block of this markdown file (docs/SECURITY.md)")
    ap.add_argument("--json", help="also write every result as JSON here")
    ap.add_argument("--from-json", help="render the table from a --json file of an earlier run instead of measuring")
    args = ap.parse_args()
    if args.check:
        print(json.dumps(run_checks(args)))
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        return render(saved["results"], saved["head"], args)
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        sys.exit("captest: run as root, with setpriv (util-linux) installed")
    os.makedirs("/run/mcp-hostagent", exist_ok=True)
    bnd = int(open("/proc/self/status").read().split("CapBnd:")[1].split()[0], 16)
    absent = [c for c in CANDIDATES if not bnd >> CAP_BITS[c] & 1]
    tmp = tempfile.mkdtemp(prefix="captest-")
    fx, procs = fixtures(tmp)
    results: dict[str, dict] = {}
    try:
        def go(key, caps, **kw):
            print(f"captest: {key} ...", file=sys.stderr, flush=True)
            results[key] = measure(caps, fx, **kw)

        results["all"] = measure_all(fx)
        go("candidates", CANDIDATES)
        for c in CANDIDATES:
            go(f"candidates - {c}", [x for x in CANDIDATES if x != c])
        # One at a time hides overlaps (CAP_SYS_ADMIN also grants what CAP_BPF, CAP_PERFMON and, for
        # reading, CAP_DAC_* grant), so: drop greedily, broadest first, keeping a drop only when
        # nothing got worse than with all the candidates; then show that each one left is needed.
        base = results["candidates"]
        needed = list(CANDIDATES)
        for c in GREEDY_ORDER:
            trial = [x for x in needed if x != c]
            key = f"candidates - {c}" if len(needed) == len(CANDIDATES) else f"greedy: {' '.join(trial) or 'none'}"
            if key not in results:
                go(key, trial)
            if not _worse(results[key], base):
                needed = trial
        go("minimal", needed)
        for c in needed:
            go(f"minimal - {c}", [x for x in needed if x != c])
        go("minimal + checkpoint_restore", needed + ["checkpoint_restore"])
        go("minimal, no tracefs", needed, no_tracefs=True)
        go("minimal + sys_admin, no tracefs", needed + ["sys_admin"], no_tracefs=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    k = os.uname()
    head = [f"Measured {datetime.date.today().isoformat()} on kernel {k.release} ({k.machine}), "
            f"{_os_release()}, setpriv {subprocess.run(['setpriv', '--version'], capture_output=True, text=True).stdout.split()[-1]}, "
            f"perf_event_paranoid={_read('/proc/sys/kernel/perf_event_paranoid')}, "
            f"unprivileged_bpf_disabled={_read('/proc/sys/kernel/unprivileged_bpf_disabled')}, "
            f"RLIMIT_MEMLOCK={_memlock()}."]
    if absent:
        head.append("Not in this host's bounding set, so never held in any run (what the runs show is that the "
                    "agent works without it): " + ", ".join("CAP_" + c.upper() for c in absent) + ".")
    needed_caps = " ".join("CAP_" + c.upper() for c in results["minimal"]["caps"])
    head.append(f"Smallest set with every probe attached and every source as with all capabilities: **{needed_caps}**.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head": head, "results": results}, f, indent=1)
    return render(results, head, args)


def render(results: dict, head: list[str], args) -> int:
    table = summarize(results, "all")
    checks = ["", "| privileged operation (checker) | agent feature | kernel requirement | " + " | ".join(
        ["all", "minimal"] + [f"minimal - {c}" for c in results["minimal"]["caps"]]) + " |",
        "| --- | --- | --- | " + " | ".join(["---"] * (2 + len(results["minimal"]["caps"]))) + " |"]
    for name, (feature, req) in CHECK_WHY.items():
        cols = [results[k]["checks"].get(name, "?") for k in ["all", "minimal"] + [f"minimal - {c}" for c in results["minimal"]["caps"]]]
        checks.append(f"| {name} | {feature} | {req} | " + " | ".join(cols) + " |")
    text = "\n".join(head + [""] + table + checks) + "\n"
    print(text)
    if args.write:
        doc = open(args.write).read()
        a, b = "<!-- captest:begin -->", "<!-- captest:end -->"
        if a not in doc or b not in doc:
            sys.exit(f"captest: {args.write} has no {a} ... {b} block")
        doc = doc[:doc.index(a) + len(a)] + "\n" + text + doc[doc.index(b):]
        with open(args.write, "w") as f:
            f.write(doc)
    return 0


def measure_all(fx) -> dict:
    """The reference: root with every capability it has (no setpriv)."""
    print("captest: all ...", file=sys.stderr, flush=True)
    bnd = int(open("/proc/self/status").read().split("CapBnd:")[1].split()[0], 16)
    names = [n for n, b in CAP_BITS.items() if bnd >> b & 1]
    sock = f"/run/mcp-hostagent/captest-{os.getpid()}.sock"
    run = subprocess.run([sys.executable, "-m", "mcp_hostagent", *AGENT_ARGS], env=agent_env(sock),
                         capture_output=True, text=True, timeout=120)
    check = subprocess.run([sys.executable, os.path.abspath(__file__), "--check", "--other-pid", str(fx["other_pid"]),
                            "--root-pid", str(fx["root_pid"]), "--private-file", fx["private_file"],
                            "--private-dir", fx["private_dir"], "--run-dir", "/run/mcp-hostagent",
                            "--uprobe-target", fx["uprobe_target"]], capture_output=True, text=True, timeout=60)
    r = parse_run(run)
    r["checks"] = json.loads(check.stdout)
    r["caps"] = names
    r["no_tracefs"] = False
    return r


# What the agent's features use (the rest show what is not needed, or what only a fallback needs).
RELIED = ("bpf_map_create", "bpf_prog_load_tracepoint", "perf_event_open_tracepoint", "tracefs_uprobe_events_open",
          "run_dir_write", "netlink_link_events", "proc_other_uid_maps", "proc_other_uid_exe", "proc_other_uid_fd",
          "proc_other_uid_fd0", "proc_other_uid_root", "proc_root_fullcaps_maps", "proc_root_fullcaps_exe",
          "proc_root_fullcaps_root")


def _worse(r: dict, base: dict) -> bool:
    """Did this run lose anything the reference had: exit status, probes, sources, control, checks the
    agent relies on (all but the DAC ones, which show what the agent does not need)."""
    if r["rc"] != base["rc"] or r["attached"] != base["attached"] or r["sources"] != base["sources"] \
            or r["control"] != base["control"] or r["traceback"] or r["warnings"] != base["warnings"]:
        return True
    relied = [k for k in base["checks"] if k in RELIED]
    return any(r["checks"].get(k) != base["checks"].get(k) for k in relied)


def _read(path: str) -> str:
    try:
        return open(path).read().strip()
    except OSError:
        return "?"


def _memlock() -> str:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    fmt = lambda v: "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"  # noqa: E731
    return f"{fmt(soft)}/{fmt(hard)}"


def _os_release() -> str:
    m = re.search(r'^PRETTY_NAME="?([^"\n]*)', _read("/etc/os-release"), re.M)
    return m.group(1) if m else "unknown OS"


if __name__ == "__main__":
    sys.exit(main())
