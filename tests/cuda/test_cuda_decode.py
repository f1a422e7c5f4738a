"""agent/cuda's pure parts: the GPU step record (steps.py), /proc/PID/maps parsing (finder.py), the
governor's weights (governor.py), the syscall layout check (ioctl.py), and the facts recorded on the
H200 host (tests/fixtures/cuda) that they rely on."""

from __future__ import annotations

import ctypes
import json
import os

import pytest

from mcp_hostagent.cuda import finder, governor, ioctl, steps, symbols
from mcp_hostagent.core import records as R
from mcp_hostagent.cuda import records as CU
from mcp_hostagent.core.decode import DecodeError

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "cuda")


def _step(**over) -> bytes:
    e = CU.EvGpuStep()
    e.h.type, e.h.size, e.h.tgid, e.h.tid, e.h.ts_ns = steps.EV_GPU_STEP, ctypes.sizeof(e), 10, 11, 5_000
    e.h.comm = b"python3"
    e.begin_ns, e.sync_ns, e.sync_kind = 1_000, 700, CU.C["MCP_CU_SYNC_CTX"]
    e.c.cu_launch_ex, e.c.cu_launch, e.c.cu_syncs, e.c.cu_sync_ns = 800, 3, 1, 700
    for k, v in over.items():
        setattr(e, k, v)
    return bytes(e)


def test_decode_step():
    s = steps.decode_step(_step())
    assert (s.hdr.tgid, s.hdr.tid, s.hdr.comm, s.begin_ns, s.hdr.ts_ns) == (10, 11, b"python3", 1_000, 5_000)
    assert s.sync_kind == "ctx" and s.sync_ns == 700 and s.launches == 803 and s.counters.cu_syncs == 1


@pytest.mark.parametrize("raw,reason", [(_step()[:40], "short"), (_step(sync_kind=9), "bad_field")])
def test_decode_step_rejects(raw, reason):
    with pytest.raises(DecodeError) as e:
        steps.decode_step(raw)
    assert e.value.reason == reason


def test_decode_step_rejects_other_types():
    raw = bytearray(_step())
    raw[0:2] = (2).to_bytes(2, "little")
    with pytest.raises(DecodeError):
        steps.decode_step(bytes(raw))


MAPS = """\
7f1a00000000-7f1a00200000 r--p 00000000 fe:10 42                         /usr/local/nvidia/lib64/libcuda.so.580.159.04
7f1a00200000-7f1a01200000 r-xp 00200000 fe:10 42                         /usr/local/nvidia/lib64/libcuda.so.580.159.04
7f1b00000000-7f1b00100000 r-xp 00000000 00:2f 1234                       /usr/lib/x86_64-linux-gnu/libcudart.so.12
7f1c00000000-7f1c00100000 r-xp 00000000 00:30 77                         /usr/lib/libcuda.so.1 (deleted)
7f1d00000000-7f1d00100000 r-xp 00000000 00:31 78                         /opt/libcuda.so.1.bak
"""


def test_libcuda_mappings():
    ms = finder.libcuda_mappings(MAPS)
    assert [(m.dev, m.inode, m.path, m.deleted) for m in ms] == [
        ((0xFE, 0x10), 42, "/usr/local/nvidia/lib64/libcuda.so.580.159.04", False),
        ((0x00, 0x30), 77, "/usr/lib/libcuda.so.1", True)]
    assert ms[0].start == "7f1a00000000-7f1a00200000"
    assert finder.libcuda_mappings("") == []


def test_plan_weights():
    c = 1324.0  # ns per hit, the H200's
    # 98k cuLaunchKernel/s (the H200 add_ loop): 13% attached -> 7 at a 2% budget; idle symbols stay exact
    w = governor.plan_weights({1: {"cu_launch": 98_000.0}}, c, 0.02)
    assert w == {"cu_launch": 7, "cu_launch_ptsz": 1, "cu_launch_ex": 1, "cu_launch_ex_ptsz": 1}
    # under budget: exact
    assert set(governor.plan_weights({1: {"cu_launch_ex": 8_000.0}}, c, 0.02).values()) == {1}
    # two busy symbols of one process share the weight; the busiest process decides
    w = governor.plan_weights({1: {"cu_launch": 40_000.0, "cu_launch_ex": 40_000.0}, 2: {"cu_launch": 1_000.0}}, c, 0.02)
    assert w["cu_launch"] == w["cu_launch_ex"] == 6
    # a rarely called symbol's exact share is taken off the budget of the busy ones
    w = governor.plan_weights({1: {"cu_launch": 98_000.0, "cu_launch_ptsz": 1_500.0}}, c, 0.02)
    assert w["cu_launch_ptsz"] == 1 and w["cu_launch"] == 8
    # down only with headroom: 7 -> 6 is held, 7 -> 3 is not
    assert governor.plan_weights({1: {"cu_launch": 85_000.0}}, c, 0.02, {"cu_launch": 7})["cu_launch"] == 7
    assert governor.plan_weights({1: {"cu_launch": 40_000.0}}, c, 0.02, {"cu_launch": 7})["cu_launch"] == 3


def test_syscall_layout_ok(tmp_path):
    d = tmp_path / "events" / "syscalls" / "sys_enter_ioctl"
    d.mkdir(parents=True)
    fmt = ("\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;\n"
           "\tfield:unsigned int fd;\toffset:16;\tsize:8;\tsigned:0;\n"
           "\tfield:unsigned int cmd;\toffset:24;\tsize:8;\tsigned:0;\n")
    (d / "format").write_text(fmt)
    assert ioctl.syscall_layout_ok(str(tmp_path)) is None
    (d / "format").write_text(fmt.replace("offset:24", "offset:20"))
    assert "cmd" in ioctl.syscall_layout_ok(str(tmp_path))
    assert "not readable" in ioctl.syscall_layout_ok(str(tmp_path / "nope"))


def test_every_probed_symbol_is_exported_by_driver_580():
    with open(os.path.join(FIX, "libcuda_symbols.json")) as f:
        funcs = set(json.load(f)["functions"])
    assert {s.name for s in symbols.SYMBOLS} <= funcs


def test_uvm_ioctls_have_no_type_byte():
    """Why the fd filter: nvidia-uvm's request codes carry no ioctl type, the control device's are 'F'."""
    with open(os.path.join(FIX, "nvidia_ioctls.json")) as f:
        dev = json.load(f)["devices"]
    assert {c["type"] for c in dev["/dev/nvidia-uvm"]["cmds"].values()} == {"0x00"}
    assert {c["type"] for c in dev["/dev/nvidiactl"]["cmds"].values()} == {"0x46"}


def test_h200_launch_counts_matched_the_profiler():
    with open(os.path.join(FIX, "h200_cuda_result.json")) as f:
        r = json.load(f)
    for w in ("mlp_profiled", "mlp_plain"):
        assert r[w]["agent"]["launches"] == 800
    assert r["mlp_profiled"]["kernels"] == 800
    assert r["graph_replays"]["agent"]["cu_graph_launch"] == 50 and r["graph_replays"]["agent"]["launches"] == 0


def test_findings():
    from mcp_hostagent.core.decode import Counters

    c = Counters(cu_ctx_ns=600_000, cu_sync_ns=2_000_000, nv_ioctl_ns=100_000)
    assert steps.findings(c, 10_000_000) == {"cuda.ctx_switch_heavy": 0.06}
    assert steps.findings(c, 3_000_000) == {"cuda.ctx_switch_heavy": 0.2, "cuda.sync_bound": 0.6667}
    assert steps.findings(c, 0) == {}
