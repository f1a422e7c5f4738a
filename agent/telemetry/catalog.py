"""Every metric the agent can export, declared by the capabilities themselves, without a running agent.

The one list docs/TELEMETRY.md, the Prometheus rules and the Grafana dashboard in packaging/ are
checked against (tests/telemetry/test_catalog.py, test_prometheus_rules.py), so that a renamed
instrument cannot leave them behind. Instruments are built with no capability behind them: their
read functions are never called here.
"""

from __future__ import annotations

from ..telemetry.spec import Instrument

# Declared outside an Instrument list: agent/cli.py _reload_metrics (process-lifetime counts).
RELOAD_INSTRUMENTS = (
    Instrument("hostagent.agent.config.reloads", "counter", "{reload}", "SIGHUP reloads applied"),
    Instrument("hostagent.agent.config.reload_failed", "counter", "{reload}",
               "SIGHUP reloads refused or whose config failed to start"),
)


def all_instruments() -> list[Instrument]:
    from ..core.health import AgentHealth
    from ..core.processes import Processes
    from ..cuda import telemetry as cuda_t
    from ..gpuhealth import telemetry as gpu_t
    from ..nic import telemetry as nic_t
    from ..pcie import telemetry as pcie_t
    from ..reclaim import telemetry as reclaim_t
    from ..requests import telemetry as requests_t

    return [*Processes().instruments(), *AgentHealth().instruments(None), *reclaim_t.INSTRUMENTS,
            *requests_t.INSTRUMENTS, *cuda_t.INSTRUMENTS, *gpu_t.instruments(None),
            *pcie_t.instruments(None, None), *nic_t.instruments(None), *RELOAD_INSTRUMENTS]
