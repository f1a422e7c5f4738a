"""Every metric the agent can export, declared by the capabilities themselves, without a running agent.

The one list docs/TELEMETRY.md, the Prometheus rules and the Grafana dashboard in packaging/ are
checked against (tests/telemetry/test_catalog.py, test_prometheus_rules.py), so that a renamed
instrument cannot leave them behind. The capabilities are made with the default config and no BPF
object (an agent that is never started): their instruments' read functions are never called here.
"""

from __future__ import annotations

from .telemetry.spec import Instrument

# Declared outside an Instrument list: agent/cli.py _reload_metrics (process-lifetime counts).
RELOAD_INSTRUMENTS = (
    Instrument("hostagent.agent.config.reloads", "counter", "{reload}", "SIGHUP reloads applied"),
    Instrument("hostagent.agent.config.reload_failed", "counter", "{reload}",
               "SIGHUP reloads refused or whose config failed to start"),
)


def all_instruments() -> list[Instrument]:
    from .config import load_config
    from .core import request
    from .registry import make_agent

    agent = make_agent(load_config(None, env={}), nvml_module=object())
    out = [*agent.processes.instruments(), *request.INSTRUMENTS, *agent.health.instruments(None)]
    for cap in agent.caps.values():
        out += cap.instruments()
    return out + list(RELOAD_INSTRUMENTS)
