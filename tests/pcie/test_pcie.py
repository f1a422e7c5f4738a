"""Tests for mcp_hostagent.pcie, core.tracefs and gpuhealth.xid: the poller over the sysfs PCI tree
recorded on an H200 host (and over modified copies of it), the downtraining rule fed with utilisation
recorded there, and the decoders fed with the nvidia:nvidia_dev_xid format and a real ring-buffer page
recorded there (an Xid 31 caused on purpose). AER hardware is absent on both machines, so AER files are
written in the kernel's format."""

from __future__ import annotations

import base64
import os
import shutil
import struct
import tarfile
from pathlib import Path

import pytest

from mcp_hostagent.core.tracefs import (
    RecordError, TracepointFormat, Unavailable, decode_captured, decode_record, iter_trace_page, load_formats,
    parse_format,
)
from mcp_hostagent.registry import UNIT
from mcp_hostagent.gpuhealth.xid import NVIDIA_DEV_XID_FORMAT, decode_xid
from mcp_hostagent.pcie.episodes import LinkJudge
from mcp_hostagent.pcie.records import AER_EVENT_FORMAT as DERIVED_AER_FORMAT
from mcp_hostagent.pcie.records import PCIE_LINK_EVENT_FORMAT, decode_aer, decode_link_event
from mcp_hostagent.pcie.sysfs import PciePoller, gen_of, parse_aer, parse_link_speed

FIX = Path(__file__).parent.parent / "fixtures" / "gpu"
GPU = "0000:00:06.0"
S = 1_000_000_000


def load(name):
    import json

    return json.loads((FIX / name).read_text())


STREAM = load("nvml_stream.json")
TRACEPOINTS = load("tracepoints.json")
XID = load("xid.json")
# utilisation the H200 reported idle and under the PyTorch matmul loop
IDLE_UTIL = STREAM["samples"][5]["gpus"][0]["calls"]["nvmlDeviceGetUtilizationRates"]["value"]["gpu"]
BUSY_UTIL = next(s for s in STREAM["samples"] if s["phase"] == "busy")["gpus"][0]["calls"][
    "nvmlDeviceGetUtilizationRates"]["value"]["gpu"]


@pytest.fixture
def sysroot(tmp_path) -> Path:
    with tarfile.open(FIX / "pci_sysfs.tar") as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(tmp_path / "sys", filter="data")
        else:
            tf.extractall(tmp_path / "sys")
    return tmp_path / "sys"


class Clock:
    def __init__(self):
        self.t = 0

    def __call__(self):
        return self.t


def write(path: Path, text: str):
    path.write_text(text)


def set_link(dev: Path, speed: str | None = None, width: str | None = None):
    if speed is not None:
        write(dev / "current_link_speed", f"{speed} GT/s PCIe\n")
    if width is not None:
        write(dev / "current_link_width", f"{width}\n")


# drivers/pci/pcie/aer.c (Linux 6.x) writes "Name count" lines, then TOTAL_ERR_*
def aer_files(dev: Path, rx_err=0, bad_tlp=0, nonfatal=0):
    write(dev / "aer_dev_correctable", f"RxErr {rx_err}\nBadTLP {bad_tlp}\nBadDLLP 0\nRollover 0\nTimeout 0\n"
          f"NonFatalErr 0\nCorrIntErr 0\nHeaderOF 0\nTOTAL_ERR_COR {rx_err + bad_tlp}\n")
    write(dev / "aer_dev_nonfatal", f"Undefined 0\nDLP {nonfatal}\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nCmpltAbrt 0\n"
          f"UnxCmplt 0\nRxOF 0\nMalfTLP 0\nECRC 0\nUnsupReq 0\nACSViol 0\nTOTAL_ERR_NONFATAL {nonfatal}\n")
    write(dev / "aer_dev_fatal", "Undefined 0\nDLP 0\nSDES 0\nTOTAL_ERR_FATAL 0\n")


def gpu_dir(root: Path) -> Path:
    return Path(os.path.realpath(root / "bus/pci/devices" / GPU))


# --- the recorded tree ---------------------------------------------------------------------------------


def test_recorded_tree_gpu_link_matches_nvml(sysroot):
    snap = PciePoller(str(sysroot)).poll()
    assert dict(snap.paths) == {GPU: ()}  # the VM puts the H200 straight on the root bus: no bridge
    link = snap.links[GPU]
    assert (link.speed_gts, link.width, link.max_speed_gts, link.max_width) == (32.0, 16, 32.0, 16)
    assert (link.gen, link.max_gen) == (5, 5)
    assert link.aer is None  # no CONFIG_PCIEAER port driver there
    # NVML's view at every recorded moment, idle and busy, agrees with sysfs
    for rec in STREAM["samples"]:
        calls = rec["gpus"][0]["calls"]
        sys_link = rec["sysfs_link"][GPU]
        nvml_gen = calls["nvmlDeviceGetCurrPcieLinkGeneration"]["value"]
        assert gen_of(parse_link_speed(sys_link["current_link_speed"])) == nvml_gen
        assert int(sys_link["current_link_width"]) == calls["nvmlDeviceGetCurrPcieLinkWidth"]["value"]


def test_only_nvidia_display_controllers_are_gpus(sysroot):
    # the recorded tree holds virtio devices (vendor 0x1af4) and a host bridge too
    assert len(os.listdir(sysroot / "bus/pci/devices")) == 7
    assert list(PciePoller(str(sysroot)).rescan()) == [GPU]


def _bridged(sysroot: Path) -> tuple[Path, list[Path]]:
    """Move the recorded GPU below root port 00:1c.0 -> switch up 10:00.0 -> switch down 11:00.0 -> GPU 12:00.0, as on
    a bare-metal HGX host, keeping the recorded attribute files."""
    top = sysroot / "devices/pci0000:00"
    chain = [("0000:00:1c.0", "0x8086"), ("0000:10:00.0", "0x1000"), ("0000:11:00.0", "0x1000")]
    parent, bridges = top, []
    for bdf, vendor in chain:
        d = parent / bdf
        d.mkdir()
        for name, text in (("vendor", vendor), ("class", "0x060400"), ("current_link_speed", "32.0 GT/s PCIe"),
                           ("current_link_width", "16"), ("max_link_speed", "32.0 GT/s PCIe"),
                           ("max_link_width", "16")):
            write(d / name, text + "\n")
        (sysroot / "bus/pci/devices" / bdf).symlink_to(os.path.relpath(d, sysroot / "bus/pci/devices"))
        bridges.append(d)
        parent = d
    gpu = parent / "0000:12:00.0"
    shutil.move(top / GPU, gpu)
    (sysroot / "bus/pci/devices" / GPU).unlink()
    (sysroot / "bus/pci/devices" / "0000:12:00.0").symlink_to(os.path.relpath(gpu, sysroot / "bus/pci/devices"))
    return gpu, bridges


def test_bridges_up_to_the_root_port(sysroot):
    gpu, bridges = _bridged(sysroot)
    snap = PciePoller(str(sysroot)).poll()
    assert dict(snap.paths) == {"0000:12:00.0": ("0000:11:00.0", "0000:10:00.0", "0000:00:1c.0")}
    assert snap.links["0000:00:1c.0"].role == "bridge" and snap.links["0000:00:1c.0"].gen == 5
    assert snap.links["0000:12:00.0"].role == "gpu"


# --- the downtraining rule -----------------------------------------------------------------------------


def run(poller, judge, clock, util, t_s):
    clock.t = int(t_s * S)
    return judge.update(poller.poll(), {GPU: util})


def test_idle_downclock_is_not_degradation(sysroot):
    clock, dev = Clock(), gpu_dir(sysroot)
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge()
    assert run(poller, judge, clock, BUSY_UTIL, 1) == []
    for t in range(2, 8):  # the GPU goes idle and the driver drops the link to Gen1 to save power
        set_link(dev, speed="2.5")
        assert run(poller, judge, clock, IDLE_UTIL, t) == []
    set_link(dev, speed="32.0")  # busy again, back at Gen5
    assert run(poller, judge, clock, BUSY_UTIL, 8) == []
    assert judge.open_episodes() == []


def test_downtrain_under_load_is_reported_and_closes_on_retrain(sysroot):
    clock, dev = Clock(), gpu_dir(sysroot)
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge(confirm_polls=2)
    assert run(poller, judge, clock, BUSY_UTIL, 1) == []
    set_link(dev, speed="16.0")  # Gen4 while the matmul loop runs: half the bandwidth
    assert run(poller, judge, clock, BUSY_UTIL, 2) == []  # one poll could be the moment load began
    (ep,) = run(poller, judge, clock, BUSY_UTIL, 3)
    assert (ep.event, ep.causes, ep.gpu_bdf, ep.link_bdf) == ("opened", ("speed_under_load",), GPU, GPU)
    assert (ep.from_gen, ep.from_width, ep.to_gen, ep.to_width, ep.ref_gen) == (5, 16, 4, 16, 5)
    assert ep.busy is True and ep.start_ns == 3 * S and ep.end_ns is None
    assert run(poller, judge, clock, BUSY_UTIL, 4) == []  # unchanged: no record
    set_link(dev, speed="2.5")  # idle at Gen1 proves nothing: the episode stays open
    (upd,) = run(poller, judge, clock, IDLE_UTIL, 5)
    assert upd.event == "updated" and upd.to_gen == 1 and upd.episode_id == ep.episode_id
    set_link(dev, speed="32.0")
    (closed,) = run(poller, judge, clock, BUSY_UTIL, 6)
    assert (closed.event, closed.episode_id, closed.end_ns, closed.to_gen) == ("closed", ep.episode_id, 6 * S, 5)
    assert closed.attributes()["hostagent.pcie.causes"] == ["speed_under_load"]


def test_width_drop_is_degradation_even_idle(sysroot):
    clock, dev = Clock(), gpu_dir(sysroot)
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge()
    run(poller, judge, clock, IDLE_UTIL, 1)
    set_link(dev, width="8")
    (ep,) = run(poller, judge, clock, IDLE_UTIL, 2)
    assert (ep.event, ep.causes, ep.from_width, ep.to_width, ep.ref_width) == ("opened", ("width_drop",), 16, 8, 16)
    assert run(poller, judge, clock, IDLE_UTIL, 3) == []  # unchanged: no new record
    (ep2,) = LinkJudge().update(poller.poll(), {})  # no NVML at all: the width rule still holds
    assert ep2.causes == ("width_drop",) and ep2.busy is None


def test_aer_burst_then_drop_is_one_episode(sysroot):
    clock, dev = Clock(), gpu_dir(sysroot)
    aer_files(dev)
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge(aer_window_s=30)
    assert run(poller, judge, clock, BUSY_UTIL, 1) == []  # baseline counters
    aer_files(dev, rx_err=5, bad_tlp=2)  # physical-layer errors...
    (opened,) = run(poller, judge, clock, BUSY_UTIL, 2)
    assert (opened.event, opened.causes) == ("opened", ("aer_errors",))
    assert dict(opened.aer_delta)["correctable"] == 7 and dict(opened.aer_delta)["correctable.RxErr"] == 5
    set_link(dev, speed="16.0")  # ...then the link retrains to Gen4 (idle or not: AER says why)
    (upd,) = run(poller, judge, clock, IDLE_UTIL, 4)
    assert upd.event == "updated" and upd.episode_id == opened.episode_id
    assert upd.causes == ("aer_errors", "drop_after_aer")
    assert (upd.from_gen, upd.to_gen, upd.link_bdf, upd.aer_devices) == (5, 4, GPU, (GPU,))
    aer_files(dev, rx_err=9, bad_tlp=2)
    (upd2,) = run(poller, judge, clock, BUSY_UTIL, 5)
    assert upd2.episode_id == opened.episode_id and dict(upd2.aer_delta)["correctable.RxErr"] == 9
    records = [upd2]
    for t in range(6, 40):
        records += run(poller, judge, clock, BUSY_UTIL, t)
    assert all(r.episode_id == opened.episode_id for r in records)
    assert not any(r.event == "opened" for r in records)
    assert judge.open_episodes() == [opened.episode_id]  # still Gen4 under load: not over
    set_link(dev, speed="32.0")
    (closed,) = run(poller, judge, clock, BUSY_UTIL, 40)
    assert (closed.event, closed.episode_id) == ("closed", opened.episode_id)
    assert set(closed.causes) == {"aer_errors", "drop_after_aer", "speed_under_load"}


def test_aer_alone_closes_after_a_quiet_window(sysroot):
    clock, dev = Clock(), gpu_dir(sysroot)
    aer_files(dev)
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge(aer_window_s=10)
    run(poller, judge, clock, IDLE_UTIL, 1)
    aer_files(dev, nonfatal=1)
    (ep,) = run(poller, judge, clock, IDLE_UTIL, 2)
    assert dict(ep.aer_delta)["nonfatal"] == 1 and dict(ep.aer_delta)["nonfatal.DLP"] == 1
    assert run(poller, judge, clock, IDLE_UTIL, 11) == []
    (closed,) = run(poller, judge, clock, IDLE_UTIL, 13)
    assert closed.event == "closed" and closed.end_ns == 13 * S


def test_aer_on_the_root_port_and_drop_on_a_bridge(sysroot):
    gpu, bridges = _bridged(sysroot)
    root_port, _, down_port = bridges
    aer_files(root_port)
    clock = Clock()
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge()
    g = "0000:12:00.0"
    clock.t = S
    assert judge.update(poller.poll(), {g: BUSY_UTIL}) == []
    aer_files(root_port, rx_err=3)
    set_link(down_port, speed="16.0")
    clock.t = 2 * S
    (ep,) = judge.update(poller.poll(), {g: IDLE_UTIL})
    assert ep.gpu_bdf == g and ep.link_bdf == "0000:11:00.0" and ep.aer_devices == ("0000:00:1c.0",)
    assert ep.causes == ("aer_errors", "drop_after_aer")


def test_lower_maximum_on_the_other_end_is_not_degradation(sysroot):
    """A Gen5 GPU behind a Gen4 port trains to Gen4 by design."""
    gpu, bridges = _bridged(sysroot)
    write(bridges[2] / "max_link_speed", "16.0 GT/s PCIe\n")
    for d in (bridges[2], gpu):
        set_link(d, speed="16.0")
    clock = Clock()
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge(confirm_polls=1)
    for t in (1, 2, 3):
        clock.t = t * S
        assert judge.update(poller.poll(), {"0000:12:00.0": BUSY_UTIL}) == []


def test_gpu_falling_off_the_bus(sysroot):
    clock, dev = Clock(), gpu_dir(sysroot)
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge()
    run(poller, judge, clock, BUSY_UTIL, 1)
    shutil.rmtree(dev)
    (ep,) = run(poller, judge, clock, None, 2)
    assert ep.causes == ("device_gone",) and ep.from_gen == 5 and ep.to_gen is None


# --- parsers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, gts, gen", [
    ("32.0 GT/s PCIe", 32.0, 5), ("2.5 GT/s PCIe", 2.5, 1), ("16.0 GT/s", 16.0, 4), ("8.0 GT/s PCIe", 8.0, 3),
    ("64.0 GT/s PCIe", 64.0, 6), ("Unknown", None, None), ("", None, None),
])
def test_link_speed(text, gts, gen):
    assert parse_link_speed(text) == gts and gen_of(gts) == gen


def test_aer_file_formats():
    new = parse_aer("RxErr 2\nBadTLP 0\nBadDLLP 1\nTOTAL_ERR_COR 3\n")
    assert new == {"RxErr": 2, "BadTLP": 0, "BadDLLP": 1, "TOTAL_ERR_COR": 3}
    # Linux 4.19's spelling (Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats)
    old = parse_aer("Receiver Error 2\nBad TLP 0\nRELAY_NUM Rollover 0\nTOTAL_ERR_COR 2\n")
    assert old == {"Receiver Error": 2, "Bad TLP": 0, "RELAY_NUM Rollover": 0, "TOTAL_ERR_COR": 2}
    assert parse_aer("garbage\n\nx y z\n") == {}


# --- tracepoint formats and the Xid record ----------------------------------------------------------------

XID_FORMAT_TEXT = TRACEPOINTS["nvidia"]["nvidia_dev_xid"]["format"]


def test_recorded_nvidia_dev_xid_format_parses():
    fmt = parse_format(XID_FORMAT_TEXT)
    assert fmt.name == "nvidia_dev_xid" and fmt.id == 2430
    assert [(f.name, f.offset, f.size, f.data_loc) for f in fmt.fields] == [
        ("common_type", 0, 2, False), ("common_flags", 2, 1, False), ("common_preempt_count", 3, 1, False),
        ("common_pid", 4, 4, False), ("dev", 8, 4, True), ("error_code", 12, 4, False), ("msg", 16, 4, True)]
    assert fmt.field("common_pid").signed
    # the built-in default is the recorded layout
    assert [(f.name, f.offset, f.size, f.data_loc) for f in fmt.fields] == [
        (f.name, f.offset, f.size, f.data_loc) for f in NVIDIA_DEV_XID_FORMAT.fields]


def build_record(fmt: TracepointFormat, pid: int, dev: str, code: int, msg: str) -> bytes:
    """A record laid out per fmt: fixed part, then the __data_loc strings (NUL included)."""
    fixed = max(f.offset + f.size for f in fmt.fields)
    buf = bytearray(fixed)
    tail = bytearray()
    struct.pack_into("<H", buf, fmt.field("common_type").offset, fmt.id or 0)
    struct.pack_into("<i", buf, fmt.field("common_pid").offset, pid)
    struct.pack_into("<I", buf, fmt.field("error_code").offset, code)
    for name, text in (("dev", dev), ("msg", msg)):
        data = text.encode() + b"\0"
        struct.pack_into("<I", buf, fmt.field(name).offset, (fixed + len(tail)) | len(data) << 16)
        tail += data
    return bytes(buf + tail)


def test_decode_xid_from_a_record_built_per_the_recorded_format():
    fmt = parse_format(XID_FORMAT_TEXT)
    raw = build_record(fmt, 177, "0000:00:06.0", 79, "GPU has fallen off the bus.")
    rec = decode_xid(raw, fmt)
    assert (rec.dev, rec.error_code, rec.msg, rec.pid) == ("0000:00:06.0", 79, "GPU has fallen off the bus.", 177)
    with pytest.raises(RecordError):
        decode_xid(raw[:14], fmt)  # cut inside the fixed part
    bad = bytearray(raw)
    struct.pack_into("<I", bad, 16, 20 | 4000 << 16)  # msg's __data_loc points past the record
    with pytest.raises(RecordError):
        decode_xid(bytes(bad), fmt)


def test_decode_the_real_xid_record_from_the_h200_ring_buffer():
    """The driver's own record of the Xid 31 we caused there, from per_cpu/cpu0/trace_pipe_raw."""
    fmt = parse_format(XID["format"])
    (page_b64,) = XID["raw_pages"]["cpu0"]
    events = list(iter_trace_page(base64.b64decode(page_b64)))
    assert len(events) == 1
    ts_ns, raw = events[0]
    assert struct.unpack_from("<H", raw, 0)[0] == fmt.id  # common_type: this event's id
    rec = decode_xid(raw, fmt)
    # tracefs's own rendering of the same record: "nvidia_dev_xid: Xid (PCI:%s): %u, %s"
    line = next(l for l in XID["trace_text"].splitlines() if "nvidia_dev_xid:" in l)
    assert f"Xid (PCI:{rec.dev}): {rec.error_code}, {rec.msg}" == line.split("nvidia_dev_xid: ", 1)[1]
    assert rec.dev == "0000:00:06.0" and rec.error_code == 31 and rec.msg.startswith("channel 0x0000000a")
    assert "irq/44-nvidia-177" in line and rec.pid == 177
    assert abs(ts_ns / 1e9 - float(line.split()[3].rstrip(":"))) < 1e-6  # the trace's timestamp
    assert decode_record(raw, fmt)["error_code"] == 31
    assert XID["events"][0]["value"]["eventData"] == rec.error_code  # NVML's Xid event said the same


# A ras:aer_event format file as a kernel printed it (quoted on LKML, 2013; its "size:1;signed:0;"
# lacks the tab, as printed). Newer kernels append u8 tlp_header_valid and u32 tlp_header[4].
AER_EVENT_FORMAT = """name: aer_event
ID: 877
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;signed:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:__data_loc char[] dev_name;\toffset:8;\tsize:4;\tsigned:1;
\tfield:u32 status;\toffset:12;\tsize:4;\tsigned:0;
\tfield:u8 severity;\toffset:16;\tsize:1;\tsigned:0;
\tfield:u8 tlp_header_valid;\toffset:17;\tsize:1;\tsigned:0;
\tfield:u32 tlp_header[4];\toffset:20;\tsize:16;\tsigned:0;
"""


def test_aer_event_format_and_record():
    fmt = parse_format(AER_EVENT_FORMAT)
    assert [f.name for f in fmt.fields][4:] == ["dev_name", "status", "severity", "tlp_header_valid", "tlp_header"]
    assert fmt.field("common_preempt_count").size == 1 and fmt.field("tlp_header").ctype == "u32[4]"
    name = b"0000:00:1c.0\0"
    raw = bytearray(36)
    struct.pack_into("<HxxiIIBB", raw, 0, 877, 0, 36 | len(name) << 16, 1 << 6, 2, 0)  # Bad TLP, corrected
    rec = decode_record(bytes(raw) + name, fmt)
    assert (rec["dev_name"], rec["status"], rec["severity"], rec["tlp_header"]) == ("0000:00:1c.0", 64, 2, bytes(16))


# the raw tracepoints the GPU and PCIe capabilities copy, and why each may be absent (their probe rows)
HEALTH_EVENTS = ("ras/aer_event", "pci/pcie_link_event", "nvidia/nvidia_dev_xid")
MISSING_WHY = {p.tracepoint.replace(":", "/"): p.absent for p in UNIT.probes if p.absent}


def test_link_event_formats_degrade_with_a_reason(tmp_path):
    empty = load_formats(str(tmp_path), HEALTH_EVENTS, MISSING_WHY)
    assert all(isinstance(v, Unavailable) and "tracefs not mounted" in v.reason for v in empty.values())
    ev = tmp_path / "events"
    (ev / "nvidia/nvidia_dev_xid").mkdir(parents=True)
    (ev / "nvidia/nvidia_dev_xid/format").write_text(XID_FORMAT_TEXT)
    got = load_formats(str(tmp_path), HEALTH_EVENTS, MISSING_WHY)
    assert isinstance(got["nvidia/nvidia_dev_xid"], TracepointFormat)
    assert isinstance(got["ras/aer_event"], Unavailable) and "CONFIG_PCIEAER" in got["ras/aer_event"].reason
    assert isinstance(got["pci/pcie_link_event"], Unavailable)
    # the H200 host had neither either (recorded list of its tracefs event groups)
    assert TRACEPOINTS["present"]["ras/aer_event"] is False and "pci" not in TRACEPOINTS["groups"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting tracefs needs root")
def test_link_event_formats_on_this_machine():
    from mcp_hostagent.core import kernel

    kernel.ensure_tracefs()
    got = load_formats("/sys/kernel/tracing", HEALTH_EVENTS, MISSING_WHY)
    for name in ("ras/aer_event", "pci/pcie_link_event"):
        if os.path.exists(f"/sys/kernel/tracing/events/{name}/format"):
            assert isinstance(got[name], TracepointFormat)  # a kernel that has them
        else:
            assert isinstance(got[name], Unavailable) and got[name].reason


# --- ras:aer_event and pci:pcie_link_event: layouts derived from kernel source, AER events in the judge ------


def build_tp_record(fmt: TracepointFormat, values: dict, strings: dict, pid: int = 0) -> bytes:
    """A record laid out per fmt (fixed part, then the __data_loc strings with their NUL), as the
    kernel's TRACE_EVENT code writes it."""
    fixed = max(f.offset + f.size for f in fmt.fields)
    buf, tail = bytearray(fixed), bytearray()
    struct.pack_into("<Hxxi", buf, 0, fmt.id or 0, pid)
    for name, v in values.items():
        f = fmt.field(name)
        if isinstance(v, bytes):
            buf[f.offset:f.offset + len(v)] = v
        else:
            struct.pack_into({1: "<B", 4: "<I"}[f.size], buf, f.offset, v)
    for name, text in strings.items():
        data = text.encode() + b"\0"
        struct.pack_into("<I", buf, fmt.field(name).offset, (fixed + len(tail)) | len(data) << 16)
        tail += data
    return bytes(buf + tail)


def test_derived_aer_format_has_the_layout_a_kernel_printed():
    """The built-in aer_event layout (derived from include/ras/ras_event.h) against the format file a
    kernel printed (AER_EVENT_FORMAT above): the same fields at the same offsets."""
    printed = parse_format(AER_EVENT_FORMAT)
    assert [(f.name, f.offset, f.size, f.data_loc) for f in DERIVED_AER_FORMAT.fields] == [
        (f.name, f.offset, f.size, f.data_loc) for f in printed.fields]
    assert DERIVED_AER_FORMAT.id is None and PCIE_LINK_EVENT_FORMAT.id is None  # ids are assigned at boot
    assert [(f.name, f.offset) for f in PCIE_LINK_EVENT_FORMAT.fields][4:] == [
        ("port_name", 8), ("type", 12), ("reason", 16), ("cur_bus_speed", 20), ("max_bus_speed", 24),
        ("width", 28), ("flit_mode", 32), ("link_status", 36)]


def test_decode_aer_with_the_derived_and_a_newer_layout():
    raw = build_tp_record(DERIVED_AER_FORMAT, {"status": 1 << 6 | 1, "severity": 2}, {"dev_name": "0000:00:1c.0"})
    rec = decode_aer(raw)
    assert (rec.dev, rec.severity, rec.status, rec.errors) == ("0000:00:1c.0", "correctable", 65, ("RxErr", "BadTLP"))
    # mainline: tlp_header of PCIE_STD_MAX_TLP_HEADERLOG (14) words, then __string(bus_type); read from
    # its format, the same record decodes
    newer = parse_format(AER_EVENT_FORMAT_TEXT_NEWER)
    raw = build_tp_record(newer, {"status": 1 << 14, "severity": 0, "tlp_header_valid": 1,
                                  "tlp_header": bytes(range(56))}, {"dev_name": GPU, "bus_type": "PCIe"})
    rec = decode_aer(raw, newer)
    assert (rec.dev, rec.severity, rec.errors) == (GPU, "nonfatal", ("CmpltTO",))
    assert decode_record(raw, newer)["bus_type"] == "PCIe"
    fatal = decode_aer(build_tp_record(DERIVED_AER_FORMAT, {"status": 1 << 18, "severity": 1}, {"dev_name": GPU}))
    assert (fatal.severity, fatal.errors) == ("fatal", ("MalfTLP",))


AER_EVENT_FORMAT_TEXT_NEWER = """name: aer_event
ID: 1412
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:__data_loc char[] dev_name;\toffset:8;\tsize:4;\tsigned:0;
\tfield:u32 status;\toffset:12;\tsize:4;\tsigned:0;
\tfield:u8 severity;\toffset:16;\tsize:1;\tsigned:0;
\tfield:u8 tlp_header_valid;\toffset:17;\tsize:1;\tsigned:0;
\tfield:u32 tlp_header[14];\toffset:20;\tsize:56;\tsigned:0;
\tfield:__data_loc char[] bus_type;\toffset:76;\tsize:4;\tsigned:0;
"""


def test_decode_link_event():
    raw = build_tp_record(PCIE_LINK_EVENT_FORMAT, {"type": 4, "reason": 3, "cur_bus_speed": 0x17,
                                                   "max_bus_speed": 0x18, "width": 8, "link_status": 0x2000},
                          {"port_name": "0000:00:1c.0"}, pid=0)
    rec = decode_link_event(raw)
    assert (rec.port, rec.reason, rec.speed_gts, rec.max_speed_gts, rec.width) == ("0000:00:1c.0", "bwctrl_irq", 16.0,
                                                                                   32.0, 8)
    assert rec.attributes()["hostagent.pcie.to_gen"] == 4
    odd = decode_link_event(build_tp_record(PCIE_LINK_EVENT_FORMAT, {"reason": 9, "cur_bus_speed": 0xFF},
                                            {"port_name": "x"}))
    assert (odd.reason, odd.speed_gts) == ("reason9", None)


def test_captured_record_strings_are_clamped_not_dropped():
    fmt = parse_format(XID_FORMAT_TEXT)
    raw = build_record(fmt, 177, GPU, 31, "M" * 1000)  # a message longer than the BPF copy
    copy = raw[:512]
    with pytest.raises(RecordError):
        decode_record(copy, fmt)  # a whole record must hold its strings
    rec, cut = decode_captured(copy, fmt, captured=True)
    assert cut == ("msg",) and rec["dev"] == GPU and rec["msg"] == "M" * (512 - 33)
    x = decode_xid(copy, fmt, captured=True)
    assert x.truncated and x.error_code == 31
    bad = bytearray(copy)
    struct.pack_into("<I", bad, 16, 4 | 600 << 16)  # msg "inside" the fixed fields: not a record of this format
    with pytest.raises(RecordError):
        decode_captured(bytes(bad), fmt, captured=True)
    struct.pack_into("<I", bad, 16, 40 | 9000 << 16)  # longer than the perf trace buffer can hold
    with pytest.raises(RecordError):
        decode_captured(bytes(bad), fmt, captured=True)
    with pytest.raises(RecordError):
        decode_captured(copy[:14], fmt, captured=True)  # the copy ends inside the fixed fields


def test_aer_event_then_drop_is_one_episode_without_sysfs_counters(sysroot):
    """The recorded tree has no aer_* files (no port driver there): ras:aer_event records alone open
    the episode, and a drop within the window joins it."""
    clock, dev = Clock(), gpu_dir(sysroot)
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge(aer_window_s=30)
    assert run(poller, judge, clock, BUSY_UTIL, 1) == []
    for _ in range(3):
        judge.note_aer_event(GPU, "correctable", ("RxErr",))
    judge.note_aer_event(GPU, "correctable", ("BadTLP", "RxErr"))
    (opened,) = run(poller, judge, clock, BUSY_UTIL, 2)
    assert (opened.event, opened.causes, opened.aer_devices) == ("opened", ("aer_errors",), (GPU,))
    assert dict(opened.aer_delta) == {"correctable": 4, "correctable.RxErr": 4, "correctable.BadTLP": 1}
    set_link(dev, speed="16.0")
    (upd,) = run(poller, judge, clock, IDLE_UTIL, 4)
    assert upd.episode_id == opened.episode_id and upd.causes == ("aer_errors", "drop_after_aer")
    assert (upd.from_gen, upd.to_gen) == (5, 4)
    assert dict(upd.aer_delta)["correctable"] == 4  # consumed once, not again at the next poll


def test_aer_event_on_a_device_with_counters_is_not_counted_twice(sysroot):
    """The kernel counts an error in sysfs and emits ras:aer_event for it: the counter delta counts,
    the event marks the device."""
    clock, dev = Clock(), gpu_dir(sysroot)
    aer_files(dev)
    poller, judge = PciePoller(str(sysroot), clock), LinkJudge()
    run(poller, judge, clock, IDLE_UTIL, 1)
    aer_files(dev, rx_err=2)
    judge.note_aer_event(GPU, "correctable", ("RxErr",))
    judge.note_aer_event(GPU, "correctable", ("RxErr",))
    (ep,) = run(poller, judge, clock, IDLE_UTIL, 2)
    assert dict(ep.aer_delta) == {"correctable": 2, "correctable.RxErr": 2}
    judge.note_aer_event("0000:99:00.0", "fatal")  # a device on no GPU's path
    run(poller, judge, clock, IDLE_UTIL, 3)
    assert judge.aer_events_off_path == 1


def test_nvml_xid_span_event_has_no_message_attribute():
    """NVML's Xid events carry no driver text: the span event leaves hostagent.gpu.xid.message off rather
    than handing OTel a None (which it drops with a warning)."""
    from conftest import unstarted_agent
    from mcp_hostagent.gpuhealth.xid import XidEvent

    g = unstarted_agent({"gpu.enabled": False}).caps["gpuhealth"]
    g.xids.append(XidEvent(100, 0, "GPU-x", "0000:00:06.0", 31, pid=4242))
    g.xids.append(XidEvent(200, 0, "GPU-x", "0000:00:06.0", 79, source="bpf", msg="fallen off the bus", pid=4242))
    (a, b) = [attrs for _, _, attrs in g.events_between(4242, 0, 1000)]
    assert a == {"hostagent.gpu.xid.code": 31, "hostagent.gpu.pci_bus_id": "0000:00:06.0", "hostagent.gpu.xid.source": "nvml"}
    assert b["hostagent.gpu.xid.message"] == "fallen off the bus"
