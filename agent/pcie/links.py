"""PCIe link health: sysfs link state and AER counters per GPU path, the downtraining rule, and decoders
for the link/error tracepoints.

Sources: sysfs under an overridable root (psutil's habit), read by PciePoller.poll(); tracepoint records
(raw bytes from BPF or a tracefs ring-buffer page) through pure decoders. LinkJudge is pure: snapshots
and GPU utilisation in, episode records out.

Kernel and driver facts relied on:
- /sys/bus/pci/devices/<bdf> links to /sys/devices/pci<dom>:<bus>/<port>/.../<bdf>: the directories
  between the host bridge and the GPU are the bridges (root port, switch ports) on its path.
- current_link_speed reads "32.0 GT/s PCIe" (older kernels: "32.0 GT/s", "Unknown"): 2.5/5/8/16/32/64
  GT/s are Gen1..Gen6. A bridge's link attributes describe its Link Status register: for a root or
  downstream port the link below it, for an upstream port the link above it; an endpoint's, its own.
- aer_dev_correctable/fatal/nonfatal (CONFIG_PCIEAER) are "Name count" lines ending in
  TOTAL_ERR_COR / TOTAL_ERR_FATAL / TOTAL_ERR_NONFATAL; they count since boot (reset on device reset).
- GPUs lower their link speed when idle to save power (Gen1 at idle is normal); the width stays. The
  H200 VM recorded in tests/fixtures/gpu kept Gen5 x16 idle and busy (persistence mode, passthrough).
- Tracepoint records start with the common header (u16 type, u8 flags, u8 preempt_count, s32 pid);
  a `__data_loc` field is a u32 whose low 16 bits are the offset of the data from the record's start
  and high 16 bits its length (the string's NUL included).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

NVIDIA_VENDOR = 0x10DE
_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_SPEED = re.compile(r"([0-9.]+)\s*GT/s")
GEN_BY_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
AER_FILES = (("correctable", "aer_dev_correctable"), ("nonfatal", "aer_dev_nonfatal"), ("fatal", "aer_dev_fatal"))


def parse_link_speed(text: str | None) -> float | None:
    m = _SPEED.search(text or "")
    return float(m.group(1)) if m else None


def gen_of(speed_gts: float | None) -> int | None:
    return GEN_BY_GTS.get(speed_gts) if speed_gts is not None else None


def parse_aer(text: str) -> dict[str, int]:
    """An aer_dev_* file -> {"RxErr": 0, ..., "TOTAL_ERR_COR": 0}; malformed lines are skipped."""
    out = {}
    for line in text.splitlines():
        name, _, count = line.strip().rpartition(" ")
        if name and count.isdigit():
            out[name.strip()] = int(count)
    return out


# --- sysfs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AerCounts:
    """One device's AER counters; each kind maps counter name -> count (TOTAL_ERR_* included)."""

    correctable: Mapping[str, int] = field(default_factory=dict)
    nonfatal: Mapping[str, int] = field(default_factory=dict)
    fatal: Mapping[str, int] = field(default_factory=dict)

    def total(self, kind: str) -> int:
        counts = getattr(self, kind)
        tot = next((v for k, v in counts.items() if k.startswith("TOTAL_ERR")), None)
        return tot if tot is not None else sum(counts.values())

    def flat(self) -> dict[str, int]:
        """{"correctable": total, "correctable.RxErr": n, ...} for deltas and metrics."""
        out = {}
        for kind, _ in AER_FILES:
            out[kind] = self.total(kind)
            out.update({f"{kind}.{k}": v for k, v in getattr(self, kind).items() if not k.startswith("TOTAL_ERR")})
        return out


@dataclass(frozen=True)
class LinkState:
    bdf: str
    role: str  # "gpu" | "bridge"
    present: bool = True  # False: the device's sysfs directory is gone (fell off the bus, removed)
    speed_gts: float | None = None
    width: int | None = None
    max_speed_gts: float | None = None
    max_width: int | None = None
    aer: AerCounts | None = None  # None: no aer_* files (no CONFIG_PCIEAER, or not a PCIe device)

    @property
    def gen(self) -> int | None:
        return gen_of(self.speed_gts)

    @property
    def max_gen(self) -> int | None:
        return gen_of(self.max_speed_gts)


@dataclass(frozen=True)
class PcieSnapshot:
    t_ns: int  # CLOCK_MONOTONIC
    links: Mapping[str, LinkState]  # bdf -> state, GPUs and their bridges
    paths: Mapping[str, tuple[str, ...]]  # GPU bdf -> bridges from the nearest up to the root port


class PciePoller:
    """Finds NVIDIA GPUs (vendor 0x10de, class 0x03xxxx: VGA or 3D controller; NVSwitches are 0x0680)
    and the bridges above each, then reads their link state and AER counters: ~10 small sysfs reads per
    device, cheap enough for the pipeline's tick. rescan() re-walks the tree (hotplug, a GPU back)."""

    def __init__(self, sysfs_root: str = "/sys", clock=time.monotonic_ns, rescan_s: float = 60.0):
        self.root = sysfs_root.rstrip("/") or "/"
        self._clock = clock
        self._rescan_ns = int(rescan_s * 1e9)
        self._scanned_ns: int | None = None
        self._paths: dict[str, tuple[str, ...]] | None = None
        self._dirs: dict[str, str] = {}

    def _read(self, path: str) -> str | None:
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def rescan(self) -> dict[str, tuple[str, ...]]:
        base = os.path.join(self.root, "bus/pci/devices")
        devices_top = os.path.realpath(os.path.join(self.root, "devices"))
        paths, dirs = {}, {}
        try:
            names = sorted(os.listdir(base))
        except OSError:
            names = []
        for bdf in names:
            d = os.path.join(base, bdf)
            vendor, cls = self._read(f"{d}/vendor"), self._read(f"{d}/class")
            try:
                if int(vendor or "0", 16) != NVIDIA_VENDOR or (int(cls or "0", 16) >> 16) != 0x03:
                    continue
            except ValueError:
                continue
            real = os.path.realpath(d)
            dirs[bdf] = real
            chain = []
            up = os.path.dirname(real)
            while up.startswith(devices_top + os.sep) and _BDF.match(os.path.basename(up)):
                chain.append(os.path.basename(up))
                dirs[os.path.basename(up)] = up
                up = os.path.dirname(up)
            paths[bdf] = tuple(chain)
        self._paths, self._dirs = paths, dirs
        self._scanned_ns = self._clock()
        return paths

    def read_link(self, bdf: str, role: str) -> LinkState:
        d = self._dirs.get(bdf) or os.path.join(self.root, "bus/pci/devices", bdf)
        if not os.path.isdir(d):
            return LinkState(bdf, role, present=False)
        width, max_width = self._read(f"{d}/current_link_width"), self._read(f"{d}/max_link_width")
        aer = {}
        for kind, name in AER_FILES:
            text = self._read(f"{d}/{name}")
            if text is not None:
                aer[kind] = parse_aer(text)
        return LinkState(
            bdf, role, True,
            speed_gts=parse_link_speed(self._read(f"{d}/current_link_speed")),
            width=int(width) if width and width.isdigit() and int(width) > 0 else None,
            max_speed_gts=parse_link_speed(self._read(f"{d}/max_link_speed")),
            max_width=int(max_width) if max_width and max_width.isdigit() and int(max_width) > 0 else None,
            aer=AerCounts(**aer) if aer else None,
        )

    def poll(self) -> PcieSnapshot:
        """Link state of every GPU and bridge; the tree is re-walked every rescan_s (a GPU that fell
        off the bus reads present=False until then, so an episode sees it go)."""
        if self._paths is None or self._clock() - self._scanned_ns >= self._rescan_ns:
            self.rescan()
        links = {}
        for gpu, chain in self._paths.items():
            links[gpu] = self.read_link(gpu, "gpu")
            for b in chain:
                if b not in links:
                    links[b] = self.read_link(b, "bridge")
        return PcieSnapshot(self._clock(), links, dict(self._paths))


# --- the downtraining rule -----------------------------------------------------------------------


@dataclass(frozen=True)
class LinkEpisode:
    """One record of a link episode on one GPU's path: event is opened | updated | closed."""

    event: str
    episode_id: int
    gpu_bdf: str
    link_bdf: str  # the device whose link is degraded (the GPU itself for an AER-only episode)
    causes: tuple[str, ...]  # aer_errors | width_drop | speed_under_load | drop_after_aer | device_gone
    from_gen: int | None
    from_width: int | None
    to_gen: int | None
    to_width: int | None
    ref_gen: int | None  # what the link should run at: min of its ends' maxima
    ref_width: int | None
    aer_delta: tuple[tuple[str, int], ...]  # increases since the episode opened, summed over the path
    aer_devices: tuple[str, ...]
    start_ns: int
    end_ns: int | None
    t_ns: int
    busy: bool | None

    def attributes(self) -> dict[str, object]:
        attrs = {
            "mcp.pcie.episode_id": self.episode_id, "mcp.pcie.gpu_bdf": self.gpu_bdf,
            "mcp.pcie.link_bdf": self.link_bdf, "mcp.pcie.causes": list(self.causes),
            "mcp.pcie.from_gen": self.from_gen, "mcp.pcie.from_width": self.from_width,
            "mcp.pcie.to_gen": self.to_gen, "mcp.pcie.to_width": self.to_width,
            "mcp.pcie.ref_gen": self.ref_gen, "mcp.pcie.ref_width": self.ref_width,
            "mcp.pcie.aer_devices": list(self.aer_devices) or None,
        }
        attrs.update({f"mcp.pcie.aer.{k}": v for k, v in self.aer_delta})
        return {k: v for k, v in attrs.items() if v is not None}


@dataclass
class _Open:
    episode_id: int
    start_ns: int
    link_bdf: str
    causes: dict[str, None]
    from_state: tuple[float | None, int | None]
    aer_delta: dict[str, int]
    aer_devices: dict[str, None]
    degraded_seen: bool = False
    last: LinkEpisode | None = None


def _min(*xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


class LinkJudge:
    """Decides, poll after poll, which GPU paths are degraded. Power management respected:
    - a narrower width than both ends support: degraded, always;
    - a lower speed than both ends support while the GPU is busy (NVML utilisation >= busy_util_pct)
      for confirm_polls polls in a row: degraded (idle Gen1 is the driver saving power);
    - a drop in speed or width within aer_window_s after AER counters rose on the path: degraded,
      busy or not; the AER burst and the drop are one episode;
    - AER counters rising alone open an episode too (cause aer_errors), closed after aer_window_s quiet.
    An episode with a link drop closes only on evidence: every link of the path back at its reference
    (an idle link at Gen1 proves nothing, so it stays open until the GPU is busy again or retrains).
    Utilisation unknown (no NVML): the speed-under-load rule is off; width and AER rules still apply.
    AER errors come from the sysfs counters' deltas and from ras:aer_event records (note_aer_event);
    the kernel's AER handling bumps the counters and emits the event for the same error, so a device
    with counters is counted by them and its events only mark it; a device without, by its events."""

    def __init__(self, busy_util_pct: float = 10.0, aer_window_s: float = 30.0, confirm_polls: int = 2):
        self.busy_util_pct = busy_util_pct
        self.aer_window_ns = int(aer_window_s * 1e9)
        self.confirm_polls = confirm_polls
        self._prev: dict[str, LinkState] = {}
        self._slow_polls: dict[str, int] = {}
        self._last_aer_ns: dict[str, int] = {}  # gpu bdf -> when AER last rose on its path
        self._open: dict[str, _Open] = {}
        self._next_id = 1
        self._aer_events: dict[str, dict[str, int]] = {}  # bdf -> {"correctable": n, "correctable.BadTLP": n}
        self.aer_events_off_path = 0  # AER events on devices on no GPU's path

    def note_aer_event(self, bdf: str, severity: str, errors: tuple[str, ...] = ()) -> None:
        """One ras:aer_event (pcie.AerRecord), judged with the next update() like a counter rise."""
        acc = self._aer_events.setdefault(bdf, {})
        for key in (severity, *(f"{severity}.{e}" for e in errors)):
            acc[key] = acc.get(key, 0) + 1

    def update(self, snap: PcieSnapshot, util_pct: Mapping[str, float | None]) -> list[LinkEpisode]:
        """util_pct: GPU bdf (sysfs spelling) -> NVML utilisation, None when unknown."""
        out = []
        for gpu, chain in snap.paths.items():
            out.extend(self._judge(snap, gpu, chain, util_pct.get(gpu)))
        on_path = {b for gpu, chain in snap.paths.items() for b in (gpu, *chain)}
        self.aer_events_off_path += sum(n for b, acc in self._aer_events.items() if b not in on_path
                                        for k, n in acc.items() if "." not in k)
        self._aer_events.clear()  # a bridge shared by several GPUs' paths counted for each of them
        self._prev.update(snap.links)
        return out

    def _ref(self, snap: PcieSnapshot, path: list[str], i: int) -> tuple[float | None, int | None]:
        # Both ends of a link report it, and it trains to the lower maximum. Which neighbour shares the
        # link depends on port types sysfs does not show, so both neighbours count: this can miss a
        # downtrain on a mixed-generation switch, and never flags a link that trained to its best.
        own = snap.links[path[i]]
        near = [snap.links[path[j]] for j in (i - 1, i + 1) if 0 <= j < len(path) and path[j] in snap.links]
        return (_min(own.max_speed_gts, *(n.max_speed_gts for n in near)),
                _min(own.max_width, *(n.max_width for n in near)))

    def _judge(self, snap, gpu, chain, util) -> list[LinkEpisode]:
        now = snap.t_ns
        busy = None if util is None else util >= self.busy_util_pct
        path = [gpu, *chain]
        aer_delta: dict[str, int] = {}
        aer_devs = []
        for bdf in path:
            cur, prev = snap.links.get(bdf), self._prev.get(bdf)
            if cur and prev and cur.aer and prev.aer:
                grew = False
                for k, v in cur.aer.flat().items():
                    d = v - prev.aer.flat().get(k, 0)
                    if d > 0:  # a decrease is a device reset: a new baseline, not errors
                        aer_delta[k] = aer_delta.get(k, 0) + d
                        grew = True
                if grew:
                    aer_devs.append(bdf)
            events = self._aer_events.get(bdf)
            if events:
                if bdf not in aer_devs:
                    aer_devs.append(bdf)
                if not (cur and prev and cur.aer and prev.aer):
                    for k, n in events.items():
                        aer_delta[k] = aer_delta.get(k, 0) + n
        if aer_devs:
            self._last_aer_ns[gpu] = now
        recent_aer = gpu in self._last_aer_ns and now - self._last_aer_ns[gpu] <= self.aer_window_ns

        causes: dict[str, None] = {}
        worst = None  # (bdf, from_state)
        all_at_ref = True
        for i, bdf in enumerate(path):
            cur, prev = snap.links.get(bdf), self._prev.get(bdf)
            if cur is None:
                continue
            if not cur.present:
                causes["device_gone"] = None
                worst = worst or (bdf, (prev.speed_gts, prev.width) if prev else (None, None))
                all_at_ref = False
                continue
            ref_speed, ref_width = self._ref(snap, path, i)
            narrow = cur.width is not None and ref_width is not None and cur.width < ref_width
            slow = cur.speed_gts is not None and ref_speed is not None and cur.speed_gts < ref_speed
            if narrow or slow:
                all_at_ref = False
            dropped = prev is not None and prev.present and (
                (cur.speed_gts or 0) < (prev.speed_gts or 0) or (cur.width or 0) < (prev.width or 0))
            self._slow_polls[bdf] = self._slow_polls.get(bdf, 0) + 1 if slow and busy else 0
            found = []
            if narrow:
                found.append("width_drop")
            if slow and busy and self._slow_polls[bdf] >= self.confirm_polls:
                found.append("speed_under_load")
            if dropped and recent_aer:
                found.append("drop_after_aer")
            if found:
                causes.update(dict.fromkeys(found))
                if worst is None:
                    before = (prev.speed_gts, prev.width) if dropped else (ref_speed, ref_width)
                    worst = (bdf, before)

        ep = self._open.get(gpu)
        if aer_devs:
            causes = {"aer_errors": None, **causes}
        if ep is None and not causes:
            return []
        gpu_state = snap.links.get(gpu)
        if ep is None:
            link_bdf, before = worst or (gpu, (gpu_state.speed_gts, gpu_state.width) if gpu_state else (None, None))
            ep = self._open[gpu] = _Open(self._next_id, now, link_bdf, {}, before, {}, {})
            self._next_id += 1
            event = "opened"
        else:
            event = "updated"
            if worst is not None and not ep.degraded_seen:
                ep.link_bdf, ep.from_state = worst  # an AER-only episode that now has its drop
        ep.degraded_seen = ep.degraded_seen or worst is not None
        changed = event == "opened" or any(c not in ep.causes for c in causes) or bool(aer_devs)
        ep.causes.update(causes)
        for k, v in aer_delta.items():
            ep.aer_delta[k] = ep.aer_delta.get(k, 0) + v
        ep.aer_devices.update(dict.fromkeys(aer_devs))

        closing = not causes and not recent_aer and (all_at_ref or not ep.degraded_seen)
        if closing:
            event = "closed"
        rec = self._record(ep, event, gpu, snap, now, busy, end_ns=now if closing else None)
        if closing:
            del self._open[gpu]
            return [rec]
        if not changed and ep.last is not None and (rec.to_gen, rec.to_width) == (ep.last.to_gen, ep.last.to_width):
            return []
        ep.last = rec
        return [rec]

    def _record(self, ep: _Open, event, gpu, snap, now, busy, end_ns) -> LinkEpisode:
        cur = snap.links.get(ep.link_bdf)
        path = [gpu, *snap.paths.get(gpu, ())]
        i = path.index(ep.link_bdf) if ep.link_bdf in path else 0
        ref_speed, ref_width = self._ref(snap, path, i) if cur is not None and cur.present else (None, None)
        return LinkEpisode(
            event=event, episode_id=ep.episode_id, gpu_bdf=gpu, link_bdf=ep.link_bdf, causes=tuple(ep.causes),
            from_gen=gen_of(ep.from_state[0]), from_width=ep.from_state[1],
            to_gen=cur.gen if cur else None, to_width=cur.width if cur else None,
            ref_gen=gen_of(ref_speed), ref_width=ref_width,
            aer_delta=tuple(sorted(ep.aer_delta.items())), aer_devices=tuple(ep.aer_devices),
            start_ns=ep.start_ns, end_ns=end_ns, t_ns=now, busy=busy,
        )

    def open_episodes(self) -> list[int]:
        return [ep.episode_id for ep in self._open.values()]


# --- tracepoint formats and records --------------------------------------------------------------


@dataclass(frozen=True)
class TpField:
    name: str
    ctype: str
    offset: int
    size: int
    signed: bool
    data_loc: bool  # __data_loc: u32 (offset | length << 16) pointing into the record


@dataclass(frozen=True)
class TracepointFormat:
    name: str
    id: int | None
    fields: tuple[TpField, ...]

    def field(self, name: str) -> TpField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}")


@dataclass(frozen=True)
class Unavailable:
    name: str
    reason: str


_FIELD = re.compile(r"field:(?P<decl>[^;]+);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);\s*signed:(?P<signed>\d+);")


def parse_format(text: str) -> TracepointFormat:
    """A tracefs events/<group>/<event>/format file -> TracepointFormat."""
    name = re.search(r"^name:\s*(\S+)", text, re.M)
    tp_id = re.search(r"^ID:\s*(\d+)", text, re.M)
    fields = []
    for m in _FIELD.finditer(text):
        decl = m["decl"].strip()
        data_loc = decl.startswith("__data_loc")
        last = decl.split()[-1]  # "dev", "tlp_header[4]"
        fname = re.sub(r"\[.*?\]$", "", last)
        ctype = decl.rsplit(None, 1)[0].replace("__data_loc", "").strip() + last[len(fname):]
        fields.append(TpField(fname, ctype, int(m["off"]), int(m["size"]), m["signed"] == "1", data_loc))
    if not fields:
        raise ValueError("no fields in tracepoint format")
    return TracepointFormat(name[1] if name else "?", int(tp_id[1]) if tp_id else None, tuple(fields))


LINK_EVENTS = ("ras/aer_event", "pci/pcie_link_event", "nvidia/nvidia_dev_xid")
MISSING_WHY = {
    "ras/aer_event": "kernel has no ras:aer_event (needs CONFIG_PCIEAER with the PCIe port driver)",
    "pci/pcie_link_event": "kernel has no pci:pcie_link_event (a newer kernel's tracepoint)",
    "nvidia/nvidia_dev_xid": "no nvidia:nvidia_dev_xid (NVIDIA driver module not loaded, or a driver without it)",
}


def load_formats(tracefs_root: str = "/sys/kernel/tracing",
                 names=LINK_EVENTS) -> dict[str, TracepointFormat | Unavailable]:
    """Each event's parsed format, or Unavailable with the reason (tracefs not mounted, event absent)."""
    out = {}
    events = os.path.join(tracefs_root, "events")
    for name in names:
        path = os.path.join(events, name, "format")
        if not os.path.isdir(events):
            out[name] = Unavailable(name, f"tracefs not mounted at {tracefs_root}")
            continue
        try:
            with open(path) as f:
                out[name] = parse_format(f.read())
        except FileNotFoundError:
            out[name] = Unavailable(name, MISSING_WHY.get(name, "event absent"))
        except (OSError, ValueError) as e:
            out[name] = Unavailable(name, f"{path}: {e}")
    return out


class RecordError(ValueError):
    """A tracepoint record that does not fit its format (counted and skipped by the caller)."""


_INTS = {(1, False): "B", (1, True): "b", (2, False): "H", (2, True): "h", (4, False): "I", (4, True): "i",
         (8, False): "Q", (8, True): "q"}


# A record's __data_loc data lies past its fixed fields, within the perf trace buffer it was built in
# (PERF_MAX_TRACE_SIZE, include/linux/trace_events.h): anything else is not a record of this format.
PERF_MAX_TRACE_SIZE = 8192


def decode_captured(raw: bytes, fmt: TracepointFormat,
                    captured: bool = False) -> tuple[dict[str, int | str | bytes], tuple[str, ...]]:
    """decode_record, and which __data_loc fields were cut. captured: raw is a fixed-size copy of the
    record's first bytes (bpf/health.bpf.c), not the whole record, so a __data_loc running past its end
    is clamped to what was copied instead of rejected (an Xid message longer than the copy keeps its
    start); its offset and length must still be plausible for a record of this format."""
    out: dict[str, int | str | bytes] = {}
    cut = []
    fixed_end = max(f.offset + f.size for f in fmt.fields)
    for f in fmt.fields:
        if f.offset + f.size > len(raw):
            raise RecordError(f"{fmt.name}: record of {len(raw)} bytes ends before {f.name}")
        if f.data_loc:
            (loc,) = struct.unpack_from("<I", raw, f.offset)
            off, length = loc & 0xFFFF, loc >> 16
            if off < fixed_end:
                raise RecordError(f"{fmt.name}.{f.name}: __data_loc offset {off} inside the fixed fields")
            if off + length > len(raw):
                if not captured or off + length > PERF_MAX_TRACE_SIZE:
                    raise RecordError(f"{fmt.name}.{f.name}: __data_loc {off}+{length} past the record's "
                                      f"{len(raw)} bytes")
                cut.append(f.name)
            data = raw[off:off + length]
            out[f.name] = data.split(b"\0", 1)[0].decode("utf-8", "replace") if "char" in f.ctype else data
        elif (f.size, f.signed) in _INTS and "[" not in f.ctype:
            (out[f.name],) = struct.unpack_from("<" + _INTS[(f.size, f.signed)], raw, f.offset)
        else:
            data = raw[f.offset:f.offset + f.size]
            out[f.name] = data.split(b"\0", 1)[0].decode("utf-8", "replace") if "char" in f.ctype else data
    return out, tuple(cut)


def decode_record(raw: bytes, fmt: TracepointFormat) -> dict[str, int | str | bytes]:
    """Every field of a raw tracepoint record: integers, __data_loc and char[N] strings (up to the
    first NUL, UTF-8 with replacement), other arrays as bytes. Host (little-endian) byte order."""
    return decode_captured(raw, fmt)[0]


_XID_TASK = re.compile(r"^pid=(\d+), name=([^,]*), ")


@dataclass(frozen=True)
class XidRecord:
    dev: str  # PCI address as the driver writes it ("0000:00:06.0")
    error_code: int  # the Xid
    msg: str
    pid: int  # common_pid: the task that ran the tracepoint (often the driver's irq thread)
    truncated: bool = False  # msg was cut at the end of the BPF copy

    @property
    def process(self) -> tuple[int, str] | None:
        """The faulting process (pid, name) where msg names it. The kernel log's line for an MMU
        fault starts "pid=574, name=python3, channel ..."; driver 580's tracepoint msg left that part
        out (tests/fixtures/gpu/xid.json), so this is None there."""
        m = _XID_TASK.match(self.msg)
        return (int(m[1]), m[2]) if m else None


# The layout recorded on the H200 host (driver 580.159.04), the default when no format file is at hand.
NVIDIA_DEV_XID_FORMAT = TracepointFormat("nvidia_dev_xid", None, (
    TpField("common_type", "unsigned short", 0, 2, False, False),
    TpField("common_flags", "unsigned char", 2, 1, False, False),
    TpField("common_preempt_count", "unsigned char", 3, 1, False, False),
    TpField("common_pid", "int", 4, 4, True, False),
    TpField("dev", "char[]", 8, 4, False, True),
    TpField("error_code", "u32", 12, 4, False, False),
    TpField("msg", "char[]", 16, 4, False, True),
))


def decode_xid(raw: bytes, fmt: TracepointFormat = NVIDIA_DEV_XID_FORMAT, captured: bool = False) -> XidRecord:
    """A raw nvidia:nvidia_dev_xid record -> XidRecord. Pure."""
    rec, cut = decode_captured(raw, fmt, captured)
    try:
        return XidRecord(str(rec["dev"]), int(rec["error_code"]), str(rec["msg"]), int(rec.get("common_pid", 0)),
                         truncated="msg" in cut or "dev" in cut)
    except (KeyError, ValueError, TypeError) as e:
        raise RecordError(f"{fmt.name}: field {e} missing or not a number") from None


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
        return {"mcp.pcie.port": self.port, "mcp.pcie.reason": self.reason, "mcp.pcie.to_gen": gen_of(self.speed_gts),
                "mcp.pcie.to_width": self.width or None, "mcp.pcie.link_status": f"0x{self.link_status:x}"}


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


def iter_trace_page(page: bytes, data_offset: int = 16) -> Iterator[tuple[int, bytes]]:
    """(timestamp ns, record) for each event on one tracefs ring-buffer page (per_cpu/cpuN/trace_pipe_raw),
    as laid out by kernel/trace/ring_buffer.c: u64 time stamp, local_t commit (bytes used; the top bits
    are flags), then events with a u32 header: type_len:5, time_delta:27. type_len 1..28: data of
    type_len*4 bytes follows; 0: array[0] holds the length (itself included); 29 padding; 30 time
    extend (delta = array[0] << 27 | time_delta); 31 absolute time stamp. The time stamps are in the
    buffer's trace_clock ("local" by default, not CLOCK_MONOTONIC: set trace_clock to "mono" to join them)."""
    ts, commit = struct.unpack_from("<QQ", page, 0)
    end = data_offset + (commit & 0xFFFFF)
    off = data_offset
    while off + 4 <= min(end, len(page)):
        (hdr,) = struct.unpack_from("<I", page, off)
        type_len, delta = hdr & 0x1F, hdr >> 5
        if type_len == 29:  # padding: a zero delta means the rest of the page
            if delta == 0:
                return
            (length,) = struct.unpack_from("<I", page, off + 4)
            off += 4 + length
            continue
        if type_len == 30:
            (hi,) = struct.unpack_from("<I", page, off + 4)
            ts += (hi << 27) | delta
            off += 8
            continue
        if type_len == 31:
            (hi,) = struct.unpack_from("<I", page, off + 4)
            ts = (ts & ~((1 << 59) - 1)) | (hi << 27) | delta
            off += 8
            continue
        ts += delta
        if type_len == 0:
            (length,) = struct.unpack_from("<I", page, off + 4)
            yield ts, bytes(page[off + 8:off + 4 + length])
            off += 4 + length
        else:
            yield ts, bytes(page[off + 4:off + 4 + type_len * 4])
            off += 4 + type_len * 4
