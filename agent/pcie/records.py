"""Decoders of the PCIe tracepoints' raw records (bpf/pcie.bpf.c, kinds in bpf/pcie.h): ras:aer_event ->
AerRecord, pci:pcie_link_event -> LinkEventRecord, with the layouts derived from kernel source standing
in when tracefs gives none. Pure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core import records as R
from ..core.tracefs import RecordError, TracepointFormat, decode_captured, parse_format
from .sysfs import gen_of

C = R.header_constants("pcie.h")


# ras:aer_event and pci:pcie_link_event: no host we could record on has them (tests/fixtures/gpu:
# the H200 VM has no PCIe port driver). These defaults are DERIVED FROM KERNEL SOURCE, not recorded:
# the offsets are what the TRACE_EVENT macros lay out for the TP_STRUCT__entry fields (an 8-byte
# common header, a __string as a u32 __data_loc, fields at their natural alignment); signed:0 for
# char as the kernel builds with -funsigned-char since 6.2. They are used only when the event's
# format file cannot be read; the format tracefs gives at run time always wins.
#
# include/ras/ras_event.h aer_event: __string(dev_name), __field(u32, status), __field(u8, severity),
# __field(u8, tlp_header_valid), __array(u32, tlp_header, 4) (PCIE_STD_NUM_TLP_HEADERLOG). Mainline
# now sizes tlp_header PCIE_STD_MAX_TLP_HEADERLOG (4 + 10 words, flit mode; include/linux/aer.h), and a
# CXL change appends __string(bus_type): the run-time format covers those.
AER_EVENT_FORMAT_TEXT = """name: aer_event
ID: 0
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:__data_loc char[] dev_name;\toffset:8;\tsize:4;\tsigned:0;
\tfield:u32 status;\toffset:12;\tsize:4;\tsigned:0;
\tfield:u8 severity;\toffset:16;\tsize:1;\tsigned:0;
\tfield:u8 tlp_header_valid;\toffset:17;\tsize:1;\tsigned:0;
\tfield:u32 tlp_header[4];\toffset:20;\tsize:16;\tsigned:0;
"""

# mainline include/trace/events/pci.h pcie_link_event (2025): __string(port_name, pci_name(bus->self)),
# then unsigned int type, reason, cur_bus_speed, max_bus_speed, width, flit_mode, link_status.
PCIE_LINK_EVENT_FORMAT_TEXT = """name: pcie_link_event
ID: 0
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:__data_loc char[] port_name;\toffset:8;\tsize:4;\tsigned:0;
\tfield:unsigned int type;\toffset:12;\tsize:4;\tsigned:0;
\tfield:unsigned int reason;\toffset:16;\tsize:4;\tsigned:0;
\tfield:unsigned int cur_bus_speed;\toffset:20;\tsize:4;\tsigned:0;
\tfield:unsigned int max_bus_speed;\toffset:24;\tsize:4;\tsigned:0;
\tfield:unsigned int width;\toffset:28;\tsize:4;\tsigned:0;
\tfield:unsigned int flit_mode;\toffset:32;\tsize:4;\tsigned:0;
\tfield:unsigned int link_status;\toffset:36;\tsize:4;\tsigned:0;
"""

# No event id is known for these (it is assigned at boot): the defaults skip the common_type check.
AER_EVENT_FORMAT = dataclasses.replace(parse_format(AER_EVENT_FORMAT_TEXT), id=None)
PCIE_LINK_EVENT_FORMAT = dataclasses.replace(parse_format(PCIE_LINK_EVENT_FORMAT_TEXT), id=None)

# include/linux/aer.h: AER_NONFATAL 0, AER_FATAL 1, AER_CORRECTABLE 2; named as the sysfs files are.
AER_SEVERITY = {0: "nonfatal", 1: "fatal", 2: "correctable"}
# Status bits by the names drivers/pci/pcie/aer.c gives the sysfs counters (aer_correctable_error_string,
# aer_uncorrectable_error_string), so event counts and counter deltas share keys ("correctable.BadTLP").
AER_COR_BITS = {0: "RxErr", 6: "BadTLP", 7: "BadDLLP", 8: "Rollover", 12: "Timeout", 13: "NonFatalErr",
                14: "CorrIntErr", 15: "HeaderOF"}
AER_UNCOR_BITS = {0: "Undefined", 4: "DLP", 5: "SDES", 12: "TLP", 13: "FCP", 14: "CmpltTO", 15: "CmpltAbrt",
                  16: "UnxCmplt", 17: "RxOF", 18: "MalfTLP", 19: "ECRC", 20: "UnsupReq", 21: "ACSViol",
                  22: "UncorrIntErr", 23: "BlockedTLP", 24: "AtomicOpBlocked", 25: "TLPBlockedErr",
                  26: "PoisonTLPBlocked", 27: "DMWrReqBlocked", 28: "IDECheck", 29: "MisIDETLP",
                  30: "PCRC_CHECK", 31: "TLPXlatBlocked"}


def aer_error_names(severity: str, status: int) -> tuple[str, ...]:
    table = AER_COR_BITS if severity == "correctable" else AER_UNCOR_BITS
    return tuple(table.get(b, f"bit{b}") for b in range(32) if status >> b & 1)


@dataclass(frozen=True)
class AerRecord:
    dev: str  # pci_name() of the device that reported the error
    severity: str  # correctable | nonfatal | fatal
    status: int  # the Correctable or Uncorrectable Error Status register
    errors: tuple[str, ...]  # status bits by their sysfs counter names
    pid: int


def decode_aer(raw: bytes, fmt: TracepointFormat = AER_EVENT_FORMAT, captured: bool = False) -> AerRecord:
    rec, _ = decode_captured(raw, fmt, captured)
    try:
        sev = AER_SEVERITY.get(int(rec["severity"]), f"severity{int(rec['severity'])}")
        status = int(rec["status"])
        return AerRecord(str(rec["dev_name"]), sev, status, aer_error_names(sev, status), int(rec.get("common_pid", 0)))
    except (KeyError, ValueError, TypeError) as e:
        raise RecordError(f"{fmt.name}: field {e} missing or not a number") from None


# drivers/pci/pci.h enum pcie_link_change_reason, in order
LINK_CHANGE_REASONS = ("retrain", "add_bus", "bwctrl_enable", "bwctrl_irq", "hotplug")
# include/linux/pci.h enum pci_bus_speed: PCIE_SPEED_2_5GT = 0x14 .. PCIE_SPEED_64_0GT = 0x19
BUS_SPEED_GTS = {0x14: 2.5, 0x15: 5.0, 0x16: 8.0, 0x17: 16.0, 0x18: 32.0, 0x19: 64.0}


@dataclass(frozen=True)
class LinkEventRecord:
    port: str  # pci_name(bus->self): the bridge port whose link below it changed
    reason: str
    speed_gts: float | None
    max_speed_gts: float | None
    width: int
    flit_mode: int
    link_status: int  # Link Status register bits LT, DLLLA, LBMS, LABS
    pid: int

    def attributes(self) -> dict[str, object]:
        return {"hostagent.pcie.port": self.port, "hostagent.pcie.reason": self.reason, "hostagent.pcie.to_gen": gen_of(self.speed_gts),
                "hostagent.pcie.to_width": self.width or None, "hostagent.pcie.link_status": f"0x{self.link_status:x}"}


def decode_link_event(raw: bytes, fmt: TracepointFormat = PCIE_LINK_EVENT_FORMAT,
                      captured: bool = False) -> LinkEventRecord:
    rec, _ = decode_captured(raw, fmt, captured)
    try:
        reason = int(rec["reason"])
        return LinkEventRecord(
            str(rec["port_name"]),
            LINK_CHANGE_REASONS[reason] if reason < len(LINK_CHANGE_REASONS) else f"reason{reason}",
            BUS_SPEED_GTS.get(int(rec["cur_bus_speed"])), BUS_SPEED_GTS.get(int(rec["max_bus_speed"])),
            int(rec["width"]), int(rec.get("flit_mode", 0)), int(rec.get("link_status", 0)),
            int(rec.get("common_pid", 0)))
    except (KeyError, ValueError, TypeError) as e:
        raise RecordError(f"{fmt.name}: field {e} missing or not a number") from None
