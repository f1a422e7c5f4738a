"""BPF C sources, shipped as package data; compiled by bcc at start-up (see mcp_hostagent.loader)."""
