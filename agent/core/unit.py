"""What is compiled: the BPF unit the capabilities' declarations make (core/capability.py Declaration).

One compile unit, bpf/common.bpf.c first (the maps and helpers every family uses: the request windows,
the per-process counters, the watch set, the raw tracepoint capture), then each capability's BPF source
in the registry's order. They share one unit because every family adds to the same per-request and
per-process counters, and one compile is the cheapest start (docs/PERFORMANCE.md).

A program that several capabilities need to act in (bcc keeps one program per tracepoint name) calls
a hook: a macro this module defines from the capabilities' declared hook functions, ahead of their
sources, so that a capability's per-process state goes with the process without the program that
calls it naming the capability.
"""

from __future__ import annotations

import os
import re

from . import probes as P
from .records import bpf_source_dir, parse_constants

COMMON = "common.bpf.c"
NAME = "agent.bpf"
# hook -> (macro, its arguments, the hook function's parameters); called by requests.bpf.c's programs
HOOKS = {
    "process_exit": ("MCP_HOOK_PROCESS_EXIT", "tgid", "u32 tgid"),  # sched_process_exit, the group leader's
    "process_exec": ("MCP_HOOK_PROCESS_EXEC", "tgid, now", "u32 tgid, u64 now"),  # sched_process_exec
    "slice": ("MCP_HOOK_SLICE", "tgid, sl", "u32 tgid, struct mcp_slice *sl"),  # a traced thread's on-CPU slice taken
}
# A program whose context is struct pt_regs is kprobe-type (bpf/cuda.bpf.c's uprobes); every other
# program of the unit is a tracepoint's
KPROBE_PROGRAM = re.compile(r"^int\s+(\w+)\s*\(\s*struct\s+pt_regs\s*\*", re.M)


class UnitError(ValueError):
    pass


class Unit:
    def __init__(self, declarations):
        self.declarations = tuple(declarations)
        self.probes = tuple(p for d in self.declarations for p in d.probes)
        self.tails = tuple(t for d in self.declarations for t in d.tails)
        seen: dict[str, str] = {}
        for d in self.declarations:
            for p in d.probes:
                if p.name in seen:
                    raise UnitError(f"probe {p.name!r} declared by both {seen[p.name]} and {d.name}")
                seen[p.name] = d.name
            for hook in d.hooks:
                if hook not in HOOKS:
                    raise UnitError(f"{d.name}: no BPF hook {hook!r} (known: {', '.join(HOOKS)})")
        raw: dict[int, str] = {}
        for d in self.declarations:
            for kind in d.raw:  # one decoder and one handler per raw tracepoint kind (enum mcp_tp_kind)
                if kind in raw:
                    raise UnitError(f"raw tracepoint kind {kind} declared by both {raw[kind]} and {d.name}")
                raw[kind] = d.name

    # ---- the text ----
    def sources(self) -> list[tuple[str, str]]:
        """(name shown, path) of each source, in compile order."""
        out = [(COMMON, os.path.join(bpf_source_dir(), COMMON))]
        for d in self.declarations:
            if d.bpf:
                path = d.bpf if os.path.isabs(d.bpf) else os.path.join(bpf_source_dir(), d.bpf)
                out.append((os.path.basename(d.bpf), path))
        return out

    def include_dirs(self) -> list[str]:
        dirs = [bpf_source_dir()]
        for _, path in self.sources():
            d = os.path.dirname(path)
            if d not in dirs:
                dirs.append(d)
        return dirs

    def hooks_text(self) -> str:
        lines = ["/* hooks: the capabilities' functions the shared programs call (agent/core/unit.py) */",
                 "struct mcp_slice;"]
        for hook, (macro, args, params) in HOOKS.items():
            fns = [d.hooks[hook] for d in self.declarations if hook in d.hooks]
            lines += [f"static __always_inline void {fn}({params});" for fn in fns]
            body = " ".join(f"{fn}({args});" for fn in fns)
            lines.append(f"#define {macro}({args}) do {{ {body} }} while (0)")
        return "\n".join(lines) + "\n"

    def text(self) -> str:
        """The text bcc compiles: each source, a marker line each, the hooks after common.bpf.c."""
        parts = []
        for i, (name, path) in enumerate(self.sources()):
            with open(path) as f:
                parts.append(f'#line 1 "{name}"\n' + f.read())
            if i == 0:
                parts.append(self.hooks_text())
        return "\n".join(parts)

    def kprobe_programs(self, text: str | None = None) -> set[str]:
        return set(KPROBE_PROGRAM.findall(self.text() if text is None else text))

    def raw_kinds(self) -> dict:
        """enum mcp_tp_kind value -> its RawKind, every capability's."""
        return {k: v for d in self.declarations for k, v in d.raw.items()}

    def missing_why(self) -> dict[str, str]:
        """tracefs event ("group/name") -> why a kernel may lack it, from the probe rows."""
        return {p.tracepoint.replace(":", "/"): p.absent for p in self.probes if p.absent}

    # ---- settings and the plan ----
    def settings(self, cfg) -> dict[str, int]:
        """The programs' compile-time settings (-D): the core's (the watch mode) and each capability's."""
        out = {"MCP_WATCH_ALL": cfg.process_watch == "all"}
        for d in self.declarations:
            out.update(d.settings(cfg))
        return out

    def switched_off(self, cfg) -> dict[str, str]:
        out = {}
        for d in self.declarations:
            out.update(d.switched_off(cfg))
        return out

    def plan(self, cfg=None, disabled=None, exists=P.tracepoint_exists) -> P.ProbePlan:
        """The probe plan for cfg (its probes.disable, the probes its settings turn off)."""
        disabled = tuple(cfg.probes_disable if disabled is None and cfg is not None else disabled or ())
        return P.plan(self.probes, disabled, exists=exists, off=self.switched_off(cfg) if cfg is not None else {})

    def probe_names(self) -> list[str]:
        return [p.name for p in self.probes]

    def cflags(self, plan: P.ProbePlan, settings: dict[str, int]) -> list[str]:
        flags = [f"-I{d}" for d in self.include_dirs()]
        flags += [f"-D{k}={int(v)}" for k, v in sorted(settings.items())]
        flags += [f"-D{spec.macro}=1" for spec in plan.enabled()]
        return flags

    # ---- what the headers say ----
    def headers(self) -> list[str]:
        out = [os.path.join(bpf_source_dir(), "common.h")]
        for d in self.declarations:
            if d.header:
                base = os.path.dirname(d.bpf) if d.bpf and os.path.isabs(d.bpf) else bpf_source_dir()
                out.append(os.path.join(base, d.header))
        return out

    def constants(self) -> dict[str, int]:
        text = []
        for h in self.headers():
            with open(h) as f:
                text.append(f.read())
        return parse_constants("\n".join(text))

    def kernel_stats(self) -> dict[int, str]:
        """enum mcp_stat_* index -> its metric label, every family's; two at one index is an error."""
        out: dict[int, str] = {}
        for name, v in self.constants().items():
            if name.startswith("MCP_STAT_") and name != "MCP_STAT_MAX":
                label = name[len("MCP_STAT_"):].lower()
                if v in out and out[v] != label:
                    raise UnitError(f"stats {out[v]} and {label} share index {v}")
                out[v] = label
        return out

    def activity_stats(self) -> frozenset:
        """Kernel stats that count activity, not a record lost or refused (the ring buffers' losses
        are counted in hostagent.agent.events.lost)."""
        return frozenset({"rb_lost", "switch_in_unseen"}).union(*(d.activity_stats for d in self.declarations))
