"""The NIC capability's pure rules, no namespace or root needed: diff_states (which link events a new
RTM_NEWLINK state makes) and the flap window (NIC_FLAP_WINDOW_S, NIC_FLAPPING), the window driven
through NicWatcher's message handling with stand-in rtnetlink messages and a fake clock."""

from __future__ import annotations

import pytest

from mcp_hostagent.nic.netlink import (
    IFF_LOWER_UP, IFF_UP, NIC_FLAP_WINDOW_S, NIC_FLAPPING, NicState, NicWatcher, diff_states,
)

S = 10**9


def st(admin=True, carrier=True, oper="UP", speed=100000, name="e", index=1):
    return NicState(name, index, admin, carrier, oper, speed)


@pytest.mark.parametrize("prev, cur, kinds", [
    # the first state of an interface is a baseline, not an event
    (None, st(), []),
    (None, st(admin=False, carrier=False, oper="DOWN", speed=None), []),
    # nothing changed
    (st(speed=1), st(speed=1), []),
    # carrier
    (st(), st(carrier=False, oper="DOWN", speed=None), ["carrier_down"]),
    (st(carrier=False, oper="DOWN", speed=None), st(), ["carrier_up"]),
    # admin first, then carrier
    (st(), st(admin=False, carrier=False, oper="DOWN", speed=None), ["admin_down", "carrier_down"]),
    (st(admin=False, carrier=False, oper="DOWN", speed=None), st(), ["admin_up", "carrier_up"]),
    (st(admin=False, carrier=False, oper="DOWN", speed=None), st(carrier=False, oper="DOWN", speed=None),
     ["admin_up"]),
    # operstate alone is reported; with an admin or carrier change it is implied, not repeated
    (st(oper="UNKNOWN", speed=1), st(speed=1), ["operstate"]),
    (st(oper="UP"), st(oper="DORMANT"), ["operstate"]),
    (st(admin=False, oper="DOWN"), st(admin=True, oper="UP"), ["admin_up"]),
    # speed: only between two readings with the carrier up on both
    (st(speed=200000), st(speed=100000), ["speed_change"]),
    (st(speed=None), st(speed=25000), ["speed_change"]),
    (st(carrier=False, oper="DOWN", speed=None), st(speed=100000), ["carrier_up"]),
    (st(speed=100000), st(carrier=False, oper="DOWN", speed=None), ["carrier_down"]),
    (st(carrier=False, speed=1), st(carrier=False, speed=2), []),
    (st(oper="UNKNOWN", speed=200000), st(speed=100000), ["operstate", "speed_change"]),
    # the name or index is not a change of state
    (st(name="a", index=1), st(name="b", index=2), []),
])
def test_diff_states(prev, cur, kinds):
    assert diff_states(prev, cur) == kinds


class Msg(dict):
    """What NicWatcher reads of a pyroute2 ifinfmsg: msg["flags"], msg["index"], msg.get("event"), get_attr()."""

    def __init__(self, event, index, ifname, flags, operstate):
        super().__init__(event=event, index=index, flags=flags)
        self.attrs = {"IFLA_IFNAME": ifname, "IFLA_OPERSTATE": operstate}

    def get_attr(self, name):
        return self.attrs.get(name)


def link(carrier: bool, ifname="eth0", index=2):
    return Msg("RTM_NEWLINK", index, ifname, IFF_UP | (IFF_LOWER_UP if carrier else 0),
               "UP" if carrier else "DOWN")


def test_flap_rule_constants():
    assert (NIC_FLAP_WINDOW_S, NIC_FLAPPING) == (60.0, 3)
    assert NicWatcher().flap_window_ns == 60 * S


def test_flaps_counted_within_the_window(tmp_path):
    now = [0]
    w = NicWatcher(sysfs_root=str(tmp_path), clock=lambda: now[0])
    w._handle(link(True))  # the baseline
    assert w.drain() == []
    for i in range(NIC_FLAPPING):  # down at 10 s, 20 s, 30 s; back 1 s later each time
        now[0] = (10 * i + 10) * S
        w._handle(link(False))
        now[0] += S
        w._handle(link(True))
    evs = w.drain()
    assert [(e.kind, e.t_ns, e.flaps_in_window) for e in evs] == [
        ("carrier_down", 10 * S, 0), ("carrier_up", 11 * S, 1),
        ("carrier_down", 20 * S, 1), ("carrier_up", 21 * S, 2),
        ("carrier_down", 30 * S, 2), ("carrier_up", 31 * S, 3),
    ]
    # the window's edge is inclusive: the first comeback (11 s) counts until 71 s, not after
    assert w.flap_count("eth0", 71 * S) == 3
    assert w.flap_count("eth0", 71 * S + 1) == 2
    assert w.flap_count("eth0", 91 * S + 1) == 0
    assert w.flap_count("other", 11 * S) == 0


def test_a_first_carrier_up_is_not_a_flap(tmp_path):
    now = [5 * S]
    w = NicWatcher(sysfs_root=str(tmp_path), clock=lambda: now[0])
    w._handle(link(False))  # seen first with the carrier down: no loss was seen
    w._handle(link(True))
    (ev,) = w.drain()
    assert (ev.kind, ev.flaps_in_window) == ("carrier_up", 0)
    assert w.flap_count("eth0") == 0


def test_a_custom_window(tmp_path):
    now = [0]
    w = NicWatcher(sysfs_root=str(tmp_path), flap_window_s=5, clock=lambda: now[0])
    w._handle(link(True))
    now[0] = S
    w._handle(link(False))
    now[0] = 2 * S
    w._handle(link(True))
    assert (w.flap_count("eth0", 7 * S), w.flap_count("eth0", 7 * S + 1)) == (1, 0)
