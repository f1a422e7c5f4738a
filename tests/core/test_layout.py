"""Every struct of every BPF header (bpf/common.h and each capability's own) against its ctypes mirror
(core/records.py, <capability>/records.py): the host C compiler reports sizeof/offsetof, so a field
added on one side only fails here. And the numbers several headers share (record types, stats,
raw tracepoint kinds) stay apart."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from mcp_hostagent.core import records as R
from mcp_hostagent.registry import UNIT
from mcp_hostagent.requests import records as RQ

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) to read the header's layout")

HEADERS = [("common.h", R.STRUCTS)] + [(d.header, d.structs) for d in UNIT.declarations if d.header]


def _fields(cls, prefix=""):
    for name, ftype in cls._fields_:
        yield prefix + name, getattr(cls, name).offset, ctypes.sizeof(ftype)


def c_layout(tmp_path, header: str, structs: dict, include: list[str]) -> dict:
    lines = []
    for cname, cls in structs.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof(struct {cname}));')
        for fname, _, _ in _fields(cls):
            lines.append(f'printf("{cname} {fname} %zu %zu\\n", offsetof(struct {cname}, {fname}), '
                         f'sizeof(((struct {cname} *)0)->{fname}));')
    src = (f"#include <stddef.h>\n#include <stdio.h>\n#include \"{header}\"\n"
           "int main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n")
    (tmp_path / "layout.c").write_text(src)
    subprocess.run(["cc", "-Wall", "-Werror", *(f"-I{d}" for d in include), "-o", str(tmp_path / "layout"),
                    str(tmp_path / "layout.c")], check=True)
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        table[(parts[0], parts[1])] = tuple(int(x) for x in parts[2:])
    return table


def check_layout(tmp_path, header: str, structs: dict, include: list[str]) -> None:
    table = c_layout(tmp_path, header, structs, include)
    for cname, cls in structs.items():
        assert table[(cname, "sizeof")] == (ctypes.sizeof(cls),), cname
        for fname, off, size in _fields(cls):
            assert table[(cname, fname)] == (off, size), f"{cname}.{fname}"


@pytest.mark.parametrize("header,structs", HEADERS, ids=[h for h, _ in HEADERS])
def test_structs_match_their_header(tmp_path, header, structs):
    check_layout(tmp_path, header, structs, [R.bpf_source_dir()])


def test_every_header_has_its_mirror():
    """A header a capability declares holds structs: each one is mirrored (no header left unchecked)."""
    for header, structs in HEADERS:
        text = open(os.path.join(R.bpf_source_dir(), header)).read()
        declared = {line.split()[1] for line in text.splitlines() if line.startswith("struct ") and line.rstrip().endswith("{")}
        assert declared <= set(structs), f"{header}: {sorted(declared - set(structs))} not mirrored"


def test_constants_come_from_the_header():
    C = RQ.C
    assert C["MCP_MARK_CMD"] == 0x4048EB01
    # _IOW(0xeb, 0x01, struct mcp_mark): direction write (1) << 30 | size << 16 | type << 8 | nr
    assert C["MCP_MARK_CMD"] == (1 << 30) | (ctypes.sizeof(RQ.Mark) << 16) | (0xEB << 8) | 0x01
    assert C["MCP_EV_REQ_END"] == 2


def test_stat_families_keep_to_their_ranges():
    # Each header numbers its counters from its family's base (multiples of 32), so a counter added
    # in one capability's header cannot shift another's index in the shared stats array.
    consts = UNIT.constants()
    names = {n: v for n, v in consts.items() if n.startswith("MCP_STAT_") and n != "MCP_STAT_MAX"}
    assert len(set(names.values())) == len(names) == len(UNIT.kernel_stats())
    assert max(names.values()) < consts["MCP_STAT_MAX"]
    for base in {v // 32 for v in names.values()}:
        family = sorted(v for v in names.values() if v // 32 == base)
        assert family == list(range(base * 32, base * 32 + len(family))), f"family at {base * 32} has a gap"


def test_record_types_and_raw_kinds_are_each_one_capabilitys():
    """Each header numbers its ring-buffer record types and raw tracepoint kinds (enum mcp_*_event_type,
    enum mcp_tp_kind_*): no two headers may give one number."""
    for prefix in ("MCP_EV_", "MCP_TP_"):
        seen: dict[int, str] = {}
        for header, _ in HEADERS:
            text = open(os.path.join(R.bpf_source_dir(), header)).read()
            for name, v in R.parse_constants(text).items():
                if name.startswith(prefix) and not name.startswith("MCP_TP_RAW"):
                    assert seen.setdefault(v, name) == name, f"{name} and {seen[v]} share {v}"


def test_parse_constants_enum_and_defines():
    text = "#define MCP_A 0x10U\n#define MCP_B 7\nenum x { P = 3, Q, /* c */ R_, };\n"
    assert R.parse_constants(text) == {"MCP_A": 16, "MCP_B": 7, "P": 3, "Q": 4, "R_": 5}
