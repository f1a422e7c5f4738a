"""The probe table: every BPF hook the agent can attach, and what became of each on this host.

A probe is one tracepoint program in one BPF source; each capability declares its rows
(core/capability.py Declaration.probes). Before compiling, each probe is checked against tracefs (bcc
cannot compile a TRACEPOINT_PROBE whose format file is absent; a "tracepoint_raw" probe compiles
anywhere but has nothing to attach to, and says why: ProbeSpec.absent); a probe that is disabled,
absent or fails to attach is reported with a reason and a hint, and the rest run (`--strict` makes
any miss fatal). Adding a probe is one row in its capability's declaration and one #if block in its
.c file.

States (`mcp-agent probes`, `run`'s start-up summary, the status line and the agent's probe-state gauge):
  attached      a tracepoint program attached
  missing       not attached, with the reason (and a hint)
  disabled      probes.disable names it
The libcuda uprobe families (kind "uprobe": cuda_launch ... cuda_free) are attached per library inode
as processes map libcuda.so (agent/cuda), so they have states of their own; none of them reads attached:
  armed         uprobes attached in N libcuda files (they fire in every process mapping those files)
  duty-cycled   cuda_launch armed, but the governor attaches it one slice in N (process counts
                scaled; a request's count exact, or labelled with its coverage)
  paused        cuda_launch armed, but its uprobes detached for now (CudaProbes.pause)
  waiting       compiled, no libcuda.so mapped now: armed when a process maps one
  found         `mcp-agent probes` only: symbols found in N libcuda files; that command attaches no uprobe
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .kernel import tracepoint_exists

ATTACHED, MISSING, DISABLED = "attached", "missing", "disabled"
ARMED, DUTY_CYCLED, PAUSED, WAITING, FOUND = "armed", "duty-cycled", "paused", "waiting", "found"
UPROBE_STATES = (ARMED, DUTY_CYCLED, PAUSED, WAITING, FOUND)  # the libcuda uprobe families' (agent/cuda)
LIVE = (ATTACHED, ARMED, DUTY_CYCLED)  # programs attached now (the status line's "probes N/M")


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    tracepoint: str  # "category:event" (the hook, for other kinds: what it attaches to)
    program: str  # BPF source under bpf/ holding its #if MCP_PROBE_<NAME> block
    provides: str
    hint: str
    # the loader attaches "tracepoint" (bcc TRACEPOINT_PROBE) and "tracepoint_raw" (a plain function
    # that copies the record, decoded with the run-time format); other kinds are attached by their module
    kind: str = "tracepoint"
    fn: str = ""  # a plain function attached instead of the TRACEPOINT_PROBE (one program on several hooks)
    absent: str = ""  # why a kernel may lack its tracepoint, said instead of "not in tracefs"

    @property
    def macro(self) -> str:
        return "MCP_PROBE_" + self.name.upper().replace(".", "_")

    @property
    def fn_name(self) -> str:
        if self.fn:
            return self.fn
        prefix = "tp_raw__" if self.kind == "tracepoint_raw" else "tracepoint__"
        return prefix + self.tracepoint.replace(":", "__")


TRACEPOINT_KINDS = ("tracepoint", "tracepoint_raw")  # checked against tracefs, attached by the loader


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
        """Those compiled (before the load: to be compiled): neither missing nor disabled."""
        return [s.spec for s in self.statuses.values()
                if s.state not in (MISSING, DISABLED) and (program is None or s.spec.program == program)]

    def mark(self, name: str, state: str, reason: str = "", hint: str = "") -> None:
        st = self.statuses[name]
        st.state, st.reason, st.hint = state, reason, hint or st.hint

    def missing(self) -> list[ProbeStatus]:
        return [s for s in self.statuses.values() if s.state == MISSING]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys((ATTACHED, MISSING, DISABLED, *UPROBE_STATES), 0)
        for s in self.statuses.values():
            out[s.state] = out.get(s.state, 0) + 1
        return out

    def live(self) -> int:
        """Probes whose programs are attached now: attached tracepoints, armed (or duty-cycled) uprobes."""
        return sum(1 for s in self.statuses.values() if s.state in LIVE)

    def summary(self) -> str:
        """`run`'s start-up line: "N attached, N missing, N disabled" and the uprobe families' states."""
        c = self.counts()
        up = [f"{c[k]} {k}" for k in UPROBE_STATES if c[k]]
        return (f"{c[ATTACHED]} attached, {c[MISSING]} missing, {c[DISABLED]} disabled"
                + (f"; libcuda uprobes {', '.join(up)}" if up else ""))


def plan(specs, disabled: list[str] | tuple[str, ...] = (), exists=tracepoint_exists,
         off: dict[str, str] | None = None) -> ProbePlan:
    """Decide before compiling. State ATTACHED here means 'to be attached'; the loader corrects it.
    off: probes turned off by other settings (Declaration.switched_off), with their reasons."""
    p = ProbePlan()
    off = off or {}
    for spec in specs:
        if spec.name in disabled or spec.name in off:
            p.statuses[spec.name] = ProbeStatus(spec, DISABLED, off.get(spec.name, "disabled by probes.disable"))
        elif spec.kind in TRACEPOINT_KINDS and not exists(*spec.tracepoint.split(":")):
            p.statuses[spec.name] = ProbeStatus(
                spec, MISSING, spec.absent or f"tracepoint {spec.tracepoint} not in this kernel's tracefs", spec.hint)
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
