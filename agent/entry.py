"""The `mcp-agent` command's entry point (and `python -m mcp_hostagent`): for `run`, the BPF
compile's slow beginnings are begun before the CLI is imported (core/loader.py begin_early)."""

from __future__ import annotations

import sys


def main():
    args = sys.argv[1:]
    # `run` only: its --help and --show-config compile nothing, and no other command compiles
    if args[:1] == ["run"] and not {"-h", "--help", "--show-config"} & set(args):
        from .core import loader

        try:
            loader.begin_early()
        except Exception:  # noqa: BLE001 - a head start only: compile_ahead does it all again and reports what fails
            pass
    from .cli import main as cli_main

    return cli_main()
