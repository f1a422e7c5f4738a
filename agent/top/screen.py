"""The terminal: the curses loop, the plain stream of frames (like `top -b`), and what they need to
know about the terminal (width, locale, whether colour is wanted)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque

from ..core.identity import sanitize_text
from .keys import _curses_key, handle_key
from .layout import ViewState
from .render import frame_text, render
from .text import cells, to_ascii


def colour_allowed(stream=None) -> bool:
    stream = stream or sys.stdout
    return not os.environ.get("NO_COLOR") and stream.isatty()


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
