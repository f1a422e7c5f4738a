/* Native loops for the benchmarks: compiled at run time by bench/_common.py with
 *   gcc -O2 -I bpf bench/loops.c -o loops
 * so that the marker struct and command come from the one header the BPF side uses.
 *
 *   loops marker   BATCH NBATCH PAUSE_US   ns per begin+end pair, one number per batch
 *   loops getppid  BATCH NBATCH            ns per getppid() (the syscall floor), per batch
 *   loops ioctl    BATCH NBATCH            ns per ioctl(pipe, FIONREAD): an ioctl that is not a marker
 *   loops flood    SECONDS                 back-to-back pairs: "pairs ns_per_pair"
 *   loops faults   SECONDS MIB MARK CPU    mmap/touch/munmap storm: "pages seconds minflt cpu_seconds"
 *   loops pingpong SECONDS MARK CPU        two processes through pipes: "roundtrips seconds switches cpu_seconds"
 *   loops pagecache SECONDS PATH MARK CPU  PATH dropped from the page cache (fadvise DONTNEED) and read
 *                                          again, over and over: "pages seconds read_pages cpu_seconds"
 *                                          (read_pages: /proc/self/io read_bytes / page, the kernel's count)
 *   loops rw       BATCH NBATCH            ns per write()+read() of 64 bytes through a socketpair, per batch
 *                                          (four socket syscall tracepoints of the zero-code HTTP probes)
 *   loops http     BATCH NBATCH            ns per HTTP/1.1 exchange through a socketpair, per batch: the
 *                                          client writes a request head (a traceparent in it), the server
 *                                          reads it, writes a response head and 16-byte body, the client
 *                                          reads it (four socket syscalls; a followed request, when watched)
 *
 * cpu_seconds is user+system time of the process(es) doing the work: BPF programs run in the context
 * of the task that hit the tracepoint and are charged to it, while time lost to other tasks (or to
 * other guests on the host, as far as the guest can tell) is not.
 *
 * MARK=1 wraps the work in a marked request (begin before, end after) on every thread that does it.
 * CPU>=0 pins the storm (both ping-pong processes) to that CPU; -1 leaves it to the scheduler.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "mcp_records.h"

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall, no trap */
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static void mark(uint16_t op, uint64_t id)
{
	struct mcp_mark m;
	memset(&m, 0, sizeof(m));
	m.magic = MCP_MARK_MAGIC;
	m.version = MCP_MARK_VERSION;
	m.op = op;
	m.request_id = id;
	/* fails with EBADF; the agent's sys_enter_ioctl program has read m by then */
	ioctl(-1, MCP_MARK_CMD, &m);
}

static uint64_t req_id(void)
{
	return ((uint64_t)getpid() << 32 | (uint64_t)now_ns()) | 1;
}

static int cmd_marker(long batch, long nbatch, long pause_us)
{
	uint64_t id = req_id();
	struct timespec pause = {pause_us / 1000000, (pause_us % 1000000) * 1000};
	for (long b = 0; b < nbatch; b++) {
		uint64_t t0 = now_ns();
		for (long i = 0; i < batch; i++) {
			mark(MCP_OP_BEGIN, id + 2 * i);
			mark(MCP_OP_END, id + 2 * i);
		}
		uint64_t t1 = now_ns();
		printf("%s%.1f", b ? " " : "", (double)(t1 - t0) / batch);
		id += 2 * batch;
		if (pause_us > 0)
			nanosleep(&pause, NULL);
	}
	printf("\n");
	return 0;
}

static int cmd_getppid(long batch, long nbatch)
{
	for (long b = 0; b < nbatch; b++) {
		uint64_t t0 = now_ns();
		for (long i = 0; i < batch; i++)
			syscall(SYS_getppid); /* not cached by libc */
		uint64_t t1 = now_ns();
		printf("%s%.1f", b ? " " : "", (double)(t1 - t0) / batch);
	}
	printf("\n");
	return 0;
}

static int cmd_ioctl(long batch, long nbatch)
{
	int p[2], n;
	if (pipe(p) != 0)
		return perror("pipe"), 1;
	for (long b = 0; b < nbatch; b++) {
		uint64_t t0 = now_ns();
		for (long i = 0; i < batch; i++)
			ioctl(p[0], FIONREAD, &n);
		uint64_t t1 = now_ns();
		printf("%s%.1f", b ? " " : "", (double)(t1 - t0) / batch);
	}
	printf("\n");
	return 0;
}

static int cmd_flood(double seconds)
{
	uint64_t id = req_id(), t0 = now_ns(), end = t0 + (uint64_t)(seconds * 1e9), t1;
	long pairs = 0;
	do {
		for (int i = 0; i < 256; i++, pairs++) {
			mark(MCP_OP_BEGIN, id + 2 * pairs);
			mark(MCP_OP_END, id + 2 * pairs);
		}
		t1 = now_ns();
	} while (t1 < end);
	printf("%ld %.1f\n", pairs, (double)(t1 - t0) / pairs);
	return 0;
}

static long minflt(void)
{
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	return ru.ru_minflt;
}

static double cpu_s(int who)
{
	struct rusage ru;
	getrusage(who, &ru);
	return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static int pin(int cpu)
{
	cpu_set_t set;
	if (cpu < 0)
		return 0;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	if (sched_setaffinity(0, sizeof(set), &set))
		return perror("sched_setaffinity"), 1;
	return 0;
}

static int cmd_faults(double seconds, long mib, int marked, int cpu)
{
	size_t len = (size_t)mib << 20, page = sysconf(_SC_PAGESIZE);
	uint64_t id = req_id();
	long pages = 0, f0;
	uint64_t t0, t1, end;

	double c0;

	if (pin(cpu))
		return 1;
	if (marked)
		mark(MCP_OP_BEGIN, id);
	f0 = minflt();
	c0 = cpu_s(RUSAGE_SELF);
	t0 = now_ns();
	end = t0 + (uint64_t)(seconds * 1e9);
	do {
		char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			return perror("mmap"), 1;
		/* 4 KiB pages, one first-touch fault each: no transparent huge page may back the region */
		madvise(p, len, MADV_NOHUGEPAGE);
		for (size_t off = 0; off < len; off += page)
			p[off] = 1;
		pages += len / page;
		munmap(p, len);
		t1 = now_ns();
	} while (t1 < end);
	f0 = minflt() - f0;
	c0 = cpu_s(RUSAGE_SELF) - c0;
	if (marked)
		mark(MCP_OP_END, id);
	printf("%ld %.6f %ld %.6f\n", pages, (t1 - t0) / 1e9, f0, c0);
	return 0;
}

static long io_read_bytes(void)
{
	char line[128];
	long v = -1;
	FILE *f = fopen("/proc/self/io", "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "read_bytes: %ld", &v) == 1)
			break;
	fclose(f);
	return v;
}

/* Page-cache insertions at the rate the storage under PATH gives them: each pass drops the clean
 * file's pages and reads it back (readahead inserts them in this task's context). */
static int cmd_pagecache(double seconds, const char *path, int marked, int cpu)
{
	static char buf[1 << 20];
	long page = sysconf(_SC_PAGESIZE), pages = 0, r0;
	uint64_t id = req_id(), t0, t1, end;
	double c0;
	ssize_t n;
	int fd = open(path, O_RDONLY);

	if (fd < 0)
		return perror(path), 1;
	if (pin(cpu))
		return 1;
	if (marked)
		mark(MCP_OP_BEGIN, id);
	r0 = io_read_bytes();
	c0 = cpu_s(RUSAGE_SELF);
	t0 = now_ns();
	end = t0 + (uint64_t)(seconds * 1e9);
	do {
		posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
		for (off_t off = 0; (n = pread(fd, buf, sizeof(buf), off)) > 0; off += n)
			pages += n / page;
		if (n < 0)
			return perror("pread"), 1;
		t1 = now_ns();
	} while (t1 < end);
	r0 = io_read_bytes() - r0;
	c0 = cpu_s(RUSAGE_SELF) - c0;
	if (marked)
		mark(MCP_OP_END, id);
	close(fd);
	printf("%ld %.6f %ld %.6f\n", pages, (t1 - t0) / 1e9, r0 / page, c0);
	return 0;
}

static long switches(int who)
{
	struct rusage ru;
	getrusage(who, &ru);
	return ru.ru_nvcsw + ru.ru_nivcsw;
}

static int cmd_pingpong(double seconds, int marked, int cpu)
{
	int a[2], b[2];
	char c = 'x';
	if (pipe(a) || pipe(b))
		return perror("pipe"), 1;
	if (pin(cpu))
		return 1;
	pid_t child = fork();
	if (child < 0)
		return perror("fork"), 1;
	if (child == 0) { /* echo until 'q' */
		uint64_t id = req_id() + 2;
		if (marked)
			mark(MCP_OP_BEGIN, id);
		while (read(a[0], &c, 1) == 1 && c != 'q')
			if (write(b[1], &c, 1) != 1)
				break;
		if (marked)
			mark(MCP_OP_END, id);
		_exit(0);
	}
	uint64_t id = req_id();
	if (marked)
		mark(MCP_OP_BEGIN, id);
	/* one round trip to be sure the child is running before the clock starts */
	if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1)
		return perror("pingpong"), 1;
	long s0 = switches(RUSAGE_SELF), trips = 0;
	double c0 = cpu_s(RUSAGE_SELF);
	uint64_t t0 = now_ns(), end = t0 + (uint64_t)(seconds * 1e9), t1;
	do {
		for (int i = 0; i < 64; i++, trips++)
			if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1)
				return perror("pingpong"), 1;
		t1 = now_ns();
	} while (t1 < end);
	long self = switches(RUSAGE_SELF) - s0;
	double cself = cpu_s(RUSAGE_SELF) - c0;
	c = 'q';
	if (write(a[1], &c, 1) != 1)
		return perror("pingpong"), 1;
	waitpid(child, NULL, 0);
	if (marked)
		mark(MCP_OP_END, id);
	/* the child's switches and CPU time include its start and end: a few switches and tens of
	 * microseconds, against hundreds of thousands and a fraction of a second */
	printf("%ld %.6f %ld %.6f\n", trips, (t1 - t0) / 1e9, self + switches(RUSAGE_CHILDREN),
	       cself + cpu_s(RUSAGE_CHILDREN));
	return 0;
}

static int cmd_rw(long batch, long nbatch)
{
	int sv[2];
	char buf[64];
	memset(buf, 'a', sizeof(buf));  /* not an HTTP method: the read side's check says no */
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
		return perror("socketpair"), 1;
	for (long b = 0; b < nbatch; b++) {
		uint64_t t0 = now_ns();
		for (long i = 0; i < batch; i++)
			if (write(sv[0], buf, sizeof(buf)) != sizeof(buf) || read(sv[1], buf, sizeof(buf)) != sizeof(buf))
				return perror("rw"), 1;
		printf("%.1f\n", (double)(now_ns() - t0) / batch);
	}
	return 0;
}

static int cmd_http(long batch, long nbatch)
{
	static const char req[] = "GET /v1/completions HTTP/1.1\r\nHost: bench\r\nUser-Agent: loops/1\r\n"
				  "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
				  "Accept: */*\r\n\r\n";
	static const char resp[] = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 16\r\n\r\n"
				   "0123456789abcdef";
	char buf[512];
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
		return perror("socketpair"), 1;
	for (long b = 0; b < nbatch; b++) {
		uint64_t t0 = now_ns();
		for (long i = 0; i < batch; i++)
			if (write(sv[0], req, sizeof(req) - 1) != sizeof(req) - 1 ||
			    read(sv[1], buf, sizeof(buf)) != sizeof(req) - 1 ||
			    write(sv[1], resp, sizeof(resp) - 1) != sizeof(resp) - 1 ||
			    read(sv[0], buf, sizeof(buf)) != sizeof(resp) - 1)
				return perror("http"), 1;
		printf("%.1f\n", (double)(now_ns() - t0) / batch);
	}
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 5 && !strcmp(argv[1], "marker"))
		return cmd_marker(atol(argv[2]), atol(argv[3]), atol(argv[4]));
	if (argc >= 4 && !strcmp(argv[1], "getppid"))
		return cmd_getppid(atol(argv[2]), atol(argv[3]));
	if (argc >= 4 && !strcmp(argv[1], "ioctl"))
		return cmd_ioctl(atol(argv[2]), atol(argv[3]));
	if (argc >= 3 && !strcmp(argv[1], "flood"))
		return cmd_flood(atof(argv[2]));
	if (argc >= 6 && !strcmp(argv[1], "faults"))
		return cmd_faults(atof(argv[2]), atol(argv[3]), atoi(argv[4]), atoi(argv[5]));
	if (argc >= 4 && !strcmp(argv[1], "rw"))
		return cmd_rw(atol(argv[2]), atol(argv[3]));
	if (argc >= 4 && !strcmp(argv[1], "http"))
		return cmd_http(atol(argv[2]), atol(argv[3]));
	if (argc >= 6 && !strcmp(argv[1], "pagecache"))
		return cmd_pagecache(atof(argv[2]), argv[3], atoi(argv[4]), atoi(argv[5]));
	if (argc >= 5 && !strcmp(argv[1], "pingpong"))
		return cmd_pingpong(atof(argv[2]), atoi(argv[3]), atoi(argv[4]));
	fprintf(stderr, "usage: see the comment at the top of bench/loops.c\n");
	return 2;
}
