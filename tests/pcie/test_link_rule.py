"""link_degraded, the downtraining rule on one reading (top's GPU row), as a table: width always,
speed only while busy (pcie.busy_util_pct, LINK_BUSY_UTIL_PCT by default), unknown values never
degraded. Expected strings are what top prints, written out here."""

from __future__ import annotations

import pytest

from mcp_hostagent.pcie.episodes import LINK_BUSY_UTIL_PCT, LinkJudge, link_degraded


def test_the_default_busy_threshold_is_shared():
    assert LINK_BUSY_UTIL_PCT == 10.0
    assert LinkJudge().busy_util_pct == 10.0


@pytest.mark.parametrize("gen, gen_max, width, width_max, util, want", [
    # at its maxima: never degraded, busy or not
    (5, 5, 16, 16, 100, None),
    (5, 5, 16, 16, 0, None),
    # narrower than the maximum: degraded whatever the load, utilisation unknown included
    (5, 5, 8, 16, 0, "width x8 < x16"),
    (5, 5, 8, 16, None, "width x8 < x16"),
    (5, 5, 1, 16, 100, "width x1 < x16"),
    (4, 4, 4, 8, 50, "width x4 < x8"),
    # width wins over speed: one reason, the width's
    (1, 5, 8, 16, 100, "width x8 < x16"),
    # wider than the stated maximum (the two sources disagree): not degraded
    (5, 5, 16, 8, 100, None),
    # slower than the maximum: power saving when idle, degraded when busy
    (1, 5, 16, 16, 0, None),
    (1, 5, 16, 16, 9.9, None),
    (1, 5, 16, 16, 10.0, "Gen1 < Gen5 at 10% util"),
    (1, 5, 16, 16, 10.4, "Gen1 < Gen5 at 10% util"),
    (4, 5, 16, 16, 80, "Gen4 < Gen5 at 80% util"),
    (3, 4, 16, 16, 99.6, "Gen3 < Gen4 at 100% util"),
    (5, 6, 16, 16, 100, "Gen5 < Gen6 at 100% util"),
    # utilisation unknown (no NVML): the speed rule is off
    (1, 5, 16, 16, None, None),
    # a value unknown (None) or unreadable (0): that part of the rule is off
    (None, 5, 16, 16, 100, None),
    (4, None, 16, 16, 100, None),
    (0, 5, 16, 16, 100, None),
    (5, 5, None, 16, 0, None),
    (5, 5, 8, None, 0, None),
    (5, 5, 0, 16, 0, None),
    (None, None, None, None, None, None),
])
def test_link_degraded_table(gen, gen_max, width, width_max, util, want):
    assert link_degraded(gen, gen_max, width, width_max, util) == want


@pytest.mark.parametrize("util, busy_util_pct, want", [
    (49.9, 50, None),
    (50, 50, "Gen4 < Gen5 at 50% util"),
    (0, 0, "Gen4 < Gen5 at 0% util"),  # a threshold of 0: any known utilisation is busy
    (None, 0, None),  # but unknown still is not
    (100, 100.5, None),
])
def test_link_degraded_busy_threshold_edge(util, busy_util_pct, want):
    assert link_degraded(4, 5, 16, 16, util, busy_util_pct) == want
