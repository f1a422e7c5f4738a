"""The libcuda uprobe families' states (core/probes.py): a family whose symbols are found but that is
attached to no library inode never reads `attached`, in the probe table, `run`'s start-up summary, the
status line's count or the probe-state gauge; an armed one reads `armed`. No BPF: the states come
from the symbols' states, set here by hand (tests/cuda/test_bpf_probe_states.py does it for real)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcp_hostagent.core import probes as P
from mcp_hostagent.registry import UNIT
from mcp_hostagent.core.health import AgentHealth
from mcp_hostagent.cuda.finder import Library
from mcp_hostagent.cuda.symbols import DUTY_PROBE, SYMBOLS, UPROBE_ROWS, SymState, family_status


def sym(name: str, state: str, reason: str = "") -> SymState:
    (s,) = [s for s in SYMBOLS if s.name == name]
    return SymState(s, addr=0x1000, state=state, reason=reason)


@pytest.mark.parametrize("row,libs,attaching,weight,paused,state,detail", [
    ("cuda_sync", [], True, 1, False, P.WAITING, "no libcuda.so mapped now"),
    ("cuda_sync", [], False, 1, False, P.WAITING, "armed per library inode as processes map it"),
    # `mcp-agent probes` resolves symbols, attaches nothing
    ("cuda_sync", [[sym("cuStreamSynchronize", "found")]], False, 1, False, P.FOUND,
     "symbols found in 1 of 1 libcuda file(s); not attached"),
    ("cuda_sync", [[sym("cuStreamSynchronize", "attached")], [sym("cuStreamSynchronize", "missing", "x")]],
     True, 1, False, P.ARMED, "armed in 1 of 2 libcuda file(s); x"),
    ("cuda_launch", [[sym("cuLaunchKernel", "attached")]], True, 1, False, P.ARMED, "armed in 1 of 1"),
    ("cuda_launch", [[sym("cuLaunchKernel", "attached")]], True, 4, False, P.DUTY_CYCLED, "one slice in 4"),
    ("cuda_launch", [[sym("cuLaunchKernel", "attached")]], True, 4, True, P.PAUSED, "detached for now"),
    ("cuda_sync", [[sym("cuStreamSynchronize", "attached")]], True, 4, True, P.ARMED, "armed in 1 of 1"),
    ("cuda_sync", [[sym("cuStreamSynchronize", "missing", "cuStreamSynchronize not exported by f")]],
     True, 1, False, P.MISSING, "none armed; cuStreamSynchronize not exported by f"),
    ("cuda_sync", [[sym("cuStreamSynchronize", "alias", "same address as y")]], True, 1, False, P.MISSING, ""),
])
def test_family_status(row, libs, attaching, weight, paused, state, detail):
    got = family_status(row, libs, attaching, weight, paused)
    assert got[0] == state and detail in got[1], got
    assert got[0] != P.ATTACHED


class FakeBpf:
    """Enough of a bcc object for CudaProbes' constructor and its probe rows (no kernel)."""
    _mcp_uprobes = SimpleNamespace(mode="multi", mechanism="fake", attach=None, detach=None)


def cuda_probes(attaching: bool):
    from mcp_hostagent.cuda.probeset import CudaProbes

    plan = UNIT.plan(disabled=(), exists=lambda cat, ev: True)
    cp = CudaProbes(FakeBpf(), plan, attach_uprobes=attaching, governor=attaching)
    for row in UPROBE_ROWS:  # as start() leaves them
        plan.mark(row, P.WAITING, "")
    return cp, plan


def add_library(cp, state: str) -> None:
    lib_ = Library((8, 1, 1234), "/proc/self/fd/99", "/usr/lib/libcuda.so.1", pids={1})
    for s in SYMBOLS:
        lib_.syms[s.name] = SymState(s, addr=0x1000 + len(lib_.syms), state=state)
    cp.libs[lib_.key] = lib_


def rows(plan) -> dict[str, str]:
    return {r: plan.statuses[r].state for r in UPROBE_ROWS}


def table_states(plan) -> dict[str, str]:
    lines = P.render_table(plan).splitlines()
    return {ln.split()[0]: ln.split()[2] for ln in lines[1:]}


def test_found_but_not_armed_is_not_attached():
    """`mcp-agent probes`: a libcuda mapped now, its symbols resolved, no uprobe attached."""
    cp, plan = cuda_probes(attaching=False)
    cp._update_rows()
    assert set(rows(plan).values()) == {P.WAITING}
    add_library(cp, "found")
    cp._update_rows()
    assert set(rows(plan).values()) == {P.FOUND}, rows(plan)
    assert all(table_states(plan)[r] == P.FOUND for r in UPROBE_ROWS), P.render_table(plan)
    c = plan.counts()
    assert c[P.FOUND] == len(UPROBE_ROWS) and plan.live() == c[P.ATTACHED]
    assert f"libcuda uprobes {len(UPROBE_ROWS)} found" in plan.summary()


def test_waiting_then_armed_then_waiting_again():
    """`run`: waiting while no process maps libcuda, armed once a library's uprobes are attached, and
    waiting again once the library is gone; the status line's count follows."""
    cp, plan = cuda_probes(attaching=True)
    live0 = plan.live()
    assert plan.counts()[P.WAITING] == len(UPROBE_ROWS)
    assert f"; libcuda uprobes {len(UPROBE_ROWS)} waiting" in plan.summary()
    assert plan.summary().startswith(f"{plan.counts()[P.ATTACHED]} attached, 0 missing, 0 disabled")
    add_library(cp, "attached")
    cp._update_rows()
    assert set(rows(plan).values()) == {P.ARMED}, rows(plan)
    assert plan.statuses["cuda_sync"].reason == "armed in 1 of 1 libcuda file(s)"
    assert all(table_states(plan)[r] == P.ARMED for r in UPROBE_ROWS)
    assert plan.live() == live0 + len(UPROBE_ROWS)
    cp.weights = {f: 3 for f in cp.weights}  # the governor duty-cycles the launch probes
    cp._update_rows()
    assert plan.statuses[DUTY_PROBE].state == P.DUTY_CYCLED and plan.statuses["cuda_ctx"].state == P.ARMED
    assert plan.live() == live0 + len(UPROBE_ROWS)
    cp.paused = True
    cp._update_rows()
    assert plan.statuses[DUTY_PROBE].state == P.PAUSED and plan.live() == live0 + len(UPROBE_ROWS) - 1
    cp.libs.clear()  # every process mapping it exited
    cp._update_rows()
    assert set(rows(plan).values()) == {P.WAITING} and plan.live() == live0
    assert set(UPROBE_ROWS) <= {s.name for s in plan.enabled()}  # compiled, whatever their state


def test_probe_state_gauge_follows_the_families():
    """hostagent.agent.probes: the families' states as they change, not a copy taken at start-up."""
    from conftest import unstarted_agent

    cp, plan = cuda_probes(attaching=True)
    health = AgentHealth(probes={n: s.state for n, s in plan.statuses.items()})
    cap = unstarted_agent().caps["cuda"]
    cap.health, cap.probes = health, cp

    def gauge() -> dict[str, str]:
        (inst,) = [i for i in health.instruments(SimpleNamespace(snapshot=dict)) if i.name.endswith("agent.probes")]
        return {a[k]: a[k + ".state"] for _, a in inst.read() for k in a if k.endswith(".probe")}

    assert {gauge()[r] for r in UPROBE_ROWS} == {P.WAITING}
    add_library(cp, "attached")
    cp._update_rows()
    cap.tick()
    assert {gauge()[r] for r in UPROBE_ROWS} == {P.ARMED}
    assert P.ATTACHED not in {gauge()[r] for r in UPROBE_ROWS}
