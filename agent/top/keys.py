"""Key presses -> the view state, and the help text that documents the same keys, kept beside the
handler so that a key and its description change together."""

from __future__ import annotations

from .layout import COLUMN_KEYS, ViewState

KEY_UP, KEY_DOWN, KEY_ENTER, KEY_ESC, KEY_BACKSPACE = "UP", "DOWN", "ENTER", "ESC", "BACKSPACE"

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


def _curses_key(ch: int) -> str | None:
    import curses

    table = {curses.KEY_UP: KEY_UP, curses.KEY_DOWN: KEY_DOWN, curses.KEY_ENTER: KEY_ENTER, 10: KEY_ENTER,
             13: KEY_ENTER, 27: KEY_ESC, curses.KEY_BACKSPACE: KEY_BACKSPACE, 127: KEY_BACKSPACE, 8: KEY_BACKSPACE}
    if ch in table:
        return table[ch]
    if 32 <= ch < 127:
        return chr(ch)
    return None
