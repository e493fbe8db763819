/*
 * bench_launch.cu - what it costs on this host to start a batch on an idle
 * GPU, by each way kdad could launch one (bench/RESULTS.md, issue 4).
 *
 * The kernel has the prefill kernel's shape (one CTA per SM, 384 threads,
 * 200 KiB of shared memory); its last CTA to finish writes a sequence number
 * into pinned host memory, and the host spins on it.  Each way is measured
 * from the host's first call (or store) until the host sees that number,
 * one launch at a time on an idle device, and separately the time the host
 * spends in the launching calls.  Medians and p90 of --reps launches:
 *
 * Graphs (cudaGraphLaunch) of [copy a 4 KiB table to the device, kernel] with timing-event
 * record nodes (e0, e1) or a write of the word the host spins on (cuStreamWriteValue32
 * captured; the kernel then does not write it):
 *   graph         [copy, kernel]
 *   e0 copy k e1  [e0, copy, kernel, e1]   kdad's graph as of 2026-11-29
 *   copy e0 k e1  [copy, e0, kernel, e1]
 *   e0 copy k     [e0, copy, kernel]
 *   copy k e1     [copy, kernel, e1]
 *   copy k write  [copy, kernel, write]
 *   copy k e1 wr  [copy, kernel, e1, write]
 *   e1 query      copy k e1, the end seen by cudaEventQuery in a loop instead (how kdad's
 *                 completion thread learnt it)
 * and without a graph:
 *   kernel        cudaLaunchKernel alone, small parameters
 *
 * (Armed launches, tried on 2026-11-29: a graph queued behind cuStreamWaitValue32 and released
 * by a store to a flag in pinned host memory or by cuStreamWriteValue32 on a flag in device
 * memory, measured 18.6 and 16.8 us here against 10.0 for the graph: RESULTS.md.)
 *
 *   bench_launch [--reps N]
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>

#define CK(call)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                 \
                    cudaGetErrorString(e_));                                              \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

namespace {

constexpr int kThreads = 384;
constexpr int kSmem = 200 << 10;
constexpr int kTable = 4096;

struct Done {
    volatile unsigned *host; /* device alias of the pinned word the host spins on */
    unsigned *ctas;          /* CTAs finished in this launch */
};

__device__ void finish(const Done &d, unsigned seq)
{
    if (threadIdx.x != 0)
        return;
    __threadfence();
    if (atomicAdd(d.ctas, 1u) + 1 == gridDim.x) {
        *d.ctas = 0;
        __threadfence_system();
        *d.host = seq;
    }
}

/* Reads the seq from the device table (as kdad's kernel reads its count there); writes it
 * to the host unless a copy node does. */
__global__ void __launch_bounds__(kThreads, 1) from_table(Done d, const unsigned *table, bool write)
{
    extern __shared__ unsigned smem[];
    if (threadIdx.x == 0)
        smem[0] = table[0];
    __syncthreads();
    if (write)
        finish(d, smem[0]);
}

__global__ void __launch_bounds__(kThreads, 1) from_param(Done d, unsigned seq)
{
    finish(d, seq);
}

double now_us()
{
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

struct Stat {
    std::vector<double> total, call;
};

void report(const char *name, Stat &s)
{
    auto q = [](std::vector<double> v, double p) {
        std::sort(v.begin(), v.end());
        return v[std::min(v.size() - 1, size_t(p * v.size()))];
    };
    printf("%-13s start to done p50 %6.1f us  p90 %6.1f us | host in the calls p50 %5.1f us  p90 %5.1f us\n",
           name, q(s.total, 0.5), q(s.total, 0.9), q(s.call, 0.5), q(s.call, 0.9));
}

}  // namespace

int main(int argc, char **argv)
{
    int reps = 2000;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int grid = prop.multiProcessorCount;
    CK(cudaFuncSetAttribute(from_table, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    CK(cudaFuncSetAttribute(from_param, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));

    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned *done_host, *table_host, *table_dev, *ctas;
    CK(cudaHostAlloc((void **)&done_host, 64, cudaHostAllocMapped));
    CK(cudaHostAlloc((void **)&table_host, kTable, cudaHostAllocMapped));
    CK(cudaMalloc((void **)&table_dev, kTable));
    CK(cudaMalloc((void **)&ctas, 64));
    CK(cudaMemset(ctas, 0, 64));
    memset(table_host, 0, kTable);
    *done_host = 0;
    void *done_dev = nullptr;
    CK(cudaHostGetDevicePointer(&done_dev, done_host, 0));
    const Done d = {(volatile unsigned *)done_dev, ctas};
    volatile unsigned *done = done_host;

    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    void *write_fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &write_fn, 12000, cudaEnableDefault, &found));
    typedef CUresult (*write_value_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned);
    /* graph shapes: e0 and e1 timing events, W the write of the host's word */
    enum { START = 1, MID = 2, END = 4, WRITE = 8 };
    static const int shapes[] = {0, START | END, MID | END, START, END, WRITE, END | WRITE};
    const int nshapes = sizeof(shapes) / sizeof(shapes[0]);
    std::vector<cudaGraphExec_t> graph(nshapes);
    for (int k = 0; k < nshapes; k++) {
        const int f = shapes[k];
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        if (f & START)
            CK(cudaEventRecordWithFlags(e0, s, cudaEventRecordExternal));
        CK(cudaMemcpyAsync(table_dev, table_host, kTable, cudaMemcpyHostToDevice, s));
        if (f & MID)
            CK(cudaEventRecordWithFlags(e0, s, cudaEventRecordExternal));
        from_table<<<grid, kThreads, kSmem, s>>>(d, table_dev, !(f & WRITE));
        if (f & END)
            CK(cudaEventRecordWithFlags(e1, s, cudaEventRecordExternal));
        if ((f & WRITE) &&
            ((write_value_fn)write_fn)((CUstream)s, (CUdeviceptr)done_dev, 1, 0) != CUDA_SUCCESS) {
            fprintf(stderr, "cuStreamWriteValue32 cannot be captured\n");
            return 1;
        }
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&graph[k], g, 0));
        CK(cudaGraphDestroy(g));
    }
    CK(cudaStreamSynchronize(s));

    unsigned seq = 0;
    auto wait_done = [&](unsigned v) {
        while (*done != v) {
        }
    };
    auto idle = []() {   /* let the device go idle between launches, as a closed-loop client does */
        double until = now_us() + 50;
        while (now_us() < until) {
        }
    };
    const char *names[] = {"graph", "e0 copy k e1", "copy e0 k e1", "e0 copy k", "copy k e1",
                           "copy k write", "copy k e1 wr", "e1 query", "kernel"};
    const int nways = sizeof(names) / sizeof(names[0]);
    const int query = nshapes, plain = nshapes + 1;
    std::vector<Stat> stats(nways);
    for (int r = 0; r < reps + 20; r++) {
        for (int w = 0; w < nways; w++) {
            const bool writes = w < nshapes && (shapes[w] & WRITE);
            const unsigned v = writes ? 1 : ++seq;
            if (writes)
                *done_host = 0;
            idle();
            const double t0 = now_us();
            if (w == plain) {
                from_param<<<grid, kThreads, kSmem, s>>>(d, v);
            } else {
                table_host[0] = v;
                CK(cudaGraphLaunch(graph[w == query ? 4 : w], s));
            }
            const double t1 = now_us();
            if (w == query) {
                while (cudaEventQuery(e1) == cudaErrorNotReady) {
                }
            } else {
                wait_done(v);
            }
            const double t2 = now_us();
            CK(cudaStreamSynchronize(s));
            if (r >= 20) {
                stats[w].total.push_back(t2 - t0);
                stats[w].call.push_back(t1 - t0);
            }
        }
    }
    printf("%s, %d SMs, %d launches each, interleaved\n", prop.name, grid, reps);
    for (int w = 0; w < nways; w++)
        report(names[w], stats[w]);
    return 0;
}
