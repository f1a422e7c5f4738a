"""The real `mcp-agent` command, run as a subprocess: help and version, config errors (exit 2, one
line, nothing attached), --show-config precedence, `probes`, `run` until SIGTERM/SIGINT (exit 0,
span drained to the JSONL file, every BPF program and map released), --strict, and non-root."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from mcp_hostagent import __version__
from mcp_hostagent.core.kernel import tracepoint_exists
from mcp_hostagent.core.probes import TRACEPOINT_KINDS, UPROBE_STATES
from mcp_hostagent.registry import UNIT

PROBES = UNIT.probes
probe_names = UNIT.probe_names
from mcp_hostagent.exporters.files import metrics_path

AGENT = [sys.executable, "-m", "mcp_hostagent"]
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
BANNER = re.compile(r"mcp-agent \S+ on .+, kernel \S+\Z")
ERROR = "mcp-agent: error: "
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any agent/OTel/bcc setting, and no config file (/etc's included)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MCP_AGENT_", "OTEL_")) and k != "BCC_KERNEL_SOURCE"}
    env["MCP_AGENT_CONFIG"] = os.devnull  # an empty TOML file any user can read
    env.update(extra)
    return env


def cli(*args: str, env: dict | None = None, prefix: list[str] = (), timeout: float = 60, cwd=None):
    return subprocess.run([*prefix, *AGENT, *args], env=clean_env() if env is None else env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def error_line(stderr: str) -> str:
    """The one error line of a failed start: the banner may precede it, nothing else may."""
    assert "Traceback" not in stderr, stderr
    ls = lines(stderr)
    errors = [ln for ln in ls if ln.startswith(ERROR)]
    assert len(errors) == 1, stderr
    assert [ln for ln in ls if not BANNER.match(ln)] == errors and ls[-1] == errors[0], stderr
    return errors[0]


def tracepoint_probes():
    return [p for p in PROBES if getattr(p, "kind", "tracepoint") in ("tracepoint", "tracepoint_raw")]


def default_off() -> set[str]:
    """Probes the default configuration turns off (group_fork: requests.group = cgroup)."""
    from mcp_hostagent.config import load_config
    switched_off = UNIT.switched_off

    return set(switched_off(load_config(None, env={}, overrides={})))


def expected_attached() -> set[str]:
    """Tracepoint probes whose tracepoint this kernel has and the default configuration runs: each
    must attach (as root)."""
    return {p.name for p in tracepoint_probes() if tracepoint_exists(*p.tracepoint.split(":"))} - default_off()


def expected_programs() -> int:
    """BPF programs those probes load: the HTTP exit probes share two (agent/core/probes.py `fn`)."""
    by_name = {p.name: p for p in tracepoint_probes()}
    return len({by_name[n].fn_name for n in expected_attached()})


def expected_missing() -> set[str]:
    """Tracepoint probes whose tracepoint this kernel lacks: each is reported missing, with its reason."""
    return {p.name for p in tracepoint_probes() if not tracepoint_exists(*p.tracepoint.split(":"))}


def probe_counts(stderr_line: str) -> dict[str, int]:
    """attached, missing, disabled and the libcuda uprobe families' states ("; libcuda uprobes 6 waiting")."""
    m = re.search(r"probes (\d+) attached, (\d+) missing, (\d+) disabled(?:; libcuda uprobes (.+))?$", stderr_line,
                  re.M)
    assert m, stderr_line
    out = dict(zip(("attached", "missing", "disabled"), map(int, m.groups()[:3])))
    for part in m.group(4).split(", ") if m.group(4) else ():
        n, state = part.split(" ", 1)
        out[state] = int(n)
    return out


def families(counts: dict[str, int]) -> dict[str, int]:
    """probe_counts with the libcuda uprobe families' states (core/probes.py UPROBE_STATES) summed."""
    out = {k: v for k, v in counts.items() if k not in UPROBE_STATES}
    out["libcuda uprobes"] = sum(v for k, v in counts.items() if k in UPROBE_STATES)
    return out


def can_drop_privileges() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to an unprivileged user"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) not installed"
    return None


# ---- help and version ------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["version"], ["--version"], ["-V"]])
def test_version(args):
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"mcp-agent (mcp-hostagent) {__version__}\n"
    assert r.stderr == ""


def test_console_script_is_the_same_command():
    script = os.path.join(os.path.dirname(sys.executable), "mcp-agent")
    if not os.access(script, os.X_OK):
        pytest.skip(f"no console script at {script} (package not installed in this environment)")
    r = subprocess.run([script, "version"], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"mcp-agent (mcp-hostagent) {__version__}\n")


@pytest.mark.parametrize("args,expected", [
    (["--help"], ["run", "probes", "version", "sudo mcp-agent probes"]),
    (["-h"], ["run", "probes", "version"]),
    (["run", "--help"], ["--config", "--otlp-endpoint", "--otlp-protocol", "grpc", "http/protobuf", "--jsonl",
                         "--strict", "--watch", "--disable-probe", "--kernel-headers", "--duration",
                         "--show-config", "--no-status", "SIGTERM"]),
    (["probes", "--help"], ["--dump", "--config", "attached", "missing"]),
    (["version", "--help"], ["version"]),
], ids=["help", "h", "run", "probes", "version"])
def test_help(args, expected):
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage: ")
    for word in expected:
        assert word in r.stdout, f"{word!r} not in {' '.join(args)}:\n{r.stdout}"


# ---- config errors: exit 2, one line naming the key, nothing done ---------------------------------

CONFIG_ERRORS = [
    # id, argv (after the command), {file name: TOML text}, env, words the line must hold
    ("toml-unknown-key", ["--config", "{unk.toml}"], {"unk.toml": "[export]\nbogus = 1\n"}, {},
     ["export.bogus", "unknown setting", "unk.toml"]),
    ("toml-unknown-section", ["--config", "{sec.toml}"], {"sec.toml": "[exprot]\nconsole = true\n"}, {},
     ["[exprot]", "unknown section", "did you mean [export]"]),
    ("toml-bad-type", ["--config", "{typ.toml}"], {"typ.toml": "[export]\nmetric_interval_s = \"fast\"\n"}, {},
     ["export.metric_interval_s", "expected a number", "typ.toml"]),
    ("toml-out-of-range", ["--config", "{rng.toml}"], {"rng.toml": "[export]\nmax_queue_size = 1\n"}, {},
     ["export.max_queue_size", "between 16 and"]),
    ("toml-bad-choice", ["--config", "{ch.toml}"], {"ch.toml": "[process]\nwatch = \"some\"\n"}, {},
     ["process.watch", "all, gpu, marked"]),
    ("toml-comm-too-long", ["--config", "{cm.toml}"], {"cm.toml": "[process]\ncomms = [\"a-very-long-process\"]\n"},
     {}, ["process.comms", "element [0]"]),
    ("toml-unknown-probe", ["--config", "{pr.toml}"], {"pr.toml": "[probes]\ndisable = [\"no_such_probe\"]\n"},
     {}, ["probes.disable", "no_such_probe", "known: " + ", ".join(probe_names())]),
    ("toml-syntax", ["--config", "{syn.toml}"], {"syn.toml": "[export\nconsole = true\n"}, {},
     ["syn.toml", "line 1", "invalid TOML"]),
    ("config-missing", ["--config", "{nope.toml}"], {}, {}, ["nope.toml", "no such file"]),
    ("env-config-missing", [], {}, {"MCP_AGENT_CONFIG": "/nonexistent/mcp.toml"},
     ["MCP_AGENT_CONFIG", "/nonexistent/mcp.toml", "no such file"]),
    ("env-bad-choice", [], {}, {"MCP_AGENT_EXPORT_OTLP_PROTOCOL": "udp"},
     ["MCP_AGENT_EXPORT_OTLP_PROTOCOL", "udp", "grpc, http/protobuf"]),
    ("env-bad-int", [], {}, {"MCP_AGENT_EXPORT_MAX_QUEUE_SIZE": "lots"},
     ["MCP_AGENT_EXPORT_MAX_QUEUE_SIZE", "not an integer"]),
    ("env-unknown-name", [], {}, {"MCP_AGENT_EXPORT_OTLP_PROTOCL": "grpc"},
     ["MCP_AGENT_EXPORT_OTLP_PROTOCL", "unknown setting", "did you mean MCP_AGENT_EXPORT_OTLP_PROTOCOL"]),
    ("env-alias-bad-url", [], {}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector:4317"},
     ["OTEL_EXPORTER_OTLP_ENDPOINT", "export.otlp_endpoint", "http://"]),
    ("flag-unknown-probe", ["--disable-probe", "no_such_probe"], {}, {},
     ["probes.disable", "no_such_probe"]),
    ("flag-bad-probe-name", ["--disable-probe", "Page Faults"], {}, {},
     ["probes.disable", "not a probe name"]),
    ("flag-bad-url", ["--otlp-endpoint", "collector:4317"], {}, {}, ["export.otlp_endpoint", "(from flag)"]),
    ("flag-headers-missing", ["--kernel-headers", "/nonexistent/headers"], {}, {},
     ["kernel.headers", "no such directory"]),
]


@pytest.mark.parametrize("command,argv,files,env,words", [
    pytest.param(command, *c[1:], id=f"{c[0]}-{command}")
    for c in CONFIG_ERRORS for command in ("run", "probes")
    if command == "run" or not c[1] or c[1][0] == "--config"  # `probes` takes only --config
])
def test_config_error_exits_2_with_one_line(command, argv, files, env, words, tmp_path):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [re.sub(r"\{(.+?)\}", lambda m: str(tmp_path / m.group(1)), a) for a in argv]
    out = tmp_path / "telemetry.jsonl"
    extra = ["--jsonl", str(out), "--duration", "1"] if command == "run" else []
    r = cli(command, *argv, *extra, env=clean_env(**env), timeout=30)

    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    ls = lines(r.stderr)
    assert len(ls) == 1, r.stderr  # no banner: it stopped before starting anything
    assert ls[0].startswith(ERROR + "config error: "), ls[0]
    for w in words:
        assert w in ls[0], f"{w!r} not in {ls[0]!r}"
    assert r.stdout == ""
    assert not out.exists()


# ---- --show-config: flag > env > file > default ----------------------------------------------------

def show_config(*args: str, env: dict) -> dict[str, tuple[str, str]]:
    r = cli("run", "--show-config", *args, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = {}
    for ln in r.stdout.splitlines():
        m = re.fullmatch(r"([a-z_]+\.[a-z_]+) = (.+) \((default|flag|env:[A-Z_]+|file:.+)\)", ln)
        assert m, f"unexpected --show-config line {ln!r}"
        out[m.group(1)] = (m.group(2), m.group(3))
    return out


def test_show_config_flag():
    r = cli("run", "--show-config", "--otlp-endpoint", "http://127.0.0.1:4317")
    assert r.returncode == 0, r.stderr
    assert 'export.otlp_endpoint = "http://127.0.0.1:4317" (flag)' in r.stdout.splitlines()
    assert 'export.otlp_protocol = "grpc" (default)' in r.stdout.splitlines()
    assert "Traceback" not in r.stderr and r.stderr == ""


def test_show_config_env():
    r = cli("run", "--show-config", "--otlp-endpoint", "http://127.0.0.1:4317",
            env=clean_env(MCP_AGENT_EXPORT_OTLP_PROTOCOL="http/protobuf"))
    assert r.returncode == 0, r.stderr
    assert 'export.otlp_endpoint = "http://127.0.0.1:4317" (flag)' in r.stdout.splitlines()
    assert 'export.otlp_protocol = "http/protobuf" (env:MCP_AGENT_EXPORT_OTLP_PROTOCOL)' in r.stdout.splitlines()


def test_show_config_precedence_flag_env_file(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[export]\notlp_endpoint = "http://file.example:4317"\notlp_protocol = "grpc"\n'
                   'console = true\n[service]\nname = "from-file"\n[process]\nwatch = "all"\n')
    file_src = f"file:{cfg}"
    env = clean_env(MCP_AGENT_EXPORT_OTLP_ENDPOINT="http://env.example:4318",
                    MCP_AGENT_EXPORT_OTLP_PROTOCOL="http/protobuf", MCP_AGENT_PROCESS_WATCH="marked")

    got = show_config("--config", str(cfg), env=env)
    assert got["export.otlp_endpoint"] == ('"http://env.example:4318"', "env:MCP_AGENT_EXPORT_OTLP_ENDPOINT")
    assert got["export.otlp_protocol"] == ('"http/protobuf"', "env:MCP_AGENT_EXPORT_OTLP_PROTOCOL")
    assert got["process.watch"] == ('"marked"', "env:MCP_AGENT_PROCESS_WATCH")
    assert got["export.console"] == ("true", file_src)
    assert got["service.name"] == ('"from-file"', file_src)
    assert got["export.max_queue_size"] == ("8192", "default")

    got = show_config("--config", str(cfg), "--otlp-endpoint", "http://127.0.0.1:4317", "--otlp-protocol", "grpc",
                      "--no-console", "--watch", "gpu", env=env)
    assert got["export.otlp_endpoint"] == ('"http://127.0.0.1:4317"', "flag")
    assert got["export.otlp_protocol"] == ('"grpc"', "flag")
    assert got["export.console"] == ("false", "flag")
    assert got["process.watch"] == ('"gpu"', "flag")
    assert got["service.name"] == ('"from-file"', file_src)

    # the file named by MCP_AGENT_CONFIG instead of --config; the OTel alias loses to the MCP_AGENT_ name
    got = show_config(env=clean_env(MCP_AGENT_CONFIG=str(cfg), OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                                    OTEL_SERVICE_NAME="from-otel", MCP_AGENT_SERVICE_NAME="from-mcp"))
    assert got["export.otlp_endpoint"] == ('"http://file.example:4317"', file_src)
    assert got["export.otlp_protocol"] == ('"http/protobuf"', "env:OTEL_EXPORTER_OTLP_PROTOCOL")
    assert got["service.name"] == ('"from-mcp"', "env:MCP_AGENT_SERVICE_NAME")

    # --config beats MCP_AGENT_CONFIG
    other = tmp_path / "other.toml"
    other.write_text('[service]\nname = "other"\n')
    got = show_config("--config", str(other), env=clean_env(MCP_AGENT_CONFIG=str(cfg)))
    assert got["service.name"] == ('"other"', f"file:{other}")
    assert got["export.otlp_endpoint"] == ("unset", "default")


# ---- probes ----------------------------------------------------------------------------------------

@pytest.mark.bpf
def test_probes_table_shows_every_probe_attached():
    r = cli("probes")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout.splitlines()
    header = next(i for i, ln in enumerate(out) if ln.split()[:4] == ["PROBE", "HOOK", "STATE", "DETAIL"])
    table = out[header + 1:]
    table = table[:table.index("")] if "" in table else table  # the libcuda section follows a blank line
    rows = {ln.split()[0]: ln.split()[1:3] for ln in table}
    assert list(rows) == probe_names(), r.stdout
    for p in PROBES:
        hook, state = rows[p.name]
        assert hook == p.tracepoint, (p.name, hook)
        if p.name in expected_attached():
            assert state == "attached", f"{p.name} not attached:\n{r.stdout}"
        elif p.name in expected_missing():  # this kernel lacks the tracepoint
            assert state == "missing", (p.name, state)
        elif p.name in default_off():
            assert state == "disabled", (p.name, state)
        elif p.kind == "uprobe":  # resolved in the libcuda files mapped now, never attached by `probes`
            assert state in ("found", "waiting", "missing"), (p.name, state)
        else:  # attached by its own module, when what it hooks is present on this host
            assert state in ("attached", "missing"), (p.name, state)
    assert any(ln.startswith("compile: ") for ln in out)


DUMP_PROBE = (  # stderr gets one line: was bcc (the compiler) ever imported?
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('bcc imported: %s\\n' % ('bcc' in sys.modules)))\n"
    "from mcp_hostagent.cli import main\n"
    "main(sys.argv[1:], prog_name='mcp-agent')\n"
)


def check_dump(r, disabled=(), sees_tracefs=True):
    disabled = (*disabled, *default_off())  # group_fork by default
    assert r.returncode == 0, r.stderr
    assert lines(r.stderr) == ["bcc imported: False"], r.stderr  # printed, not compiled
    out = r.stdout.splitlines()
    assert out[0].startswith("// ") and ".bpf.c" in out[0], out[0]  # names the source(s)
    [cflags] = [ln for ln in out if ln.startswith("// cflags: ")]
    flags = cflags[len("// cflags: "):].split()
    assert flags[0].startswith("-I/"), cflags
    for p in PROBES:
        # as root the dump leaves out probes whose tracepoint is absent (health.bpf.c's, here); a user
        # who cannot read tracefs gets every probe's flag
        absent = (sees_tracefs and p.kind in TRACEPOINT_KINDS and not tracepoint_exists(*p.tracepoint.split(":")))
        assert (f"-D{p.macro}=1" in flags) == (p.name not in disabled and not absent), (p.name, cflags)
    assert "-DMCP_WATCH_ALL=0" in flags and "-DMCP_MAX_OPEN_PER_PID=1024" in flags
    for p in tracepoint_probes():
        cat, event = p.tracepoint.split(":")
        source = f"TRACEPOINT_PROBE({cat}, {event})" if p.kind == "tracepoint" and not p.fn else f"int {p.fn_name}("
        assert source in r.stdout, f"no source for probe {p.name}"


@pytest.mark.bpf
def test_probes_dump_prints_source_and_flags_without_compiling(tmp_path):
    r = subprocess.run([sys.executable, "-c", DUMP_PROBE, "probes", "--dump"], env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    check_dump(r)
    # the settings reach the flags
    r = subprocess.run([sys.executable, "-c", DUMP_PROBE, "probes", "--dump"],
                       env=clean_env(MCP_AGENT_PROBES_DISABLE="page_faults,process_exit"),
                       capture_output=True, text=True, timeout=60)
    check_dump(r, disabled=("page_faults", "process_exit"))


def test_probes_dump_as_unprivileged_user():
    if reason := can_drop_privileges():
        pytest.skip(reason)
    r = subprocess.run([*NOBODY, sys.executable, "-c", DUMP_PROBE, "probes", "--dump"], env=clean_env(),
                       cwd="/", capture_output=True, text=True, timeout=60)
    check_dump(r, sees_tracefs=False)


# ---- run until a signal ----------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
BPF_PROG_GET_FD_BY_ID, BPF_MAP_GET_FD_BY_ID = 13, 14


def bpf_object_exists(cmd: int, obj_id: int) -> bool:
    """Is this BPF program/map id still alive in the kernel? (bpftool-free: bpf(2) *_GET_FD_BY_ID)"""
    attr = (ctypes.c_uint32 * 4)(obj_id, 0, 0, 0)
    fd = _libc.syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd >= 0:
        os.close(fd)
        return True
    err = ctypes.get_errno()
    assert err == errno.ENOENT, os.strerror(err)
    return False


def bpf_ids(pid: int) -> dict[str, set[int]]:
    """The BPF programs and maps a process holds, from /proc/PID/fdinfo."""
    out = {"prog": set(), "map": set()}
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = open(f"/proc/{pid}/fdinfo/{fd}").read()
        except FileNotFoundError:
            continue
        for kind in out:
            m = re.search(rf"^{kind}_id:\s+(\d+)$", text, re.M)
            if m:
                out[kind].add(int(m.group(1)))
    return out


class AgentProcess:
    """`mcp-agent run ...` as a child; its stderr read line by line on a thread."""

    def __init__(self, *args: str, env=None):
        self.p = subprocess.Popen([*AGENT, *args], env=clean_env() if env is None else env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        self.stdout = ""
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for ln in self.p.stderr:
            with self._cond:
                self.stderr.append(ln.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_line(self, prefix: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                hit = [ln for ln in self.stderr if ln.startswith(prefix)]
                if hit:
                    return hit[0]
                left = deadline - time.monotonic()
                assert left > 0 and not self._eof, f"no {prefix!r} line; stderr so far:\n" + "\n".join(self.stderr)
                self._cond.wait(left)

    def wait_eof(self, timeout: float = 5) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._eof, timeout)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


@pytest.mark.bpf
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_exports_drains_and_detaches_on_signal(sig, tmp_path):
    from mcp_hostagent import marker

    out = tmp_path / "telemetry.jsonl"
    a = AgentProcess("run", "--jsonl", str(out), "--no-status")
    try:
        assert a.wait_line("  export:") == f"  export:   jsonl: {out} (spans), {metrics_path(str(out))} (metrics)"
        counts = probe_counts(a.wait_line("  bpf:"))
        assert counts["attached"] >= len(expected_attached()) and sum(counts.values()) == len(PROBES), counts
        held = bpf_ids(a.p.pid)
        assert len(held["prog"]) >= expected_programs() and held["map"], held
        assert all(bpf_object_exists(BPF_PROG_GET_FD_BY_ID, i) for i in held["prog"])

        # marked just before the signal: the agent must drain the ring buffer on its way out
        with marker.request(traceparent=TP) as rid:
            pass
        t0 = time.monotonic()
        a.p.send_signal(sig)
        try:
            rc = a.p.wait(5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{sig.name}: still running 5 s after the signal; stderr:\n" + "\n".join(a.stderr))
        took = time.monotonic() - t0
        a.wait_eof()
    finally:
        a.kill()
    assert rc == 0, (rc, a.stderr)
    assert took < 5
    assert "Traceback" not in "\n".join(a.stderr), a.stderr
    stopped = [ln for ln in a.stderr if ln.startswith("stopped: ")]
    assert len(stopped) == 1 and stopped[0] == a.stderr[-1], a.stderr
    # other marking processes on this host are the agent's business too: at least ours was exported
    m = re.search(r"spans exported (\d+) dropped \d+ \| lost kernel \d+ user (\d+)", stopped[0])
    assert m and int(m.group(1)) >= 1 and m.group(2) == "0", stopped[0]
    assert "did not flush" not in stopped[0]

    spans = [(rs["resource"], s) for line in out.read_text().splitlines()
             for rs in json.loads(line).get("resourceSpans", []) for ss in rs["scopeSpans"] for s in ss["spans"]]
    mine = [(r, s) for r, s in spans
            if {"key": "hostagent.request.id", "value": {"stringValue": f"{rid:016x}"}} in s["attributes"]]
    assert len(mine) == 1, spans
    resource, span = mine[0]
    assert span["traceId"] == TP.split("-")[1] and span["parentSpanId"] == TP.split("-")[2]
    assert {"key": "process.pid", "value": {"intValue": str(os.getpid())}} in span["attributes"]
    # OTLP/JSON: the process's identity in resourceSpans[].resource, beside the agent's own
    res = {kv["key"]: next(iter(kv["value"].values())) for kv in resource["attributes"]}
    assert res["process.pid"] == str(os.getpid()) and res["process.executable.name"].startswith("python"), res
    assert res["service.name"] and res["service.instance.id"], res
    assert not [kv for kv in span["attributes"] if kv["key"] == "process.executable.name"]

    # Nothing left behind: the process is gone, and so is every BPF program and map it held (a
    # tracepoint attachment holds its program, so a freed program is a detached one).
    assert not os.path.exists(f"/proc/{a.p.pid}")
    deadline = time.monotonic() + 5
    while True:
        left = {k: {i for i in ids if bpf_object_exists(cmd, i)}
                for (k, ids), cmd in zip(held.items(), (BPF_PROG_GET_FD_BY_ID, BPF_MAP_GET_FD_BY_ID))}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not any(left.values()), f"still in the kernel after exit: {left}"

    # and a fresh agent starts and attaches everything again
    r = cli("run", "--jsonl", "none", "--no-status", "--duration", "0.2")
    assert r.returncode == 0, r.stderr
    # the libcuda uprobe families are armed or waiting as processes on this host (any test's, any
    # user's) map libcuda.so or not at that moment: the same families, whatever their state now
    assert families(probe_counts(r.stderr)) == families(counts)
    assert lines(r.stderr)[-1].startswith("stopped: ")


# ---- start failures --------------------------------------------------------------------------------

@pytest.fixture
def useless_headers(tmp_path):
    d = tmp_path / "headers"
    (d / "include").mkdir(parents=True)  # passes the "has include/" check; nothing compiles against it
    return str(d)


@pytest.mark.bpf
def test_strict_with_useless_headers_names_missing_probes(useless_headers):
    r = cli("run", "--strict", "--kernel-headers", useless_headers, "--jsonl", "none", "--no-status",
            "--duration", "1")
    assert r.returncode == 1, r.stderr
    line = error_line(r.stderr)
    assert line.startswith(ERROR + "--strict: probes missing: "), line
    missing = line[len(ERROR + "--strict: probes missing: "):].split(": ", 1)[0].split(", ")
    assert missing == [n for n in probe_names() if n not in default_off()], line
    assert line.count("Failed to compile") == 1, line  # one compile error, not one per probe


@pytest.mark.bpf
def test_without_strict_nothing_loaded_is_still_fatal(useless_headers):
    r = cli("run", "--kernel-headers", useless_headers, "--jsonl", "none", "--no-status", "--duration", "1")
    assert r.returncode == 1, r.stderr
    line = error_line(r.stderr)
    assert line.startswith(ERROR + "no BPF program loaded: "), line
    assert "compile" in line
    assert not any(ln.startswith("stopped: ") for ln in lines(r.stderr))


@pytest.mark.parametrize("args", [["run", "--duration", "1"], ["probes"]], ids=["run", "probes"])
def test_unprivileged_user_is_told_to_be_root(args):
    if reason := can_drop_privileges():
        pytest.skip(reason)
    r = cli(*args, prefix=NOBODY, cwd="/", timeout=30)
    assert r.returncode == 1, (r.returncode, r.stderr)
    line = error_line(r.stderr)
    assert "root" in line, line
