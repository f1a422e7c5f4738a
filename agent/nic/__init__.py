"""NIC: the host's interfaces' link events from rtnetlink (no BPF)."""

from ..core.capability import Declaration


def _make():
    from .capability import Nic
    return Nic


CAPABILITY = Declaration(
    name="nic", make=_make,
    # pyroute2's import (0.2-0.6 s) shares the GIL with the load's end if begun with the others
    imports_after_load=lambda cfg: ("pyroute2",) if cfg.nic_enabled else (),
)
