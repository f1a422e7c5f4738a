"""Reliability of the real `mcp-agent run`: a collector outage (the loopback receiver refusing, then
killed, ~20 s in all) with spans counted exactly against what the receiver got, bounded memory, export
back within 30 s; SIGTERM during an outage still exits within 5 s with nothing left attached; SIGHUP
reloads a good config, keeps the old one on a bad one or on one that fails to start (counted);
kill -9 then restart leaves nothing stale. Config fuzzing (hypothesis) on the loader, and 60
malformed config files through the CLI: exit 2, one line, no traceback."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import threading
import time

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from notify_listener import NotifySocket
from otlp_receiver import GrpcReceiver

from mcp_hostagent import config as C
from mcp_hostagent import marker
from mcp_hostagent.cli import _checked, main
from mcp_hostagent.exporters.files import metrics_path
from test_cli import (AGENT, BPF_MAP_GET_FD_BY_ID, BPF_PROG_GET_FD_BY_ID, ERROR, bpf_ids, bpf_object_exists, clean_env,
                      expected_attached, expected_missing, expected_programs, lines, probe_counts)

STOPPED = re.compile(r"stopped: probes \d+/\d+ \| requests \d+ open \d+ \| spans exported (\d+) dropped (\d+) \| "
                     r"lost kernel (\d+) user (\d+)")


class Agent:
    """`mcp-agent run` as a child: stderr to a file (ordered against sd_notify), READY/STOPPING over a
    notify socket, its control socket in tmp_path."""

    def __init__(self, tmp_path, *args: str, env: dict | None = None, name: str = "agent"):
        self.notify = NotifySocket(f"@mcp-test-{name}-{os.getpid()}-{time.monotonic_ns()}")
        self.errpath = tmp_path / f"{name}.stderr"
        self.sock = tmp_path / f"{name}.sock"
        e = clean_env(NOTIFY_SOCKET=self.notify.address, MCP_AGENT_CONTROL_SOCKET=str(self.sock), **(env or {}))
        with open(self.errpath, "w") as err:
            self.p = subprocess.Popen([*AGENT, "run", "--no-status", *args], env=e, stdout=subprocess.DEVNULL, stderr=err)

    @property
    def stderr(self) -> str:
        return self.errpath.read_text()

    def ready(self, n: int = 1, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while sum(1 for _, f in self.notify.messages if f.get("READY") == "1") < n:
            assert self.p.poll() is None, self.stderr
            assert time.monotonic() < deadline, f"no READY=1 #{n}:\n{self.stderr}"
            time.sleep(0.02)

    def rss_kb(self) -> int:
        with open(f"/proc/{self.p.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))

    def term(self, within: float = 5.0) -> tuple[int, float]:
        t0 = time.monotonic()
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(within)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {within} s after SIGTERM:\n{self.stderr}")
        return rc, time.monotonic() - t0

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        self.notify.close()


class Marker:
    """Marks requests at `rate` per second on a thread; remembers every request id."""

    def __init__(self, rate: float = 50):
        self.ids: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(1 / rate,), daemon=True)
        self._t.start()

    def _run(self, period: float) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            with marker.request() as rid:
                pass
            self.ids.append(f"{rid:016x}")
            nxt += period
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


def gone(held: dict) -> dict:
    """The BPF programs and maps of `held` still alive in the kernel, waiting up to 5 s for the last."""
    deadline = time.monotonic() + 5
    while True:
        left = {k: {i for i in ids if bpf_object_exists(cmd, i)}
                for (k, ids), cmd in zip(held.items(), (BPF_PROG_GET_FD_BY_ID, BPF_MAP_GET_FD_BY_ID))}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def jsonl_requests(path) -> list[dict]:
    """The export requests in the spans' file and its metrics file beside it (exporters/jsonl.py)."""
    out = []
    for p in (path, metrics_path(path)):
        if os.path.exists(p) or p == path:
            with open(p) as f:
                out += [json.loads(ln) for ln in f if ln.strip()]
    return out


def span_ids(req: dict) -> list[str]:
    """hostagent.request.id of every span in one OTLP-JSON export request ("" for spans without one)."""
    out = []
    for rs in req.get("resourceSpans", []):
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                a = {kv["key"]: kv["value"] for kv in s.get("attributes", [])}
                out.append(a.get("hostagent.request.id", {}).get("stringValue", ""))
    return out


def stopped_clean(rc: int, took: float, err: str) -> tuple[int, int]:
    """After an outage: exit 0 within 5 s, flushed, nothing lost in the kernel or user space (the
    reader never waits on the exporters). The exit line's (spans exported, spans dropped)."""
    assert rc == 0 and took < 5 and "Traceback" not in err, err
    stopped = STOPPED.search(err)
    assert stopped and "did not flush" not in err, err
    exported, dropped, lost_k, lost_u = map(int, stopped.groups())
    assert lost_k == 0 and lost_u == 0
    return exported, dropped


def last_counter(reqs: list[dict], name: str) -> dict[str, int]:
    """The last cumulative value of a counter in OTLP-JSON metric requests, by its hostagent.reason (or "")."""
    out = {}
    for req in reqs:
        for rm in req.get("resourceMetrics", []):
            for sm in rm["scopeMetrics"]:
                for m in sm["metrics"]:
                    if m["name"] == name:
                        for dp in m["sum"]["dataPoints"]:
                            a = {kv["key"]: kv["value"]["stringValue"] for kv in dp.get("attributes", [])}
                            out[a.get("hostagent.reason", "")] = int(dp["asInt"])
    return out


# ---- collector outage -----------------------------------------------------------------------------

@pytest.mark.bpf
def test_collector_outage_counts_every_span_and_recovers(tmp_path):
    """20 s of outage: 8 s refusing (UNAVAILABLE), 12 s killed, then back on the same port. A 16-span
    queue overflows meanwhile, so both kinds of loss occur: export failures and queue drops."""
    rx = GrpcReceiver()
    rx.start()
    jsonl = tmp_path / "telemetry.jsonl"
    a = Agent(tmp_path, "--otlp-endpoint", rx.endpoint, "--jsonl", str(jsonl), "--watch", "marked",
              env={"OTEL_EXPORTER_OTLP_TIMEOUT": "2", "MCP_AGENT_EXPORT_MAX_QUEUE_SIZE": "16",
                   "MCP_AGENT_EXPORT_METRIC_INTERVAL_S": "1"})
    m = None
    try:
        a.ready()
        m = Marker(rate=50)
        rx.wait_for_spans(20, timeout=10)
        rss0 = a.rss_kb()
        rss = [rss0]
        t_out = time.monotonic()
        rx.fail = True
        while time.monotonic() - t_out < 8:
            time.sleep(0.5)
            rss.append(a.rss_kb())
        rx.stop()  # killed: connection refused from here on
        rx.fail = False  # (the restarted one accepts again)
        while time.monotonic() - t_out < 20:
            time.sleep(0.5)
            rss.append(a.rss_kb())
        before = len(rx.spans())
        rx.start()  # the same port
        t_back = time.monotonic()
        assert rx.wait_for(lambda: len(rx.spans()) > before, timeout=30), "export did not resume within 30 s"
        resumed_s = time.monotonic() - t_back
        time.sleep(1.5)
        m.stop()
        time.sleep(0.5)
        rc, took = a.term()
    finally:
        if m:
            m.stop()
        a.close()
        rx.stop()
    err = a.stderr
    exported, dropped = stopped_clean(rc, took, err)
    # ~20 retries and failures a signal during the outage, logged at most once per 30 s per exporter
    # logger (gRPC: one for both signals); the rest are counted in the metrics
    export_errors = [ln for ln in lines(err) if re.search(r"(Transient error|Failed to export) ", ln)]
    assert 1 <= len(export_errors) <= 2, export_errors

    reqs = jsonl_requests(jsonl)
    in_jsonl = [i for r in reqs for i in span_ids(r)]  # every span that reached the exporters
    received = len(rx.spans())
    final = last_counter(reqs, "hostagent.agent.spans.dropped")
    assert last_counter(reqs, "hostagent.agent.spans.exported")[""] == exported  # the final metric export
    failed, queue_full = final["export_failed"], final["queue_full"]
    # exact: what the exporters accepted is what the receiver has; what failed is exactly the rest of
    # what reached them; the summary line adds up
    assert received == exported
    assert len(in_jsonl) - received == failed and failed > 0
    assert dropped == failed + queue_full and queue_full > 0
    # our own requests: each reached the exporters or was one of the queue drops
    ours = set(m.ids)
    assert len(ours - set(in_jsonl)) <= queue_full
    got = {s.attributes.get("hostagent.request.id") for s in rx.spans()}
    assert ours & got and len(ours & set(in_jsonl) - got) <= failed
    print(f"outage: exported {exported} = received {received}; failed {failed} = {len(in_jsonl)} reached the "
          f"exporters - {received}; queue_full {queue_full}; ours {len(ours)}; resumed after {resumed_s:.1f} s; "
          f"RSS {rss0} -> max {max(rss)} kB")
    # memory stayed bounded while nothing could be exported
    assert max(rss) - rss0 < 40_000, (rss0, max(rss))
    assert max(rss) < 250_000
    assert resumed_s < 30


@pytest.mark.bpf
def test_sigterm_during_outage_exits_within_5s_and_detaches(tmp_path):
    rx = GrpcReceiver()
    rx.start()
    rx.fail = True
    a = Agent(tmp_path, "--otlp-endpoint", rx.endpoint, "--jsonl", "none", "--watch", "marked",
              env={"OTEL_EXPORTER_OTLP_TIMEOUT": "10"})
    m = None
    try:
        a.ready()
        held = bpf_ids(a.p.pid)
        assert len(held["prog"]) >= expected_programs()
        m = Marker(rate=100)
        time.sleep(2.5)  # the batch worker is now inside a 10 s export that cannot succeed
        rc, took = a.term(within=5)
    finally:
        if m:
            m.stop()
        a.close()
        rx.stop()
    err = a.stderr
    assert rc == 0 and took < 5 and "Traceback" not in err, err
    assert lines(err)[-1].startswith("stopped: "), err
    assert "STOPPING" in a.notify.keys()
    assert gone(held) == {"prog": set(), "map": set()}
    assert not os.path.exists(a.sock)


def test_export_errors_are_logged_at_most_every_interval():
    import logging

    from mcp_hostagent.exporters.counting import _ExportErrorFilter

    f = _ExportErrorFilter(interval_s=30)
    rec = lambda msg, *a: logging.LogRecord("x", logging.WARNING, __file__, 1, msg, a, None)  # noqa: E731
    first = rec("Transient error %s encountered while exporting %s", "UNAVAILABLE", "traces")
    assert f.filter(first) and first.getMessage() == "Transient error UNAVAILABLE encountered while exporting traces"
    assert not any(f.filter(rec("Failed to export %s to %s", "traces", "x")) for _ in range(20))
    assert f.filter(rec("Exception while exporting %s.", "x"))  # other messages pass untouched
    f._next_ok = 0  # the interval is over
    later = rec("Failed to export %s to %s", "traces", "x")
    assert f.filter(later)
    assert later.getMessage().startswith("Failed to export traces to x (and 20 similar export errors in the last 30 s")


# ---- SIGHUP ---------------------------------------------------------------------------------------

def metric_value(rx: GrpcReceiver, name: str) -> int | None:
    vals = [dp.as_int for m in rx.metrics() if m.metric.name == name for dp in m.metric.sum.data_points]
    return vals[-1] if vals else None


@pytest.mark.bpf
def test_sighup_reloads_good_config_keeps_old_on_bad(tmp_path):
    rx = GrpcReceiver()
    rx.start()
    cfg = tmp_path / "config.toml"

    def write(name: str, extra: str = "") -> None:
        cfg.write_text(f'[service]\nname = "{name}"\n[export]\nmetric_interval_s = 0.5\n{extra}')

    write("before")
    a = Agent(tmp_path, "--config", str(cfg), "--otlp-endpoint", rx.endpoint, "--jsonl", "none", "--watch", "marked")

    def service_of_new_span() -> str:
        n = len(rx.spans())
        with marker.request():
            pass
        assert rx.wait_for(lambda: len(rx.spans()) > n, 10)
        return rx.spans()[-1].resource["service.name"]

    try:
        a.ready()
        assert service_of_new_span() == "before"
        held = bpf_ids(a.p.pid)

        # 1. a bad config: refused, one line, the agent runs on unchanged
        cfg.write_text('[service]\nname = 5\n')
        a.p.send_signal(signal.SIGHUP)
        a.ready(2)  # RELOADING=1 ... READY=1
        assert "RELOADING" in a.notify.keys()
        refused = [ln for ln in lines(a.stderr) if ln.startswith("reload: ")]
        assert refused == ["reload: kept the running config: config error: service.name = 5 (from "
                           f"{cfg}): expected a string, got an integer"], a.stderr
        assert bpf_ids(a.p.pid) == held  # nothing was detached
        assert service_of_new_span() == "before"
        assert rx.wait_for(lambda: metric_value(rx, "hostagent.agent.config.reload_failed") == 1, 5)

        # 2. a good one: applied, by a new pipeline (probes detached and attached again)
        write("after")
        a.p.send_signal(signal.SIGHUP)
        a.ready(3)
        assert service_of_new_span() == "after"
        assert "reload: config valid; restarting the pipeline with it" in a.stderr
        now = bpf_ids(a.p.pid)
        assert now["prog"] and not (now["prog"] & held["prog"])
        assert gone(held) == {"prog": set(), "map": set()}  # the old programs were released
        assert rx.wait_for(lambda: metric_value(rx, "hostagent.agent.config.reloads") == 1, 5)

        # 3. valid but cannot start (headers nothing compiles against): back to the previous config
        useless = tmp_path / "headers"
        (useless / "include").mkdir(parents=True)
        write("broken", f'[kernel]\nheaders = "{useless}"\n')
        a.p.send_signal(signal.SIGHUP)
        a.ready(4, timeout=90)
        assert "reload: the new config failed to start (no BPF program loaded" in a.stderr
        assert service_of_new_span() == "after"
        assert rx.wait_for(lambda: metric_value(rx, "hostagent.agent.config.reload_failed") == 2, 5)
        assert probe_counts(a.stderr.split("reload: the new config failed")[1])["missing"] == len(expected_missing())

        rc, took = a.term()
    finally:
        a.close()
        rx.stop()
    err = a.stderr
    assert rc == 0 and "Traceback" not in err, err
    assert [ln for ln in lines(err) if ln.startswith("stopped: ")] == [lines(err)[-1]]


# ---- kill -9 ----------------------------------------------------------------------------------------

def tracefs_probes(pid: int) -> list[str]:
    out = []
    for f in ("uprobe_events", "kprobe_events"):
        try:
            with open(f"/sys/kernel/tracing/{f}") as fh:
                out += [ln for ln in fh if ln.split()[0].endswith(f"_bcc_{pid}")]
        except OSError:
            pass
    return out


@pytest.mark.bpf
def test_kill_9_then_restart_leaves_nothing_stale(tmp_path):
    farm_root = "/run/mcp-hostagent/kernel-src"
    a = Agent(tmp_path, "--jsonl", "none", name="killed")
    try:
        a.ready()
        held = bpf_ids(a.p.pid)
        farms = {d: os.stat(os.path.join(farm_root, d)).st_ino for d in os.listdir(farm_root)} \
            if os.path.isdir(farm_root) else {}
        pid = a.p.pid
        a.p.kill()
        assert a.p.wait(5) == -signal.SIGKILL
    finally:
        a.close()
    # the kernel let go of everything with the last fd: no pinned maps, no named probes left
    assert gone(held) == {"prog": set(), "map": set()}
    pinned = [n for n in (os.listdir("/sys/fs/bpf") if os.path.isdir("/sys/fs/bpf") else []) if "mcp" in n]
    assert pinned == []
    assert tracefs_probes(pid) == []
    assert os.path.exists(a.sock)  # the stale socket is the one thing left; the next agent replaces it

    b = Agent(tmp_path, "--jsonl", "none", name="killed")  # same control socket path
    try:
        b.ready()
        err = b.stderr
        assert probe_counts(err)["missing"] == len(expected_missing())
        assert f"  control:  {b.sock} (mode 0660" in err
        if farms:  # the kernel-src farm was reused, not rebuilt
            assert {d: os.stat(os.path.join(farm_root, d)).st_ino for d in farms} == farms
        assert not [d for d in os.listdir(farm_root) if d.endswith(".tmp")] if os.path.isdir(farm_root) else True
        rc, _ = b.term()
    finally:
        b.close()
    assert rc == 0


# ---- config fuzzing -----------------------------------------------------------------------------

KEYS = [s.key for s in C.SETTINGS]
_bare = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789", min_size=1, max_size=12)
_scalars = st.one_of(
    st.booleans(), st.integers(min_value=-2**63, max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["grpc", "http/protobuf", "all", "gpu", "marked", "info", "none", "", "http://127.0.0.1:4317",
                     "/nonexistent", "/tmp", "page_faults", "no_such_probe"]),
    st.datetimes().map(lambda d: d.replace(microsecond=0)),
)
_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4), max_leaves=6)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):  # a TOML basic string: JSON's escapes are TOML's, but TOML also escapes DEL
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return v.isoformat()


def typed_value(s: C.Setting):
    """Values of the setting's own type, around its bounds: mostly valid, some just outside."""
    lo = -1e6 if s.min is None else s.min
    hi = 1e6 if s.max is None else s.max
    scalar = {
        "bool": st.booleans(),
        "int": st.integers(int(lo) - 2, int(hi) + 2),
        "float": st.one_of(st.floats(lo - 1, hi + 1), st.sampled_from([lo, hi])),
        "choice": st.sampled_from(list(s.choices or ()) + ["", "ALL", "x"]),
        "str": st.one_of(st.just(s.default if isinstance(s.default, str) else ""), st.text(max_size=20)),
    }
    if s.type.startswith("list["):
        inner = scalar["int" if s.type == "list[int]" else "str"]
        if s.key == "probes.disable":
            inner = st.sampled_from(["page_faults", "marker", "sched_switch", "nope", "Bad Name"])
        return st.lists(inner, max_size=3)
    return scalar[s.type]


@st.composite
def toml_docs(draw) -> str:
    """A TOML document: known and unknown sections and keys, typed values near their bounds and values of
    every other type, some top-level keys, some syntax damage."""
    sections: dict[str, dict[str, str]] = {}
    for _ in range(draw(st.integers(0, 6))):
        key = draw(st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), st.tuples(_bare, _bare).map(".".join)))
        sec, name = key.split(".", 1)
        known = C._BY_KEY.get(key)
        v = draw(typed_value(known) if known is not None and draw(st.integers(0, 3)) else _values)
        sections.setdefault(sec, {})[name] = f"{name} = {toml_value(v)}"
    text = "".join(f"[{s}]\n" + "".join(ln + "\n" for ln in body.values()) for s, body in sections.items())
    if draw(st.booleans()):
        text = f"{draw(_bare)} = {toml_value(draw(_values))}\n" + text
    if text and draw(st.integers(0, 4)) == 0:  # damage: cut it, or insert junk
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.sampled_from(["", "[", "]", "=", "\"", "\n[[x]]\n", "\x00", "\\u"])) + text[i:]
    return text


def load_or_error(path=None, env=None):
    """A Config or a one-line ConfigError; anything else fails the test."""
    try:
        return _checked(path, {}, env or {})
    except C.ConfigError as e:
        msg = str(e)
        assert msg.startswith("config error: ") and "\n" not in msg and "\r" not in msg, repr(msg)
        return msg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=toml_docs())
def test_fuzz_config_files(tmp_path, doc):
    path = tmp_path / "fuzz.toml"
    path.write_text(doc, encoding="utf-8", errors="surrogatepass") if "\ud800" not in doc else path.write_bytes(
        doc.encode("utf-8", "surrogatepass"))
    load_or_error(str(path))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_fuzz_config_bytes(tmp_path, data):
    path = tmp_path / "bytes.toml"
    path.write_bytes(data)
    load_or_error(str(path))


_env_names = st.one_of(st.sampled_from([s.env for s in C.SETTINGS] + [a for s in C.SETTINGS for a in s.env_aliases]),
                       _bare.map(lambda n: "MCP_AGENT_" + n.upper()))


@settings(max_examples=300, deadline=None)
@given(env=st.dictionaries(_env_names, st.text(alphabet=st.characters(blacklist_categories=["Cs"],
                                                                      blacklist_characters="\x00"), max_size=30),
                           max_size=4))
def test_fuzz_config_env(env):
    load_or_error(None, env)


# ---- 60 malformed files through the CLI ------------------------------------------------------------

MALFORMED = [
    # syntax
    "[export\n", "[export]]\n", "[[export]]\nconsole = true\n", "[export]\nconsole = \n", "[export]\nconsole\n",
    "[export]\n= true\n", '[export]\njsonl_path = "unterminated\n', "[export]\njsonl_path = 'a\nb'\n",
    "[export]\nconsole = true\nconsole = false\n", "[export]\n[export]\n", "\x00", "\ufeff\ufeff[export]\n",
    "[export]\nconsole = tru\n", "[export]\nmax_queue_size = 0x\n", "[export]\nmax_queue_size = 1__0\n",
    "[export]\nmetric_interval_s = 1.\n", "[export]\nmetric_interval_s = .5\n", '[export]\njsonl_path = "\\q"\n',
    "[export]\nconsole = true # ok\n]", "a.b.c = 1\n", "[export.sub]\nx = 1\n", "[service]\nname = {a = 1}\n",
    # unknown names
    "[exprot]\nconsole = true\n", "[export]\nconsol = true\n", "console = true\n", "export = 1\n",
    "[export]\nOTLP_ENDPOINT = \"http://a:1\"\n", "[Export]\nconsole = true\n", "[export]\n\"console \" = true\n",
    # types
    "[export]\nconsole = \"yes\"\n", "[export]\nconsole = 1\n", "[export]\nmax_queue_size = 1.5\n",
    "[export]\nmax_queue_size = \"100\"\n", "[export]\nmax_queue_size = true\n", "[export]\nmetric_interval_s = \"1\"\n",
    "[export]\nmetric_interval_s = 1979-05-27\n", "[process]\npids = 5\n", "[process]\npids = [\"1\"]\n",
    "[process]\npids = [1.0]\n", "[process]\ncomms = \"python\"\n", "[process]\ncomms = [1]\n", "[probes]\ndisable = \"x\"\n",
    "[service]\nname = []\n", "[log]\nlevel = 3\n",
    # ranges and choices
    "[export]\nmax_queue_size = 1\n", "[export]\nmax_queue_size = -5\n", "[export]\nmetric_interval_s = inf\n",
    "[export]\nmetric_interval_s = nan\n", "[export]\nmetric_interval_s = 0\n", "[status]\ninterval_s = 61\n",
    "[process]\npids = [0]\n", "[process]\ncomms = [\"\"]\n", "[process]\ncomms = [\"a-very-long-process\"]\n",
    "[process]\nwatch = \"some\"\n", "[export]\notlp_protocol = \"udp\"\n", "[log]\nlevel = \"verbose\"\n",
    "[service]\nname = \"\"\n", "[reclaim]\nstorm_kswapd_ratio = 2\n",
    # checks
    "[export]\notlp_endpoint = \"ftp://collector\"\n", "[export]\notlp_endpoint = \"http://\"\n",
    "[export]\notlp_endpoint = \"http://a:99999\"\n", "[kernel]\nheaders = \"/nonexistent/headers\"\n",
    "[probes]\ndisable = [\"no_such_probe\"]\n", "[probes]\ndisable = [\"Page Faults\"]\n",
    "[export]\nheaders_file = \"/nonexistent/otlp-headers\"\n", "[export]\nheaders_file = \"/etc/passwd\"\n",
]


def test_at_least_50_malformed():
    assert len(MALFORMED) >= 50 and len(set(MALFORMED)) == len(MALFORMED)


@pytest.mark.parametrize("i", range(len(MALFORMED)))
def test_malformed_config_exits_2_one_line_in_process(i, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(MALFORMED[i].encode("utf-8"))
    # --show-config: were a file valid after all, this prints instead of starting the agent
    r = CliRunner().invoke(main, ["run", "--config", str(path), "--show-config"], env={"MCP_AGENT_CONFIG": None},
                           prog_name="mcp-agent")
    assert r.exit_code == 2, (MALFORMED[i], r.exit_code, r.output)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert r.stdout == ""
    ls = r.stderr.splitlines()
    assert len(ls) == 1 and ls[0].startswith(ERROR + "config error: "), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("i", [0, 10, 22, 40, 46, 60, 62, 65])
def test_malformed_config_exits_2_one_line_subprocess(i, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(MALFORMED[i].encode("utf-8"))
    r = subprocess.run([*AGENT, "run", "--config", str(path), "--jsonl", "none", "--duration", "1"],
                       env=clean_env(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, (MALFORMED[i], r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr
    ls = lines(r.stderr)
    assert len(ls) == 1 and ls[0].startswith(ERROR + "config error: "), r.stderr


def test_sighup_path_uses_the_same_checks():
    # what SIGHUP re-reads goes through _checked: an unknown probe is a config error there too
    with pytest.raises(C.ConfigError, match="unknown probe"):
        _checked(None, {"probes.disable": ("no_such_probe",)}, {})
