/*
 * bench_kernel.cu - times the fused kernel on the standard workloads of
 * PERF-ANCHORS.md and the H = 96 length sweep.
 *
 *   bench_kernel [--reps N] [--json FILE] [--only NAME]... [--pairing off] [--split off|always]
 *                [--decode] [--step-warps 4|8] [--step-ahead P]
 *
 * --decode runs only the decode-step rows (kda_cuda_step; run_decode);
 * --step-warps launches the step kernel with that many warps per CTA, --step-ahead
 * with each CTA prefetching the bytes of the CTA P% of a wave after it (0: none).
 *
 * Per workload: random N(0,1) bf16 inputs (never zeros), A_log, dt_bias ~
 * U(0,1), lower_bound -5, fp32 state pool; sequences sorted longest first;
 * one correctness check against the float64 oracle; 3 warm-up launches; then
 * N timed launches, each after a 512 MiB write that evicts the L2, timed with
 * CUDA events; the median is reported.  Prints one table and writes the same
 * as a JSON array.  The few-chain rows (H8, H32) take their FlashKDA times
 * from the daemon's measurement (kernel time through kdad, no L2 flush).
 */
#include <algorithm>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>

#include "gpu_testutil.h"
#include "kda_cuda.h"
#include "kda_decode_sm90.h"
#ifdef KDA_PROFILE
#include "kda_fwd_sm90.h"
#include "profile.cuh"
#endif

struct Workload {
    std::string name;
    int heads;
    std::vector<int64_t> lens;
    double flashkda_ms;   /* PERF-ANCHORS.md, measured on the same H200 kind; 0 = not measured */
    double fla_ms;
};

static std::vector<Workload> workloads()
{
    const std::vector<int64_t> mixed = {1300, 547, 2048, 963, 271, 3063}, uniform(8, 1024);
    return {
        {"H96 fixed 8192", 96, {8192}, 1.40, 2.62},
        {"H96 mixed", 96, mixed, 1.39, 2.66},
        {"H96 uniform 8x1024", 96, uniform, 1.20, 2.63},
        {"H64 fixed 8192", 64, {8192}, 1.19, 1.75},
        {"H64 mixed", 64, mixed, 1.01, 1.81},
        {"H64 uniform 8x1024", 64, uniform, 0.81, 1.76},
        {"H96 fixed 1024", 96, {1024}, 0.21, 0.39},
        {"H96 fixed 2048", 96, {2048}, 0.38, 0.70},
        {"H96 fixed 4096", 96, {4096}, 0.72, 1.34},
        {"H96 fixed 16384", 96, {16384}, 2.78, 5.21},
        {"H96 fixed 32768", 96, {32768}, 5.49, 10.47},
        {"H96 4x8192", 96, std::vector<int64_t>(4, 8192), 4.97, 10.06},
        {"H96 uniform 64x1024", 96, std::vector<int64_t>(64, 1024), 0.0, 0.0},   /* the e2e throughput batch */
        {"H8 fixed 131072", 8, {131072}, 12.78, 0.0},   /* few chains, long: the split path */
        {"H8 fixed 32768", 8, {32768}, 3.247, 1.99},
        {"H32 fixed 131072", 32, {131072}, 15.29, 0.0},
        {"H32 fixed 8192", 32, {8192}, 1.057, 0.0},
    };
}

struct Result {
    Workload w;
    double ms, floor_ms, mtok_s, out_err, state_err;
};

static const double COPY_BYTES_PER_S = 4.27e12;   /* measured device copy rate (PERF-ANCHORS.md) */

/* A run's device inputs: q, k, v, g, beta N(0, 1) in bf16, an output block, and a layer whose
 * A_log and dt_bias are U(0, 1), from seeds seed .. seed + 6 (the caller cudaFrees each). */
struct Inputs {
    uint16_t *q, *k, *v, *g, *beta, *out;
    float *a_log, *dt_bias;
    kda_layer *layer;
};

static Inputs make_inputs(int64_t T, int32_t H, uint64_t seed)
{
    const size_t tok = size_t(T) * H * KDA_HEAD_DIM;
    Inputs in;
    for (uint16_t **p : {&in.q, &in.k, &in.v, &in.g, &in.out})
        GPU_CHECK(cudaMalloc(p, tok * 2));
    GPU_CHECK(cudaMalloc(&in.beta, size_t(T) * H * 2));
    gpu_fill_normal_bf16(in.q, tok, seed, 0, 1);
    gpu_fill_normal_bf16(in.k, tok, seed + 1, 0, 1);
    gpu_fill_normal_bf16(in.v, tok, seed + 2, 0, 1);
    gpu_fill_normal_bf16(in.g, tok, seed + 3, 0, 1);
    gpu_fill_normal_bf16(in.beta, size_t(T) * H, seed + 4, 0, 1);
    GPU_CHECK(cudaMalloc(&in.a_log, sizeof(float) * H));
    GPU_CHECK(cudaMalloc(&in.dt_bias, sizeof(float) * H * KDA_HEAD_DIM));
    gpu_fill_uniform_f32(in.a_log, H, seed + 5, 0, 1);
    gpu_fill_uniform_f32(in.dt_bias, size_t(H) * KDA_HEAD_DIM, seed + 6, 0, 1);
    const kda_layer layer = {in.a_log, in.dt_bias, -5.0f, 0.08838834764831845f};
    GPU_CHECK(cudaMalloc(&in.layer, sizeof layer));
    GPU_CHECK(cudaMemcpy(in.layer, &layer, sizeof layer, cudaMemcpyHostToDevice));
    return in;
}

static Result run(const Workload &w, kda_cuda *cu, int reps, void *flush, size_t flush_bytes)
{
    const int32_t H = w.heads, N = int32_t(w.lens.size());
    std::vector<int64_t> lens = w.lens;
    std::sort(lens.begin(), lens.end(), std::greater<int64_t>());   /* longest first balances the grid */
    int64_t T = 0;
    for (int64_t l : lens)
        T += l;
    const size_t tok = size_t(T) * H * KDA_HEAD_DIM;
    auto [q, k, v, g, beta, out, a_log, dt_bias, dlayer] = make_inputs(T, H, 11);

    kda_pool pool = {nullptr, KDA_DTYPE_F32, H, N}, before = pool;
    const size_t pool_bytes = size_t(N) * kda_slot_elems(H) * 4;
    GPU_CHECK(cudaMalloc(&pool.state, pool_bytes));
    GPU_CHECK(cudaMalloc(&before.state, pool_bytes));
    gpu_fill_normal_state(pool.state, KDA_DTYPE_F32, pool_bytes / 4, 18, 0.25f);
    GPU_CHECK(cudaMemcpy(before.state, pool.state, pool_bytes, cudaMemcpyDeviceToDevice));

    std::vector<int64_t> cu_seqlens(N + 1, 0), slots(N);
    for (int i = 0; i < N; i++) {
        cu_seqlens[i + 1] = cu_seqlens[i] + lens[i];
        slots[i] = i;
    }
    std::vector<kda_seq> seqs(N);
    kda_error err;
    if (kda_seqs_from_packed(seqs.data(), N, H, cu_seqlens.data(), T, slots.data(), q, k, v, g, beta, out, dlayer,
                             &err) != KDA_OK ||
        kda_cuda_batch_check(&pool, seqs.data(), N, &err) != KDA_OK) {
        fprintf(stderr, "%s: %s\n", w.name.c_str(), err.msg);
        exit(1);
    }
    kda_seq *dseqs;
    int32_t *dn;
    gpu_upload_table(seqs.data(), N, &dseqs, &dn);

    auto launch = [&]() {
        if (kda_cuda_prefill(cu, &pool, dseqs, dn, N, nullptr, &err) != KDA_OK) {
            fprintf(stderr, "%s: %s\n", w.name.c_str(), err.msg);
            exit(1);
        }
    };

    /* correctness of this very configuration, once */
    GPU_CHECK(cudaMemset(out, 0xff, tok * 2));
    launch();
    GPU_CHECK(cudaDeviceSynchronize());
    double *out_ref, *state_ref;
    GPU_CHECK(cudaMalloc(&out_ref, sizeof(double) * tok));
    GPU_CHECK(cudaMalloc(&state_ref, sizeof(double) * size_t(N) * kda_slot_elems(H)));
    gpu_oracle(dseqs, N, &before, out, out_ref, state_ref);
    const double out_err = gpu_rel_rms_bf16(out, out_ref, tok);
    const double state_err = gpu_rel_rms_slots(&pool, slots.data(), N, state_ref);
    cudaFree(out_ref);
    cudaFree(state_ref);

    const float median_ms = gpu_median_ms(launch, reps, flush, flush_bytes);
#ifdef KDA_PROFILE
    {   /* one more launch with CTA 0's phase counters (profile.cuh) */
        unsigned long long prof[kda::PROF_SLOTS];
        GPU_CHECK(kda_fwd_profile(prof, true));
        launch();
        GPU_CHECK(cudaDeviceSynchronize());
        GPU_CHECK(kda_fwd_profile(prof, true));
        const double chunks = prof[kda::PROF_CHUNKS] ? double(prof[kda::PROF_CHUNKS]) : 1.0;
        static const char *names[kda::PROF_SLOTS] = {
            "p.fetch", "p.loadwait", "p.emptywait", "p.operands", "p.lmqk", "p.inv",
            "c.fullwait", "c.state", "c.step1", "c.step23", "c.step4", "c.epilogue", "chunks", "total"};
        printf("profile %-20s CTA 0, %.0f chunks, cycles per chunk:", w.name.c_str(), chunks);
        for (int i = 0; i < kda::PROF_SLOTS; i++)
            if (i != kda::PROF_CHUNKS)
                printf(" %s %.0f", names[i], double(prof[i]) / chunks);
        printf("\n");
    }
#endif
    Result res;
    res.w = w;
    res.ms = median_ms;
    const double bytes = 1282.0 * double(T) * H + 2.0 * N * H * KDA_HEAD_DIM * KDA_HEAD_DIM * 4;
    res.floor_ms = bytes / COPY_BYTES_PER_S * 1e3;
    res.mtok_s = double(T) / (res.ms * 1e-3) / 1e6;
    res.out_err = out_err;
    res.state_err = state_err;

    for (void *p : {(void *)q, (void *)k, (void *)v, (void *)g, (void *)beta, (void *)out, (void *)a_log,
                    (void *)dt_bias, (void *)dlayer, pool.state, before.state, (void *)dseqs, (void *)dn})
        cudaFree(p);
    return res;
}

/* ---- decode steps (kda_cuda_step) ------------------------------------------------------------------------------ */

struct DecodeWorkload {
    std::string name;
    int heads, nseqs, tokens;   /* tokens per sequence */
    kda_dtype dtype;
    bool keep;                  /* the state after every token kept (speculative decoding) */
    double flashkda_ms, fla_ms; /* measured on the H200 with CUDA IPC regions, fp32 pool; 0 = not measured */
};

static std::vector<DecodeWorkload> decode_workloads()
{
    const kda_dtype F = KDA_DTYPE_F32, B = KDA_DTYPE_BF16;
    return {
        {"H32 decode 256x1", 32, 256, 1, F, false, 0.943, 0.405},
        {"H96 decode 256x1", 96, 256, 1, F, false, 2.558, 1.209},
        {"H32 decode 64x1", 32, 64, 1, F, false, 0.267, 0.142},
        {"H96 decode 64x1", 96, 64, 1, F, false, 0.0, 0.0},
        {"H32 decode 256x2", 32, 256, 2, F, false, 0.0, 0.0},
        {"H32 decode 256x4", 32, 256, 4, F, false, 0.0, 0.0},
        {"H32 decode 256x4 kept", 32, 256, 4, F, true, 0.0, 0.857},   /* fla writes every token's state */
        {"H32 decode 256x8", 32, 256, 8, F, false, 0.0, 0.0},
        {"H32 decode 256x16", 32, 256, 16, F, false, 0.0, 0.0},
        {"H32 decode 256x1 bf16", 32, 256, 1, B, false, 0.0, 0.0},
        {"H96 decode 256x1 bf16", 96, 256, 1, B, false, 0.0, 0.0},
        {"H32 decode 64x1 bf16", 32, 64, 1, B, false, 0.0, 0.0},
        {"H32 decode 256x4 bf16", 32, 256, 4, B, false, 0.0, 0.0},
        {"H32 decode 256x4 kept bf16", 32, 256, 4, B, true, 0.0, 0.0},
    };
}

struct DecodeResult {
    DecodeWorkload w;
    double ms, floor_ms, copy_tb_s, prefill_ms, out_err, state_err;
};

/*
 * One decode row: the step kernel on nseqs sequences of `tokens` tokens (slots in reverse order), checked once
 * against the float64 oracle; its median time; the chunked prefill kernel on the same batch (the choice of
 * kernel); and the floor: the bytes the step must move (each state read once and written once, plus every kept
 * state) at the copy rate of a cudaMemcpy of the pool's state bytes timed here the same way.
 */
static DecodeResult run_decode(const DecodeWorkload &w, kda_cuda *cu, int reps, void *flush, size_t flush_bytes,
                               int step_warps, int step_ahead)
{
    const int32_t H = w.heads, N = w.nseqs, T = w.nseqs * w.tokens;
    const size_t tok = size_t(T) * H * KDA_HEAD_DIM, esize = kda_dtype_size(w.dtype);
    const size_t state_bytes = size_t(N) * kda_slot_elems(H) * esize;
    auto [q, k, v, g, beta, out, a_log, dt_bias, dlayer] = make_inputs(T, H, 21);

    kda_pool pool = {nullptr, w.dtype, H, N}, before = pool;
    void *copy_dst, *kept = nullptr;
    GPU_CHECK(cudaMalloc(&pool.state, state_bytes));
    GPU_CHECK(cudaMalloc(&before.state, state_bytes));
    GPU_CHECK(cudaMalloc(&copy_dst, state_bytes));
    if (w.keep)
        GPU_CHECK(cudaMalloc(&kept, size_t(T) * kda_slot_elems(H) * esize));
    gpu_fill_normal_state(pool.state, w.dtype, state_bytes / esize, 28, 0.25f);
    GPU_CHECK(cudaMemcpy(before.state, pool.state, state_bytes, cudaMemcpyDeviceToDevice));

    std::vector<int64_t> slots(N), cu_seqlens(N + 1);
    std::vector<int32_t> lens(N, w.tokens);
    for (int i = 0; i < N; i++) {
        slots[i] = N - 1 - i;
        cu_seqlens[i + 1] = cu_seqlens[i] + w.tokens;
    }
    std::vector<kda_step_seq> sseqs(N);
    std::vector<kda_seq> pseqs(N);
    int32_t total;
    kda_error err;
    if (kda_step_seqs_fill(sseqs.data(), N, slots.data(), lens.data(), &total, &err) != KDA_OK ||
        kda_seqs_from_packed(pseqs.data(), N, H, cu_seqlens.data(), T, slots.data(), q, k, v, g, beta, out, dlayer,
                             &err) != KDA_OK) {
        fprintf(stderr, "%s: %s\n", w.name.c_str(), err.msg);
        exit(1);
    }
    kda_step step = {q, k, v, g, beta, out, kept, dlayer, sseqs.data(), N, total};
    if (kda_cuda_step_check(&pool, &step, &err) != KDA_OK) {
        fprintf(stderr, "%s: %s\n", w.name.c_str(), err.msg);
        exit(1);
    }
    kda_step_seq *dsseqs;
    kda_step *dstep;
    GPU_CHECK(cudaMalloc(&dsseqs, sizeof(kda_step_seq) * N));
    GPU_CHECK(cudaMemcpy(dsseqs, sseqs.data(), sizeof(kda_step_seq) * N, cudaMemcpyHostToDevice));
    step.seqs = dsseqs;
    GPU_CHECK(cudaMalloc(&dstep, sizeof step));
    GPU_CHECK(cudaMemcpy(dstep, &step, sizeof step, cudaMemcpyHostToDevice));
    kda_seq *dpseqs;
    int32_t *dn;
    gpu_upload_table(pseqs.data(), N, &dpseqs, &dn);

    const int warps = step_warps ? step_warps : 4, ahead = step_ahead >= 0 ? step_ahead : KDA_STEP_AHEAD_PERCENT;
    auto launch = [&]() {
        if (step_warps || step_ahead >= 0)   /* a forced CTA size or prefetch distance */
            GPU_CHECK(kda_step_launch(&pool, dstep, N, warps,
                                      kda_step_ahead_ctas(ahead, warps, kda_cuda_sm_count(cu)), nullptr));
        else if (kda_cuda_step(cu, &pool, dstep, N, nullptr, &err) != KDA_OK) {
            fprintf(stderr, "%s: %s\n", w.name.c_str(), err.msg);
            exit(1);
        }
    };
    GPU_CHECK(cudaMemset(out, 0xff, tok * 2));
    launch();
    GPU_CHECK(cudaDeviceSynchronize());
    double *out_ref, *state_ref;
    GPU_CHECK(cudaMalloc(&out_ref, sizeof(double) * tok));
    GPU_CHECK(cudaMalloc(&state_ref, sizeof(double) * size_t(N) * kda_slot_elems(H)));
    gpu_oracle(dpseqs, N, &before, out, out_ref, state_ref);
    DecodeResult r;
    r.w = w;
    r.out_err = gpu_rel_rms_bf16(out, out_ref, tok);
    r.state_err = gpu_rel_rms_slots(&pool, slots.data(), N, state_ref);
    cudaFree(out_ref);
    cudaFree(state_ref);

    r.ms = gpu_median_ms(launch, reps, flush, flush_bytes);
    const float copy_ms = gpu_median_ms(
        [&]() { GPU_CHECK(cudaMemcpyAsync(copy_dst, pool.state, state_bytes, cudaMemcpyDeviceToDevice)); }, reps, flush,
        flush_bytes);
    r.copy_tb_s = 2.0 * state_bytes / (copy_ms * 1e-3) / 1e12;
    const double moved = 2.0 * state_bytes + (w.keep ? double(T) * kda_slot_elems(H) * esize : 0.0);
    r.floor_ms = moved / (r.copy_tb_s * 1e12) * 1e3;
    r.prefill_ms = w.keep ? 0.0 : gpu_median_ms([&]() {
        if (kda_cuda_prefill(cu, &pool, dpseqs, dn, N, nullptr, &err) != KDA_OK) {
            fprintf(stderr, "%s: %s\n", w.name.c_str(), err.msg);
            exit(1);
        }
    }, reps, flush, flush_bytes);

    for (void *p : {(void *)q, (void *)k, (void *)v, (void *)g, (void *)beta, (void *)out, (void *)a_log,
                    (void *)dt_bias, (void *)dlayer, pool.state, before.state, copy_dst, kept, (void *)dsseqs,
                    (void *)dstep, (void *)dpseqs, (void *)dn})
        cudaFree(p);
    return r;
}

static void print_decode(const std::vector<DecodeResult> &rs)
{
    printf("\ndecode steps (kda_cuda_step), median of the same launches; floor: each state read once and written once "
           "(and every kept state written) at the copy rate measured in this run\n");
    printf("%-24s %9s %9s %8s %9s %11s %9s %11s %9s %9s\n", "workload", "ms", "floor ms", "x floor", "copy TB/s",
           "prefill ms", "fla ms", "FlashKDA ms", "out err", "state err");
    for (const DecodeResult &r : rs)
        printf("%-24s %9.4f %9.4f %7.2fx %9.2f %11.4f %9.3f %11.3f %9.5f %9.5f\n", r.w.name.c_str(), r.ms, r.floor_ms,
               r.ms / r.floor_ms, r.copy_tb_s, r.prefill_ms, r.w.fla_ms, r.w.flashkda_ms, r.out_err, r.state_err);
}

static void json_decode(FILE *f, const std::vector<DecodeResult> &rs)
{
    for (size_t i = 0; i < rs.size(); i++) {
        const DecodeResult &r = rs[i];
        fprintf(f,
                "  {\"workload\": \"%s\", \"ms\": %.4f, \"floor_ms\": %.4f, \"ratio_to_floor\": %.3f, \"copy_tb_s\": %.3f, "
                "\"prefill_ms\": %.4f, \"flashkda_ms\": %.3f, \"fla_ms\": %.3f, \"out_err\": %.5f, \"state_err\": %.5f}%s\n",
                r.w.name.c_str(), r.ms, r.floor_ms, r.ms / r.floor_ms, r.copy_tb_s, r.prefill_ms, r.w.flashkda_ms,
                r.w.fla_ms, r.out_err, r.state_err, i + 1 < rs.size() ? "," : "");
    }
}

int main(int argc, char **argv)
{
    int reps = 50;
    kda_cuda_pairing pairing = KDA_CUDA_PAIRING_AUTO;
    kda_cuda_split split = KDA_CUDA_SPLIT_AUTO;
    const char *json = nullptr;
    std::vector<std::string> only;
    bool decode_only = false;
    int step_warps = 0, step_ahead = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            json = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only.push_back(argv[++i]);
        else if (!strcmp(argv[i], "--decode"))
            decode_only = true;
        else if (!strcmp(argv[i], "--step-warps") && i + 1 < argc && (atoi(argv[i + 1]) == 4 || atoi(argv[i + 1]) == 8))
            step_warps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--step-ahead") && i + 1 < argc && atoi(argv[i + 1]) >= 0 &&
                 atoi(argv[i + 1]) <= 400)
            step_ahead = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--pairing") && i + 1 < argc && !strcmp(argv[i + 1], "off")) {
            pairing = KDA_CUDA_PAIRING_OFF;
            i++;
        } else if (!strcmp(argv[i], "--split") && i + 1 < argc &&
                   (!strcmp(argv[i + 1], "off") || !strcmp(argv[i + 1], "always"))) {
            split = !strcmp(argv[++i], "off") ? KDA_CUDA_SPLIT_OFF : KDA_CUDA_SPLIT_ALWAYS;
        } else {
            fprintf(stderr, "usage: %s [--reps N] [--json FILE] [--only NAME]... [--pairing off] [--split off|always]"
                            " [--decode] [--step-warps 4|8] [--step-ahead P]\n", argv[0]);
            return 2;
        }
    }
    kda_cuda *cu;
    kda_error err;
    if (kda_cuda_create(0, &cu, &err) != KDA_OK) {
        fprintf(stderr, "bench_kernel: %s\n", err.msg);
        return err.code == KDA_ENOTSUP ? 77 : 1;
    }
    kda_cuda_set_pairing(cu, pairing);
    kda_cuda_set_split(cu, split);
    const size_t flush_bytes = size_t(512) << 20;
    void *flush;
    GPU_CHECK(cudaMalloc(&flush, flush_bytes));

    std::vector<Result> results;
    for (const Workload &w : workloads())
        if (!decode_only && (only.empty() || std::find(only.begin(), only.end(), w.name) != only.end()))
            results.push_back(run(w, cu, reps, flush, flush_bytes));
    std::vector<DecodeResult> decode_results;
    for (const DecodeWorkload &w : decode_workloads())
        if (only.empty() || std::find(only.begin(), only.end(), w.name) != only.end())
            decode_results.push_back(run_decode(w, cu, reps, flush, flush_bytes, step_warps, step_ahead));

    printf("\nkdad fused KDA kernel on %s (%d SMs), fp32 state pool, median of %d launches, L2 flushed; "
           "chains paired (a cluster of two CTAs each) %s; long chains cut %s\n",
           kda_cuda_device_name(cu), kda_cuda_sm_count(cu), reps,
           pairing == KDA_CUDA_PAIRING_OFF ? "never" : "up to the GPU's clusters at once",
           split == KDA_CUDA_SPLIT_OFF ? "never" : split == KDA_CUDA_SPLIT_ALWAYS ? "whenever two segments fit"
                                                                                 : "when few and long");
    printf("%-20s %9s %9s %11s %9s %9s %9s %9s %9s\n", "workload", "ms", "Mtok/s", "FlashKDA ms", "speedup",
           "floor ms", "% floor", "out err", "state err");
    for (const Result &r : results)
        printf("%-20s %9.3f %9.2f %11.2f %8.2fx %9.3f %8.1f%% %9.5f %9.5f\n", r.w.name.c_str(), r.ms, r.mtok_s,
               r.w.flashkda_ms, r.w.flashkda_ms > 0 ? r.w.flashkda_ms / r.ms : 0.0, r.floor_ms,
               100.0 * r.floor_ms / r.ms, r.out_err, r.state_err);
    if (!decode_results.empty())
        print_decode(decode_results);
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            perror(json);
            return 1;
        }
        fprintf(f, "[\n");
        for (size_t i = 0; i < results.size(); i++) {
            const Result &r = results[i];
            fprintf(f,
                    "  {\"workload\": \"%s\", \"ms\": %.4f, \"flashkda_ms\": %.2f, \"speedup_vs_flashkda\": %.3f, "
                    "\"fla_ms\": %.2f, \"floor_ms\": %.4f, \"mtok_s\": %.2f, \"out_err\": %.5f, \"state_err\": %.5f}%s\n",
                    r.w.name.c_str(), r.ms, r.w.flashkda_ms, r.w.flashkda_ms > 0 ? r.w.flashkda_ms / r.ms : 0.0, r.w.fla_ms,
                    r.floor_ms, r.mtok_s,
                    r.out_err, r.state_err, i + 1 < results.size() || !decode_results.empty() ? "," : "");
        }
        json_decode(f, decode_results);
        fprintf(f, "]\n");
        fclose(f);
    }
    cudaFree(flush);
    kda_cuda_destroy(cu);
    return 0;
}
