"""Text that fits a terminal: widths in display cells, sanitised and fitted strings, number formats.

Separate so that every string bound for the screen passes one pure place: identity.sanitize_text
(the agent's one rule for names: control, format and separator characters escaped), unassigned and
private-use characters escaped too, then cut by display cells, so escape sequences, bidi tricks, wide
characters, very long names and non-UTF-8 bytes can neither move the cursor nor push a column out
of place.
"""

from __future__ import annotations

import time
import unicodedata

from ..core.identity import escape_char, sanitize_text

Segment = tuple[str, str | None]  # (text, style); styles: title head sel warn dim ok
Line = list[Segment]


def char_cells(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def cells(text: str) -> int:
    return sum(char_cells(c) for c in text)


_TERMINAL_ONLY = ("Cn", "Co")  # what a terminal may draw as anything, of any width; exports keep them


def _safe(text: str) -> str:
    """sanitize_text (format characters such as zero-width joiners included: invisible on a terminal,
    they make the cell count lie), plus unassigned and private-use characters escaped the same way."""
    text = sanitize_text(text, 4096)
    if text.isprintable():
        return text
    return "".join(escape_char(c) if unicodedata.category(c) in _TERMINAL_ONLY else c for c in text)


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


_ASCII = str.maketrans({"▼": "v", "▲": "^", "…": "~"})


def to_ascii(text: str) -> str:
    """For a terminal that is not UTF-8: our own symbols spelled in ASCII, anything else as "?"."""
    return text.translate(_ASCII).encode("ascii", "replace").decode()
