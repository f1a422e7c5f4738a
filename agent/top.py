"""`mcp-agent top`: a live terminal view of the host, its processes and the newest findings.

Where the data comes from: a running agent's control socket (agent/control.py) when one answers,
else an Agent started here on a background thread, whose exporters only count. Either way the
screen reads snapshot.Snapshot objects that another thread replaced whole: the UI thread never calls
BPF or NVML, so a slow GPU call or a slow agent can leave the figures old, never the screen frozen.

render() is pure: (snapshot, width, height, view state) -> lines of (text, style) segments, each
line at most `width` cells. Curses draws them; --once prints them as plain text (ANSI colour only on
a TTY without NO_COLOR). Every string from a process goes through identity.sanitize_text and is cut
to its column by display cells, so escape sequences, bidi tricks, wide characters, very long names
and non-UTF-8 bytes can neither move the cursor nor push a column out of place.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import unicodedata
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .core.identity import sanitize_text
from .telemetry.snapshot import GpuView, ProcView, RequestView, Snapshot

Segment = tuple[str, str | None]  # (text, style); styles: title head sel warn dim ok
Line = list[Segment]


# --- text that fits ------------------------------------------------------------------------------


def char_cells(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def cells(text: str) -> int:
    return sum(char_cells(c) for c in text)


def _safe(text: str) -> str:
    """sanitize_text, plus format characters (zero-width joiners and the like) escaped: on a
    terminal they are invisible and make the cell count lie."""
    text = sanitize_text(text, 4096)
    if all(unicodedata.category(c)[0] != "C" for c in text):
        return text
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in ("Cf", "Cn", "Co") else c for c in text)


def fit(text, width: int, align: str = "<") -> str:
    """Sanitised text cut (with "…") or padded to exactly `width` terminal cells."""
    if width <= 0:
        return ""
    text = _safe("" if text is None else str(text))
    if cells(text) > width:
        out, used = [], 0
        for ch in text:
            w = char_cells(ch)
            if used + w > width - 1:
                break
            out.append(ch)
            used += w
        text = "".join(out) + "…"
    pad = " " * (width - cells(text))
    return pad + text if align == ">" else text + pad


def line_text(line: Line) -> str:
    return "".join(t for t, _ in line)


def fmt_num(v: float | None) -> str:
    if v is None:
        return "-"
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:.1f}G"
    if a >= 1e6:
        return f"{v / 1e6:.1f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if a >= 100 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.1f}" if a >= 10 else f"{v:.2f}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n}B"


def fmt_clock(wall_ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall_ns / 1e9)) if wall_ns else "--:--:--"


# --- columns -------------------------------------------------------------------------------------


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
    Column("offcpu", "OFF%", 5, 3, lambda p: p.offcpu_pct, lambda p: fmt_num(p.offcpu_pct),
           help="off-CPU time, % of one core (threads summed)"),
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


# --- view state ----------------------------------------------------------------------------------


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


# --- rendering -----------------------------------------------------------------------------------


def _gpu_line(g: GpuView, width: int) -> Line:
    if not g.up:
        return [(fit(f"GPU{g.index} {g.bus_id or ''} DOWN: {g.down_reason or '?'}", width), "warn")]
    mem = (f"mem {fmt_bytes(g.mem_used_bytes)}/{fmt_bytes(g.mem_total_bytes)}"
           if g.mem_total_bytes else "mem -")
    parts = [f"GPU{g.index} {fmt_num(g.util_pct)}%", mem]
    if g.sm_clock_mhz is not None:
        parts.append(f"SM {g.sm_clock_mhz}MHz")
    if g.power_w is not None:
        parts.append(f"{g.power_w:.0f}W")
    if g.temperature_c is not None:
        parts.append(f"{g.temperature_c}C")
    head = " ".join(parts) + " "
    link = (f"Gen{g.link_gen or '?'}x{g.link_width or '?'}/Gen{g.link_gen_max or '?'}x{g.link_width_max or '?'}"
            if (g.link_gen or g.link_width) else "link -")
    link += " DEGRADED" if g.link_degraded else ""
    tail = []
    if g.aer_correctable is not None:
        tail.append(f"AER {g.aer_correctable}/{g.aer_nonfatal}/{g.aer_fatal}")
    if g.xid_count:
        tail.append(f"Xid {g.xid_count} (last {g.last_xid})")
    if g.throttle:
        tail.append("thr " + ",".join(g.throttle))
    tail_s = (" " + " ".join(tail)) if tail else ""
    line: Line = [(head, None), (link, "warn" if g.link_degraded else None), (tail_s, None)]
    return _clip(line, width)


def _clip(line: Line, width: int) -> Line:
    """Cut a line of segments to width cells (each segment sanitised), padded to width."""
    out: Line = []
    left = width
    for text, style in line:
        if left <= 0:
            break
        t = _safe(text)
        if cells(t) > left:
            t = fit(t, left)
        out.append((t, style))
        left -= cells(t)
    if left > 0:
        out.append((" " * left, None))
    return out


def _header(snap: Snapshot, width: int, st: ViewState) -> list[Line]:
    h, a = snap.host, snap.agent
    src = "attached to agent socket" if snap.source == "socket" else "local probes"
    title = (f"mcp-agent top - {h.hostname} - {fmt_clock(snap.t_wall_ns)} - {src}"
             f" - probes {a.probes_attached}/{a.probes_total}")
    lines: list[Line] = [_clip([(title, "title")] + ([("  PAUSED", "warn")] if st.paused else []), width)]
    if h.mem_total_bytes:
        avail = h.mem_available_bytes or 0
        mem = f"Mem {fmt_bytes(h.mem_total_bytes)} avail {fmt_bytes(avail)} ({avail * 100 // h.mem_total_bytes}%)"
    else:
        mem = "Mem -"
    psi = ("PSI mem some %.2f full %.2f" % (h.psi_some_avg10 or 0.0, h.psi_full_avg10 or 0.0)
           if h.psi_some_avg10 is not None else "PSI -")
    swap = f"Swap {fmt_bytes((h.swap_total_bytes or 0) - (h.swap_free_bytes or 0))}/{fmt_bytes(h.swap_total_bytes)}" \
        if h.swap_total_bytes else "Swap none"
    lines.append(_clip([(f"{mem}  {psi}  {swap}", None)], width))
    ks: Line = [("kswapd", None)]
    for k in h.kswapd:
        ks.append((f" n{k.node}:", None))
        ks.append(("AWAKE" if k.awake else "asleep", "warn" if k.awake else None))
        if k.active_pct:
            ks.append((f" {k.active_pct:.0f}%", None))
    if not h.kswapd:
        ks.append((" -", None))
    ks.append(("  storm: ", None))
    ks.append((("STORM " + ",".join(h.storm_scopes)) if h.storm else "none", "warn" if h.storm else "ok"))
    down = [n.name for n in h.nics if n.down_since_wall_ns is not None]
    if down:  # before the counters: a link lost during the incident matters more at 80 columns
        ks.append(("  NIC DOWN " + ",".join(down), "warn"))
    ks.append((f"  req {a.requests_total} open {a.open_requests}  lost {a.lost_kernel}/{a.lost_user}", None))
    if h.xid_total:
        ks.append((f"  Xid {h.xid_total}", "warn"))
    lines.append(_clip(ks, width))
    return lines


def _gpu_lines(snap: Snapshot, width: int, room: int) -> list[Line]:
    gpus = snap.host.gpus
    if not gpus:
        why = snap.host.nvml or "-"
        return [_clip([(f"GPU none ({'NVML ' + why if why != 'ok' else 'none found'})", "dim")], width)]
    if len(gpus) <= room:
        return [_gpu_line(g, width) for g in gpus]
    # too many for the room: the degraded and down ones first, then a summary line
    order = sorted(gpus, key=lambda g: (g.up and not g.link_degraded, g.index))
    shown = order[:max(0, room - 1)]
    rest = [g for g in gpus if g not in shown]
    bad = sum(1 for g in rest if g.link_degraded or not g.up)
    mean = [g.util_pct for g in rest if g.util_pct is not None]
    summary = f"+{len(rest)} GPUs, util mean {fmt_num(sum(mean) / len(mean)) if mean else '-'}%"
    summary += f", {bad} degraded/down" if bad else ""
    return [_gpu_line(g, width) for g in sorted(shown, key=lambda g: g.index)] + \
        [_clip([(summary, "warn" if bad else None)], width)]


def _table(rows: list[ProcView], width: int, height: int, st: ViewState) -> list[Line]:
    cols, cmd_w = layout(width, st.containers)
    st.visible_cols = tuple(c.key for c in cols)

    def w(c):
        return cmd_w if c.key == "command" else c.width

    head = []
    for c in cols:
        title = ("▼" if st.descending else "▲") + c.title if c.key == st.sort else c.title
        head.append(fit(title, w(c), c.align))
    lines: list[Line] = [_clip([(" ".join(head), "head")], width)]
    body = max(0, height - 1)
    if st.selected_pid is not None:
        keys = [p.pid if not st.containers else p.container_id for p in rows]
        if st.selected_pid in keys:
            st.selected_row = keys.index(st.selected_pid)
    st.selected_row = max(0, min(st.selected_row, len(rows) - 1))
    top = max(0, st.selected_row - body + 1)
    for i, p in enumerate(rows[top:top + body], start=top):
        text = " ".join(fit(c.text(p), w(c), c.align) for c in cols)
        lines.append(_clip([(text, "sel" if i == st.selected_row else None)], width))
    if not rows:
        msg = f"no process matches filter {st.filter!r}" if st.filter else \
            "no watched process yet (GPU processes and processes that mark requests are watched)"
        lines.append(_clip([(msg, "dim")], width))
    return lines


RECENT_ROOM = 12  # lines the expanded view would like before findings get more
REQ_COLS = (("ENDED", 8, "<"), ("REQUEST", 16, "<"), ("TID", 7, ">"), ("DURms", 8, ">"), ("FLT", 6, ">"),
            ("OFFms", 7, ">"), ("RCLMms", 7, ">"), ("LNCH", 6, ">"), ("SYNCms", 7, ">"), ("IOCTL", 6, ">"),
            ("END", 12, "<"))


def _req_cells(r: RequestView) -> tuple[str, ...]:
    return (fmt_clock(r.end_wall_ns), r.request_id, str(r.tid), fmt_num(r.duration_ms), fmt_num(r.faults),
            fmt_num(r.offcpu_ms), fmt_num(r.reclaim_ms), fmt_num(r.launches), fmt_num(r.sync_ms),
            fmt_num(r.ioctls), r.end_reason)


def _expanded(snap: Snapshot, pid: int, width: int, height: int) -> list[Line]:
    p = next((x for x in snap.processes if x.pid == pid), None)
    lines: list[Line] = []
    if p is None:
        return [_clip([(f"process {pid} is no longer watched (Esc: back)", "dim")], width)]
    lines.append(_clip([(f"PID {p.pid} ", "title"), (p.name or p.command, "title"),
                        (f"  container {p.container_id or '-'}  GPU {','.join(map(str, p.gpus)) or '-'}"
                         f"  requests {p.requests_total}  p50 {fmt_num(p.p50_ms)}ms p99 {fmt_num(p.p99_ms)}ms", None)],
                       width))
    lines.append(_clip([("cmd: ", "dim"), (p.command_line or "-", None)], width))
    cols = [c for c in REQ_COLS]
    while cols and sum(c[1] + 1 for c in cols) - 1 > width and len(cols) > 4:
        cols.pop(-2)  # drop from the right, keeping END
    idx = [REQ_COLS.index(c) for c in cols]
    lines.append(_clip([(" ".join(fit(c[0], c[1], c[2]) for c in cols), "head")], width))
    reqs = snap.requests_of(pid)
    if not reqs:
        lines.append(_clip([("no marked request ended recently in this process", "dim")], width))
    for r in reqs[:max(0, height - 3)]:
        cells_ = _req_cells(r)
        text = " ".join(fit(cells_[i], c[1], c[2]) for i, c in zip(idx, cols))
        lines.append(_clip([(text, "warn" if r.error else None)], width))
    return lines


HELP = (
    ("<  >", "sort by the column left / right of the current one"),
    ("1-9 0", "sort by the Nth column shown (0: the 10th)"),
    ("r", "reverse the sort order"),
    ("/", "filter by name, command line, container or pid (Enter keeps, Esc clears)"),
    ("c", "group rows by container"),
    ("p / space", "pause / resume refreshing"),
    ("Up Down j k", "select a process"),
    ("Enter / e", "expand the selected process: its recent request spans (Esc: back)"),
    ("h / ?", "this help"),
    ("q", "quit"),
)


def _help(width: int) -> list[Line]:
    lines: list[Line] = [_clip([("keys", "head")], width)]
    lines += [_clip([(fit(k, 12), "title"), (" " + d, None)], width) for k, d in HELP]
    lines.append(_clip([("columns", "head")], width))
    lines += [_clip([(fit(c.title, 12), "title"), (" " + c.help, None)], width) for c in COLUMNS]
    return lines


OK_FINDINGS = ("reclaim_storm_close", "link_restored", "nic_carrier_up", "nic_speed_up")


def _findings(snap: Snapshot, width: int, n: int) -> list[Line]:
    lines: list[Line] = [_clip([("FINDINGS (newest first)", "head")], width)]
    if not snap.findings:
        lines.append(_clip([("none", "dim")], width))
    for f in snap.findings[:max(0, n)]:
        style = "ok" if f.kind in OK_FINDINGS else "warn"
        lines.append(_clip([(fmt_clock(f.t_wall_ns) + " ", "dim"), (f.text, style)], width))
    return lines


def _footer(st: ViewState, width: int) -> Line:
    if st.editing:
        return _clip([("filter: ", "title"), (st.filter + "_", None), ("  (Enter: keep, Esc: clear)", "dim")], width)
    keys = "q quit  h help  </> sort  / filter  p pause  Enter expand  c containers"
    bits = [(keys, "dim")]
    if st.filter:
        bits.append((f"  filter: {st.filter}", "title"))
    if st.status:
        bits.append((f"  {st.status}", "warn"))
    return _clip(bits, width)


def render(snap: Snapshot | None, width: int, height: int | None, st: ViewState) -> list[Line]:
    """One frame. height None: as many lines as the content needs (--once)."""
    width = max(20, width)
    tall = height is None
    height = 10_000 if tall else max(5, height)
    if snap is None:
        lines = [_clip([("mcp-agent top", "title")], width),
                 _clip([(st.status or "waiting for the first snapshot…", None)], width)]
        return (lines + [_clip([], width)] * (height - 3) + [_footer(st, width)])[:height] if not tall else lines
    head = _header(snap, width, st)
    gpu_room = max(1, (height - 12) // 3) if not tall else len(snap.host.gpus) or 1
    head += _gpu_lines(snap, width, gpu_room)
    foot = [] if tall else [_footer(st, width)]
    if st.help:  # the help takes the findings' room too
        body = _help(width)
        if tall:
            return head + body
        body_h = height - len(head) - len(foot)
        body = body[:max(0, body_h)] + [_clip([], width)] * (body_h - len(body))
        return (head + body + foot)[:height]
    rows = sorted_rows(snap, st) if st.expanded is None else []
    n_find = len(snap.findings) or 1
    if not tall:
        # findings get height/8 lines, more when the table (as filtered) leaves room, never all of it
        free = height - len(head) - len(foot) - 1 - (max(1, len(rows)) + 1 if st.expanded is None else RECENT_ROOM)
        n_find = max(1, min(n_find, max(height // 8, free - 1)))
    find = _findings(snap, width, n_find)
    body_h = height - len(head) - len(find) - len(foot)
    if st.expanded is not None:
        body = _expanded(snap, st.expanded, width, 10_000 if tall else body_h)
    else:
        st.rows = rows
        body = _table(rows, width, len(rows) + 1 if tall else body_h, st)
    if tall:
        return head + body + find
    body = body[:max(0, body_h)]
    body += [_clip([], width)] * (body_h - len(body))
    return (head + body + find + foot)[:height]


# --- keys ----------------------------------------------------------------------------------------

KEY_UP, KEY_DOWN, KEY_ENTER, KEY_ESC, KEY_BACKSPACE = "UP", "DOWN", "ENTER", "ESC", "BACKSPACE"


def handle_key(st: ViewState, key: str) -> None:
    """One key press -> the view state. Pure apart from st."""
    if st.editing:
        if key == KEY_ENTER:
            st.editing = False
        elif key == KEY_ESC:
            st.editing, st.filter = False, ""
        elif key == KEY_BACKSPACE:
            st.filter = st.filter[:-1]
        elif len(key) == 1 and key.isprintable() and len(st.filter) < 64:
            st.filter += key
        st.selected_row, st.selected_pid = 0, None
        return
    if key == "q":
        st.quit = True
    elif key in ("h", "?"):
        st.help = not st.help
    elif key == KEY_ESC:
        st.help, st.expanded = False, None
    elif key in ("p", " "):
        st.paused = not st.paused
    elif key == "/":
        st.editing, st.help, st.expanded, st.filter = True, False, None, ""
    elif key == "c":
        st.containers = not st.containers
        st.selected_row, st.selected_pid, st.expanded = 0, None, None
    elif key == "r":
        st.descending = not st.descending
    elif key in ("<", ">", ",", "."):
        vis = [k for k in st.visible_cols] or list(COLUMN_KEYS)
        i = vis.index(st.sort) if st.sort in vis else 0
        i = (i + (-1 if key in ("<", ",") else 1)) % len(vis)
        st.sort = vis[i]
        st.descending = st.sort not in ("pid", "command", "container")
    elif key.isdigit() and len(key) == 1:
        vis = list(st.visible_cols)
        n = 9 if key == "0" else int(key) - 1
        if n < len(vis):
            if st.sort == vis[n]:
                st.descending = not st.descending
            else:
                st.sort = vis[n]
                st.descending = st.sort not in ("pid", "command", "container")
    elif key in (KEY_UP, "k", KEY_DOWN, "j"):
        if st.rows:
            st.selected_row = max(0, min(len(st.rows) - 1, st.selected_row + (-1 if key in (KEY_UP, "k") else 1)))
            sel = st.rows[st.selected_row]
            st.selected_pid = sel.container_id if st.containers else sel.pid
    elif key in (KEY_ENTER, "e"):
        if st.expanded is not None:
            st.expanded = None
        elif st.rows and not st.containers:
            st.expanded = st.rows[min(st.selected_row, len(st.rows) - 1)].pid
            st.help = False


# --- sources -------------------------------------------------------------------------------------


class SocketSource:
    """A running agent's snapshots, fetched on a background thread every interval."""

    kind = "socket"

    def __init__(self, path: str, interval_s: float):
        from .control import ControlClient

        self.client = ControlClient(path)
        self.interval_s = interval_s
        self.snap: Snapshot | None = None
        self.status = f"attaching to {path}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcp-top-fetch", daemon=True)

    def start(self) -> None:
        self._fetch()
        self._thread.start()

    def _fetch(self) -> None:
        from .control import ControlError

        try:
            self.snap = self.client.snapshot()
            self.status = ""
        except ControlError as e:
            self.status = f"agent lost: {e} (showing the last snapshot)"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._fetch()

    def latest(self) -> Snapshot | None:
        return self.snap

    def wait_ready(self, timeout_s: float) -> Snapshot | None:
        return self.snap

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.client.close()


# How long `q` waits for local probes to detach: each uprobe detach waits an RCU-tasks grace period,
# seconds in all for a libcuda's ~40 on a loaded host, and exiting under a detach crashes in bcc.
LOCAL_STOP_S = 30.0


class LocalSource:
    """An Agent started here on a background thread; exporters that only count."""

    kind = "local"

    def __init__(self, cfg):
        self.cfg = cfg
        self.agent = None
        self.status = "starting the probes (compiling BPF)…"
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcp-top-agent", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _progress(self, text: str) -> None:
        self.status = sanitize_text(text, 200)

    def _run(self) -> None:
        from .exporters import Exporters, ExportStats
        from .exporters.counting import CountingSpanExporter, MultiSpanExporter

        from .core.agent import Agent, StartError

        stats = ExportStats()
        exporters = Exporters(CountingSpanExporter(MultiSpanExporter([]), stats), [], stats,
                              ["none: top counts, exports nothing"])
        try:
            agent = Agent(self.cfg, exporters=exporters, progress=self._progress)
            agent.start()
        except StartError as e:
            self.error = self.status = str(e)
            return
        except Exception as e:  # shown on the screen and returned as the exit status
            self.error = self.status = f"starting the probes failed: {e}"
            return
        self.agent = agent
        self.status = ""
        try:
            agent.run(self._stop)
        finally:
            agent.stop(timeout_s=2.0)

    def latest(self) -> Snapshot | None:
        a = self.agent
        if a is None or getattr(a, "snapshots", None) is None:
            return None
        snap = a.snapshots.latest()
        return snap if snap.seq else None

    def wait_ready(self, timeout_s: float, min_seq: int = 2) -> Snapshot | None:
        """Wait for a snapshot with rates (the second tick), the probes' start, or an error."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.error is None:
            s = self.latest()
            if s is not None and s.seq >= min_seq:
                return s
            time.sleep(0.05)
        return self.latest()

    def stop(self, note: Callable[[str], None] | None = None) -> bool:
        """Stop the agent (drain, detach: seconds with many uprobes on a busy host). False when its
        thread is still at it after LOCAL_STOP_S."""
        self._stop.set()
        if not self._thread.is_alive():
            return True
        self._thread.join(1.0)
        if self._thread.is_alive() and note is not None:
            note("stopping: detaching the probes…")
        self._thread.join(LOCAL_STOP_S - 1.0)
        return not self._thread.is_alive()


# --- output --------------------------------------------------------------------------------------

ANSI = {"title": "\033[1m", "head": "\033[7m", "sel": "\033[7m", "warn": "\033[1;31m", "dim": "\033[2m",
        "ok": "\033[32m"}


def colour_allowed(stream=None) -> bool:
    stream = stream or sys.stdout
    return not os.environ.get("NO_COLOR") and stream.isatty()


def _ascii(text: str, stream) -> str:
    enc = (getattr(stream, "encoding", None) or "ascii").lower().replace("-", "")
    return text if enc in ("utf8", "utf8mb4") else to_ascii(text)


def frame_text(lines: list[Line], colour: bool, stream=None) -> str:
    stream = stream or sys.stdout
    out = []
    for line in lines:
        if colour:
            out.append("".join(f"{ANSI[s]}{t}\033[0m" if s in ANSI else t for t, s in line).rstrip())
        else:
            out.append(line_text(line).rstrip())
    return _ascii("\n".join(out), stream) + "\n"


_ASCII = str.maketrans({"▼": "v", "▲": "^", "…": "~"})


def to_ascii(text: str) -> str:
    """For a terminal that is not UTF-8: our own symbols spelled in ASCII, anything else as "?"."""
    return text.translate(_ASCII).encode("ascii", "replace").decode()


def _curses_key(ch: int) -> str | None:
    import curses

    table = {curses.KEY_UP: KEY_UP, curses.KEY_DOWN: KEY_DOWN, curses.KEY_ENTER: KEY_ENTER, 10: KEY_ENTER,
             13: KEY_ENTER, 27: KEY_ESC, curses.KEY_BACKSPACE: KEY_BACKSPACE, 127: KEY_BACKSPACE, 8: KEY_BACKSPACE}
    if ch in table:
        return table[ch]
    if 32 <= ch < 127:
        return chr(ch)
    return None


class _LogTail(logging.Handler):
    """Log records while curses owns the terminal: kept for the footer, not written over the screen."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: deque[str] = deque(maxlen=20)

    def emit(self, record):
        self.lines.append(sanitize_text(record.getMessage(), 200))


def run_curses(source, interval_s: float, st: ViewState) -> None:
    import curses

    def loop(scr):
        try:
            curses.set_escdelay(25)  # Esc closes views: do not wait a second for an escape sequence
        except (AttributeError, curses.error):
            pass
        try:
            curses.curs_set(0)
        except curses.error:
            pass
        colour = colour_allowed() and curses.has_colors()
        if curses.has_colors():
            try:  # curses.wrapper started colour: keep the terminal's own fore/background, even with NO_COLOR
                curses.use_default_colors()
                bg = -1
            except curses.error:
                bg = curses.COLOR_BLACK
        attrs = {None: curses.A_NORMAL, "title": curses.A_BOLD, "head": curses.A_REVERSE,
                 "sel": curses.A_REVERSE | curses.A_BOLD, "warn": curses.A_BOLD, "dim": curses.A_DIM,
                 "ok": curses.A_NORMAL}
        if colour:
            curses.init_pair(1, curses.COLOR_RED, bg)
            curses.init_pair(2, curses.COLOR_GREEN, bg)
            curses.init_pair(3, curses.COLOR_CYAN, bg)
            attrs.update({"warn": curses.color_pair(1) | curses.A_BOLD, "ok": curses.color_pair(2),
                          "title": curses.color_pair(3) | curses.A_BOLD})
        scr.timeout(100)
        scr.keypad(True)
        ascii_only = not _utf8_locale()
        shown, last_seq, last_draw, dirty = None, None, 0.0, True
        while not st.quit:
            snap = source.latest()
            if snap is not None and not st.paused and (shown is None or
                                                       time.monotonic() - last_draw >= interval_s * 0.9):
                if snap.seq != last_seq or snap is not shown:
                    shown, last_seq, dirty = snap, snap.seq, True
            status = getattr(source, "status", "")
            if status != st.status:
                st.status, dirty = status, True
            if dirty:
                h, w = scr.getmaxyx()
                lines = render(shown, w, h, st)
                scr.erase()
                for y, line in enumerate(lines[:h]):
                    x = 0
                    for text, style in line:
                        if x >= w:
                            break
                        if ascii_only:
                            text = to_ascii(text)
                        try:
                            scr.addstr(y, x, text[: max(0, w - x)], attrs.get(style, curses.A_NORMAL))
                        except curses.error:  # the bottom-right cell: curses moves the cursor past it
                            pass
                        x += cells(text)
                scr.noutrefresh()
                curses.doupdate()
                last_draw, dirty = time.monotonic(), False
            ch = scr.getch()
            if ch == -1:
                continue
            if ch == curses.KEY_RESIZE:
                dirty = True
                continue
            key = _curses_key(ch)
            if key is not None:
                handle_key(st, key)
                dirty = True

    curses.wrapper(loop)


def _utf8_locale() -> bool:
    import locale

    return (locale.getpreferredencoding(False) or "").lower().replace("-", "") == "utf8"


def run_stream(source, interval_s: float, st: ViewState, stream) -> None:
    """stdout not a TTY and no --once: a plain frame every interval, like `top -b`."""
    width = _term_width(stream)
    last = None
    while True:
        snap = source.latest()
        if snap is not None and snap.seq != last:
            stream.write(frame_text(render(snap, width, None, st), False, stream) + "\n")
            stream.flush()
            last = snap.seq
        time.sleep(interval_s)


def _term_width(stream) -> int:
    import shutil

    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    return shutil.get_terminal_size((120, 40)).columns if stream.isatty() else 120


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(*, cfg_loader: Callable[[], object], socket_path: str | None, local: bool, interval_s: float,
         once: bool, as_json: bool, stream=None) -> int:
    """The `top` command. Returns the exit status; errors are one line on stderr."""
    from . import control

    stream = stream or sys.stdout
    explicit = socket_path is not None
    cfg = cfg_loader()
    path = socket_path or cfg.control_socket
    source, why = None, "control.socket is off"
    if not local and path:
        client = control.ControlClient(path, 1.0)
        try:
            client.ping()
            source = SocketSource(path, interval_s)
        except control.ControlError as e:
            why = str(e)
        finally:
            client.close()
        if source is None and explicit:
            sys.stderr.write(f"mcp-agent: error: {why}\n")
            return 1
    if source is None:
        if os.geteuid() != 0:
            sys.stderr.write(f"mcp-agent: error: {why}; starting the probes here needs root; "
                             "HINT: sudo mcp-agent top, or start `mcp-agent run`\n")
            return 1
        source = LocalSource(cfg)
    st = ViewState()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # restore the terminal and stop the probes on kill
    tail = None
    saved_fd = None
    interactive = not (once or as_json) and stream.isatty() and sys.stdin.isatty()
    if interactive and source.kind == "local":
        # bcc's compiler writes warnings straight to fd 2, and the agent logs: neither may scribble
        # over the screen. Restored before anything is reported.
        tail = _LogTail()
        root = logging.getLogger()
        saved_handlers, root.handlers = root.handlers, [tail]
        saved_fd = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    rc, err, stopped = 0, None, True
    try:
        source.start()
        if once or as_json:
            snap = source.wait_ready(30.0 + 3 * interval_s) if source.kind == "local" else source.latest()
            if snap is None:
                err = f"no snapshot: {getattr(source, 'error', None) or source.status}"
            elif as_json:
                stream.write(json.dumps(snap.to_dict(), separators=(",", ":")) + "\n")
            else:
                stream.write(frame_text(render(snap, _term_width(stream), None, st), colour_allowed(stream), stream))
            stream.flush()
        elif interactive:
            run_curses(source, interval_s, st)
            err = getattr(source, "error", None)
        else:
            if source.kind == "local":
                source.wait_ready(30.0 + 3 * interval_s, min_seq=1)
            run_stream(source, interval_s, st, stream)
    except KeyboardInterrupt:
        pass
    finally:
        def note(text: str) -> None:  # the terminal, while fd 2 still hides bcc's detach noise
            os.write(saved_fd, f"mcp-agent: {text}\n".encode())

        if source.kind == "local":
            stopped = source.stop(note if saved_fd is not None else None)
        else:
            source.stop()
        if saved_fd is not None:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            logging.getLogger().handlers = saved_handlers
    if err:
        sys.stderr.write(f"mcp-agent: error: {err}\n")
        rc = 1
    if not stopped:
        # The agent's thread is still detaching: interpreter shutdown would run bcc's atexit cleanup
        # on the same objects under it (double closes, a crash). The kernel detaches what a process
        # held when it exits.
        sys.stderr.write(f"mcp-agent: warning: the probes did not detach within {LOCAL_STOP_S:.0f} s; "
                         "exiting without waiting\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
