/*
 * cmd_prefill.c - kdactl prefill: runs a golden-format input file (or
 * synthetic inputs) through the daemon and writes what came back.
 *
 * The run: register the input's layer (under a name derived from its
 * content; the daemon counts registrations, so the run's drop at the end
 * gives back its own and never pulls the layer from under a concurrent run
 * of the same input), allocate one fresh slot
 * per sequence, write the initial states into them, one prefill request of
 * every sequence (inline, or through a shared-memory region when the
 * tensors exceed the inline cap), read the final states back as f32, free
 * the slots, and write `out` and `final_state` to the output file.  Slot
 * writes and reads are pipelined on the one connection.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "prefill_io.h"

static const char prefill_help[] =
    "Usage: kdactl prefill --input IN.safetensors [--output OUT.safetensors] [options]\n"
    "       kdactl prefill --random --tokens T --heads H [--seqs N] [--seed S] [options]\n"
    "\n"
    "Runs one KDA prefill of every sequence of the input through the daemon, each\n"
    "sequence in a fresh slot that starts from the input's initial_state (zeros when\n"
    "absent), and prints what happened.  IN is a golden-vector file: q, k, v, g, beta,\n"
    "A_log, dt_bias, cu_seqlens, optional initial_state, metadata lower_bound and scale.\n"
    "OUT receives out (BF16 [T, H, 128]), final_state (F32 [N, H, 128, 128]) and\n"
    "cu_seqlens.  --random draws inputs instead (N(0,1) bf16 tensors, U(0,1) weights);\n"
    "H must be the daemon's heads.\n"
    "\n"
    "Options:\n"
    "  -i, --input FILE      golden-format input\n"
    "  -o, --output FILE     where to write out and final_state\n"
    "  -R, --random          synthetic inputs (needs --tokens and --heads)\n"
    "  -T, --tokens T        tokens in all (random)\n"
    "  -H, --heads H         heads (random)\n"
    "  -N, --seqs N          sequences, splitting T evenly (random; default 1)\n"
    "  -S, --seed S          seed of the random inputs (default 1)\n"
    "  -x, --transport MODE  inline, shm, or auto (default: inline when it fits the\n"
    "                        daemon's max_inline_bytes, else shm)\n"
    "  -C, --check           compare out and final_state with the input's expected_out and\n"
    "                        expected_final_state (relative RMS error) and fail (exit 1)\n"
    "                        above max(0.005, the fla error the file records)\n"
    "\n"
    "Examples:\n"
    "  kdactl prefill --input case.safetensors --check\n"
    "  kdactl prefill --random --tokens 8192 --heads 96 --seqs 4 --output out.safetensors\n";

typedef enum transport { TR_AUTO, TR_INLINE, TR_SHM } transport;

typedef struct batch {
    int done;
    int failed;
    kdac_error first; /* the first failure */
} batch;

static void batch_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    batch *b = data;
    if (status && !b->failed++)
        b->first = res->error;
    b->done++;
}

/* Everything one run holds, released by run_cleanup. */
typedef struct run {
    const ctl *g;
    kdac_client *c;
    prefill_input in;
    char layer[KDAC_NAME_MAX + 1];
    bool layer_created;
    bool layer_registered;        /* holds one registration, given back at the end */
    uint64_t *slots;              /* [N], allocated when slots_allocated */
    bool slots_allocated;
    kdac_seq *seqs;               /* [N] */
    uint16_t *out;                /* [T][H][128] */
    float *final_state;           /* [N][H][128][128] */
    kdac_shm shm;                 /* the region's memory (transport shm) */
    uint32_t region;
    const char *transport;
    uint64_t bytes_in, bytes_out; /* tensor bytes the prefill moves */
    /* the prefill's completion */
    int prefill_done;
    int prefill_status;
    kdac_error prefill_error;
    uint64_t *pos;                /* [N] */
    uint64_t queue_us, run_us;
    double seconds;               /* send to completion */
} run;

/* Sends one request per sequence with `send`, pipelined, and waits for all. */
static int for_each_seq(run *r, const char *what,
                        int (*send)(run *r, uint32_t i, batch *b, kdac_error *err))
{
    batch b = {0, 0, {0}};
    kdac_error err;
    int sent = 0;
    for (uint32_t i = 0; i < r->in.nseqs; i++, sent++) {
        if (send(r, i, &b, &err)) {
            ctl_wait(r->c, &b.done, sent, NULL, 0, 0);
            return ctl_fail(r->g, what, &err);
        }
    }
    /* A lost connection completes every request with its error: b.first. */
    ctl_wait(r->c, &b.done, sent, NULL, 0, 0);
    return b.failed ? ctl_fail(r->g, what, &b.first) : EXIT_OK;
}

static int write_state(run *r, uint32_t i, batch *b, kdac_error *err)
{
    size_t bytes = (size_t)kdac_state_bytes((uint32_t)r->in.heads, r->in.initial_dtype);
    const char *src = (const char *)r->in.initial_state + (size_t)i * bytes;
    return kdac_slot_write_send(r->c, r->slots[i], 0, r->in.initial_dtype,
                                kdac_tensor_inline(src), batch_cb, b, err);
}

static int read_state(run *r, uint32_t i, batch *b, kdac_error *err)
{
    size_t elems = (size_t)r->in.heads * KDAC_HEAD_DIM * KDAC_HEAD_DIM;
    return kdac_slot_read_send(r->c, r->slots[i], KDAC_DTYPE_F32,
                               kdac_output_inline(r->final_state + (size_t)i * elems), batch_cb,
                               b, err);
}

static uint64_t align16(uint64_t x)
{
    return (x + 15) & ~(uint64_t)15;
}

/* The request's sequences, tensors inline from the input. */
static void seqs_inline(run *r)
{
    const size_t tok = (size_t)r->in.heads * KDAC_HEAD_DIM;
    for (uint32_t i = 0; i < r->in.nseqs; i++) {
        size_t t0 = (size_t)r->in.cu_seqlens[i];
        kdac_seq *s = &r->seqs[i];
        s->q = kdac_tensor_inline(r->in.q + t0 * tok);
        s->k = kdac_tensor_inline(r->in.k + t0 * tok);
        s->v = kdac_tensor_inline(r->in.v + t0 * tok);
        s->g = kdac_tensor_inline(r->in.g + t0 * tok);
        s->beta = kdac_tensor_inline(r->in.beta + t0 * (size_t)r->in.heads);
        s->out = kdac_output_inline(r->out + t0 * tok);
    }
}

/*
 * The request's sequences, tensors in one shared-memory region: q, k, v, g
 * and out packed [T][H][128] (every token starts 16-byte aligned), beta one
 * aligned block per sequence (a token's beta is only 2H bytes).
 */
static int seqs_shm(run *r)
{
    const uint32_t H = (uint32_t)r->in.heads, T = r->in.total_tokens;
    const uint64_t big = kdac_token_bytes(T, H);
    uint64_t size = 5 * big;
    for (uint32_t i = 0; i < r->in.nseqs; i++)
        size += align16(kdac_beta_bytes(prefill_input_len(&r->in, i), H));
    kdac_error err;
    if (kdac_shm_create(&r->shm, size, "kdactl-prefill", &err))
        return ctl_fail(r->g, "prefill", &err);
    if (kdac_region_register_shm(r->c, r->shm.fd, size, &r->region, &err))
        return ctl_fail(r->g, "prefill: register shared memory", &err);
    char *base = r->shm.base;
    const uint16_t *src[4] = {r->in.q, r->in.k, r->in.v, r->in.g};
    for (int t = 0; t < 4; t++)
        memcpy(base + t * big, src[t], big);
    uint64_t beta_at = 5 * big;
    for (uint32_t i = 0; i < r->in.nseqs; i++) {
        uint32_t len = prefill_input_len(&r->in, i);
        uint64_t at = kdac_token_bytes((uint32_t)r->in.cu_seqlens[i], H);
        kdac_seq *s = &r->seqs[i];
        s->q = kdac_tensor_region(r->region, at);
        s->k = kdac_tensor_region(r->region, big + at);
        s->v = kdac_tensor_region(r->region, 2 * big + at);
        s->g = kdac_tensor_region(r->region, 3 * big + at);
        s->out = kdac_output_region(r->region, 4 * big + at);
        s->beta = kdac_tensor_region(r->region, beta_at);
        memcpy(base + beta_at, r->in.beta + (size_t)r->in.cu_seqlens[i] * H,
               kdac_beta_bytes(len, H));
        beta_at += align16(kdac_beta_bytes(len, H));
    }
    return EXIT_OK;
}

/* Picks the transport and lays the sequences out for it. */
static int prepare(run *r, transport tr)
{
    const kdac_server_info *info = kdac_client_info(r->c);
    const uint32_t H = (uint32_t)r->in.heads, T = r->in.total_tokens;
    uint64_t in_bytes = 4 * kdac_token_bytes(T, H) + kdac_beta_bytes(T, H);
    uint64_t out_bytes = kdac_token_bytes(T, H);
    bool fits = in_bytes <= info->limits.max_inline_bytes &&
                out_bytes <= info->limits.max_inline_bytes;
    if (tr == TR_AUTO)
        tr = fits ? TR_INLINE : TR_SHM;
    for (uint32_t i = 0; i < r->in.nseqs; i++) {
        kdac_seq *s = &r->seqs[i];
        s->slot = r->slots[i];
        s->len = prefill_input_len(&r->in, i);
        s->flags = KDAC_SEQ_EXPECT_POS;
        s->expect_pos = 0;
    }
    r->bytes_in = in_bytes;
    r->bytes_out = out_bytes;
    if (tr == TR_INLINE) {
        if (!fits)
            return ctl_error(r->g, EXIT_INPUT, "the inputs (%llu bytes) or the output (%llu "
                             "bytes) exceed the daemon's max_inline_bytes %llu: use "
                             "--transport shm", (unsigned long long)in_bytes,
                             (unsigned long long)out_bytes,
                             (unsigned long long)info->limits.max_inline_bytes);
        r->transport = "inline";
        seqs_inline(r);
        return EXIT_OK;
    }
    if (!(info->transports & KDAC_TRANSPORT_SHM))
        return ctl_error(r->g, EXIT_UNSUPPORTED, "the daemon does not offer the shm transport%s",
                         fits ? "" : ", and the tensors exceed its inline cap");
    r->transport = "shm";
    return seqs_shm(r);
}

static void prefill_cb(kdac_client *c, void *data, const kdac_result *res, int status)
{
    run *r = data;
    r->prefill_done = 1;
    r->prefill_status = status;
    r->prefill_error = res->error;
    if (status == KDAC_OK) {
        memcpy(r->pos, res->u.prefill.pos, sizeof(uint64_t) * res->u.prefill.nseqs);
        r->queue_us = res->u.prefill.queue_us;
        r->run_us = res->u.prefill.run_us;
    }
}

/* The prefill itself: one request (again after a retryable refusal), with a progress bar
 * for big transfers that names the request's phase. */
static int run_prefill(run *r)
{
    kdac_error err;
    bool inl = strcmp(r->transport, "inline") == 0;
    int attempt = 0;
    for (;;) {
        kdac_io_status st;
        kdac_client_io_status(r->c, &st);
        progress bar;
        progress_begin(&bar, r->g, "prefill", inl ? r->bytes_in + r->bytes_out : 0, true);
        progress_request(&bar, r->bytes_in);
        r->prefill_done = 0;
        double t0 = now_s();
        if (kdac_prefill_send(r->c, r->layer, r->seqs, r->in.nseqs, prefill_cb, r, &err)) {
            if (ctl_retry(r->g, "prefill", &err, &attempt))
                continue;
            return ctl_fail(r->g, "prefill", &err);
        }
        ctl_wait(r->c, &r->prefill_done, 1, &bar, st.sent_bytes, st.recv_bytes);
        progress_end(&bar);
        r->seconds = now_s() - t0;
        if (!r->prefill_status)
            break;
        if (!ctl_retry(r->g, "prefill", &r->prefill_error, &attempt))
            return ctl_fail(r->g, "prefill", &r->prefill_error);
    }
    for (uint32_t i = 0; i < r->in.nseqs; i++) {
        if (r->pos[i] != r->seqs[i].len)
            return ctl_error(r->g, EXIT_REFUSED, "the daemon put sequence %u at position %llu "
                             "after %u tokens from position 0", i,
                             (unsigned long long)r->pos[i], r->seqs[i].len);
    }
    if (!inl)
        memcpy(r->out, (char *)r->shm.base + 4 * kdac_token_bytes(r->in.total_tokens,
                                                                   (uint32_t)r->in.heads),
               kdac_token_bytes(r->in.total_tokens, (uint32_t)r->in.heads));
    return EXIT_OK;
}

/* Frees the slots, the region and (if this run created it) the layer; best
 * effort: the connection may be gone, which releases the first two anyway. */
static void run_cleanup(run *r)
{
    if (r->c) {
        if (r->slots_allocated)
            kdac_slot_free(r->c, r->slots, r->in.nseqs, NULL);
        if (r->region)
            kdac_region_release(r->c, r->region, NULL);
        if (r->layer_registered)
            kdac_layer_drop(r->c, r->layer, NULL);
        kdac_client_close(r->c);
    }
    if (r->shm.base)
        kdac_shm_close(&r->shm);
    free(r->slots);
    free(r->seqs);
    free(r->out);
    free(r->final_state);
    free(r->pos);
    prefill_input_free(&r->in);
}

static void print_summary(const run *r, const char *output, const prefill_check *check)
{
    const kdac_server_info *info = kdac_client_info(r->c);
    const prefill_input *in = &r->in;
    double tps = r->seconds > 0 ? in->total_tokens / r->seconds : 0;
    if (r->g->json) {
        json_object *o = json_object_new_object();
        json_object_object_add(o, "socket", json_object_new_string(kdac_client_path(r->c)));
        json_object_object_add(o, "server", json_object_new_string(info->server));
        json_object_object_add(o, "backend", json_object_new_string(info->backend));
        json_object_object_add(o, "gpu", info->has_gpu ? json_object_new_string(info->gpu_name)
                                                       : NULL);
        json_object_object_add(o, "tokens", json_u64(in->total_tokens));
        json_object_object_add(o, "heads", json_u64((uint64_t)in->heads));
        json_object_object_add(o, "seqs", json_u64(in->nseqs));
        json_object_object_add(o, "layer", json_object_new_string(r->layer));
        json_object_object_add(o, "layer_created", json_object_new_boolean(r->layer_created));
        json_object_object_add(o, "transport", json_object_new_string(r->transport));
        json_object_object_add(o, "bytes_in", json_u64(r->bytes_in));
        json_object_object_add(o, "bytes_out", json_u64(r->bytes_out));
        json_object_object_add(o, "queue_us", json_u64(r->queue_us));
        json_object_object_add(o, "run_us", json_u64(r->run_us));
        json_object_object_add(o, "e2e_us", json_u64((uint64_t)(r->seconds * 1e6)));
        json_object_object_add(o, "tokens_per_s", json_object_new_double(tps));
        json_object *pos = json_object_new_array();
        for (uint32_t i = 0; i < in->nseqs; i++)
            json_object_array_add(pos, json_u64(r->pos[i]));
        json_object_object_add(o, "positions", pos);
        json_object_object_add(o, "output", output ? json_object_new_string(output) : NULL);
        if (check) {
            json_object *k = json_object_new_object();
            json_object_object_add(k, "out_err", json_object_new_double(check->out_err));
            json_object_object_add(k, "state_err", json_object_new_double(check->state_err));
            json_object_object_add(k, "out_bound", json_object_new_double(check->out_bound));
            json_object_object_add(k, "state_bound", json_object_new_double(check->state_bound));
            json_object_object_add(k, "ok", json_object_new_boolean(check->ok));
            json_object_object_add(o, "check", k);
        }
        ctl_print_json(o);
        return;
    }
    char bin[32], bout[32];
    format_bytes((double)r->bytes_in, bin, sizeof(bin));
    format_bytes((double)r->bytes_out, bout, sizeof(bout));
    printf("prefill: %u tokens x %d heads in %u sequence%s on %s (backend %s%s%s) at %s\n",
           in->total_tokens, in->heads, in->nseqs, in->nseqs == 1 ? "" : "s", info->server,
           info->backend, info->has_gpu ? ", " : "", info->has_gpu ? info->gpu_name : "",
           kdac_client_path(r->c));
    printf("  layer      %s (%s)\n", r->layer,
           r->layer_created ? "registered for this run, then dropped"
                                : "already registered; this run's registration dropped");
    printf("  transport  %s: %s in, %s out\n", r->transport, bin, bout);
    printf("  time       %.1f ms end to end, daemon queue %.1f ms + run %.1f ms; "
           "%.0f tokens/s\n", r->seconds * 1e3, r->queue_us / 1e3, r->run_us / 1e3, tps);
    if (output)
        printf("  output     %s: out bf16 [%u, %d, 128], final_state f32 [%u, %d, 128, 128]\n",
               output, in->total_tokens, in->heads, in->nseqs, in->heads);
    if (check)
        printf("  check      output error %.3g (bound %.3g), final state %.3g (bound %.3g): %s\n",
               check->out_err, check->out_bound, check->state_err, check->state_bound,
               check->ok ? "within the accuracy contract" : "ABOVE the accuracy contract");
}

/* The run (see the top of this file) up to the final states, on a connected
 * client; run_cleanup frees what it leaves. */
static int run_steps(run *r, transport tr)
{
    prefill_input *in = &r->in;
    const kdac_server_info *info = kdac_client_info(r->c);
    kdac_error err;
    if ((uint32_t)in->heads != info->heads)
        return ctl_error(r->g, EXIT_INPUT, "the input has %d heads; the daemon at %s serves %u",
                         in->heads, kdac_client_path(r->c), info->heads);
    size_t N = in->nseqs, T = in->total_tokens, H = (size_t)in->heads;
    r->slots = calloc(N, sizeof(*r->slots));
    r->seqs = calloc(N, sizeof(*r->seqs));
    r->pos = calloc(N, sizeof(*r->pos));
    r->out = calloc(T * H * KDAC_HEAD_DIM + 1, sizeof(uint16_t));
    r->final_state = calloc(N * H * KDAC_HEAD_DIM * KDAC_HEAD_DIM, sizeof(float));
    if (!r->slots || !r->seqs || !r->pos || !r->out || !r->final_state)
        return ctl_error(r->g, EXIT_INPUT, "cannot allocate buffers for %zu tokens", T);

    layer_weights_name(&in->weights, r->layer, sizeof(r->layer));
    kdac_layer layer = {r->layer, in->weights.A_log, in->weights.dt_bias,
                        in->weights.lower_bound, in->weights.scale};
    if (CTL_RETRYING(r->g, "prefill: register the layer", err,
                     kdac_layer_register(r->c, &layer, &r->layer_created, &err)))
        return ctl_fail(r->g, "prefill: register the layer", &err);
    r->layer_registered = true;
    unsigned flags = in->initial_state ? KDAC_SLOT_ALLOC_EMPTY : 0;
    if (CTL_RETRYING(r->g, "prefill: allocate slots", err,
                     kdac_slot_alloc(r->c, (uint32_t)N, flags, r->slots, &err)))
        return ctl_fail(r->g, "prefill: allocate slots", &err);
    r->slots_allocated = true;
    int rc;
    if (in->initial_state && (rc = for_each_seq(r, "prefill: write initial states", write_state)))
        return rc;
    if ((rc = prepare(r, tr)) || (rc = run_prefill(r)))
        return rc;
    return for_each_seq(r, "prefill: read final states", read_state);
}

int cmd_prefill(ctl *g, int argc, char **argv)
{
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},         {"input", required_argument, NULL, 'i'},
        {"output", required_argument, NULL, 'o'}, {"random", no_argument, NULL, 'R'},
        {"tokens", required_argument, NULL, 'T'}, {"heads", required_argument, NULL, 'H'},
        {"seqs", required_argument, NULL, 'N'},   {"seed", required_argument, NULL, 'S'},
        {"transport", required_argument, NULL, 'x'}, {"check", no_argument, NULL, 'C'},
        {NULL, 0, NULL, 0}};
    const char *input = NULL, *output = NULL;
    bool random = false, check = false;
    uint64_t tokens = 0, heads = 0, nseqs = 1, seed = 1;
    transport tr = TR_AUTO;
    int o;
    while ((o = getopt_long(argc, argv, "hi:o:RT:H:N:S:x:C", opts, NULL)) != -1) {
        switch (o) {
        case 'h':
            fputs(prefill_help, stdout);
            return EXIT_OK;
        case 'i':
            input = optarg;
            break;
        case 'o':
            output = optarg;
            break;
        case 'R':
            random = true;
            break;
        case 'C':
            check = true;
            break;
        case 'T':
            if (!parse_u64(optarg, 1, UINT32_MAX, &tokens))
                return ctl_usage("prefill", "--tokens: '%s' is not a positive count", optarg);
            break;
        case 'H':
            if (!parse_u64(optarg, 1, 128, &heads))
                return ctl_usage("prefill", "--heads: '%s' is not in [1, 128]", optarg);
            break;
        case 'N':
            if (!parse_u64(optarg, 1, 4096, &nseqs))
                return ctl_usage("prefill", "--seqs: '%s' is not in [1, 4096]", optarg);
            break;
        case 'S':
            if (!parse_u64(optarg, 0, UINT64_MAX / 8, &seed))
                return ctl_usage("prefill", "--seed: '%s' is not a seed", optarg);
            break;
        case 'x':
            if (strcmp(optarg, "auto") == 0)
                tr = TR_AUTO;
            else if (strcmp(optarg, "inline") == 0)
                tr = TR_INLINE;
            else if (strcmp(optarg, "shm") == 0)
                tr = TR_SHM;
            else
                return ctl_usage("prefill", "--transport: '%s' is not inline, shm or auto",
                                 optarg);
            break;
        default:
            return ctl_usage("prefill", "unknown option");
        }
    }
    if (optind < argc)
        return ctl_usage("prefill", "unexpected argument '%s'", argv[optind]);
    if (!!input == random)
        return ctl_usage("prefill", "give either --input FILE or --random");
    if (random && (!tokens || !heads))
        return ctl_usage("prefill", "--random needs --tokens and --heads");
    if (random && nseqs > tokens)
        return ctl_usage("prefill", "--seqs %llu is more than --tokens %llu",
                         (unsigned long long)nseqs, (unsigned long long)tokens);
    if (!random && (tokens || heads || nseqs != 1))
        return ctl_usage("prefill", "--tokens, --heads and --seqs go with --random");
    if (check && random)
        return ctl_usage("prefill", "--check compares with an --input file's expected tensors");

    run r;
    memset(&r, 0, sizeof(r));
    r.g = g;
    r.shm.fd = -1;
    char why[1024];
    int rc = input ? prefill_input_read(&r.in, input, why, sizeof(why))
                   : prefill_input_random(&r.in, (uint32_t)tokens, (int32_t)heads,
                                          (uint32_t)nseqs, seed, why, sizeof(why));
    if (rc) {
        prefill_input_free(&r.in);
        return ctl_error(g, EXIT_INPUT, "%s", why);
    }
    if ((rc = ctl_connect(g, &r.c))) {
        run_cleanup(&r);
        return rc;
    }
    rc = run_steps(&r, tr);
    if (rc == EXIT_OK && output) {
        char backend[64], queue[32], runus[32];
        snprintf(backend, sizeof(backend), "%s", kdac_client_info(r.c)->backend);
        snprintf(queue, sizeof(queue), "%llu", (unsigned long long)r.queue_us);
        snprintf(runus, sizeof(runus), "%llu", (unsigned long long)r.run_us);
        const char *meta[] = {"producer", "kdactl prefill", "server", kdac_client_info(r.c)->server,
                              "backend", backend, "input", input ? input : "random",
                              "queue_us", queue, "run_us", runus};
        if (prefill_output_write(output, &r.in, r.out, r.final_state, meta, 6, why,
                                 sizeof(why)))
            rc = ctl_error(g, EXIT_INPUT, "%s", why);
    }
    prefill_check result;
    if (rc == EXIT_OK && check &&
        prefill_input_check(&r.in, r.out, r.final_state, &result, why, sizeof(why)))
        rc = ctl_error(g, EXIT_INPUT, "%s", why);
    if (rc == EXIT_OK) {
        print_summary(&r, output, check ? &result : NULL);
        if (check && !result.ok)
            rc = EXIT_REFUSED;
    }
    run_cleanup(&r);
    return rc;
}
