"""Packaging: the systemd unit passes `systemd-analyze verify` (and its offline security review), its
capabilities are the measured set of docs/SECURITY.md (the DaemonSet's too) and the agent attaches every
probe with exactly that set; sd_notify against a real datagram socket; `mcp-agent run` under a
NOTIFY_SOCKET says READY=1 only once the probes are attached and its start-up lines are written, pings
the watchdog, and says STOPPING=1 at SIGTERM. The Debian package (packaging/build-deb.sh): its control
fields, files and conffiles; installed for real with dpkg (without network), it runs, attaches its probes
and passes systemd-analyze; an upgrade keeps changed configuration; remove keeps it and purge leaves
nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from notify_listener import NotifySocket

from mcp_hostagent import __version__
from mcp_hostagent import sdnotify
from test_cli import (AGENT, BPF_PROG_GET_FD_BY_ID, bpf_ids, bpf_object_exists, clean_env, expected_attached,
                      expected_programs,
                      expected_missing,
                      probe_counts)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIT = os.path.join(REPO, "packaging", "mcp-agent.service")
DAEMONSET = os.path.join(REPO, "packaging", "daemonset.yaml")
SECURITY = os.path.join(REPO, "docs", "SECURITY.md")
VENV_AGENT = os.path.join(os.path.dirname(sys.executable), "mcp-agent")


def unit_values(key: str, text: str | None = None) -> list[str]:
    text = open(UNIT).read() if text is None else text
    return [ln.split("=", 1)[1].strip() for ln in text.splitlines() if ln.startswith(key + "=")]


def unit_caps() -> list[str]:
    [bounding] = unit_values("CapabilityBoundingSet")
    return bounding.split()


# ---- the unit ----------------------------------------------------------------------------------------

def analyze(*args: str, cwd: str):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (Debian: apt-get install systemd)")
    return subprocess.run(["systemd-analyze", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def unit_copy(tmp_path):
    """The unit as installed, but starting this checkout's mcp-agent: verify checks that ExecStart's
    binary exists, and /opt/mcp-hostagent is what install.sh makes, not what a test run has."""
    text = open(UNIT).read()
    assert "ExecStart=/opt/mcp-hostagent/bin/mcp-agent run --config /etc/mcp-hostagent/config.toml" in text
    path = tmp_path / "mcp-agent.service"
    path.write_text(text.replace("/opt/mcp-hostagent/bin/mcp-agent", VENV_AGENT))
    return path


def test_unit_passes_systemd_analyze_verify(unit_copy):
    r = analyze("verify", "--man=no", str(unit_copy), cwd=unit_copy.parent)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", (r.returncode, r.stdout, r.stderr)


def test_unit_security_exposure_is_ok(unit_copy):
    r = analyze("security", "--offline=true", "--no-pager", str(unit_copy), cwd=unit_copy.parent)
    m = re.search(r"Overall exposure level for mcp-agent\.service: ([\d.]+) (\w+)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr
    assert float(m.group(1)) <= 5.0, m.group(0)  # "OK" on systemd's scale; 4.8 when written


def test_unit_settings():
    text = open(UNIT).read()
    one = lambda k: unit_values(k, text)  # noqa: E731
    assert one("Type") == ["notify"] and one("NotifyAccess") == ["main"] and one("WatchdogSec")
    assert one("Restart") == ["on-failure"] and one("RestartPreventExitStatus") == ["2"]
    assert one("EnvironmentFile") == ["-/etc/mcp-hostagent/env"]
    assert one("ExecReload") == ["/bin/kill -HUP $MAINPID"]
    for k, v in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                 "UMask": "0027", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK"}.items():
        assert one(k) == [v], k
    rw = one("ReadWritePaths")[0].split()
    assert {"/var/lib/mcp-hostagent", "/run/mcp-hostagent", "/var/cache/mcp-hostagent", "/sys/kernel/tracing"} <= set(rw)
    assert one("CacheDirectory") == ["mcp-hostagent"] and one("CacheDirectoryMode") == ["0700"]
    assert one("MemoryMax") and one("AmbientCapabilities") == one("CapabilityBoundingSet")
    # the watchdog must outlast the slowest status tick (status.interval_s <= 60 s)
    from mcp_hostagent.config import setting
    assert one("WatchdogSec") == ["2min"] and setting("status.interval_s").max <= 60


def test_capabilities_are_the_measured_set():
    doc = open(SECURITY).read()
    m = re.search(r"Smallest set with every probe attached.*?\*\*((?:CAP_\w+ ?)+)\*\*", doc)
    assert m, "docs/SECURITY.md has no measured smallest set (run packaging/captest.py --write docs/SECURITY.md)"
    measured = m.group(1).split()
    assert sorted(unit_caps()) == sorted(measured)
    ds = open(DAEMONSET).read()
    add = re.search(r"add: \[(.*?)\]", ds).group(1)
    assert sorted("CAP_" + c.strip().strip('"') for c in add.split(",")) == sorted(measured)


def test_the_limits_admit_a_first_start_and_leave_room():
    """The compile charges ~157 MiB at a first start (one process, docs/SECURITY.md): the pod's and the
    unit's memory limits hold it with room for the steady ~100 MiB beside the SDK's queues."""
    ds = open(DAEMONSET).read()
    mem = int(re.search(r'limits: \{cpu: "?(\d+)"?, memory: (\d+)Mi\}', ds).group(2))
    assert mem >= 256
    unit = open(UNIT).read()
    high = int(re.search(r"^MemoryHigh=(\d+)M$", unit, re.M).group(1))
    assert high >= 256 and "COMPILE_SPLIT" not in ds


@pytest.mark.bpf
def test_agent_attaches_every_probe_with_exactly_the_unit_capabilities(tmp_path):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    caps = ",".join(["-all"] + ["+" + c[len("CAP_"):].lower() for c in unit_caps()])
    env = clean_env(MCP_AGENT_CONTROL_SOCKET=str(tmp_path / "agent.sock"))
    r = subprocess.run(["setpriv", "--inh-caps=-all", "--ambient-caps=-all", f"--bounding-set={caps}", "--",
                        "sh", "-c", "grep CapEff /proc/self/status >&2; exec \"$@\"", "sh",
                        *AGENT, "run", "--duration", "1", "--jsonl", "none", "--no-status"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    eff = int(re.search(r"CapEff:\s+([0-9a-f]+)", r.stderr).group(1), 16)
    assert bin(eff).count("1") == len(unit_caps()), hex(eff)
    counts = probe_counts(r.stderr)
    assert counts["missing"] == len(expected_missing()) and counts["attached"] >= len(expected_attached()), r.stderr
    assert "control:  " + str(tmp_path / "agent.sock") in r.stderr and "Traceback" not in r.stderr


# ---- sd_notify -------------------------------------------------------------------------------------

@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path):
    address = str(tmp_path / "notify") if request.param == "path" else f"@mcp-test-notify-{os.getpid()}-{time.monotonic_ns()}"
    s = NotifySocket(address)
    yield s
    s.close()


def test_sdnotify_ready_status_watchdog_stopping(notify_socket):
    n = sdnotify.Notifier({"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "30000000",
                           "WATCHDOG_PID": str(os.getpid())})
    assert n.enabled and n.watchdog and n.watchdog_usec == 30_000_000
    assert n.ready("probes 4/4 | requests 0")
    assert n.ping()
    assert n.status("probes 4/4 | requests 1") and not n.status("probes 4/4 | requests 1")  # unchanged: not resent
    assert n.reloading()
    assert n.stopping("stopping")
    assert notify_socket.wait("STOPPING", "1")
    got = [f for _, f in notify_socket.messages]
    assert got[0] == {"READY": "1", "STATUS": "probes 4/4 | requests 0"}
    assert got[1] == {"WATCHDOG": "1"}
    assert got[2] == {"STATUS": "probes 4/4 | requests 1"}
    assert set(got[3]) == {"RELOADING", "MONOTONIC_USEC"} and int(got[3]["MONOTONIC_USEC"]) > 0
    assert got[4] == {"STOPPING": "1", "STATUS": "stopping"}
    assert len(got) == 5 and n.sent == 5
    n.close()


def test_sdnotify_off_without_socket_and_watchdog_for_another_pid(notify_socket):
    off = sdnotify.Notifier({})
    assert not off.enabled and not off.ready() and not off.ping() and not off.stopping()
    other = sdnotify.Notifier({"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "1000000",
                               "WATCHDOG_PID": "1"})
    assert other.enabled and not other.watchdog and not other.ping()  # WatchdogSec meant for pid 1
    no_wd = sdnotify.Notifier({"NOTIFY_SOCKET": notify_socket.address})
    assert not no_wd.ping()
    assert sdnotify.Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled is False
    # a listener that went away: no exception, just False
    gone = sdnotify.Notifier({"NOTIFY_SOCKET": "/nonexistent/notify"})
    assert gone.enabled and gone.ready() is False
    time.sleep(0.2)
    assert notify_socket.messages == []


@pytest.mark.bpf
def test_run_ready_after_probes_attached_watchdog_and_stopping(tmp_path):
    notify = NotifySocket(f"@mcp-test-run-{os.getpid()}")
    errfile = tmp_path / "stderr"
    sock = tmp_path / "agent.sock"
    env = clean_env(NOTIFY_SOCKET=notify.address, WATCHDOG_USEC="2000000", MCP_AGENT_CONTROL_SOCKET=str(sock),
                    MCP_AGENT_STATUS_INTERVAL_S="0.2")
    at_ready = {}
    p = None

    def on_message(fields):  # runs as READY=1 arrives: what is true at that moment
        if fields.get("READY") == "1" and not at_ready:
            at_ready["stderr"] = errfile.read_text()  # a file, not a pipe: written before READY was sent
            at_ready["bpf"] = bpf_ids(p.pid)
            at_ready["socket"] = sock.exists()

    notify.hooks.append(on_message)
    try:
        with open(errfile, "w") as err:
            p = subprocess.Popen([*AGENT, "run", "--jsonl", "none"], env=env, stdout=subprocess.DEVNULL, stderr=err)
            ready = notify.wait("READY", "1", timeout=60)
            assert ready["STATUS"].startswith("probes "), ready
            lines = at_ready["stderr"].splitlines()
            assert any(ln.startswith("  export:   ") for ln in lines), lines
            assert any(ln.startswith("  control:  ") for ln in lines), lines
            counts = probe_counts(at_ready["stderr"])
            assert counts["missing"] == len(expected_missing()), counts
            assert len(at_ready["bpf"]["prog"]) >= expected_programs(), at_ready["bpf"]
            assert all(bpf_object_exists(BPF_PROG_GET_FD_BY_ID, i) for i in at_ready["bpf"]["prog"])
            assert at_ready["socket"]
            n_ready = len(notify.messages)
            notify.wait("WATCHDOG", "1", timeout=5, after=n_ready)
            notify.wait("STATUS", timeout=5, after=n_ready)
            # the DaemonSet's liveness probe, pointed at this agent's socket
            cmd = re.search(r'command: \["/opt/mcp-hostagent/bin/python", "-I", "-S", "-c",\s*"(.*)"\]',
                            open(DAEMONSET).read()).group(1)
            cmd = json.loads(f'"{cmd}"').replace("/run/mcp-hostagent/agent.sock", str(sock))
            assert subprocess.run([sys.executable, "-I", "-S", "-c", cmd], timeout=10).returncode == 0
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            stopping = notify.wait("STOPPING", "1", timeout=5)
            rc = p.wait(5)
        assert rc == 0 and time.monotonic() - t0 < 5
        assert "STATUS" in stopping
        keys = notify.keys()
        assert keys.index("READY") < keys.index("WATCHDOG") < keys.index("STOPPING")
        assert keys.count("READY") == 1 and "STOPPING" not in keys[:keys.index("READY")]
        assert errfile.read_text().splitlines()[-1].startswith("stopped: ")
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        notify.close()


def test_sdnotify_imports_nothing_heavy():
    r = subprocess.run([sys.executable, "-c", "import sys, mcp_hostagent.sdnotify; "
                        "print(sorted(m for m in sys.modules if m.startswith(('bcc', 'opentelemetry'))))"],
                       capture_output=True, text=True, env=clean_env())
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# ---- the Debian package -------------------------------------------------------------------------------

BUILD_DEB = os.path.join(REPO, "packaging", "build-deb.sh")
PREFIX = "/opt/mcp-hostagent"
CONFFILES = ["/etc/mcp-hostagent/config.toml", "/etc/mcp-hostagent/env", "/etc/logrotate.d/mcp-hostagent"]
WANTS = "/etc/systemd/system/multi-user.target.wants/mcp-agent.service"
STATE = "/var/lib/mcp-hostagent"  # also made by any agent run that writes the default JSONL file
# Everything the package or its maintainer scripts create (the unit's enablement and mask included).
INSTALLED = [PREFIX, "/etc/mcp-hostagent", STATE, "/lib/systemd/system/mcp-agent.service",
             "/usr/bin/mcp-agent", "/etc/logrotate.d/mcp-hostagent", "/usr/share/doc/mcp-hostagent",
             "/usr/share/mcp-hostagent",
             "/etc/systemd/system/mcp-agent.service", WANTS]
CACHE = "/var/cache/mcp-hostagent"  # the compile cache: an agent run from a source tree writes it too


def debian_version(v: str) -> str:
    return re.sub(r"[.-]?post(\d*)", r"+post\1", re.sub(r"[.-]?(a|b|rc|dev)(\d*)", r"~\1\2", v))


def host_arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()


def system_python_version() -> tuple[int, int]:
    out = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(*sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout
    return tuple(map(int, out.split()))


class Deb(NamedTuple):
    path: Path      # the .deb
    tree: Path      # its files (dpkg-deb -x)
    ctrl: Path      # its control files (dpkg-deb -e)
    workdir: Path   # holds the build's scratch directory


@pytest.fixture(scope="module")
def deb(tmp_path_factory):
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb not installed (Debian's dpkg package): cannot build the .deb")
    work = tmp_path_factory.mktemp("deb")
    scratch = work / "scratch"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TMPDIR"] = str(scratch)  # the build's scratch files, which nothing in the package may name
    r = subprocess.run(["bash", BUILD_DEB, "--out", str(work / "out")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    [path] = (work / "out").glob("*.deb")
    subprocess.run(["dpkg-deb", "-x", str(path), str(work / "tree")], check=True)
    subprocess.run(["dpkg-deb", "-e", str(path), str(work / "ctrl")], check=True)
    return Deb(path, work / "tree", work / "ctrl", work)


def test_deb_control_fields(deb):
    version, arch = debian_version(__version__), host_arch()
    assert deb.path.name == f"mcp-hostagent_{version}_{arch}.deb"
    out = subprocess.run(["dpkg-deb", "-f", str(deb.path)], capture_output=True, text=True, check=True).stdout
    f = dict(re.findall(r"^(\S+): (.*)$", out, re.M))
    assert f["Package"] == "mcp-hostagent" and f["Version"] == version and f["Architecture"] == arch
    major, minor = system_python_version()
    depends = [d.strip() for d in f["Depends"].split(",")]
    # the venv's python3 symlink and its lib/pythonX.Y, and the cpXY wheels, hold only for this version
    assert f"python3 (>= {major}.{minor}~)" in depends and f"python3 (<< {major}.{minor + 1})" in depends, depends
    assert {"python3-bpfcc", "libbpfcc"} <= set(depends), depends
    assert not [d for d in depends if d.split()[0] in ("bcc", "mcp-agent", "python3-venv", "python3-pip")]
    assert re.search(rf"(^|, )linux-headers-{arch} \| linux-headers-cloud-{arch}(,|$)", f["Recommends"]), f
    assert f["Maintainer"] and f["Description"] and int(f["Installed-Size"]) > 1000


def test_deb_files_conffiles_and_venv(deb):
    tree, ctrl = deb.tree, deb.ctrl
    listing = subprocess.run(["dpkg-deb", "-c", str(deb.path)], capture_output=True, text=True, check=True).stdout
    entries = {}
    for ln in listing.splitlines():
        perms, owner, _size, _date, _time, rest = ln.split(None, 5)
        path, _, target = rest.partition(" -> ")
        entries[path[1:].rstrip("/") or "/"] = (perms, owner, target)
    assert {owner for _, owner, _ in entries.values()} == {"root/root"}
    assert entries["/etc/mcp-hostagent/env"][0] == "-rw-------"
    assert entries["/etc/mcp-hostagent/config.toml"][0] == "-rw-r-----"
    assert entries["/usr/bin/mcp-agent"][2] == f"{PREFIX}/bin/mcp-agent"
    assert entries[f"{PREFIX}/bcc-only/bcc"][2] == "/usr/lib/python3/dist-packages/bcc"
    assert (ctrl / "conffiles").read_text().split() == CONFFILES
    for script in ("postinst", "prerm", "postrm"):
        assert os.access(ctrl / script, os.X_OK)
        assert (ctrl / script).read_text() == open(os.path.join(REPO, "packaging", "deb", script)).read()
    # the packaged copies are the repository's
    same = {"etc/mcp-hostagent/config.toml": "packaging/config.example.toml", "etc/mcp-hostagent/env": "packaging/env.example",
            "lib/systemd/system/mcp-agent.service": "packaging/mcp-agent.service",
            "etc/logrotate.d/mcp-hostagent": "packaging/logrotate",
            "usr/share/mcp-hostagent/grafana/mcp-agent-dashboard.json": "packaging/grafana/mcp-agent-dashboard.json",
            "usr/share/mcp-hostagent/prometheus/rules.yml": "packaging/prometheus/rules.yml",
            "usr/share/doc/mcp-hostagent/TELEMETRY.md": "docs/TELEMETRY.md"}
    for packaged, source in same.items():
        assert (tree / packaged).read_text() == open(os.path.join(REPO, source)).read(), packaged
    [exec_start] = unit_values("ExecStart")
    assert exec_start.split()[0] == f"{PREFIX}/bin/mcp-agent" and entries[exec_start.split()[0]][0].startswith("-rwx")
    # a venv for its final path: shebangs, pyvenv.cfg and the bcc .pth name /opt/mcp-hostagent
    venv = tree / PREFIX.lstrip("/")
    assert (venv / "bin" / "mcp-agent").read_text().splitlines()[0] == f"#!{PREFIX}/bin/python3"
    cfg = dict(ln.split(" = ", 1) for ln in (venv / "pyvenv.cfg").read_text().splitlines())
    assert cfg["home"] == "/usr/bin" and cfg["include-system-site-packages"] == "false"
    [pth] = venv.glob("lib/python3*/site-packages/debian_bcc.pth")
    assert pth.read_text() == f"{PREFIX}/bcc-only\n"
    site = pth.parent
    dists = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert {"mcp_hostagent", "click", "psutil", "pyroute2", "opentelemetry_sdk", "grpcio"} <= dists, dists
    assert not dists & {"pip", "setuptools", "wheel", "bcc", "mcp_agent", "pytest"}, dists
    # byte-code is the postinst's to make; nothing names the build's scratch directory or this checkout
    files = [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()]
    assert not [p for p in files if p.suffix == ".pyc" or "__pycache__" in p.parts]
    leaks = [p for p in files if str(deb.workdir).encode() in p.read_bytes() or REPO.encode() in p.read_bytes()]
    assert not leaks, leaks
    # md5sums: every shipped file but the conffiles, with its hash
    sums = dict(reversed(ln.split("  ", 1)) for ln in (ctrl / "md5sums").read_text().splitlines())
    assert set(sums) == {str(p.relative_to(tree)) for p in files} - {c.lstrip("/") for c in CONFFILES}
    assert all(hashlib.md5((tree / p).read_bytes()).hexdigest() == h for p, h in sums.items())


def install_blocker() -> str | None:
    """Why this host's own mcp-agent install must not be touched by a test that purges, if it has one."""
    if os.geteuid() != 0:
        return "needs root (dpkg -i)"
    st = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}", "mcp-hostagent"],
                        capture_output=True, text=True)
    if st.returncode == 0 and not st.stdout.startswith("un"):
        return f"mcp-hostagent is already known to dpkg here (status {st.stdout.strip()!r}); not touching it"
    there = [p for p in INSTALLED if os.path.lexists(p) and p != STATE]
    if there:
        return f"{', '.join(there)} already exist (an install from elsewhere), and purging would remove them"
    return None


def dpkg(*args: str, offline: bool = False) -> subprocess.CompletedProcess:
    cmd = ["dpkg", *args]
    if offline:  # a network namespace with no interface: installing must need no network
        cmd = ["unshare", "--net", *cmd]
    env = {**clean_env(), "DEBIAN_FRONTEND": "noninteractive"}
    deadline = time.monotonic() + 120
    while True:  # another dpkg or apt (a test elsewhere on this machine) holds the lock: wait
        r = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
        if r.returncode == 0 or "lock" not in r.stderr or time.monotonic() > deadline:
            return r
        time.sleep(2)


def left_behind(r: subprocess.CompletedProcess) -> list[str]:
    """Directories dpkg kept because something it does not know of was in them; /opt is only shared (no
    Debian package owns it, so this package is its owner of record, and other software lives there)."""
    dirs = re.findall(r"directory '([^']*)' not empty so not removed", r.stdout + r.stderr)
    return [d for d in dirs if d != "/opt"]


def dpkg_status() -> str:
    return subprocess.run(["dpkg-query", "-W", "-f", "${Status}", "mcp-hostagent"],
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.bpf
def test_deb_installs_offline_runs_upgrades_and_purges_clean(deb):
    if reason := install_blocker():
        pytest.skip(reason)
    offline = shutil.which("unshare") is not None and subprocess.run(["unshare", "--net", "true"]).returncode == 0
    # An agent run from a source tree may have left telemetry there; purge would delete it: set aside.
    kept = f"{STATE}.before-test-{os.getpid()}" if os.path.lexists(STATE) else None
    if kept:
        os.rename(STATE, kept)
    shutil.rmtree(CACHE, ignore_errors=True)  # derived data: whoever runs next compiles again
    try:
        r = dpkg("-i", str(deb.path), offline=offline)
        assert r.returncode == 0, r.stdout + r.stderr
        assert dpkg_status() == "install ok installed"
        v = subprocess.run(["/usr/bin/mcp-agent", "version"], env=clean_env(), capture_output=True, text=True,
                           timeout=60)
        assert v.returncode == 0 and v.stdout == f"mcp-agent (mcp-hostagent) {__version__}\n", v.stdout + v.stderr
        # bcc from python3-bpfcc, through the venv's bcc-only directory; nothing else from dist-packages
        b = subprocess.run([f"{PREFIX}/bin/python", "-c", "import bcc, sys; print(bcc.__file__); print(sys.path)"],
                           env=clean_env(), capture_output=True, text=True, check=True)
        assert b.stdout.startswith(f"{PREFIX}/bcc-only/bcc/") and "/usr/lib/python3/dist-packages" not in b.stdout
        # the installed tree attaches every probe this kernel has, with the installed config
        p = subprocess.run(["/usr/bin/mcp-agent", "probes", "--config", "/etc/mcp-hostagent/config.toml"],
                           env=clean_env(), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
        states = {ln.split()[0]: ln.split()[2] for ln in p.stdout.splitlines() if len(ln.split()) >= 3}
        assert all(states.get(name) == "attached" for name in expected_attached()), p.stdout
        # the compile workers' parts went to the compile cache, which only root may write
        assert oct(os.stat(f"{CACHE}/bpf").st_mode & 0o777) == "0o700"
        if shutil.which("systemd-analyze"):
            a = subprocess.run(["systemd-analyze", "verify", "--man=no", "/lib/systemd/system/mcp-agent.service"],
                               capture_output=True, text=True, timeout=60)
            assert a.returncode == 0 and a.stdout == "" and a.stderr == "", (a.returncode, a.stdout, a.stderr)
        if shutil.which("deb-systemd-helper"):  # enabled, as Debian enables a packaged service
            assert os.readlink(WANTS) == "/lib/systemd/system/mcp-agent.service"
        assert oct(os.stat(STATE).st_mode & 0o777) == "0o750"
        assert any(Path(PREFIX, "lib").rglob("cli.cpython-*.pyc")), "postinst compiled no byte-code"
        ver = subprocess.run(["dpkg", "-V", "mcp-hostagent"], capture_output=True, text=True)
        assert ver.returncode == 0 and ver.stdout == "", ver.stdout + ver.stderr
        if shutil.which("logrotate"):
            lr = subprocess.run(["logrotate", "-d", "/etc/logrotate.d/mcp-hostagent"], capture_output=True, text=True)
            assert lr.returncode == 0 and "error" not in lr.stderr.lower(), lr.stderr

        # an upgrade (here: the same version again) runs prerm/postinst and keeps a changed conffile
        with open("/etc/mcp-hostagent/config.toml", "a") as f:
            f.write("# changed by the admin\n")
        r = dpkg("-i", str(deb.path), offline=offline)
        assert r.returncode == 0, r.stdout + r.stderr
        assert open("/etc/mcp-hostagent/config.toml").read().endswith("# changed by the admin\n")
        assert os.stat("/etc/mcp-hostagent/env").st_mode & 0o777 == 0o600
        assert any(Path(PREFIX, "lib").rglob("cli.cpython-*.pyc"))

        # remove: the program goes, the configuration stays
        r = dpkg("-r", "mcp-hostagent")
        assert r.returncode == 0 and not left_behind(r), r.stdout + r.stderr
        assert dpkg_status() == "deinstall ok config-files"
        assert not [p for p in (PREFIX, "/usr/bin/mcp-agent", "/lib/systemd/system/mcp-agent.service")
                    if os.path.lexists(p)]
        assert os.path.exists("/etc/mcp-hostagent/config.toml") and os.path.isdir(STATE)

        # purge: nothing is left
        r = dpkg("--purge", "mcp-hostagent")
        assert r.returncode == 0 and not left_behind(r), r.stdout + r.stderr
        assert dpkg_status() in ("", "unknown ok not-installed")
        assert [p for p in INSTALLED + [CACHE] if os.path.lexists(p)] == []
        assert not list(Path("/var/lib/systemd").glob("deb-systemd-helper-*/**/mcp-agent.service*"))
    finally:
        if dpkg_status() not in ("", "unknown ok not-installed"):
            dpkg("--purge", "mcp-hostagent")
        if kept and not os.path.lexists(STATE):
            os.rename(kept, STATE)
