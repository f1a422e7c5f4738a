"""The agent's own state: probes, losses, refusals, survived failures; exported as hostagent.agent.* metrics
and summarised in the status line."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..telemetry.spec import Instrument


@dataclass
class AgentHealth:
    probes: dict[str, str] = field(default_factory=dict)  # probe -> state (core/probes.py), source -> attached|missing
    compile_s: float = 0.0
    kernel_stats: dict[str, int] = field(default_factory=dict)  # enum mcp_stat label -> total
    rejected: Counter = field(default_factory=Counter)  # user-space reasons
    user_lost: int = 0  # records we failed to handle
    requests: Counter = field(default_factory=Counter)  # end_reason -> count
    source_reasons: dict[str, str] = field(default_factory=dict)  # non-BPF source -> why missing
    errors: Counter = field(default_factory=Counter)  # failures survived, by where (tick step, map write)
    activity: frozenset = frozenset()  # kernel stats that count activity, not a refusal (core/unit.py)

    def kernel_lost(self) -> int:
        """Records a ring buffer had no room for: each family's rb_*lost stat."""
        return sum(v for k, v in self.kernel_stats.items() if is_loss(k))

    def all_rejected(self) -> dict[str, int]:
        """Records and markers refused or dropped, by reason: the kernel's and user space's."""
        out = {k: v for k, v in self.kernel_stats.items() if k not in self.activity and not is_loss(k)}
        for k, v in dict(self.rejected).items():  # (a copy: the agent's thread adds reasons)
            out[k] = out.get(k, 0) + v
        return out

    def instruments(self, stats) -> list[Instrument]:
        """Read at collection time on the SDK's reader thread, so that the last export at shutdown
        carries the final counts: dicts the agent's thread grows are copied (dict() under the GIL)
        before they are iterated. stats: the exporters' ExportStats."""
        return [
            Instrument("hostagent.agent.probes", "gauge",
                       description="1 per probe, by state (attached, missing, disabled; "
                                   "libcuda uprobes: armed, duty-cycled, paused, waiting)",
                       read=lambda: [(1, {"hostagent.probe": n, "hostagent.probe.state": s}) for n, s in dict(self.probes).items()]),
            Instrument("hostagent.agent.bpf.compile.duration", "gauge", "s", "BPF compile time at start-up",
                       read=lambda: [(self.compile_s, {})]),
            Instrument("hostagent.agent.events.lost", "counter", "{record}",
                       description="records lost: ring buffer full (kernel) or failed to handle (user)",
                       read=lambda: [(self.kernel_lost(), {"hostagent.where": "kernel"}),
                                     (self.user_lost, {"hostagent.where": "user"})]),
            Instrument("hostagent.agent.records.rejected", "counter", "{record}", description="markers and records rejected, by reason",
                       read=lambda: [(v, {"hostagent.reason": k}) for k, v in self.all_rejected().items()]),
            Instrument("hostagent.agent.sched.switch_in_unseen", "counter", "{slice}",
                       description="on-CPU slices of traced threads whose switch-in sched:sched_switch did not "
                                   "report: timed from the CPU's last reported switch (an upper bound)",
                       read=lambda: [(self.kernel_stats.get("switch_in_unseen", 0), {})]),
            Instrument("hostagent.agent.errors", "counter", "{error}",
                       description="failures the agent caught and survived, by where (a tick step, a map write)",
                       read=lambda: [(v, {"hostagent.where": k}) for k, v in sorted(dict(self.errors).items())]),
            Instrument("hostagent.agent.spans.exported", "counter", "{span}", description="spans the exporters accepted",
                       read=lambda: [(stats.snapshot().get("spans_exported", 0), {})]),
            Instrument("hostagent.agent.spans.dropped", "counter", "{span}", description="spans not delivered",
                       read=lambda: [(stats.snapshot().get("spans_dropped_queue", 0), {"hostagent.reason": "queue_full"}),
                                     (stats.snapshot().get("spans_failed", 0), {"hostagent.reason": "export_failed"})]),
        ]


def is_loss(stat: str) -> bool:
    """A ring buffer's loss count (enum mcp_stat_* MCP_STAT_RB_*LOST: every family names its so)."""
    return stat.startswith("rb_") and stat.endswith("lost")
