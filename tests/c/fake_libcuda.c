/* A stand-in for libcuda.so: the driver API symbols the agent probes, with their real signatures
 * (cuda.h, CUDA 12), doing nothing but count their calls. Tests build it with
 *   cc -shared -fPIC -O2 -fno-ipa-icf -o libcuda.so.1 fake_libcuda.c [-DFAKE_NO_PTSZ]
 * -fno-ipa-icf and the per-symbol counters keep every symbol a function of its own: folded
 * identical bodies would share an address, and a uprobe there would count both names.
 * FAKE_NO_PTSZ leaves out cuLaunchKernelEx_ptsz and cuStreamSynchronize_ptsz (a driver without them).
 *
 * Sync calls wait fake_sync_ns (set by the caller); cuEventSynchronize(FAKE_BLOCK_EVENT) blocks
 * until fake_release() so that a test can kill the thread inside the call.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef int CUresult;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
typedef struct CUgraphExec_st *CUgraphExec;
typedef unsigned long long CUdeviceptr;
typedef struct CUlaunchConfig_st {
	unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
	CUstream hStream;
	void *attrs;
	unsigned int numAttrs;
} CUlaunchConfig;

#define FAKE_BLOCK_EVENT ((CUevent)0xb10c)

enum { F_LAUNCH, F_LAUNCH_PTSZ, F_LAUNCH_EX, F_LAUNCH_EX_PTSZ, F_GRAPH, F_GRAPH_PTSZ, F_PUSH, F_PUSH_V2,
       F_POP, F_POP_V2, F_SET, F_SSYNC, F_SSYNC_PTSZ, F_CSYNC, F_ESYNC, F_ALLOC, F_ALLOC_ASYNC,
       F_ALLOC_ASYNC_PTSZ, F_FREE, F_CSYNC_V2, F_FREE_ASYNC, F_FREE_ASYNC_PTSZ, F_MAX };
volatile unsigned long fake_calls[F_MAX];
volatile unsigned long long fake_sync_ns;
volatile int fake_blocked;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int released;

static void wait_ns(unsigned long long ns)
{
	if (!ns)
		return;
	struct timespec ts = {ns / 1000000000ull, ns % 1000000000ull};
	while (nanosleep(&ts, &ts) != 0)
		;
}

void fake_release(void)
{
	pthread_mutex_lock(&mu);
	released = 1;
	pthread_cond_broadcast(&cv);
	pthread_mutex_unlock(&mu);
}

#define LAUNCH_ARGS CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, \
	unsigned int by, unsigned int bz, unsigned int shmem, CUstream s, void **params, void **extra
CUresult cuLaunchKernel(LAUNCH_ARGS) { fake_calls[F_LAUNCH]++; return 0; }
CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS) { fake_calls[F_LAUNCH_PTSZ]++; return 0; }
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{ fake_calls[F_LAUNCH_EX]++; return 0; }
#ifndef FAKE_NO_PTSZ
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{ fake_calls[F_LAUNCH_EX_PTSZ]++; return 0; }
#endif
CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { fake_calls[F_GRAPH]++; return 0; }
CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) { fake_calls[F_GRAPH_PTSZ]++; return 0; }

CUresult cuCtxPushCurrent(CUcontext ctx) { fake_calls[F_PUSH]++; return 0; }
CUresult cuCtxPushCurrent_v2(CUcontext ctx) { fake_calls[F_PUSH_V2]++; return 0; }
CUresult cuCtxPopCurrent(CUcontext *pctx) { fake_calls[F_POP]++; if (pctx) *pctx = 0; return 0; }
CUresult cuCtxPopCurrent_v2(CUcontext *pctx) { fake_calls[F_POP_V2]++; if (pctx) *pctx = 0; return 0; }
CUresult cuCtxSetCurrent(CUcontext ctx) { fake_calls[F_SET]++; return 0; }

CUresult cuStreamSynchronize(CUstream s) { fake_calls[F_SSYNC]++; wait_ns(fake_sync_ns); return 0; }
#ifndef FAKE_NO_PTSZ
CUresult cuStreamSynchronize_ptsz(CUstream s) { fake_calls[F_SSYNC_PTSZ]++; wait_ns(fake_sync_ns); return 0; }
#endif
CUresult cuCtxSynchronize(void) { fake_calls[F_CSYNC]++; wait_ns(fake_sync_ns); return 0; }
CUresult cuEventSynchronize(CUevent e)
{
	fake_calls[F_ESYNC]++;
	if (e == FAKE_BLOCK_EVENT) {
		pthread_mutex_lock(&mu);
		fake_blocked = 1;
		while (!released)
			pthread_cond_wait(&cv, &mu);
		pthread_mutex_unlock(&mu);
		return 0;
	}
	wait_ns(fake_sync_ns);
	return 0;
}

/* what the allocations return, set by the caller: 2 is CUDA_ERROR_OUT_OF_MEMORY (cuda.h) */
volatile int fake_alloc_result;

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{ fake_calls[F_ALLOC]++; *dptr = 0x1000 + bytesize; return fake_alloc_result; }
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s)
{ fake_calls[F_ALLOC_ASYNC]++; *dptr = 0x2000 + bytesize; return fake_alloc_result; }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s)
{ fake_calls[F_ALLOC_ASYNC_PTSZ]++; *dptr = 0x3000 + bytesize; return fake_alloc_result; }
CUresult cuMemFree_v2(CUdeviceptr dptr) { fake_calls[F_FREE]++; return 0; }
CUresult cuCtxSynchronize_v2(CUcontext ctx) { fake_calls[F_CSYNC_V2]++; wait_ns(fake_sync_ns); return 0; }
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) { fake_calls[F_FREE_ASYNC]++; return 0; }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) { fake_calls[F_FREE_ASYNC_PTSZ]++; return 0; }
