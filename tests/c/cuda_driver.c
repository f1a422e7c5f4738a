/* Calls a libcuda.so (tests/c/fake_libcuda.c) in patterns the tests ask for, one command per line on
 * stdin, one reply line ("ok ...") on stdout. Build: cc -O2 -I bpf -o cuda_driver cuda_driver.c -ldl -lpthread
 *
 *   lib PATH            dlopen PATH and look up the probed symbols; "ok MISSING_COUNT"
 *   sym NAME N          call symbol NAME N times with plausible arguments
 *   launch N            N calls of each launch symbol present (cuLaunchKernel(_ptsz), cuLaunchKernelEx(_ptsz))
 *   syncns NS           sync calls wait NS from now on (fake_sync_ns)
 *   begin ID | end ID   request marker (ioctl(-1, MCP_MARK_CMD, &mark), bpf/mcp_records.h)
 *   steps R L           R times: L x cuLaunchKernel, then cuStreamSynchronize
 *   paced N RATE        N x cuLaunchKernel on a RATE/s timeline (sleeps between); "ok ELAPSED_NS"
 *   loop MS WORK        for MS milliseconds: spin WORK ns, cuLaunchKernel; "ok ITERATIONS NS_PER_ITERATION"
 *   block               a thread enters cuEventSynchronize(FAKE_BLOCK_EVENT) and blocks; "ok TID"
 *   kill                that thread gets SIGUSR1 and exits (SYS_exit) inside the call; "ok"
 *   open PATH           "ok FD";  ioctl FD N CMD: N x ioctl(FD, CMD, &buf)
 *   thread C1;C2;...    run the commands on a new thread and join it; "ok TID <last reply>"
 *   pid                 "ok PID";  calls: the fake library's call counters;  exit
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mcp_records.h"

typedef int (*fn_t)();
static const char *NAMES[] = {
	"cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",
	"cuGraphLaunch", "cuGraphLaunch_ptsz", "cuCtxPushCurrent", "cuCtxPushCurrent_v2",
	"cuCtxPopCurrent", "cuCtxPopCurrent_v2", "cuCtxSetCurrent", "cuStreamSynchronize",
	"cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuEventSynchronize", "cuMemAlloc_v2",
	"cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemFree_v2", "cuCtxSynchronize_v2", "cuMemFreeAsync",
	"cuMemFreeAsync_ptsz",
};
#define NSYM (sizeof(NAMES) / sizeof(NAMES[0]))
static fn_t fns[NSYM];
static void *lib;
static volatile unsigned long long *sync_ns;
static volatile int *blocked;
static pid_t block_tid;

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static int sym_index(const char *name)
{
	for (unsigned i = 0; i < NSYM; i++)
		if (!strcmp(NAMES[i], name))
			return i;
	return -1;
}

/* one call with arguments of the right shape for the symbol's signature */
static void call(int i)
{
	static int dummy_fn, cfg[16];
	unsigned long long dptr;
	void *ctx;
	fn_t f = fns[i];
	if (!f)
		return;
	if (i <= 1)
		f((void *)&dummy_fn, 1u, 1u, 1u, 128u, 1u, 1u, 0u, (void *)0, (void **)0, (void **)0);
	else if (i <= 3)
		f((void *)cfg, (void *)&dummy_fn, (void **)0, (void **)0);
	else if (i <= 5)
		f((void *)&dummy_fn, (void *)0);
	else if (i == 8 || i == 9)
		f(&ctx);
	else if (i == 13)
		f();
	else if (i == 15)
		f(&dptr, (size_t)4096);
	else if (i == 16 || i == 17)
		f(&dptr, (size_t)4096, (void *)0);
	else if (i == 18)
		f(0x1000ull);
	else if (i == 20 || i == 21)
		f(0x1000ull, (void *)0);
	else
		f((void *)0);
}

static void mark(uint16_t op, uint64_t id)
{
	struct mcp_mark m;
	memset(&m, 0, sizeof(m));
	m.magic = MCP_MARK_MAGIC;
	m.version = MCP_MARK_VERSION;
	m.op = op;
	m.request_id = id;
	ioctl(-1, MCP_MARK_CMD, &m); /* EBADF by design: the agent read it at sys_enter_ioctl */
}

static void on_usr1(int sig)
{
	(void)sig;
	syscall(SYS_exit, 0); /* this thread only, from inside cuEventSynchronize */
}

static void *blocker(void *arg)
{
	(void)arg;
	block_tid = gettid();
	fns[14]((void *)0xb10c); /* FAKE_BLOCK_EVENT */
	return 0;
}

static void run(char *line, char *out, size_t outsz);

struct thr { char *line; char out[512]; pid_t tid; };

static void *thread_main(void *arg)
{
	struct thr *t = arg;
	char *save, *cmd;
	t->tid = gettid();
	for (cmd = strtok_r(t->line, ";", &save); cmd; cmd = strtok_r(0, ";", &save))
		run(cmd, t->out, sizeof(t->out));
	return 0;
}

static void run(char *line, char *out, size_t outsz)
{
	char a[4096];
	long n = 0, m = 0, r = 0;
	unsigned long long u = 0;
	snprintf(out, outsz, "ok");
	if (sscanf(line, "lib %4095s", a) == 1) {
		int missing = 0;
		lib = dlopen(a, RTLD_NOW | RTLD_LOCAL);
		if (!lib) {
			snprintf(out, outsz, "err %s", dlerror());
			return;
		}
		for (unsigned i = 0; i < NSYM; i++)
			missing += !(fns[i] = (fn_t)dlsym(lib, NAMES[i]));
		sync_ns = dlsym(lib, "fake_sync_ns");
		blocked = dlsym(lib, "fake_blocked");
		snprintf(out, outsz, "ok %d", missing);
	} else if (sscanf(line, "sym %4095s %ld", a, &n) == 2) {
		int i = sym_index(a);
		if (i < 0 || !fns[i]) {
			snprintf(out, outsz, "err no %.200s", a);
			return;
		}
		for (long k = 0; k < n; k++)
			call(i);
	} else if (sscanf(line, "launch %ld", &n) == 1) {
		for (int i = 0; i < 4; i++)
			for (long k = 0; k < n; k++)
				call(i);
	} else if (sscanf(line, "syncns %llu", &u) == 1) {
		*sync_ns = u;
	} else if (sscanf(line, "allocresult %ld", &n) == 1) {
		volatile int *res = dlsym(lib, "fake_alloc_result");
		if (!res) {
			snprintf(out, outsz, "err no fake_alloc_result");
			return;
		}
		*res = (int)n;
	} else if (sscanf(line, "begin %llu", &u) == 1) {
		mark(MCP_OP_BEGIN, u);
	} else if (sscanf(line, "end %llu", &u) == 1) {
		mark(MCP_OP_END, u);
	} else if (sscanf(line, "steps %ld %ld", &n, &m) == 2) {
		for (long r = 0; r < n; r++) {
			for (long k = 0; k < m; k++)
				call(0);
			call(11);
		}
	} else if (sscanf(line, "reqs %ld %ld %ld %llu", &n, &m, &r, &u) == 4) {
		/* n marked requests (ids u, u+1, ...) of m cuLaunchKernel calls each, paced at r per
		 * second on one timeline across them (requests back to back, 1 ms between) */
		uint64_t t0 = now_ns(), step = 1000000000ull / (uint64_t)r, k = 0;
		for (long q = 0; q < n; q++) {
			mark(MCP_OP_BEGIN, u + q);
			for (long j = 0; j < m; j++, k++) {
				uint64_t at = t0 + k * step;
				struct timespec ts = {at / 1000000000ull, at % 1000000000ull};
				while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, 0) != 0)
					;
				call(0);
			}
			mark(MCP_OP_END, u + q);
			t0 += 1000000ull;
		}
		snprintf(out, outsz, "ok %llu", (unsigned long long)(now_ns() - t0));
	} else if (sscanf(line, "paced %ld %ld", &n, &m) == 2) {
		uint64_t t0 = now_ns(), step = 1000000000ull / (uint64_t)m;
		for (long k = 0; k < n; k++) {
			uint64_t at = t0 + k * step;
			struct timespec ts = {at / 1000000000ull, at % 1000000000ull};
			while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, 0) != 0)
				;
			call(0);
		}
		snprintf(out, outsz, "ok %llu", (unsigned long long)(now_ns() - t0));
	} else if (sscanf(line, "loop %lld %ld", (long long *)&u, &m) == 2) {
		uint64_t t0 = now_ns(), end = t0 + u * 1000000ull, iters = 0, t;
		do {
			uint64_t s = now_ns();
			while (now_ns() < s + (uint64_t)m)
				;
			call(0);
			iters++;
		} while ((t = now_ns()) < end);
		snprintf(out, outsz, "ok %llu %.1f", (unsigned long long)iters, (double)(t - t0) / iters);
	} else if (!strncmp(line, "block", 5)) {
		pthread_t th;
		pthread_create(&th, 0, blocker, 0);
		pthread_detach(th);
		while (!*blocked)
			usleep(1000);
		snprintf(out, outsz, "ok %d", block_tid);
	} else if (!strncmp(line, "kill", 4)) {
		char path[64];
		syscall(SYS_tgkill, getpid(), block_tid, SIGUSR1);
		snprintf(path, sizeof(path), "/proc/self/task/%d", block_tid);
		while (access(path, F_OK) == 0)
			usleep(1000);
	} else if (sscanf(line, "open %4095s", a) == 1) {
		snprintf(out, outsz, "ok %d", open(a, O_RDWR | O_CREAT, 0600));
	} else if (sscanf(line, "ioctl %ld %ld %llx", &n, &m, &u) == 3) {
		char buf[64];
		for (long k = 0; k < m; k++) {
			memset(buf, 0, sizeof(buf));
			ioctl((int)n, (unsigned long)u, buf); /* ENOTTY on a plain file but for FIONREAD: fine */
		}
	} else if (!strncmp(line, "thread ", 7)) {
		struct thr t = {.line = line + 7};
		pthread_t th;
		pthread_create(&th, 0, thread_main, &t);
		pthread_join(th, 0);
		snprintf(out, outsz, "ok %d %s", t.tid, t.out);
	} else if (!strncmp(line, "pid", 3)) {
		snprintf(out, outsz, "ok %d", getpid());
	} else if (!strncmp(line, "calls", 5)) {
		volatile unsigned long *c = dlsym(lib, "fake_calls");
		size_t off = 2;
		for (unsigned i = 0; i < NSYM && off < outsz - 24; i++)
			off += snprintf(out + off, outsz - off, " %lu", c[i]);
	} else {
		snprintf(out, outsz, "err unknown command: %.200s", line);
	}
}

int main(void)
{
	char line[4096], out[600];
	signal(SIGUSR1, on_usr1);
	setvbuf(stdout, 0, _IOLBF, 0);
	while (fgets(line, sizeof(line), stdin)) {
		line[strcspn(line, "\n")] = 0;
		if (!strcmp(line, "exit"))
			break;
		run(line, out, sizeof(out));
		puts(out);
	}
	return 0;
}
