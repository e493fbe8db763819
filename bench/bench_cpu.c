/*
 * bench_cpu.c - times the CPU backend on the standard workloads.
 *
 *   bench_cpu [--heads H] [--tokens T] [--seqs N] [--threads N] [--reps R] [--json]
 *
 * Default: H = 96, one sequence of 8192 tokens (92.6 GFLOP of the chunked
 * algorithm at C = 16, docs/kda.md).  Prints the median of R runs, tokens/s and
 * GFLOP/s; inputs are random N(0,1) bf16, never zeros.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "kda_cpu.h"

enum { D = KDA_HEAD_DIM };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rng = 88172645463325252ull;
static float randn(void)   /* sum of uniforms: cheap, roughly normal */
{
    float s = 0;
    for (int i = 0; i < 4; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        s += (float)(rng >> 40) * 0x1.0p-24f;
    }
    return (s - 2.0f) * 1.7320508f;
}

int main(int argc, char **argv)
{
    int heads = 96, nseqs = 1, threads = 0, reps = 3, json = 0;
    long tokens = 8192;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--heads") && i + 1 < argc) heads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = atol(argv[++i]);
        else if (!strcmp(argv[i], "--seqs") && i + 1 < argc) nseqs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json")) json = 1;
        else {
            fprintf(stderr, "usage: %s [--heads H] [--tokens T] [--seqs N] [--threads N] [--reps R] [--json]\n", argv[0]);
            return 2;
        }
    }
    if (heads < 1 || heads > KDA_MAX_HEADS || tokens < 1 || nseqs < 1 || reps < 1) {
        fprintf(stderr, "bench_cpu: bad sizes\n");
        return 2;
    }
    const size_t n = (size_t)tokens * heads * D;
    uint16_t *x[4], *beta = malloc((size_t)tokens * heads * 2), *out = malloc(n * 2);
    for (int t = 0; t < 4; t++) {
        x[t] = malloc(n * 2);
        for (size_t i = 0; i < n; i++)
            x[t][i] = kda_f32_to_bf16(randn());
    }
    for (size_t i = 0; i < (size_t)tokens * heads; i++)
        beta[i] = kda_f32_to_bf16(randn());
    float *A_log = malloc(sizeof(float) * heads), *dt_bias = malloc(sizeof(float) * heads * D);
    for (int h = 0; h < heads; h++)
        A_log[h] = 0.5f;
    for (int i = 0; i < heads * D; i++)
        dt_bias[i] = 0.5f;
    kda_layer layer = {A_log, dt_bias, -5.0f, 0.08838834764831845f};
    kda_pool pool = {calloc((size_t)nseqs * heads * D * D, 4), KDA_DTYPE_F32, heads, nseqs};
    int64_t *cu = malloc(sizeof(int64_t) * (nseqs + 1)), *slots = malloc(sizeof(int64_t) * nseqs);
    for (int i = 0; i <= nseqs; i++)
        cu[i] = tokens * i / nseqs;
    for (int i = 0; i < nseqs; i++)
        slots[i] = i;
    kda_seq *seqs = calloc(nseqs, sizeof *seqs);
    kda_error err;
    kda_cpu *cpu;
    if (kda_seqs_from_packed(seqs, nseqs, heads, cu, tokens, slots, x[0], x[1], x[2], x[3], beta,
                             out, &layer, &err) || kda_cpu_create(threads, &cpu, &err)) {
        fprintf(stderr, "bench_cpu: %s\n", err.msg);
        return 1;
    }
    double *times = malloc(sizeof(double) * reps);
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        if (kda_cpu_prefill(cpu, &pool, seqs, nseqs, &err) != KDA_OK) {
            fprintf(stderr, "bench_cpu: %s\n", err.msg);
            return 1;
        }
        times[r] = now_s() - t0;
    }
    qsort(times, reps, sizeof *times, cmp_double);
    double med = times[reps / 2];
    double gflop = 117760.0 * (double)tokens * heads / 1e9;   /* docs/kda.md: per token per head at C = 16 */
    if (json)
        printf("{\"heads\": %d, \"tokens\": %ld, \"seqs\": %d, \"threads\": %d, \"s\": %.4f, "
               "\"tokens_per_s\": %.0f, \"gflop_s\": %.1f}\n",
               heads, tokens, nseqs, kda_cpu_threads(cpu), med, tokens / med, gflop / med);
    else
        printf("cpu backend: H=%d T=%ld N=%d threads=%d: median %.3f s of %d (min %.3f), "
               "%.0f tokens/s, %.1f GFLOP/s\n",
               heads, tokens, nseqs, kda_cpu_threads(cpu), med, reps, times[0], tokens / med,
               gflop / med);
    kda_cpu_destroy(cpu);
    return 0;
}
