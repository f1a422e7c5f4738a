"""Exposure (docs/SECURITY.md, "Threat model: exposure"): secrets leaking into telemetry and logs, and
what an unprivileged local user can do to the JSONL file and the control socket. Attackers are real
processes run as uid/gid 4242 (setpriv), on real files and sockets; no BPF."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from mcp_hostagent import config as C
from mcp_hostagent import control
from mcp_hostagent.core import traceparent
from mcp_hostagent.exporters import build_exporters
from mcp_hostagent.exporters.files import UnsafeFileError, check_jsonl_path
from mcp_hostagent.exporters.jsonl import JsonlSpanExporter, JsonlWriter
from mcp_hostagent.core.identity import ProcessRegistry
from mcp_hostagent.otlpheaders import check_env_headers
from mcp_hostagent.redact import command_line, redact_argv, redact_text, redact_url
from mcp_hostagent.telemetry.snapshot import SnapshotBuilder
from mcp_hostagent.core.health import AgentHealth
from test_cli import clean_env

ATTACKER = 4242
AS_ATTACKER = ["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups"]
CLI = [os.path.join(os.path.dirname(sys.executable), "mcp-agent")]
CANARY = "c4n4ry-s3cret"

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to run an attacker as another uid")


def as_attacker(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*AS_ATTACKER, *argv], capture_output=True, text=True, timeout=60, check=True, **kw)


@pytest.fixture
def shared_dir():
    """A directory like /tmp: world-writable with the sticky bit (pytest's tmp_path is root's 0700)."""
    d = tempfile.mkdtemp(prefix="mcp-exposure-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


# ---- 1. process.command_line -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, want", [
    (["serve", "--api-key=abc123"], ["serve", "--api-key=***"]),
    (["serve", "--API_KEY=abc"], ["serve", "--API_KEY=***"]),
    (["serve", "--token", "xyz"], ["serve", "--token", "***"]),
    (["serve", "-token", "xyz", "-v"], ["serve", "-token", "***", "-v"]),
    (["serve", "--password=p", "--passwd", "q"], ["serve", "--password=***", "--passwd", "***"]),
    (["serve", "--client-secret", "s", "--model", "m"], ["serve", "--client-secret", "***", "--model", "m"]),
    (["serve", "--hf-credentials=/x", "--auth", "b"], ["serve", "--hf-credentials=***", "--auth", "***"]),
    (["env", "API_KEY=abc", "HF_TOKEN=t", "HOME=/root", "serve"], ["env", "API_KEY=***", "HF_TOKEN=***", "HOME=/root", "serve"]),
    (["serve", "--url", "https://user:pw@host:8080/x"], ["serve", "--url", "https://user:***@host:8080/x"]),
    (["serve", "--upstream=http://tok@host/"], ["serve", "--upstream=http://***@host/"]),
    (["serve", "--token", "--verbose"], ["serve", "--token", "--verbose"]),  # an option is not a value
    (["serve", "--token"], ["serve", "--token"]),  # at the end: nothing to hide
    (["python", "-m", "vllm", "--port", "8000", "--model", "m"], ["python", "-m", "vllm", "--port", "8000", "--model", "m"]),
    (["/usr/bin/authd", "x"], ["/usr/bin/authd", "x"]),  # argv[0] is a program, not a setting
    (["serve", "a=b=c"], ["serve", "a=b=c"]),
    (["serve", "--url", "https://u:p@ss@host/x"], ["serve", "--url", "https://u:***@host/x"]),  # "@" in the password
    (["curl", "-H", "Authorization: Bearer abc.def"], ["curl", "-H", "Authorization: ***"]),
    (["curl", "--header", "X-Api-Key:k1"], ["curl", "--header", "X-Api-Key: ***"]),
    (["curl", "-H", "Accept: text/plain"], ["curl", "-H", "Accept: text/plain"]),
    ([], []),
])
def test_redact_argv_table(argv, want):
    assert redact_argv(argv) == want


@pytest.mark.parametrize("text, want", [
    ("http://user:secret@collector:4317", "http://user:***@collector:4317"),
    ("https://tok@github.com/o/r.git", "https://***@github.com/o/r.git"),
    ("http://collector:4317", "http://collector:4317"),
    ("http://[::1]:4317", "http://[::1]:4317"),
    ('"http://u:p@h", "a@b"', '"http://u:***@h", "a@b"'),
    ("git@github.com:o/r.git", "git@github.com:o/r.git"),
])
def test_redact_url_table(text, want):
    assert redact_url(text) == want


@pytest.mark.parametrize("text, want", [
    ("Failed to export traces to user:secret@collector:4317, error code", "Failed to export traces to user:***@collector:4317, error code"),
    ("DNS resolution failed for user:secret@h:4317", "DNS resolution failed for user:***@h:4317"),
    ("to http://user:secret@h", "to http://user:***@h"),
    ("no userinfo here: h:4317", "no userinfo here: h:4317"),
])
def test_redact_text_table(text, want):
    assert redact_text(text) == want


def test_command_line_modes():
    argv = ["serve", "--token", "t0k"]
    assert command_line(argv) == "serve --token '***'"
    assert command_line(argv, "full") == "serve --token t0k"
    assert command_line(argv, "off") is None
    assert command_line([], "redacted") is None


def test_command_line_setting():
    assert C.load_config(None, env={}).process_command_line == "redacted"
    cfg = C.load_config(None, env={"MCP_AGENT_PROCESS_COMMAND_LINE": "full"})
    assert cfg.process_command_line == "full" and cfg.sources["process.command_line"] == "env:MCP_AGENT_PROCESS_COMMAND_LINE"
    with pytest.raises(C.ConfigError) as e:
        C.load_config(None, env={"MCP_AGENT_PROCESS_COMMAND_LINE": "everything"})
    assert str(e.value) == ('config error: MCP_AGENT_PROCESS_COMMAND_LINE="everything": '
                            "must be one of redacted, full, off")
    assert "\n" not in str(e.value)


def test_identity_redacts_a_real_process_argv():
    secret_argv = ["--api-key=" + CANARY, "--token", CANARY + "2", f"https://bob:{CANARY}3@models.local/x",
                   f"DB_PASSWORD={CANARY}4", "--model", "llama"]
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *secret_argv])
    try:
        deadline = time.monotonic() + 10
        while CANARY not in Path(f"/proc/{p.pid}/cmdline").read_text() and time.monotonic() < deadline:
            time.sleep(0.02)  # until exec has put the new argv in place
        attrs = ProcessRegistry().attributes(ProcessRegistry().lookup(p.pid))
        cl = attrs["process.command_line"]
        assert CANARY not in cl
        assert "--api-key=***" in cl and "--token '***'" in cl and "https://bob:***@models.local/x" in cl
        assert "DB_PASSWORD=***" in cl and "--model llama" in cl
        full = ProcessRegistry(command_line="full")
        assert CANARY + "2" in full.attributes(full.lookup(p.pid))["process.command_line"]
        off = ProcessRegistry(command_line="off")
        info = off.lookup(p.pid)
        assert "process.command_line" not in off.attributes(info) and info.exe_name
        assert off.lookup(p.pid) is info  # cached: "off" is not an exec in progress
    finally:
        p.kill()
        p.wait()


# ---- 2. the JSONL file -----------------------------------------------------------------------------

@pytest.fixture
def victim(tmp_path):
    """A root-owned file the attacker would like the agent to append to."""
    v = tmp_path / "victim"
    v.write_text("root's data\n")
    v.chmod(0o600)
    return v


@needs_root
def test_jsonl_refuses_a_symlink_planted_by_another_user(shared_dir, victim):
    path = shared_dir / "telemetry.jsonl"
    as_attacker("ln", "-s", str(victim), str(path))
    assert path.is_symlink() and os.lstat(path).st_uid == ATTACKER
    with pytest.raises(UnsafeFileError, match="symbolic link; not following it"):
        check_jsonl_path(path)
    writer = JsonlWriter(path)
    exporter = JsonlSpanExporter(writer)
    for _ in range(3):  # refused at each (re)open, counted, and never raised into the SDK
        assert exporter.export([]).name == "FAILURE"
    assert writer.refused == 3 and writer.write_errors == 3 and writer.lines_written == 0
    assert victim.read_text() == "root's data\n"


@needs_root
def test_jsonl_refuses_a_file_precreated_by_another_user(shared_dir):
    path = shared_dir / "telemetry.jsonl"
    as_attacker("sh", "-c", f"umask 0; touch {path}")  # 0666, the attacker's: they would read every line
    with pytest.raises(UnsafeFileError, match=f"owned by uid {ATTACKER}"):
        check_jsonl_path(path)
    with pytest.raises(UnsafeFileError):
        JsonlWriter(path).write_line("{}")
    assert path.read_bytes() == b""


@needs_root
def test_jsonl_start_refusal_is_one_line_from_the_real_cli(shared_dir, victim):
    path = shared_dir / "telemetry.jsonl"
    as_attacker("ln", "-s", str(victim), str(path))
    r = subprocess.run([*CLI, "run", "--jsonl", str(path), "--duration", "1", "--no-status"],
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("mcp-agent: error: ")]
    assert errors == [f"mcp-agent: error: export.jsonl_path {path}: {path} is a symbolic link; not following it"]
    assert victim.read_text() == "root's data\n"


def test_jsonl_refuses_group_or_other_access_and_hard_links(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("")
    for mode in (0o644, 0o660, 0o604, 0o4600):
        path.chmod(mode)
        with pytest.raises(UnsafeFileError, match=f"mode {mode:04o}, more than 0640"):
            check_jsonl_path(path)
    for mode in (0o600, 0o640, 0o400):
        path.chmod(mode)
        if mode & 0o200:
            check_jsonl_path(path)
    path.chmod(0o600)
    os.link(path, tmp_path / "other-name")
    with pytest.raises(UnsafeFileError, match="2 hard links"):
        check_jsonl_path(path)


def test_jsonl_refuses_a_directory_others_can_write(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)  # no sticky bit: anyone may rename our file away and put theirs in its place
    with pytest.raises(UnsafeFileError, match=r"directory .*/open is writable by group or others \(mode 0777\)"):
        check_jsonl_path(d / "t.jsonl")
    assert not (d / "t.jsonl").exists()
    d.chmod(0o1777)
    check_jsonl_path(d / "t.jsonl")  # sticky (like /tmp): only we may remove or rename our file
    assert stat.S_IMODE(os.stat(d / "t.jsonl").st_mode) & 0o137 == 0


@needs_root
def test_jsonl_swap_at_rotation_is_counted_and_writing_resumes(shared_dir, victim):
    path = shared_dir / "telemetry.jsonl"
    writer = JsonlWriter(path)
    writer.write_line('{"n":1}')
    os.rename(path, shared_dir / "telemetry.jsonl.1")  # logrotate
    as_attacker("ln", "-s", str(victim), str(path))  # in the moment before the agent reopens
    with pytest.raises(UnsafeFileError):
        writer.write_line('{"n":2}')
    assert writer.refused == 1 and victim.read_text() == "root's data\n"
    os.unlink(path)  # the admin removes it; the agent goes on without a restart
    writer.write_line('{"n":3}')
    assert path.read_text() == '{"n":3}\n' and writer.lines_written == 2
    assert os.stat(path).st_uid == 0 and stat.S_IMODE(os.stat(path).st_mode) & 0o137 == 0


# ---- 3. endpoint userinfo and OTEL_EXPORTER_OTLP_HEADERS -------------------------------------------

def test_show_config_redacts_endpoint_userinfo():
    r = subprocess.run([*CLI, "run", "--show-config", "--otlp-endpoint", f"http://user:{CANARY}@collector:4317"],
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert 'export.otlp_endpoint = "http://user:***@collector:4317" (flag)' in r.stdout.splitlines()
    assert CANARY not in r.stdout + r.stderr
    r = subprocess.run([*CLI, "run", "--show-config"], capture_output=True, text=True, timeout=60,
                       env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"https://{CANARY}@collector:4318"))
    assert 'export.otlp_endpoint = "https://***@collector:4318" (env:OTEL_EXPORTER_OTLP_ENDPOINT)' in r.stdout
    assert CANARY not in r.stdout + r.stderr


def test_config_error_about_an_endpoint_hides_its_password():
    r = subprocess.run([*CLI, "run", "--show-config", "--otlp-endpoint", f"http://user:{CANARY}@collector:port"],
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith('mcp-agent: error: config error: export.otlp_endpoint = "http://user:***@collector:port"')
    assert CANARY not in r.stdout + r.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_exporter_banner_and_logs_redact_endpoint_userinfo(protocol, caplog):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    with socket.socket() as s:  # a port nothing listens on: every export fails and is logged
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ex = build_exporters(None, f"http://user:{CANARY}@127.0.0.1:{port}", protocol, otlp_timeout_s=0.5)
    assert ex.describe() == [f"otlp {protocol}: http://user:***@127.0.0.1:{port}"]
    spans = []

    class Grab:
        def export(self, batch):
            spans.extend(batch)

        def shutdown(self):
            pass

        def force_flush(self, timeout_millis=0):
            return True

    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(Grab()))
    tp.get_tracer("t").start_span("s").end()
    with caplog.at_level(logging.DEBUG):
        assert ex.span_exporter.export(spans).name == "FAILURE"
    exporter_records = [r for r in caplog.records if r.name.startswith("opentelemetry.exporter.otlp")]
    assert exporter_records, [r.getMessage() for r in caplog.records]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert CANARY not in text
    if protocol == "grpc":  # the gRPC exporter names its target: user:***@127.0.0.1:port
        assert f"user:***@127.0.0.1:{port}" in text
    ex.span_exporter.shutdown()


@pytest.mark.parametrize("value, error", [
    ("authorization=Bearer abc", None),
    ("authorization=Bearer%20abc,x-tenant=t1", None),
    ("  a=1 , b=2 ,", None),
    ("Authorization:Bearer abc", "header 'authorization': written name:value"),
    ("x-tenant=t1,Authorization: Bearer abc", "header 'authorization': written name:value"),
    ('authorization=Bearer "abc"', "header 'authorization': the value has characters"),
    ("authorization=a;b", "header 'authorization': the value has characters"),
    ("Bearer abc", "entry 1 of the comma-separated list is not name=value"),
    ("a=1,just-a-token", "entry 2 of the comma-separated list is not name=value"),
])
def test_env_headers_table(value, error, caplog):
    from opentelemetry.util.re import parse_env_headers

    with caplog.at_level(logging.WARNING, logger="opentelemetry.util.re"):
        parse_env_headers(value, liberal=True)  # the SDK's parser, as both exporters call it
    if error is None:
        check_env_headers("OTEL_EXPORTER_OTLP_HEADERS", value)
        assert not caplog.records  # what we accept, the SDK parses without a warning
        return
    assert caplog.records  # and what we refuse, the SDK would have logged, value included
    with pytest.raises(ValueError) as e:
        check_env_headers("OTEL_EXPORTER_OTLP_HEADERS", value)
    msg = str(e.value)
    assert msg.startswith("OTEL_EXPORTER_OTLP_HEADERS: ") and error in msg and "\n" not in msg
    assert "abc" not in msg and "Bearer" not in msg and "t1" not in msg


def test_colon_headers_refused_by_the_real_cli_without_the_token():
    for var in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        r = subprocess.run([*CLI, "run", "--show-config", "--otlp-endpoint", "http://collector:4317"],
                           env=clean_env(**{var: f"Authorization:Bearer {CANARY}"}),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.splitlines() == [
            f"mcp-agent: error: config error: {var}: header 'authorization': written name:value; "
            "OTLP headers are name=value (e.g. authorization=...); the value is not shown"]
        assert CANARY not in r.stdout + r.stderr


# ---- 4. the control socket -------------------------------------------------------------------------

ATTACK = r"""
import json, socket, sys, time
path, n, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conns, refused = [], 0
for i in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    conns.append(s)
    time.sleep(0.05)
live, cut = {}, []
t0 = time.monotonic()
for s in conns:
    s.setblocking(False)
    try:
        data = s.recv(4096)
    except BlockingIOError:
        live[s] = t0
        continue
    refused += b"too many clients of this uid" in data
print("ready", flush=True)
while live and time.monotonic() - t0 < 30:
    for s in list(live):
        try:
            s.send(b"x")  # one byte of a request that never ends
        except OSError:
            cut.append(time.monotonic() - t0)
            del live[s]
            continue
        try:
            if s.recv(4096) == b"":
                cut.append(time.monotonic() - t0)
                del live[s]
        except BlockingIOError:
            pass
        except OSError:
            cut.append(time.monotonic() - t0)
            del live[s]
    time.sleep(period)
print(json.dumps({"accepted": n - refused, "refused": refused, "cut_after": cut, "still_open": len(live)}))
"""


@pytest.fixture
def socket_dir():
    d = tempfile.mkdtemp(prefix="mcp-ctl-", dir="/tmp")
    os.chmod(d, 0o755)  # the attacker may reach the socket, whose mode and group decide
    yield d
    shutil.rmtree(d, ignore_errors=True)


def client_threads() -> int:
    return sum(t.name == "mcp-control-client" for t in threading.enumerate())


@needs_root
def test_control_socket_deadline_and_per_uid_limit_against_an_unprivileged_client(socket_dir):
    health = AgentHealth()
    path = os.path.join(socket_dir, "agent.sock")
    srv = control.ControlServer(SnapshotBuilder(), path, group=ATTACKER, max_clients=8, max_per_uid=3,
                                deadline_s=3.0, idle_timeout_s=30.0, rejected=health.rejected)
    srv.start()
    try:
        assert os.stat(path).st_gid == ATTACKER
        attack = subprocess.Popen([*AS_ATTACKER, "/usr/bin/python3", "-c", ATTACK, path, "8", "0.5"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert attack.stdout.readline() == "ready\n", attack.stderr.read()
        # the attack holds every slot its uid may have; root's `top` still gets its snapshot, at once
        t0 = time.monotonic()
        for _ in range(3):
            snap = control.fetch_snapshot(path, timeout_s=2.0)
            assert snap.source == "socket"
        assert time.monotonic() - t0 < 1.0
        deadline = time.monotonic() + 1
        while client_threads() > 3 and time.monotonic() < deadline:  # root's last one is closing
            time.sleep(0.02)
        assert client_threads() == 3  # the attacker's three; refused connections cost no thread
        out, err = attack.communicate(timeout=60)
        result = json.loads(out.splitlines()[-1])
        assert result["accepted"] == 3 and result["refused"] == 5 and result["still_open"] == 0, (result, err)
        # trickling a byte every 0.5 s (far inside the 30 s idle timeout) is cut at the 3 s deadline
        assert all(2.5 <= t <= 5.0 for t in result["cut_after"]), result
        assert health.rejected["control_uid_limit"] == 5
        assert health.rejected["control_deadline"] == 3
        deadline = time.monotonic() + 2
        while client_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client_threads() == 0
        assert control.fetch_snapshot(path).source == "socket"
    finally:
        srv.stop()


def test_control_socket_total_client_limit(tmp_path):
    rejected = Counter()
    path = str(tmp_path / "agent.sock")
    srv = control.ControlServer(SnapshotBuilder(), path, max_clients=2, max_per_uid=5, rejected=rejected)
    srv.start()
    held = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(b"ping\n")
            assert json.loads(s.makefile("rb").readline())["ok"]
            held.append(s)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            assert json.loads(s.makefile("rb").readline()) == {"error": "too many clients"}
        assert rejected == Counter(control_too_many_clients=1)
    finally:
        for s in held:
            s.close()
        srv.stop()


def test_control_socket_deeply_nested_json_is_one_error_line(tmp_path, capfd):
    seen = []
    old_hook, threading.excepthook = threading.excepthook, seen.append
    rejected = Counter()
    path = str(tmp_path / "agent.sock")
    srv = control.ControlServer(SnapshotBuilder(), path, rejected=rejected)
    srv.start()
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            f = s.makefile("rb")
            deep = b'{"op":' + b"[" * 2040 + b"]" * 2040 + b"}\n"  # within MAX_REQUEST, deeper than the recursion limit
            assert len(deep) <= control.MAX_REQUEST
            s.sendall(deep)
            assert json.loads(f.readline()) == {"error": "JSON nested too deep"}
            s.sendall(b'{"op":' + b"[" * 3000 + b"\n")  # unclosed, too
            assert json.loads(f.readline()) == {"error": "JSON nested too deep"}
            s.sendall(b'{"op":"ping"}\n')  # the connection is still served
            assert json.loads(f.readline())["ok"] is True
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(b'{"op":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
            assert json.loads(s.makefile("rb").readline()) == {"error": "request too long"}
        assert rejected == Counter(control_nested_json=2, control_request_too_long=1)
    finally:
        srv.stop()
        threading.excepthook = old_hook
    assert not seen
    assert "Traceback" not in capfd.readouterr().err


# ---- 5. traceparent --------------------------------------------------------------------------------

TP = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("raw, ok", [
    (TP, True),
    (TP + b"\n", False),  # "$" used to match before a final newline
    (TP + b"\r\n", False),
    (b"\n" + TP, False),
    (TP + b"\x00", False),
    (TP + b"-extra", False),
    (b"ff" + TP[2:], False),
    (b"00-" + b"0" * 32 + TP[35:], False),
    (TP.upper(), False),
    (b"", False),
])
def test_traceparent_table(raw, ok):
    assert (traceparent.parse(raw) is not None) is ok
