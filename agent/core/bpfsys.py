"""The bpf(2) syscall where bcc has no wrapper for what we need: BPF_PROG_LOAD with an expected attach
type (libbcc 0.26's bcc_prog_load has none), used for uprobe_multi programs (agent/cuda/uprobes.py)
and for programs adopted from a compile worker or the compile cache (core/loader.py)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource

BPF_PROG_LOAD = 5
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
    fd, err = sys_bpf(BPF_PROG_LOAD, a)
    if err == errno.EPERM:  # kernels before 5.11 charge programs to RLIMIT_MEMLOCK: raised as libbpf does
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (OSError, ValueError):
            return fd, err
        fd, err = sys_bpf(BPF_PROG_LOAD, a)
    return fd, err
