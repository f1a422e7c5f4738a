"""The NIC capability's part of `top`'s snapshot: each interface as the netlink watcher last saw it,
and findings from its link events (carrier down and up, flapping, speed changes)."""

from __future__ import annotations

from collections import deque

from ..core.identity import sanitize_text
from ..telemetry.snapshot import NicView, Section, Tick, finding
from .netlink import NIC_FLAP_WINDOW_S, NIC_FLAPPING

MAX_NICS = 256  # interfaces listed in a snapshot (a node with many pods has a veth per pod)


class NicSection(Section):
    def __init__(self, nic):
        """nic: the capability (its watcher `nics`, drained `nic_events`, `sources`)."""
        self.nic = nic
        self._last = None  # the newest netlink.LinkEvent taken from nic_events
        self._down: dict[str, int] = {}  # interface -> wall ns its carrier went away
        self._flaps: dict[str, deque] = {}  # interface -> monotonic ns of carrier comebacks
        self._pending: list = []

    def host(self, tick: Tick) -> dict:
        self._events(tick)
        src = getattr(self.nic, "sources", {}).get("nic_netlink")
        if src is None or src.state == "attached":
            state = "ok"
        else:
            state = sanitize_text(f"{src.state}: {src.reason}", 160)
        return {"nics": self._nics(tick.now_ns), "nic": state}

    def findings(self, tick: Tick) -> list:
        out, self._pending = self._pending, []
        return out

    def _events(self, tick: Tick) -> None:
        """Findings from the LinkEvents the NIC capability drained since the last tick (a bounded deque, fed on
        this thread: the ones after the newest seen are new; all of them when that one has left)."""
        events = list(getattr(self.nic, "nic_events", ()) or ())
        new = []
        for ev in reversed(events):
            if ev is self._last:
                break
            new.append(ev)
        if events:
            self._last = events[-1]
        set_down = set()
        for ev in reversed(new):
            name = sanitize_text(ev.ifname, 64)
            t = tick.to_wall(ev.t_ns)
            if ev.kind == "admin_down":
                set_down.add((ev.ifname, ev.t_ns))  # one message: said with its carrier_down
            elif ev.kind == "carrier_down":
                self._down[name] = t
                how = " (set down)" if (ev.ifname, ev.t_ns) in set_down else ""
                self._pending.append(finding(t, "nic_carrier_down", name,
                                             f"NIC {name} carrier down{how}, operstate {ev.operstate or '?'}"))
            elif ev.kind == "carrier_up":
                down_at = self._down.pop(name, None)
                if not ev.flaps_in_window and down_at is None:
                    continue  # a new interface coming up (a pod's veth), not a link coming back
                self._flaps.setdefault(name, deque(maxlen=64)).append(ev.t_ns)
                n = ev.flaps_in_window or 1
                speed = f" at {ev.speed_mbps} Mb/s" if ev.speed_mbps else ""
                after = f" after {max(0, t - down_at) / 1e9:.1f}s" if down_at is not None else ""
                text = (f"carrier up{speed}{after}; {n} flap{'s' if n > 1 else ''} in "
                        f"{NIC_FLAP_WINDOW_S:.0f}s")
                if n >= NIC_FLAPPING:
                    self._pending.append(finding(t, "nic_flapping", name, f"NIC {name} flapping: {text}"))
                else:
                    self._pending.append(finding(t, "nic_carrier_up", name, f"NIC {name} {text}"))
            elif ev.kind == "speed_change":
                lower = (ev.speed_mbps or 0) < (ev.prev_speed_mbps or 0)
                self._pending.append(finding(t, "nic_speed_down" if lower else "nic_speed_up", name,
                                             f"NIC {name} speed {ev.prev_speed_mbps or '?'} -> {ev.speed_mbps or '?'} Mb/s"))
            elif ev.kind == "removed":
                self._down.pop(name, None)
                self._flaps.pop(name, None)

    def _nics(self, now: int) -> tuple[NicView, ...]:
        watcher = getattr(self.nic, "nics", None)
        if watcher is None:
            return ()
        out = []
        for st in sorted(watcher.links().values(), key=lambda x: x.ifname)[:MAX_NICS]:
            name = sanitize_text(st.ifname, 64)
            q = self._flaps.get(name, ())
            flaps = sum(1 for t in q if now - t <= NIC_FLAP_WINDOW_S * 1e9)
            out.append(NicView(name=name, admin_up=st.admin_up, carrier=st.carrier,
                               operstate=sanitize_text(st.operstate, 16), speed_mbps=st.speed_mbps, flaps=flaps,
                               down_since_wall_ns=self._down.get(name) if not st.carrier else None))
        return tuple(out)
