/*
 * prefill_loop.c - the C side of overhead.py: the same blocking prefill the
 * Python benchmark times (one sequence of T tokens, inline tensors, fresh),
 * issued N times through libkdaclient; prints each call's latency and the
 * calling thread's CPU time, in nanoseconds, one call per line.
 *
 *   prefill_loop SOCKET TOKENS CALLS
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kdaclient.h"

static long long clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: prefill_loop SOCKET TOKENS\n");
        return 2;
    }
    uint32_t T = (uint32_t)atoi(argv[2]);
    int calls;
    kdac_options o;
    kdac_options_init(&o);
    o.socket_path = argv[1];
    o.timeout_ms = 60000;
    kdac_client *c;
    kdac_error err;
    if (kdac_client_open(&c, &o, &err) != 0) {
        fprintf(stderr, "open: %s\n", err.message);
        return 1;
    }
    uint32_t H = kdac_client_info(c)->heads;
    float *alog = calloc(H, 4), *dtb = calloc((size_t)H * 128, 4);
    kdac_layer L = {"bench.overhead", alog, dtb, -5.0f, KDAC_DEFAULT_SCALE};
    uint64_t slot;
    if (kdac_layer_register(c, &L, NULL, &err) != 0 || kdac_slot_alloc(c, 1, 0, &slot, &err) != 0) {
        fprintf(stderr, "setup: %s\n", err.message);
        return 1;
    }
    size_t tok = kdac_token_bytes(T, H);
    uint16_t *in = malloc(tok), *beta = malloc(kdac_beta_bytes(T, H)), *out = malloc(tok);
    for (size_t i = 0; i < tok / 2; i++)
        in[i] = 0x3f80 ^ (uint16_t)(i * 2654435761u >> 20 & 0x807f);
    memset(beta, 0, kdac_beta_bytes(T, H));
    kdac_seq s = {0};
    s.slot = slot;
    s.len = T;
    s.flags = KDAC_SEQ_FRESH;
    s.q = s.k = s.v = s.g = kdac_tensor_inline(in);
    s.beta = kdac_tensor_inline(beta);
    s.out = kdac_output_inline(out);
    while (scanf("%d", &calls) == 1) {
        for (int i = 0; i < calls; i++) {
            long long t0 = clock_ns(CLOCK_MONOTONIC), c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
            if (kdac_prefill(c, "bench.overhead", &s, 1, NULL, &err) != 0) {
                fprintf(stderr, "prefill: %s\n", err.message);
                return 1;
            }
            long long c1 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
            printf("%lld %lld\n", clock_ns(CLOCK_MONOTONIC) - t0, c1 - c0);
        }
        printf("done\n");
        fflush(stdout);
    }
    kdac_client_close(c);
    return 0;
}
