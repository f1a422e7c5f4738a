"""The process table's columns, which of them fit a width, the view state the keys change, and the
row order; shared by the renderer (which reads it) and the key handler (which changes it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..telemetry.snapshot import ProcView, Snapshot
from .text import fmt_num


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    width: int
    keep: int  # lower is kept first when the terminal is narrow
    get: Callable[[ProcView], object]
    text: Callable[[ProcView], str]
    align: str = ">"
    help: str = ""


def _ctr(p: ProcView) -> str:
    return (p.container_id or "-")[:12]


COLUMNS = (
    Column("pid", "PID", 7, 0, lambda p: p.pid, lambda p: str(p.pid) if p.pid is not None else "-",
           help="process id"),
    Column("command", "COMMAND", 12, 0, lambda p: p.command.lower(), lambda p: p.command, "<",
           help="command line (sanitised; Enter shows all of it)"),
    Column("container", "CONTAINER", 12, 8, lambda p: p.container_id or "", _ctr, "<",
           help="container id (first 12)"),
    Column("gpu", "GPU", 3, 7, lambda p: p.gpus[0] if p.gpus else None,
           lambda p: ",".join(map(str, p.gpus)) or "-", help="GPUs NVML lists the process on"),
    Column("req", "REQ/s", 6, 1, lambda p: p.req_per_s, lambda p: fmt_num(p.req_per_s),
           help="marked requests ended per second"),
    Column("p50", "P50ms", 7, 2, lambda p: p.p50_ms, lambda p: fmt_num(p.p50_ms),
           help="median request latency, last 10 s"),
    Column("p99", "P99ms", 7, 2, lambda p: p.p99_ms, lambda p: fmt_num(p.p99_ms),
           help="99th percentile request latency, last 10 s"),
    Column("launch", "LNCH/s", 7, 4, lambda p: p.launches_per_s, lambda p: fmt_num(p.launches_per_s),
           help="CUDA kernel + graph launches per second"),
    Column("ctx", "CTXus", 6, 6, lambda p: p.ctx_switch_us, lambda p: fmt_num(p.ctx_switch_us),
           help="mean CUDA context push/pop/set time, us"),
    Column("sync", "SYNCms/s", 8, 6, lambda p: p.sync_ms_per_s, lambda p: fmt_num(p.sync_ms_per_s),
           help="CUDA synchronize wait, ms per second"),
    Column("ioctl", "IOCTL/s", 7, 7, lambda p: p.ioctls_per_s, lambda p: fmt_num(p.ioctls_per_s),
           help="ioctls on NVIDIA device files per second"),
    Column("faults", "FLT/s", 7, 3, lambda p: p.faults_per_s, lambda p: fmt_num(p.faults_per_s),
           help="user page faults per second"),
    Column("reclaim", "RCLMms/s", 8, 5, lambda p: p.reclaim_ms_per_s, lambda p: fmt_num(p.reclaim_ms_per_s),
           help="direct + memcg reclaim stall, ms per second"),
    # not OFF% (all time switched out): for an idle server that is mostly sleep, not a cost
    Column("wait", "WAIT%", 5, 3, lambda p: p.wait_pct, lambda p: fmt_num(p.wait_pct),
           help="time runnable but not running (preempted, or woken and not yet on a CPU), % of one core (threads summed)"),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)


def layout(width: int, containers: bool = False) -> tuple[list[Column], int]:
    """The columns that fit in width (by `keep`, shown in table order) and COMMAND's width."""
    cols = [c for c in COLUMNS]
    if containers:
        cols = [c for c in cols if c.key != "pid"]
    keep = sorted(cols, key=lambda c: (0 if containers and c.key == "container" else c.keep, COLUMNS.index(c)))
    chosen, used = [], 0
    for c in keep:
        need = c.width + (1 if chosen else 0)
        if used + need <= width:
            chosen.append(c)
            used += need
    shown = [c for c in cols if c in chosen]
    extra = max(0, width - used)
    cmd_w = next((c.width for c in shown if c.key == "command"), 0) + extra
    return shown, cmd_w


@dataclass
class ViewState:
    sort: str = "req"
    descending: bool = True
    filter: str = ""
    editing: bool = False  # typing a filter after "/"
    paused: bool = False
    selected_pid: int | None = None
    selected_row: int = 0
    expanded: int | None = None  # pid whose recent requests are shown
    help: bool = False
    containers: bool = False
    quit: bool = False
    status: str = ""  # the source's state (starting, attached, lost) for the footer
    visible_cols: tuple[str, ...] = COLUMN_KEYS
    rows: list = field(default_factory=list)  # the rows on screen, for selection by the keys


def matches(p: ProcView, text: str) -> bool:
    if not text:
        return True
    t = text.lower()
    fields = (p.command, p.name, p.command_line or "", p.container_id or "", p.pod_uid or "",
              str(p.pid) if p.pid is not None else "")
    return any(t in f.lower() for f in fields)


def sorted_rows(snap: Snapshot, st: ViewState) -> list[ProcView]:
    rows = [p for p in (snap.containers if st.containers else snap.processes) if matches(p, st.filter)]
    col = next((c for c in COLUMNS if c.key == st.sort), COLUMNS[4])
    have = [p for p in rows if col.get(p) is not None]
    none = [p for p in rows if col.get(p) is None]  # unknowns last, whichever the direction
    have.sort(key=lambda p: (col.get(p), -(p.pid or 0)), reverse=st.descending)
    none.sort(key=lambda p: p.pid or 0)
    return have + none
