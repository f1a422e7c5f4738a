"""mcp-hostagent: eBPF host-level observability for GPU inference hosts (the `mcp-agent` command)."""

__version__ = "0.1.0"
