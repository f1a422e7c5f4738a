"""Zero-code HTTP/1.1 requests of watched processes (bpf/http.bpf.c): request spans with no marker."""

from ..core.capability import Declaration
from ..core.probes import ProbeSpec
from . import records

# What the zero-code HTTP probes cannot see, said wherever they are listed (docs/HTTP.md: the plan)
HTTP_HINT = ("needs CONFIG_FTRACE_SYSCALLS; sees HTTP/1.1 in cleartext only: not TLS, HTTP/2, io_uring or"
             " sendfile (docs/HTTP.md)")
_SYSCALLS = (
    ("http_read", "sys_enter_read", "zero-code HTTP requests: read() arguments of watched processes"),
    ("http_read_ret", "sys_exit_read", "zero-code HTTP requests: a request head read (begin), a peer's close"),
    ("http_recvfrom", "sys_enter_recvfrom", "zero-code HTTP requests: recv()/recvfrom() arguments"),
    ("http_recvfrom_ret", "sys_exit_recvfrom", "zero-code HTTP requests: a request head received (begin)"),
    ("http_write", "sys_enter_write", "zero-code HTTP responses: write() arguments inside a request"),
    ("http_write_ret", "sys_exit_write", "zero-code HTTP responses: head (status, framing), end"),
    ("http_sendto", "sys_enter_sendto", "zero-code HTTP responses: send()/sendto() arguments"),
    ("http_sendto_ret", "sys_exit_sendto", "zero-code HTTP responses: head (status, framing), end"),
    ("http_writev", "sys_enter_writev", "zero-code HTTP responses: writev() arguments (uvloop)"),
    ("http_writev_ret", "sys_exit_writev", "zero-code HTTP responses: head (status, framing), end"),
    ("http_sendmsg", "sys_enter_sendmsg", "zero-code HTTP responses: sendmsg() arguments (asyncio writelines)"),
    ("http_sendmsg_ret", "sys_exit_sendmsg", "zero-code HTTP responses: head (status, framing), end"),
    ("http_close", "sys_enter_close", "zero-code HTTP requests: a connection's close ends its open request"),
)
PROBES = (
    # socket syscalls of watched processes, no kprobes; the exits of reads and of writes share a program each
    *(ProbeSpec(name, f"syscalls:{tp}", "http.bpf.c", provides, HTTP_HINT,
                fn="http_exit_read" if tp in ("sys_exit_read", "sys_exit_recvfrom") else
                "http_exit_write" if tp.startswith("sys_exit_") else "") for name, tp, provides in _SYSCALLS),
    ProbeSpec("http_sock_recv", "sock:sock_recv_length", "http.bpf.c",
              "zero-code HTTP requests: a read is a socket's (files and pipes make no record), and which socket",
              "Linux 6.3+ (include/trace/events/sock.h); without it agent/http checks each connection's fd in /proc"),
    ProbeSpec("http_sock_send", "sock:sock_send_length", "http.bpf.c",
              "zero-code HTTP responses: a write is a socket's, and which socket", "Linux 6.3+"),
)
_RX = ("http_read_ret", "http_recvfrom_ret")
_TX = ("http_write_ret", "http_sendto_ret", "http_writev_ret", "http_sendmsg_ret")
# Programs the exit programs tail-call through the prog array http_tail (enum mcp_http_tail): the
# loader loads each into its slot before it attaches the probes that call it
TAILS = (
    ("http_tail", 0, "http_rx_step", _RX),
    ("http_tail", 1, "http_rx_post", _RX),
    ("http_tail", 2, "http_tx_step", _TX),
    ("http_tail", 3, "http_tx_post", _TX),
)


def switched_off(cfg) -> dict[str, str]:
    return {} if cfg.requests_http else {p.name: "disabled by requests.http = false" for p in PROBES}


def _make():
    from .capability import Http
    return Http


CAPABILITY = Declaration(
    name="http", make=_make, bpf="http.bpf.c", header="http.h", structs=records.STRUCTS, settings=records.bpf_settings,
    switched_off=switched_off, probes=PROBES, rings=(b"http_events",), tails=TAILS, hooks={"process_exit": "http_proc_gone"},
    attributes=("network.protocol.name", "network.protocol.version", "http.request.method", "url.path",
                "http.response.status_code", "hostagent.http.*",
                *(f"hostagent.request.{s}.{what}" for s in ("thread", "process", "group")
                  for what in ("concurrency", "counters")),
                "hostagent.request.group.root_pid", "hostagent.request.group.cgroup_id"),
)
