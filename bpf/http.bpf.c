/* Zero-code HTTP/1.1 requests of watched processes, from socket syscall tracepoints.
 *
 * No kprobes on these kernels (CONFIG_KPROBES unset): syscalls:sys_enter/exit_* of read, recvfrom,
 * write, sendto, writev, sendmsg and close. The enter side saves a watched thread's arguments (map
 * http_args); sock:sock_recv_length / sock:sock_send_length, which fire inside sock_recvmsg() and
 * sock_sendmsg() (net/socket.c, Linux 6.3+), mark the call as a socket's and give its struct sock
 * address; the exit side has the byte count, the data is in user memory, and only a socket's bytes
 * are looked at: a file or pipe that holds "GET / HTTP/1.1" never makes a record.
 *
 * Each followed connection (tgid, fd) has one framing state per direction (struct mcp_http_dir),
 * fed every byte the server reads or writes, whatever the sizes of the calls:
 *   the request head is scanned line by line across reads (a line's first bytes are carried over a
 *   read boundary) for its empty line, Content-Length and Transfer-Encoding; a body is skipped by its
 *   length, or chunk by chunk; what follows is the next request (pipelined, or after Go's 1-byte
 *   background read), never a body that merely starts with a method;
 *   the response head likewise (status, Content-Length, chunked; HEAD, 1xx, 204 and 304 have no
 *   body; a 1xx is counted in the response's size and the final response follows); its body by length or
 *   chunk by chunk, or until the close when it has no framing.
 * A request begins when its head is whole (BEGIN, with the head's bytes) and ends when its response
 * is (END); requests in flight on one connection are answered in order (struct mcp_http_conn.q).
 *
 * Tables a local user's traffic fills are bounded apart: a connection enters http_conn only with a
 * whole request head, charged to its process's uid and cgroup (MCP_HTTP_CONNS_PER_OWNER each), and
 * leaves it as soon as nothing is in flight; a head still arriving lives in the LRU http_pend, so
 * heads that never complete (slowloris) push out only each other. BEGINs are capped per second per
 * process and per owner, and refused to owners past MCP_PRESSURE_BEGINS_PER_S while the agent reads
 * http_events late (the marker path's rule). Every refusal is counted (enum mcp_stat).
 *
 * BEGIN and END carry the counters of the request's thread, its process and its serving group (the
 * thread's cgroup, or its process tree) at that moment; user space subtracts.
 * Not seen: TLS (ciphertext here), HTTP/2 (binary frames), io_uring, sendfile/splice and readv/recvmsg.
 */
#include "http.h"

/* Per-process state and owner shares; a process's exit (the process_exit hook, core/loader.py HOOKS)
 * gives its share back. */
BPF_HASH(http_proc, u32, struct mcp_http_proc, MCP_MAX_PROCS);
BPF_TABLE("lru_hash", struct mcp_owner_key, struct mcp_http_budget, http_owners, MCP_MAX_OWNERS);

static __always_inline struct mcp_http_budget *http_owner(u32 kind, u64 id, int create)
{
	struct mcp_owner_key k = {.kind = kind, .id = id};
	struct mcp_http_budget *b = http_owners.lookup(&k);
	if (b || !create)
		return b;
	struct mcp_http_budget zero = {};
	http_owners.insert(&k, &zero);
	return http_owners.lookup(&k);
}

/* The process_exit hook: an exit closes its fds without close(2), so its share of http_conn goes back
 * to its owners at once (its entries, of another generation now, are removed by agent/http, their
 * requests ended). */
static __always_inline void http_proc_gone(u32 tgid)
{
	struct mcp_http_proc *p = http_proc.lookup(&tgid);
	if (!p)
		return;
	if (!p->exempt && p->conns) {
		struct mcp_http_budget *b = http_owner(MCP_OWNER_UID, p->uid, 0);
		if (b)
			sat_sub(&b->conns, p->conns);
		b = http_owner(MCP_OWNER_CGROUP, p->cgroup_id, 0);
		if (b)
			sat_sub(&b->conns, p->conns);
	}
	http_proc.delete(&tgid);
}

#define MCP_HTTP_MAX_CONNS 16384
#define MCP_HTTP_MAX_PEND 2048        /* heads arriving in several reads, at once (LRU) */
#define MCP_HTTP_MAX_IOV 8            /* iovecs looked at in writev/sendmsg */
#define MCP_HTTP_LOOK 24              /* bytes of a line its start is matched on (the longest name + digits) */
#define MCP_HTTP_SCAN_ITERS 96        /* newline-free words and lines of one window */
#define MCP_HTTP_CHUNK_LINE 32        /* bytes of a chunk-size line looked at per step */
#ifndef MCP_HTTP_CONNS_PER_OWNER
#define MCP_HTTP_CONNS_PER_OWNER 4096
#endif
#ifndef MCP_HTTP_SOCK_TP
#define MCP_HTTP_SOCK_TP 1            /* 0: no sock:sock_*_length (before 6.3): user space checks the fd */
#endif

BPF_RINGBUF_OUTPUT(http_events, MCP_HTTP_RINGBUF_PAGES);
BPF_HASH(http_args, u32, struct mcp_http_args, MCP_MAX_THREADS);
BPF_HASH(http_conn, struct mcp_http_conn_key, struct mcp_http_conn, MCP_HTTP_MAX_CONNS);
BPF_TABLE("lru_hash", struct mcp_http_conn_key, struct mcp_http_pend, http_pend, MCP_HTTP_MAX_PEND);
/* BEGINs of each owner the agent has read (struct mcp_http_budget.begun minus this: the owner's
 * records waiting in http_events); written by agent/http, read here */
BPF_TABLE("lru_hash", struct mcp_owner_key, u64, http_owner_read, MCP_MAX_OWNERS);
/* An owner's BEGINs waiting in http_events at most: a quarter of the ring, in BEGIN records (~2 KiB
 * with the ring's header), so that one owner behind whom the agent lags (a flood, or a starved
 * agent) cannot fill the ring for the others */
#define MCP_HTTP_OWNER_WAITING (MCP_HTTP_RINGBUF_PAGES * 4096 / 4 / 2048)

/* Per-CPU scratch: the framing being followed (copied in from its entry and back), one window of a
 * call's bytes after a carried line start, and what the framing found in this call (whole heads,
 * whole responses), acted on once the bytes are through. The cursors live here, in map memory, not in
 * registers: the verifier then sees one state per loop iteration, not one per combination of what
 * earlier iterations found (a scan over registers passed its 1M-instruction limit). */
#define MCP_HTTP_MASK 1023              /* indexes into b: every valid one (< CARRY + WIN) is below it */
#define MCP_HTTP_TX_STEPS (MCP_HTTP_STEPS + MCP_HTTP_MAX_IOV)  /* a write's steps: framing and its buffers */
struct mcp_http_head_ev {               /* a read: a whole head at data[start, end) */
	u32 start, end;
	u8 here, head_only, tunnel, pad;    /* here: it began in this read */
};
struct mcp_http_resp_ev {               /* a write: a whole response */
	u64 written, interim;
	u16 status;
	u8 mode, pad[5];
};
struct mcp_http_scratch {
	u8 b[MCP_HTTP_MASK + 1 + 64];       /* + room for the words read past an index */
	struct mcp_http_dir d;
	u64 ptr, written, interim, left_total;
	u32 off, n, cur, total, base, used, done, nev;
	s32 ls;
	u32 head_off, head_here, inflight, upgraded, iov_i;
	u8 mode, pad[3];
	struct mcp_http_conn_key key;       /* the call's connection, and the call: */
	u64 buf, sk, now, iov, iovcnt;
	u32 sys, step, pend_used, pad2;
	u8 head_only[MCP_HTTP_PIPELINE], tunnel[MCP_HTTP_PIPELINE];
	struct mcp_http_head_ev heads[MCP_HTTP_PIPELINE];
	struct mcp_http_resp_ev resps[MCP_HTTP_PIPELINE];
	struct mcp_http_pend pend;          /* a pend entry being made (too big for the stack) */
};
BPF_PERCPU_ARRAY(http_scratch, struct mcp_http_scratch, 1);
/* the framing's programs, by enum mcp_http_tail; filled by the loader (agent/core/probes.py TAILS) */
BPF_PROG_ARRAY(http_tail, 4);
BPF_ARRAY(http_conn_zero, struct mcp_http_conn, 1);  /* a new connection's value (no memset that large) */

struct mcp_iov {                      /* struct iovec */
	u64 base;
	u64 len;
};

/* The first four bytes, little-endian: "GET ", "POST", "PUT ", "HEAD", "DELE", "PATC", "OPTI" */
static __always_inline int http_method(u32 w)
{
	return w == 0x20544547 || w == 0x54534f50 || w == 0x20545550 || w == 0x44414548 ||
	       w == 0x454c4544 || w == 0x43544150 || w == 0x4954504f;
}

/* Whether the first n (1..3) bytes of w are those of a method: a read that short (Go's background
 * read takes one byte) is let begin a head, which its next bytes confirm. */
static __always_inline int http_method_prefix(u32 w, u32 n)
{
	u32 m = n >= 3 ? 0xffffff : n == 2 ? 0xffff : 0xff;
	w &= m;
	return w == (0x20544547 & m) || w == (0x54534f50 & m) || w == (0x20545550 & m) || w == (0x44414548 & m) ||
	       w == (0x454c4544 & m) || w == (0x43544150 & m) || w == (0x4954504f & m);
}

/* dst = the counters at src, or zeros: one helper call on either path, so that the verifier's states
 * meet again right after it (a memcpy or memset per path kept them apart, 8 paths a record) */
static __always_inline void http_snap(struct mcp_counters *dst, struct mcp_counters *src)
{
	u32 z = 0;
	if (!src)
		src = zero_counters.lookup(&z);
	if (!src || mcp_read_kernel(dst, sizeof(*dst), src) != 0)
		__builtin_memset(dst, 0, sizeof(*dst));
}

static __always_inline void *http_reserve(u32 size)
{
	void *e = http_events.ringbuf_reserve(size);
	if (!e)
		stat_inc(MCP_STAT_RB_HTTP_LOST);
	return e;
}

/* The owner's BEGINs the agent has not read yet (begun counted at each BEGIN sent) */
static __always_inline s64 http_waiting(struct mcp_http_budget *b, u32 kind, u64 id)
{
	struct mcp_owner_key k = {.kind = kind, .id = id};
	u64 *read = http_owner_read.lookup(&k);
	return (s64)(b->begun - (read ? *read : 0));
}

static __always_inline void http_save(u32 fd, u64 buf, u64 count, u32 sys)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	if (!watched_bit(tgid))
		return;
	if (sys != MCP_HTTP_SYS_READ) {
		/* a write matters only with a request in flight: most writes of a watched process cost this lookup */
		struct mcp_http_conn_key k = {.tgid = tgid, .fd = fd};
		if (!http_conn.lookup(&k))
			return;
	}
	struct mcp_http_args a = {.buf = buf, .count = count, .fd = fd, .sys = sys};
	if (http_args.update(&tid, &a) != 0)
		stat_inc(MCP_STAT_HTTP_ARGS_FULL);
}

/* The socket layer ran for this thread's saved call: its data is a socket's (sk: its struct sock). */
static __always_inline void http_sock(u64 sk)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid;
	if (!watched_bit(pid_tgid >> 32))
		return;
	struct mcp_http_args *a = http_args.lookup(&tid);
	if (a) {
		a->sk = sk;
		a->sock = 1;
	}
}

/* The saved arguments of this thread's call, taken out of the map; 0 if none, not of `want`, or
 * (with the sock tracepoints) not a socket's. */
static __always_inline int http_take(struct mcp_http_args *out, int want_read)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid;
	if (!watched_bit(pid_tgid >> 32))  /* the host's other processes: no hash lookup */
		return 0;
	struct mcp_http_args *a = http_args.lookup(&tid);
	if (!a)
		return 0;
	*out = *a;
	http_args.delete(&tid);
	if (MCP_HTTP_SOCK_TP && !out->sock)
		return 0;
	return (out->sys == MCP_HTTP_SYS_READ) == !!want_read;
}

/* ---- owners: a connection's share and the begins' rate, per uid and cgroup (common.bpf.c) ---- */
/* The process's HTTP state, made at its first whole head: its owners, its connections, its rate. */
static __always_inline struct mcp_http_proc *http_proc_of(u32 tgid, u64 now)
{
	struct mcp_http_proc *p = http_proc.lookup(&tgid);
	if (p)
		return p;
	u32 uid = (u32)bpf_get_current_uid_gid();
	u64 cg = bpf_get_current_cgroup_id();
	if (cg <= MCP_ROOT_CGROUP_ID)
		cg = MCP_ROOT_CGROUP_OWNER | uid;  /* as mark_begin: a root-cgroup task's cgroup owner is its uid's */
	struct mcp_http_proc fresh = {.gen = now, .uid = uid, .cgroup_id = cg};
	if (MCP_MARK_RESTRICT) {
		if (!mark_allowed(uid)) {
			stat_inc(MCP_STAT_HTTP_DENIED);
			return 0;
		}
		fresh.exempt = 1;
	}
	if (http_proc.insert(&tgid, &fresh) != 0 && !http_proc.lookup(&tgid)) {
		stat_inc(MCP_STAT_HTTP_PROC_FULL);
		return 0;
	}
	return http_proc.lookup(&tgid);
}

/* A request may begin: the process's and its owners' begins this second, and the pressure rule. */
static __always_inline int http_begin_ok(struct mcp_http_proc *p, u64 now)
{
	if (!window_take(&p->window_start_ns, &p->begins, 0, MCP_MAX_BEGINS_PER_S, now)) {
		stat_inc(MCP_STAT_HTTP_RATE);
		return 0;
	}
	if (p->exempt)
		return 1;
	struct mcp_http_budget *bu = http_owner(MCP_OWNER_UID, p->uid, 1);
	struct mcp_http_budget *bc = http_owner(MCP_OWNER_CGROUP, p->cgroup_id, 1);
	if (!bu || !bc) {
		stat_inc(MCP_STAT_BUDGET_MAP_FULL);
		return 0;
	}
	if (!window_take(&bu->window_start_ns, &bu->begins, &bu->prev_begins, MCP_MAX_BEGINS_PER_S_UID, now)) {
		stat_inc(MCP_STAT_HTTP_UID_RATE);
		return 0;
	}
	if (!window_take(&bc->window_start_ns, &bc->begins, &bc->prev_begins, MCP_MAX_BEGINS_PER_S_CGROUP, now)) {
		stat_inc(MCP_STAT_HTTP_CGROUP_RATE);
		return 0;
	}
	/* The pressure rule, by owner: an owner with a quarter of the ring's BEGINs unread waits; the
	 * others, light or busy, go on (a fixed light rate, as the marker path has, refused a busy
	 * legitimate server as soon as a flood made the agent lag) */
	if (http_waiting(bu, MCP_OWNER_UID, p->uid) > MCP_HTTP_OWNER_WAITING ||
	    http_waiting(bc, MCP_OWNER_CGROUP, p->cgroup_id) > MCP_HTTP_OWNER_WAITING) {
		stat_inc(MCP_STAT_HTTP_PRESSURE);
		return 0;
	}
	return 1;
}

/* A connection entry for a whole head, within its process's owners' shares. */
static __always_inline struct mcp_http_conn *http_conn_new(struct mcp_http_conn_key *k, struct mcp_http_proc *p,
							   u64 sk, u64 now)
{
	struct mcp_http_budget *bu = 0, *bc = 0;
	if (!p->exempt) {
		bu = http_owner(MCP_OWNER_UID, p->uid, 1);
		bc = http_owner(MCP_OWNER_CGROUP, p->cgroup_id, 1);
		if (!bu || !bc) {
			stat_inc(MCP_STAT_BUDGET_MAP_FULL);
			return 0;
		}
		if ((s32)bu->conns >= MCP_HTTP_CONNS_PER_OWNER) {
			stat_inc(MCP_STAT_HTTP_UID_CONNS);
			return 0;
		}
		if ((s32)bc->conns >= MCP_HTTP_CONNS_PER_OWNER) {
			stat_inc(MCP_STAT_HTTP_CGROUP_CONNS);
			return 0;
		}
	}
	u32 z = 0;
	struct mcp_http_conn *zero = http_conn_zero.lookup(&z);
	if (!zero)
		return 0;
	if (http_conn.insert(k, zero) != 0) {
		stat_inc(MCP_STAT_HTTP_CONN_FULL);
		return 0;
	}
	struct mcp_http_conn *c = http_conn.lookup(k);
	if (!c)
		return 0;
	c->sk = sk;
	c->conn_id = now;
	c->gen = p->gen;
	__sync_fetch_and_add(&p->conns, 1);
	if (bu)
		__sync_fetch_and_add(&bu->conns, 1);
	if (bc)
		__sync_fetch_and_add(&bc->conns, 1);
	return c;
}

/* The connection leaves the table; its share goes back unless its process's exit gave it back already
 * (another generation: the tgid was reused, or the process is gone). */
static __always_inline void http_conn_drop(struct mcp_http_conn_key *k, struct mcp_http_conn *c)
{
	u64 gen = c->gen;
	if (http_conn.delete(k) != 0)
		return;  /* deleted meanwhile: whoever did gave the share back */
	struct mcp_http_proc *p = http_proc.lookup(&k->tgid);
	if (!p || p->gen != gen)
		return;
	sat_sub(&p->conns, 1);
	if (p->exempt)
		return;
	struct mcp_http_budget *b = http_owner(MCP_OWNER_UID, p->uid, 0);
	if (b)
		sat_sub(&b->conns, 1);
	b = http_owner(MCP_OWNER_CGROUP, p->cgroup_id, 0);
	if (b)
		sat_sub(&b->conns, 1);
}

/* ---- records ---- */

/* The END of the request in slot `slot`: the response's size, status and framing as given. */
static __always_inline void http_end(struct mcp_http_conn_key *k, struct mcp_http_conn *c, u32 slot, u64 now,
				     u32 reason, u64 written, u64 interim, u16 status, u8 mode)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mcp_http_req *q = &c->q[slot & (MCP_HTTP_PIPELINE - 1)];
	if (q->ghost)
		return;  /* its BEGIN was refused or lost: nothing to end */
	if (tgid_state.lookup(&k->tgid))
		reason = MCP_HTTP_END_MARKED;  /* the process marks its requests: user space drops this one */
	struct mcp_ev_http_end *e = http_reserve(sizeof(*e));
	if (!e)
		return;
	fill_hdr(&e->h, MCP_EV_HTTP_END, sizeof(*e), pid_tgid, now);
	e->conn_id = c->conn_id;
	e->seq = q->seq;
	e->begin_ns = q->begin_ns;
	e->written = written;
	e->interim = interim;
	e->group = q->group;
	e->fd = k->fd;
	e->begin_tid = q->tid;
	e->status = status;
	e->reason = reason;
	e->mode = mode;
	e->pad = 0;
	u32 tid = q->tid, tgid = k->tgid;
	u64 g = q->group;
	http_snap(&e->thread, thread_stats.lookup(&tid));
	http_snap(&e->proc, proc_stats.lookup(&tgid));
	http_snap(&e->grp, g ? group_stats.lookup(&g) : 0);
	http_events.ringbuf_submit(e, 0);
}

/* Every request still in flight on the connection ends (a close, a socket no longer the fd's): one
 * END, for the one being answered, with what of its response was written; user space ends those
 * behind it with the same counters and no response (reason MCP_HTTP_END_CLOSE). */
static __always_inline void http_end_all(struct mcp_http_conn_key *k, struct mcp_http_conn *c, u64 now, u32 reason)
{
	if (c->tx_seq < c->rx_seq) {
		slice_split((u32)bpf_get_current_pid_tgid(), k->tgid, now, 0);
		http_end(k, c, c->tx_seq, now, reason, c->written, c->interim, c->tx.status, c->tx_mode);
	}
	c->tx_seq = c->rx_seq;
}

/* The serving group of the current thread: its cgroup, or its process tree (requests.group = tree) */
static __always_inline u64 http_group(u32 tgid)
{
	u64 g = bpf_get_current_cgroup_id();
	if (MCP_GROUP_TREE) {  /* the serving process roots a tree unless it is in one already */
		u32 *root = tree_root.lookup(&tgid);
		if (!root)
			tree_root.update(&tgid, &tgid);
		g = MCP_TREE_GROUP | (root ? *root : tgid);
	}
	if (group_counters(g)) {
		u32 z = 0, one = 1;
		groups_on.update(&z, &one);
		return g;
	}
	return 0;
}

/* A whole head (head_len bytes at buf, or in pd): a request in flight, and its BEGIN unless it is
 * refused (ok == 0) or the ring is full. Either way it holds its place: responses come in order. */
static __always_inline void http_begin(struct mcp_http_conn_key *k, struct mcp_http_conn *c,
				       struct mcp_http_pend *pd, u64 buf, u32 head_len, int ok, u64 now,
				       struct mcp_http_head_ev *h, struct mcp_http_proc *p)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	if (c->rx_seq - c->tx_seq >= MCP_HTTP_PIPELINE) {
		stat_inc(MCP_STAT_HTTP_PIPELINE_FULL);
		c->rx.state = MCP_HTTP_ST_LOST;
		return;
	}
	struct mcp_http_req *q = &c->q[c->rx_seq & (MCP_HTTP_PIPELINE - 1)];
	c->rx_seq++;
	c->seq++;
	q->begin_ns = now;
	q->seq = c->seq;
	q->tid = tid;
	q->head_only = h->head_only;
	q->tunnel = h->tunnel;
	q->ghost = 1;
	q->group = 0;
	if (!ok || !p)
		return;
	u64 g = http_group(tgid);
	thread_counters(tid);
	struct mcp_ev_http_begin *e = http_reserve(sizeof(*e));
	if (!e)
		return;
	q->ghost = 0;
	q->group = g;
	fill_hdr(&e->h, MCP_EV_HTTP_BEGIN, sizeof(*e), pid_tgid, now);
	/* its owners, for the agent to count what it read of each (http_owner_read) */
	e->owner_uid = p->uid;
	e->exempt = p->exempt;
	e->owner_cgroup = p->cgroup_id;
	if (!p->exempt) {
		struct mcp_http_budget *b = http_owner(MCP_OWNER_UID, p->uid, 0);
		if (b)
			__sync_fetch_and_add(&b->begun, 1);
		b = http_owner(MCP_OWNER_CGROUP, p->cgroup_id, 0);
		if (b)
			__sync_fetch_and_add(&b->begun, 1);
	}
	e->conn_id = c->conn_id;
	e->seq = c->seq;
	e->group = g;
	e->fd = k->fd;
	u32 flags = 0, n;
	/* at most MCP_HTTP_HEAD_LEN - 1, masked where the call reads it: the verifier wants the bound on
	 * the register passed */
	if (pd) {
		e->first_ns = pd->first_ns;
		e->reads = pd->reads;
		flags = pd->flags;
		n = pd->len < MCP_HTTP_HEAD_LEN - 1 ? pd->len : MCP_HTTP_HEAD_LEN - 1;
		asm volatile("" : "+r"(n));
		if (mcp_read_kernel(e->head, n & (MCP_HTTP_HEAD_LEN - 1), pd->head) != 0)
			n = 0;
	} else {
		e->first_ns = now;
		e->reads = 1;
		if (!h->here)
			flags = MCP_HTTP_BEGIN_PARTIAL;  /* begun in a read whose bytes were not kept */
		n = head_len < MCP_HTTP_HEAD_LEN - 1 ? head_len : MCP_HTTP_HEAD_LEN - 1;
		asm volatile("" : "+r"(n));
		if (mcp_read_user(e->head, n & (MCP_HTTP_HEAD_LEN - 1), (void *)buf) != 0)
			n = 0;
		if (head_len > n)
			flags |= MCP_HTTP_BEGIN_TRUNCATED;
	}
	e->flags = flags;
	e->head_len = n;
	http_snap(&e->thread, thread_stats.lookup(&tid));
	http_snap(&e->proc, proc_stats.lookup(&tgid));
	http_snap(&e->grp, g ? group_stats.lookup(&g) : 0);
	http_events.ringbuf_submit(e, 0);
}

/* ---- framing: the line scanner and the chunk parser, shared by both directions (s->d) ---- */

/* A line's start at s->b[ls], L bytes before its LF (MCP_HTTP_LOOK when only that much is known
 * yet). Header names are matched case-insensitively (| 0x20 on each byte: '-' and ':' have it). */
static __always_inline void http_line(struct mcp_http_scratch *s, u32 ls, u32 L, int tx)
{
	struct mcp_http_dir *d = &s->d;
	u32 at = ls & MCP_HTTP_MASK;
	if (d->lines++ == 0) {
		if (tx) {  /* "HTTP/1.x NNN" */
			u64 a;
			__builtin_memcpy(&a, &s->b[at], 8);
			u8 d0 = s->b[at + 9] - '0', d1 = s->b[at + 10] - '0', d2 = s->b[at + 11] - '0';
			if ((a & 0xffffffffffULL) == 0x2f50545448ULL && L >= 12 && d0 <= 9 && d1 <= 9 && d2 <= 9)
				d->status = d0 * 100 + d1 * 10 + d2;
		} else if (L >= 4) {
			u32 w;
			__builtin_memcpy(&w, &s->b[at], 4);
			if (w == 0x44414548)  /* "HEAD" */
				d->flags |= MCP_HTTP_F_HEAD_METHOD;
			else if (w == 0x4e4e4f43)  /* "CONN"ECT: a tunnel once answered 2xx */
				d->flags |= MCP_HTTP_F_TUNNEL;
		}
		return;
	}
	u64 a, b;
	__builtin_memcpy(&a, &s->b[at], 8);
	__builtin_memcpy(&b, &s->b[at + 8], 8);
	a |= 0x2020202020202020ULL;
	b |= 0x2020202020202020ULL;
	if (L >= 15 && a == 0x2d746e65746e6f63ULL && (b & 0x00ffffffffffffffULL) == 0x3a6874676e656cULL) {
		/* "content-" "length:": its value's bytes, read once the head is whole */
		__builtin_memcpy(d->clv, &s->b[at + 15], sizeof(d->clv));
		d->flags |= MCP_HTTP_F_LENGTH;
	} else if (L >= 18 && a == 0x726566736e617274ULL && b == 0x6e69646f636e652dULL) {
		/* "transfer" "-encodin": chunked is the only coding a server must take, and any other
		 * message's last (RFC 9112 6.1) */
		d->flags |= MCP_HTTP_F_CHUNKED;
	}
}

/* What follows a whole head: its body's framing (RFC 9112 6.3). */
static __always_inline void http_head_done(struct mcp_http_dir *d, int tx, int head_only)
{
	d->left = 0;
	d->flags &= ~(MCP_HTTP_F_DIGITS | MCP_HTTP_F_EXT);
	if (tx && (head_only || d->status < 200 || d->status == 204 || d->status == 304)) {
		d->state = MCP_HTTP_ST_BOUNDARY;
		return;
	}
	if (d->flags & MCP_HTTP_F_CHUNKED) {
		d->state = MCP_HTTP_ST_CHUNK_SIZE;
		return;
	}
	if (d->flags & MCP_HTTP_F_LENGTH) {
		/* the digits, spaces around them allowed; value and counts in map memory (see the scratch) */
		d->left = 0;
		d->lines = 0;  /* digits seen */
		d->midline = 0;  /* 1: a space after digits */
		for (u32 i = 0; i < sizeof(d->clv); i++) {
			asm volatile("" ::: "memory");  /* each iteration reads d again: no value carried in a register */
			u8 ch = d->clv[i];
			if (ch >= '0' && ch <= '9' && !d->midline) {
				d->left = d->left * 10 + (ch - '0');
				d->lines++;
			} else if (ch == ' ' || ch == '\t') {
				if (d->lines)
					d->midline = 1;
			} else {
				break;
			}
		}
		u16 digits = d->lines;
		d->lines = 0;
		d->midline = 0;
		if (digits && digits <= 18) {
			d->state = d->left ? MCP_HTTP_ST_BODY : MCP_HTTP_ST_BOUNDARY;
			return;
		}
		d->left = 0;
		d->state = MCP_HTTP_ST_LOST;  /* a length it cannot read: the server refuses it too */
		return;
	}
	/* no framing: a request has no body; a response lasts until the close */
	d->state = tx ? MCP_HTTP_ST_UNTIL_CLOSE : MCP_HTTP_ST_BOUNDARY;
}

/* One window of a head (or trailer) at ptr, n > 0 bytes: its lines, from the carried start on.
 * s->used: the data bytes taken; s->done: the head's empty line was among them (they end with its LF). */
static __always_inline void http_scan(struct mcp_http_scratch *s, u64 ptr, u32 n, int tx)
{
	struct mcp_http_dir *d = &s->d;
	u32 base = d->carry_len & (MCP_HTTP_CARRY - 1);
	u32 wl = n < MCP_HTTP_WIN - 1 ? n : MCP_HTTP_WIN - 1;
	asm volatile("" : "+r"(wl));
	s->done = 0;
	s->used = wl;
	if (base)
		__builtin_memcpy(s->b, d->carry, MCP_HTTP_CARRY);
	if (mcp_read_user(&s->b[base], wl & (MCP_HTTP_WIN - 1), (void *)ptr) != 0)
		return;  /* unreadable: taken as used, the framing goes on at the next call */
	s->base = base;
	s->total = base + wl;
	s->ls = d->midline ? -1 : 0;  /* the current line's start not yet looked at: carried, or the data's */
	s->cur = base;
	d->carry_len = 0;
	for (u32 it = 0; it < MCP_HTTP_SCAN_ITERS; it++) {
		asm volatile("" ::: "memory");
		u32 cur = s->cur, total = s->total;
		if (cur >= total)
			break;
		u64 w;
		__builtin_memcpy(&w, &s->b[cur & MCP_HTTP_MASK], 8);
		u64 x = w ^ 0x0a0a0a0a0a0a0a0aULL;
		u64 m = (x - 0x0101010101010101ULL) & ~x & 0x8080808080808080ULL;
		if (!m) {
			s->cur = cur + 8;
			continue;
		}
		/* the lowest set bit marks the first LF exactly (a borrow only runs upwards); its byte's
		 * index is the multiply's top byte */
		u64 low = m & (~m + 1);
		u32 p = cur + (u32)(((low >> 7) * 0x0001020304050607ULL) >> 56);
		if (p >= total) {
			s->cur = total;  /* an LF past the valid bytes (a stale one): none in them */
			break;
		}
		s32 ls = s->ls;
		if (ls >= 0) {
			u32 L = p - (u32)ls;
			u8 c0 = s->b[ls & MCP_HTTP_MASK];
			if (d->lines && (L == 0 || (L == 1 && c0 == '\r'))) {
				s->done = 1;
				s->used = p + 1 - s->base;
				d->midline = 0;
				break;
			}
			if (d->state == MCP_HTTP_ST_HEAD)
				http_line(s, (u32)ls, L, tx);
			else
				d->lines++;
		}
		s->ls = p + 1;
		s->cur = p + 1;
		d->midline = 0;
	}
	asm volatile("" ::: "memory");
	if (s->done)
		return;
	u32 cur = s->cur, total = s->total;
	s32 ls = s->ls;
	base = s->base;
	if (cur < total) {
		/* out of iterations (many short lines): the next step goes on from the current line */
		if (ls < 0) {
			d->midline = 1;
			s->used = cur - base;
		} else if ((u32)ls >= base) {
			d->midline = 0;
			s->used = (u32)ls - base;
		} else {
			if (d->state == MCP_HTTP_ST_HEAD)  /* a carried line this long: its start is all here */
				http_line(s, (u32)ls, MCP_HTTP_LOOK, tx);
			else
				d->lines++;
			d->midline = 1;
			s->used = cur - base;
		}
		return;
	}
	if (ls < 0)
		return;
	u32 len = total - (u32)ls;
	if (len < MCP_HTTP_LOOK) {
		/* too little of the line to tell its name: its bytes wait for the next call's */
		__builtin_memcpy(d->carry, &s->b[ls & MCP_HTTP_MASK], MCP_HTTP_CARRY);
		d->carry_len = len;
		d->midline = 0;
		return;
	}
	if (d->state == MCP_HTTP_ST_HEAD)
		http_line(s, (u32)ls, MCP_HTTP_LOOK, tx);
	else
		d->lines++;
	d->midline = 1;
}

/* One step of a chunked body at ptr, n > 0 bytes: the size line (hex digits, extensions, LF), the
 * chunk's data, its CRLF; the last chunk (size 0) leads to the trailer. Returns the bytes taken. */
static __always_inline u32 http_chunk(struct mcp_http_scratch *s, u64 ptr, u32 n)
{
	struct mcp_http_dir *d = &s->d;
	if (d->state == MCP_HTTP_ST_CHUNK_DATA) {
		u64 k = d->left < n ? d->left : n;
		d->left -= k;
		if (!d->left)
			d->state = MCP_HTTP_ST_CHUNK_END;
		return (u32)k;
	}
	u32 wl = n < MCP_HTTP_CHUNK_LINE ? n : MCP_HTTP_CHUNK_LINE;
	asm volatile("" : "+r"(wl));
	s->used = wl;
	if (mcp_read_user(s->b, wl & (2 * MCP_HTTP_CHUNK_LINE - 1), (void *)ptr) != 0)
		return n;
	/* the bytes taken go to s->used and the loop breaks: a value returned from inside it would keep
	 * each iteration's exit apart for the rest of the program */
	for (u32 i = 0; i < MCP_HTTP_CHUNK_LINE; i++) {
		asm volatile("" ::: "memory");
		if (i >= s->used)
			break;
		u8 ch = s->b[i];
		if (ch == '\n') {
			s->used = i + 1;
			if (d->state == MCP_HTTP_ST_CHUNK_END) {
				d->state = MCP_HTTP_ST_CHUNK_SIZE;
				d->left = 0;
				d->flags &= ~(MCP_HTTP_F_DIGITS | MCP_HTTP_F_EXT);
			} else if (!(d->flags & MCP_HTTP_F_DIGITS)) {
				d->state = MCP_HTTP_ST_LOST;  /* a size line without a size */
			} else if (d->left) {
				d->state = MCP_HTTP_ST_CHUNK_DATA;
			} else {
				d->state = MCP_HTTP_ST_TRAILER;  /* its lines follow a head already begun */
				d->lines = 1;
				d->midline = 0;
				d->carry_len = 0;
			}
			break;
		}
		if (d->state != MCP_HTTP_ST_CHUNK_SIZE || (d->flags & MCP_HTTP_F_EXT))
			continue;  /* the CR after a chunk's data, extensions, the CR before the LF */
		u8 lc = ch | 0x20;
		u32 v = ch - '0';
		if (v > 9)
			v = lc >= 'a' && lc <= 'f' ? lc - 'a' + 10 : 16;
		if (v < 16 && d->left < (1ULL << 56)) {
			d->left = (d->left << 4) | v;
			d->flags |= MCP_HTTP_F_DIGITS;
		} else {
			d->flags |= MCP_HTTP_F_EXT;
		}
	}
	asm volatile("" ::: "memory");
	return s->used;
}

/* The start of a message (request or response head) at the current offset. */
static __always_inline void http_head_begin(struct mcp_http_dir *d)
{
	d->state = MCP_HTTP_ST_HEAD;
	d->lines = 0;
	d->flags = 0;
	d->midline = 0;
	d->carry_len = 0;
	d->status = 0;
}

/* ---- reads: request heads and bodies ----
 * A read's bytes go through the framing one step per program: http_exit_read takes the call and its
 * connection's state into the scratch, http_rx_step runs one step and tail-calls itself while bytes
 * and steps are left, http_rx_post acts on what was found (BEGINs, the pend entry, the state back to
 * its entry). Each program is verified alone: the three as one passed the verifier's 1M limit. */

/* One framing step on the scratch's read (s->buf, s->n from s->off); 0 when the read is through. */
static __always_inline int http_rx_one(struct mcp_http_scratch *s)
{
	struct mcp_http_dir *d = &s->d;
	u32 off = s->off, n = s->n;
	u64 buf = s->buf;
	if (off >= n)
		return 0;
	if (d->state == MCP_HTTP_ST_BOUNDARY) {
		u8 ch = 0;
		mcp_read_user(&ch, 1, (void *)(buf + off));
		if (ch == '\r' || ch == '\n') {  /* an empty line between requests (RFC 9112 2.2) */
			s->off = off + 1;
			return 1;
		}
		http_head_begin(d);
		s->head_off = off;
		s->head_here = 1;
	}
	u32 left = n - off;
	u8 st = d->state;
	if (st == MCP_HTTP_ST_HEAD || st == MCP_HTTP_ST_TRAILER) {
		http_scan(s, buf + off, left, 0);
		s->off = off + s->used;
		if (!s->done)
			return 1;
		if (st == MCP_HTTP_ST_TRAILER) {
			d->state = MCP_HTTP_ST_BOUNDARY;
			return 1;
		}
		u32 i = s->nev;
		if (i >= MCP_HTTP_PIPELINE) {
			stat_inc(MCP_STAT_HTTP_PIPELINE_FULL);
			d->state = MCP_HTTP_ST_LOST;
			return 0;
		}
		struct mcp_http_head_ev *h = &s->heads[i & (MCP_HTTP_PIPELINE - 1)];
		h->start = s->head_off;
		h->end = s->off;
		h->here = s->head_here;
		h->head_only = (d->flags & MCP_HTTP_F_HEAD_METHOD) != 0;
		h->tunnel = (d->flags & MCP_HTTP_F_TUNNEL) != 0;
		s->nev = i + 1;
		s->head_here = 0;
		http_head_done(d, 0, 0);
		return 1;
	}
	if (st == MCP_HTTP_ST_BODY) {
		u64 t = d->left < left ? d->left : left;
		d->left -= t;
		s->off = off + (u32)t;
		if (!d->left)
			d->state = MCP_HTTP_ST_BOUNDARY;
		return 1;
	}
	if (st >= MCP_HTTP_ST_CHUNK_SIZE && st <= MCP_HTTP_ST_CHUNK_END) {
		s->off = off + http_chunk(s, buf + off, left);
		return 1;
	}
	return 0;  /* LOST, UPGRADED: not followed until the connection's entry goes */
}

/* The head bytes data[from, to) of this read go after those pd holds. */
static __always_inline void http_pend_add(struct mcp_http_pend *pd, u64 buf, u32 from, u32 to)
{
	u32 at = pd->len & (MCP_HTTP_HEAD_LEN - 1);
	u32 hn = to > from ? to - from : 0;
	if (at + hn > MCP_HTTP_HEAD_LEN - 1) {
		hn = MCP_HTTP_HEAD_LEN - 1 - at;
		pd->flags |= MCP_HTTP_BEGIN_TRUNCATED;
	}
	asm volatile("" : "+r"(hn));
	if (hn && mcp_read_user(&pd->head[at], hn & (MCP_HTTP_HEAD_LEN - 1), (void *)(buf + from)) == 0)
		pd->len = at + hn;
}

static __always_inline int http_read_ret(void *ctx, long ret)
{
	struct mcp_http_args a;
	if (!http_take(&a, 1) || ret < 0)
		return 0;
	u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mcp_http_conn_key k = {.tgid = pid_tgid >> 32, .fd = a.fd};
	u64 now = bpf_ktime_get_ns();
	u32 z = 0;
	struct mcp_http_scratch *s = http_scratch.lookup(&z);
	if (!s)
		return 0;
	struct mcp_http_conn *c = http_conn.lookup(&k);
	if (c && c->sk != a.sk) {
		/* another socket at this fd: the one followed was closed unseen (close_range, dup2) */
		stat_inc(MCP_STAT_HTTP_FD_REUSED);
		http_end_all(&k, c, now, MCP_HTTP_END_CLOSE);
		http_conn_drop(&k, c);
		c = 0;
	}
	struct mcp_http_pend *pd = http_pend.lookup(&k);
	if (pd && pd->sk != a.sk) {
		http_pend.delete(&k);
		pd = 0;
	}
	if (ret == 0) {
		/* the peer closed its side: what is in flight still gets its response, until the close */
		if (c)
			c->rx.state = MCP_HTTP_ST_LOST;
		if (pd)
			http_pend.delete(&k);
		return 0;
	}
	if (tgid_state.lookup(&k.tgid))
		return 0;  /* a process that marks its requests has them from its markers: not twice */
	u32 n = ret > 0x7fffffff ? 0x7fffffff : (u32)ret;
	s->pend_used = 0;
	if (c) {
		s->d = c->rx;
		s->pend_used = pd && c->rx.state == MCP_HTTP_ST_HEAD;  /* else another head's: replaced */
	} else if (pd) {
		s->d = pd->rx;
		s->pend_used = 1;
	} else {
		/* A connection not followed: only a read that starts like a request begins one. At a
		 * request boundary that is exact (every request starts with its method); a connection met
		 * mid-stream (open before the agent) is followed from its first read that does. */
		u64 w = 0;
		u32 m = n < 4 ? n : 4;
		asm volatile("" : "+r"(m));
		if (mcp_read_user(&w, m & 7, (void *)a.buf) != 0)
			return 0;
		if (n < 4 ? !http_method_prefix((u32)w, n) : !http_method((u32)w))
			return 0;
		__builtin_memset(&s->d, 0, sizeof(s->d));
	}
	if (pd && s->pend_used)
		pd->reads++;
	s->key = k;
	s->buf = a.buf;
	s->sk = a.sk;
	s->now = now;
	s->n = n;
	s->off = 0;
	s->nev = 0;
	s->head_off = 0;
	s->head_here = 0;
	s->step = 0;
	http_tail.call(ctx, MCP_HTTP_TAIL_RX_STEP);
	stat_inc(MCP_STAT_HTTP_TAIL_FAIL);
	return 0;
}

#if MCP_PROBE_HTTP_READ_RET || MCP_PROBE_HTTP_RECVFROM_RET
int http_rx_step(void *ctx)
{
	u32 z = 0;
	struct mcp_http_scratch *s = http_scratch.lookup(&z);
	if (!s)
		return 0;
	if (http_rx_one(s)) {
		if (s->step++ < MCP_HTTP_STEPS) {
			http_tail.call(ctx, MCP_HTTP_TAIL_RX_STEP);
			stat_inc(MCP_STAT_HTTP_TAIL_FAIL);
			return 0;
		}
		if (s->off < s->n && s->d.state != MCP_HTTP_ST_LOST) {
			stat_inc(MCP_STAT_HTTP_FRAMING_LOST);  /* more in one read than the steps follow */
			s->d.state = MCP_HTTP_ST_LOST;
		}
	}
	http_tail.call(ctx, MCP_HTTP_TAIL_RX_POST);
	stat_inc(MCP_STAT_HTTP_TAIL_FAIL);
	return 0;
}

int http_rx_post(void *ctx)
{
	u32 z = 0;
	struct mcp_http_scratch *s = http_scratch.lookup(&z);
	if (!s)
		return 0;
	struct mcp_http_conn_key k = s->key;
	u64 now = s->now, buf = s->buf, sk = s->sk;
	u32 n = s->n;
	struct mcp_http_conn *c = http_conn.lookup(&k);
	if (c && c->sk != sk)
		c = 0;
	struct mcp_http_pend *pd = 0;
	if (s->pend_used)
		pd = http_pend.lookup(&k);

	/* whole heads: requests, in order; the connection's first enters http_conn */
	struct mcp_http_proc *p = 0;
	if (s->nev) {
		p = http_proc_of(k.tgid, now);
		slice_split((u32)bpf_get_current_pid_tgid(), k.tgid, now, 0);  /* CPU time counts from the head on */
	}
	for (u32 i = 0; i < MCP_HTTP_PIPELINE; i++) {
		if (i >= s->nev)
			break;
		struct mcp_http_head_ev *h = &s->heads[i];
		int ok = p && http_begin_ok(p, now);
		if (!c) {
			if (ok)
				c = http_conn_new(&k, p, sk, now);
			if (!c)
				continue;  /* not followed; its body's framing still is (below) */
		}
		u32 start = h->start, end = h->end;
		if (i == 0 && !h->here && pd) {
			asm volatile("" : "+r"(pd));  /* no &pd->head before its null check */
			http_pend_add(pd, buf, start, end);
			http_begin(&k, c, pd, 0, 0, ok, now, h, p);
		} else {
			http_begin(&k, c, 0, buf + start, end - start, ok, now, h, p);
		}
	}

	/* the framing goes back to its entry; a head still arriving keeps its bytes in a pend entry */
	u8 st = s->d.state;
	if (c) {
		c->rx = s->d;
		if (st == MCP_HTTP_ST_BOUNDARY && c->tx_seq >= c->rx_seq && c->tx.state == MCP_HTTP_ST_BOUNDARY) {
			http_conn_drop(&k, c);  /* a refused request's body read to its end: nothing in flight */
			st = MCP_HTTP_ST_LOST;
		}
	}
	if (st != MCP_HTTP_ST_HEAD && (c || st == MCP_HTTP_ST_BOUNDARY || st == MCP_HTTP_ST_LOST)) {
		if (pd || (!c && s->nev))
			http_pend.delete(&k);
		return 0;
	}
	if (!pd || s->head_here) {
		if (!pd) {
			s->pend.sk = sk;
			s->pend.rx = s->d;
			if (http_pend.update(&k, &s->pend) != 0)
				return 0;
			pd = http_pend.lookup(&k);
			if (!pd)
				return 0;
		}
		pd->first_ns = now;
		pd->len = 0;
		pd->reads = 1;
		pd->flags = s->head_here ? 0 : MCP_HTTP_BEGIN_PARTIAL;
	}
	if (!c)
		pd->rx = s->d;
	if (st == MCP_HTTP_ST_HEAD)
		http_pend_add(pd, buf, s->head_here ? s->head_off : 0, n);
	return 0;
}
#endif

/* ---- writes: responses ----
 * As reads: http_exit_write takes the call, http_tx_step runs the framing a step at a time over the
 * write's buffers (one for write/sendto; iovecs for writev and sendmsg), http_tx_post ends the
 * requests whose responses are whole. */

/* One step: the next buffer, or one framing step on the current one; 0 when the write is through. */
static __always_inline int http_tx_one(struct mcp_http_scratch *s)
{
	struct mcp_http_dir *d = &s->d;
	u32 off = s->off, n = s->n;
	if (off >= n) {
		u64 left = s->left_total;
		u32 i = s->iov_i;
		if (!left)
			return 0;
		struct mcp_iov v = {.base = s->buf, .len = left};
		if (s->sys != MCP_HTTP_SYS_WRITE) {
			if (i >= s->iovcnt || i >= MCP_HTTP_MAX_IOV ||
			    mcp_read_user(&v, sizeof(v), (void *)(s->iov + (u64)(i & 15) * sizeof(v))) != 0)
				return 0;
		} else if (i) {
			return 0;
		}
		u64 took = v.len < left ? v.len : left;
		s->left_total = left - took;
		s->ptr = v.base;
		s->n = took > 0x7fffffff ? 0x7fffffff : (u32)took;
		s->off = 0;
		s->iov_i = i + 1;
		return 1;
	}
	if (s->nev >= s->inflight)
		return 0;  /* nothing in flight: an early answer to a partial head, not followed */
	u32 left = n - off;
	u64 ptr = s->ptr + off;
	if (d->state == MCP_HTTP_ST_BOUNDARY)
		http_head_begin(d);
	u8 st = d->state;
	u32 i = s->nev & (MCP_HTTP_PIPELINE - 1);
	int whole = 0;
	if (st == MCP_HTTP_ST_HEAD || st == MCP_HTTP_ST_TRAILER) {
		http_scan(s, ptr, left, 1);
		s->off = off + s->used;
		s->written += s->used;
		if (!s->done)
			return 1;
		if (st == MCP_HTTP_ST_TRAILER) {
			d->state = MCP_HTTP_ST_BOUNDARY;
			whole = 1;
		} else {
			u16 status = d->status;
			http_head_done(d, 1, s->head_only[i]);
			s->mode = d->state == MCP_HTTP_ST_CHUNK_SIZE ? MCP_HTTP_MODE_CHUNKED :
				  d->state == MCP_HTTP_ST_UNTIL_CLOSE ? MCP_HTTP_MODE_UNKNOWN : MCP_HTTP_MODE_LENGTH;
			if (status >= 100 && status < 200 && status != 101) {
				/* 100 Continue (or 103): its bytes are the response's; the final head follows */
				s->interim = s->written;
				return 1;
			}
			if (status == 101 || (s->tunnel[i] && status >= 200 && status < 300)) {
				/* Switching Protocols, a CONNECT tunnel: HTTP/1.1 ends on the connection */
				d->state = MCP_HTTP_ST_UPGRADED;
				s->upgraded = 1;
				whole = 1;
			} else {
				whole = d->state == MCP_HTTP_ST_BOUNDARY;
			}
		}
	} else if (st == MCP_HTTP_ST_BODY) {
		u64 t = d->left < left ? d->left : left;
		d->left -= t;
		s->written += t;
		s->off = off + (u32)t;
		if (!d->left) {
			d->state = MCP_HTTP_ST_BOUNDARY;
			whole = 1;
		}
	} else if (st >= MCP_HTTP_ST_CHUNK_SIZE && st <= MCP_HTTP_ST_CHUNK_END) {
		u32 used = http_chunk(s, ptr, left);
		s->written += used;
		s->off = off + used;
	} else {
		s->written += left;  /* until the close, upgraded, lost: every byte is the response's */
		s->off = n;
	}
	if (!whole)
		return 1;
	struct mcp_http_resp_ev *r = &s->resps[i];
	r->written = s->written;
	r->interim = s->interim;
	r->status = d->status;
	r->mode = s->mode;
	s->nev++;
	s->written = 0;
	s->interim = 0;
	s->mode = MCP_HTTP_MODE_UNKNOWN;
	return 1;
}

static __always_inline int http_write_ret(void *ctx, long ret)
{
	struct mcp_http_args a;
	if (!http_take(&a, 0) || ret <= 0)
		return 0;
	u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mcp_http_conn_key k = {.tgid = pid_tgid >> 32, .fd = a.fd};
	struct mcp_http_conn *c = http_conn.lookup(&k);
	if (!c || c->sk != a.sk)
		return 0;
	u64 total = (u64)ret;
	if (c->tx.state == MCP_HTTP_ST_BODY && c->tx.left > total && c->tx_seq < c->rx_seq) {
		c->tx.left -= total;  /* the middle of a body: no byte to look at */
		c->written += total;
		return 0;
	}
	u32 z = 0;
	struct mcp_http_scratch *s = http_scratch.lookup(&z);
	if (!s)
		return 0;
	u64 iov = a.buf, iovcnt = a.count;
	if (a.sys == MCP_HTTP_SYS_SENDMSG) {
		/* struct user_msghdr: msg_iov at 16, msg_iovlen at 24 (64-bit) */
		if (mcp_read_user(&iov, 8, (void *)(a.buf + 16)) != 0 ||
		    mcp_read_user(&iovcnt, 8, (void *)(a.buf + 24)) != 0)
			return 0;
	}
	s->key = k;
	s->sk = a.sk;
	s->now = bpf_ktime_get_ns();
	s->buf = a.buf;
	s->sys = a.sys;
	s->iov = iov;
	s->iovcnt = iovcnt;
	s->d = c->tx;
	s->nev = 0;
	s->inflight = c->rx_seq - c->tx_seq;
	s->written = c->written;
	s->interim = c->interim;
	s->mode = c->tx_mode;
	s->upgraded = 0;
	s->off = s->n = 0;
	s->iov_i = 0;
	s->left_total = total;
	s->step = 0;
	for (u32 i = 0; i < MCP_HTTP_PIPELINE; i++) {
		struct mcp_http_req *q = &c->q[(c->tx_seq + i) & (MCP_HTTP_PIPELINE - 1)];
		s->head_only[i] = q->head_only;
		s->tunnel[i] = q->tunnel;
	}
	http_tail.call(ctx, MCP_HTTP_TAIL_TX_STEP);
	stat_inc(MCP_STAT_HTTP_TAIL_FAIL);
	return 0;
}

#if MCP_PROBE_HTTP_WRITE_RET || MCP_PROBE_HTTP_SENDTO_RET || MCP_PROBE_HTTP_WRITEV_RET || MCP_PROBE_HTTP_SENDMSG_RET
int http_tx_step(void *ctx)
{
	u32 z = 0;
	struct mcp_http_scratch *s = http_scratch.lookup(&z);
	if (!s)
		return 0;
	if (http_tx_one(s)) {
		if (s->step++ < MCP_HTTP_TX_STEPS) {
			http_tail.call(ctx, MCP_HTTP_TAIL_TX_STEP);
			stat_inc(MCP_STAT_HTTP_TAIL_FAIL);
			return 0;
		}
		u8 st = s->d.state;
		if ((s->off < s->n || s->left_total) && s->nev < s->inflight && st != MCP_HTTP_ST_LOST &&
		    st != MCP_HTTP_ST_UNTIL_CLOSE && st != MCP_HTTP_ST_UPGRADED) {
			stat_inc(MCP_STAT_HTTP_FRAMING_LOST);  /* more in one write than the steps follow */
			s->d.state = MCP_HTTP_ST_LOST;
		}
	} else if (s->left_total && s->iov_i >= MCP_HTTP_MAX_IOV && s->nev < s->inflight) {
		stat_inc(MCP_STAT_HTTP_FRAMING_LOST);  /* more buffers than followed */
		s->d.state = MCP_HTTP_ST_LOST;
	}
	http_tail.call(ctx, MCP_HTTP_TAIL_TX_POST);
	stat_inc(MCP_STAT_HTTP_TAIL_FAIL);
	return 0;
}

int http_tx_post(void *ctx)
{
	u32 z = 0;
	struct mcp_http_scratch *s = http_scratch.lookup(&z);
	if (!s)
		return 0;
	struct mcp_http_conn_key k = s->key;
	u64 now = s->now;
	struct mcp_http_conn *c = http_conn.lookup(&k);
	if (!c || c->sk != s->sk)
		return 0;
	/* whole responses: their requests end, in order */
	if (s->nev)
		slice_split((u32)bpf_get_current_pid_tgid(), k.tgid, now, 0);  /* the slice so far belongs up to here */
	for (u32 i = 0; i < MCP_HTTP_PIPELINE; i++) {
		if (i >= s->nev)
			break;
		struct mcp_http_resp_ev *r = &s->resps[i];
		http_end(&k, c, c->tx_seq + i, now, MCP_HTTP_END_COMPLETE, r->written, r->interim, r->status, r->mode);
	}
	c->tx_seq += s->nev;
	c->tx = s->d;
	c->written = s->written;
	c->interim = s->interim;
	c->tx_mode = s->mode;
	if (s->upgraded)
		c->rx.state = MCP_HTTP_ST_UPGRADED;
	u8 rs = c->rx.state;
	if (c->tx_seq >= c->rx_seq && (rs == MCP_HTTP_ST_BOUNDARY || rs == MCP_HTTP_ST_LOST) &&
	    c->tx.state == MCP_HTTP_ST_BOUNDARY)
		http_conn_drop(&k, c);  /* nothing in flight: the next request is told by its method again */
	return 0;
}
#endif

#if MCP_PROBE_HTTP_READ
TRACEPOINT_PROBE(syscalls, sys_enter_read)
{
	http_save((u32)args->fd, (u64)args->buf, args->count, MCP_HTTP_SYS_READ);
	return 0;
}
#endif
#if MCP_PROBE_HTTP_RECVFROM
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom)
{
	http_save((u32)args->fd, (u64)args->ubuf, args->size, MCP_HTTP_SYS_READ);
	return 0;
}
#endif
#if MCP_PROBE_HTTP_WRITE
TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
	http_save((u32)args->fd, (u64)args->buf, args->count, MCP_HTTP_SYS_WRITE);
	return 0;
}
#endif
#if MCP_PROBE_HTTP_SENDTO
TRACEPOINT_PROBE(syscalls, sys_enter_sendto)
{
	http_save((u32)args->fd, (u64)args->buff, args->len, MCP_HTTP_SYS_WRITE);
	return 0;
}
#endif
#if MCP_PROBE_HTTP_WRITEV
TRACEPOINT_PROBE(syscalls, sys_enter_writev)
{
	http_save((u32)args->fd, (u64)args->vec, args->vlen, MCP_HTTP_SYS_WRITEV);
	return 0;
}
#endif
#if MCP_PROBE_HTTP_SENDMSG
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg)
{
	http_save((u32)args->fd, (u64)args->msg, 0, MCP_HTTP_SYS_SENDMSG);
	return 0;
}
#endif
#if MCP_PROBE_HTTP_SOCK_RECV
TRACEPOINT_PROBE(sock, sock_recv_length)
{
	http_sock((u64)args->sk);
	return 0;
}
#endif
#if MCP_PROBE_HTTP_SOCK_SEND
TRACEPOINT_PROBE(sock, sock_send_length)
{
	http_sock((u64)args->sk);
	return 0;
}
#endif
/* One program for every read-side exit and one for every write-side exit, each attached to several
 * tracepoints (agent/core/probes.py names them in `fn`): compiled and verified once, not per syscall.
 * Every syscalls:sys_exit_* record has the same layout (kernel/trace/trace_syscalls.c, struct
 * syscall_trace_exit): the common fields, int __syscall_nr at 8, long ret at 16. */
struct mcp_sys_exit {
	u64 common;
	int nr;
	int pad;
	long ret;
};

#if MCP_PROBE_HTTP_READ_RET || MCP_PROBE_HTTP_RECVFROM_RET
int http_exit_read(struct mcp_sys_exit *ctx)
{
	return http_read_ret(ctx, ctx->ret);
}
#endif

#if MCP_PROBE_HTTP_WRITE_RET || MCP_PROBE_HTTP_SENDTO_RET || MCP_PROBE_HTTP_WRITEV_RET || MCP_PROBE_HTTP_SENDMSG_RET
int http_exit_write(struct mcp_sys_exit *ctx)
{
	return http_write_ret(ctx, ctx->ret);
}
#endif

#if MCP_PROBE_HTTP_CLOSE
TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tgid = pid_tgid >> 32;
	if (!watched_bit(tgid))
		return 0;
	struct mcp_http_conn_key k = {.tgid = tgid, .fd = (u32)args->fd};
	http_pend.delete(&k);
	struct mcp_http_conn *c = http_conn.lookup(&k);
	if (!c)
		return 0;
	http_end_all(&k, c, bpf_ktime_get_ns(), MCP_HTTP_END_CLOSE);
	http_conn_drop(&k, c);
	return 0;
}
#endif
