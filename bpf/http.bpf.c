/* Zero-code HTTP/1.1 requests of watched processes, from socket syscall tracepoints.
 *
 * No kprobes on these kernels (CONFIG_KPROBES unset): syscalls:sys_enter/exit_* of read, recvfrom,
 * write, sendto, writev, sendmsg and close. The enter side saves the arguments of a watched thread's
 * call (map http_args); the exit side has its return value, and the data is then in user memory:
 *
 *   read/recvfrom returning data that starts with an HTTP method: a request begins on (tgid, fd),
 *     a connection followed from its first request on (those open before the agent too);
 *   the first write after it: the response head, parsed here (status, Content-Length, chunked);
 *   the write completing the framing (head + Content-Length bytes, or the terminal chunk): the end;
 *   failing that, the connection's next request or its close ends it (end reason says which).
 *
 * BEGIN and END carry the counters of the request's thread, its process and its serving group (the
 * thread's cgroup; requests.bpf.c and reclaim.bpf.c add to it) at that moment; user space subtracts.
 * Not seen: TLS (the data is ciphertext here), HTTP/2 (binary frames), io_uring and sendfile/splice
 * (no read/write syscall), pipelined requests (one read holding two heads counts as one).
 * Records go to http_events, a ring of their own: a flood of requests to a watched server cannot
 * crowd marked requests out of req_events.
 */

#define MCP_HTTP_MAX_CONNS 16384
#define MCP_HTTP_MIN_HEAD 16          /* "GET / HTTP/1.1\r\n": shorter reads are not a request head */
#define MCP_HTTP_MAX_IOV 8            /* iovecs looked at in writev/sendmsg */

BPF_RINGBUF_OUTPUT(http_events, MCP_HTTP_RINGBUF_PAGES);
BPF_HASH(http_args, u32, struct mcp_http_args, MCP_MAX_THREADS);
BPF_HASH(http_conn, struct mcp_http_conn_key, struct mcp_http_conn, MCP_HTTP_MAX_CONNS);
struct mcp_http_rate {
	u64 window_start_ns;
	u32 begins;
	u32 pad;
};
BPF_TABLE("lru_hash", u32, struct mcp_http_rate, http_rate, MCP_MAX_PROCS);
/* Per-CPU scratch. Values the scan and the iovec walk find are kept here, in map memory, rather
 * than in registers: the verifier then sees one state per loop iteration, not one per combination
 * of what earlier iterations found (which passed its 1M-instruction limit in sys_exit_sendmsg). */
struct mcp_http_scratch {
	u64 first, first_len, end;    /* the first buffer written, and where the written bytes end */
	u32 cl_at, chunked;           /* Content-Length's value offset; a Transfer-Encoding header */
	u32 head_len, pad;            /* the head's length, through its empty line; 0: not in the scan */
	u8 b[MCP_HTTP_SCAN + 32];     /* + room for the 16 bytes read past an index < MCP_HTTP_SCAN */
};
BPF_PERCPU_ARRAY(http_scratch, struct mcp_http_scratch, 1);

struct mcp_iov {                      /* struct iovec */
	u64 base;
	u64 len;
};

static __always_inline int http_method(u32 w)
{
	/* the first four bytes, little-endian: "GET ", "POST", "PUT ", "HEAD", "DELE", "PATC", "OPTI" */
	return w == 0x20544547 || w == 0x54534f50 || w == 0x20545550 || w == 0x44414548 ||
	       w == 0x454c4544 || w == 0x43544150 || w == 0x4954504f;
}

static __always_inline void http_snap(struct mcp_counters *dst, struct mcp_counters *src)
{
	if (src)
		__builtin_memcpy(dst, src, sizeof(*dst));
	else
		__builtin_memset(dst, 0, sizeof(*dst));
}

static __always_inline void http_save(u32 fd, u64 buf, u64 count, u32 sys)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
	if (!watched_bit(tgid))
		return;
	if (sys != MCP_HTTP_SYS_READ) {
		/* a write matters only inside a request: most writes of a watched process cost this lookup */
		struct mcp_http_conn_key k = {.tgid = tgid, .fd = fd};
		struct mcp_http_conn *c = http_conn.lookup(&k);
		if (!c || c->state == MCP_HTTP_IDLE)
			return;
	}
	struct mcp_http_args a = {.buf = buf, .count = count, .fd = fd, .sys = sys};
	if (http_args.update(&tid, &a) != 0)
		stat_inc(MCP_STAT_HTTP_ARGS_FULL);
}

/* The saved arguments of this thread's call, taken out of the map; 0 if none or not of `want`. */
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
	return (out->sys == MCP_HTTP_SYS_READ) == !!want_read;
}

static __always_inline void http_end(struct mcp_http_conn_key *k, struct mcp_http_conn *c, u64 now, u32 reason)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	c->state = MCP_HTTP_IDLE;
	struct mcp_ev_http_end *e = http_events.ringbuf_reserve(sizeof(*e));
	if (!e) {
		stat_inc(MCP_STAT_RB_HTTP_LOST);
		return;
	}
	fill_hdr(&e->h, MCP_EV_HTTP_END, sizeof(*e), pid_tgid, now);
	e->conn_id = c->conn_id;
	e->seq = c->seq;
	e->begin_ns = c->begin_ns;
	e->written = c->written;
	e->group = c->group;
	e->fd = k->fd;
	e->begin_tid = c->begin_tid;
	e->status = c->status;
	e->reason = reason;
	e->mode = c->mode;
	e->pad = 0;
	u32 tid = c->begin_tid, tgid = k->tgid;
	u64 g = c->group;
	if ((u32)pid_tgid == tid)  /* the slice running now belongs up to here (requests.bpf.c) */
		slice_split(tid, tgid, now, 0);
	http_snap(&e->thread, thread_stats.lookup(&tid));
	http_snap(&e->proc, proc_stats.lookup(&tgid));
	http_snap(&e->grp, g ? group_stats.lookup(&g) : 0);
	http_events.ringbuf_submit(e, 0);
}

static __always_inline void http_begin(struct mcp_http_conn_key *k, struct mcp_http_conn *c, u64 now,
				       u64 buf, u32 len, u32 first)
{
	u64 pid_tgid = bpf_get_current_pid_tgid();
	u32 tid = (u32)pid_tgid, tgid = pid_tgid >> 32;
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
	} else {
		g = 0;
	}
	thread_counters(tid);
	c->state = MCP_HTTP_REQUEST;
	c->begin_ns = now;
	c->seq++;
	c->written = 0;
	c->expect = 0;
	c->status = 0;
	c->mode = MCP_HTTP_MODE_UNKNOWN;
	c->head_only = first == 0x44414548;  /* "HEAD" */
	c->begin_tid = tid;
	c->group = g;

	struct mcp_ev_http_begin *e = http_events.ringbuf_reserve(sizeof(*e));
	if (!e) {
		stat_inc(MCP_STAT_RB_HTTP_LOST);
		return;
	}
	fill_hdr(&e->h, MCP_EV_HTTP_BEGIN, sizeof(*e), pid_tgid, now);
	e->conn_id = c->conn_id;
	e->seq = c->seq;
	e->group = g;
	e->fd = k->fd;
	/* at most MCP_HTTP_HEAD_LEN - 1, masked where the call reads it: the verifier wants the bound on
	 * the register passed, and the compiler passed the unclamped copy of `len` otherwise */
	u32 n = len < MCP_HTTP_HEAD_LEN - 1 ? len : MCP_HTTP_HEAD_LEN - 1;
	asm volatile("" : "+r"(n));  /* keeps the clamp on the register the call gets */
	if (mcp_read_user(e->head, n & (MCP_HTTP_HEAD_LEN - 1), (void *)buf) != 0)
		n = 0;
	e->head_len = n;
	slice_split(tid, tgid, now, 0);  /* the thread's CPU time counts from the head on */
	http_snap(&e->thread, thread_stats.lookup(&tid));
	http_snap(&e->proc, proc_stats.lookup(&tgid));
	http_snap(&e->grp, g ? group_stats.lookup(&g) : 0);
	http_events.ringbuf_submit(e, 0);
}

/* One-second windows per process, as marked begins (requests.bpf.c window_take). */
static __always_inline int http_rate_ok(u32 tgid, u64 now)
{
	struct mcp_http_rate fresh = {.window_start_ns = now};
	http_rate.insert(&tgid, &fresh);
	struct mcp_http_rate *r = http_rate.lookup(&tgid);
	if (!r)
		return 1;
	return window_take(&r->window_start_ns, &r->begins, 0, MCP_MAX_BEGINS_PER_S, now);
}

static __always_inline int http_read_ret(long ret)
{
	struct mcp_http_args a;
	if (!http_take(&a, 1))
		return 0;
	u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mcp_http_conn_key k = {.tgid = pid_tgid >> 32, .fd = a.fd};
	struct mcp_http_conn *c = http_conn.lookup(&k);
	u64 now = bpf_ktime_get_ns();
	u32 w = 0;
	if (ret != 0) {  /* 0: the peer closed its side */
		if (ret < MCP_HTTP_MIN_HEAD)
			return 0;
		if (mcp_read_user(&w, sizeof(w), (void *)a.buf) != 0 || !http_method(w))
			return 0;
		if (tgid_state.lookup(&k.tgid))
			return 0;  /* a process that marks its requests has them from its markers: not twice */
		if (!http_rate_ok(k.tgid, now)) {
			stat_inc(MCP_STAT_HTTP_RATE);
			return 0;
		}
		if (!c) {
			struct mcp_http_conn fresh = {.conn_id = now};
			if (http_conn.insert(&k, &fresh) != 0) {
				stat_inc(MCP_STAT_HTTP_CONN_FULL);
				return 0;
			}
			c = http_conn.lookup(&k);
		}
	}
	if (!c)
		return 0;
	/* one call site: each http_end inlined is ~150 instructions to compile and verify */
	if (c->state != MCP_HTTP_IDLE)
		http_end(&k, c, now, ret == 0 ? MCP_HTTP_END_CLOSE : MCP_HTTP_END_NEXT);
	if (ret == 0) {
		http_conn.delete(&k);
		return 0;
	}
	http_begin(&k, c, now, a.buf, (u32)ret, w);
	return 0;
}

/* The response head, from the first write after the request: status, then its framing. Header
 * names are matched case-insensitively (| 0x20 on each byte: '-' and ':' already have that bit). */
static __always_inline void http_parse_head(struct mcp_http_conn *c, u64 ptr, u64 len)
{
	u32 z = 0;
	struct mcp_http_scratch *s = http_scratch.lookup(&z);
	if (!s)
		return;
	u32 n = len < MCP_HTTP_SCAN - 1 ? len : MCP_HTTP_SCAN - 1;  /* masked below, as in http_begin */
	asm volatile("" : "+r"(n));
	if (n < 12 || mcp_read_user(s->b, n & (MCP_HTTP_SCAN - 1), (void *)ptr) != 0)
		return;
	u32 w;
	__builtin_memcpy(&w, s->b, 4);
	if (w != 0x50545448 || s->b[4] != '/')  /* "HTTP/" */
		return;
	u8 d0 = s->b[9] - '0', d1 = s->b[10] - '0', d2 = s->b[11] - '0';
	if (d0 > 9 || d1 > 9 || d2 > 9)
		return;
	c->status = d0 * 100 + d1 * 10 + d2;
	s->head_len = 0;
	s->cl_at = 0;
	s->chunked = 0;
	for (u32 i = 12; i < MCP_HTTP_SCAN - 1; i++) {
		/* no byte loaded in one iteration reused in the next (b[i + 1] is the next b[i]): a value
		 * carried in a register made each iteration's states distinct, past the verifier's limit */
		asm volatile("" ::: "memory");
		if (i + 1 >= n)
			break;
		if (s->b[i] != '\n')
			continue;
		u32 j = (i + 1) & (MCP_HTTP_SCAN - 1);
		if (s->b[j] == '\r') {  /* the empty line: the head ends after its \n */
			s->head_len = j + 2;
			break;
		}
		u64 a, b;
		__builtin_memcpy(&a, &s->b[j], 8);
		__builtin_memcpy(&b, &s->b[j + 8], 8);
		a |= 0x2020202020202020ULL;
		b |= 0x2020202020202020ULL;
		if (a == 0x2d746e65746e6f63ULL && (b & 0x00ffffffffffffffULL) == 0x3a6874676e656cULL)
			s->cl_at = j + 15;   /* "content-" "length:" */
		else if (a == 0x726566736e617274ULL && b == 0x6e69646f636e652dULL)
			s->chunked = 1;      /* "transfer" "-encodin": a response's only coding in practice is chunked */
	}
	u32 head_len = s->head_len;
	if (!head_len || head_len > n)
		return;  /* the head goes past this write or the scan: ends at the next request or the close */
	u16 st = c->status;
	if (c->head_only || st == 204 || st == 304) {
		c->mode = MCP_HTTP_MODE_LENGTH;
		c->expect = head_len;
	} else if (s->chunked) {
		c->mode = MCP_HTTP_MODE_CHUNKED;
	} else if (s->cl_at) {
		u32 at = s->cl_at;
		if (s->b[at & (MCP_HTTP_SCAN - 1)] == ' ')
			at++;
		u64 v = 0;
		u32 i;
		for (i = 0; i < 16; i++) {
			u8 ch = s->b[(at + i) & (MCP_HTTP_SCAN - 1)];
			if (ch < '0' || ch > '9')
				break;
			v = v * 10 + (ch - '0');
		}
		if (i > 0 && i < 16) {
			c->mode = MCP_HTTP_MODE_LENGTH;
			c->expect = head_len + v;
		}
	}
}

/* Whether the last 5 bytes written are chunked's terminal chunk "0\r\n\r\n" (its trailer-less form). */
static __always_inline int http_last_chunk(u64 end_ptr)
{
	u64 t = 0;
	if (mcp_read_user(&t, 5, (void *)(end_ptr - 5)) != 0)
		return 0;
	return t == 0xa0d0a0d30ULL;
}

static __always_inline int http_write_ret(long ret)
{
	struct mcp_http_args a;
	if (!http_take(&a, 0) || ret <= 0)
		return 0;
	u64 pid_tgid = bpf_get_current_pid_tgid();
	struct mcp_http_conn_key k = {.tgid = pid_tgid >> 32, .fd = a.fd};
	struct mcp_http_conn *c = http_conn.lookup(&k);
	if (!c || c->state == MCP_HTTP_IDLE)
		return 0;
	u32 z = 0;
	struct mcp_http_scratch *s = http_scratch.lookup(&z);
	if (!s)
		return 0;
	/* the first buffer (for the head) and where the written bytes end (for the terminal chunk) */
	s->first = a.buf;
	s->first_len = (u64)ret;
	s->end = a.buf + (u64)ret;
	u64 iov = a.buf, iovcnt = a.count;
	if (a.sys == MCP_HTTP_SYS_SENDMSG) {
		/* struct user_msghdr: msg_iov at 16, msg_iovlen at 24 (64-bit) */
		if (mcp_read_user(&iov, 8, (void *)(a.buf + 16)) != 0 ||
		    mcp_read_user(&iovcnt, 8, (void *)(a.buf + 24)) != 0)
			return 0;
	}
	if (a.sys == MCP_HTTP_SYS_WRITEV || a.sys == MCP_HTTP_SYS_SENDMSG) {
		u64 left = (u64)ret;
		s->end = 0;
		for (u32 i = 0; i < MCP_HTTP_MAX_IOV; i++) {
			if (i >= iovcnt || left == 0)
				break;
			struct mcp_iov v = {};
			if (mcp_read_user(&v, sizeof(v), (void *)(iov + i * sizeof(v))) != 0)
				break;
			u64 took = v.len < left ? v.len : left;
			if (i == 0) {
				s->first = v.base;
				s->first_len = took;
			}
			left -= took;
			/* the terminal chunk is looked for only whole in one buffer */
			s->end = took >= 5 ? v.base + took : 0;
		}
	}
	if (c->state == MCP_HTTP_REQUEST) {
		http_parse_head(c, s->first, s->first_len);
		if (c->status >= 100 && c->status < 200) {  /* 100 Continue: the response proper follows */
			c->status = 0;
			c->mode = MCP_HTTP_MODE_UNKNOWN;
			return 0;
		}
		c->state = MCP_HTTP_RESPONSE;
	}
	c->written += (u64)ret;
	if ((c->mode == MCP_HTTP_MODE_LENGTH && c->written >= c->expect) ||
	    (c->mode == MCP_HTTP_MODE_CHUNKED && s->end && http_last_chunk(s->end)))
		http_end(&k, c, bpf_ktime_get_ns(), MCP_HTTP_END_COMPLETE);
	return 0;
}

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
	return http_read_ret(ctx->ret);
}
#endif

#if MCP_PROBE_HTTP_WRITE_RET || MCP_PROBE_HTTP_SENDTO_RET || MCP_PROBE_HTTP_WRITEV_RET || MCP_PROBE_HTTP_SENDMSG_RET
int http_exit_write(struct mcp_sys_exit *ctx)
{
	return http_write_ret(ctx->ret);
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
	struct mcp_http_conn *c = http_conn.lookup(&k);
	if (!c)
		return 0;
	if (c->state != MCP_HTTP_IDLE)
		http_end(&k, c, bpf_ktime_get_ns(), MCP_HTTP_END_CLOSE);
	http_conn.delete(&k);
	return 0;
}
#endif
