"""The capabilities this agent runs, one line each, in the order the core drives them: their BPF
sources are compiled in this order (after bpf/common.bpf.c), their ticks run, their evidence is
gathered and their snapshot sections composed in it. A capability is its folder; its declaration
(core/capability.py Declaration) is the folder's __init__.py. The core knows none of them by name.
"""

from __future__ import annotations

from . import cuda, gpuhealth, http, nic, numa, pcie, reclaim, requests
from .core.unit import Unit

CAPABILITIES = (
    requests.CAPABILITY,
    http.CAPABILITY,
    reclaim.CAPABILITY,
    cuda.CAPABILITY,
    gpuhealth.CAPABILITY,
    pcie.CAPABILITY,
    nic.CAPABILITY,
    numa.CAPABILITY,
)

UNIT = Unit(CAPABILITIES)


def make_agent(cfg, **kw):
    """An Agent (not started) running these capabilities."""
    from .core.agent import Agent

    return Agent(cfg, CAPABILITIES, **kw)
