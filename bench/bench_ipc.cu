/*
 * bench_ipc.cu - is the fused kernel slower on memory opened from another
 * process's cudaIpcMemHandle, and on what does that depend?  (kdad's mixed
 * batches ran ~24% slower on CUDA IPC regions than on VMM ones; measured
 * here: it is the exported allocation's size, not where the tensors sit in
 * it.  bench/RESULTS.md, "End to end", 2026-11-29.)
 *
 *   bench_ipc [--reps N]
 *
 * Child processes cudaMalloc one buffer each, of three sizes (SIZES), and
 * pass their IPC handles over pipes; this process opens them, and
 * cudaMallocs a local buffer of each size.  On every pair, the H96 and H64
 * mixed batches run with four placements of each sequence's tensors:
 * everything packed as a varlen batch holds it (q, k, v, g, out blocks,
 * then beta), beta alone at 64 KiB boundaries, q/k/v/g/out alone at 64 KiB
 * boundaries, everything at 64 KiB boundaries (placements that do not fit
 * an allocation are skipped).  Median of N launches, L2 flushed before
 * each; two rounds, local and IPC interleaved.
 */
#include <algorithm>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "gpu_testutil.h"
#include "kda_cuda.h"

static const uint64_t PAGE = 64 << 10;

/* Allocation sizes: a multiple of 2 MiB with room for every placement; what kdactl bench
   allocates for the packed H96 mixed batch (960 MiB + 6 beta blocks of 588096 bytes, a multiple
   of neither 64 KiB nor 2 MiB); the same rounded up to 64 KiB. */
static const size_t SIZES[] = {size_t(1088) << 20, (size_t(960) << 20) + 3528576, (size_t(960) << 20) + 3538944};
static const int NSIZES = 3;

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* The child: allocates, sends the handle, holds the memory until the parent closes `hold`. */
static int exporter(size_t bytes, int handle_out, int hold)
{
    void *p;
    cudaIpcMemHandle_t h;
    if (cudaMalloc(&p, bytes) != cudaSuccess || cudaIpcGetMemHandle(&h, p) != cudaSuccess)
        return 1;
    if (write(handle_out, &h, sizeof h) != (ssize_t)sizeof h)
        return 1;
    char c;
    while (read(hold, &c, 1) > 0) {
    }
    cudaFree(p);
    return 0;
}

struct Placement {
    const char *name;
    uint64_t tensor_align, beta_align;
};

/* One mixed batch's descriptors with the placement's offsets in `base`; false if it does not fit. */
static bool place(std::vector<kda_seq> &seqs, const std::vector<int64_t> &lens, int32_t heads, uint8_t *base,
                  size_t bytes, const Placement &pl, const kda_layer *layer)
{
    const int n = int(lens.size());
    std::vector<uint64_t> off[6];
    uint64_t at = 0;
    for (int t = 0; t < 5; t++)       /* q k v g out */
        for (int j = 0; j < n; j++) {
            at = round_up(at, pl.tensor_align);
            off[t].push_back(at);
            at += uint64_t(lens[j]) * heads * KDA_HEAD_DIM * 2;
        }
    for (int j = 0; j < n; j++) {
        at = round_up(at, pl.beta_align);
        off[5].push_back(at);
        at += uint64_t(lens[j]) * heads * 2;
    }
    if (at > bytes)
        return false;
    seqs.resize(n);
    for (int j = 0; j < n; j++) {
        const int64_t cu[2] = {0, lens[j]}, slot = j;
        auto at_off = [&](int t) { return (uint16_t *)(base + off[t][j]); };
        kda_error err;
        if (kda_seqs_from_packed(&seqs[j], 1, heads, cu, lens[j], &slot, at_off(0), at_off(1), at_off(2),
                                 at_off(3), at_off(5), at_off(4), layer, &err) != KDA_OK) {
            fprintf(stderr, "bench_ipc: %s\n", err.msg);
            exit(1);
        }
    }
    return true;
}

static double time_batch(kda_cuda *cu, const std::vector<kda_seq> &seqs, int32_t heads, int reps, void *flush,
                         size_t flush_bytes)
{
    const int32_t n = int32_t(seqs.size());
    kda_pool pool = {nullptr, KDA_DTYPE_F32, heads, n};
    const size_t pool_bytes = size_t(n) * kda_slot_elems(heads) * 4;
    GPU_CHECK(cudaMalloc(&pool.state, pool_bytes));
    gpu_fill_normal_state(pool.state, KDA_DTYPE_F32, pool_bytes / 4, 18, 0.25f);
    kda_error err;
    if (kda_cuda_batch_check(&pool, seqs.data(), n, &err) != KDA_OK) {
        fprintf(stderr, "bench_ipc: %s\n", err.msg);
        exit(1);
    }
    kda_seq *dseqs;
    int32_t *dn;
    gpu_upload_table(seqs.data(), n, &dseqs, &dn);
    auto launch = [&]() {
        if (kda_cuda_prefill(cu, &pool, dseqs, dn, n, nullptr, &err) != KDA_OK) {
            fprintf(stderr, "bench_ipc: %s\n", err.msg);
            exit(1);
        }
    };
    const double ms = gpu_median_ms(launch, reps, flush, flush_bytes);
    for (void *p : {pool.state, (void *)dseqs, (void *)dn})
        cudaFree(p);
    return ms;
}

/* One exported buffer: its exporting child, the pipe that holds the child alive, its handle. */
struct Export {
    pid_t child;
    int hold;
    cudaIpcMemHandle_t handle;
};

static bool start_exporter(size_t bytes, Export *e, const Export *earlier, int nearlier)
{
    int handle_pipe[2], hold_pipe[2];
    if (pipe(handle_pipe) || pipe(hold_pipe)) {
        perror("pipe");
        return false;
    }
    e->child = fork();
    if (e->child < 0) {
        perror("fork");
        return false;
    }
    if (e->child == 0) {
        close(handle_pipe[0]);
        close(hold_pipe[1]);
        for (int i = 0; i < nearlier; i++)   /* or an earlier exporter would never see its pipe close */
            close(earlier[i].hold);
        _exit(exporter(bytes, handle_pipe[1], hold_pipe[0]));
    }
    close(handle_pipe[1]);
    close(hold_pipe[0]);
    e->hold = hold_pipe[1];
    const bool ok = read(handle_pipe[0], &e->handle, sizeof e->handle) == (ssize_t)sizeof e->handle;
    close(handle_pipe[0]);
    return ok;
}

int main(int argc, char **argv)
{
    int reps = 30;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--reps N]\n", argv[0]);
            return 2;
        }
    }
    setvbuf(stdout, nullptr, _IOLBF, 0);
    /* The exporters start before this process touches CUDA (a forked child cannot use it). */
    Export exports[NSIZES];
    for (int z = 0; z < NSIZES; z++)
        if (!start_exporter(SIZES[z], &exports[z], exports, z)) {
            fprintf(stderr, "bench_ipc: an exporting process sent no handle (no GPU?)\n");
            return 77;
        }
    kda_cuda *cu;
    kda_error err;
    if (kda_cuda_create(0, &cu, &err) != KDA_OK) {
        fprintf(stderr, "bench_ipc: %s\n", err.msg);
        return err.code == KDA_ENOTSUP ? 77 : 1;
    }
    uint8_t *ipc[NSIZES], *local[NSIZES];
    for (int z = 0; z < NSIZES; z++) {
        GPU_CHECK(cudaIpcOpenMemHandle((void **)&ipc[z], exports[z].handle, cudaIpcMemLazyEnablePeerAccess));
        GPU_CHECK(cudaMalloc(&local[z], SIZES[z]));
        gpu_fill_normal_bf16((uint16_t *)ipc[z], SIZES[z] / 2, 21, 0, 1);
        gpu_fill_normal_bf16((uint16_t *)local[z], SIZES[z] / 2, 21, 0, 1);
    }

    const int heads_list[2] = {96, 64};
    kda_layer *dlayer[2];
    float *weights[2][2];
    for (int i = 0; i < 2; i++) {
        const int H = heads_list[i];
        GPU_CHECK(cudaMalloc(&weights[i][0], sizeof(float) * H));
        GPU_CHECK(cudaMalloc(&weights[i][1], sizeof(float) * H * KDA_HEAD_DIM));
        gpu_fill_uniform_f32(weights[i][0], H, 16, 0, 1);
        gpu_fill_uniform_f32(weights[i][1], size_t(H) * KDA_HEAD_DIM, 17, 0, 1);
        const kda_layer layer = {weights[i][0], weights[i][1], -5.0f, 0.08838834764831845f};
        GPU_CHECK(cudaMalloc(&dlayer[i], sizeof layer));
        GPU_CHECK(cudaMemcpy(dlayer[i], &layer, sizeof layer, cudaMemcpyHostToDevice));
    }
    const size_t flush_bytes = size_t(512) << 20;
    void *flush;
    GPU_CHECK(cudaMalloc(&flush, flush_bytes));

    std::vector<int64_t> mixed = {1300, 547, 2048, 963, 271, 3063};
    std::sort(mixed.begin(), mixed.end(), std::greater<int64_t>());   /* as kdad orders a batch */
    const Placement placements[] = {
        {"packed", 256, 16},
        {"beta at 64 KiB", 256, PAGE},
        {"tensors at 64 KiB", PAGE, 16},
        {"all at 64 KiB", PAGE, PAGE},
    };
    printf("fused kernel, mixed batch (3063,2048,1300,963,547,271 tokens), median of %d launches, L2 flushed, ms\n",
           reps);
    printf("%-6s %-12s %-18s %-6s %9s %9s %9s\n", "heads", "allocation", "placement", "round", "local", "cuda-ipc",
           "ipc/local");
    for (int i = 0; i < 2; i++)
        for (int z = 0; z < NSIZES; z++)
            for (const Placement &pl : placements)
                for (int round = 1; round <= 2; round++) {
                    std::vector<kda_seq> s_local, s_ipc;
                    if (!place(s_local, mixed, heads_list[i], local[z], SIZES[z], pl, dlayer[i]) ||
                        !place(s_ipc, mixed, heads_list[i], ipc[z], SIZES[z], pl, dlayer[i]))
                        continue;   /* the placement's padding does not fit this allocation */
                    const double t_local = time_batch(cu, s_local, heads_list[i], reps, flush, flush_bytes);
                    const double t_ipc = time_batch(cu, s_ipc, heads_list[i], reps, flush, flush_bytes);
                    printf("H%-5d %-12zu %-18s %-6d %9.3f %9.3f %9.3f\n", heads_list[i], SIZES[z], pl.name, round,
                           t_local, t_ipc, t_ipc / t_local);
                }
    for (int z = 0; z < NSIZES; z++) {
        cudaIpcCloseMemHandle(ipc[z]);
        close(exports[z].hold);
        waitpid(exports[z].child, nullptr, 0);
    }
    kda_cuda_destroy(cu);
    return 0;
}
