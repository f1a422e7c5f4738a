"""The probe table: every BPF hook the agent can attach, and what became of each on this host.

A probe is one tracepoint program in one BPF source. Before compiling, each probe is checked against
tracefs (bcc cannot compile a TRACEPOINT_PROBE whose format file is absent); a probe that is
disabled, absent or fails to attach is reported with a reason and a hint, and the rest run
(`--strict` makes any miss fatal). Adding a probe is one row here and one #if block in its .c file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .kernel import tracepoint_exists

ATTACHED, MISSING, DISABLED = "attached", "missing", "disabled"


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    tracepoint: str  # "category:event"
    program: str  # BPF source under bpf/
    provides: str
    hint: str

    @property
    def macro(self) -> str:
        return "MCP_PROBE_" + self.name.upper().replace(".", "_")

    @property
    def fn_name(self) -> str:
        return "tracepoint__" + self.tracepoint.replace(":", "__")


PROBES: tuple[ProbeSpec, ...] = (
    ProbeSpec("marker", "syscalls:sys_enter_ioctl", "requests.bpf.c",
              "request begin/end markers (per-request counters need it)",
              "needs CONFIG_FTRACE_SYSCALLS"),
    ProbeSpec("page_faults", "exceptions:page_fault_user", "requests.bpf.c",
              "user page faults per request and per process",
              "x86 kernels have it; other architectures lack exceptions:* tracepoints"),
    ProbeSpec("sched_switch", "sched:sched_switch", "requests.bpf.c",
              "context switches and off-CPU time per request and per process",
              "needs tracepoints (CONFIG_TRACEPOINTS)"),
    ProbeSpec("process_exit", "sched:sched_process_exit", "requests.bpf.c",
              "closes requests of threads that exit inside them; frees per-process state",
              "without it, open requests end by idle expiry only"),
)


def probe_names() -> list[str]:
    return [p.name for p in PROBES]


@dataclass
class ProbeStatus:
    spec: ProbeSpec
    state: str
    reason: str = ""
    hint: str = ""


@dataclass
class ProbePlan:
    """Which probes to compile, and the statuses of those already decided (disabled, absent)."""

    statuses: dict[str, ProbeStatus] = field(default_factory=dict)

    def enabled(self, program: str | None = None) -> list[ProbeSpec]:
        return [s.spec for s in self.statuses.values()
                if s.state == ATTACHED and (program is None or s.spec.program == program)]

    def mark(self, name: str, state: str, reason: str = "", hint: str = "") -> None:
        st = self.statuses[name]
        st.state, st.reason, st.hint = state, reason, hint or st.hint

    def missing(self) -> list[ProbeStatus]:
        return [s for s in self.statuses.values() if s.state == MISSING]

    def counts(self) -> dict[str, int]:
        out = {ATTACHED: 0, MISSING: 0, DISABLED: 0}
        for s in self.statuses.values():
            out[s.state] += 1
        return out


def plan(disabled: list[str] | tuple[str, ...] = (), exists=tracepoint_exists) -> ProbePlan:
    """Decide before compiling. State ATTACHED here means 'to be attached'; the loader corrects it."""
    p = ProbePlan()
    for spec in PROBES:
        if spec.name in disabled:
            p.statuses[spec.name] = ProbeStatus(spec, DISABLED, "disabled by probes.disable")
        elif not exists(*spec.tracepoint.split(":")):
            p.statuses[spec.name] = ProbeStatus(
                spec, MISSING, f"tracepoint {spec.tracepoint} not in this kernel's tracefs", spec.hint)
        else:
            p.statuses[spec.name] = ProbeStatus(spec, ATTACHED)
    return p


def render_table(p: ProbePlan) -> str:
    rows = [("PROBE", "HOOK", "STATE", "DETAIL")]
    for s in p.statuses.values():
        detail = s.reason or s.spec.provides
        if s.state == MISSING and s.hint:
            detail += f" (HINT: {s.hint})"
        rows.append((s.spec.name, s.spec.tracepoint, s.state, detail))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows)
