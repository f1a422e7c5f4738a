"""Packaging: the systemd unit passes `systemd-analyze verify` (and its offline security review), its
capabilities are the measured set of docs/SECURITY.md (the DaemonSet's too) and the agent attaches every
probe with exactly that set; sd_notify against a real datagram socket; `mcp-agent run` under a
NOTIFY_SOCKET says READY=1 only once the probes are attached and its start-up lines are written, pings
the watchdog, and says STOPPING=1 at SIGTERM; install.sh stages a working install."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from notify_listener import NotifySocket

from mcp_hostagent import sdnotify
from test_cli import (AGENT, BPF_PROG_GET_FD_BY_ID, bpf_ids, bpf_object_exists, clean_env, expected_attached,
                      probe_counts)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    assert {"/var/lib/mcp-hostagent", "/run/mcp-hostagent", "/sys/kernel/tracing"} <= set(rw)
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
    assert counts["missing"] == 0 and counts["attached"] >= len(expected_attached()), r.stderr
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
            assert counts["missing"] == 0, counts
            assert len(at_ready["bpf"]["prog"]) >= len(expected_attached()), at_ready["bpf"]
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


# ---- install.sh --------------------------------------------------------------------------------------

def test_install_sh_stages_a_working_install(tmp_path):
    root = tmp_path / "root"
    r = subprocess.run(["bash", os.path.join(REPO, "packaging", "install.sh"), "--root", str(root)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    etc = root / "etc" / "mcp-hostagent"
    assert (etc / "env").stat().st_mode & 0o777 == 0o600
    assert (etc / "config.toml").stat().st_mode & 0o777 == 0o640
    assert (etc / "config.toml").read_text() == open(os.path.join(REPO, "packaging", "config.example.toml")).read()
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in (etc / "env").read_text()
    assert (root / "etc/systemd/system/mcp-agent.service").read_text() == open(UNIT).read()
    prefix = root / "opt" / "mcp-hostagent"
    assert os.readlink(prefix / "bcc-only" / "bcc") == "/usr/lib/python3/dist-packages/bcc"
    [pth] = list(prefix.glob("lib/python3*/site-packages/debian_bcc.pth"))
    assert pth.read_text() == "/opt/mcp-hostagent/bcc-only\n"
    v = subprocess.run([str(prefix / "bin" / "mcp-agent"), "version"], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and v.stdout.startswith("mcp-agent (mcp-hostagent) "), v.stderr
    # the installed config is valid as it stands
    s = subprocess.run([str(prefix / "bin" / "mcp-agent"), "run", "--show-config", "--config", str(etc / "config.toml")],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert s.returncode == 0, s.stderr
