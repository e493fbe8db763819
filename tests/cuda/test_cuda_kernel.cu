/*
 * test_cuda_kernel.cu - the fused kernel (kda_cuda.h) on the GPU.
 *
 *   golden cases       every golden case (docs/kda.md), fp32 and bf16 pools
 *   random workloads   the six standard shapes, fresh seeds, outputs poisoned,
 *                      against the float64 oracle (gpu_testutil.cu)
 *   edges              lengths around the chunk, zero-length sequences with
 *                      and without KDA_SEQ_ZERO_STATE, many short sequences,
 *                      a 100k-token sequence, untouched slots bit-identical
 *   buffers            one launch over sequences in different allocations
 *   graphs             one captured launch replayed with new batches
 *   determinism        the same batch twice gives the same bits
 *   split chains       long sequences of few chains cut into segments
 *                      (kda_cuda_set_split): 32768 and 131072 tokens against
 *                      the oracle, slow gates, the correction's scratch too
 *                      small (segments recomputed), cuts at every length, graphs,
 *                      determinism; the golden cases and edges cut too
 *
 * Exits 77 (skipped) without an sm_90 GPU.  KDA_GPU_TEST_QUICK=1 runs only a
 * small varlen batch, whole and cut (for compute-sanitizer); =split only the
 * cut one.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
extern "C" {
#include <cmocka.h>
}

#include <algorithm>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>

#include "bf16.h"
#include "golden.h"
#include "gpu_testutil.h"
#include "kda_cuda.h"
#include "kda_ref.h"

static kda_cuda *cu;
static uint64_t seed;
static const double BOUND = 0.005;

/* A packed batch in device memory: one buffer per tensor, sequences back to back. */
struct DevBatch {
    int32_t heads = 0, nseqs = 0;
    int64_t total = 0;
    std::vector<int64_t> lens, slots;
    uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr, *out = nullptr;
    float *a_log = nullptr, *dt_bias = nullptr;
    kda_layer *layer = nullptr;
    std::vector<kda_seq> seqs;      /* host copy of the descriptors */
    kda_seq *seqs_dev = nullptr;
    int32_t *nseqs_dev = nullptr;
};

static DevBatch make_batch(int32_t heads, const std::vector<int64_t> &lens, const std::vector<int64_t> &slots,
                           uint64_t s, float lower_bound = -5.0f)
{
    DevBatch b;
    b.heads = heads;
    b.nseqs = int32_t(lens.size());
    b.lens = lens;
    b.slots = slots;
    for (int64_t l : lens)
        b.total += l;
    const size_t tok = size_t(b.total) * heads * KDA_HEAD_DIM + 8;
    for (uint16_t **p : {&b.q, &b.k, &b.v, &b.g, &b.out})
        GPU_CHECK(cudaMalloc(p, tok * 2));
    GPU_CHECK(cudaMalloc(&b.beta, (size_t(b.total) * heads + 8) * 2));
    gpu_fill_normal_bf16(b.q, tok, s + 1, 0, 1);
    gpu_fill_normal_bf16(b.k, tok, s + 2, 0, 1);
    gpu_fill_normal_bf16(b.v, tok, s + 3, 0, 1);
    gpu_fill_normal_bf16(b.g, tok, s + 4, 0, 1);
    gpu_fill_normal_bf16(b.beta, size_t(b.total) * heads + 8, s + 5, 0, 1);
    GPU_CHECK(cudaMalloc(&b.a_log, sizeof(float) * heads));
    GPU_CHECK(cudaMalloc(&b.dt_bias, sizeof(float) * heads * KDA_HEAD_DIM));
    gpu_fill_uniform_f32(b.a_log, heads, s + 6, 0, 1);
    gpu_fill_uniform_f32(b.dt_bias, size_t(heads) * KDA_HEAD_DIM, s + 7, 0, 1);
    kda_layer layer = {b.a_log, b.dt_bias, lower_bound, 0.08838834764831845f};
    GPU_CHECK(cudaMalloc(&b.layer, sizeof layer));
    GPU_CHECK(cudaMemcpy(b.layer, &layer, sizeof layer, cudaMemcpyHostToDevice));
    std::vector<int64_t> cu_seqlens(b.nseqs + 1, 0);
    for (int i = 0; i < b.nseqs; i++)
        cu_seqlens[i + 1] = cu_seqlens[i] + lens[i];
    b.seqs.resize(b.nseqs + 1);
    kda_error err;
    assert_int_equal(kda_seqs_from_packed(b.seqs.data(), b.nseqs, heads, cu_seqlens.data(), b.total, slots.data(),
                                          b.q, b.k, b.v, b.g, b.beta, b.out, b.layer, &err),
                     KDA_OK);
    GPU_CHECK(cudaMalloc(&b.seqs_dev, sizeof(kda_seq) * (b.nseqs + 1)));
    GPU_CHECK(cudaMemcpy(b.seqs_dev, b.seqs.data(), sizeof(kda_seq) * b.nseqs, cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMalloc(&b.nseqs_dev, sizeof(int32_t)));
    GPU_CHECK(cudaMemcpy(b.nseqs_dev, &b.nseqs, sizeof(int32_t), cudaMemcpyHostToDevice));
    return b;
}

/* Re-uploads the host descriptors (after a test changed flags). */
static void upload_seqs(DevBatch &b)
{
    GPU_CHECK(cudaMemcpy(b.seqs_dev, b.seqs.data(), sizeof(kda_seq) * b.nseqs, cudaMemcpyHostToDevice));
}

static void free_batch(DevBatch &b)
{
    for (void *p : {(void *)b.q, (void *)b.k, (void *)b.v, (void *)b.g, (void *)b.beta, (void *)b.out,
                    (void *)b.a_log, (void *)b.dt_bias, (void *)b.layer, (void *)b.seqs_dev, (void *)b.nseqs_dev})
        cudaFree(p);
    b = DevBatch();
}

static void launch(kda_pool &pool, const kda_seq *seqs_dev, const int32_t *nseqs_dev, int32_t max_seqs)
{
    kda_error err = {};
    if (kda_cuda_prefill(cu, &pool, seqs_dev, nseqs_dev, max_seqs, nullptr, &err) != KDA_OK)
        fail_msg("kda_cuda_prefill: %s", err.msg);
    GPU_CHECK(cudaDeviceSynchronize());
}

/* Errors of b's outputs and of its slots in `after` against the oracle run from `before`. */
static void oracle_errors(const DevBatch &b, const kda_pool &before, const kda_pool &after, double *oe, double *se)
{
    double *out_ref, *state_ref;
    const size_t out_n = size_t(b.total) * b.heads * KDA_HEAD_DIM;
    GPU_CHECK(cudaMalloc(&out_ref, sizeof(double) * (out_n + 1)));
    GPU_CHECK(cudaMalloc(&state_ref, sizeof(double) * size_t(b.nseqs) * kda_slot_elems(b.heads)));
    gpu_oracle(b.seqs_dev, b.nseqs, &before, b.out, out_ref, state_ref);
    GPU_CHECK(cudaDeviceSynchronize());
    *oe = out_n ? gpu_rel_rms_bf16(b.out, out_ref, out_n) : 0.0;
    *se = gpu_rel_rms_slots(&after, b.slots.data(), b.nseqs, state_ref);
    cudaFree(out_ref);
    cudaFree(state_ref);
}

/* Poisons the outputs, runs b on `pool`, checks against the oracle and that other slots are untouched. */
static void run_and_check(DevBatch &b, kda_pool &pool, const char *what)
{
    kda_pool before = gpu_clone_pool(pool);
    GPU_CHECK(cudaMemset(b.out, 0xff, size_t(b.total) * b.heads * KDA_HEAD_DIM * 2));   /* NaN */
    launch(pool, b.seqs_dev, b.nseqs_dev, b.nseqs);
    double oe, se;
    oracle_errors(b, before, pool, &oe, &se);
    print_message("  %-44s out %.5f state %.5f\n", what, oe, se);
    if (!(oe <= BOUND && se <= BOUND))
        fail_msg("%s: out %.5f state %.5f above %.3f (seed %llu)", what, oe, se, BOUND, (unsigned long long)seed);

    std::vector<char> now(gpu_pool_bytes(pool)), was(gpu_pool_bytes(pool));
    GPU_CHECK(cudaMemcpy(now.data(), pool.state, now.size(), cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(was.data(), before.state, was.size(), cudaMemcpyDeviceToHost));
    const size_t slot_bytes = size_t(kda_slot_elems(pool.heads)) * kda_dtype_size(pool.dtype);
    for (int64_t s = 0; s < pool.slots; s++) {
        bool named = false;
        for (int i = 0; i < b.nseqs; i++)
            named |= b.seqs[i].slot == s && (b.seqs[i].len > 0 || b.seqs[i].flags);
        if (!named && memcmp(now.data() + s * slot_bytes, was.data() + s * slot_bytes, slot_bytes) != 0)
            fail_msg("%s: slot %lld is not in the batch but changed", what, (long long)s);
    }
    cudaFree(before.state);
}

static std::vector<int64_t> iota_slots(size_t n, int64_t first = 0, int64_t step = 1)
{
    std::vector<int64_t> s(n);
    for (size_t i = 0; i < n; i++)
        s[i] = first + int64_t(i) * step;
    return s;
}

/* ---- tests ---------------------------------------------------------------- */

static void golden_cases(void **unused)
{
    char err[512];
    char **paths = nullptr;
    const int n = golden_list(golden_dir(), &paths, err, sizeof err);
    if (n <= 0)
        fail_msg("%s", err);
    int failed = 0;
    for (int f = 0; f < n; f++) {
        golden_case c;
        if (golden_load(paths[f], &c, err, sizeof err) != 0)
            fail_msg("%s", err);
        const int64_t N = c.nseqs, H = c.heads, T = c.total_tokens, slot_elems = kda_slot_elems(c.heads);
        const size_t tok = size_t(T * H * KDA_HEAD_DIM), st_n = size_t(N * slot_elems);
        uint16_t *dq, *dk, *dv, *dg, *dbeta, *dout;
        float *dalog, *ddtb;
        kda_layer *dlayer;
        for (uint16_t **p : {&dq, &dk, &dv, &dg, &dout})
            GPU_CHECK(cudaMalloc(p, tok * 2 + 16));
        GPU_CHECK(cudaMalloc(&dbeta, size_t(T * H) * 2 + 16));
        GPU_CHECK(cudaMemcpy(dq, c.q, tok * 2, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(dk, c.k, tok * 2, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(dv, c.v, tok * 2, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(dg, c.g, tok * 2, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(dbeta, c.beta, size_t(T * H) * 2, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMalloc(&dalog, sizeof(float) * H));
        GPU_CHECK(cudaMalloc(&ddtb, sizeof(float) * H * KDA_HEAD_DIM));
        GPU_CHECK(cudaMemcpy(dalog, c.A_log, sizeof(float) * H, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(ddtb, c.dt_bias, sizeof(float) * H * KDA_HEAD_DIM, cudaMemcpyHostToDevice));
        const kda_layer layer = {dalog, ddtb, float(c.lower_bound), float(c.scale)};
        GPU_CHECK(cudaMalloc(&dlayer, sizeof layer));
        GPU_CHECK(cudaMemcpy(dlayer, &layer, sizeof layer, cudaMemcpyHostToDevice));
        std::vector<int64_t> slots(N);
        for (int64_t i = 0; i < N; i++)
            slots[i] = N - 1 - i;                    /* slot order differs from sequence order */
        std::vector<kda_seq> seqs(N);
        kda_error kerr;
        assert_int_equal(kda_seqs_from_packed(seqs.data(), N, int32_t(H), c.cu_seqlens, T, slots.data(), dq, dk, dv,
                                              dg, dbeta, dout, dlayer, &kerr),
                         KDA_OK);
        if (!c.initial_state)
            for (auto &s : seqs)
                s.flags = KDA_SEQ_ZERO_STATE;
        kda_seq *dseqs;
        int32_t *dn, nn = int32_t(N);
        GPU_CHECK(cudaMalloc(&dseqs, sizeof(kda_seq) * N));
        GPU_CHECK(cudaMemcpy(dseqs, seqs.data(), sizeof(kda_seq) * N, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMalloc(&dn, sizeof nn));
        GPU_CHECK(cudaMemcpy(dn, &nn, sizeof nn, cudaMemcpyHostToDevice));

        std::vector<uint16_t> out(tok);
        std::vector<float> fin(st_n);
        double errs[2][2] = {{0, 0}, {0, 0}};
        for (int dt = 0; dt < 2; dt++) {
            const kda_dtype dtype = dt ? KDA_DTYPE_BF16 : KDA_DTYPE_F32;
            kda_pool pool = {nullptr, dtype, int32_t(H), N};
            GPU_CHECK(cudaMalloc(&pool.state, st_n * kda_dtype_size(dtype)));
            std::vector<float> init(st_n, NAN);     /* no initial state: NaN must never be read */
            std::vector<uint16_t> init16(st_n);
            for (int64_t i = 0; i < N; i++)
                for (int64_t e = 0; e < slot_elems; e++) {
                    const float x = c.initial_state ? c.initial_state[i * slot_elems + e] : NAN;
                    init[slots[i] * slot_elems + e] = x;
                    init16[slots[i] * slot_elems + e] = kda_f32_to_bf16(x);
                }
            if (dt)
                GPU_CHECK(cudaMemcpy(pool.state, init16.data(), st_n * 2, cudaMemcpyHostToDevice));
            else
                GPU_CHECK(cudaMemcpy(pool.state, init.data(), st_n * 4, cudaMemcpyHostToDevice));
            GPU_CHECK(cudaMemset(dout, 0xff, tok * 2));
            launch(pool, dseqs, dn, nn);
            GPU_CHECK(cudaMemcpy(out.data(), dout, tok * 2, cudaMemcpyDeviceToHost));
            std::vector<char> st(st_n * kda_dtype_size(dtype));
            GPU_CHECK(cudaMemcpy(st.data(), pool.state, st.size(), cudaMemcpyDeviceToHost));
            for (int64_t i = 0; i < N; i++)
                for (int64_t e = 0; e < slot_elems; e++) {
                    const size_t at = size_t(slots[i] * slot_elems + e);
                    fin[i * slot_elems + e] = dt ? kda_bf16_to_f32(((uint16_t *)st.data())[at]) : ((float *)st.data())[at];
                }
            if (!dt) {
                errs[0][0] = rel_rms_bf16(out.data(), c.expected_out, tok);
                errs[0][1] = rel_rms_f32(fin.data(), c.expected_state, st_n);
            } else {   /* bf16 pool: the reference starts from the rounded initial state */
                std::vector<double> ref_out(tok), ref_st(st_n);
                for (int64_t i = 0; i < N; i++) {
                    const int64_t t0 = c.cu_seqlens[i], len = c.cu_seqlens[i + 1] - t0, row = H * KDA_HEAD_DIM;
                    for (int64_t e = 0; e < slot_elems; e++)
                        ref_st[i * slot_elems + e] =
                            c.initial_state ? kda_bf16_to_f32(kda_f32_to_bf16(c.initial_state[i * slot_elems + e])) : 0.0;
                    kda_layer hl = {c.A_log, c.dt_bias, float(c.lower_bound), float(c.scale)};
                    kda_ref_sequence(int32_t(H), &hl, c.q + t0 * row, c.k + t0 * row, c.v + t0 * row, c.g + t0 * row,
                                     c.beta + t0 * H, len, &ref_st[i * slot_elems], &ref_out[t0 * row]);
                }
                double num = 0, den = 0;
                for (size_t i = 0; i < tok; i++) {
                    const double d = kda_bf16_to_f32(out[i]) - ref_out[i];
                    num += d * d, den += ref_out[i] * ref_out[i];
                }
                errs[1][0] = sqrt(num / den);
                num = den = 0;
                for (size_t i = 0; i < st_n; i++) {
                    const double d = fin[i] - ref_st[i];
                    num += d * d, den += ref_st[i] * ref_st[i];
                }
                errs[1][1] = sqrt(num / den);
            }
            cudaFree(pool.state);
        }
        const double bo = std::max(0.005, c.fla_out_err), bs = std::max(0.005, c.fla_state_err);
        const bool ok = errs[0][0] <= bo && errs[0][1] <= bs && errs[1][0] <= bo && errs[1][1] <= bs;
        print_message("  %-22s fp32 pool out %.5f state %.5f | bf16 pool out %.5f state %.5f | fla %.5f/%.5f"
                      " flashkda %.5f/%.5f %s\n",
                      c.name, errs[0][0], errs[0][1], errs[1][0], errs[1][1], c.fla_out_err, c.fla_state_err,
                      c.flashkda_out_err, c.flashkda_state_err, ok ? "" : "FAILED");
        failed += !ok;
        for (void *p : {(void *)dq, (void *)dk, (void *)dv, (void *)dg, (void *)dbeta, (void *)dout, (void *)dalog,
                        (void *)ddtb, (void *)dlayer, (void *)dseqs, (void *)dn})
            cudaFree(p);
        golden_free(&c);
    }
    golden_list_free(paths, n);
    if (failed)
        fail_msg("%d golden case(s) above the contract", failed);
}

static void six_workloads(void **unused)
{
    struct { const char *name; int heads; std::vector<int64_t> lens; } w[] = {
        {"H96 fixed 8192", 96, {8192}},
        {"H96 mixed", 96, {1300, 547, 2048, 963, 271, 3063}},
        {"H96 uniform 8x1024", 96, std::vector<int64_t>(8, 1024)},
        {"H64 fixed 8192", 64, {8192}},
        {"H64 mixed", 64, {1300, 547, 2048, 963, 271, 3063}},
        {"H64 uniform 8x1024", 64, std::vector<int64_t>(8, 1024)},
    };
    for (auto &x : w) {
        DevBatch b = make_batch(x.heads, x.lens, iota_slots(x.lens.size(), 1, 2), seed + 100);
        kda_pool pool = gpu_make_pool(x.heads, 2 * int64_t(x.lens.size()) + 2, KDA_DTYPE_F32, seed + 200);
        run_and_check(b, pool, x.name);
        cudaFree(pool.state);
        free_batch(b);
    }
}

static void varlen_edges(void **unused)
{
    const std::vector<int64_t> lens = {1, 31, 32, 33, 0, 63, 64, 65, 100, 7, 0, 200};
    for (int dt = 0; dt < 2; dt++) {
        DevBatch b = make_batch(5, lens, iota_slots(lens.size(), 13, -1), seed + 300 + dt);
        b.seqs[10].flags = KDA_SEQ_ZERO_STATE;       /* empty and zero-state: the slot becomes zero */
        b.seqs[2].flags = KDA_SEQ_ZERO_STATE;
        upload_seqs(b);
        kda_pool pool = gpu_make_pool(5, 16, dt ? KDA_DTYPE_BF16 : KDA_DTYPE_F32, seed + 400);
        run_and_check(b, pool, dt ? "varlen edges, bf16 pool" : "varlen edges, fp32 pool");
        std::vector<float> slot(kda_slot_elems(5));
        if (!dt) {
            GPU_CHECK(cudaMemcpy(slot.data(), (float *)pool.state + b.seqs[10].slot * kda_slot_elems(5),
                                 slot.size() * 4, cudaMemcpyDeviceToHost));
            for (float x : slot)
                assert_true(x == 0.0f);
        }
        cudaFree(pool.state);
        free_batch(b);
    }
}

static void many_short_sequences(void **unused)
{
    srand(unsigned(seed));
    std::vector<int64_t> lens(1500);
    for (auto &l : lens)
        l = rand() % 90;
    DevBatch b = make_batch(3, lens, iota_slots(lens.size()), seed + 500);
    kda_pool pool = gpu_make_pool(3, int64_t(lens.size()), KDA_DTYPE_F32, seed + 600);
    run_and_check(b, pool, "1500 short sequences, H=3");
    cudaFree(pool.state);
    free_batch(b);
}

static void long_sequence(void **unused)
{
    DevBatch b = make_batch(2, {100003}, {0}, seed + 700);
    kda_pool pool = gpu_make_pool(2, 1, KDA_DTYPE_F32, seed + 800);
    run_and_check(b, pool, "one sequence of 100003 tokens, H=2");
    cudaFree(pool.state);
    free_batch(b);
}

static void sequences_in_separate_buffers(void **unused)
{
    DevBatch a = make_batch(4, {300, 45}, {0, 1}, seed + 900), c = make_batch(4, {129, 0, 77}, {2, 3, 4}, seed + 901);
    kda_pool pool = gpu_make_pool(4, 5, KDA_DTYPE_F32, seed + 902), before = gpu_clone_pool(pool);
    std::vector<kda_seq> all(a.seqs.begin(), a.seqs.begin() + a.nseqs);
    all.insert(all.end(), c.seqs.begin(), c.seqs.begin() + c.nseqs);
    kda_seq *dseqs;
    int32_t *dn, nn = int32_t(all.size());
    gpu_upload_table(all.data(), nn, &dseqs, &dn);
    launch(pool, dseqs, dn, nn);
    double oe[2], se[2];
    oracle_errors(a, before, pool, &oe[0], &se[0]);
    oracle_errors(c, before, pool, &oe[1], &se[1]);
    print_message("  two buffers in one launch: out %.5f / %.5f state %.5f / %.5f\n", oe[0], oe[1], se[0], se[1]);
    assert_true(oe[0] <= BOUND && oe[1] <= BOUND && se[0] <= BOUND && se[1] <= BOUND);
    cudaFree(dseqs);
    cudaFree(dn);
    cudaFree(pool.state);
    cudaFree(before.state);
    free_batch(a);
    free_batch(c);
}

/* One launch captured in a graph for a bucket of 8 sequences, replayed with three different batches. */
static void graph_replay(void **unused)
{
    const int32_t bucket = 8, heads = 6;
    kda_seq *table;
    int32_t *count;
    GPU_CHECK(cudaMalloc(&table, sizeof(kda_seq) * bucket));
    GPU_CHECK(cudaMalloc(&count, sizeof(int32_t)));
    kda_pool pool = gpu_make_pool(heads, 24, KDA_DTYPE_F32, seed + 1000);
    cudaStream_t stream;
    GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    kda_error err = {};
    assert_int_equal(kda_cuda_prefill(cu, &pool, table, count, bucket, stream, &err), KDA_OK);
    GPU_CHECK(cudaStreamEndCapture(stream, &graph));
    GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    const std::vector<std::vector<int64_t>> lens = {{500, 20, 33}, {7, 0, 64, 1000, 5, 96, 31, 2}, {257}};
    const std::vector<std::vector<int64_t>> slots = {{3, 9, 4}, {0, 1, 2, 5, 6, 7, 8, 10}, {23}};
    for (size_t r = 0; r < lens.size(); r++) {
        DevBatch b = make_batch(heads, lens[r], slots[r], seed + 1100 + r);
        kda_pool before = gpu_clone_pool(pool);
        GPU_CHECK(cudaMemset(b.out, 0xff, size_t(b.total) * heads * KDA_HEAD_DIM * 2));
        GPU_CHECK(cudaMemcpy(table, b.seqs.data(), sizeof(kda_seq) * b.nseqs, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(count, &b.nseqs, sizeof(int32_t), cudaMemcpyHostToDevice));
        GPU_CHECK(cudaGraphLaunch(exec, stream));
        GPU_CHECK(cudaStreamSynchronize(stream));
        double oe, se;
        oracle_errors(b, before, pool, &oe, &se);
        print_message("  graph replay %zu (%d seqs): out %.5f state %.5f\n", r, b.nseqs, oe, se);
        assert_true(oe <= BOUND && se <= BOUND);
        cudaFree(before.state);
        free_batch(b);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    cudaFree(table);
    cudaFree(count);
    cudaFree(pool.state);
}

static void deterministic(void **unused)
{
    DevBatch b = make_batch(8, {700, 300, 1025}, {0, 1, 2}, seed + 1200);
    kda_pool p1 = gpu_make_pool(8, 3, KDA_DTYPE_F32, seed + 1201), p2 = gpu_clone_pool(p1);
    const size_t out_bytes = size_t(b.total) * 8 * KDA_HEAD_DIM * 2;
    std::vector<char> o1(out_bytes), o2(out_bytes), s1(gpu_pool_bytes(p1)), s2(gpu_pool_bytes(p1));
    launch(p1, b.seqs_dev, b.nseqs_dev, b.nseqs);
    GPU_CHECK(cudaMemcpy(o1.data(), b.out, out_bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemset(b.out, 0, out_bytes));
    launch(p2, b.seqs_dev, b.nseqs_dev, b.nseqs);
    GPU_CHECK(cudaMemcpy(o2.data(), b.out, out_bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(s1.data(), p1.state, s1.size(), cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(s2.data(), p2.state, s2.size(), cudaMemcpyDeviceToHost));
    assert_memory_equal(o1.data(), o2.data(), out_bytes);
    assert_memory_equal(s1.data(), s2.data(), s1.size());
    cudaFree(p1.state);
    cudaFree(p2.state);
    free_batch(b);
}

/* ---- split chains (kda_cuda_set_split) --------------------------------------- */

/* Lengths around the cuts (64-token segments under ALWAYS), zero-length sequences, both pools. */
static void split_edges(void **unused)
{
    const std::vector<int64_t> lens = {1000, 200, 0, 65, 64, 33, 1, 0};
    for (int dt = 0; dt < 2; dt++) {
        DevBatch b = make_batch(2, lens, iota_slots(lens.size(), 9, -1), seed + 1300 + dt);
        b.seqs[2].flags = KDA_SEQ_ZERO_STATE;        /* empty: the slot becomes zero */
        b.seqs[3].flags = KDA_SEQ_ZERO_STATE;        /* cut, from a zero state */
        upload_seqs(b);
        kda_pool pool = gpu_make_pool(2, 11, dt ? KDA_DTYPE_BF16 : KDA_DTYPE_F32, seed + 1400);
        run_and_check(b, pool, dt ? "split edges, bf16 pool" : "split edges, fp32 pool");
        cudaFree(pool.state);
        free_batch(b);
    }
}

/* Few chains, long sequences: what AUTO cuts (H = 8: eight segments per sequence). */
static void split_long(void **unused)
{
    struct { const char *name; int heads; std::vector<int64_t> lens; kda_dtype dtype; float lb; } w[] = {
        {"H8 x 32768, fp32 pool", 8, {32768}, KDA_DTYPE_F32, -5.0f},
        {"H8 x 32768, bf16 pool", 8, {32768}, KDA_DTYPE_BF16, -5.0f},
        {"H4 x 20000 + 9000, slow gates (-0.1)", 4, {20000, 9000}, KDA_DTYPE_F32, -0.1f},
        {"H8 x 131072, fp32 pool", 8, {131072}, KDA_DTYPE_F32, -5.0f},
    };
    for (auto &x : w) {
        DevBatch b = make_batch(x.heads, x.lens, iota_slots(x.lens.size(), 1), seed + 1500, x.lb);
        kda_pool pool = gpu_make_pool(x.heads, int64_t(x.lens.size()) + 1, x.dtype, seed + 1600);
        run_and_check(b, pool, x.name);
        cudaFree(pool.state);
        free_batch(b);
    }
}

/* The correction's scratch capped (kda_cuda_set_split_outputs): the segments past it are recomputed. */
static void split_recompute(void **unused)
{
    const int64_t D = KDA_HEAD_DIM;
    struct { const char *name; int heads; std::vector<int64_t> lens; int64_t cap_tokens; float lb; } w[] = {
        {"H4 x 20000 + 9000, scratch for 24000 tokens", 4, {20000, 9000}, 24000, -0.1f},
        {"H8 x 32768, no scratch (every segment recomputed)", 8, {32768}, 0, -5.0f},
    };
    for (auto &x : w) {
        kda_cuda_set_split_outputs(cu, x.cap_tokens * x.heads * D);
        DevBatch b = make_batch(x.heads, x.lens, iota_slots(x.lens.size(), 1), seed + 1550, x.lb);
        kda_pool pool = gpu_make_pool(x.heads, int64_t(x.lens.size()) + 1, KDA_DTYPE_F32, seed + 1650);
        run_and_check(b, pool, x.name);
        cudaFree(pool.state);
        free_batch(b);
    }
    kda_cuda_set_split_outputs(cu, -1);
}

/* An instance created without the outputs scratch (kda_cuda_create_with_scratch 0): it holds exactly the
   default scratch less, and cuts every 64 tokens, recomputing each segment, still match the oracle. */
static void split_without_scratch(void **unused)
{
    kda_cuda *none;
    kda_error err;
    assert_int_equal(kda_cuda_create_with_scratch(0, 0, &none, &err), KDA_OK);
    assert_int_equal(kda_cuda_split_scratch_bytes(none), 0);
    assert_int_equal(kda_cuda_split_scratch_bytes(cu), KDA_CUDA_SPLIT_SCRATCH_DEFAULT);
    assert_int_equal(kda_cuda_device_bytes(cu) - kda_cuda_device_bytes(none), KDA_CUDA_SPLIT_SCRATCH_DEFAULT);
    kda_cuda_set_split(none, KDA_CUDA_SPLIT_ALWAYS);
    kda_cuda *with = cu;
    cu = none;   /* launch() runs on cu */
    const std::vector<int64_t> lens = {1000, 200, 65};
    DevBatch b = make_batch(2, lens, iota_slots(lens.size(), 1), seed + 1580);
    kda_pool pool = gpu_make_pool(2, 5, KDA_DTYPE_F32, seed + 1680);
    run_and_check(b, pool, "H2 x {1000, 200, 65} cut, no scratch");
    cu = with;
    cudaFree(pool.state);
    free_batch(b);
    kda_cuda_destroy(none);
}

/* One captured launch (a bucket of 2 sequences, H = 4: split) replayed with batches cut and not cut. */
static void split_graph_replay(void **unused)
{
    const int32_t bucket = 2, heads = 4;
    kda_seq *table;
    int32_t *count;
    GPU_CHECK(cudaMalloc(&table, sizeof(kda_seq) * bucket));
    GPU_CHECK(cudaMalloc(&count, sizeof(int32_t)));
    kda_pool pool = gpu_make_pool(heads, 6, KDA_DTYPE_F32, seed + 1700);
    cudaStream_t stream;
    GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    kda_error err = {};
    assert_int_equal(kda_cuda_prefill(cu, &pool, table, count, bucket, stream, &err), KDA_OK);
    GPU_CHECK(cudaStreamEndCapture(stream, &graph));
    GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    const std::vector<std::vector<int64_t>> lens = {{9000, 3000}, {40000}, {100, 0}};
    const std::vector<std::vector<int64_t>> slots = {{3, 1}, {5}, {0, 2}};
    for (size_t r = 0; r < lens.size(); r++) {
        DevBatch b = make_batch(heads, lens[r], slots[r], seed + 1800 + r);
        kda_pool before = gpu_clone_pool(pool);
        GPU_CHECK(cudaMemset(b.out, 0xff, size_t(b.total) * heads * KDA_HEAD_DIM * 2));
        GPU_CHECK(cudaMemcpy(table, b.seqs.data(), sizeof(kda_seq) * b.nseqs, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(count, &b.nseqs, sizeof(int32_t), cudaMemcpyHostToDevice));
        GPU_CHECK(cudaGraphLaunch(exec, stream));
        GPU_CHECK(cudaStreamSynchronize(stream));
        double oe, se;
        oracle_errors(b, before, pool, &oe, &se);
        print_message("  split graph replay %zu (%d seqs): out %.5f state %.5f\n", r, b.nseqs, oe, se);
        assert_true(oe <= BOUND && se <= BOUND);
        cudaFree(before.state);
        free_batch(b);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    cudaFree(table);
    cudaFree(count);
    cudaFree(pool.state);
}

static void split_deterministic(void **unused)
{
    DevBatch b = make_batch(8, {20000}, {0}, seed + 1900);
    kda_pool p1 = gpu_make_pool(8, 1, KDA_DTYPE_F32, seed + 1901), p2 = gpu_clone_pool(p1);
    const size_t out_bytes = size_t(b.total) * 8 * KDA_HEAD_DIM * 2;
    std::vector<char> o1(out_bytes), o2(out_bytes), s1(gpu_pool_bytes(p1)), s2(gpu_pool_bytes(p1));
    launch(p1, b.seqs_dev, b.nseqs_dev, b.nseqs);
    GPU_CHECK(cudaMemcpy(o1.data(), b.out, out_bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemset(b.out, 0, out_bytes));
    launch(p2, b.seqs_dev, b.nseqs_dev, b.nseqs);
    GPU_CHECK(cudaMemcpy(o2.data(), b.out, out_bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(s1.data(), p1.state, s1.size(), cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(s2.data(), p2.state, s2.size(), cudaMemcpyDeviceToHost));
    assert_memory_equal(o1.data(), o2.data(), out_bytes);
    assert_memory_equal(s1.data(), s2.data(), s1.size());
    cudaFree(p1.state);
    cudaFree(p2.state);
    free_batch(b);
}

/* The host-side batch check (no device needed: it runs in CI too). */
static void host_checks(void **unused)
{
    kda_seq s = {};
    char byte;
    kda_pool pool = {&byte, KDA_DTYPE_F32, 4, 2};
    s.q = s.k = s.v = s.g = s.beta = s.out = reinterpret_cast<uint16_t *>(0x1000);
    s.layer = reinterpret_cast<kda_layer *>(0x2000);
    s.len = 5;
    kda_error err;
    assert_int_equal(kda_cuda_batch_check(&pool, &s, 1, &err), KDA_OK);
    s.q = reinterpret_cast<uint16_t *>(0x1008);   /* 8-byte aligned only */
    assert_int_equal(kda_cuda_batch_check(&pool, &s, 1, &err), KDA_EINVAL);
    assert_non_null(strstr(err.msg, "16-byte aligned"));
    s.q = reinterpret_cast<uint16_t *>(0x1000);
    s.out = reinterpret_cast<uint16_t *>(0x1008); /* the outputs are stored as 16-byte row pieces */
    assert_int_equal(kda_cuda_batch_check(&pool, &s, 1, &err), KDA_EINVAL);
    s.len = 0;                                    /* reads and writes nothing: alignment does not matter */
    assert_int_equal(kda_cuda_batch_check(&pool, &s, 1, &err), KDA_OK);
}

/* Group set-ups: how chains map to CTAs (kda_cuda_set_pairing) for the group's tests. */
static int set_pairing(kda_cuda_pairing pairing, const char *what)
{
    kda_cuda_set_pairing(cu, pairing);
    printf("-- chains on %s\n", what);
    return 0;
}
static int pairing_auto(void **) { return set_pairing(KDA_CUDA_PAIRING_AUTO, "paired CTAs when they fit, else one CTA each"); }
static int pairing_off(void **) { return set_pairing(KDA_CUDA_PAIRING_OFF, "one CTA each"); }
static int pairing_always(void **) { return set_pairing(KDA_CUDA_PAIRING_ALWAYS, "paired CTAs, several chains per cluster"); }
/* Split groups: pairing back to AUTO, and the split mode for the group's tests (reset after). */
static int set_split(kda_cuda_split split, const char *what)
{
    kda_cuda_set_pairing(cu, KDA_CUDA_PAIRING_AUTO);
    kda_cuda_set_split(cu, split);
    printf("-- chains %s\n", what);
    return 0;
}
static int split_auto(void **) { return set_split(KDA_CUDA_SPLIT_AUTO, "cut when few and long (automatic)"); }
static int split_always(void **) { return set_split(KDA_CUDA_SPLIT_ALWAYS, "cut whenever two segments fit, down to 64 tokens"); }
static int split_reset(void **) { kda_cuda_set_split(cu, KDA_CUDA_SPLIT_AUTO); return 0; }

int main()
{
    const struct CMUnitTest host[] = {cmocka_unit_test(host_checks)};
    if (cmocka_run_group_tests(host, nullptr, nullptr) != 0)
        return 1;
    kda_error err;
    const int rc = kda_cuda_create(0, &cu, &err);
    if (rc == KDA_ENOTSUP) {
        printf("SKIP: %s; the CUDA kernel tests need an sm_90 GPU (the host checks passed)\n", err.msg);
        return 77;
    }
    if (rc != KDA_OK) {
        fprintf(stderr, "kda_cuda_create: %s\n", err.msg);
        return 1;
    }
    const char *env = getenv("KDA_TEST_SEED");
    seed = env ? strtoull(env, nullptr, 10) : uint64_t(time(nullptr));
    printf("test_cuda_kernel on %s (%d SMs, %d clusters of paired chains), seed %llu\n", kda_cuda_device_name(cu),
           kda_cuda_sm_count(cu), kda_cuda_paired_clusters(cu), (unsigned long long)seed);
    /* AUTO pairs the chains of small batches (the golden cases, H64 x 8192, ...) and gives larger
       ones a CTA each; the OFF and ALWAYS groups run the small batches one CTA per chain and the
       large ones with several chains per cluster. */
    const struct CMUnitTest forced[] = {
        cmocka_unit_test(golden_cases), cmocka_unit_test(varlen_edges), cmocka_unit_test(many_short_sequences),
        cmocka_unit_test(graph_replay),
    };
    int failed;
    const char *quick = getenv("KDA_GPU_TEST_QUICK");
    if (quick && !strcmp(quick, "split")) {   /* the split path alone (racecheck is slow) */
        const struct CMUnitTest quick_split[] = {cmocka_unit_test(split_edges)};
        failed = cmocka_run_group_tests_name("split chains", quick_split, split_always, split_reset);
    } else if (quick) {
        const struct CMUnitTest quick[] = {cmocka_unit_test(varlen_edges)};
        const struct CMUnitTest quick_split[] = {cmocka_unit_test(split_edges)};
        failed = cmocka_run_group_tests_name("one CTA per chain", quick, pairing_off, nullptr) +
                 cmocka_run_group_tests_name("paired chains", quick, pairing_always, nullptr) +
                 cmocka_run_group_tests_name("split chains", quick_split, split_always, split_reset);
    } else {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(golden_cases),         cmocka_unit_test(varlen_edges),
            cmocka_unit_test(six_workloads),        cmocka_unit_test(many_short_sequences),
            cmocka_unit_test(long_sequence),        cmocka_unit_test(sequences_in_separate_buffers),
            cmocka_unit_test(graph_replay),         cmocka_unit_test(deterministic),
        };
        const struct CMUnitTest split_auto_tests[] = {
            cmocka_unit_test(split_long),          cmocka_unit_test(split_recompute),
            cmocka_unit_test(split_without_scratch), cmocka_unit_test(split_graph_replay),
            cmocka_unit_test(split_deterministic),
        };
        const struct CMUnitTest split_always_tests[] = {cmocka_unit_test(golden_cases), cmocka_unit_test(split_edges)};
        failed = cmocka_run_group_tests_name("automatic pairing", tests, pairing_auto, nullptr) +
                 cmocka_run_group_tests_name("one CTA per chain", forced, pairing_off, nullptr) +
                 cmocka_run_group_tests_name("paired chains", forced, pairing_always, nullptr) +
                 cmocka_run_group_tests_name("split chains", split_auto_tests, split_auto, split_reset) +
                 cmocka_run_group_tests_name("split chains, every cut", split_always_tests, split_always, split_reset);
    }
    kda_cuda_destroy(cu);
    return failed;
}
