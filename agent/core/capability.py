"""The one protocol a capability plugs into the core with (docs/ARCHITECTURE.md: the picture).

A capability is declared once, as data (Declaration, in its folder's __init__.py: light, read before
the compile), and made by the core with one signature, Capability(ctx). The core drives every one the
same way:

    prepare()                       before the load: refuse a bad setting (CapabilityError), warm a source
    loaded()                        right after the load and attach (ctx.bpf, ctx.plan; no telemetry yet):
                                    write the maps the probes read, attach what it attaches itself
    start() -> [SourceStatus]       once the exporters are built: ctx.telemetry is there
    routes() -> {type: Route}       its ring-buffer records: struct, builder, handlers
    raw(kind, record, t_ns)         a raw tracepoint copy of a kind it declared, decoded (core/rawtp.py)
    ring(name, callback)            the reader callback of a ring buffer it owns, wrapped (reader's lag)
    polled()                        after each ring-buffer poll
    in_flight() -> int              requests begun and not finished (the status line)
    instruments() -> [Instrument]   metrics it declares once (telemetry/spec.py)
    tick()                          periodic work on the agent's thread, one counted step each
    evidence(request) -> Evidence   what it saw of one finished request's window (declared attributes only)
    on_request(request, span, ctx)  each finished request after its span went out
    section()                       its part of `top`'s snapshot (telemetry/snapshot.py Section), or None
    stop()

What one capability needs of another is an input by name (Declaration.needs), which another provides
(Declaration.provides, Capability.provided()); the core hands them over through ctx.inputs and knows
neither side. The attributes a capability writes on a request span are declared (Declaration.attributes,
and the span attributes of its kernel counters, Declaration.counters): two writers of one attribute
is an error when the agent is made, and a write of an undeclared one is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..telemetry.spec import EventSpec, LinkSpec, SpanSpec


class CapabilityError(RuntimeError):
    """A capability cannot start as configured: one line naming the setting."""


@dataclass(frozen=True)
class Evidence:
    attributes: dict = field(default_factory=dict)
    links: tuple[LinkSpec, ...] = ()
    events: tuple[EventSpec, ...] = ()
    children: tuple[SpanSpec, ...] = ()

    def __add__(self, other: "Evidence") -> "Evidence":
        return Evidence({**self.attributes, **other.attributes}, self.links + other.links,
                        self.events + other.events, self.children + other.children)


NONE = Evidence()


@dataclass(frozen=True)
class SourceStatus:
    """A source outside BPF (NVML, sysfs, netlink): attached, missing or disabled, and why."""

    name: str
    state: str  # attached | missing | disabled
    reason: str = ""


@dataclass(frozen=True)
class RawKind:
    """A tracepoint whose record a "tracepoint_raw" probe copies (bpf/common.bpf.c tp_raw_capture):
    decoded with the format tracefs gives at run time, `default` standing in when it gives none."""

    event: str  # "group/name" under tracefs events/
    default: object | None  # core.tracefs.TracepointFormat
    decode: Callable | None  # (data, format, captured=True) -> a typed record; None: every field (TpFields)


def _no_settings(cfg) -> dict:
    return {}


@dataclass(frozen=True)
class Declaration:
    """What a capability is, before any of it runs: the loader compiles from these, `mcp-agent probes`
    lists them, the core makes and wires the capabilities from them."""

    name: str
    make: Callable[[], type]  # -> its Capability class (imported only when an agent is made)
    bpf: str = ""  # its BPF source: a file of bpf/, or a path (its header's folder goes on -I)
    header: str = ""  # its records header, beside its BPF source
    structs: dict = field(default_factory=dict)  # C struct name -> its ctypes mirror (tests/core/test_layout.py)
    probes: tuple = ()  # core.probes.ProbeSpec rows
    tails: tuple = ()  # (prog array, index, function, the probes whose programs tail-call it)
    hooks: dict = field(default_factory=dict)  # BPF hook (core.loader.HOOKS) -> its function in `bpf`
    settings: Callable = _no_settings  # cfg -> its programs' -D settings
    switched_off: Callable = _no_settings  # cfg -> {probe: why} turned off by a setting
    raw: dict = field(default_factory=dict)  # enum mcp_tp_kind value -> RawKind it decodes and handles
    counters: dict = field(default_factory=dict)  # struct mcp_counters field -> request span attribute
    always: frozenset = frozenset()  # of its counters, those shown even at 0
    attributes: tuple[str, ...] = ()  # request span attributes it writes; "prefix.*" names a family
    provides: tuple[str, ...] = ()  # inputs it gives others (Capability.provided)
    needs: tuple[str, ...] = ()  # inputs it takes (ctx.inputs)
    activity_stats: frozenset = frozenset()  # its kernel stats that count activity, not a loss or refusal
    rings: tuple[bytes, ...] = ()  # ring buffers its programs write (beside the core's `events`)
    # modules it imports that start-up overlaps (core/imports_behind.py): during the compile, and once
    # every probe is attached (an import that would share the GIL with the load's end)
    imports: Callable = lambda cfg: ()
    imports_after_load: Callable = lambda cfg: ()


class Inputs:
    """What capabilities provide one another, by name. get() is late-bound: a capability made before
    the one providing its input still calls the provider's function."""

    def __init__(self):
        self._fns: dict[str, Callable] = {}
        self._owner: dict[str, str] = {}

    def provide(self, owner: str, name: str, fn: Callable) -> None:
        if name in self._fns:
            raise ValueError(f"input {name!r} provided by both {self._owner[name]} and {owner}")
        self._fns[name], self._owner[name] = fn, owner

    def has(self, name: str) -> bool:
        return name in self._fns

    def get(self, name: str, default: Callable) -> Callable:
        def call(*a, **kw):
            fn = self._fns.get(name)
            return (fn or default)(*a, **kw)
        return call


@dataclass
class Context:
    """What every capability is made with. bpf, plan and telemetry are set once the programs are
    loaded and the exporters built (before start()); finish is the request path (core/request.py)."""

    cfg: object  # config.Config
    health: object  # core.health.AgentHealth
    processes: object  # core.processes.Processes
    timebase: object  # core.timebase.Timebase
    proc_root: str = "/proc"
    sysfs_root: str = "/sys"
    options: dict = field(default_factory=dict)  # per-capability test hooks (gpuhealth: nvml_module)
    inputs: Inputs = field(default_factory=Inputs)
    bpf: object = None
    plan: object = None  # core.probes.ProbePlan
    telemetry: object = None  # telemetry.otel.Telemetry: span, record, publish, open, close, declare
    finish: Callable | None = None  # a FinishedRequest -> its span, metric and listeners
    survived: Callable = lambda where, e: None  # a failure caught off the tick (counted in hostagent.agent.errors)

    def attached(self, probe: str) -> bool:
        st = self.plan.statuses.get(probe) if self.plan is not None else None
        return st is not None and st.state == "attached"


class Capability:
    """The defaults: a capability overrides what it has."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def provided(self) -> dict[str, Callable]:
        return {}

    def prepare(self) -> None:
        pass

    def loaded(self) -> None:
        pass

    def start(self) -> list[SourceStatus]:
        return []

    def routes(self) -> dict:
        return {}

    def raw(self, kind: int, rec, t_ns: int) -> None:
        pass

    def ring(self, name: bytes, callback):
        return callback

    def polled(self) -> None:
        pass

    def in_flight(self) -> int:
        """Requests it has begun and not yet finished (the status line's "open")."""
        return 0

    def instruments(self) -> list:
        return []

    def tick(self) -> None:
        pass

    def evidence(self, fr) -> Evidence:
        return NONE

    def on_request(self, fr, span: SpanSpec, ctx) -> None:
        pass

    def section(self):
        return None

    def stop(self) -> None:
        pass

    @classmethod
    def report(cls, bpf, plan) -> str:
        """`mcp-agent probes`: what this capability finds on the host beyond its probe rows."""
        return ""
