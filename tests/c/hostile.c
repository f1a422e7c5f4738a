/* A hostile local user's processes against the request marker (tests/test_security_blinding.py).
 *
 *   hostile flood SECONDS       mark begin+end as fast as it can for SECONDS; prints the pairs made
 *   hostile procs N             N child processes, each marks one begin and waits; "ready" once all did
 *   hostile threads N           N threads (64 KiB stacks), each marks one begin and waits; "ready"
 *   hostile launch SECONDS LIB  dlopen LIB and call cuLaunchKernel as fast as it can, without cuInit
 *   hostile libs 0 LIB...       dlopen every LIB; "ready" once all are mapped
 *   hostile maps N              N mappings (alternating page protections: no two merge); "ready"
 *
 * Children and threads wait until stdin closes or the process is killed. */
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>
#include "mcp_records.h"

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void mark(__u16 op, __u64 id)
{
	struct mcp_mark m = {.magic = MCP_MARK_MAGIC, .version = MCP_MARK_VERSION, .op = op, .request_id = id};
	ioctl(-1, MCP_MARK_CMD, &m);
}

/* until stdin closes: the test holds the other end */
static void wait_stdin(void)
{
	char c;
	while (read(0, &c, 1) > 0)
		;
}

static void *hold(void *arg)
{
	mark(MCP_OP_BEGIN, (__u64)(long)arg);
	for (;;)
		pause();
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 3)
		return 2;
	long n = atol(argv[2]);
	if (!strcmp(argv[1], "flood")) {
		double end = now() + atof(argv[2]);
		unsigned long long k = 0;
		while (now() < end)
			for (int i = 0; i < 256; i++, k++) {
				mark(MCP_OP_BEGIN, k + 1);
				mark(MCP_OP_END, k + 1);
			}
		printf("%llu\n", k);
		return 0;
	}
	if (!strcmp(argv[1], "procs")) {
		int fds[2];
		if (pipe(fds))
			return 1;
		for (long i = 0; i < n; i++) {
			pid_t p = fork();
			if (p < 0) {
				perror("fork");
				return 1;
			}
			if (p == 0) {
				prctl(PR_SET_PDEATHSIG, SIGKILL);
				mark(MCP_OP_BEGIN, i + 1);
				close(fds[0]);
				if (write(fds[1], "x", 1) != 1)
					_exit(1);
				for (;;)
					pause();
			}
		}
		close(fds[1]);
		char c;
		for (long i = 0; i < n; i++)
			if (read(fds[0], &c, 1) != 1)
				return 1;
		printf("ready\n");
		fflush(stdout);
		while (read(0, &c, 1) > 0)
			;
		kill(0, SIGKILL);
		return 0;
	}
	if (!strcmp(argv[1], "threads")) {
		pthread_attr_t a;
		pthread_attr_init(&a);
		pthread_attr_setstacksize(&a, 64 << 10);
		for (long i = 0; i < n; i++) {
			pthread_t t;
			if (pthread_create(&t, &a, hold, (void *)(i + 1))) {
				perror("pthread_create");
				return 1;
			}
		}
		usleep(200000);
		printf("ready\n");
		fflush(stdout);
		wait_stdin();
		return 0;
	}
	if (!strcmp(argv[1], "libs")) {
		for (int i = 3; i < argc; i++)
			if (!dlopen(argv[i], RTLD_NOW)) {
				fprintf(stderr, "%s\n", dlerror());
				return 1;
			}
		printf("ready\n");
		fflush(stdout);
		wait_stdin();
		return 0;
	}
	if (!strcmp(argv[1], "maps")) {
		long pg = sysconf(_SC_PAGESIZE);
		char *p = mmap(0, n * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			return 1;
		for (long i = 0; i < n; i += 2)
			if (mprotect(p + i * pg, pg, PROT_READ))
				return 1;
		printf("ready\n");
		fflush(stdout);
		wait_stdin();
		return 0;
	}
	if (!strcmp(argv[1], "launch") && argc > 3) {
		void *h = dlopen(argv[3], RTLD_NOW);
		if (!h) {
			fprintf(stderr, "%s\n", dlerror());
			return 1;
		}
		int (*f)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
			 void **, void **) = dlsym(h, "cuLaunchKernel");
		double end = now() + atof(argv[2]);
		unsigned long long k = 0;
		while (now() < end)
			for (int i = 0; i < 256; i++, k++)
				f(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
		printf("%llu\n", k);
		return 0;
	}
	return 2;
}
