"""Configuration: the settings table, layering (flag > env > file > default) and one-line errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mcp_hostagent import config as C
from mcp_hostagent.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "packaging" / "config.example.toml"


@pytest.fixture(autouse=True)
def _no_default_file(tmp_path, monkeypatch):
    """A host's real /etc/mcp-hostagent/config.toml must not leak into the tests."""
    monkeypatch.setattr(C, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent" / "config.toml"))


@pytest.fixture
def write(tmp_path):
    def write(text: str | bytes, name: str = "agent.toml") -> str:
        p = tmp_path / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(p)
    return write


def defaults() -> dict:
    return {s.attr: s.default for s in C.SETTINGS}


def values(cfg: C.Config) -> dict:
    return {s.attr: getattr(cfg, s.attr) for s in C.SETTINGS}


def one_line_error(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and "\r" not in msg, msg
    assert msg.startswith("config error: "), msg
    return msg


# ---- the table ------------------------------------------------------------------------------------

EXPECTED_KEYS = [
    "export.jsonl_path",
    "export.otlp_endpoint",
    "export.otlp_protocol",
    "export.headers_file",
    "export.console",
    "export.prometheus_listen",
    "export.metric_interval_s",
    "export.max_queue_size",
    "service.name",
    "requests.max_open_per_pid",
    "requests.idle_expiry_s",
    "requests.max_begins_per_s_per_pid",
    "requests.http",
    "requests.http_conns_per_owner",
    "requests.group",
    "requests.mark_users",
    "requests.mark_cgroups",
    "requests.max_begins_per_s_per_uid",
    "requests.max_begins_per_s_per_cgroup",
    "requests.max_open_per_uid",
    "requests.max_open_per_cgroup",
    "requests.max_procs_per_uid",
    "requests.max_procs_per_cgroup",
    "probes.strict",
    "probes.disable",
    "process.watch",
    "process.pids",
    "process.comms",
    "process.command_line",
    "kernel.headers",
    "kernel.link_modules_build",
    "reclaim.stall_threshold_ms",
    "reclaim.window_s",
    "reclaim.storm_kswapd_ratio",
    "reclaim.storm_direct_ms_per_s",
    "reclaim.storm_memcg_ms_per_s",
    "reclaim.storm_close_windows",
    "cuda.overhead_budget",
    "cuda.device_globs",
    "cuda.max_libraries",
    "cuda.duty_slice_s",
    "cuda.step_span_min_ms",
    "cuda.step_spans_per_s",
    "gpu.enabled",
    "gpu.sample_period_s",
    "gpu.slow_period_s",
    "pcie.busy_util_pct",
    "nic.enabled",
    "control.socket",
    "control.group",
    "status.interval_s",
    "status.enabled",
    "log.level",
]


def test_table_is_consistent():
    assert [s.key for s in C.SETTINGS] == EXPECTED_KEYS
    assert [f.name for f in dataclasses.fields(C.Config)] == [s.attr for s in C.SETTINGS] + ["sources"]
    assert len({s.env for s in C.SETTINGS}) == len(C.SETTINGS)
    sections = [s.section for s in C.SETTINGS]
    assert sections == sorted(sections, key=sections.index), "a section's settings must be contiguous"
    for s in C.SETTINGS:
        assert s.type in C.TYPES, s.key
        assert s.help and "\n" not in s.help, s.key
        assert (s.type == "choice") == (s.choices is not None), s.key
        assert s.default is None or C._coerce(s, s.default) == s.default, s.key  # defaults are valid
        assert (s.default is None) == s.optional, s.key


def test_setting_lookup():
    s = C.setting("export.otlp_endpoint")
    assert (s.env, s.attr, s.section, s.name) == (
        "MCP_AGENT_EXPORT_OTLP_ENDPOINT", "export_otlp_endpoint", "export", "otlp_endpoint")
    assert s.env_aliases == ("OTEL_EXPORTER_OTLP_ENDPOINT",) and s.optional
    assert C.setting("kernel.headers").env_aliases == ("BCC_KERNEL_SOURCE",)
    assert C.setting("service.name").env_aliases == ("OTEL_SERVICE_NAME",)
    with pytest.raises(KeyError):
        C.setting("export.nope")


# ---- defaults and files ---------------------------------------------------------------------------

def test_defaults_when_no_file():
    cfg = load_config(env={})
    assert values(cfg) == defaults()
    assert set(cfg.sources.values()) == {"default"} and set(cfg.sources) == set(EXPECTED_KEYS)
    assert cfg.export_otlp_endpoint is None and cfg.export_otlp_protocol == "grpc"
    assert cfg.process_pids == () and cfg.status_enabled is True and cfg.export_max_queue_size == 8192


def test_config_is_immutable():
    cfg = load_config(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.log_level = "debug"
    with pytest.raises(TypeError):
        cfg.sources["log.level"] = "flag"


def test_file_values(write, tmp_path):
    path = write(f"""
[export]
otlp_endpoint = "https://collector.example:4318/v1"
otlp_protocol = "http/protobuf"
console = true
metric_interval_s = 5          # an int where a float belongs is fine
[process]
pids = [1, 42]
comms = ["python3", "123456789012345"]
[probes]
disable = ["sched:sched_switch", "uprobe.cuda-x"]
[kernel]
headers = "{tmp_path}"
[log]
level = "WARNING"
""")
    cfg = load_config(path, env={})
    assert cfg.export_otlp_endpoint == "https://collector.example:4318/v1"
    assert cfg.export_otlp_protocol == "http/protobuf" and cfg.export_console is True
    assert cfg.export_metric_interval_s == 5.0 and isinstance(cfg.export_metric_interval_s, float)
    assert cfg.process_pids == (1, 42) and cfg.process_comms == ("python3", "123456789012345")
    assert cfg.probes_disable == ("sched:sched_switch", "uprobe.cuda-x")
    assert cfg.kernel_headers == str(tmp_path) and cfg.log_level == "warning"
    assert cfg.sources["export.console"] == f"file:{path}" and cfg.sources["service.name"] == "default"


@pytest.mark.parametrize("text", ['""', '"none"', '"None"'])
def test_jsonl_path_disabled(write, text):
    assert load_config(write(f"[export]\njsonl_path = {text}\n"), env={}).export_jsonl_path == ""


def test_empty_string_unsets_optional(write):
    cfg = load_config(write('[export]\notlp_endpoint = ""\n[kernel]\nheaders = ""\n'), env={})
    assert cfg.export_otlp_endpoint is None and cfg.kernel_headers is None


def test_missing_explicit_file(tmp_path):
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as e:
        load_config(missing, env={})
    assert missing in one_line_error(e) and "no such file" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(env={"MCP_AGENT_CONFIG": missing})
    assert "MCP_AGENT_CONFIG" in one_line_error(e) and missing in str(e.value)


def test_unreadable_files(tmp_path, write):
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path), env={})
    assert str(tmp_path) in one_line_error(e)
    with pytest.raises(ConfigError) as e:
        load_config(write(b'[log]\nlevel = "\xff"\n'), env={})
    one_line_error(e)


def test_default_path_used_only_if_present(write, monkeypatch):
    load_config(env={})  # absent: fine
    monkeypatch.setattr(C, "DEFAULT_CONFIG_PATH", write('[log]\nlevel = "debug"\n', "default.toml"))
    cfg = load_config(env={})
    assert cfg.log_level == "debug" and cfg.sources["log.level"] == f"file:{C.DEFAULT_CONFIG_PATH}"


def test_config_path_precedence(write, monkeypatch):
    monkeypatch.setattr(C, "DEFAULT_CONFIG_PATH", write('[log]\nlevel = "debug"\n', "default.toml"))
    from_env = write('[log]\nlevel = "warning"\n', "env.toml")
    from_flag = write('[log]\nlevel = "error"\n', "flag.toml")
    assert load_config(env={"MCP_AGENT_CONFIG": from_env}).log_level == "warning"
    assert load_config(from_flag, env={"MCP_AGENT_CONFIG": from_env}).log_level == "error"
    assert load_config(env={"MCP_AGENT_CONFIG": ""}).log_level == "debug"  # empty = not set


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("MCP_AGENT_LOG_LEVEL", "debug")
    cfg = load_config()
    assert cfg.log_level == "debug" and cfg.sources["log.level"] == "env:MCP_AGENT_LOG_LEVEL"


# ---- precedence -----------------------------------------------------------------------------------

def test_precedence_file_env_flag(write):
    path = write("[requests]\nidle_expiry_s = 10\n")
    env = {"MCP_AGENT_REQUESTS_IDLE_EXPIRY_S": "20"}
    flag = {"requests.idle_expiry_s": 30.0}
    key = "requests.idle_expiry_s"

    cfg = load_config(env={})
    assert (cfg.requests_idle_expiry_s, cfg.sources[key]) == (300.0, "default")
    cfg = load_config(path, env={})
    assert (cfg.requests_idle_expiry_s, cfg.sources[key]) == (10.0, f"file:{path}")
    cfg = load_config(path, env=env)
    assert (cfg.requests_idle_expiry_s, cfg.sources[key]) == (20.0, "env:MCP_AGENT_REQUESTS_IDLE_EXPIRY_S")
    cfg = load_config(path, env=env, overrides=flag)
    assert (cfg.requests_idle_expiry_s, cfg.sources[key]) == (30.0, "flag")
    cfg = load_config(env=env, overrides={key: None})  # None: the flag was not given
    assert (cfg.requests_idle_expiry_s, cfg.sources[key]) == (20.0, "env:MCP_AGENT_REQUESTS_IDLE_EXPIRY_S")


@pytest.mark.parametrize("key,alias,infile,mine,theirs", [
    ("export.otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", "http://file:1", "http://mine:4317", "http://theirs:4317"),
    ("export.otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "grpc", "http/protobuf"),
    ("service.name", "OTEL_SERVICE_NAME", "file", "mine", "theirs"),
])
def test_alias_loses_to_mcp_agent_var(write, key, alias, infile, mine, theirs):
    s = C.setting(key)
    path = write(f"[{s.section}]\n{s.name} = {C._toml(infile)}\n")
    cfg = load_config(path, env={alias: theirs})
    assert (getattr(cfg, s.attr), cfg.sources[key]) == (theirs, f"env:{alias}")  # the alias beats the file
    cfg = load_config(path, env={alias: theirs, s.env: mine})
    assert (getattr(cfg, s.attr), cfg.sources[key]) == (mine, f"env:{s.env}")
    cfg = load_config(path, env={alias: theirs, s.env: mine}, overrides={key: theirs})
    assert (getattr(cfg, s.attr), cfg.sources[key]) == (theirs, "flag")


def test_kernel_headers_alias(tmp_path):
    cfg = load_config(env={"BCC_KERNEL_SOURCE": str(tmp_path)})
    assert cfg.kernel_headers == str(tmp_path) and cfg.sources["kernel.headers"] == "env:BCC_KERNEL_SOURCE"


def test_alias_edge_cases():
    # An empty OTEL_* variable means unset (OpenTelemetry's rule); an unused alias is not validated.
    cfg = load_config(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_SERVICE_NAME": ""})
    assert cfg.export_otlp_endpoint is None and cfg.service_name == "mcp-agent"
    assert cfg.sources["service.name"] == "default"
    cfg = load_config(env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "MCP_AGENT_EXPORT_OTLP_PROTOCOL": "grpc"})
    assert cfg.export_otlp_protocol == "grpc"
    # An empty MCP_AGENT_ variable for an optional setting unsets it, even against the file and alias.
    cfg = load_config(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1", "MCP_AGENT_EXPORT_OTLP_ENDPOINT": ""})
    assert cfg.export_otlp_endpoint is None


# ---- environment parsing ----------------------------------------------------------------------------

@pytest.mark.parametrize("raw,want", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True),
    ("false", False), ("0", False), ("NO", False), ("off", False), (" yes ", True),
])
def test_env_bool(raw, want):
    assert load_config(env={"MCP_AGENT_EXPORT_CONSOLE": raw}).export_console is want


@pytest.mark.parametrize("var,raw,attr,want", [
    ("MCP_AGENT_PROCESS_PIDS", "1, 2,3", "process_pids", (1, 2, 3)),
    ("MCP_AGENT_PROCESS_PIDS", "", "process_pids", ()),
    ("MCP_AGENT_PROBES_DISABLE", "a,b.c", "probes_disable", ("a", "b.c")),
    ("MCP_AGENT_PROCESS_COMMS", "python3 , vllm", "process_comms", ("python3", "vllm")),
    ("MCP_AGENT_EXPORT_METRIC_INTERVAL_S", "2", "export_metric_interval_s", 2.0),
    ("MCP_AGENT_EXPORT_METRIC_INTERVAL_S", "1e1", "export_metric_interval_s", 10.0),
    ("MCP_AGENT_EXPORT_METRIC_INTERVAL_S", ".5", "export_metric_interval_s", 0.5),
    ("MCP_AGENT_EXPORT_MAX_QUEUE_SIZE", "+100", "export_max_queue_size", 100),
    ("MCP_AGENT_LOG_LEVEL", "DEBUG", "log_level", "debug"),
    ("MCP_AGENT_EXPORT_JSONL_PATH", "none", "export_jsonl_path", ""),
    ("MCP_AGENT_EXPORT_JSONL_PATH", "/tmp/x.jsonl", "export_jsonl_path", "/tmp/x.jsonl"),
])
def test_env_values(var, raw, attr, want):
    assert getattr(load_config(env={var: raw}), attr) == want


def test_unrelated_env_is_ignored():
    assert values(load_config(env={"PATH": "/bin", "MCP_AGENTX": "1", "OTEL_FOO": "bar"})) == defaults()


# ---- errors ---------------------------------------------------------------------------------------

def test_error_message_examples(write):
    path = write('[export]\notlp_protocol = "udp"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    assert str(e.value) == (
        f'config error: export.otlp_protocol = "udp" (from {path}): must be one of grpc, http/protobuf')
    with pytest.raises(ConfigError) as e:
        load_config(env={"MCP_AGENT_REQUESTS_IDLE_EXPIRY_S": "abc"})
    assert str(e.value) == 'config error: MCP_AGENT_REQUESTS_IDLE_EXPIRY_S="abc": not a number'


BAD_FILES = [  # (TOML text, the key the message must name)
    ('[export]\nconsole = "yes"', "export.console"),
    ("[export]\nconsole = 1", "export.console"),
    ("[export]\nmax_queue_size = true", "export.max_queue_size"),
    ("[export]\nmax_queue_size = 8192.0", "export.max_queue_size"),
    ("[export]\nmax_queue_size = 15", "export.max_queue_size"),
    ("[export]\nmax_queue_size = 1_000_001", "export.max_queue_size"),
    ("[export]\nmax_queue_size = { value = 1 }", "export.max_queue_size"),
    ("[export]\nmetric_interval_s = 0.1", "export.metric_interval_s"),
    ('[export]\nmetric_interval_s = "10"', "export.metric_interval_s"),
    ("[export]\nmetric_interval_s = nan", "export.metric_interval_s"),
    ("[export]\nmetric_interval_s = inf", "export.metric_interval_s"),
    ("[export]\nmetric_interval_s = 1979-05-27", "export.metric_interval_s"),
    ('[export]\notlp_protocol = "GRPC2"', "export.otlp_protocol"),
    ('[export]\notlp_endpoint = "localhost:4317"', "export.otlp_endpoint"),
    ('[export]\notlp_endpoint = "ftp://collector:4317"', "export.otlp_endpoint"),
    ('[export]\notlp_endpoint = "http://"', "export.otlp_endpoint"),
    ('[export]\notlp_endpoint = "http://host:99999"', "export.otlp_endpoint"),
    ('[export]\notlp_endpoint = "http://host name:4317"', "export.otlp_endpoint"),
    ("[export]\notlp_endpoint = 4317", "export.otlp_endpoint"),
    ('[export]\njsonl_path = ["a.jsonl"]', "export.jsonl_path"),
    ("[export]\nconsolee = true", "export.consolee"),
    ('[export]\n"console.x" = true', "export.console.x"),
    ("[exporter]\nconsole = true", "exporter"),
    ("console = true", "console"),
    ("export = 1", "export"),
    ("[[export]]\nconsole = true", "export"),
    ("[export.console]\nx = 1", "export.console"),  # a table where a value belongs
    ("[export]\nconsole = [true]", "export.console"),
    ('[service]\nname = ""', "service.name"),
    ("[service]\nname = 1", "service.name"),
    ("[requests]\nidle_expiry_s = 0", "requests.idle_expiry_s"),
    ("[requests]\nidle_expiry_s = 86401", "requests.idle_expiry_s"),
    ("[requests]\nmax_open_per_pid = 65537", "requests.max_open_per_pid"),
    ("[requests]\nmax_begins_per_s_per_pid = -1", "requests.max_begins_per_s_per_pid"),
    ('[probes]\nstrict = "false"', "probes.strict"),
    ('[probes]\ndisable = "sched_switch"', "probes.disable"),
    ('[probes]\ndisable = ["ok", "Bad Name"]', "probes.disable"),
    ("[probes]\ndisable = [1]", "probes.disable"),
    ('[process]\nwatch = "some"', "process.watch"),
    ("[process]\npids = [1, 0]", "process.pids"),
    ('[process]\npids = [1, "2"]', "process.pids"),
    ("[process]\npids = [true]", "process.pids"),
    ("[process]\npids = 1", "process.pids"),
    ('[process]\ncomms = ["python3", "a-very-long-comm-name"]', "process.comms"),
    ('[process]\ncomms = ["ééééééééé"]', "process.comms"),  # 9 characters, 18 bytes
    ('[process]\ncomms = [""]', "process.comms"),
    ('[kernel]\nheaders = "/nonexistent/mcp-agent-headers"', "kernel.headers"),
    ("[kernel]\nheaders = true", "kernel.headers"),
    ('[kernel]\nlink_modules_build = "no"', "kernel.link_modules_build"),
    ("[status]\ninterval_s = 61", "status.interval_s"),
    ("[status]\ninterval_s = 0.05", "status.interval_s"),
    ('[status]\nenabled = "true"', "status.enabled"),
    ('[log]\nlevel = "verbose"', "log.level"),
    ('[log]\nlevel = "a\\nb"', "log.level"),  # a newline in the value stays escaped
]


@pytest.mark.parametrize("text,key", BAD_FILES, ids=[f"{k}-{i}" for i, (_, k) in enumerate(BAD_FILES)])
def test_bad_file_values(write, text, key):
    path = write(text + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    msg = one_line_error(e)
    assert key in msg and path in msg


def test_unknown_key_suggests(write):
    with pytest.raises(ConfigError) as e:
        load_config(write("[export]\nconsol = true\n"), env={})
    assert "unknown setting" in str(e.value) and "did you mean export.console?" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(write("[exprot]\nconsole = true\n"), env={})
    assert "unknown section; did you mean [export]?" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(write("level = 'info'\n"), env={})
    assert "log.level" in str(e.value)


@pytest.mark.parametrize("text,line", [
    ("[export\nconsole = true\n", 1),
    ("[export]\nconsole = tru\n", 2),
    ("[export]\nconsole = true\nconsole = false\n", 3),
    ('[log]\nlevel = "info\n', 2),
    ("[log]\n\n\nlevel == 1\n", 4),
])
def test_toml_syntax_errors(write, text, line):
    path = write(text)
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    msg = one_line_error(e)
    assert msg.startswith(f"config error: {path}: line {line}, column ") and "invalid TOML" in msg


BAD_ENV = [  # (variable, value, what the message must name besides the variable)
    ("MCP_AGENT_EXPORT_CONSOLE", "maybe", "not a boolean"),
    ("MCP_AGENT_EXPORT_CONSOLE", "", "not a boolean"),
    ("MCP_AGENT_STATUS_ENABLED", "2", "not a boolean"),
    ("MCP_AGENT_EXPORT_MAX_QUEUE_SIZE", "8192.0", "not an integer"),
    ("MCP_AGENT_EXPORT_MAX_QUEUE_SIZE", "1_000", "not an integer"),
    ("MCP_AGENT_EXPORT_MAX_QUEUE_SIZE", "0x10", "not an integer"),
    ("MCP_AGENT_EXPORT_MAX_QUEUE_SIZE", "10", "between 16 and 1000000"),
    ("MCP_AGENT_EXPORT_MAX_QUEUE_SIZE", " ", "not an integer"),
    ("MCP_AGENT_EXPORT_METRIC_INTERVAL_S", "nan", "not a number"),
    ("MCP_AGENT_EXPORT_METRIC_INTERVAL_S", "inf", "not a number"),
    ("MCP_AGENT_EXPORT_METRIC_INTERVAL_S", "10s", "not a number"),
    ("MCP_AGENT_EXPORT_METRIC_INTERVAL_S", "1e9", "between 0.5 and 3600"),
    ("MCP_AGENT_PROCESS_PIDS", "1,x", 'element [1] = "x": not an integer'),
    ("MCP_AGENT_PROCESS_PIDS", "1,,2", "empty list element"),
    ("MCP_AGENT_PROCESS_PIDS", "1,0", "must be >= 1"),
    ("MCP_AGENT_PROBES_DISABLE", "a,B", "not a probe name"),
    ("MCP_AGENT_PROCESS_COMMS", "averyveryverylongname", "between 1 and 15"),
    ("MCP_AGENT_EXPORT_OTLP_PROTOCOL", "udp", "must be one of grpc, http/protobuf"),
    ("MCP_AGENT_EXPORT_OTLP_ENDPOINT", "collector:4317", "http:// or https://"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "export.otlp_protocol"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "grpc://collector", "export.otlp_endpoint"),
    ("BCC_KERNEL_SOURCE", "/nonexistent/mcp-agent-headers", "kernel.headers"),
    ("MCP_AGENT_SERVICE_NAME", "", "must not be empty"),
    ("MCP_AGENT_LOG_LEVEL", "loud", "must be one of"),
    ("MCP_AGENT_CONTROL_GROUP", "mcp-no-such-group", "no such group"),
    ("MCP_AGENT_CONTROL_GROUP", "4294967295", "not a valid gid"),
    ("MCP_AGENT_CONTROL_GROUP", "٢", "no such group"),  # a digit, not an ASCII one
    ("MCP_AGENT_EXPORT_CONSOL", "1", "unknown setting; did you mean MCP_AGENT_EXPORT_CONSOLE?"),
    ("MCP_AGENT_FOO", "1", "unknown setting"),
]


@pytest.mark.parametrize("var,raw,expect", BAD_ENV, ids=[f"{v}-{i}" for i, (v, _, _) in enumerate(BAD_ENV)])
def test_bad_env_values(var, raw, expect):
    with pytest.raises(ConfigError) as e:
        load_config(env={var: raw})
    msg = one_line_error(e)
    assert msg.startswith(f"config error: {var}=") and expect in msg, msg


def test_control_group_by_name_or_gid(write, tmp_path):
    assert load_config(env={}).control_group is None  # the socket stays root's
    assert load_config(env={"MCP_AGENT_CONTROL_GROUP": "nogroup"}).control_group == "nogroup"
    assert load_config(env={"MCP_AGENT_CONTROL_GROUP": ""}).control_group is None
    # a gid needs no name here: a container's /etc/group may not list the host's groups
    assert load_config(write('[control]\ngroup = "424242"\n')).control_group == "424242"
    with pytest.raises(ConfigError) as e:
        load_config(write('[control]\ngroup = "mcp-no-such-group"\n'))
    assert one_line_error(e) == (f'config error: control.group = "mcp-no-such-group" (from {tmp_path}/agent.toml): '
                                 'no such group (a name in /etc/group or a numeric gid)')
    with pytest.raises(ConfigError):
        load_config(write("[control]\ngroup = 0\n"))  # a string, as TOML has it


def test_env_is_checked_even_when_a_flag_wins():
    with pytest.raises(ConfigError):
        load_config(env={"MCP_AGENT_LOG_LEVEL": "loud"}, overrides={"log.level": "info"})


@pytest.mark.parametrize("key,value", [
    ("export.max_queue_size", "100"),
    ("export.max_queue_size", 5),
    ("export.max_queue_size", True),
    ("export.console", 1),
    ("export.metric_interval_s", float("nan")),
    ("export.otlp_protocol", "udp"),
    ("export.otlp_endpoint", "collector"),
    ("process.pids", (1, -2)),
    ("process.pids", 3),
    ("probes.disable", ("UPPER",)),
])
def test_bad_flag_values(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={key: value})
    msg = one_line_error(e)
    assert msg.startswith(f"config error: {key} = ") and "(from flag)" in msg


def test_flag_values_and_unknown_flag():
    cfg = load_config(env={}, overrides={"process.pids": (3, 4), "export.metric_interval_s": 2,
                                         "export.otlp_endpoint": "http://c:4317", "log.level": "error"})
    assert cfg.process_pids == (3, 4) and cfg.export_metric_interval_s == 2.0
    assert cfg.export_otlp_endpoint == "http://c:4317" and cfg.sources["process.pids"] == "flag"
    with pytest.raises(ValueError) as e:
        load_config(env={}, overrides={"export.nope": 1})
    assert not isinstance(e.value, ConfigError)


# ---- describe and the example file ---------------------------------------------------------------

def test_describe(write):
    path = write("[process]\npids = [7]\n")
    cfg = load_config(path, env={"MCP_AGENT_EXPORT_CONSOLE": "on"}, overrides={"log.level": "debug"})
    lines = C.describe(cfg)
    assert len(lines) == len(C.SETTINGS) and all(re.fullmatch(r"[a-z_.]+ = .+ \(.+\)", ln) for ln in lines)
    assert "process.pids = [7] (file:%s)" % path in lines
    assert "export.console = true (env:MCP_AGENT_EXPORT_CONSOLE)" in lines
    assert "log.level = \"debug\" (flag)" in lines
    assert "export.otlp_endpoint = unset (default)" in lines
    assert "requests.idle_expiry_s = 300.0 (default)" in lines


def test_example_file_is_generated():
    assert EXAMPLE.read_text() == C.example_toml(), (
        "packaging/config.example.toml is stale: python -m mcp_hostagent.config > packaging/config.example.toml")
    for s in C.SETTINGS:
        assert f"# {s.help}\n" in EXAMPLE.read_text() and s.env in EXAMPLE.read_text()


def test_example_file_round_trips(tmp_path):
    cfg = load_config(str(EXAMPLE), env={})
    assert values(cfg) == defaults() and set(cfg.sources.values()) == {"default"}
    # Uncommenting every setting line still gives the defaults, now read from the file.
    uncommented = re.sub(r"(?m)^#(?=[a-z_]+ = )", "", C.example_toml())
    assert uncommented.count("\n#") < C.example_toml().count("\n#")
    p = tmp_path / "all.toml"
    p.write_text(uncommented)
    cfg = load_config(str(p), env={})
    assert values(cfg) == defaults() and set(cfg.sources.values()) == {f"file:{p}"}


def test_kubernetes_service_link_variables_are_not_settings():
    """A Service named mcp-agent makes Kubernetes put these in every pod of its namespace (service links,
    on by default): they are left alone, while a name that only looks like ours is still refused."""
    links = {"MCP_AGENT_SERVICE_HOST": "10.96.0.12", "MCP_AGENT_SERVICE_PORT": "4317",
             "MCP_AGENT_SERVICE_PORT_OTLP_GRPC": "4317", "MCP_AGENT_PORT": "tcp://10.96.0.12:4317",
             "MCP_AGENT_PORT_4317_TCP": "tcp://10.96.0.12:4317", "MCP_AGENT_PORT_4317_TCP_PROTO": "tcp",
             "MCP_AGENT_PORT_4317_TCP_PORT": "4317", "MCP_AGENT_PORT_4317_TCP_ADDR": "10.96.0.12",
             "MCP_AGENT_PORT_53_UDP_ADDR": "10.96.0.12"}
    cfg = load_config(env={**links, "MCP_AGENT_LOG_LEVEL": "debug"})
    assert cfg.log_level == "debug" and not any(v.startswith("env:MCP_AGENT_PORT") for v in cfg.sources.values())
    for near in ("MCP_AGENT_PORTS", "MCP_AGENT_PORT_4317", "MCP_AGENT_PORT_4317_TCP_HOST", "MCP_AGENT_SERVICE_HOSTS"):
        with pytest.raises(ConfigError) as e:
            load_config(env={near: "1"})
        assert "unknown setting" in one_line_error(e), near
