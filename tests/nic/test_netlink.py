"""Tests for mcp_hostagent.nic.netlink: real link flaps on a veth pair inside a network namespace made with
pyroute2 (needs root), watched from inside that namespace. The pure rules: test_nic_rules.py."""

from __future__ import annotations

import itertools
import os
import time

import pytest

from mcp_hostagent.nic.netlink import NicWatcher, sysfs_speed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
_seq = itertools.count()


@pytest.fixture
def veth_ns():
    """A fresh namespace holding veth pair vA <-> vB, both up; removed whatever happens."""
    from pyroute2 import NetNS, netns

    name = f"mcp-test-{os.getpid()}-{next(_seq)}"
    netns.create(name)
    try:
        with NetNS(name, flags=0) as ipr:
            ipr.link("add", ifname="vA", kind="veth", peer="vB")
            for ifname in ("vA", "vB"):
                ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], state="up")
        yield name
    finally:
        netns.remove(name)
    assert name not in netns.listnetns()


def set_state(ns: str, ifname: str, state: str):
    from pyroute2 import NetNS

    with NetNS(ns, flags=0) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], state=state)


def wait_events(w: NicWatcher, pred, timeout=5.0):
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += w.drain()
        if pred(got):
            break
        time.sleep(0.02)
    return got


def carrier_up(w, ifname, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = w.links().get(ifname)
        if st and st.carrier and st.operstate == "UP":
            return True
        time.sleep(0.02)
    return False


def test_veth_down_and_up_in_a_namespace(veth_ns):
    w = NicWatcher(netns=veth_ns)
    assert w.start(), w.reason
    try:
        links = w.links()
        assert set(links) == {"vA", "vB"}  # lo is ignored
        assert carrier_up(w, "vA") and carrier_up(w, "vB")
        w.drain()  # link-up events of the setup, if they came after the dump
        assert w.links()["vA"].speed_mbps == 10000  # veth reports 10 Gb/s through ethtool

        set_state(veth_ns, "vA", "down")
        down = wait_events(w, lambda evs: any(e.ifname == "vB" and e.kind == "carrier_down" for e in evs))
        set_state(veth_ns, "vA", "up")
        both_up = {("vA", "carrier_up"), ("vB", "carrier_up")}
        up = wait_events(w, lambda evs: both_up <= {(e.ifname, e.kind) for e in evs})
    finally:
        t = time.monotonic()
        assert w.stop()
        assert time.monotonic() - t < 0.5

    kinds = [(e.ifname, e.kind) for e in down]
    assert ("vA", "admin_down") in kinds and ("vA", "carrier_down") in kinds
    assert ("vB", "carrier_down") in kinds  # the peer loses its carrier, stays admin up
    a_down = next(e for e in down if e.ifname == "vA" and e.kind == "carrier_down")
    assert a_down.carrier is False and a_down.operstate == "DOWN" and a_down.prev_speed_mbps == 10000
    b_down = next(e for e in down if e.ifname == "vB")
    assert b_down.operstate == "LOWERLAYERDOWN"

    kinds = [(e.ifname, e.kind) for e in up]
    assert ("vA", "admin_up") in kinds and ("vA", "carrier_up") in kinds
    a_up = next(e for e in up if e.ifname == "vA" and e.kind == "carrier_up")
    assert a_up.carrier is True and a_up.speed_mbps == 10000 and a_up.flaps_in_window == 1
    assert a_up.attributes()["network.interface.name"] == "vA"
    assert all(e.ifindex == w.links()["vA"].ifindex for e in down + up if e.ifname == "vA")


def test_flaps_are_counted_within_the_window(veth_ns):
    w = NicWatcher(netns=veth_ns, flap_window_s=60)
    assert w.start(), w.reason
    try:
        assert carrier_up(w, "vA")
        for _ in range(3):
            set_state(veth_ns, "vA", "down")
            assert wait_events(w, lambda evs: any(e.ifname == "vA" and e.kind == "carrier_down" for e in evs))
            set_state(veth_ns, "vA", "up")
            assert wait_events(w, lambda evs: any(e.ifname == "vA" and e.kind == "carrier_up" for e in evs))
        assert w.flap_count("vA") == 3
        assert w.flap_count("vA", now_ns=time.monotonic_ns() + 61 * 10**9) == 0
    finally:
        assert w.stop()


def test_removed_interface(veth_ns):
    from pyroute2 import NetNS

    w = NicWatcher(netns=veth_ns)
    assert w.start(), w.reason
    try:
        with NetNS(veth_ns, flags=0) as ipr:
            ipr.link("del", index=ipr.link_lookup(ifname="vA")[0])  # takes its peer with it
        evs = wait_events(w, lambda evs: {("vA", "removed"), ("vB", "removed")} <= {(e.ifname, e.kind) for e in evs})
        assert {("vA", "removed"), ("vB", "removed")} <= {(e.ifname, e.kind) for e in evs}
        assert w.links() == {}
    finally:
        assert w.stop()


def test_missing_namespace_degrades_with_a_reason():
    from pyroute2 import netns

    w = NicWatcher(netns="mcp-test-no-such-ns")
    assert w.start() is False
    assert w.state == "degraded" and "not found" in w.reason
    assert "mcp-test-no-such-ns" not in netns.listnetns()  # not created as a side effect
    assert w.stop()


def test_host_namespace_watch_starts_and_stops():
    w = NicWatcher()
    assert w.start(), w.reason
    assert "lo" not in w.links()
    t = time.monotonic()
    assert w.stop() and time.monotonic() - t < 0.5


def test_sysfs_speed_reader(tmp_path):
    d = tmp_path / "class/net/eth9"
    d.mkdir(parents=True)
    (d / "speed").write_text("100000\n")
    assert sysfs_speed("eth9", str(tmp_path)) == 100000
    (d / "speed").write_text("-1\n")  # carrier down or unknown
    assert sysfs_speed("eth9", str(tmp_path)) is None
    assert sysfs_speed("nope", str(tmp_path)) is None
