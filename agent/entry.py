"""The `mcp-agent` command's entry point (and `python -m mcp_hostagent`)."""

from __future__ import annotations

import warnings


def quiet_bcc_escape_warnings() -> None:
    """bcc 0.26's bcc/__init__.py has regexes in plain strings (b'^.*\\.cold...'): Python warns each time
    it compiles that file (SyntaxWarning from 3.12, DeprecationWarning before), which is every start
    where no .pyc for this Python sits beside it: Debian byte-compiles it for its own python3 only,
    and ProtectSystem=strict keeps ours from being written. Two lines in the journal on each start
    that nobody can act on; only that message, only from bcc's files."""
    for category in (SyntaxWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", message="invalid escape sequence", category=category,
                                module=r".*[/\\]bcc[/\\]")  # a compile warning's module is its file's path


def main():
    quiet_bcc_escape_warnings()
    from .cli import main as cli_main

    return cli_main()
