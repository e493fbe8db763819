/*
 * test_cuda_decode.cu - the decode-step kernel (kda_cuda_step) on the GPU.
 *
 *   random steps     H = 32: 256 x 1 and 64 x 1..16 tokens, fp32 and bf16
 *                    pools, with and without the per-token states, outputs
 *                    poisoned, against the float64 oracle (gpu_testutil.cu);
 *                    every kept state against the oracle's after that token;
 *                    untouched slots bit-identical
 *   golden cuts      every golden case as 1-token and 4-token steps (fp32
 *                    pool) against the golden results
 *   graphs           one captured launch replayed with three different steps
 *   determinism      the same step twice gives the same bits
 *
 * Exits 77 (skipped) without an sm_90 GPU, after the host checks.
 * KDA_GPU_TEST_QUICK=1 runs one small step (for compute-sanitizer).
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

static kda_cuda *cu;
static uint64_t seed;
static const double BOUND = 0.005;
static const int D = KDA_HEAD_DIM;

/* A packed step in device memory. */
struct DevStep {
    int32_t heads = 0, nseqs = 0, tokens = 0;
    kda_dtype dtype = KDA_DTYPE_F32;
    std::vector<kda_step_seq> seqs;   /* host copy */
    uint16_t *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr, *out = nullptr;
    void *states = nullptr;
    float *a_log = nullptr, *dt_bias = nullptr;
    kda_layer *layer = nullptr;
    kda_step_seq *seqs_dev = nullptr;
    kda_step host = {};                /* with device pointers */
    kda_step *dev = nullptr;
};

static void upload_step(DevStep &s)
{
    GPU_CHECK(cudaMemcpy(s.seqs_dev, s.seqs.data(), sizeof(kda_step_seq) * s.nseqs, cudaMemcpyHostToDevice));
    s.host = kda_step{s.q, s.k, s.v, s.g, s.beta, s.out, s.states, s.layer, s.seqs_dev, s.nseqs, s.tokens};
    GPU_CHECK(cudaMemcpy(s.dev, &s.host, sizeof s.host, cudaMemcpyHostToDevice));
}

static DevStep make_step(int32_t heads, const std::vector<int32_t> &lens, const std::vector<int64_t> &slots,
                         kda_dtype dtype, bool keep, uint64_t sd)
{
    DevStep s;
    s.heads = heads;
    s.nseqs = int32_t(lens.size());
    s.dtype = dtype;
    s.seqs.resize(s.nseqs + 1);
    kda_error err;
    assert_int_equal(kda_step_seqs_fill(s.seqs.data(), s.nseqs, slots.data(), lens.data(), &s.tokens, &err), KDA_OK);
    const size_t tok = size_t(s.tokens) * heads * D;
    for (uint16_t **p : {&s.q, &s.k, &s.v, &s.g, &s.out})
        GPU_CHECK(cudaMalloc(p, tok * 2 + 16));
    GPU_CHECK(cudaMalloc(&s.beta, size_t(s.tokens) * heads * 2 + 16));
    gpu_fill_normal_bf16(s.q, tok, sd + 1, 0, 1);
    gpu_fill_normal_bf16(s.k, tok, sd + 2, 0, 1);
    gpu_fill_normal_bf16(s.v, tok, sd + 3, 0, 1);
    gpu_fill_normal_bf16(s.g, tok, sd + 4, 0, 1);
    gpu_fill_normal_bf16(s.beta, size_t(s.tokens) * heads, sd + 5, 0, 1);
    if (keep)
        GPU_CHECK(cudaMalloc(&s.states, size_t(s.tokens) * kda_slot_elems(heads) * kda_dtype_size(dtype)));
    GPU_CHECK(cudaMalloc(&s.a_log, sizeof(float) * heads));
    GPU_CHECK(cudaMalloc(&s.dt_bias, sizeof(float) * heads * D));
    gpu_fill_uniform_f32(s.a_log, heads, sd + 6, 0, 1);
    gpu_fill_uniform_f32(s.dt_bias, size_t(heads) * D, sd + 7, 0, 1);
    const kda_layer layer = {s.a_log, s.dt_bias, -5.0f, 0.08838834764831845f};
    GPU_CHECK(cudaMalloc(&s.layer, sizeof layer));
    GPU_CHECK(cudaMemcpy(s.layer, &layer, sizeof layer, cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMalloc(&s.seqs_dev, sizeof(kda_step_seq) * (s.nseqs + 1)));
    GPU_CHECK(cudaMalloc(&s.dev, sizeof(kda_step)));
    upload_step(s);
    return s;
}

static void free_step(DevStep &s)
{
    for (void *p : {(void *)s.q, (void *)s.k, (void *)s.v, (void *)s.g, (void *)s.beta, (void *)s.out, s.states,
                    (void *)s.a_log, (void *)s.dt_bias, (void *)s.layer, (void *)s.seqs_dev, (void *)s.dev})
        cudaFree(p);
    s = DevStep();
}

static void launch(const kda_pool &pool, const DevStep &s, int32_t max_seqs)
{
    kda_error err = {};
    kda_step h = s.host;   /* the check reads the descriptors from host memory */
    h.seqs = s.seqs.data();
    if (kda_cuda_step_check(&pool, &h, &err) != KDA_OK)
        fail_msg("kda_cuda_step_check: %s", err.msg);
    if (kda_cuda_step(cu, &pool, s.dev, max_seqs, nullptr, &err) != KDA_OK)
        fail_msg("kda_cuda_step: %s", err.msg);
    GPU_CHECK(cudaDeviceSynchronize());
}

/* The step's sequences as prefill descriptors of their first `upto` tokens (for the oracle). */
static void oracle_table(const DevStep &s, int upto, std::vector<kda_seq> &seqs, std::vector<int64_t> &at)
{
    const int64_t row = int64_t(s.heads) * D;
    seqs.clear();
    at.clear();
    for (int i = 0; i < s.nseqs; i++) {
        const kda_step_seq &x = s.seqs[i];
        if (x.len < upto)
            continue;
        const int64_t t0 = x.start;
        seqs.push_back(kda_seq{s.q + t0 * row, s.k + t0 * row, s.v + t0 * row, s.g + t0 * row, s.beta + t0 * s.heads,
                               s.out + t0 * row, s.layer, upto, x.slot, x.flags, 0});
        at.push_back(t0 + upto - 1);   /* the token after which the oracle's state is the kept one */
    }
}

struct Errors {
    double out, state, kept;
};

/* Errors of s's outputs, of its slots in `after` and (if kept) of every kept state, against the oracle from `before`. */
static Errors oracle_errors(const DevStep &s, const kda_pool &before, const kda_pool &after)
{
    Errors e = {0, 0, 0};
    std::vector<kda_seq> seqs;
    std::vector<int64_t> at;
    oracle_table(s, 0, seqs, at);   /* every sequence, whole */
    for (size_t i = 0; i < seqs.size(); i++)
        seqs[i].len = s.seqs[i].len;
    kda_seq *dseqs;
    int32_t *dn;
    gpu_upload_table(seqs.data(), int32_t(seqs.size()), &dseqs, &dn);
    double *out_ref, *state_ref;
    const size_t out_n = size_t(s.tokens) * s.heads * D, slot_elems = kda_slot_elems(s.heads);
    GPU_CHECK(cudaMalloc(&out_ref, sizeof(double) * out_n));
    GPU_CHECK(cudaMalloc(&state_ref, sizeof(double) * s.nseqs * slot_elems));
    gpu_oracle(dseqs, s.nseqs, &before, s.out, out_ref, state_ref);
    e.out = gpu_rel_rms_bf16(s.out, out_ref, out_n);
    std::vector<int64_t> slots(s.nseqs);
    for (int i = 0; i < s.nseqs; i++)
        slots[i] = s.seqs[i].slot;
    e.state = gpu_rel_rms_slots(&after, slots.data(), s.nseqs, state_ref);
    cudaFree(dseqs);
    cudaFree(dn);
    if (s.states) {
        /* the kept states as a pool of `tokens` slots; the oracle of each prefix */
        const kda_pool kept = {s.states, s.dtype, s.heads, s.tokens};
        for (int upto = 1; upto <= KDA_STEP_MAX_TOKENS; upto++) {   /* the worst token position */
            oracle_table(s, upto, seqs, at);
            if (seqs.empty())
                break;
            gpu_upload_table(seqs.data(), int32_t(seqs.size()), &dseqs, &dn);
            gpu_oracle(dseqs, int32_t(seqs.size()), &before, s.out, out_ref, state_ref);
            e.kept = std::max(e.kept, gpu_rel_rms_slots(&kept, at.data(), int32_t(seqs.size()), state_ref));
            cudaFree(dseqs);
            cudaFree(dn);
        }
    }
    cudaFree(out_ref);
    cudaFree(state_ref);
    return e;
}

static void run_and_check(const DevStep &s, kda_pool &pool, const char *what)
{
    kda_pool before = gpu_clone_pool(pool);
    GPU_CHECK(cudaMemset(s.out, 0xff, size_t(s.tokens) * s.heads * D * 2));   /* NaN */
    if (s.states)
        GPU_CHECK(cudaMemset(s.states, 0xff, size_t(s.tokens) * kda_slot_elems(s.heads) * kda_dtype_size(s.dtype)));
    launch(pool, s, s.nseqs);
    const Errors e = oracle_errors(s, before, pool);
    print_message("  %-48s out %.5f state %.5f kept %.5f\n", what, e.out, e.state, e.kept);
    if (!(e.out <= BOUND && e.state <= BOUND && e.kept <= BOUND))
        fail_msg("%s: out %.5f state %.5f kept %.5f above %.3f (seed %llu)", what, e.out, e.state, e.kept, BOUND,
                 (unsigned long long)seed);

    std::vector<char> now(gpu_pool_bytes(pool)), was(gpu_pool_bytes(pool));
    GPU_CHECK(cudaMemcpy(now.data(), pool.state, now.size(), cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(was.data(), before.state, was.size(), cudaMemcpyDeviceToHost));
    const size_t slot_bytes = size_t(kda_slot_elems(pool.heads)) * kda_dtype_size(pool.dtype);
    for (int64_t sl = 0; sl < pool.slots; sl++) {
        bool named = false;
        for (int i = 0; i < s.nseqs; i++)
            named |= s.seqs[i].slot == sl;
        if (!named && memcmp(now.data() + sl * slot_bytes, was.data() + sl * slot_bytes, slot_bytes) != 0)
            fail_msg("%s: slot %lld is not in the step but changed", what, (long long)sl);
    }
    cudaFree(before.state);
}

/* n slots out of 0..pool-1, shuffled */
static std::vector<int64_t> shuffled_slots(int n, int64_t pool_slots, uint64_t sd)
{
    std::vector<int64_t> all(pool_slots);
    for (int64_t i = 0; i < pool_slots; i++)
        all[i] = i;
    srand(unsigned(sd));
    for (int64_t i = pool_slots - 1; i > 0; i--)
        std::swap(all[i], all[rand() % (i + 1)]);
    all.resize(n);
    return all;
}

/* ---- tests ---------------------------------------------------------------- */

static void random_steps(void **)
{
    struct { const char *name; int heads, nseqs; bool mixed; } w[] = {
        {"H32 256 x 1", 32, 256, false},
        {"H32 64 x 1..16", 32, 64, true},
        {"H5 3 x 1..16", 5, 3, true},
    };
    srand(unsigned(seed));
    for (auto &x : w)
        for (int dt = 0; dt < 2; dt++)
            for (int keep = 0; keep < 2; keep++) {
                std::vector<int32_t> lens(x.nseqs, 1);
                if (x.mixed)
                    for (auto &l : lens)
                        l = 1 + rand() % KDA_STEP_MAX_TOKENS;
                const kda_dtype dtype = dt ? KDA_DTYPE_BF16 : KDA_DTYPE_F32;
                const int64_t pool_slots = x.nseqs + 7;
                DevStep s = make_step(x.heads, lens, shuffled_slots(x.nseqs, pool_slots, seed + 10), dtype, keep,
                                      seed + 100);
                kda_pool pool = gpu_make_pool(x.heads, pool_slots, dtype, seed + 200);
                char what[96];
                snprintf(what, sizeof what, "%s, %s pool%s", x.name, dt ? "bf16" : "fp32", keep ? ", states kept" : "");
                run_and_check(s, pool, what);
                cudaFree(pool.state);
                free_step(s);
            }
}

static void zero_state_flag(void **)
{
    DevStep s = make_step(4, {3, 1, 16, 2}, {5, 0, 2, 3}, KDA_DTYPE_F32, true, seed + 300);
    s.seqs[1].flags = s.seqs[3].flags = KDA_SEQ_ZERO_STATE;
    upload_step(s);
    kda_pool pool = gpu_make_pool(4, 6, KDA_DTYPE_F32, seed + 301);
    GPU_CHECK(cudaMemset(static_cast<float *>(pool.state), 0xff, kda_slot_elems(4) * sizeof(float)));   /* slot 0: NaN */
    run_and_check(s, pool, "zero-state sequences among others");
    cudaFree(pool.state);
    free_step(s);
}

/* Golden case c as steps of at most `cut` tokens per sequence (fp32 pool, sequence i in slot i). */
static void golden_steps(const golden_case &c, int cut, std::vector<uint16_t> &out, std::vector<float> &fin)
{
    const int32_t H = c.heads, N = int32_t(c.nseqs);
    const int64_t slot_elems = kda_slot_elems(H), row = int64_t(H) * D;
    kda_pool pool = {nullptr, KDA_DTYPE_F32, H, N};
    GPU_CHECK(cudaMalloc(&pool.state, sizeof(float) * N * slot_elems));
    std::vector<float> init(N * slot_elems, NAN);   /* no initial state: NaN must never be read */
    if (c.initial_state)
        std::copy(c.initial_state, c.initial_state + N * slot_elems, init.begin());
    GPU_CHECK(cudaMemcpy(pool.state, init.data(), sizeof(float) * init.size(), cudaMemcpyHostToDevice));
    std::vector<int32_t> all_lens(N, cut);
    std::vector<int64_t> all_slots(N);
    DevStep s = make_step(H, all_lens, all_slots, KDA_DTYPE_F32, false, 0);   /* buffers big enough for any step */
    std::vector<float> a_log(c.A_log, c.A_log + H), dt_bias(c.dt_bias, c.dt_bias + H * D);
    GPU_CHECK(cudaMemcpy(s.a_log, a_log.data(), sizeof(float) * H, cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMemcpy(s.dt_bias, dt_bias.data(), sizeof(float) * H * D, cudaMemcpyHostToDevice));
    const kda_layer layer = {s.a_log, s.dt_bias, float(c.lower_bound), float(c.scale)};
    GPU_CHECK(cudaMemcpy(s.layer, &layer, sizeof layer, cudaMemcpyHostToDevice));

    std::vector<uint16_t> q(N * cut * row), k(q.size()), v(q.size()), g(q.size()), o(q.size()), beta(N * cut * H);
    std::vector<int64_t> src(N * cut);
    out.assign(c.total_tokens * row, 0);
    for (int64_t done = 0;; done += cut) {
        std::vector<int32_t> lens;
        std::vector<int64_t> slots;
        int32_t total = 0;
        for (int32_t i = 0; i < N; i++) {
            const int64_t len = c.cu_seqlens[i + 1] - c.cu_seqlens[i];
            if (done >= len)
                continue;
            const int32_t l = int32_t(std::min<int64_t>(len - done, cut));
            for (int32_t t = 0; t < l; t++)
                src[total + t] = c.cu_seqlens[i] + done + t;
            total += l;
            lens.push_back(l);
            slots.push_back(i);
        }
        if (lens.empty())
            break;
        kda_error err;
        s.nseqs = int32_t(lens.size());
        assert_int_equal(kda_step_seqs_fill(s.seqs.data(), s.nseqs, slots.data(), lens.data(), &s.tokens, &err), KDA_OK);
        for (int32_t j = 0; j < s.nseqs; j++)
            s.seqs[j].flags = done == 0 && !c.initial_state ? KDA_SEQ_ZERO_STATE : 0;
        for (int32_t t = 0; t < total; t++) {
            std::copy(c.q + src[t] * row, c.q + (src[t] + 1) * row, q.begin() + t * row);
            std::copy(c.k + src[t] * row, c.k + (src[t] + 1) * row, k.begin() + t * row);
            std::copy(c.v + src[t] * row, c.v + (src[t] + 1) * row, v.begin() + t * row);
            std::copy(c.g + src[t] * row, c.g + (src[t] + 1) * row, g.begin() + t * row);
            std::copy(c.beta + src[t] * H, c.beta + (src[t] + 1) * H, beta.begin() + t * H);
        }
        const size_t bytes = size_t(total) * row * 2;
        GPU_CHECK(cudaMemcpy(s.q, q.data(), bytes, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(s.k, k.data(), bytes, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(s.v, v.data(), bytes, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(s.g, g.data(), bytes, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemcpy(s.beta, beta.data(), size_t(total) * H * 2, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemset(s.out, 0xff, bytes));
        upload_step(s);
        launch(pool, s, N);
        GPU_CHECK(cudaMemcpy(o.data(), s.out, bytes, cudaMemcpyDeviceToHost));
        for (int32_t t = 0; t < total; t++)
            std::copy(o.begin() + t * row, o.begin() + (t + 1) * row, out.begin() + src[t] * row);
    }
    fin.resize(N * slot_elems);
    GPU_CHECK(cudaMemcpy(fin.data(), pool.state, sizeof(float) * fin.size(), cudaMemcpyDeviceToHost));
    cudaFree(pool.state);
    free_step(s);
}

static void golden_cuts(void **)
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
        const double bo = std::max(BOUND, c.fla_out_err), bs = std::max(BOUND, c.fla_state_err);
        const size_t out_n = size_t(c.total_tokens) * c.heads * D, st_n = size_t(c.nseqs) * kda_slot_elems(c.heads);
        for (int cut = 1; cut <= 4; cut += 3) {
            std::vector<uint16_t> out;
            std::vector<float> fin;
            golden_steps(c, cut, out, fin);
            const double eo = rel_rms_bf16(out.data(), c.expected_out, out_n);
            const double es = rel_rms_f32(fin.data(), c.expected_state, st_n);
            const bool ok = eo <= bo && es <= bs;
            print_message("  %-22s %d-token steps, fp32 pool: out %.5f state %.5f (fla %.5f/%.5f) %s\n", c.name, cut,
                          eo, es, c.fla_out_err, c.fla_state_err, ok ? "" : "FAILED");
            failed += !ok;
        }
        golden_free(&c);
    }
    golden_list_free(paths, n);
    if (failed)
        fail_msg("%d golden cut(s) above the contract", failed);
}

/* One launch captured for a bucket of 64 sequences, replayed with three different steps. */
static void graph_replay(void **)
{
    const int32_t bucket = 64, heads = 8;
    kda_pool pool = gpu_make_pool(heads, 100, KDA_DTYPE_BF16, seed + 400);
    DevStep shape = make_step(heads, std::vector<int32_t>(bucket, 1), shuffled_slots(bucket, 100, 1), KDA_DTYPE_BF16,
                              false, seed + 401);
    cudaStream_t stream;
    GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    kda_error err = {};
    assert_int_equal(kda_cuda_step(cu, &pool, shape.dev, bucket, stream, &err), KDA_OK);
    GPU_CHECK(cudaStreamEndCapture(stream, &graph));
    GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    const std::vector<std::vector<int32_t>> lens = {{1, 1, 1}, std::vector<int32_t>(64, 4), {16, 2, 9, 1, 1}};
    for (size_t r = 0; r < lens.size(); r++) {
        DevStep s = make_step(heads, lens[r], shuffled_slots(int(lens[r].size()), 100, seed + r), KDA_DTYPE_BF16,
                              r == 2, seed + 500 + r);
        kda_pool before = gpu_clone_pool(pool);
        GPU_CHECK(cudaMemset(s.out, 0xff, size_t(s.tokens) * heads * D * 2));
        GPU_CHECK(cudaMemcpy(shape.dev, &s.host, sizeof s.host, cudaMemcpyHostToDevice));   /* the new step */
        GPU_CHECK(cudaGraphLaunch(exec, stream));
        GPU_CHECK(cudaStreamSynchronize(stream));
        const Errors e = oracle_errors(s, before, pool);
        print_message("  graph replay %zu (%d seqs, %d tokens): out %.5f state %.5f kept %.5f\n", r, s.nseqs, s.tokens,
                      e.out, e.state, e.kept);
        assert_true(e.out <= BOUND && e.state <= BOUND && e.kept <= BOUND);
        cudaFree(before.state);
        free_step(s);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    free_step(shape);
    cudaFree(pool.state);
}

static void deterministic(void **)
{
    DevStep s = make_step(16, {1, 7, 3, 16, 1}, {0, 1, 2, 3, 4}, KDA_DTYPE_F32, true, seed + 600);
    kda_pool p1 = gpu_make_pool(16, 5, KDA_DTYPE_F32, seed + 601), p2 = gpu_clone_pool(p1);
    const size_t out_bytes = size_t(s.tokens) * 16 * D * 2, kept_bytes = size_t(s.tokens) * kda_slot_elems(16) * 4;
    std::vector<char> o1(out_bytes), o2(out_bytes), k1(kept_bytes), k2(kept_bytes), s1(gpu_pool_bytes(p1)), s2(s1.size());
    launch(p1, s, s.nseqs);
    GPU_CHECK(cudaMemcpy(o1.data(), s.out, out_bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(k1.data(), s.states, kept_bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemset(s.out, 0, out_bytes));
    GPU_CHECK(cudaMemset(s.states, 0, kept_bytes));
    launch(p2, s, s.nseqs);
    GPU_CHECK(cudaMemcpy(o2.data(), s.out, out_bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(k2.data(), s.states, kept_bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(s1.data(), p1.state, s1.size(), cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(s2.data(), p2.state, s2.size(), cudaMemcpyDeviceToHost));
    assert_memory_equal(o1.data(), o2.data(), out_bytes);
    assert_memory_equal(k1.data(), k2.data(), kept_bytes);
    assert_memory_equal(s1.data(), s2.data(), s1.size());
    cudaFree(p1.state);
    cudaFree(p2.state);
    free_step(s);
}

/* The host-side check (no device needed: it runs in CI too). */
static void host_checks(void **)
{
    char byte;
    kda_pool pool = {&byte, KDA_DTYPE_F32, 4, 2};
    kda_step_seq seqs[2] = {{0, 0, 1, 0}, {1, 1, 3, 0}};
    uint16_t *p = reinterpret_cast<uint16_t *>(0x1000);
    kda_step s = {p, p, p, p, p, p, nullptr, reinterpret_cast<kda_layer *>(0x2000), seqs, 2, 4};
    kda_error err;
    assert_int_equal(kda_cuda_step_check(&pool, &s, &err), KDA_OK);
    s.states = reinterpret_cast<void *>(0x3008);   /* 8-byte aligned only */
    assert_int_equal(kda_cuda_step_check(&pool, &s, &err), KDA_EINVAL);
    assert_non_null(strstr(err.msg, "16-byte aligned"));
    s.states = nullptr;
    s.v = reinterpret_cast<uint16_t *>(0x1002);
    assert_int_equal(kda_cuda_step_check(&pool, &s, &err), KDA_EINVAL);
    s.v = p;
    seqs[1].len = 17;
    assert_int_equal(kda_cuda_step_check(&pool, &s, &err), KDA_EINVAL);
    assert_non_null(strstr(err.msg, "outside [1, 16]"));
}

int main()
{
    const struct CMUnitTest host[] = {cmocka_unit_test(host_checks)};
    if (cmocka_run_group_tests(host, nullptr, nullptr) != 0)
        return 1;
    kda_error err;
    const int rc = kda_cuda_create(0, &cu, &err);
    if (rc == KDA_ENOTSUP) {
        printf("SKIP: %s; the CUDA decode tests need an sm_90 GPU (the host checks passed)\n", err.msg);
        return 77;
    }
    if (rc != KDA_OK) {
        fprintf(stderr, "kda_cuda_create: %s\n", err.msg);
        return 1;
    }
    const char *env = getenv("KDA_TEST_SEED");
    seed = env ? strtoull(env, nullptr, 10) : uint64_t(time(nullptr));
    printf("test_cuda_decode on %s, seed %llu\n", kda_cuda_device_name(cu), (unsigned long long)seed);
    int failed;
    if (getenv("KDA_GPU_TEST_QUICK")) {
        const struct CMUnitTest quick[] = {cmocka_unit_test(zero_state_flag)};
        failed = cmocka_run_group_tests_name("decode (quick)", quick, nullptr, nullptr);
    } else {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(random_steps), cmocka_unit_test(zero_state_flag), cmocka_unit_test(golden_cuts),
            cmocka_unit_test(graph_replay), cmocka_unit_test(deterministic),
        };
        failed = cmocka_run_group_tests_name("decode", tests, nullptr, nullptr);
    }
    kda_cuda_destroy(cu);
    return failed;
}
