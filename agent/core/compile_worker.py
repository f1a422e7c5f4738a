"""A compile worker process: compiles the unit with one part's probe macros and hands back the
instructions of its programs, not loaded.

Run by core/loader.py as `python -m mcp_hostagent.core.compile_worker`, beside the agent's own compile
of the other probes: libbcc cannot run two compiles in one process (a SIGSEGV, seen), and LLVM is
most of start-up. Started before the agent imports bcc, it imports bcc while the agent does; an
empty stdin (the part came from the compile cache) ends it. Request on stdin, JSON {"text", "cflags", "kernel_source"}; reply on stdout, JSON {"funcs": {name:
base64 instructions}, "maps": {fd: table name}, "license", "kern_version"}. The instructions name
this process's map fds (BPF_PSEUDO_MAP_FD); the agent rewrites them to its own maps of the same
names and loads the programs itself. These maps die with this process. Compiler output goes to
stderr, which the agent shows only when the compile fails.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import signal
import sys


def tables(module) -> dict[int, str]:
    """{map fd: table name} of a compiled bcc module (libbcc exports these; bcc's Python does not declare them)."""
    from bcc import libbcc

    lib = libbcc.lib
    lib.bpf_num_tables.restype, lib.bpf_num_tables.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    lib.bpf_table_name.restype, lib.bpf_table_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]
    lib.bpf_table_fd_id.restype, lib.bpf_table_fd_id.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
    return {lib.bpf_table_fd_id(module, i): lib.bpf_table_name(module, i).decode() for i in range(lib.bpf_num_tables(module))}


def reply_of(module, only: set[str] | None = None) -> dict:
    """The reply for a compiled bcc module: each function's instructions (only those named in `only`,
    if given), the module's tables by map fd, its license and kernel version."""
    from bcc import libbcc

    lib = libbcc.lib
    funcs = {}
    for i in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, i)
        if only is None or name.decode() in only:
            funcs[name.decode()] = base64.b64encode(
                ctypes.string_at(lib.bpf_function_start(module, name), lib.bpf_function_size(module, name))).decode()
    return {"funcs": funcs, "maps": {str(fd): name for fd, name in tables(module).items()},
            "license": lib.bpf_module_license(module).decode(), "kern_version": lib.bpf_module_kern_version(module)}


def main() -> int:
    # The agent decides when this process stops: a ^C or systemd's SIGTERM to the unit's cgroup is
    # for the agent, which finishes its start (taking this reply) and then stops, or kills us.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # libbcc prints some errors on stdout, which carries the reply
    from ..entry import quiet_bcc_escape_warnings

    quiet_bcc_escape_warnings()  # this stderr is shown with a failed compile's own messages
    # bcc first: the agent starts this process before its own import of bcc and writes the request
    # once it knows the part is not in the compile cache (it closes stdin unwritten when it is)
    from bcc import BPF

    class NoAutoAttach(BPF):
        def _trace_autoload(self):  # attached by the agent, not here
            pass

    data = sys.stdin.buffer.read()
    if not data:
        return 0
    req = json.loads(data)
    # libbcc reads BCC_KERNEL_SOURCE when it compiles; this process may have started before the agent set it
    if req.get("kernel_source"):
        os.environ["BCC_KERNEL_SOURCE"] = req["kernel_source"]
    else:
        os.environ.pop("BCC_KERNEL_SOURCE", None)
    try:
        b = NoAutoAttach(text=req["text"].encode(), cflags=req["cflags"])
    except Exception as e:  # noqa: BLE001 - bcc raises bare Exception; the diagnostics are on stderr
        print(f"compile: {e}", file=sys.stderr)
        return 1
    json.dump(reply_of(b.module), reply)
    reply.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
