"""The PCIe downtraining rule: LinkJudge turns sysfs snapshots and GPU utilisation into link episodes
(opened, updated, closed); link_degraded is the same rule on a single reading, for top. Pure.

GPUs lower their link speed when idle to save power (Gen1 at idle is normal); the width stays. The
H200 VM recorded in tests/fixtures/gpu kept Gen5 x16 idle and busy (persistence mode, passthrough).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .sysfs import LinkState, PcieSnapshot, gen_of

# A link below its maximum speed counts as degraded only while the GPU is at least pcie.busy_util_pct
# busy: NVIDIA GPUs drop to Gen1 at idle on purpose. A narrower width than the maximum is degraded
# always. One default for top (link_degraded) and the spans (LinkJudge), so the two agree.
LINK_BUSY_UTIL_PCT = 10.0  # pcie.busy_util_pct's default


# The rule in two forms, which differ on purpose. link_degraded judges one reading, for top's GPU
# row: the reference is the maximum its caller gives (the GPU's own link: NVML's or sysfs's, the
# higher), and one busy reading below it counts. LinkJudge opens episodes, which become span events
# and metrics, so it must not flap: each link on the GPU's path is held to the lower maximum of its two
# ends (the link trains to that), speed under load counts only after confirm_polls busy polls in a row,
# and AER errors, drops after them and devices gone count too (top shows an open episode's causes
# instead of link_degraded's). Both share the busy test (utilisation >= busy_util_pct, unknown
# utilisation never busy) and the width-always rule.
def link_degraded(gen, gen_max, width, width_max, util_pct, busy_util_pct: float = LINK_BUSY_UTIL_PCT) -> str | None:
    """Why a link counts as degraded on one reading, or None (see LINK_BUSY_UTIL_PCT)."""
    if width and width_max and width < width_max:
        return f"width x{width} < x{width_max}"
    if gen and gen_max and gen < gen_max and util_pct is not None and util_pct >= busy_util_pct:
        return f"Gen{gen} < Gen{gen_max} at {util_pct:.0f}% util"
    return None


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
            "hostagent.pcie.episode_id": self.episode_id, "hostagent.pcie.gpu_bdf": self.gpu_bdf,
            "hostagent.pcie.link_bdf": self.link_bdf, "hostagent.pcie.causes": list(self.causes),
            "hostagent.pcie.from_gen": self.from_gen, "hostagent.pcie.from_width": self.from_width,
            "hostagent.pcie.to_gen": self.to_gen, "hostagent.pcie.to_width": self.to_width,
            "hostagent.pcie.ref_gen": self.ref_gen, "hostagent.pcie.ref_width": self.ref_width,
            "hostagent.pcie.aer_devices": list(self.aer_devices) or None,
        }
        attrs.update({f"hostagent.pcie.aer.{k}": v for k, v in self.aer_delta})
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

    def __init__(self, busy_util_pct: float = LINK_BUSY_UTIL_PCT, aer_window_s: float = 30.0,
                 confirm_polls: int = 2):
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
        """One ras:aer_event (records.AerRecord), judged with the next update() like a counter rise."""
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
