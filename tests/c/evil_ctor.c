/* Linked into the libcuda.so files tests/test_security_code.py plants as a hostile user: a constructor
 * that leaves LIBRARY.ran-as-EUID beside the library. The agent must never load such a file; a
 * ran-as-0 file means its code ran as root. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

__attribute__((constructor)) static void ran(void)
{
	Dl_info i;
	char p[4096];
	if (!dladdr((void *)ran, &i) || !i.dli_fname)
		return;
	snprintf(p, sizeof p, "%s.ran-as-%u", i.dli_fname, (unsigned)geteuid());
	FILE *f = fopen(p, "w");
	if (f)
		fclose(f);
}
