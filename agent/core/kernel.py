"""What the running kernel offers bcc: headers to compile against, tracefs, tracepoints.

Header choice matters less than it looks: our BPF programs read only tracepoint fields (whose layout
bcc takes from tracefs at compile time), uprobe registers and BPF helpers, never kernel struct
offsets. So Debian's nearest linux-headers tree is safe for a custom kernel with no headers package.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

TRACEFS = "/sys/kernel/tracing"
DEBUGFS = "/sys/kernel/debug"
SAFE_NOTE = "safe: our BPF reads only tracepoint fields, uprobe registers and helpers, never kernel struct offsets"


class KernelSetupError(RuntimeError):
    """The kernel side cannot be prepared; the message carries a hint."""


@dataclass(frozen=True)
class HeaderChoice:
    bcc_kernel_source: str | None  # value for BCC_KERNEL_SOURCE; None: bcc finds /lib/modules/R/build
    description: str
    exact: bool


def _has_kernel_h(tree: str) -> bool:
    return os.path.exists(os.path.join(tree, "include", "linux", "kernel.h"))


def _version_key(path: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", os.path.basename(path))]


def _merge_tree(dst: str, sources: list[str], depth: int = 0) -> None:
    """Symlink farm: entries of every source under dst; directories present in several sources are
    merged recursively (Debian splits one tree into -<flavour> (generated, config) and -common)."""
    os.makedirs(dst, exist_ok=True)
    names: dict[str, list[str]] = {}
    for src in sources:
        for name in os.listdir(src):
            names.setdefault(name, []).append(os.path.join(src, name))
    for name, paths in names.items():
        target = os.path.join(dst, name)
        dirs = [p for p in paths if os.path.isdir(p)]
        if len(dirs) > 1 and depth < 4:
            _merge_tree(target, dirs, depth + 1)
        elif not os.path.lexists(target):
            os.symlink(os.path.realpath(paths[0]), target)


def find_kernel_headers(
    explicit: str | None = None,
    release: str | None = None,
    usr_src: str = "/usr/src",
    modules_root: str = "/lib/modules",
    cache_dir: str = "/run/mcp-hostagent",
    link_modules: bool = False,
) -> HeaderChoice:
    release = release or os.uname().release
    if explicit:
        if not os.path.isdir(os.path.join(explicit, "include")):
            raise KernelSetupError(f"kernel headers {explicit}: no include/ directory there")
        return HeaderChoice(explicit, f"{explicit} (configured)", False)
    build = os.path.join(modules_root, release, "build")
    if os.path.isdir(os.path.join(build, "include")):
        return HeaderChoice(None, f"{os.path.realpath(build)} (matches {release})", True)

    trees = sorted(
        (t for t in glob.glob(os.path.join(usr_src, "linux-headers-*")) if not t.endswith("-common")),
        key=_version_key,
    )
    for tree in reversed(trees):
        parts = [tree]
        if not _has_kernel_h(tree):
            common = re.sub(r"-[a-z0-9]+(-[a-z0-9]+)?$", "-common", tree)
            if not _has_kernel_h(common):
                continue
            parts.append(common)
        name = os.path.basename(tree)
        desc = f"{tree} (nearest to {release}; {SAFE_NOTE})"
        if link_modules:
            os.makedirs(os.path.join(modules_root, release), exist_ok=True)
            os.symlink(parts[0], build)
            if len(parts) > 1:
                os.symlink(parts[1], os.path.join(modules_root, release, "source"))
            return HeaderChoice(None, desc + f"; linked {build}", False)
        if len(parts) == 1:
            return HeaderChoice(tree, desc, False)
        farm = os.path.join(cache_dir, "kernel-src", name)
        if not os.path.isdir(os.path.join(farm, "include")):
            tmp = f"{farm}.{os.getpid()}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            _merge_tree(tmp, parts)
            try:
                os.rename(tmp, farm)
            except OSError:  # another agent built it first
                shutil.rmtree(tmp, ignore_errors=True)
        return HeaderChoice(farm, desc + f" merged with {os.path.basename(parts[1])} at {farm}", False)
    raise KernelSetupError(
        f"no kernel headers for {release}: none at {build} and no {usr_src}/linux-headers-* tree; "
        "HINT: run scripts/setup.sh, or apt-get install linux-headers-$(uname -r), or set kernel.headers"
    )


def _mounted(path: str, proc_mounts: str = "/proc/mounts") -> bool:
    with open(proc_mounts) as f:
        return any(line.split()[1] == path for line in f if len(line.split()) > 2)


_UNREPORTED: list[str] = []  # mounts not yet in a start-up log (the compile begun ahead mounts first)


def ensure_tracefs(report: bool = True) -> list[str]:
    """Mount tracefs (and debugfs, where bcc also looks for tracepoint formats) if needed.
    Returns what this process mounted and no earlier call reported, for the start-up log (report=False:
    keep it for the next call)."""
    done = _UNREPORTED
    for fstype, path in (("tracefs", TRACEFS), ("debugfs", DEBUGFS)):
        if _mounted(path) or (fstype == "debugfs" and _mounted(TRACEFS) and not os.path.isdir(path)):
            continue
        r = subprocess.run(["mount", "-t", fstype, "none", path], capture_output=True, text=True)
        if r.returncode != 0:
            if fstype == "tracefs":
                raise KernelSetupError(f"mount tracefs at {path}: {r.stderr.strip()}; HINT: run as root")
            continue
        done.append(f"mounted {fstype} at {path}")
    if not report:
        return []
    out = list(done)
    done.clear()
    return out


def tracepoint_exists(category: str, event: str) -> bool:
    return os.path.exists(os.path.join(TRACEFS, "events", category, event, "format"))


def prepare(headers: str | None, link_modules: bool, report: bool = True) -> tuple[HeaderChoice, list[str]]:
    """tracefs mounted and the header tree found, for bcc (BCC_KERNEL_SOURCE set in this process's
    environment where the tree is not bcc's default). KernelSetupError if either cannot be had."""
    mounted = ensure_tracefs(report)
    hc = find_kernel_headers(headers, link_modules=link_modules)
    if hc.bcc_kernel_source:
        os.environ["BCC_KERNEL_SOURCE"] = hc.bcc_kernel_source
    return hc, mounted
