"""Secrets out of what the agent exports and prints: argv values and URL userinfo. Pure.

The agent exports every watched process's command line (process.command_line), and prints its own
collector endpoint; both are where credentials get pasted (`--api-key=...`, `https://user:pw@host`).
Redaction is by shape, not by knowing the program: it removes more than the secrets (a
`--max-tokens 512` loses its 512 too) and cannot find a secret that has no telltale name.
"""

from __future__ import annotations

import re
import shlex

MASK = "***"
# An argument whose name holds one of these (case-insensitive, anywhere: "apikey", "X-Auth-Token")
# has its value replaced.
SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "credential", "auth")
COMMAND_LINE_MODES = ("redacted", "full", "off")

_SECRET_NAME = re.compile("|".join(SECRET_WORDS), re.IGNORECASE)
# scheme://userinfo@ ; userinfo stops at what cannot be in it (and at quotes, so that a URL inside
# JSON or TOML text does not run into the next value)
# (greedy up to the authority's last "@": a password may hold an "@" of its own)
_URL_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)([^\s/?#\"']+)@")
# user:password@host without a scheme: how the gRPC exporter logs its target (the URL's netloc)
_BARE_USERINFO = re.compile(r"(?<![^\s(\[=,'\"])([^\s/?#@:\"'(\[=,]+):([^\s/?#@\"']+)@(?=[\w\[])")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")
# an HTTP header as one argument: curl -H "Authorization: Bearer ...", --header "X-Api-Key: ..."
_HEADER_ARG = re.compile(r"([A-Za-z0-9-]+)\s*:\s*\S")


def _userinfo(m: re.Match) -> str:
    user, sep, _ = m.group(2).partition(":")
    # "user:password" keeps the user; a lone userinfo is often the token itself (https://TOKEN@host)
    return f"{m.group(1)}{user}:{MASK}@" if sep else f"{m.group(1)}{MASK}@"


def redact_url(text: str) -> str:
    """Userinfo of every scheme://... URL in text: `http://u:pw@h` -> `http://u:***@h`, `https://tok@h` -> `https://***@h`."""
    return _URL_USERINFO.sub(_userinfo, text) if "@" in text else text


def redact_text(text: str) -> str:
    """redact_url, and also a scheme-less `user:password@host` (log messages carry bare netlocs)."""
    if "@" not in text:
        return text
    return _BARE_USERINFO.sub(rf"\1:{MASK}@", redact_url(text))


def _secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact_argv(args: list[str] | tuple[str, ...]) -> list[str]:
    """A command line with credential-shaped values replaced by ***:

    --name=value / -name=value   when name holds a SECRET_WORD
    --name value                 the argument after such a flag, unless it is itself an option
    NAME=value                   environment-style (`env API_KEY=... cmd`), NAME holding a SECRET_WORD
    Name: value                  an HTTP header as one argument (`-H "Authorization: Bearer ..."`)
    scheme://user:pw@host        userinfo, in any argument
    argv[0] is only checked for URLs."""
    out: list[str] = []
    hide_next = False
    for i, arg in enumerate(args):
        if hide_next and not (arg.startswith("-") and len(arg) > 1):
            out.append(MASK)
            hide_next = False
            continue
        hide_next = False
        arg = redact_url(arg)
        if i > 0:
            name, eq, _ = arg.partition("=")
            if arg.startswith("-") and len(arg) > 1:
                if _secret_name(name):
                    if eq:
                        arg = f"{name}={MASK}"
                    else:
                        hide_next = True
            elif eq and _ENV_NAME.match(name) and _secret_name(name):
                arg = f"{name}={MASK}"
            elif (h := _HEADER_ARG.match(arg)) and _secret_name(h.group(1)):
                arg = f"{h.group(1)}: {MASK}"
        out.append(arg)
    return out


def command_line(args: list[str] | tuple[str, ...], mode: str = "redacted") -> str | None:
    """process.command_line for a process's argv under the process.command_line setting."""
    if mode == "off" or not args:
        return None
    if mode == "full":
        return shlex.join(args)
    if mode != "redacted":
        raise ValueError(f"command line mode {mode!r} is not one of {', '.join(COMMAND_LINE_MODES)}")
    return shlex.join(redact_argv(args))
