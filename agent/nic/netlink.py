"""NIC link events (carrier, operstate, speed, flaps) from rtnetlink, for multi-node inference hosts.

Source: an rtnetlink socket bound to RTMGRP_LINK (pyroute2's IPRSocket: unbuffered, so select() on it
is truthful; IPRoute's get() buffers several messages behind one wake-up and blocks stop()). One thread
waits on the socket and a wake-up pipe, so stop() returns at once. Link speed is read from
/sys/class/net/<if>/speed (root overridable) in the agent's own namespace, and through the ethtool
ioctl on a socket of the watched namespace otherwise: sysfs shows the namespace it was mounted in.

Kernel facts relied on: the kernel sends RTM_NEWLINK to RTMGRP_LINK on every change of flags, carrier
or operstate (carrier changes are batched by linkwatch, up to ~1 s late for non-urgent ones);
IFF_LOWER_UP (0x10000) / IFLA_CARRIER is the carrier; RTM_DELLINK when an interface goes away;
/sys/class/net/<if>/speed reads -1 or fails with EINVAL when the carrier is down or unknown.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

IFF_UP, IFF_LOWER_UP = 0x1, 0x10000
RTMGRP_LINK = 0x1
SIOCETHTOOL, ETHTOOL_GSET = 0x8946, 0x1
NETNS_RUN_DIR = "/var/run/netns"  # where `ip netns` and pyroute2 keep named namespaces

# A carrier that comes back after a loss is a flap, counted over this window (NicWatcher's default);
# this many in the window make the comeback a "flapping" finding in top.
NIC_FLAP_WINDOW_S = 60.0
NIC_FLAPPING = 3


@dataclass(frozen=True)
class NicState:
    ifname: str
    ifindex: int
    admin_up: bool
    carrier: bool
    operstate: str  # UP, DOWN, LOWERLAYERDOWN, UNKNOWN, DORMANT, NOTPRESENT, TESTING
    speed_mbps: int | None


@dataclass(frozen=True)
class LinkEvent:
    """kind: carrier_down | carrier_up | admin_down | admin_up | operstate | speed_change | removed."""

    t_ns: int  # CLOCK_MONOTONIC when the agent read the message
    ifname: str
    ifindex: int
    kind: str
    carrier: bool | None
    operstate: str | None
    speed_mbps: int | None
    prev_speed_mbps: int | None
    flaps_in_window: int  # carrier down->up cycles within flap_window_s, this one included

    def attributes(self) -> dict[str, object]:
        attrs = {"network.interface.name": self.ifname, "hostagent.nic.event": self.kind, "hostagent.nic.carrier": self.carrier,
                 "hostagent.nic.operstate": self.operstate, "hostagent.nic.speed_mbps": self.speed_mbps,
                 "hostagent.nic.prev_speed_mbps": self.prev_speed_mbps, "hostagent.nic.flaps_in_window": self.flaps_in_window}
        return {k: v for k, v in attrs.items() if v is not None}


def state_from_msg(msg) -> NicState | None:
    """An RTM_NEWLINK message (pyroute2 ifinfmsg) -> NicState without speed. Pure."""
    name = msg.get_attr("IFLA_IFNAME")
    if name is None:
        return None
    flags = msg["flags"]
    carrier = msg.get_attr("IFLA_CARRIER")
    return NicState(name, msg["index"], bool(flags & IFF_UP),
                    bool(carrier) if carrier is not None else bool(flags & IFF_LOWER_UP),
                    msg.get_attr("IFLA_OPERSTATE") or "UNKNOWN", None)


def diff_states(prev: NicState | None, cur: NicState) -> list[str]:
    """Event kinds between two states of one interface, in the order they matter. Pure."""
    if prev is None:
        return []
    kinds = []
    if prev.admin_up != cur.admin_up:
        kinds.append("admin_up" if cur.admin_up else "admin_down")
    if prev.carrier != cur.carrier:
        kinds.append("carrier_up" if cur.carrier else "carrier_down")
    if prev.operstate != cur.operstate and not kinds:
        kinds.append("operstate")
    if cur.speed_mbps != prev.speed_mbps and cur.carrier and prev.carrier:
        kinds.append("speed_change")
    return kinds


def sysfs_speed(ifname: str, sysfs_root: str = "/sys") -> int | None:
    try:
        with open(f"{sysfs_root}/class/net/{ifname}/speed") as f:
            v = int(f.read().strip())
    except (OSError, ValueError):  # EINVAL while the carrier is down; absent for virtual devices
        return None
    return v if v > 0 else None


def ethtool_speed(sock: socket.socket, ifname: str) -> int | None:
    """ETHTOOL_GSET through SIOCETHTOOL on sock; it answers for sock's network namespace.
    struct ethtool_cmd: u32 cmd, supported, advertising; u16 speed; ...; u16 speed_hi at offset 28."""
    buf = array.array("B", struct.pack("I", ETHTOOL_GSET) + bytes(40))
    addr, _ = buf.buffer_info()
    ifreq = struct.pack("16sP16x", ifname.encode()[:15], addr)  # struct ifreq is 40 bytes
    try:
        fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)
    except OSError:
        return None
    raw = bytes(buf)
    speed = struct.unpack_from("H", raw, 12)[0] | struct.unpack_from("H", raw, 28)[0] << 16
    return None if speed in (0, 0xFFFF, 0xFFFFFFFF) else speed


class NicWatcher:
    """Watches every interface of a network namespace (the agent's own by default). Events are kept in a
    bounded queue (drain()) and passed to on_event from the watcher thread; links() is a snapshot."""

    def __init__(self, *, netns: str | None = None, sysfs_root: str = "/sys",
                 flap_window_s: float = NIC_FLAP_WINDOW_S, max_events: int = 4096,
                 on_event: Callable[[LinkEvent], None] | None = None,
                 ignore: Callable[[str], bool] = lambda name: name == "lo", clock=time.monotonic_ns):
        self.netns = netns
        self.sysfs_root = sysfs_root
        self.flap_window_ns = int(flap_window_s * 1e9)
        self.on_event = on_event
        self.ignore = ignore
        self._clock = clock
        self._events: deque[LinkEvent] = deque(maxlen=max_events)
        self._states: dict[int, NicState] = {}
        self._downs: dict[str, deque[int]] = {}
        self._flaps: dict[str, deque[int]] = {}
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._ready = threading.Event()
        self._sock = None
        self._ioctl_sock: socket.socket | None = None
        self.state = "stopped"
        self.reason: str | None = None
        self.lost = 0  # ENOBUFS: the kernel dropped messages; states are re-read

    def start(self, timeout_s: float = 5.0) -> bool:
        """Open the socket and read the current links (in the thread, so the socket lives there);
        False with reason when rtnetlink or pyroute2 is not usable."""
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="mcp-netlink", daemon=True)
        self._thread.start()
        self._ready.wait(timeout_s)
        return self.state == "running"

    def stop(self, timeout_s: float = 1.0) -> bool:
        if self._thread is None:
            return True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout_s)
        alive = self._thread.is_alive()
        if not alive:
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._thread = None
        return not alive

    def drain(self) -> list[LinkEvent]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def links(self) -> dict[str, NicState]:
        return {s.ifname: s for s in list(self._states.values())}

    def flap_count(self, ifname: str, now_ns: int | None = None) -> int:
        q = self._flaps.get(ifname, deque())
        now_ns = self._clock() if now_ns is None else now_ns
        return sum(1 for t in q if now_ns - t <= self.flap_window_ns)

    # ---- the thread ----
    def _open(self) -> None:
        from pyroute2 import IPRSocket

        if self.netns and not os.path.exists(os.path.join(NETNS_RUN_DIR, self.netns)):
            raise FileNotFoundError(f"network namespace {self.netns!r} not found in {NETNS_RUN_DIR}")

        # flags=0: a namespace that does not exist is an error, not created (pyroute2 defaults to O_CREAT)
        self._sock = IPRSocket(netns=self.netns, flags=0) if self.netns else IPRSocket()
        self._sock.bind(groups=RTMGRP_LINK)
        if self.netns:
            from pyroute2 import netns as pr_netns

            self._ioctl_sock = pr_netns.create_socket(self.netns, socket.AF_INET, socket.SOCK_DGRAM, flags=0)
        # the dump comes after bind, so no change between the two is missed (at worst seen twice)
        with self._iproute() as ipr:
            self._seed(ipr.get_links())

    def _iproute(self):
        from pyroute2 import IPRoute

        return IPRoute(netns=self.netns, flags=0) if self.netns else IPRoute()

    def _seed(self, msgs) -> None:
        for msg in msgs:
            st = state_from_msg(msg)
            if st is not None and not self.ignore(st.ifname):
                self._states[st.ifindex] = self._with_speed(st)

    def _speed(self, ifname: str) -> int | None:
        if self._ioctl_sock is not None:
            return ethtool_speed(self._ioctl_sock, ifname)
        return sysfs_speed(ifname, self.sysfs_root)

    def _with_speed(self, st: NicState) -> NicState:
        speed = self._speed(st.ifname) if st.carrier else None
        return NicState(st.ifname, st.ifindex, st.admin_up, st.carrier, st.operstate, speed)

    def _run(self) -> None:
        try:
            self._open()
        except Exception as e:  # noqa: BLE001 - ImportError, EPERM, a namespace that is gone
            self.state, self.reason = "degraded", f"rtnetlink link watch unavailable: {e}"
            log.warning("%s", self.reason)
            self._ready.set()
            return
        self.state = "running"
        self._ready.set()
        sock = self._sock.socket
        try:
            while True:
                r, _, _ = select.select([sock, self._wake_r], [], [])
                if self._wake_r in r:
                    break
                try:
                    msgs = self._sock.get()
                except OSError as e:  # ENOBUFS: messages lost; re-read every link
                    self.lost += 1
                    log.warning("rtnetlink: %s; re-reading links", e)
                    with self._iproute() as ipr:
                        msgs = ipr.get_links()
                for msg in msgs:
                    self._handle(msg)
        finally:
            self._sock.close()
            if self._ioctl_sock is not None:
                self._ioctl_sock.close()
            self.state = "stopped"

    def _handle(self, msg) -> None:
        now = self._clock()
        event = msg.get("event")
        if event == "RTM_DELLINK":
            prev = self._states.pop(msg["index"], None)
            if prev is not None:
                self._emit(LinkEvent(now, prev.ifname, prev.ifindex, "removed", None, None, None, prev.speed_mbps,
                                     self.flap_count(prev.ifname, now)))
            return
        if event != "RTM_NEWLINK":
            return
        st = state_from_msg(msg)
        if st is None or self.ignore(st.ifname):
            return
        st = self._with_speed(st)
        prev = self._states.get(st.ifindex)
        self._states[st.ifindex] = st
        for kind in diff_states(prev, st):
            if kind == "carrier_down":
                self._downs.setdefault(st.ifname, deque(maxlen=256)).append(now)
            elif kind == "carrier_up" and self._downs.get(st.ifname):
                self._flaps.setdefault(st.ifname, deque(maxlen=256)).append(now)
            self._emit(LinkEvent(now, st.ifname, st.ifindex, kind, st.carrier, st.operstate, st.speed_mbps,
                                 prev.speed_mbps if prev else None, self.flap_count(st.ifname, now)))

    def _emit(self, ev: LinkEvent) -> None:
        self._events.append(ev)
        if self.on_event:
            try:
                self.on_event(ev)
            except Exception:  # noqa: BLE001 - a consumer's bug must not end the watch
                log.exception("NIC link event consumer failed")
