"""The `mcp-agent` command's entry point (and `python -m mcp_hostagent`): for `run`, the BPF
compile's slow beginnings are begun before the CLI is imported (core/loader.py begin_early)."""

from __future__ import annotations

import sys


def main() -> None:
    args = sys.argv[1:]
    # `run` only: its --help and --show-config compile nothing, and no other command compiles
    if args[:1] == ["run"] and not {"-h", "--help", "--show-config"} & set(args):
        from .core import loader

        loader.begin_early()
    from .cli import main as cli_main

    cli_main()
