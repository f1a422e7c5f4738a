"""The request model and the one request path: a FinishedRequest, from whichever capability saw it
(a marker's BEGIN/END, a zero-code HTTP exchange), -> every capability's evidence for its window ->
one span, the duration metric, the listeners. docs/TELEMETRY.md names what it exports.

Each capability's attributes are its own (core/capability.py Declaration.attributes and .counters):
the span attributes of its kernel counters are rendered here from its declaration, for the request's
thread and for each scope a zero-code request carries (process, group); its evidence may then replace
its own (cuda: an estimated or unknown launch count) and add what else it saw. An attribute a
capability did not declare is dropped and counted (evidence_undeclared), so no merge order can decide
a value: two capabilities cannot write one name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..telemetry.spec import Instrument, SpanSpec
from .capability import Evidence
from .decode import Counters
from .traceparent import TraceParent

SPAN_NAME = "hostagent.request"
DURATION = "hostagent.request.duration"
ERROR_REASONS = {"thread_exit", "process_exit", "expired", "id_mismatch", "superseded"}
SCOPES = ("process", "group")  # a zero-code request's counters beside its thread's (FinishedRequest.scopes)
INSTRUMENTS = (Instrument(DURATION, "histogram", "s", "marked request duration (exponential buckets)"),)

# The request path's own attributes: who and which request, how it ended (the source's own, http's
# method and route, come in FinishedRequest.attributes and are declared by that capability).
OWN_ATTRIBUTES = ("process.pid", "thread.id", "hostagent.request.id", "hostagent.request.source",
                  "hostagent.request.end_reason", "hostagent.request.traceparent", "hostagent.cgroup.id")

# hostagent.request.duration's labels: whose requests, boundedly. The executable's name alone is
# anybody's to choose (another user's binary named `vllm` would merge into the real vLLM's series), so
# its owner (process.owner: a user name, or the uid where it has none) and, where the agent knows them,
# its container and pod split the series by who could have started it. No pid, command line, start
# time or cgroup path: one series per process or per argv would be unbounded.
DURATION_IDENTITY = ("process.owner", "container.id", "k8s.pod.uid")


@dataclass(frozen=True)
class FinishedRequest:
    tgid: int
    tid: int
    request_id: int
    comm: bytes
    cgroup_id: int
    begin_ns: int  # kernel monotonic
    end_ns: int  # kernel monotonic
    parent: TraceParent | None
    traceparent_state: str  # "valid" | "missing" | "invalid" | "begin_lost"
    end_reason: str
    counters: Counters
    # zero-code requests (agent/http): span attributes of their own; the process's and the serving
    # group's counters over the window, by scope name; the response's status (0: none seen)
    attributes: dict = field(default_factory=dict)
    scopes: tuple = ()  # ((scope, Counters), ...)
    http_status: int | None = None  # None: not an HTTP request
    source: str = "marker"

    @property
    def is_error(self) -> bool:
        return self.end_reason in ERROR_REASONS or self.http_status == 0 or (self.http_status or 0) >= 500

    @property
    def error_text(self) -> str:
        if self.end_reason in ERROR_REASONS:
            return f"request ended: {self.end_reason}"
        return f"HTTP {self.http_status}" if self.http_status else "no HTTP response"


def scoped(name: str, scope: str) -> str:
    """hostagent.faults.user -> hostagent.request.<scope>.faults.user"""
    return name.replace("hostagent.", f"hostagent.request.{scope}.", 1)


def unscoped(name: str) -> str | None:
    for scope in SCOPES:
        prefix = f"hostagent.request.{scope}."
        if name.startswith(prefix):
            return "hostagent." + name[len(prefix):]
    return None


def counter_attributes(counters, mapping: dict, always=frozenset()) -> dict:
    """A struct mcp_counters reading -> span attributes: those not 0 (and `always`); fields kept in ns
    are exported in seconds (OTel's base unit; the names say `.time`)."""
    out = {}
    for f, name in mapping.items():
        v = getattr(counters, f)
        if v or f in always:
            out[name] = v / 1e9 if f.endswith("_ns") else v
    return out


def base_attributes(fr: FinishedRequest) -> dict:
    """The span's own attributes; the process's identity is its resource."""
    return {
        "process.pid": fr.tgid,
        "thread.id": fr.tid,
        "hostagent.request.id": f"{fr.request_id:016x}",
        "hostagent.request.source": fr.source,
        "hostagent.request.end_reason": fr.end_reason,
        "hostagent.request.traceparent": fr.traceparent_state,
        "hostagent.cgroup.id": fr.cgroup_id,
    }


def duration_row(fr: FinishedRequest, proc_attrs: dict) -> tuple[float, dict]:
    labels = {"process.executable.name": proc_attrs.get("process.executable.name", "")}
    labels.update({k: proc_attrs[k] for k in DURATION_IDENTITY if proc_attrs.get(k)})
    labels["hostagent.request.end_reason"] = fr.end_reason
    return (fr.end_ns - fr.begin_ns) / 1e9, labels


class Owners:
    """Which capability writes each request attribute: names, and families by prefix ("x.y.*")."""

    def __init__(self, declared: list[tuple[str, tuple[str, ...]]]):
        self.names: dict[str, str] = {}
        self.prefixes: list[tuple[str, str]] = []
        for owner, names in declared:
            for n in names:
                other = self.owner_of(n.removesuffix("*")) if n.endswith(".*") else self.owner_of(n)
                if other is not None and other != owner:
                    raise ValueError(f"request attribute {n!r} declared by both {other} and {owner}")
                if n.endswith(".*"):
                    for p, o in self.prefixes:
                        if o != owner and (p.startswith(n[:-1]) or n[:-1].startswith(p)):
                            raise ValueError(f"request attributes {p}* and {n} overlap: {o} and {owner}")
                    self.prefixes.append((n[:-1], owner))
                else:
                    self.names[n] = owner
        self._cache: dict[str, str | None] = {}

    def owner_of(self, name: str) -> str | None:
        got = self.names.get(name)
        if got is not None:
            return got
        for p, o in self.prefixes:
            if name.startswith(p):
                return o
        return None

    def owns(self, owner: str, name: str) -> bool:
        """A scoped name (hostagent.request.process.X) is its unscoped name's owner's, unless declared itself."""
        got = self._cache.get(name, False)
        if got is False:
            got = self.owner_of(name)
            if got is None:
                base = unscoped(name)
                got = self.owner_of(base) if base else None
            if len(self._cache) < 65536:
                self._cache[name] = got
        return got == owner


class RequestPath:
    """A FinishedRequest -> its span (telemetry.span), the duration metric, the listeners. On the
    agent's thread (records, expiry, ticks)."""

    def __init__(self, caps: list, processes, telemetry, health):
        """caps: [(Declaration, Capability)], in the registry's order."""
        self.processes, self.telemetry, self.health = processes, telemetry, health
        self.caps = caps
        self.owners = Owners([("request", OWN_ATTRIBUTES)] + [
            (d.name, tuple(d.attributes) + tuple(d.counters.values())) for d, _ in caps])
        self.listeners = []  # (fr, span, ctx) -> None, after the capabilities' own on_request

    def evidence(self, fr: FinishedRequest) -> tuple[dict, Evidence]:
        attrs = base_attributes(fr)
        src = [d for d, _ in self.caps if d.name == fr.source]
        self._take(attrs, src[0].name if src else "request", fr.attributes)
        links, events, children = [], [], []
        for d, cap in self.caps:
            own = counter_attributes(fr.counters, d.counters, d.always) if d.counters else {}
            for scope, counters in fr.scopes:
                own.update({scoped(n, scope): v for n, v in counter_attributes(counters, d.counters, d.always).items()})
            ev = cap.evidence(fr)
            own.update(ev.attributes)
            self._take(attrs, d.name, own)
            links += ev.links
            events += ev.events
            children += ev.children
        return attrs, Evidence({}, tuple(links), tuple(events), tuple(children))

    def _take(self, into: dict, owner: str, attrs: dict) -> None:
        for k, v in attrs.items():
            if self.owners.owns(owner, k):
                into[k] = v
            else:
                self.health.rejected["evidence_undeclared"] += 1

    def span(self, fr: FinishedRequest, proc_attrs: dict) -> SpanSpec:
        attrs, ev = self.evidence(fr)
        return SpanSpec(SPAN_NAME, fr.begin_ns, fr.end_ns, attrs, parent=fr.parent, links=ev.links,
                        events=ev.events, children=ev.children, error=fr.error_text if fr.is_error else None,
                        resource=proc_attrs)

    def finish(self, fr: FinishedRequest) -> None:
        proc_attrs = self.processes.attrs(fr.tgid, fr.comm)
        spec = self.span(fr, proc_attrs)
        ctx = self.telemetry.span(spec)
        self.telemetry.record(DURATION, *duration_row(fr, proc_attrs))
        self.health.requests[fr.end_reason] += 1
        for _, cap in self.caps:
            cap.on_request(fr, spec, ctx)
        for listen in self.listeners:
            listen(fr, spec, ctx)
