"""The bpf(2) syscall where bcc has no wrapper for what we need: BPF_PROG_LOAD with an expected attach
type (libbcc 0.26's bcc_prog_load has none), used for uprobe_multi programs (agent/cuda/uprobes.py)
and for programs adopted from a compile worker or the compile cache (core/loader.py); BPF_MAP_CREATE
and BPF_OBJ_GET_INFO_BY_FD for maps made from the compile cache's description (core/mapset.py)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource

BPF_MAP_CREATE, BPF_PROG_LOAD, BPF_OBJ_GET_INFO_BY_FD = 0, 5, 15
BPF_PROG_TYPE_KPROBE = 2  # uprobes are kprobe-type programs
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}.get(platform.machine(), 321)
_libc = ctypes.CDLL(None, use_errno=True)


class ProgLoadAttr(ctypes.Structure):
    """union bpf_attr, the BPF_PROG_LOAD member, up to expected_attach_type (offset 68). The kernel
    takes a shorter attr than its own and reads the rest as zero."""
    _fields_ = [("prog_type", ctypes.c_uint32),  # 0
                ("insn_cnt", ctypes.c_uint32),  # 4
                ("insns", ctypes.c_uint64),  # 8
                ("license", ctypes.c_uint64),  # 16
                ("log_level", ctypes.c_uint32),  # 24
                ("log_size", ctypes.c_uint32),  # 28
                ("log_buf", ctypes.c_uint64),  # 32
                ("kern_version", ctypes.c_uint32),  # 40
                ("prog_flags", ctypes.c_uint32),  # 44
                ("prog_name", ctypes.c_char * 16),  # 48
                ("prog_ifindex", ctypes.c_uint32),  # 64
                ("expected_attach_type", ctypes.c_uint32)]  # 68


assert ctypes.sizeof(ProgLoadAttr) == 72


class MapCreateAttr(ctypes.Structure):
    """union bpf_attr, the BPF_MAP_CREATE member, up to map_name (offset 28): no BTF, no NUMA node."""
    _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32), ("value_size", ctypes.c_uint32),
                ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32), ("inner_map_fd", ctypes.c_uint32),
                ("numa_node", ctypes.c_uint32), ("map_name", ctypes.c_char * 16)]


class MapInfo(ctypes.Structure):
    """struct bpf_map_info up to btf_value_type_id (include/uapi/linux/bpf.h)."""
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("name", ctypes.c_char * 16), ("ifindex", ctypes.c_uint32), ("btf_vmlinux_value_type_id", ctypes.c_uint32),
                ("netns_dev", ctypes.c_uint64), ("netns_ino", ctypes.c_uint64), ("btf_id", ctypes.c_uint32),
                ("btf_key_type_id", ctypes.c_uint32), ("btf_value_type_id", ctypes.c_uint32)]


class InfoAttr(ctypes.Structure):
    """union bpf_attr, the BPF_OBJ_GET_INFO_BY_FD member."""
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


assert ctypes.sizeof(MapCreateAttr) == 44 and ctypes.sizeof(MapInfo) == 80


def sys_bpf(cmd: int, attr) -> tuple[int, int]:
    """(fd or -1, errno)."""
    r = _libc.syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    return r, (ctypes.get_errno() if r < 0 else 0)


def why(err: int) -> str:
    """One line for an errno: its name and meaning (the probe table's 'missing' reason)."""
    return f"{errno.errorcode.get(err, str(err))} ({os.strerror(err)})"


def prog_load(prog_type: int, insns: bytes, license: bytes, kern_version: int = 0, name: bytes = b"",
              attach_type: int = 0) -> tuple[int, int]:
    """(fd or -1, errno): one program loaded. name: the kernel keeps 15 characters (BPF_OBJ_NAME_LEN)."""
    buf = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license)
    a = ProgLoadAttr(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ctypes.addressof(buf),
                     license=ctypes.addressof(lic), kern_version=kern_version, prog_name=name[:15],
                     expected_attach_type=attach_type)
    return _charged(BPF_PROG_LOAD, a)


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int = 0,
               name: bytes = b"") -> tuple[int, int]:
    """(fd or -1, errno): one map, without BTF. name: 15 characters kept, as for programs."""
    return _charged(BPF_MAP_CREATE, MapCreateAttr(map_type=map_type, key_size=key_size, value_size=value_size,
                                                  max_entries=max_entries, map_flags=flags, map_name=name[:15]))


def map_info(fd: int) -> MapInfo:
    """The kernel's view of a map. OSError if fd is not one."""
    info = MapInfo()
    fd_, err = sys_bpf(BPF_OBJ_GET_INFO_BY_FD, InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info),
                                                        info=ctypes.addressof(info)))
    if fd_ < 0:
        raise OSError(err, f"map info of fd {fd}: {why(err)}")
    return info


def _charged(cmd: int, attr) -> tuple[int, int]:
    fd, err = sys_bpf(cmd, attr)
    if err == errno.EPERM:  # kernels before 5.11 charge maps and programs to RLIMIT_MEMLOCK: raised as libbpf does
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (OSError, ValueError):
            return fd, err
        fd, err = sys_bpf(cmd, attr)
    return fd, err
