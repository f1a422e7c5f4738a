"""Collector credentials. OTLP over TLS and mTLS from the OTEL_EXPORTER_OTLP_* variables alone (gRPC and
HTTP, against loopback receivers with a throwaway CA made by the openssl CLI; a missing client
certificate or a wrong CA fails and is counted); export.headers_file (root-owned, 0600) validated as a
setting; and a canary token: the real `mcp-agent run` exports a marked request over mTLS with the token
from a headers file, the receiver sees the header, and the token appears nowhere else: not in the
agent's stdout/stderr, /proc/PID/cmdline, /proc/PID/environ, nor in the exported spans and metrics."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import time

import grpc
import pytest
from otlp_receiver import GrpcReceiver, HttpReceiver

from mcp_hostagent import config as C
from mcp_hostagent import otlpheaders
from test_cli import AGENT, TP, clean_env, lines

OTEL_TLS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_KEY",
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TIMEOUT",
            "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_INSECURE")


# ---- a throwaway PKI -------------------------------------------------------------------------------

def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _leaf(d, name: str, ca: str, usage: str, san: str = ""):
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text(f"extendedKeyUsage={usage}\nbasicConstraints=critical,CA:FALSE\n" + (f"subjectAltName={san}\n" if san else ""))
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", ext.name, cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
                 f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj", f"/CN=mcp test {ca}",
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _leaf(d, "server", "ca", "serverAuth", "IP:127.0.0.1,DNS:localhost")
    _leaf(d, "client", "ca", "clientAuth")
    return {k: str(d / k) for k in ("ca.crt", "other-ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


def receiver(kind: str, pki: dict, mtls: bool):
    if kind == "grpc":
        creds = grpc.ssl_server_credentials([(open(pki["server.key"], "rb").read(), open(pki["server.crt"], "rb").read())],
                                            root_certificates=open(pki["ca.crt"], "rb").read(),
                                            require_client_auth=mtls)
        return GrpcReceiver(creds)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki["server.crt"], pki["server.key"])
    if mtls:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki["ca.crt"])
    return HttpReceiver(ctx)


def tls_env(kind: str, endpoint: str, pki: dict, ca: str = "ca.crt", client: bool = True) -> dict:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_CERTIFICATE": pki[ca],
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc" if kind == "grpc" else "http/protobuf",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}
    if client:
        env.update(OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE=pki["client.crt"], OTEL_EXPORTER_OTLP_CLIENT_KEY=pki["client.key"])
    return env


def export_one(monkeypatch, env: dict, headers=None):
    """build_exporters from the environment only (no endpoint, protocol or credentials passed), one span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from mcp_hostagent.exporters import build_exporters

    for name in OTEL_TLS:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ex = build_exporters(None, None, otlp_headers=headers)
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(ex.span_exporter))
    with tp.get_tracer("tls-test").start_as_current_span("tls-probe"):
        pass
    tp.shutdown()
    return ex


@pytest.mark.parametrize("kind", ["grpc", "http"])
@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_tls_and_mtls_from_env_only(kind, mtls, pki, monkeypatch):
    with receiver(kind, pki, mtls) as rx:
        assert rx.endpoint.startswith("https://")
        ex = export_one(monkeypatch, tls_env(kind, rx.endpoint, pki, client=mtls))
        [span] = rx.wait_for_spans(1)
        assert span.span.name == "tls-probe"
        assert ex.stats.snapshot()["spans_exported"] == 1 and ex.stats.snapshot()["spans_failed"] == 0


@pytest.mark.parametrize("kind", ["grpc", "http"])
@pytest.mark.parametrize("case", ["mtls-without-client-cert", "wrong-ca"])
def test_tls_failures_are_failures(kind, case, pki, monkeypatch):
    with receiver(kind, pki, mtls=True) as rx:
        env = tls_env(kind, rx.endpoint, pki, ca="other-ca.crt" if case == "wrong-ca" else "ca.crt",
                      client=case != "mtls-without-client-cert")
        ex = export_one(monkeypatch, env)
        time.sleep(0.2)
        assert rx.spans() == []
        assert ex.stats.snapshot()["spans_failed"] == 1 and ex.stats.snapshot()["spans_exported"] == 0


# ---- export.headers_file -----------------------------------------------------------------------------

def write_headers(path, text: str, mode: int = 0o600, uid: int = 0) -> str:
    path.write_text(text)
    os.chmod(path, mode)
    os.chown(path, uid, 0)
    return str(path)


def test_headers_file_parsing(tmp_path):
    p = write_headers(tmp_path / "h", "# token\n\nAuthorization = Bearer abc=def\nx-tenant=a%20b, x-other=1\n")
    assert otlpheaders.read_headers_file(p) == {"authorization": "Bearer abc=def", "x-tenant": "a b", "x-other": "1"}
    assert C.load_config(None, env={}, overrides={"export.headers_file": p}).export_headers_file == p


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown the file")
@pytest.mark.parametrize("text,mode,uid,words", [
    ("authorization=Bearer s3cr3t-canary\n", 0o640, 0, ["mode 0640", "chmod 0600"]),
    ("authorization=Bearer s3cr3t-canary\n", 0o604, 0, ["mode 0604"]),
    ("authorization=Bearer s3cr3t-canary\n", 0o600, 65534, ["owned by root", "uid 65534"]),
    ("Bearer s3cr3t-canary\n", 0o600, 0, ["line 1", "name=value"]),
    ("authorization=\n", 0o600, 0, ["line 1", "empty value"]),
    ("# only a comment\n", 0o600, 0, ["no headers"]),
    ("bad name=s3cr3t-canary\n", 0o600, 0, ["line 1"]),
    ("authorization=Bearer s3cr3t-canary\x7f\n", 0o600, 0, ["control characters"]),
], ids=["group-readable", "other-readable", "not-root", "no-equals", "empty", "empty-file", "bad-name", "ctl"])
def test_headers_file_rejected_without_echoing_it(tmp_path, text, mode, uid, words):
    p = write_headers(tmp_path / "h", text, mode, uid)
    with pytest.raises(C.ConfigError) as e:
        C.load_config(None, env={"MCP_AGENT_EXPORT_HEADERS_FILE": p})
    msg = str(e.value)
    assert msg.startswith("config error: MCP_AGENT_EXPORT_HEADERS_FILE=") and "\n" not in msg
    for w in words:
        assert w in msg, msg
    assert "s3cr3t" not in msg, msg


def test_headers_file_missing_or_a_directory(tmp_path):
    for p, word in ((tmp_path / "nope", "no such file"), (tmp_path, "not a regular file")):
        with pytest.raises(C.ConfigError, match=word):
            C.load_config(None, env={}, overrides={"export.headers_file": str(p)})


def test_headers_go_to_the_exporters_over_the_env(pki, monkeypatch):
    with receiver("grpc", pki, mtls=False) as rx:
        env = tls_env("grpc", rx.endpoint, pki, client=False)
        env["OTEL_EXPORTER_OTLP_HEADERS"] = "x-from-env=1,authorization=from-env"
        ex = export_one(monkeypatch, env, headers={"Authorization": "Bearer from-file"})
        rx.wait_for_spans(1)
        assert rx.headers[0]["authorization"] == "Bearer from-file" and rx.headers[0]["x-from-env"] == "1"
        assert "otlp headers: authorization (from export.headers_file; values not shown)" in ex.describe()


# ---- the canary ----------------------------------------------------------------------------------------

@pytest.mark.bpf
@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_canary_token_reaches_the_collector_and_nothing_else(kind, pki, tmp_path):
    from mcp_hostagent import marker

    canary = f"mcp-canary-{os.urandom(12).hex()}"
    headers = write_headers(tmp_path / "otlp-headers", f"authorization=Bearer {canary}\n")
    cfg = tmp_path / "config.toml"
    jsonl = tmp_path / "telemetry.jsonl"
    cfg.write_text(f'[export]\nheaders_file = "{headers}"\njsonl_path = "{jsonl}"\nmetric_interval_s = 0.5\n'
                   f'[control]\nsocket = "{tmp_path / "agent.sock"}"\n[process]\nwatch = "marked"\n')
    with receiver(kind, pki, mtls=True) as rx:
        env = clean_env(**tls_env(kind, rx.endpoint, pki))
        p = subprocess.Popen([*AGENT, "run", "--config", str(cfg), "--no-status", "--console"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(tmp_path / "agent.sock"):  # bound after every start-up line is out
                assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
                time.sleep(0.05)
            with marker.request(traceparent=TP) as rid:
                pass
            rx.wait_for(lambda: any(s.attributes.get("hostagent.request.id") == f"{rid:016x}" for s in rx.spans()), 20)
            rx.wait_for_metric("hostagent.agent.spans.exported", 10)
            cmdline = open(f"/proc/{p.pid}/cmdline", "rb").read()
            environ = open(f"/proc/{p.pid}/environ", "rb").read()
            children = [open(f"/proc/{c}/environ", "rb").read()
                        for c in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=10)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 0, err
    # the collector got it, on every request
    assert rx.headers and all(h.get("authorization") == f"Bearer {canary}" for h in rx.headers)
    # ... and nothing else did
    tok = canary.encode()
    assert canary not in out and canary not in err, "canary in the agent's output"
    assert "mcp-canary" not in out + err
    assert tok not in cmdline and tok not in environ and not any(tok in e for e in children)
    exported = b"".join(r.SerializeToString() for r in rx.trace_requests + rx.metrics_requests)
    assert exported and tok not in exported, "canary in the exported telemetry"
    assert jsonl.exists() and tok not in jsonl.read_bytes()
    # and the agent did say where the headers came from (names only)
    assert "  export:   otlp headers: authorization (from export.headers_file; values not shown)" in lines(err)
