/*
 * bench_layer_find: what resolving a request's layer name costs
 * (kd_layers_find, daemon/layer.c) as the registry grows.
 *
 * N client layers across 8 uids, each uid registering the same names
 * ("model.layers.%u.attn", N/8 of them), as serving stacks that load the
 * same model under different uids do.  Times every (uid, name) in a shuffled
 * order, and a name no uid has; the median of 5 passes of at least 0.1 s.
 *
 *   bench_layer_find [N ...]     (default: 16 256 4096)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "backend.h"
#include "layer.h"
#include "log.h"

#define UIDS 8
#define HEADS 4
#define PASSES 5

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct probe {
    char name[64];
    uint32_t uid;
} probe;

/* Median ns per kd_layers_find over the probes; `hits` says whether each must resolve. */
static double time_finds(const kd_layers *ls, const probe *p, uint32_t n, int hits)
{
    double ns[PASSES];
    for (int pass = 0; pass < PASSES; pass++) {
        uint64_t finds = 0, found = 0;
        double t0 = now_s(), t;
        do {
            for (uint32_t i = 0; i < n; i++)
                found += kd_layers_find(ls, p[i].name, p[i].uid) != NULL;
            finds += n;
            t = now_s();
        } while (t - t0 < 0.1);
        if (found != (hits ? finds : 0)) {
            fprintf(stderr, "bench_layer_find: %llu of %llu lookups resolved\n",
                    (unsigned long long)found, (unsigned long long)finds);
            exit(1);
        }
        ns[pass] = (t - t0) * 1e9 / (double)finds;
    }
    qsort(ns, PASSES, sizeof(ns[0]), cmp_double);
    return ns[PASSES / 2];
}

int main(int argc, char **argv)
{
    static const uint32_t defaults[] = {16, 256, 4096};
    uint32_t sizes[16], nsizes = 0;
    for (int i = 1; i < argc && nsizes < 16; i++)
        sizes[nsizes++] = (uint32_t)strtoul(argv[i], NULL, 10);
    if (nsizes == 0) {
        memcpy(sizes, defaults, sizeof(defaults));
        nsizes = 3;
    }
    kd_log_set_level(KD_LOG_WARNING);
    char err[256];
    kd_backend *b;
    kd_backend_config bc = {.kind = KD_BACKEND_CPU, .cpu_threads = 1, .heads = HEADS, .slots = 1,
                            .dtype = KDA_DTYPE_F32};
    if (kd_backend_create(uv_default_loop(), &bc, NULL, NULL, NULL, &b, err, sizeof(err)) !=
        KP_OK) {
        fprintf(stderr, "bench_layer_find: %s\n", err);
        return 1;
    }
    float A_log[HEADS] = {0}, dt_bias[HEADS * KDA_HEAD_DIM] = {0};
    printf("| layers | ns per lookup (hit) | ns per lookup (miss) |\n|---|---|---|\n");
    for (uint32_t s = 0; s < nsizes; s++) {
        const uint32_t n = sizes[s] < UIDS ? UIDS : sizes[s] / UIDS * UIDS;
        kd_layers ls;
        kd_layers_init(&ls, b, HEADS, UINT64_C(0x5eed5eed5eed5eed));
        kd_layer_quota q = {n, n};
        probe *p = calloc(n, sizeof(*p)), miss[UIDS];
        for (uint32_t i = 0; i < n; i++) {
            p[i].uid = 1000 + i % UIDS;
            snprintf(p[i].name, sizeof(p[i].name), "model.layers.%u.attn", i / UIDS);
            bool created;
            kp_error e;
            if (kd_layers_register(&ls, p[i].name, A_log, dt_bias, -5.0f, 1.0f, p[i].uid, &q,
                                   &created, &e) != KP_OK || !created) {
                fprintf(stderr, "bench_layer_find: %s\n", e.message);
                return 1;
            }
        }
        srand(1);
        for (uint32_t i = n; i-- > 1;) { /* a shuffled order: no cache-friendly walk */
            uint32_t j = (uint32_t)rand() % (i + 1);
            probe t = p[i];
            p[i] = p[j];
            p[j] = t;
        }
        for (uint32_t u = 0; u < UIDS; u++) {
            miss[u].uid = 1000 + u;
            snprintf(miss[u].name, sizeof(miss[u].name), "model.layers.%u.mlp", u);
        }
        double hit = time_finds(&ls, p, n, 1), none = time_finds(&ls, miss, UIDS, 0);
        printf("| %u | %.1f | %.1f |\n", n, hit, none);
        free(p);
        kd_layers_destroy(&ls);
    }
    kd_backend_destroy(b);
    return 0;
}
