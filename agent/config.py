"""Agent configuration: one table of settings, layered flag > env > file > default, validated at start.

Every setting is one row of SETTINGS.  It can be set in the TOML file (``[section] name = value``),
in the environment (``MCP_AGENT_<SECTION>_<NAME>``, plus a few standard aliases such as
``OTEL_EXPORTER_OTLP_ENDPOINT`` that lose to the MCP_AGENT_ name) and by command-line flags (passed
to ``load_config`` as ``overrides``).  Anything unknown or malformed raises ConfigError, whose text
is one line naming the key and where the value came from, so that a typo stops the agent at start
instead of being silently ignored.

Conventions: "" for an optional setting means unset (TOML has no null); an empty OTEL_*/BCC_* alias
is ignored, as OpenTelemetry specifies; list values are tuples in Config.

Regenerate the example file with ``python -m mcp_hostagent.config > packaging/config.example.toml``.
"""

from __future__ import annotations

import grp
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field, fields
from difflib import get_close_matches
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional
from urllib.parse import urlsplit

from .redact import redact_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_PATH = "/etc/mcp-hostagent/config.toml"
ENV_PREFIX = "MCP_AGENT_"
CONFIG_ENV = "MCP_AGENT_CONFIG"
# What Kubernetes' service links put in every pod of a namespace with a Service named mcp-agent
# (<SVC>_SERVICE_HOST, <SVC>_SERVICE_PORT[_<NAME>], <SVC>_PORT[_<PORT>_<PROTO>[_PROTO|_PORT|_ADDR]]):
# not ours, and no setting is named like them. Refusing them as unknown settings crash-looped the
# DaemonSet; any other unknown MCP_AGENT_ name is still refused (a typo must not pass silently).
_SERVICE_LINK = re.compile(r"MCP_AGENT_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)")
TYPES = ("str", "int", "float", "bool", "list[str]", "list[int]", "choice")


class ConfigError(Exception):
    """A bad configuration; str() is one line starting with "config error: "."""

    def __init__(self, msg: str) -> None:
        super().__init__("config error: " + msg.replace("\r", "\\r").replace("\n", "\\n"))


@dataclass(frozen=True)
class Setting:
    key: str  # "section.name"
    type: str  # one of TYPES
    default: Any
    help: str  # one line
    choices: Optional[tuple[str, ...]] = None
    min: Optional[float] = None  # numbers: the value; str and list[str]: the length in bytes; lists: each element
    max: Optional[float] = None
    env_aliases: tuple[str, ...] = ()
    optional: bool = False  # None allowed (and "" means None)
    # Extra validation after the type and range checks: returns the value to use, or raises ValueError(reason).
    check: Optional[Callable[[Any], Any]] = field(default=None, compare=False, repr=False)

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.key.split(".", 1)[1]

    @property
    def attr(self) -> str:
        return self.key.replace(".", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.attr.upper()


def _none_is_empty(v: str) -> str:
    return "" if v.lower() == "none" else v


def _http_url(v: str) -> str:
    try:
        u = urlsplit(v)
        u.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as e:
        raise ValueError(f"not a valid URL ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname or any(c.isspace() for c in v):
        raise ValueError("must be an http:// or https:// URL with a host")
    return v


def _directory(v: str) -> str:
    if not os.path.isdir(v):
        raise ValueError("no such directory")
    return v


def _headers_file(v: str) -> str:
    from .otlpheaders import read_headers_file

    read_headers_file(v)  # ValueError names the problem, never the file's text
    return v


def _listen(v: str) -> str:
    """host:port of the Prometheus endpoint ("" or "none": off); checked here, bound at start."""
    if v == "" or v.lower() == "none":
        return ""
    from .exporters.prometheus import parse_listen

    try:
        parse_listen(v)
    except ValueError as e:  # ListenError: its reason, without the value again
        raise ValueError(getattr(e, "reason", str(e))) from None
    return v


def _group(v: str) -> str:
    """A group name that exists here, or a numeric gid (which needs no name: a container's /etc/group
    may lack the host's groups). Resolved again when the socket is made."""
    if v.isascii() and v.isdigit():
        if int(v) >= 0xFFFFFFFF:  # (gid_t)-1 means "unchanged" to chown(2)
            raise ValueError("not a valid gid")
        return v
    try:
        grp.getgrnam(v)
    except KeyError:
        raise ValueError("no such group (a name in /etc/group or a numeric gid)") from None
    return v


def _users(v: tuple[str, ...]) -> tuple[str, ...]:
    """User names that exist here, or numeric uids; resolved to uids when the agent starts."""
    import pwd

    for i, name in enumerate(v):
        if name.isascii() and name.isdigit():
            if int(name) >= 0xFFFFFFFF:
                raise ValueError(f"element [{i}] = {_show(name)}: not a valid uid")
            continue
        try:
            pwd.getpwnam(name)
        except KeyError:
            raise ValueError(f"element [{i}] = {_show(name)}: no such user (a name in /etc/passwd or a numeric uid)") from None
    return v


def _cgroup_paths(v: tuple[str, ...]) -> tuple[str, ...]:
    for i, path in enumerate(v):
        if not path.startswith("/") or "/../" in path + "/" or any(c.isspace() for c in path):
            raise ValueError(f"element [{i}] = {_show(path)}: not a cgroup v2 path such as /system.slice/vllm.service")
    return v


_PROBE_NAME = re.compile(r"[a-z0-9_.:-]+\Z")


def _probe_names(v: tuple[str, ...]) -> tuple[str, ...]:
    for i, name in enumerate(v):
        if not _PROBE_NAME.match(name):
            raise ValueError(f"element [{i}] = {_show(name)}: not a probe name (allowed: a-z 0-9 _ . : -)")
    return v


S = Setting
SETTINGS: tuple[Setting, ...] = (
    S("export.jsonl_path", "str", "/var/lib/mcp-hostagent/telemetry.jsonl",
      'File that spans are appended to as OTLP/JSON lines, metrics to the same name with .metrics '
      'before the extension; "" or "none" disables both', check=_none_is_empty),
    S("export.otlp_endpoint", "str", None,
      'OTLP collector URL (http:// or https://); unset or "" disables OTLP export',
      env_aliases=("OTEL_EXPORTER_OTLP_ENDPOINT",), optional=True, check=_http_url),
    S("export.otlp_protocol", "choice", "grpc", "OTLP transport",
      choices=("grpc", "http/protobuf"), env_aliases=("OTEL_EXPORTER_OTLP_PROTOCOL",)),
    S("export.headers_file", "str", None,
      "File of OTLP headers (tokens), one name=value a line; must be root's, mode 0600; read again on SIGHUP",
      optional=True, check=_headers_file),
    S("export.console", "bool", False, "Also print telemetry to stdout: a line per span, a summary line per metric and export interval"),
    S("export.prometheus_listen", "str", "",
      'host:port (e.g. 127.0.0.1:9464, [::1]:9464) serving metrics on GET /metrics for Prometheus, without'
      ' authentication (docs/PROMETHEUS.md); "" or "none" disables it', max=255, check=_listen),
    S("export.metric_interval_s", "float", 10.0, "Seconds between metric exports", min=0.5, max=3600),
    S("export.max_queue_size", "int", 8192,
      "Most spans queued for export; when full, new spans are dropped and counted", min=16, max=1_000_000),
    S("service.name", "str", "mcp-agent", "service.name resource attribute of all telemetry",
      min=1, env_aliases=("OTEL_SERVICE_NAME",)),
    S("requests.max_open_per_pid", "int", 1024,
      "Most threads of one process with an open request; further begins are refused and counted",
      min=1, max=65536),
    S("requests.idle_expiry_s", "float", 300.0,
      "Seconds after its begin at which a request never ended is closed as expired", min=1, max=86400),
    S("requests.max_begins_per_s_per_pid", "int", 20000,
      "Most request begins accepted per second per process; the excess is dropped and counted",
      min=1, max=10_000_000),
    S("requests.http", "bool", True,
      "Find HTTP/1.1 requests of watched processes with no code in them (socket syscall tracepoints, "
      "docs/HTTP.md); false turns the http_* probes off, and their cost on every read and write of the host"),
    S("requests.http_conns_per_owner", "int", 4096,
      "Most connections with a zero-code HTTP request in flight that the processes of one uid, and of one"
      " cgroup, may hold in the kernel's table (16,384 in all) at once; allowed markers' owners exempt",
      min=1, max=16384),
    S("requests.group", "choice", "cgroup",
      "A request's serving group, whose threads' faults, switches and reclaim its span sums beside its own thread's:"
      " the thread's cgroup (its container or systemd unit), or the process tree the serving process roots"
      " (processes it forks, such as a batching engine)", choices=("cgroup", "tree")),
    S("requests.mark_users", "list[str]", (),
      "Users (names or uids) whose processes may mark requests; with mark_cgroups, unset: anyone may, within"
      " the per-uid and per-cgroup budgets. Others' markers are counted and dropped in the kernel",
      min=1, max=64, check=_users),
    S("requests.mark_cgroups", "list[str]", (),
      "cgroup v2 paths (e.g. /system.slice/vllm.service) whose processes, and those of"
      " cgroups below, may mark requests; see requests.mark_users", min=1, max=4096, check=_cgroup_paths),
    S("requests.max_begins_per_s_per_uid", "int", 20000,
      "Most request begins per second from all processes of one uid (allowed markers exempt)",
      min=1, max=10_000_000),
    S("requests.max_begins_per_s_per_cgroup", "int", 20000,
      "Most request begins per second from all processes of one cgroup (allowed markers exempt)",
      min=1, max=10_000_000),
    S("requests.max_open_per_uid", "int", 2048,
      "Most open requests of one uid's threads together (allowed markers exempt)", min=1, max=1 << 20),
    S("requests.max_open_per_cgroup", "int", 2048,
      "Most open requests of one cgroup's threads together (allowed markers exempt)", min=1, max=1 << 20),
    S("requests.max_procs_per_uid", "int", 256,
      "Most processes of one uid that mark requests at once (allowed markers exempt)", min=1, max=1 << 20),
    S("requests.max_procs_per_cgroup", "int", 256,
      "Most processes of one cgroup that mark requests at once (allowed markers exempt)", min=1, max=1 << 20),
    S("probes.strict", "bool", False, "Exit if any probe fails to attach, instead of running without it"),
    S("probes.disable", "list[str]", (), "Names of probes not to attach (each of a-z 0-9 _ . : -)", check=_probe_names),
    S("process.watch", "choice", "gpu",
      "Per-process counters for: all processes, GPU processes (libcuda or /dev/nvidia* mapped), or only"
      " processes that mark requests; process.pids/process.comms are added in every mode",
      choices=("all", "gpu", "marked")),
    S("process.pids", "list[int]", (), "Process ids to watch", min=1),
    S("process.comms", "list[str]", (),
      "Process names (comm, 1..15 bytes: the kernel keeps 16 with the NUL) to watch", min=1, max=15),
    # argv is where credentials get passed (docs/SECURITY.md, "Threat model: exposure")
    S("process.command_line", "choice", "redacted",
      "process.command_line of watched processes: argv with credential-shaped values (--api-key=..., --token X,"
      " PASSWORD=..., URL userinfo) as ***, the full argv, or none",
      choices=("redacted", "full", "off")),
    S("kernel.headers", "str", None,
      "Kernel headers directory for BCC when not the running kernel's (must exist); unset uses the default",
      env_aliases=("BCC_KERNEL_SOURCE",), optional=True, check=_directory),
    S("kernel.link_modules_build", "bool", False,
      "Create the /lib/modules/$(uname -r)/build link to the kernel headers when it is missing"),
    S("reclaim.stall_threshold_ms", "float", 1.0,
      "A direct or memcg reclaim stall at least this long becomes a child span of its request", min=0.001, max=60000),
    S("reclaim.window_s", "float", 1.0, "Length of the windows the reclaim-storm rule is evaluated on", min=0.1, max=60),
    S("reclaim.storm_kswapd_ratio", "float", 0.5,
      "Storm when kswapd is awake at least this share of a window (any NUMA node)", min=0.01, max=1),
    S("reclaim.storm_direct_ms_per_s", "float", 10.0,
      "Storm when direct-reclaim stalls add up to this many ms per second (all threads)", min=0.001, max=1e6),
    S("reclaim.storm_memcg_ms_per_s", "float", 10.0,
      "Storm of one cgroup when its memcg-reclaim stalls add up to this many ms per second (a host storm is"
      " global reclaim only: kswapd and direct)", min=0.001, max=1e6),
    S("reclaim.storm_close_windows", "int", 3,
      "Quiet windows in a row (all signals under half their threshold) that close a storm", min=1, max=3600),
    S("cuda.overhead_budget", "float", 0.005,
      "Most slowdown the libcuda launch uprobes may cost a traced process; above it they are duty-cycled"
      " (the default leaves room for the per-hit calibration's error: docs/PERFORMANCE.md)",
      min=0.0001, max=1.0),
    S("cuda.device_globs", "list[str]", ("/dev/nvidia*",),
      "Device files whose ioctls are counted as NVIDIA driver ioctls (glob patterns)", min=1),
    S("cuda.max_libraries", "int", 16,
      "Most libcuda files (device, inode) followed at once; more are refused and counted", min=1, max=4096),
    S("cuda.duty_slice_s", "float", 0.2, "Length of one attach slice when launch probes are duty-cycled",
      min=0.01, max=10),
    S("cuda.step_span_min_ms", "float", 50.0,
      "A GPU step of an unmarked process becomes a span only if it lasts this long and 4x its process's "
      "mean; every step goes to the step histograms", min=0.0, max=3.6e6),
    S("cuda.step_spans_per_s", "float", 10.0,
      "Most GPU step spans per second, host-wide (and 1 per second per process)", min=0.0, max=10000),
    S("gpu.enabled", "bool", True, "Sample NVML (utilisation, clocks, throttling, PCIe, Xid) and poll PCIe links in sysfs"),
    S("gpu.sample_period_s", "float", 1.0, "Seconds between NVML samples of each GPU", min=0.05, max=60),
    S("gpu.slow_period_s", "float", 10.0,
      "Seconds between slow NVML calls (PCIe throughput blocks ~20 ms per GPU)", min=1, max=3600),
    S("pcie.busy_util_pct", "float", 10.0,
      "GPU utilisation (%) above which a lower PCIe link speed is downtraining, not power saving", min=0, max=100),
    S("nic.enabled", "bool", True, "Watch network links (carrier, speed, flaps) over netlink"),
    S("control.socket", "str", "/run/mcp-hostagent/agent.sock",
      'Unix socket (mode 0660, no TCP) on which `mcp-agent run` serves snapshots to `mcp-agent top`; "" or "none" disables it',
      check=_none_is_empty),
    S("control.group", "str", None,
      "Group (name or numeric gid) given the control socket, whose members may then use `mcp-agent top`; unset: root's",
      optional=True, check=_group),
    S("status.interval_s", "float", 1.0, "Seconds between status reports", min=0.1, max=60),
    S("status.enabled", "bool", True, "Report the agent's status periodically"),
    S("log.level", "choice", "info", "Log level", choices=("debug", "info", "warning", "error")),
)
del S
_BY_KEY = {s.key: s for s in SETTINGS}
_BY_ENV = {s.env: s for s in SETTINGS}
_SECTIONS: dict[str, list[Setting]] = {}
for _s in SETTINGS:
    _SECTIONS.setdefault(_s.section, []).append(_s)


def setting(key: str) -> Setting:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"unknown setting {key!r}") from None


@dataclass(frozen=True)
class Config:
    export_jsonl_path: str
    export_otlp_endpoint: str | None
    export_otlp_protocol: str
    export_headers_file: str | None
    export_console: bool
    export_prometheus_listen: str
    export_metric_interval_s: float
    export_max_queue_size: int
    service_name: str
    requests_max_open_per_pid: int
    requests_idle_expiry_s: float
    requests_max_begins_per_s_per_pid: int
    requests_http: bool
    requests_http_conns_per_owner: int
    requests_group: str
    requests_mark_users: tuple[str, ...]
    requests_mark_cgroups: tuple[str, ...]
    requests_max_begins_per_s_per_uid: int
    requests_max_begins_per_s_per_cgroup: int
    requests_max_open_per_uid: int
    requests_max_open_per_cgroup: int
    requests_max_procs_per_uid: int
    requests_max_procs_per_cgroup: int
    probes_strict: bool
    probes_disable: tuple[str, ...]
    process_watch: str
    process_pids: tuple[int, ...]
    process_comms: tuple[str, ...]
    process_command_line: str
    kernel_headers: str | None
    kernel_link_modules_build: bool
    reclaim_stall_threshold_ms: float
    reclaim_window_s: float
    reclaim_storm_kswapd_ratio: float
    reclaim_storm_direct_ms_per_s: float
    reclaim_storm_memcg_ms_per_s: float
    reclaim_storm_close_windows: int
    cuda_overhead_budget: float
    cuda_device_globs: tuple[str, ...]
    cuda_max_libraries: int
    cuda_duty_slice_s: float
    cuda_step_span_min_ms: float
    cuda_step_spans_per_s: float
    gpu_enabled: bool
    gpu_sample_period_s: float
    gpu_slow_period_s: float
    pcie_busy_util_pct: float
    nic_enabled: bool
    control_socket: str
    control_group: str | None
    status_interval_s: float
    status_enabled: bool
    log_level: str
    # key -> "default" | "file:/path" | "env:NAME" | "flag"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)


if [f.name for f in fields(Config)] != [s.attr for s in SETTINGS] + ["sources"]:  # pragma: no cover
    raise RuntimeError("Config fields do not match SETTINGS")


# ---- values ----------------------------------------------------------------------------------------

def _show(v: Any, limit: int = 80) -> str:
    """A value as one short line, TOML/JSON style."""
    text = json.dumps(list(v) if isinstance(v, tuple) else v, default=str, ensure_ascii=False)
    text = redact_url(text)  # a URL's password is not shown, not even in an error about that URL
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _kind(v: Any) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
                    ((list, tuple), "an array"), (dict, "a table")):
        if isinstance(v, t):
            return name
    return "a date/time"


_EXPECTED = {"str": "a string", "choice": "a string", "int": "an integer", "float": "a number",
             "bool": "a boolean", "list[str]": "an array of strings", "list[int]": "an array of integers"}


def _range(s: Setting, x: float, what: str = "") -> None:
    lo, hi = s.min, s.max
    if (lo is None or x >= lo) and (hi is None or x <= hi):
        return
    if what and x == 0:
        raise ValueError("must not be empty")
    bound = f"between {lo} and {hi}" if lo is not None and hi is not None else (
        f">= {lo}" if lo is not None else f"<= {hi}")
    raise ValueError(f"{what}must be {bound}")


def _scalar(s: Setting, t: str, v: Any) -> Any:
    bad = ValueError(f"expected {_EXPECTED[t]}, got {_kind(v)}")
    if t == "bool":
        if not isinstance(v, bool):
            raise bad
        return v
    if t in ("int", "float"):
        if isinstance(v, bool) or not isinstance(v, (int, float) if t == "float" else int):
            raise bad
        if t == "float":
            if not math.isfinite(v):
                raise ValueError("must be a finite number")
            v = float(v)
        _range(s, v)
        return v
    if not isinstance(v, str):
        raise bad
    if t == "choice":
        if v.lower() not in s.choices:
            raise ValueError("must be one of " + ", ".join(s.choices))
        return v.lower()
    _range(s, len(v.encode()), "length in bytes ")
    return v


def _coerce(s: Setting, v: Any) -> Any:
    """Type-check and validate a typed value (from TOML or a flag); returns the value to store."""
    if s.optional and (v is None or v == ""):
        return None
    if s.type.startswith("list["):
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"expected {_EXPECTED[s.type]}, got {_kind(v)}")
        out = []
        for i, x in enumerate(v):
            try:
                out.append(_scalar(s, s.type[5:-1], x))
            except ValueError as e:
                raise ValueError(f"element [{i}] = {_show(x)}: {e}") from None
        v = tuple(out)
    else:
        v = _scalar(s, s.type, v)
    return s.check(v) if s.check else v


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_INT = re.compile(r"[+-]?\d+\Z")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\Z")


def _parse_text(t: str, raw: str) -> Any:
    if t == "bool":
        if raw.strip().lower() not in _BOOLS:
            raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")
        return _BOOLS[raw.strip().lower()]
    if t == "int":
        if not _INT.match(raw.strip()):
            raise ValueError("not an integer")
        return int(raw)
    if t == "float":
        if not _FLOAT.match(raw.strip()):
            raise ValueError("not a number")
        return float(raw)
    return raw


def _from_env(s: Setting, raw: str) -> Any:
    """An environment string -> typed value (validated by _coerce afterwards)."""
    if not s.type.startswith("list["):
        return None if s.optional and raw == "" else _parse_text(s.type, raw)
    items = [] if raw.strip() == "" else [x.strip() for x in raw.split(",")]
    out = []
    for i, x in enumerate(items):
        try:
            if x == "":
                raise ValueError("empty list element")
            out.append(_parse_text(s.type[5:-1], x))
        except ValueError as e:
            raise ValueError(f"element [{i}] = {_show(x)}: {e}") from None
    return out


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    return repr(v)


def _hint(word: str, options: list[str], form: str = "{}") -> str:
    close = get_close_matches(word, options, n=1)
    return f"; did you mean {form.format(close[0])}?" if close else ""


# ---- layers ----------------------------------------------------------------------------------------

def _read_file(path: str, origin: str) -> dict[str, Any]:
    """Validated {key: value} from a TOML file; origin is how errors name where the path came from."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{origin}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        m = re.match(r"(.*) \(at (line \d+, column \d+|end of document)\)\Z", str(e), re.S)
        where, msg = (m.group(2), m.group(1)) if m else ("", str(e))
        raise ConfigError(f"{path}: {where + ': ' if where else ''}invalid TOML: {msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{origin}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    out: dict[str, Any] = {}
    for sec, table in data.items():
        if sec not in _SECTIONS:
            if isinstance(table, dict):
                raise ConfigError(f"[{sec}] (from {path}): unknown section{_hint(sec, list(_SECTIONS), '[{}]')}")
            names = {s.name: s.key for s in SETTINGS}
            close = get_close_matches(sec, list(names), n=1)
            hint = f"; did you mean {names[close[0]]} (in [{names[close[0]].split('.')[0]}])?" if close else ""
            raise ConfigError(f"{sec} (from {path}): unknown setting: settings go in a [section]{hint}")
        if not isinstance(table, dict):
            raise ConfigError(f"{sec} = {_show(table)} (from {path}): expected a table [{sec}], got {_kind(table)}")
        for name, value in table.items():
            key = f"{sec}.{name}"
            s = _BY_KEY.get(key)
            if s is None:
                raise ConfigError(f"{key} (from {path}): unknown setting{_hint(key, list(_BY_KEY))}")
            try:
                out[key] = _coerce(s, value)
            except ValueError as e:
                raise ConfigError(f"{key} = {_show(value)} (from {path}): {e}") from None
    return out


def load_config(path: str | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, object] | None = None) -> Config:
    """The configuration: overrides (flags) > env > file > defaults.

    path: the --config flag; else $MCP_AGENT_CONFIG; else DEFAULT_CONFIG_PATH if it exists.
    env: defaults to os.environ.  overrides: {dotted key: typed value}; None means "flag not given".
    """
    env = os.environ if env is None else env
    values = {s.key: s.default for s in SETTINGS}
    sources = dict.fromkeys(values, "default")

    if path is not None:
        file, origin = path, path
    elif env.get(CONFIG_ENV):
        file, origin = env[CONFIG_ENV], f"{CONFIG_ENV}={_show(env[CONFIG_ENV])}"
    else:
        file = origin = DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None
    if file is not None:
        for key, v in _read_file(file, origin).items():
            values[key], sources[key] = v, f"file:{file}"

    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name != CONFIG_ENV and name not in _BY_ENV \
                and not _SERVICE_LINK.fullmatch(name):
            hint = _hint(name[len(ENV_PREFIX):], [n[len(ENV_PREFIX):] for n in _BY_ENV], ENV_PREFIX + "{}")
            raise ConfigError(f"{name}={_show(env[name])}: unknown setting{hint}")
    for s in SETTINGS:
        name = next((n for n in (s.env, *s.env_aliases) if n in env and (n == s.env or env[n] != "")), None)
        if name is None:
            continue
        try:
            values[s.key], sources[s.key] = _coerce(s, _from_env(s, env[name])), f"env:{name}"
        except ValueError as e:
            alias = f" (for {s.key})" if name != s.env else ""
            raise ConfigError(f"{name}={_show(env[name])}{alias}: {e}") from None

    for key, v in (overrides or {}).items():
        s = _BY_KEY.get(key)
        if s is None:
            raise ValueError(f"unknown config override {key!r}")
        if v is None:
            continue
        try:
            values[key], sources[key] = _coerce(s, v), "flag"
        except ValueError as e:
            raise ConfigError(f"{key} = {_show(v)} (from flag): {e}") from None

    return Config(**{_BY_KEY[k].attr: v for k, v in values.items()}, sources=MappingProxyType(sources))


def describe(cfg: Config) -> list[str]:
    """One "key = value (source)" line per setting, for --show-config."""
    out = []
    for s in SETTINGS:
        v = getattr(cfg, s.attr)
        out.append(f"{s.key} = {'unset' if v is None else redact_url(_toml(v))} ({cfg.sources.get(s.key, 'default')})")
    return out


def example_toml() -> str:
    """The commented example config (packaging/config.example.toml), generated from SETTINGS."""
    lines = [
        "# mcp-agent configuration; the agent reads /etc/mcp-hostagent/config.toml if it exists,",
        "# or the file named by --config or $MCP_AGENT_CONFIG.",
        "# Precedence: command-line flag > environment > this file > default. Unknown keys are errors.",
        "# Each setting is shown commented out with its default value; uncomment a line to change it.",
        "# Generated by `python -m mcp_hostagent.config`; do not edit by hand.",
    ]
    for sec, settings in _SECTIONS.items():
        lines += ["", f"[{sec}]"]
        for i, s in enumerate(settings):
            notes = []
            if s.choices:
                notes.append("one of: " + ", ".join(s.choices))
            if s.type in ("int", "float", "list[int]") and (s.min is not None or s.max is not None):
                bound = (f"{s.min}..{s.max}" if s.min is not None and s.max is not None
                         else f">= {s.min}" if s.min is not None else f"<= {s.max}")
                notes.append(("each " if s.type.startswith("list") else "") + bound)
            comma = " (comma-separated)" if s.type.startswith("list") else ""
            notes.append("env: " + ", ".join((s.env, *s.env_aliases)) + comma)
            lines += [""] * (i > 0) + [f"# {s.help}", "# " + "; ".join(notes),
                                       f"#{s.name} = {_toml('' if s.default is None else s.default)}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(example_toml())
