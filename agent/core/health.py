"""The agent's own state: probes, losses, refusals, survived failures; exported as mcp.agent.* metrics
and summarised in the status line."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..telemetry.spec import Instrument
from .records import ACTIVITY_STATS


@dataclass
class AgentHealth:
    probes: dict[str, str] = field(default_factory=dict)  # probe -> attached|missing|disabled
    compile_s: float = 0.0
    kernel_stats: dict[str, int] = field(default_factory=dict)  # enum mcp_stat label -> total
    rejected: Counter = field(default_factory=Counter)  # user-space reasons
    user_lost: int = 0  # records we failed to handle
    requests: Counter = field(default_factory=Counter)  # end_reason -> count
    source_reasons: dict[str, str] = field(default_factory=dict)  # non-BPF source -> why missing
    errors: Counter = field(default_factory=Counter)  # failures survived, by where (tick step, map write)

    def kernel_lost(self) -> int:
        return self.kernel_stats.get("rb_lost", 0) + self.kernel_stats.get("rb_req_lost", 0)

    def all_rejected(self) -> dict[str, int]:
        """Records and markers refused or dropped, by reason: the kernel's and user space's."""
        out = {k: v for k, v in self.kernel_stats.items() if k not in ACTIVITY_STATS}
        for k, v in dict(self.rejected).items():  # (a copy: the agent's thread adds reasons)
            out[k] = out.get(k, 0) + v
        return out

    def instruments(self, stats) -> list[Instrument]:
        """Read at collection time on the SDK's reader thread, so that the last export at shutdown
        carries the final counts: dicts the agent's thread grows are copied (dict() under the GIL)
        before they are iterated. stats: the exporters' ExportStats."""
        return [
            Instrument("mcp.agent.probes", "gauge", description="1 per probe, by state (attached, missing, disabled)",
                       read=lambda: [(1, {"mcp.probe": n, "mcp.probe.state": s}) for n, s in dict(self.probes).items()]),
            Instrument("mcp.agent.bpf.compile_s", "gauge", "s", "BPF compile time at start-up",
                       read=lambda: [(self.compile_s, {})]),
            Instrument("mcp.agent.events.lost", "counter",
                       description="records lost: ring buffer full (kernel) or failed to handle (user)",
                       read=lambda: [(self.kernel_lost(), {"mcp.where": "kernel"}),
                                     (self.user_lost, {"mcp.where": "user"})]),
            Instrument("mcp.agent.records.rejected", "counter", description="markers and records rejected, by reason",
                       read=lambda: [(v, {"mcp.reason": k}) for k, v in self.all_rejected().items()]),
            Instrument("mcp.agent.errors", "counter",
                       description="failures the agent caught and survived, by where (a tick step, a map write)",
                       read=lambda: [(v, {"mcp.where": k}) for k, v in sorted(dict(self.errors).items())]),
            Instrument("mcp.agent.spans.exported", "counter", description="spans the exporters accepted",
                       read=lambda: [(stats.snapshot().get("spans_exported", 0), {})]),
            Instrument("mcp.agent.spans.dropped", "counter", description="spans not delivered",
                       read=lambda: [(stats.snapshot().get("spans_dropped_queue", 0), {"mcp.reason": "queue_full"}),
                                     (stats.snapshot().get("spans_failed", 0), {"mcp.reason": "export_failed"})]),
        ]
