/* Zero-code HTTP/1.1 requests (http.bpf.c, agent/http; the framing is described there). BEGIN and
 * END carry the counters of the request's thread, its process and its serving group: user space
 * takes the differences. */
#ifndef MCP_HTTP_H
#define MCP_HTTP_H
#include "common.h"
#define MCP_HTTP_HEAD_LEN 1024      /* bytes of a request head sent to user space (method, target, traceparent) */
#define MCP_HTTP_WIN 512            /* bytes of a call scanned per step (one window) */
#define MCP_HTTP_CARRY 32           /* a line's first bytes kept over a call boundary */
#define MCP_HTTP_STEPS 12           /* framing steps per call (a window of a head, a body, a chunk line...) */
#define MCP_HTTP_PIPELINE 4         /* requests in flight at once on one connection (pipelined) */

enum mcp_http_tail { MCP_HTTP_TAIL_RX_STEP, MCP_HTTP_TAIL_RX_POST, MCP_HTTP_TAIL_TX_STEP, MCP_HTTP_TAIL_TX_POST };
enum mcp_http_event_type { MCP_EV_HTTP_BEGIN = 20, MCP_EV_HTTP_END = 21 };

enum mcp_http_state {               /* one direction's framing */
	MCP_HTTP_ST_BOUNDARY = 0,   /* between messages: the next byte begins a head (CR/LF skipped) */
	MCP_HTTP_ST_HEAD = 1,       /* a head's lines, to the empty line */
	MCP_HTTP_ST_BODY = 2,       /* left bytes of a Content-Length body */
	MCP_HTTP_ST_CHUNK_SIZE = 3, /* a chunk-size line: hex digits (left), extensions, LF */
	MCP_HTTP_ST_CHUNK_DATA = 4, /* left bytes of a chunk's data */
	MCP_HTTP_ST_CHUNK_END = 5,  /* the CRLF after a chunk's data */
	MCP_HTTP_ST_TRAILER = 6,    /* trailer fields after the last chunk, to the empty line */
	MCP_HTTP_ST_UNTIL_CLOSE = 7,/* a response without framing: its body lasts until the close */
	MCP_HTTP_ST_LOST = 8,       /* framing lost (counted): nothing followed until the entry goes */
	MCP_HTTP_ST_UPGRADED = 9,   /* 101 Switching Protocols, a CONNECT tunnel: no longer HTTP/1.1 */
};

/* struct mcp_http_dir.flags: what the head said */
#define MCP_HTTP_F_LENGTH 1         /* Content-Length (its bytes in clv) */
#define MCP_HTTP_F_CHUNKED 2        /* Transfer-Encoding */
#define MCP_HTTP_F_HEAD_METHOD 4    /* a HEAD request: its response has no body */
#define MCP_HTTP_F_TUNNEL 8         /* a CONNECT request */
#define MCP_HTTP_F_DIGITS 16        /* a chunk-size line's digits began */
#define MCP_HTTP_F_EXT 32           /* a chunk-size line's digits ended */

/* struct mcp_ev_http_begin.flags */
#define MCP_HTTP_BEGIN_TRUNCATED 1  /* the head was longer than MCP_HTTP_HEAD_LEN - 1: cut */
#define MCP_HTTP_BEGIN_PARTIAL 2    /* the head's first bytes were not kept (its pend entry lost) */

enum mcp_http_mode {                /* how the response's end was found */
	MCP_HTTP_MODE_UNKNOWN = 0,  /* no framing: ends at the close */
	MCP_HTTP_MODE_LENGTH = 1,   /* head + Content-Length bytes (no body: HEAD, 204, 304) */
	MCP_HTTP_MODE_CHUNKED = 2,  /* the last chunk and the trailer */
};

enum mcp_http_end_reason {
	MCP_HTTP_END_COMPLETE = 0,  /* the response's framing says it is whole */
	MCP_HTTP_END_CLOSE = 1,     /* the connection closed first (or its fd now names another socket) */
	MCP_HTTP_END_MARKED = 2,    /* the process marks its requests: this zero-code one is dropped */
};

enum mcp_http_syscall {         /* which syscall's arguments map http_args holds */
	MCP_HTTP_SYS_READ = 0,      /* read, recvfrom: (fd, buf) */
	MCP_HTTP_SYS_WRITE = 1,     /* write, sendto: (fd, buf) */
	MCP_HTTP_SYS_WRITEV = 2,    /* writev: (fd, iov, iovcnt) */
	MCP_HTTP_SYS_SENDMSG = 3,   /* sendmsg: (fd, msghdr) */
};

struct mcp_http_args {          /* a socket syscall of a watched thread between its entry and exit */
	__u64 buf;                  /* buffer, iovec array or msghdr */
	__u64 count;                /* bytes asked for, or iovcnt */
	__u32 fd;
	__u32 sys;                  /* enum mcp_http_syscall */
	__u64 sk;                   /* the struct sock (sock:sock_*_length): never leaves the kernel */
	__u32 sock;                 /* 1: the socket layer ran for this call */
	__u32 pad;
};

struct mcp_http_conn_key {
	__u32 tgid;
	__u32 fd;
};

struct mcp_http_dir {           /* one direction's framing: request bytes read, response bytes written */
	__u64 left;                 /* BODY, CHUNK_DATA: bytes left; CHUNK_SIZE: the size so far */
	__u8 state;                 /* enum mcp_http_state */
	__u8 midline;               /* the current line's start was looked at, its LF not yet seen */
	__u8 carry_len;             /* bytes in carry: a line's start too short to tell, from the last call */
	__u8 flags;                 /* MCP_HTTP_F_* */
	__u16 lines;                /* lines of the head so far */
	__u16 status;               /* a response's status code */
	__u8 clv[24];               /* the bytes after "Content-Length:", read once the head is whole */
	__u8 carry[MCP_HTTP_CARRY];
};

struct mcp_http_req {           /* a request in flight on a connection */
	__u64 begin_ns;
	__u64 seq;
	__u64 group;                /* the serving group its BEGIN's snapshot was taken of */
	__u32 tid;                  /* the thread that read the head's last bytes: the request's thread */
	__u8 head_only;             /* HEAD: its response has no body */
	__u8 tunnel;                /* CONNECT: a 2xx answer makes the connection a tunnel */
	__u8 ghost;                 /* its BEGIN was refused or lost: it holds its place, sends no END */
	__u8 pad;
};

struct mcp_http_conn {          /* map http_conn: a connection with a request in flight */
	__u64 sk;                   /* its socket: an fd reused for another one is told apart */
	__u64 conn_id;              /* when this entry was made (ns) */
	__u64 gen;                  /* struct mcp_http_proc.gen of its process: its share was charged there */
	__u64 seq;                  /* requests begun in this entry */
	__u64 written;              /* bytes of the response being written (interim ones included) */
	__u64 interim;              /* of which 1xx responses (100 Continue) */
	__u32 rx_seq;               /* requests begun ... */
	__u32 tx_seq;               /* ... and answered: q[tx_seq % PIPELINE] is the one answered next */
	__u8 tx_mode;               /* enum mcp_http_mode of the response being written */
	__u8 pad[7];
	struct mcp_http_dir rx, tx;
	struct mcp_http_req q[MCP_HTTP_PIPELINE];
};

struct mcp_http_pend {          /* map http_pend (LRU): a head arriving over several reads */
	__u64 sk;
	__u64 first_ns;             /* its first byte's read */
	__u32 len;                  /* bytes of it in head */
	__u32 reads;
	__u32 flags;                /* MCP_HTTP_BEGIN_* */
	__u32 pad;
	struct mcp_http_dir rx;     /* the framing, for a connection not in http_conn */
	__u8 head[2 * MCP_HTTP_HEAD_LEN]; /* MCP_HTTP_HEAD_LEN - 1 used: the rest lets the verifier bound a copy */
};

struct mcp_http_proc {          /* map http_proc: a process with zero-code requests */
	__u64 gen;                  /* when this entry was made: its connections' shares belong to it */
	__u64 window_start_ns;
	__u64 cgroup_id;            /* its owners (as a marking process's, struct mcp_tgid_state) */
	__u32 uid;
	__u32 exempt;               /* allowed by requests.mark_users / mark_cgroups: no owner shares */
	__u32 begins;               /* in the current one-second window */
	__u32 conns;                /* its entries in http_conn */
};

struct mcp_http_budget {        /* map http_owners: an owner's (enum mcp_owner_kind) zero-code share */
	__u64 window_start_ns;
	__u32 begins;
	__u32 prev_begins;
	__u32 conns;
	__u32 pad;
	__u64 begun;                /* BEGINs sent: minus http_owner_read's, those the agent has not read */
};

struct mcp_ev_http_begin {
	struct mcp_hdr h;           /* the thread that read the head's end; ts_ns = then */
	__u64 conn_id;
	__u64 seq;
	__u64 group;                /* the serving group: the thread's cgroup id, or a tree's key */
	__u64 first_ns;             /* the head's first byte's read */
	__u32 fd;
	__u32 head_len;             /* bytes of head[] read from the data (< MCP_HTTP_HEAD_LEN) */
	__u32 reads;                /* reads the head came in */
	__u32 flags;                /* MCP_HTTP_BEGIN_* */
	__u32 owner_uid;            /* the owners it is counted to (struct mcp_http_proc) */
	__u32 exempt;
	__u64 owner_cgroup;
	struct mcp_counters thread, proc, grp; /* at the begin */
	__u8 head[MCP_HTTP_HEAD_LEN];
};

struct mcp_ev_http_end {
	struct mcp_hdr h;           /* the thread that ended it; ts_ns = the end */
	__u64 conn_id;
	__u64 seq;
	__u64 begin_ns;
	__u64 written;              /* response bytes written, 1xx responses included */
	__u64 interim;              /* of which 1xx responses */
	__u64 group;
	__u32 fd;
	__u32 begin_tid;
	__u16 status;
	__u8 reason;                /* enum mcp_http_end_reason */
	__u8 mode;                  /* enum mcp_http_mode */
	__u32 pad;
	struct mcp_counters thread, proc, grp; /* at the end: of begin_tid, the process, the group */
};

enum mcp_stat_http {
	MCP_STAT_RB_HTTP_LOST = 160,      /* HTTP ring buffer full: an HTTP BEGIN/END record not sent */
	MCP_STAT_HTTP_CONN_FULL,          /* HTTP connection not followed: map http_conn full */
	MCP_STAT_HTTP_RATE,               /* HTTP request not followed: its process over its begins per second */
	MCP_STAT_HTTP_ARGS_FULL,          /* socket syscall not followed: map http_args full */
	MCP_STAT_HTTP_DENIED,             /* HTTP request not followed: its process's owner not in requests.mark_users/mark_cgroups */
	MCP_STAT_HTTP_PROC_FULL,          /* HTTP request not followed: map http_proc full */
	MCP_STAT_HTTP_UID_RATE,           /* HTTP request not followed: its uid over requests.max_begins_per_s_per_uid */
	MCP_STAT_HTTP_CGROUP_RATE,        /* HTTP request not followed: its cgroup over requests.max_begins_per_s_per_cgroup */
	MCP_STAT_HTTP_PRESSURE,           /* HTTP request not followed: its owner has a quarter of http_events unread */
	MCP_STAT_HTTP_UID_CONNS,          /* HTTP connection not followed: its uid holds requests.http_conns_per_owner */
	MCP_STAT_HTTP_CGROUP_CONNS,       /* HTTP connection not followed: its cgroup holds requests.http_conns_per_owner */
	MCP_STAT_HTTP_PIPELINE_FULL,      /* HTTP connection not followed further: over MCP_HTTP_PIPELINE requests in flight */
	MCP_STAT_HTTP_FRAMING_LOST,       /* HTTP connection not followed further: a call held more than the framing steps follow */
	MCP_STAT_HTTP_FD_REUSED,          /* HTTP requests ended: their fd names another socket (closed unseen) */
	MCP_STAT_HTTP_TAIL_FAIL,          /* HTTP call not followed: a framing program's tail call failed */
};

#endif
