/*
 * prefill_libuv.c - the same pipelined prefills from a libuv loop: a
 * uv_poll_t watches the client's fd for the events kdac_client_events()
 * asks for, and its callback calls kdac_client_progress().
 *
 *   cc prefill_libuv.c $(pkg-config --cflags --libs kdaclient libuv) -o prefill_libuv
 *   ./prefill_libuv [SOCKET]
 *
 * NSEQ sequences of LEN tokens each go out at once (one request each, on
 * its own slot); the daemon batches them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kdaclient.h>
#include <uv.h>

#define NSEQ 16
#define LEN 32

typedef struct app {
    kdac_client *c;
    uv_poll_t poll;
    int armed;    /* events the uv_poll_t watches */
    int done, failed;
} app;

static void on_prefill(kdac_client *c, void *data, const kdac_result *res, int status)
{
    app *a = data;
    a->done++;
    if (status != 0) {
        a->failed++;
        fprintf(stderr, "prefill: %s (%s)\n", res->error.message, kdac_err_name(status));
    }
}

static int uv_events(int kdac_events)
{
    return (kdac_events & KDAC_READABLE ? UV_READABLE : 0) |
           (kdac_events & KDAC_WRITABLE ? UV_WRITABLE : 0);
}

static void on_poll(uv_poll_t *handle, int status, int events)
{
    app *a = handle->data;
    int rc = kdac_client_progress(a->c);
    int want = kdac_client_events(a->c);
    if (rc != 0 || a->done == NSEQ || want == 0) {
        uv_poll_stop(handle); /* nothing left to wait for: the loop ends */
        return;
    }
    if (want != a->armed) {
        uv_poll_start(handle, uv_events(want), on_poll);
        a->armed = want;
    }
}

int main(int argc, char **argv)
{
    app a = {0};
    kdac_options opts;
    kdac_options_init(&opts);
    opts.socket_path = argc > 1 ? argv[1] : NULL;
    kdac_error err;
    if (kdac_client_open(&a.c, &opts, &err) != 0) {
        fprintf(stderr, "connect: %s\n", err.message);
        return 1;
    }
    uint32_t heads = kdac_client_info(a.c)->heads;
    size_t tok = (size_t)heads * KDAC_HEAD_DIM;
    float *A_log = calloc(heads, sizeof(float)), *dt_bias = calloc(tok, sizeof(float));
    uint16_t *input = calloc(LEN * tok, sizeof(uint16_t)); /* zeros are valid bf16 inputs */
    uint16_t *out = malloc(NSEQ * LEN * tok * sizeof(uint16_t));
    kdac_layer layer = {"example.libuv", A_log, dt_bias, -5.0f, KDAC_DEFAULT_SCALE};
    bool created;
    uint64_t slots[NSEQ];
    if (kdac_layer_register(a.c, &layer, &created, &err) != 0 ||
        kdac_slot_alloc(a.c, NSEQ, 0, slots, &err) != 0) {
        fprintf(stderr, "setup: %s\n", err.message);
        return 1;
    }
    for (int i = 0; i < NSEQ; i++) {
        kdac_seq s;
        memset(&s, 0, sizeof(s));
        s.slot = slots[i];
        s.len = LEN;
        s.q = s.k = s.v = s.g = s.beta = kdac_tensor_inline(input);
        s.out = kdac_output_inline(out + (size_t)i * LEN * tok);
        if (kdac_prefill_send(a.c, layer.name, &s, 1, on_prefill, &a, &err) != 0) {
            fprintf(stderr, "prefill_send: %s\n", err.message);
            return 1;
        }
    }

    uv_loop_t *loop = uv_default_loop();
    uv_poll_init(loop, &a.poll, kdac_client_fd(a.c));
    a.poll.data = &a;
    a.armed = kdac_client_events(a.c);
    uv_poll_start(&a.poll, uv_events(a.armed), on_poll);
    uv_run(loop, UV_RUN_DEFAULT);
    uv_close((uv_handle_t *)&a.poll, NULL);
    uv_run(loop, UV_RUN_DEFAULT);

    printf("%d prefills of %d tokens completed, %d failed\n", a.done, LEN, a.failed);
    kdac_slot_free(a.c, slots, NSEQ, NULL);
    if (created)
        kdac_layer_drop(a.c, layer.name, NULL);
    kdac_client_close(a.c);
    uv_loop_close(loop);
    free(A_log);
    free(dt_bias);
    free(input);
    free(out);
    return a.failed || a.done < NSEQ ? 1 : 0;
}
