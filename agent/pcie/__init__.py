"""PCIe: each GPU's link and AER counters from sysfs, the downtraining rule, AER and link-change
tracepoints (bpf/pcie.bpf.c)."""

from ..core.capability import Declaration, RawKind
from ..core.probes import ProbeSpec
from . import records


def _make():
    from .capability import Pcie
    return Pcie


CAPABILITY = Declaration(
    name="pcie", make=_make, bpf="pcie.bpf.c", header="pcie.h", needs=("gpu.util_by_bdf", "gpu.gpus_of", "gpu.links"),
    raw={records.C["MCP_TP_AER_EVENT"]: RawKind("ras/aer_event", records.AER_EVENT_FORMAT, records.decode_aer),
         records.C["MCP_TP_PCIE_LINK_EVENT"]: RawKind("pci/pcie_link_event", records.PCIE_LINK_EVENT_FORMAT,
                                                      records.decode_link_event)},
    probes=(
        ProbeSpec("pcie_aer", "ras:aer_event", "pcie.bpf.c",
                  "PCIe AER errors as they are reported, into the link-episode judge (sysfs AER counters otherwise)",
                  "needs CONFIG_PCIEAER and the PCIe port driver (CONFIG_PCIEPORTBUS)", kind="tracepoint_raw",
                  absent="kernel has no ras:aer_event (needs CONFIG_PCIEAER with the PCIe port driver)"),
        ProbeSpec("pcie_link_event", "pci:pcie_link_event", "pcie.bpf.c",
                  "PCIe link speed/width changes: an immediate re-poll of the link (sysfs polling otherwise)",
                  "a 2025 kernel tracepoint (include/trace/events/pci.h); older kernels rely on the poll",
                  kind="tracepoint_raw", absent="kernel has no pci:pcie_link_event (a newer kernel's tracepoint)"),
    ),
)
