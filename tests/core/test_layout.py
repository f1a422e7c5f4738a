"""Every struct in the BPF headers (bpf/*.h) against its ctypes mirror: the host C
compiler reports sizeof/offsetof, so a field added on one side only fails here."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from mcp_hostagent.core import records as R

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) to read the header's layout")


def _fields(cls, prefix=""):
    for name, ftype in cls._fields_:
        yield prefix + name, getattr(cls, name).offset, ctypes.sizeof(ftype)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    lines = []
    for cname, cls in R.STRUCTS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof(struct {cname}));')
        for fname, _, _ in _fields(cls):
            lines.append(f'printf("{cname} {fname} %zu %zu\\n", offsetof(struct {cname}, {fname}), '
                         f'sizeof(((struct {cname} *)0)->{fname}));')
    src = ("#include <stddef.h>\n#include <stdio.h>\n#include \"mcp_records.h\"\n"
           "int main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n")
    d = tmp_path_factory.mktemp("layout")
    (d / "layout.c").write_text(src)
    subprocess.run(["cc", "-Wall", "-Werror", f"-I{R.bpf_source_dir()}", "-o", str(d / "layout"), str(d / "layout.c")],
                   check=True)
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        table[(parts[0], parts[1])] = tuple(int(x) for x in parts[2:])
    return table


@pytest.mark.parametrize("cname", sorted(R.STRUCTS))
def test_struct_matches_header(c_layout, cname):
    cls = R.STRUCTS[cname]
    assert c_layout[(cname, "sizeof")] == (ctypes.sizeof(cls),)
    for fname, off, size in _fields(cls):
        assert c_layout[(cname, fname)] == (off, size), f"{cname}.{fname}"


def test_constants_come_from_the_header():
    assert R.C["MCP_MARK_CMD"] == 0x4048EB01
    # _IOW(0xeb, 0x01, struct mcp_mark): direction write (1) << 30 | size << 16 | type << 8 | nr
    assert R.C["MCP_MARK_CMD"] == (1 << 30) | (ctypes.sizeof(R.Mark) << 16) | (0xEB << 8) | 0x01
    assert R.C["MCP_EV_REQ_END"] == 2


def test_stat_families_keep_to_their_ranges():
    # Each header numbers its counters from its family's base (multiples of 32), so a counter added
    # in one capability's header cannot shift another's index in the shared stats array.
    names = {n: v for n, v in R.C.items() if n.startswith("MCP_STAT_") and n != "MCP_STAT_MAX"}
    assert len(set(names.values())) == len(names) == len(R.KERNEL_STATS)
    assert max(names.values()) < R.C["MCP_STAT_MAX"]
    bases = {v // 32 for v in names.values()}
    for base in bases:
        family = sorted(v for v in names.values() if v // 32 == base)
        assert family == list(range(base * 32, base * 32 + len(family))), f"family at {base * 32} has a gap"


def test_parse_constants_enum_and_defines():
    text = "#define MCP_A 0x10U\n#define MCP_B 7\nenum x { P = 3, Q, /* c */ R_, };\n"
    assert R.parse_constants(text) == {"MCP_A": 16, "MCP_B": 7, "P": 3, "Q": 4, "R_": 5}
