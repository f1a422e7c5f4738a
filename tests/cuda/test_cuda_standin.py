"""The governor's calibration target (issue 11): a stand-in the agent writes itself, never a library
found in another process. Its first instruction copies the real libcuda's (the uprobe's cost depends
on whether the kernel can emulate or must single-step it); the recorded bytes are the H200's
libcuda 580.159.04 (tests/fixtures/cuda/h200_calibration_result.json)."""

from __future__ import annotations

import json
import os

import pytest

from mcp_hostagent.cuda import calibrate

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "cuda", "h200_calibration_result.json")


def _recorded() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.mark.parametrize("symbol, row", sorted(_recorded()["first_bytes"].items()))
def test_standin_copies_the_h200_libcuda_first_instruction(symbol, row):
    code, insn = calibrate.standin_code(bytes.fromhex(row["hex"]))
    assert insn == row["standin"] == "55"  # push %rbp
    assert code == b"\x55\x5d\x31\xc0\xc3"  # push %rbp; pop %rbp; xor %eax,%eax; ret


def _first_bytes_of_every_prologue() -> list[bytes]:
    out = []
    for pre, insn, _undo in calibrate._PROLOGUES:
        out.append(pre + b"\x08" + bytes(16) if insn is None else pre + bytes(16))
    return out


@pytest.mark.parametrize("first", _first_bytes_of_every_prologue(), ids=lambda b: b[:7].hex())
def test_every_standin_runs_and_returns(first):
    """Executed for real (memfd, mapped R|X): each prologue's copy is undone and the call returns 0,
    the stack intact (a wrong undo would crash this process)."""
    code, insn = calibrate.standin_code(first)
    assert not insn.startswith("not recognised"), insn
    st = calibrate.Standin(code)
    try:
        assert [st.fn(i) for i in range(3)] == [0, 0, 0]
    finally:
        st.close()


def test_an_unknown_first_instruction_is_said_and_still_safe():
    code, insn = calibrate.standin_code(bytes.fromhex("c5f877") + bytes(13))  # vzeroupper: not in the table
    assert insn == "not recognised (c5f8770000000000): endbr64 in its place"
    st = calibrate.Standin(code)
    try:
        assert st.fn(7) == 0
    finally:
        st.close()
