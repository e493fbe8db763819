/*
 * prefill_epoll.c - pipelined prefills from an epoll loop with libkdaclient.
 *
 * A serving stack keeps many sequences in kdad's state pool and, per step,
 * submits prefill work for all of them without waiting for each answer.
 * This example does that for NSEQ sequences, each fed in NCHUNK chunks of
 * CHUNK tokens (chunked prefill): every chunk continues its slot's state,
 * names the position it expects (so a lost chunk can never be silently
 * skipped), and the next chunk of a sequence goes out from the completion
 * callback of the previous one.  All sequences are in flight at once on one
 * connection; the daemon batches them.
 *
 *   cc prefill_epoll.c $(pkg-config --cflags --libs kdaclient) -o prefill_epoll
 *   ./prefill_epoll [SOCKET]        (default: $KDAD_SOCKET, then the system socket)
 *
 * Tensors travel inline here; with kdac_shm_create + kdac_region_register_shm
 * (or a CUDA IPC region) the same seqs name region offsets instead.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <kdaclient.h>

#define NSEQ 8    /* sequences, one slot each */
#define NCHUNK 3  /* chunks per sequence */
#define CHUNK 64  /* tokens per chunk */

struct app;

typedef struct sequence {
    struct app *app;
    uint64_t slot;
    uint32_t chunks_done;
    uint16_t *out; /* bf16 [NCHUNK * CHUNK][H][128]: each chunk's output lands here */
} sequence;

typedef struct app {
    kdac_client *c;
    uint32_t heads;
    uint16_t *input;  /* bf16 [CHUNK][H][128], shared by every chunk (read-only) */
    sequence seqs[NSEQ];
    int finished;     /* sequences done */
    int failed;
} app;

static void chunk_done(kdac_client *c, void *data, const kdac_result *res, int status);

/* Sends the next chunk of sequence s. */
static int send_chunk(app *a, sequence *s)
{
    size_t tok = (size_t)a->heads * KDAC_HEAD_DIM; /* elements per token */
    kdac_seq q;
    memset(&q, 0, sizeof(q));
    q.slot = s->slot;
    q.len = CHUNK;
    q.flags = KDAC_SEQ_EXPECT_POS;
    q.expect_pos = (uint64_t)s->chunks_done * CHUNK;
    q.q = q.k = q.v = q.g = kdac_tensor_inline(a->input);
    q.beta = kdac_tensor_inline(a->input); /* [CHUNK][H]: a prefix of the same bytes */
    q.out = kdac_output_inline(s->out + (size_t)s->chunks_done * CHUNK * tok);
    kdac_error err;
    if (kdac_prefill_send(a->c, "example.layer", &q, 1, chunk_done, s, &err) != 0) {
        fprintf(stderr, "prefill_send: %s (%s)\n", err.message, kdac_err_name(err.code));
        return -1;
    }
    return 0;
}

static void chunk_done(kdac_client *c, void *data, const kdac_result *res, int status)
{
    sequence *s = data;
    app *a = s->app;
    if (status != 0) {
        fprintf(stderr, "slot 0x%llx: %s (%s)\n", (unsigned long long)s->slot,
                res->error.message, kdac_err_name(status));
        a->failed++;
        a->finished++;
        return;
    }
    s->chunks_done++;
    printf("slot 0x%llx: chunk %u done, position %llu (daemon: queue %llu us, run %llu us)\n",
           (unsigned long long)s->slot, s->chunks_done,
           (unsigned long long)res->u.prefill.pos[0],
           (unsigned long long)res->u.prefill.queue_us, (unsigned long long)res->u.prefill.run_us);
    if (s->chunks_done == NCHUNK || send_chunk(a, s) != 0)
        a->finished++;
}

/* epoll events for what the client asks to be polled for. */
static uint32_t epoll_events(int kdac_events)
{
    return (kdac_events & KDAC_READABLE ? EPOLLIN : 0) |
           (kdac_events & KDAC_WRITABLE ? EPOLLOUT : 0);
}

int main(int argc, char **argv)
{
    static app the_app;
    app *a = &the_app;
    kdac_options opts;
    kdac_options_init(&opts);
    opts.socket_path = argc > 1 ? argv[1] : NULL;
    opts.client_name = "prefill_epoll example";
    kdac_error err;
    if (kdac_client_open(&a->c, &opts, &err) != 0) {
        fprintf(stderr, "connect: %s\n", err.message);
        return 1;
    }
    const kdac_server_info *info = kdac_client_info(a->c);
    a->heads = info->heads;
    printf("connected to %s (backend %s, %u heads)\n", info->server, info->backend, a->heads);

    /* Setup, blocking: a layer (weights belong to the layer, not the
     * request), one zeroed slot per sequence, and the inputs. */
    size_t tok = (size_t)a->heads * KDAC_HEAD_DIM;
    float *A_log = calloc(a->heads, sizeof(float));
    float *dt_bias = calloc(tok, sizeof(float));
    a->input = malloc(CHUNK * tok * sizeof(uint16_t));
    for (size_t i = 0; i < CHUNK * tok; i++) /* small bf16 values: upper halves of floats */
        a->input[i] = (uint16_t)(0x3c00 + (i * 2654435761u >> 24) % 0x200);
    kdac_layer layer = {"example.layer", A_log, dt_bias, -5.0f, KDAC_DEFAULT_SCALE};
    bool created;
    uint64_t slots[NSEQ];
    if (kdac_layer_register(a->c, &layer, &created, &err) != 0 ||
        kdac_slot_alloc(a->c, NSEQ, 0, slots, &err) != 0) {
        fprintf(stderr, "setup: %s (%s)\n", err.message, kdac_err_name(err.code));
        return 1;
    }

    /* Pipelined: the first chunk of every sequence goes out at once. */
    for (int i = 0; i < NSEQ; i++) {
        a->seqs[i].app = a;
        a->seqs[i].slot = slots[i];
        a->seqs[i].out = malloc(NCHUNK * CHUNK * tok * sizeof(uint16_t));
        if (send_chunk(a, &a->seqs[i]) != 0)
            return 1;
    }

    /* The event loop: wait for what the client asks for, let it progress
     * (which runs the callbacks above), and re-arm when its wishes change. */
    int ep = epoll_create1(EPOLL_CLOEXEC);
    int fd = kdac_client_fd(a->c);
    int armed = kdac_client_events(a->c);
    struct epoll_event ev = {.events = epoll_events(armed)};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    while (a->finished < NSEQ) {
        struct epoll_event got;
        if (epoll_wait(ep, &got, 1, 1000) < 0)
            break;
        if (kdac_client_progress(a->c) != 0)
            break; /* connection failed: every callback has run with the error */
        int want = kdac_client_events(a->c);
        if (want != armed) {
            ev.events = epoll_events(want);
            epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev);
            armed = want;
        }
    }
    epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
    close(ep);

    printf("%d sequences x %d chunks of %d tokens: %d failed\n", NSEQ, NCHUNK, CHUNK, a->failed);
    kdac_slot_free(a->c, slots, NSEQ, NULL);
    if (created)
        kdac_layer_drop(a->c, layer.name, NULL);
    kdac_client_close(a->c);
    for (int i = 0; i < NSEQ; i++)
        free(a->seqs[i].out);
    free(a->input);
    free(A_log);
    free(dt_bias);
    return a->failed || a->finished < NSEQ ? 1 : 0;
}
