"""A Snapshot into a frame: lines of (text, style) segments, each line at most `width` cells.

render() is pure: (snapshot, width, height, view state) -> lines. Curses draws them (screen.py);
--once prints them with frame_text as plain text (ANSI colour when screen.colour_allowed says so).
"""

from __future__ import annotations

import sys

from ..telemetry.snapshot import GpuView, ProcView, RequestView, Snapshot
from .keys import HELP
from .layout import COLUMNS, ViewState, layout, sorted_rows
from .text import Line, _clip, fit, fmt_bytes, fmt_clock, fmt_num, line_text, to_ascii


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


ANSI = {"title": "\033[1m", "head": "\033[7m", "sel": "\033[7m", "warn": "\033[1;31m", "dim": "\033[2m",
        "ok": "\033[32m"}


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
