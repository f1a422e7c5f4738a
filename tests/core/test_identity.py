"""Tests for mcp_hostagent.core.identity: parsers on fixture /proc text, the resolver on fake and real
cgroup2 trees, the registry against psutil and against a reused pid."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import psutil
import pytest
from hypothesis import given, strategies as st

from mcp_hostagent.core.identity import (
    CgroupInfo,
    CgroupResolver,
    ContainerRef,
    ProcessInfo,
    ProcessRegistry,
    cgroup2_mounts,
    container_from_cgroup,
    container_from_cgroup_path,
    parse_proc_cgroup,
    sanitize_text,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "identity"

D1 = "bdc2c3ccc50b108f615472c846cfae3366801a11a42237d28fb653affea66092"
D2 = "4284a57efebae67ae501c25f299095f3b671842cb3735ae28bb146141120dc6f"
C1 = "e00b115f16c23546c7a46e8a5fa3a270737b0b885136c00e7f98974230458261"
K1 = "206a8e8a58f4900af9579c2fe413cbd1b943fae6b2e9efbf405f61b8298f1080"
R1 = "ed12b3b332aecf567cd8bd91283cca657cb04d3344a262594bc3cb6f31b43e77"
P1 = "f259f698526bd64a3afc1fffcd5547033a4d3d536bfa12e7c914ef3d1dfc2fcb"
U1 = "5efeae32-7bea-40f3-8c24-7457865b51b1"
U2 = "611be20c-e8e5-43e9-ad55-3d3117d5777e"
U3 = "7aae9482-2f55-4753-94f7-7e56b7f64a74"


def _u(uid: str) -> str:  # the systemd cgroup driver's spelling of a pod uid
    return uid.replace("-", "_")


# --- sanitize_text ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("python3", "python3"),
        (b"python3", "python3"),
        ("\x1b[2J\x1b]0;owned\x07", "\\x1b[2J\\x1b]0;owned\\x07"),
        ("a\nb\tc\rd\x00", "a\\x0ab\\x09c\\x0dd\\x00"),
        ("del\x7f c1\x85\x9b", "del\\x7f c1\\x85\\x9b"),
        ("x\u2028y\u2029z", "x\\u2028y\\u2029z"),
        ("evil\u202egpj.exe", "evil\\u202egpj.exe"),
        ("\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069", "\\u202a\\u202b\\u202c\\u202d\\u2066\\u2067\\u2068\\u2069"),
        (b"py\xfftorch\xc3", "py\\xfftorch\\xc3"),  # what errors="backslashreplace" writes
        ("caf\u00e9 \u65e5\u672c \U0001f680".encode(), "caf\u00e9 \u65e5\u672c \U0001f680"),
        (b"\xff".decode("utf-8", "surrogateescape"), "\\xff"),  # psutil's decoding of a bad byte
        ("lone\ud800", "lone\\ud800"),
        ("back\\slash", "back\\slash"),
    ],
)
def test_sanitize_text_table(value, expected):
    out = sanitize_text(value)
    assert out == expected
    out.encode("utf-8")  # strict: nothing an exporter could choke on


@pytest.mark.parametrize(
    "value, expected",
    [
        # Cf (format) characters, every one escaped: bidi, zero-width, invisible operators, BOM, tags
        ("a\u200bb\u200cc\u200dd", "a\\u200bb\\u200cc\\u200dd"),
        ("\u061c\u200e\u200f", "\\u061c\\u200e\\u200f"),
        ("soft\u00adhyphen", "soft\\xadhyphen"),  # below U+0100: \\xNN, as C1 is
        ("\u2060\u2061\u2064\u206a\u206f\ufeff\ufff9", "\\u2060\\u2061\\u2064\\u206a\\u206f\\ufeff\\ufff9"),
        ("tag\U000e0001\U000e0041", "tag\\U000e0001\\U000e0041"),
        ("\u0600\u180e\U000110bd", "\\u0600\\u180e\\U000110bd"),
        # kept: what is visible, or a space; private-use and unassigned are the terminal's (top/text.py)
        ("nb\u00a0sp\u3000x", "nb\u00a0sp\u3000x"),
        ("\ue000\U0010fffd", "\ue000\U0010fffd"),
        ("\u0301e\u0301", "\u0301e\u0301"),  # combining marks (Mn)
    ],
)
def test_sanitize_text_escapes_every_format_character(value, expected):
    assert sanitize_text(value) == expected


@given(st.text(max_size=300))
def test_sanitize_text_never_lets_an_escaped_category_through(value):
    import unicodedata

    out = sanitize_text(value)
    assert not any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") for c in out)
    assert len(out) <= 256
    out.encode("utf-8")


def test_oom_victim_name_is_sanitized():
    import struct

    from mcp_hostagent.reclaim.oom import decode_mark_victim

    comm = "py\u202eevil\x1b".encode()
    fixed = bytearray(72)
    struct.pack_into("<iI", fixed, 8, 42, (len(comm) + 1) << 16 | 72)
    kill = decode_mark_victim(bytes(fixed) + comm + b"\0")
    assert kill.comm == "py\\u202eevil\\x1b" and kill.attributes()["hostagent.oom.victim.name"] == kill.comm


def test_sanitize_text_matches_backslashreplace_for_invalid_utf8():
    raw = bytes(range(0x80, 0x100)) + b"ok"
    assert sanitize_text(raw, 4096) == raw.decode("utf-8", "backslashreplace")


def test_sanitize_text_truncates_with_marker():
    assert sanitize_text("a" * 256) == "a" * 256
    out = sanitize_text("a" * 300)
    assert len(out) == 256 and out == "a" * 255 + "…"
    assert sanitize_text("b" * 5000, max_len=10) == "b" * 9 + "…"
    assert sanitize_text("abc", max_len=0) == ""


def test_sanitize_text_never_cuts_an_escape_in_half():
    out = sanitize_text("a" * 250 + "\x1b" * 10)
    assert len(out) <= 256 and out.endswith("…")
    assert out == "a" * 250 + "\\x1b" + "…"
    assert sanitize_text(b"a" * 254 + b"\xff" * 5) == "a" * 254 + "…"


def test_sanitize_text_escapes_count_toward_the_limit():
    out = sanitize_text("\x00" * 1000, max_len=64)
    assert len(out) <= 64 and out.endswith("…") and out.startswith("\\x00\\x00")


def test_sanitize_text_is_bounded_on_huge_input():
    huge = b"\xff" * 50_000_000
    started = time.perf_counter()
    out = sanitize_text(huge, max_len=1024)
    assert time.perf_counter() - started < 0.5
    assert len(out) <= 1024 and out.endswith("…")


# --- parse_proc_cgroup -------------------------------------------------------------------------------


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_parse_proc_cgroup_v1_full_sample():
    info = parse_proc_cgroup(_fixture("docker_v1_cgroupfs.cgroup"))
    assert info.v2_path == "/"
    assert info.v1_paths["memory"] == f"/docker/{D1}"
    assert info.v1_paths["cpu"] == info.v1_paths["cpuacct"] == f"/docker/{D1}"
    assert info.v1_paths["net_cls"] == info.v1_paths["net_prio"] == f"/docker/{D1}"
    assert info.v1_paths["name=systemd"] == f"/docker/{D1}"
    assert info.v1_paths["rdma"] == "/"
    assert len(info.v1_paths) == 14


def test_parse_proc_cgroup_v2_only():
    info = parse_proc_cgroup(_fixture("k8s_containerd_v2_systemd.cgroup"))
    assert info.v1_paths == {}
    assert info.v2_path == (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_u(U1)}.slice/cri-containerd-{C1}.scope"
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", CgroupInfo(None, {})),
        ("\n\n0::/a.slice\n\n", CgroupInfo("/a.slice", {})),
        ("garbage\n0::/ok\n", CgroupInfo("/ok", {})),
        ("x:memory:/m\n4:memory\n", CgroupInfo(None, {})),  # non-numeric id; missing path field
        ("4:memory:relative\n3::/nocontrollers\n", CgroupInfo(None, {})),
        ("4:memory:/with:colon\n", CgroupInfo(None, {"memory": "/with:colon"})),
        ("2:cpu,cpuacct:/c\n1:name=systemd:/s\n", CgroupInfo(None, {"cpu": "/c", "cpuacct": "/c", "name=systemd": "/s"})),
    ],
)
def test_parse_proc_cgroup_table(text, expected):
    assert parse_proc_cgroup(text) == expected


def test_primary_path_prefers_a_non_root_path():
    info = parse_proc_cgroup(_fixture("hybrid_v1_memory_only.cgroup"))  # captured on the dev VM
    assert info.v2_path == "/"
    assert info.primary_path == "/process_api/db8263f4b7551250ccf6815f3337b6e0"
    assert parse_proc_cgroup("0::/\n").primary_path == "/"
    assert CgroupInfo().primary_path is None


# --- container_from_cgroup_path ----------------------------------------------------------------------

KP = "/kubepods.slice/kubepods-burstable.slice"


@pytest.mark.parametrize(
    "path, expected",
    [
        (f"/docker/{D1}", ContainerRef(D1, "docker")),
        (f"/system.slice/docker-{D2}.scope", ContainerRef(D2, "docker")),
        (f"/system.slice/docker-{D2}.scope/init.scope", ContainerRef(D2, "docker")),
        (f"/kubepods/burstable/pod{U2}/{K1}", ContainerRef(K1, "unknown", U2)),
        (f"/kubepods/besteffort/pod{U2}/{K1}", ContainerRef(K1, "unknown", U2)),
        (f"/kubepods/pod{U2}/{K1}", ContainerRef(K1, "unknown", U2)),  # guaranteed QoS
        (f"/kubepods/burstable/pod{U2}/crio-{R1}", ContainerRef(R1, "cri-o", U2)),
        (f"{KP}/kubepods-burstable-pod{_u(U1)}.slice/cri-containerd-{C1}.scope", ContainerRef(C1, "containerd", U1)),
        (f"{KP}/kubepods-burstable-pod{_u(U3)}.slice/crio-{R1}.scope", ContainerRef(R1, "cri-o", U3)),
        (f"{KP}/kubepods-burstable-pod{_u(U3)}.slice/crio-conmon-{R1}.scope", ContainerRef(None, "unknown", U3)),
        (f"{KP}/kubepods-burstable-pod{_u(U3)}.slice/docker-{D2}.scope", ContainerRef(D2, "docker", U3)),
        (
            f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{_u(U1)}.slice/cri-containerd-{C1}.scope",
            ContainerRef(C1, "containerd", U1),
        ),
        (f"/kubepods.slice/kubepods-pod{_u(U1)}.slice/cri-containerd-{C1}.scope", ContainerRef(C1, "containerd", U1)),
        (f"/kubepods.slice/kubepods-pod{_u(U1)}.slice", ContainerRef(None, "unknown", U1)),
        (f"/kubepods/burstable/pod{U2}", ContainerRef(None, "unknown", U2)),
        (f"/machine.slice/libpod-{P1}.scope", ContainerRef(P1, "podman")),
        (f"/machine.slice/libpod-{P1}.scope/container", ContainerRef(P1, "podman")),
        (f"/machine.slice/libpod-conmon-{P1}.scope", None),
        (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{P1}.scope", ContainerRef(P1, "podman")),
        # kind: a k8s node in a docker container; the pod's container is the innermost one
        (f"/docker/{D1}/kubepods/burstable/pod{U2}/{K1}", ContainerRef(K1, "unknown", U2)),
        (f"/docker/{D1}/kubepods/burstable/pod{U2}", ContainerRef(None, "unknown", U2)),
        ("/system.slice/ssh.service", None),
        ("/system.slice/containerd.service", None),
        ("/user.slice/user-0.slice/session-3.scope", None),
        ("/", None),
        ("", None),
        ("/process_api/db8263f4b7551250ccf6815f3337b6e0", None),  # 32 hex: not a container id
        (f"/system.slice/docker-{D2[:-1]}.scope", None),  # 63 hex
        (f"/pod{U2}/{K1[:12]}", None),  # pod-like name outside kubepods
    ],
)
def test_container_from_cgroup_path_table(path, expected):
    assert container_from_cgroup_path(path) == expected


@pytest.mark.parametrize(
    "fixture, expected",
    [
        ("docker_v1_cgroupfs.cgroup", ContainerRef(D1, "docker")),  # v2 is "/": found through v1 memory
        ("docker_v2_systemd.cgroup", ContainerRef(D2, "docker")),
        ("k8s_containerd_v2_systemd.cgroup", ContainerRef(C1, "containerd", U1)),
        ("k8s_docker_v1_cgroupfs.cgroup", ContainerRef(K1, "unknown", U2)),
        ("k8s_crio_v2_systemd.cgroup", ContainerRef(R1, "cri-o", U3)),
        ("k8s_crio_conmon_v2_systemd.cgroup", ContainerRef(None, "unknown", U3)),
        ("podman_v1_systemd.cgroup", ContainerRef(P1, "podman")),
        ("podman_v2_systemd.cgroup", ContainerRef(P1, "podman")),
        ("systemd_service_v1.cgroup", None),
        ("systemd_service_v2.cgroup", None),
        ("hybrid_v1_memory_only.cgroup", None),
    ],
)
def test_container_from_fixture_files(fixture, expected):
    assert container_from_cgroup(parse_proc_cgroup(_fixture(fixture))) == expected


def test_container_detection_order_v2_then_memory_then_cpu_then_any():
    info = CgroupInfo(f"/docker/{D1}", {"memory": f"/docker/{D2}", "cpu": f"/docker/{K1}"})
    assert container_from_cgroup(info).container_id == D1
    info = CgroupInfo("/", {"pids": f"/docker/{P1}", "cpu": f"/docker/{K1}", "memory": f"/docker/{D2}"})
    assert container_from_cgroup(info).container_id == D2
    info = CgroupInfo("/", {"pids": f"/docker/{P1}", "cpu": f"/docker/{K1}"})
    assert container_from_cgroup(info).container_id == K1
    assert container_from_cgroup(CgroupInfo("/", {"pids": f"/docker/{P1}"})).container_id == P1


# --- mountinfo and the resolver on fake trees ---------------------------------------------------------


def test_cgroup2_mounts_from_fixtures():
    assert cgroup2_mounts(_fixture("mountinfo_hybrid_unified")) == [("/sys/fs/cgroup/unified", "/")]
    assert cgroup2_mounts(_fixture("mountinfo_v2_only")) == [("/sys/fs/cgroup", "/")]
    line = "41 31 0:38 /kube\\040pods /host/my\\040cg rw - cgroup2 cgroup2 rw\n"
    assert cgroup2_mounts(line) == [("/host/my cg", "/kube pods")]
    assert cgroup2_mounts("41 31 0:38 / /x rw - cgroup cgroup rw,memory\nnonsense\n") == []


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _fake_host(tmp_path: Path, layout: str, mount_root: str = "/") -> tuple[Path, Path, Path]:
    """A proc root whose self/mountinfo points into a cgroup root under tmp_path. Returns
    (proc_root, cgroup_root, cgroup2 mount point)."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    v2 = cg / "unified" if layout == "hybrid" else cg
    v2.mkdir(parents=True)
    lines = []
    if layout == "hybrid":
        (cg / "memory" / "docker" / D1).mkdir(parents=True)
        lines += [
            f"31 23 0:28 / {cg} rw,relatime - tmpfs tmpfs rw,mode=755",
            f"35 31 0:32 / {cg}/memory rw,relatime - cgroup cgroup rw,memory",
        ]
    lines.append(f"41 31 0:38 {mount_root} {v2} rw,relatime - cgroup2 cgroup2 rw")
    (proc / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    return proc, cg, v2


@pytest.mark.parametrize("layout", ["hybrid", "unified"])
def test_resolver_maps_inodes_to_paths(tmp_path, layout):
    proc, cg, v2 = _fake_host(tmp_path, layout)
    scope = v2 / "system.slice" / f"docker-{D2}.scope"
    scope.mkdir(parents=True)
    pod = v2 / "kubepods.slice" / "kubepods-burstable.slice" / f"kubepods-burstable-pod{_u(U1)}.slice"
    (pod / f"cri-containerd-{C1}.scope").mkdir(parents=True)
    resolver = CgroupResolver(cgroup_root=str(cg), proc_root=str(proc))
    assert resolver.path_for_id(os.stat(v2).st_ino) == "/"
    assert resolver.path_for_id(os.stat(scope).st_ino) == f"/system.slice/docker-{D2}.scope"
    path = resolver.path_for_id(os.stat(pod / f"cri-containerd-{C1}.scope").st_ino)
    assert container_from_cgroup_path(path) == ContainerRef(C1, "containerd", U1)
    if layout == "hybrid":  # v1 directories are not cgroup v2 ids
        assert resolver.path_for_id(os.stat(cg / "memory" / "docker" / D1).st_ino) is None
    assert resolver.path_for_id(os.stat(tmp_path).st_ino) is None


def test_resolver_prefixes_the_mount_root(tmp_path):
    proc, cg, v2 = _fake_host(tmp_path, "unified", mount_root="/kubepods.slice")
    (v2 / "kubepods-besteffort.slice").mkdir()
    resolver = CgroupResolver(cgroup_root=str(cg), proc_root=str(proc))
    assert resolver.path_for_id(os.stat(v2).st_ino) == "/kubepods.slice"
    assert resolver.path_for_id(os.stat(v2 / "kubepods-besteffort.slice").st_ino) == "/kubepods.slice/kubepods-besteffort.slice"


def test_resolver_picks_the_whole_hierarchy_under_cgroup_root(tmp_path):
    proc, cg, v2 = _fake_host(tmp_path, "unified")
    (v2 / "kubepods.slice").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with open(proc / "self" / "mountinfo", "a") as f:  # a bind mount of a subtree, and one outside the root
        f.write(f"52 41 0:38 /kubepods.slice {v2}/kubepods.slice rw - cgroup2 cgroup2 rw\n")
        f.write(f"53 22 0:38 / {elsewhere} rw - cgroup2 cgroup2 rw\n")
    resolver = CgroupResolver(cgroup_root=str(cg), proc_root=str(proc))
    assert resolver.path_for_id(os.stat(v2).st_ino) == "/"
    assert resolver.path_for_id(os.stat(v2 / "kubepods.slice").st_ino) == "/kubepods.slice"


def test_resolver_without_mountinfo_probes_cgroup_root(tmp_path):
    cg = tmp_path / "cgroup"
    (cg / "unified" / "user.slice").mkdir(parents=True)
    (cg / "unified" / "cgroup.controllers").write_text("cpu io\n")
    (cg / "memory" / "user.slice").mkdir(parents=True)
    resolver = CgroupResolver(cgroup_root=str(cg), proc_root=str(tmp_path / "noproc"))
    assert resolver.path_for_id(os.stat(cg / "unified" / "user.slice").st_ino) == "/user.slice"
    assert resolver.path_for_id(os.stat(cg / "memory" / "user.slice").st_ino) is None
    assert CgroupResolver(cgroup_root=str(tmp_path / "none"), proc_root=str(tmp_path)).path_for_id(1) is None


def test_resolver_rewalks_on_miss_at_most_once_per_interval(tmp_path):
    proc, cg, v2 = _fake_host(tmp_path, "unified")
    clock = FakeClock()
    resolver = CgroupResolver(cgroup_root=str(cg), proc_root=str(proc), min_rescan_interval_s=5.0, clock=clock)
    assert resolver.path_for_id(os.stat(v2).st_ino) == "/"  # first walk
    (v2 / "late.scope").mkdir()
    late = os.stat(v2 / "late.scope").st_ino
    clock.now += 4.9
    assert resolver.path_for_id(late) is None  # rate limited: no walk yet
    clock.now += 0.1
    assert resolver.path_for_id(late) == "/late.scope"
    (v2 / "later.scope").mkdir()
    assert resolver.path_for_id(os.stat(v2 / "later.scope").st_ino) is None
    shutil.rmtree(v2 / "late.scope")
    clock.now += 5.0
    assert resolver.path_for_id(os.stat(v2 / "later.scope").st_ino) == "/later.scope"
    assert resolver.path_for_id(late) is None  # a re-walk drops removed cgroups


def test_resolver_walk_is_bounded(tmp_path):
    proc, cg, v2 = _fake_host(tmp_path, "unified")
    for i in range(20):
        (v2 / f"s{i}" / "child").mkdir(parents=True)
    dirs = [v2] + [p for p in v2.rglob("*") if p.is_dir()]
    resolver = CgroupResolver(cgroup_root=str(cg), proc_root=str(proc), max_dirs=7)
    assert sum(resolver.path_for_id(os.stat(d).st_ino) is not None for d in dirs) == 7
    unbounded = CgroupResolver(cgroup_root=str(cg), proc_root=str(proc))
    assert sum(unbounded.path_for_id(os.stat(d).st_ino) is not None for d in dirs) == 41


def test_resolver_for_pid_reads_fixture_and_tolerates_gone_process(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(_fixture("k8s_docker_v1_cgroupfs.cgroup"))
    resolver = CgroupResolver(proc_root=str(tmp_path))
    info = resolver.for_pid(4242)
    assert info.v1_paths["memory"] == f"/kubepods/burstable/pod{U2}/{K1}"
    assert container_from_cgroup(info) == ContainerRef(K1, "unknown", U2)
    assert resolver.for_pid(4243) is None


# --- the resolver on this machine ---------------------------------------------------------------------


def _real_cgroup2_mount() -> str:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return fields[1]
    pytest.skip("no cgroup2 mount on this machine")


def _own_v2_path() -> str:
    return next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))


def test_real_resolver_round_trips_own_cgroup():
    mount, path = _real_cgroup2_mount(), _own_v2_path()
    cgroup_id = os.stat(mount + path.rstrip("/")).st_ino if path != "/" else os.stat(mount).st_ino
    assert CgroupResolver().path_for_id(cgroup_id) == path
    assert CgroupResolver().for_pid(os.getpid()).v2_path == path


def test_real_resolver_finds_a_new_cgroup_and_its_process():
    mount = Path(_real_cgroup2_mount())
    cgroup = mount / f"mcp-identity-test-{uuid.uuid4().hex[:8]}"
    try:
        cgroup.mkdir()
    except OSError as err:
        pytest.skip(f"cannot create a cgroup under {mount}: {err}")
    child = subprocess.Popen(["sleep", "30"])
    try:
        (cgroup / "cgroup.procs").write_text(str(child.pid))
        resolver = CgroupResolver()
        assert resolver.path_for_id(os.stat(cgroup).st_ino) == f"/{cgroup.name}"
        assert resolver.for_pid(child.pid).v2_path == f"/{cgroup.name}"
        assert ProcessRegistry().lookup(child.pid).cgroup_path == f"/{cgroup.name}"
    finally:
        child.kill()
        child.wait()
        cgroup.rmdir()


# --- ProcessRegistry ---------------------------------------------------------------------------------


def test_registry_matches_psutil_for_this_process():
    registry = ProcessRegistry()
    info = registry.lookup(os.getpid())
    proc = psutil.Process()
    assert info.pid == os.getpid()
    assert info.comm == proc.name()
    assert info.exe_name == os.path.basename(proc.exe())
    assert info.owner == proc.username()
    assert info.command_line.split()[0] == proc.cmdline()[0]
    assert abs(info.start_time_ns / 1e9 - proc.create_time()) < 1e-3
    assert info.cgroup_path == parse_proc_cgroup(Path("/proc/self/cgroup").read_text()).primary_path
    assert registry.lookup(os.getpid()) is info  # cached

    attrs = registry.attributes(info)
    assert attrs["process.pid"] == os.getpid()
    assert attrs["process.executable.name"] == info.exe_name
    assert attrs["process.owner"] == proc.username()
    created = datetime.fromisoformat(attrs["process.creation.time"].replace("Z", "+00:00"))
    assert created.tzinfo is not None and abs(created.timestamp() - proc.create_time()) < 1e-3


def test_registry_child_lifecycle_never_raises():
    registry = ProcessRegistry()
    child = subprocess.Popen(["sleep", "30"])
    try:
        # Popen returns once the vfork'd child released the parent's mm inside exec, which is before
        # the kernel has set the new args (create_elf_tables): wait until /proc shows them
        deadline = time.monotonic() + 5
        while not open(f"/proc/{child.pid}/cmdline", "rb").read() and time.monotonic() < deadline:
            time.sleep(0.001)
        live = registry.lookup(child.pid)
        assert (live.comm, live.exe_name, live.command_line) == ("sleep", "sleep", "sleep 30")
        assert live.start_time_ns > 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    gone = registry.lookup(child.pid, comm_hint=b"sleep\0\0\0\0\0\0\0\0\0\0\0")
    assert gone == ProcessInfo(child.pid, 0, "sleep", exe_name="sleep")
    assert registry.attributes(gone) == {"process.pid": child.pid, "process.executable.name": "sleep"}
    assert registry.lookup(child.pid).comm == ""


def _stat_line(pid: int, comm: str, start_ticks: int) -> str:
    fields = ["S"] + ["0"] * 49  # proc(5): field 3 is the state, field 22 the start time in ticks
    fields[19] = str(start_ticks)
    return f"{pid} ({comm}) {' '.join(fields)}\n"


def _fake_process(proc_root: Path, pid: int, comm: str, args: list[str], start_ticks: int, cgroup: str) -> None:
    d = proc_root / str(pid)
    if d.is_symlink():
        d.unlink()
    d.mkdir(exist_ok=True)
    (d / "stat").write_text(_stat_line(pid, comm, start_ticks))
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")
    (d / "status").write_text(f"Name:\t{comm}\nState:\tS (sleeping)\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n")
    (d / "cgroup").write_text(cgroup)
    if not (d / "exe").is_symlink():
        (d / "exe").symlink_to(f"/opt/srv/{comm}")


def _proxy_proc_root(tmp_path: Path) -> Path:
    """A proc root that shows the real /proc (system files, self) until a pid is replaced by fakes."""
    root = tmp_path / "proc"
    root.mkdir()
    for name in ("stat", "self", "uptime"):
        (root / name).symlink_to(f"/proc/{name}")
    return root


def test_registry_reused_pid_gets_a_new_record(tmp_path):
    root = _proxy_proc_root(tmp_path)
    registry = ProcessRegistry(proc_root=str(root))
    child = subprocess.Popen(["sleep", "30"])
    try:
        (root / str(child.pid)).symlink_to(f"/proc/{child.pid}")
        old = registry.lookup(child.pid)
        assert old.command_line == "sleep 30" and old.start_time_ns > 0
        start_ticks = int(Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    finally:
        child.kill()
        child.wait()
    assert registry.lookup(child.pid, comm_hint="sleep").start_time_ns == 0  # gone: not the cached record

    # The kernel hands the pid to a new process 5 s later, in a pod.
    cgroup = f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{_u(U1)}.slice/cri-containerd-{C1}.scope\n"
    _fake_process(root, child.pid, "vllm", ["vllm", "serve", "--port", "8000"], start_ticks + 500, cgroup)
    new = registry.lookup(child.pid)
    assert new.start_time_ns == old.start_time_ns + 5_000_000_000
    assert (new.comm, new.exe_name, new.command_line, new.owner) == ("vllm", "vllm", "vllm serve --port 8000", "root")
    assert (new.container_id, new.pod_uid, new.container_runtime) == (C1, U1, "containerd")
    attrs = registry.attributes(new)
    created = attrs.pop("process.creation.time")
    assert created.endswith("Z")
    assert datetime.fromisoformat(created[:-1] + "+00:00").timestamp() == pytest.approx(new.start_time_ns / 1e9, abs=1e-3)
    assert attrs == {
        "process.pid": child.pid,
        "process.executable.name": "vllm",
        "process.command_line": "vllm serve --port 8000",
        "process.owner": "root",
        "container.id": C1,
        "k8s.pod.uid": U1,
        "container.runtime": "containerd",
        "hostagent.cgroup.path": cgroup[3:].strip(),
    }
    assert registry.lookup(child.pid) is new


def test_registry_sanitizes_hostile_names(tmp_path):
    root = _proxy_proc_root(tmp_path)
    _fake_process(root, 7, "x\x1b[2J", ["x\x1b[2J", "--name=\u202eevil", "a b"], 100, "0::/\n")
    info = ProcessRegistry(proc_root=str(root)).lookup(7)
    assert info.comm == "x\\x1b[2J"
    assert info.command_line == "'x\\x1b[2J' '--name=\\u202eevil' 'a b'"


HOSTILE = "evil\u202egpj\u200b"  # 13 bytes: the whole of it is the comm too (at most 15)


@pytest.fixture
def hostile_child(tmp_path):
    """A real process whose comm, executable and argv[0] hold U+202E and U+200B: a copy of sleep."""
    exe = tmp_path / HOSTILE
    shutil.copy(shutil.which("sleep"), exe)
    child = subprocess.Popen([str(exe), "30"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/comm").read_bytes().rstrip(b"\n") != HOSTILE.encode():
            assert time.monotonic() < deadline, "the child never exec'd"
            time.sleep(0.01)
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_real_process_with_bidi_characters_in_its_names(hostile_child):
    from mcp_hostagent.core.processes import Processes, metric_identity
    from mcp_hostagent.top.text import fit

    escaped = "evil\\u202egpj\\u200b"
    info = ProcessRegistry().lookup(hostile_child.pid)
    assert info.comm == escaped and info.exe_name == escaped
    assert escaped in info.command_line and info.command_line.endswith(" 30")
    attrs = Processes().attrs(hostile_child.pid, HOSTILE.encode())  # span resource
    assert attrs["process.executable.name"] == escaped
    assert metric_identity(attrs)["process.executable.name"] == escaped  # metric labels
    assert fit(attrs["process.executable.name"], 40).rstrip() == escaped  # `top`
    for v in attrs.values():
        assert "\u202e" not in str(v) and "\u200b" not in str(v)
    # the same rule for the kernel's comm when /proc is gone: the BPF record's bytes
    assert ProcessRegistry().lookup(2**22 + 1, comm_hint=HOSTILE.encode() + b"\0\0").comm == escaped


def test_a_real_process_renamed_by_prctl(tmp_path):
    code = ("import ctypes, sys, time; n = sys.argv[1].encode(); "
            "ctypes.CDLL(None).prctl(15, ctypes.c_char_p(n), 0, 0, 0); print(flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code, "a\u202eb\u2066c"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        assert Path(f"/proc/{child.pid}/comm").read_text().rstrip("\n") == "a\u202eb\u2066c"
        assert ProcessRegistry().lookup(child.pid).comm == "a\\u202eb\\u2066c"
    finally:
        child.kill()
        child.wait()


def test_registry_cache_is_lru_bounded_and_forgets(tmp_path):
    root = _proxy_proc_root(tmp_path)
    for pid in (11, 12, 13):
        _fake_process(root, pid, "worker", ["worker", "v1"], 100, "0::/\n")
    registry = ProcessRegistry(proc_root=str(root), max_entries=2)
    for pid in (11, 12, 11, 13):  # 12 is the least recently used when 13 arrives
        registry.lookup(pid)
    for pid in (11, 12, 13):  # same process (same start time), new arguments: only a cache miss sees them
        _fake_process(root, pid, "worker", ["worker", "v2"], 100, "0::/\n")
    assert registry.lookup(12).command_line == "worker v2"  # evicted
    assert registry.lookup(13).command_line == "worker v1"  # still cached
    registry.forget(13)
    assert registry.lookup(13).command_line == "worker v2"


def test_registry_missing_pid_in_fake_root(tmp_path):
    registry = ProcessRegistry(proc_root=str(_proxy_proc_root(tmp_path)))
    assert registry.lookup(99, comm_hint=b"\xffbad") == ProcessInfo(99, 0, "\\xffbad", exe_name="\\xffbad")
    assert registry.lookup(99) == ProcessInfo(99, 0, "")
    assert registry.attributes(registry.lookup(99)) == {"process.pid": 99}
